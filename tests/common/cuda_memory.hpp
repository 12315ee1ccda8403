// Device memory for the rank runner (TestMemory over cudaMalloc) and the stream its calls use. For
// the gpu and MPI-CUDA test programs only (they link the CUDA runtime). No test framework here.
//
// With several ranks on one GPU a blocking CUDA call (cudaMalloc, pageable cudaMemcpy, cudaFree) must
// never wait behind a kernel that waits for a peer still on its host side: the runner places every
// input before its first collective and reads back only after a barrier that follows the last
// kernel; destroy a CudaMemory only when no peer's kernel can be waiting for this rank.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/rank_round.hpp"

namespace eptest {

inline void cuda_ok(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

class CudaMemory final : public TestMemory {
 public:
    explicit CudaMemory(int device) : device_(device) {
        cuda_ok(cudaSetDevice(device), "cudaSetDevice");
        cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    }
    ~CudaMemory() override {
        cudaSetDevice(device_);
        for (void* p : blocks_) cudaFree(p);
        cudaStreamDestroy(stream_);
    }
    CudaMemory(const CudaMemory&) = delete;
    CudaMemory& operator=(const CudaMemory&) = delete;

    Device device() const override { return Device{DeviceType::kCUDA, device_}; }
    // Both finish before returning, on this memory's stream: a cudaMemcpy from pageable memory may
    // return before its DMA lands and a cudaMemset is asynchronous, both on the legacy stream, which the
    // calls' non-blocking streams (and the peers' kernels reading this rank's tensors) do not wait for.
    void* place(const void* host, size_t bytes) override {
        void* p = alloc(bytes);
        if (bytes) {
            cuda_ok(cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync H2D");
            synchronize();
        }
        return p;
    }
    void* fresh(size_t bytes, uint8_t fill) override {
        void* p = alloc(bytes);
        cuda_ok(cudaMemsetAsync(p, fill, std::max<size_t>(bytes, 16), stream_), "cudaMemsetAsync");
        synchronize();
        return p;
    }
    void copy_to_host(void* dst, const void* src, size_t bytes) override {
        if (bytes) cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    }
    void* stream() const override { return stream_; }
    cudaStream_t cuda_stream() const { return stream_; }
    void synchronize() override { cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

 private:
    void* alloc(size_t bytes) {
        void* p = nullptr;
        cuda_ok(cudaMalloc(&p, std::max<size_t>(bytes, 16)), "cudaMalloc");  // 256-byte aligned
        blocks_.push_back(p);
        return p;
    }

    int device_;
    cudaStream_t stream_ = nullptr;
    std::vector<void*> blocks_;
};

}  // namespace eptest
