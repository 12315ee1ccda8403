// Host-side CUDA helpers shared by every CUDA translation unit of the library (the intranode
// backend, the serving kernels, the scale-out transports): the error macro that turns a failed
// runtime call into elasticep::Error(kCuda) naming the call.
#pragma once

#include <cuda_runtime.h>

#include "core/check.hpp"

#define ELASTICEP_CUDA_CALL(expr)                                                                  \
    do {                                                                                           \
        const cudaError_t elasticep_err_ = (expr);                                                 \
        if (elasticep_err_ != cudaSuccess)                                                         \
            ::elasticep::detail::raise(                                                            \
                ::elasticep::ErrorCode::kCuda,                                                     \
                ::elasticep::detail::cat(#expr, " failed: ", cudaGetErrorString(elasticep_err_))); \
    } while (0)

// The last launch's error, as ELASTICEP_CUDA_CALL reports it.
#define ELASTICEP_CUDA_CHECK_LAUNCH() ELASTICEP_CUDA_CALL(cudaGetLastError())
