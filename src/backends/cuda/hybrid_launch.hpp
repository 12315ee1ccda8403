// Host entry points of the hybrid kernels (src/kernels/hybrid/*.cuh): each picks the instantiation for
// the call's modes and launches it on `stream` with the grid of the kernel's launch contract. The
// instantiations live in hybrid_dispatch_kernels.cu and hybrid_combine_kernels.cu.
#pragma once

#include <cuda_runtime.h>

#include "kernels/hybrid/params.cuh"

namespace elasticep::detail::cuda::hybrid {

using kernels::hybrid::CombineParams;
using kernels::hybrid::DispatchParams;
using kernels::hybrid::Params;
using kernels::hybrid::RailPayload;
using kernels::hybrid::WaitSpec;

struct Modes {
    RailPayload payload;
    bool idx64;
    bool contiguous;
};

void launch_plan(const DispatchParams& p, const Modes& m, cudaStream_t stream);
void launch_header(const DispatchParams& p, const Modes& m, cudaStream_t stream);
void launch_pack(const DispatchParams& p, const Modes& m, int grid, cudaStream_t stream);
void launch_forward(const DispatchParams& p, int grid, cudaStream_t stream);
void launch_forward_publish(const DispatchParams& p, cudaStream_t stream);
void launch_exchange(const DispatchParams& p, cudaStream_t stream);
void launch_expand(const DispatchParams& p, const Modes& m, int grid, cudaStream_t stream);
void launch_wait(const Params& p, const WaitSpec& w, cudaStream_t stream);

void launch_partial(const CombineParams& p, bool weighted, int grid, cudaStream_t stream);
void launch_comb_publish(const CombineParams& p, cudaStream_t stream);
void launch_node_reduce(const CombineParams& p, int grid, cudaStream_t stream);
void launch_reduce(const CombineParams& p, bool bias, bool nodes, int grid, cudaStream_t stream);

// Loads every instantiation now: lazy loading mid-protocol could stall a context while peers spin.
void load_dispatch_kernels();
void load_combine_kernels();

}  // namespace elasticep::detail::cuda::hybrid
