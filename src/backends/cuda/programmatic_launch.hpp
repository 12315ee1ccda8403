// Launches of the staged kernels, optionally with programmatic stream serialization (programmatic
// dependent launch, sm_90+): a kernel may then be scheduled while the previous kernel of its stream
// finishes, and waits in kernels::wait_for_previous_grid() (src/kernels/common/primitives.cuh) until
// that grid has completed and its writes are visible. Kernels that wait on no peer let their
// successor be scheduled early (allow_next_grid); the others leave it to their completion. In a CUDA
// graph capture the attribute becomes a programmatic edge.
// Off by default for the staged kernels; ELASTICEP_PROGRAMMATIC_LAUNCH=1 (read once per process) turns it
// on. (The direct path's second launch is programmatic by default, allowed only after its first
// launch's peer wait: src/kernels/intranode/direct.cuh.) Measured on
// one H200 with 8 ranks as threads (docs/PERFORMANCE.md, run 13): 7 % faster decode graph replays at
// T = 128, but isolated replays at T <= 16 stalled for 0.3-3.7 ms (cause not established; a
// likely one: blocks scheduled early hold SMs that other ranks' kernels on the same GPU need). One
// rank per GPU was not measured.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string>
#include <utility>

#include "kernels/common/cuda_check.hpp"

namespace elasticep::detail::cuda {

inline bool programmatic_launch() {
    static const bool on = [] {
        const char* v = std::getenv("ELASTICEP_PROGRAMMATIC_LAUNCH");
        return v && std::string(v) == "1";
    }();
    return on;
}

// Launches `kernel` on `stream`, with programmatic stream serialization when `programmatic`.
template <class... Params, class... Args>
void launch_maybe_programmatic(void (*kernel)(Params...), int grid, int block, int smem_bytes, bool programmatic,
                               cudaStream_t stream, Args&&... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    cfg.blockDim = dim3(static_cast<unsigned>(block));
    cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = programmatic ? 1 : 0;
    ELASTICEP_CUDA_CALL(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// The staged kernels' launches: programmatic when ELASTICEP_PROGRAMMATIC_LAUNCH=1.
template <class... Params, class... Args>
void launch_programmatic(void (*kernel)(Params...), int grid, int block, cudaStream_t stream, Args&&... args) {
    launch_maybe_programmatic(kernel, grid, block, 0, programmatic_launch(), stream, std::forward<Args>(args)...);
}

}  // namespace elasticep::detail::cuda
