#include "backends/cuda/host_records.hpp"

#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "kernels/common/cuda_check.hpp"

namespace elasticep::detail::cuda {
namespace {

std::mutex g_mu;
std::vector<kernels::HostRecord*> g_free;

kernels::HostRecord* acquire() {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_free.empty()) {
        constexpr int kChunk = 64;
        kernels::HostRecord* chunk = nullptr;
        ELASTICEP_CUDA_CALL(cudaHostAlloc(reinterpret_cast<void**>(&chunk), kChunk * sizeof(kernels::HostRecord),
                                          cudaHostAllocMapped | cudaHostAllocPortable));
        for (int i = kChunk - 1; i >= 0; --i) g_free.push_back(chunk + i);
    }
    kernels::HostRecord* r = g_free.back();
    g_free.pop_back();
    std::memset(static_cast<void*>(r), 0, sizeof(kernels::HostRecord));
    return r;
}

void release(kernels::HostRecord* r) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_free.push_back(r);
}

std::map<size_t, std::vector<void*>> g_free_pinned;  // by size class, under g_mu

size_t size_class(size_t bytes) {
    size_t c = 4096;
    while (c < bytes) c *= 2;
    return c;
}

}  // namespace

HostRecordLease::HostRecordLease() : host_(acquire()) {
    try {
        ELASTICEP_CUDA_CALL(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0));
    } catch (...) {
        release(host_);
        throw;
    }
}

HostRecordLease::~HostRecordLease() { release(host_); }

PinnedScratch::PinnedScratch(size_t bytes) : bytes_(size_class(bytes)) {
    std::lock_guard<std::mutex> lock(g_mu);
    std::vector<void*>& free = g_free_pinned[bytes_];
    if (free.empty()) {
        ELASTICEP_CUDA_CALL(cudaHostAlloc(&ptr_, bytes_, cudaHostAllocPortable));
    } else {
        ptr_ = free.back();
        free.pop_back();
    }
}

void PinnedScratch::read_call_state(const uint64_t* epoch_dev, const int32_t* timed_out_dev, cudaStream_t stream,
                                    uint64_t& epoch, int32_t& timed_out) {
    auto* line = static_cast<uint8_t*>(ptr_);
    ELASTICEP_CUDA_CALL(cudaMemcpyAsync(line, epoch_dev, sizeof(uint64_t), cudaMemcpyDeviceToHost, stream));
    ELASTICEP_CUDA_CALL(cudaMemcpyAsync(line + 8, timed_out_dev, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
    std::memcpy(&epoch, line, sizeof(epoch));
    std::memcpy(&timed_out, line + 8, sizeof(timed_out));
}

PinnedScratch::~PinnedScratch() {
    std::lock_guard<std::mutex> lock(g_mu);
    g_free_pinned[bytes_].push_back(ptr_);
}

}  // namespace elasticep::detail::cuda
