// The direct-path kernels' instantiations and launchers (kernel_launch.hpp).
#include <algorithm>

#include "backends/cuda/kernel_launch.hpp"
#include "backends/cuda/programmatic_launch.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/intranode/direct.cuh"

namespace elasticep::detail::cuda {

using kernels::BoolChoice;
using kernels::SendPayloadChoice;
using kernels::with_constants;

namespace {

// The largest dynamic shared memory a direct dispatch asks for (kDirectMaxExperts, the tables' staged
// rows: larger than a full plan chunk there).
constexpr int kDirectMaxSmem =
    kernels::direct_dispatch_smem_bytes(kernels::kDirectMaxExperts, kernels::kDirectMaxRanks, 1 << 30);

int smem_of(const DispatchParams& p) {
    return kernels::direct_dispatch_smem_bytes(p.shape.num_experts, p.shape.num_ranks, p.num_tokens);
}

}  // namespace

void launch_direct_dispatch(const DispatchParams& p, const DispatchModes& modes, int grid, bool after_first,
                            cudaStream_t stream) {
    with_constants(
        [&](auto payload, auto idx64) {
            launch_maybe_programmatic(kernels::direct_dispatch_kernel<Team, payload(), idx64()>, grid,
                                      kernels::kThreads, smem_of(p), after_first, stream, p);
        },
        SendPayloadChoice{modes.payload}, BoolChoice{modes.idx64});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_direct_combine(const CombineParams& p, bool nodes, int grid, bool after_first, cudaStream_t stream) {
    with_constants(
        [&](auto n) {
            launch_maybe_programmatic(kernels::direct_combine_kernel<Team, n()>, grid, kernels::kThreads, 0,
                                      after_first, stream, p);
        },
        BoolChoice{nodes});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

int direct_blocks_per_sm() {
    // the worst case of every instantiation: the grid must be resident whatever the call's modes
    int blocks = 2;
    kernels::for_all_constants(
        [&](auto payload, auto idx64) {
            int b = 0;
            ELASTICEP_CUDA_CALL(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &b, kernels::direct_dispatch_kernel<Team, payload(), idx64()>, kernels::kThreads, kDirectMaxSmem));
            blocks = std::min(blocks, b);
        },
        SendPayloadChoice{}, BoolChoice{});
    kernels::for_all_constants(
        [&](auto n) {
            int b = 0;
            ELASTICEP_CUDA_CALL(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &b, kernels::direct_combine_kernel<Team, n()>, kernels::kThreads, 0));
            blocks = std::min(blocks, b);
        },
        BoolChoice{});
    return std::max(blocks, 1);
}

void load_direct_kernels() {
    cudaFuncAttributes attr{};
    kernels::for_all_constants(
        [&](auto payload, auto idx64) {
            auto* k = kernels::direct_dispatch_kernel<Team, payload(), idx64()>;
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k));
            ELASTICEP_CUDA_CALL(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kDirectMaxSmem));
        },
        SendPayloadChoice{}, BoolChoice{});
    kernels::for_all_constants(
        [&](auto n) { ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, kernels::direct_combine_kernel<Team, n()>)); },
        BoolChoice{});
}

}  // namespace elasticep::detail::cuda
