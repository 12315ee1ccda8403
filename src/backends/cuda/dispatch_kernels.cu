// The dispatch kernels' instantiations and launchers (kernel_launch.hpp).
#include "backends/cuda/kernel_launch.hpp"
#include "backends/cuda/programmatic_launch.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/intranode/dispatch.cuh"

namespace elasticep::detail::cuda {

using kernels::BoolChoice;
using kernels::SendPayloadChoice;
using kernels::with_constants;

void launch_plan(const DispatchParams& p, const DispatchModes& modes, cudaStream_t stream) {
    const int grid = kernels::plan_grid(p.shape, p.num_tokens).blocks();
    with_constants(
        [&](auto idx64) {
            launch_programmatic(kernels::plan_kernel<Team, idx64()>, grid, kernels::kThreads, stream, p);
        },
        BoolChoice{modes.idx64});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_send(const DispatchParams& p, const DispatchModes& modes, int grid, cudaStream_t stream) {
    with_constants(
        [&](auto payload, auto idx64) {
            launch_programmatic(kernels::send_kernel<Team, payload(), idx64()>, grid, kernels::kThreads, stream, p);
        },
        SendPayloadChoice{modes.payload}, BoolChoice{modes.idx64});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_exchange(const DispatchParams& p, const DispatchModes& modes, cudaStream_t stream) {
    with_constants(
        [&](auto idx64) {
            launch_programmatic(kernels::exchange_kernel<Team, idx64()>, 1, kernels::kExchangeThreads, stream, p);
        },
        BoolChoice{modes.idx64});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_expand(const DispatchParams& p, const DispatchModes& modes, int grid, cudaStream_t stream) {
    with_constants(
        [&](auto fp8, auto contiguous) {
            launch_programmatic(kernels::expand_kernel<Team, fp8(), contiguous()>, grid, kernels::kThreads, stream, p);
        },
        BoolChoice{kernels::payload_is_fp8(modes.payload)}, BoolChoice{modes.contiguous});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_round(const DispatchParams& p, cudaStream_t stream) {
    launch_programmatic(kernels::round_kernel<Team>, 1, kWarpSize, stream, p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void load_dispatch_kernels() {
    cudaFuncAttributes attr{};
    ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, kernels::round_kernel<Team>));
    kernels::for_all_constants(
        [&](auto idx64) {
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, kernels::plan_kernel<Team, idx64()>));
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, kernels::exchange_kernel<Team, idx64()>));
        },
        BoolChoice{});
    kernels::for_all_constants(
        [&](auto payload, auto idx64) {
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, kernels::send_kernel<Team, payload(), idx64()>));
        },
        SendPayloadChoice{}, BoolChoice{});
    kernels::for_all_constants(
        [&](auto fp8, auto contiguous) {
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, kernels::expand_kernel<Team, fp8(), contiguous()>));
        },
        BoolChoice{}, BoolChoice{});
}

}  // namespace elasticep::detail::cuda
