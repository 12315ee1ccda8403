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

// staged path (src/kernels/intranode/dispatch.cuh, combine.cuh)
void launch_plan(const DispatchParams& p, const DispatchModes& modes, cudaStream_t stream);
void launch_send(const DispatchParams& p, const DispatchModes& modes, int grid, cudaStream_t stream);
void launch_exchange(const DispatchParams& p, const DispatchModes& modes, cudaStream_t stream);
void launch_expand(const DispatchParams& p, const DispatchModes& modes, int grid, cudaStream_t stream);
void launch_round(const DispatchParams& p, cudaStream_t stream);

void launch_partial(const CombineParams& p, bool weighted, int grid, cudaStream_t stream);
void launch_publish(const CombineParams& p, cudaStream_t stream);
// `nodes`: the node level of the combine order (ranks_per_node < R)
void launch_reduce(const CombineParams& p, bool bias, bool nodes, int grid, cudaStream_t stream);
// the node level from p.shape (ranks_per_node)
void launch_reduce(const CombineParams& p, bool bias, int grid, cudaStream_t stream);

// direct path (src/kernels/intranode/direct.cuh); p.step says which steps run, `grid` is 1 for
// kStepFinish and the combine's kStepPublish and kStepPublishMeet; `after_first`: launched as a
// programmatic dependent of the kernel before it on `stream` (kStepMoveFinish after kStepPublishMeet)
void launch_direct_dispatch(const DispatchParams& p, const DispatchModes& modes, int grid, bool after_first,
                            cudaStream_t stream);
void launch_direct_combine(const CombineParams& p, bool nodes, int grid, bool after_first, cudaStream_t stream);
// Resident blocks per SM of the direct kernels (the occupancy calculator; at most 2): their grid is
// the rank's SM share times this (so that, in the one-kernel variant, every block of every rank can
// wait at once).
int direct_blocks_per_sm();

// Loads every instantiation now (cudaFuncGetAttributes): CUDA's lazy loading mid-protocol could
// stall a context while peers spin on this rank. The direct dispatch kernels also get their dynamic
// shared memory limit raised here.
void load_dispatch_kernels();
void load_combine_kernels();
void load_direct_kernels();

}  // namespace elasticep::detail::cuda
