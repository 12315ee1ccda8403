// Caller-provided dispatch outputs in device memory with guard bytes on both sides, so a test can
// prove a receiver wrote nothing outside them (and, for a call that failed, nothing at all). For the
// gpu and MPI-CUDA test programs (they link the CUDA runtime). No test framework here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/cuda_memory.hpp"
#include "common/scenario.hpp"

namespace eptest {

class DeviceGuarded {
 public:
    static constexpr size_t kGuard = 4096;  // a multiple of 16: the body keeps cudaMalloc's alignment
    static constexpr uint8_t kGuardByte = 0xa5, kFillByte = 0x5a;

    explicit DeviceGuarded(size_t bytes) : bytes_(bytes) {
        cuda_ok(cudaMalloc(&base_, bytes + 2 * kGuard), "cudaMalloc (guarded output)");
        auto* b = static_cast<uint8_t*>(base_);
        cuda_ok(cudaMemset(b, kGuardByte, kGuard), "cudaMemset");
        cuda_ok(cudaMemset(b + kGuard, kFillByte, bytes), "cudaMemset");
        cuda_ok(cudaMemset(b + kGuard + bytes, kGuardByte, kGuard), "cudaMemset");
        // landed before any call's (non-blocking) stream writes next to them
        cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize");
    }
    ~DeviceGuarded() { cudaFree(base_); }
    DeviceGuarded(const DeviceGuarded&) = delete;
    DeviceGuarded& operator=(const DeviceGuarded&) = delete;

    void* data() const { return static_cast<uint8_t*>(base_) + kGuard; }
    // Guards as written (nothing was written next to the output).
    bool guards_intact() const {
        const std::vector<uint8_t> h = download_all();
        for (size_t i = 0; i < kGuard; ++i)
            if (h[i] != kGuardByte || h[kGuard + bytes_ + i] != kGuardByte) return false;
        return true;
    }
    // The body as written (nothing was written into the output).
    bool body_untouched() const {
        const std::vector<uint8_t> h = download_all();
        for (size_t i = 0; i < bytes_; ++i)
            if (h[kGuard + i] != kFillByte) return false;
        return true;
    }

 private:
    std::vector<uint8_t> download_all() const {
        std::vector<uint8_t> h(bytes_ + 2 * kGuard);
        cuda_ok(cudaMemcpy(h.data(), base_, h.size(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H (guarded output)");
        return h;
    }

    void* base_ = nullptr;
    size_t bytes_ = 0;
};

// Every caller-provided output of a bf16 contiguous-layout dispatch (worst-case rows), guarded.
struct GuardedDispatchOutputs {
    std::unique_ptr<DeviceGuarded> x, weights, src, m_indices;
    DispatchOutputs refs;
    bool guards_intact() const {
        return x->guards_intact() && weights->guards_intact() && src->guards_intact() && m_indices->guards_intact();
    }
    bool bodies_untouched() const {
        return x->body_untouched() && weights->body_untouched() && src->body_untouched() && m_indices->body_untouched();
    }
};

inline std::unique_ptr<GuardedDispatchOutputs> guarded_dispatch_outputs(const Scenario& sc, int device) {
    const int64_t rows = worst_case_rows(sc), h = sc.cfg.hidden;
    const Device dev{DeviceType::kCUDA, device};
    auto o = std::make_unique<GuardedDispatchOutputs>();
    o->x = std::make_unique<DeviceGuarded>(static_cast<size_t>(rows * h * 2));
    o->weights = std::make_unique<DeviceGuarded>(static_cast<size_t>(rows * 4));
    o->src = std::make_unique<DeviceGuarded>(static_cast<size_t>(rows * 4));
    o->m_indices = std::make_unique<DeviceGuarded>(static_cast<size_t>(rows * 4));
    o->refs.recv_x = TensorRef::contiguous(o->x->data(), DType::kBFloat16, {rows, h}, dev);
    o->refs.recv_weights = TensorRef::contiguous(o->weights->data(), DType::kFloat32, {rows}, dev);
    o->refs.recv_src = TensorRef::contiguous(o->src->data(), DType::kInt32, {rows}, dev);
    o->refs.m_indices = TensorRef::contiguous(o->m_indices->data(), DType::kInt32, {rows}, dev);
    return o;
}

// A device dispatch result read back to the host and observed (the oracle's canonical form).
inline Observed observe_device(const DispatchResult& r, const BufferConfig& cfg) {
    std::vector<std::vector<uint8_t>> keep;
    const CopyToHost copy = [](void* dst, const void* src, size_t n) {
        cuda_ok(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    };
    return observe(to_host(r, copy, keep), cfg);
}

}  // namespace eptest
