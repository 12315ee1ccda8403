// Host entry points of the intranode kernels: each picks the template instantiation for the call's
// modes (with_constants, src/kernels/common/static_switch.hpp) and launches it on `stream` with the
// grid of the kernel's launch contract (src/kernels/intranode/*.cuh). The instantiations live in two
// translation units (dispatch_kernels.cu, combine_kernels.cu) that compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "kernels/intranode/params.cuh"
#include "transport/nvlink_team.cuh"

namespace elasticep::detail::cuda {

using Team = transport::NvlinkTeam;
using DispatchParams = kernels::DispatchParams<Team>;
using CombineParams = kernels::CombineParams<Team>;

// The templated arguments of one dispatch.
struct DispatchModes {
    kernels::SendPayload payload;
    bool idx64;       // topk_idx is int64
    bool contiguous;  // expert-contiguous layout (else masked)
};

void launch_plan(const DispatchParams& p, const DispatchModes& modes, cudaStream_t stream);
void launch_send(const DispatchParams& p, const DispatchModes& modes, int grid, cudaStream_t stream);
void launch_exchange(const DispatchParams& p, const DispatchModes& modes, cudaStream_t stream);
void launch_expand(const DispatchParams& p, const DispatchModes& modes, int grid, cudaStream_t stream);

void launch_partial(const CombineParams& p, bool weighted, int grid, cudaStream_t stream);
void launch_publish(const CombineParams& p, cudaStream_t stream);
void launch_reduce(const CombineParams& p, bool bias, int grid, cudaStream_t stream);

// Loads every instantiation now (cudaFuncGetAttributes): CUDA's lazy loading mid-protocol could
// stall a context while peers spin on this rank.
void load_dispatch_kernels();
void load_combine_kernels();

}  // namespace elasticep::detail::cuda
