#include "transport/symmetric_memory.hpp"

#include <unistd.h>

#include <cstring>
#include <string>

#include "core/check.hpp"
#include "kernels/common/cuda_check.hpp"
#include "transport/device_pool.hpp"

namespace elasticep::transport {
namespace {

struct Where {
    int64_t pid;
    int32_t device;
    int32_t ready;  // 0: this rank failed before the exchange
    char uuid[16];
};

struct Hello {
    int64_t pid;
    int32_t device;
    int32_t ready;
    uint64_t window;
    cudaIpcMemHandle_t ipc;
};

bool same_gpu(const Where& a, const Where& b) { return std::memcmp(a.uuid, b.uuid, 16) == 0; }

// After an exchange: this rank's own error first, else Internal naming the ranks that were not ready.
template <class T>
void agree(const std::vector<T>& all, const std::exception_ptr& mine, const char* step) {
    if (mine) std::rethrow_exception(mine);
    std::string failed;
    for (size_t q = 0; q < all.size(); ++q)
        if (!all[q].ready) failed += (failed.empty() ? "" : ", ") + std::to_string(q);
    ELASTICEP_CHECK(failed.empty(), ErrorCode::kInternal, "CUDA backend: rank(s) ", failed, " failed ", step,
                    " (see the error raised there)");
}

}  // namespace

Placement Placement::gather(Group& group, int rank, int device, std::exception_ptr failure) {
    Where me{};
    me.pid = static_cast<int64_t>(::getpid());
    me.device = device;
    if (!failure) {
        try {
            cudaDeviceProp prop{};
            ELASTICEP_CUDA_CALL(cudaGetDeviceProperties(&prop, device));
            std::memcpy(me.uuid, &prop.uuid, 16);
        } catch (...) {
            failure = std::current_exception();
        }
    }
    me.ready = failure ? 0 : 1;
    const auto all = group.all_gather_value(me);
    agree(all, failure, "to start its buffer");
    Placement p;
    p.rank = rank;
    p.num_ranks = static_cast<int>(all.size());
    p.device = device;
    p.ranks_on_my_gpu = 0;
    for (const Where& w : all) {
        p.ranks_on_my_gpu += same_gpu(w, me);
        p.remote_gpu = p.remote_gpu || !same_gpu(w, me);
        p.one_process = p.one_process && w.pid == me.pid;
    }
    for (size_t i = 0; i < all.size(); ++i)
        for (size_t j = i + 1; j < all.size(); ++j)
            p.shared_gpu_in_process = p.shared_gpu_in_process || (all[i].pid == all[j].pid && same_gpu(all[i], all[j]));
    return p;
}

SymmetricMemory::SymmetricMemory(Group& group, const Placement& where, size_t bytes, cudaStream_t stream)
    : where_(where), bytes_(bytes), stream_(stream), local_from_pool_(where.one_process) {
    try {
        map(group);
    } catch (...) {
        release();
        throw;
    }
}

void SymmetricMemory::map(Group& group) {
    const Placement& where = where_;
    const size_t bytes = bytes_;
    cudaStream_t stream = stream_;
    const int dev = where.device;
    Hello hello{};
    hello.pid = static_cast<int64_t>(::getpid());
    hello.device = dev;
    std::exception_ptr failure;
    try {  // allocate and export this rank's window; a failure still takes part in the exchange below
        if (local_from_pool_) {
            local_ = static_cast<uint8_t*>(pool_alloc(bytes, dev, stream));
        } else {
            void* p = nullptr;
            ELASTICEP_CUDA_CALL(cudaMalloc(&p, bytes));
            local_ = static_cast<uint8_t*>(p);
        }
        ELASTICEP_CUDA_CALL(cudaMemsetAsync(local_, 0, bytes, stream));
        device_windows_ =
            static_cast<uint8_t**>(pool_alloc(static_cast<size_t>(where.num_ranks) * sizeof(uint8_t*), dev, stream));
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
        hello.window = reinterpret_cast<uint64_t>(local_);
        if (!local_from_pool_) ELASTICEP_CUDA_CALL(cudaIpcGetMemHandle(&hello.ipc, local_));
    } catch (...) {
        failure = std::current_exception();
    }
    hello.ready = failure ? 0 : 1;
    const auto all = group.all_gather_value(hello);
    agree(all, failure, "to allocate its receive window");
    windows_.assign(all.size(), nullptr);
    for (size_t q = 0; q < all.size(); ++q) {
        const Hello& h = all[q];
        if (h.pid != hello.pid) {
            void* mapped = nullptr;
            ELASTICEP_CUDA_CALL(cudaIpcOpenMemHandle(&mapped, h.ipc, cudaIpcMemLazyEnablePeerAccess));
            opened_.push_back(mapped);
            windows_[q] = static_cast<uint8_t*>(mapped);
            continue;
        }
        windows_[q] = reinterpret_cast<uint8_t*>(h.window);
        if (h.device == dev) continue;
        int can = 0;
        ELASTICEP_CUDA_CALL(cudaDeviceCanAccessPeer(&can, dev, h.device));
        ELASTICEP_CHECK(can, ErrorCode::kUnsupported, "rank ", where.rank, " on GPU ", dev, " cannot access GPU ",
                        h.device, " of rank ", q,
                        " (no peer access); the direct topology needs NVLink or PCIe peer access between all "
                        "ranks' GPUs");
        if (!local_from_pool_) {  // pool memory is reachable through the pool's access list
            const cudaError_t e = cudaDeviceEnablePeerAccess(h.device, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled)
                cudaGetLastError();
            else
                ELASTICEP_CUDA_CALL(e);
        }
    }
    ELASTICEP_CUDA_CALL(cudaMemcpyAsync(device_windows_, windows_.data(), windows_.size() * sizeof(uint8_t*),
                                        cudaMemcpyHostToDevice, stream));
    ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
}

SymmetricMemory::~SymmetricMemory() { release(); }

void SymmetricMemory::release() {
    // Nothing here waits for the whole device (device_pool.hpp): peers of this process may already
    // run kernels of their next buffer. The caller has synchronised its own streams.
    for (void* p : opened_) cudaIpcCloseMemHandle(p);
    opened_.clear();
    if (device_windows_) cudaFreeAsync(device_windows_, stream_);
    device_windows_ = nullptr;
    if (local_ && !keep_local_) {
        if (local_from_pool_)
            cudaFreeAsync(local_, stream_);
        else
            cudaFree(local_);  // IPC-exported; other processes' ranks do not wait for this one
    }
    local_ = nullptr;
    cudaGetLastError();
}

NvlinkWindows SymmetricMemory::nvlink_windows() const {
    return NvlinkWindows{where_.rank, where_.num_ranks, device_windows_, local_};
}

}  // namespace elasticep::transport
