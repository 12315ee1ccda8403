// Makes a CUDA device current for one library call and gives the caller's back afterwards, as NCCL's
// calls and PyTorch's device guards do: a buffer's calls (dispatch, combine, check, expert load) and
// the serving kernels never leave the calling thread on another device. (Creating a CUDA buffer
// still leaves its device current, as it always has.)
// When the device is already current (the common case: one rank per thread), it costs one
// cudaGetDevice and sets nothing (cudaSetDevice takes the context's lock: 0.7 us a call from 8
// threads of one process, docs/PERFORMANCE.md, run 58).
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/cuda_check.hpp"

namespace elasticep::detail::cuda {

class DeviceScope {
 public:
    explicit DeviceScope(int device) {
        ELASTICEP_CUDA_CALL(cudaGetDevice(&prev_));
        if (device != prev_) {
            ELASTICEP_CUDA_CALL(cudaSetDevice(device));
            switched_ = true;
        }
    }
    ~DeviceScope() {
        if (switched_) cudaSetDevice(prev_);
    }
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;

 private:
    int prev_ = 0;
    bool switched_ = false;
};

}  // namespace elasticep::detail::cuda
