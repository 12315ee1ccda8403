// Device discovery for `elasticep info` and backend selection.
#include <cuda_runtime.h>
#if defined(ELASTICEP_HAVE_NCCL)  // set by CMake when NCCL was found (cmake/ElasticepNccl.cmake)
#include <nccl.h>
#endif

#include "core/backend.hpp"
#include "elasticep/info.hpp"
#include "elasticep/version.hpp"

namespace elasticep {
namespace detail {

bool cuda_backend_compiled() { return true; }

bool cuda_backend_available() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no device" error
        return false;
    }
    return n > 0;
}

}  // namespace detail

SystemInfo system_info() {
    SystemInfo s;
    s.version = version_string();
    s.backends_compiled = build_backends();
    cudaRuntimeGetVersion(&s.cuda_runtime_version);
    if (cudaDriverGetVersion(&s.cuda_driver_version) != cudaSuccess) s.cuda_driver_version = 0;
#if defined(ELASTICEP_HAVE_NCCL)
    s.nccl_version = NCCL_VERSION_CODE;
#endif
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        s.note = cudaGetErrorString(err);
        cudaGetLastError();
        return s;
    }
    for (int i = 0; i < n; ++i) {
        cudaDeviceProp p{};
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
        s.gpus.push_back(GpuInfo{i, p.name, p.major, p.minor, p.totalGlobalMem, p.multiProcessorCount});
    }
    if (n == 0) s.note = "no CUDA device found";
    return s;
}

}  // namespace elasticep
