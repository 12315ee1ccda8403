// The hybrid dispatch kernels' instantiations and launchers (hybrid_launch.hpp).
#include "backends/cuda/hybrid_launch.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/common/static_switch.hpp"
#include "kernels/hybrid/dispatch.cuh"

namespace elasticep::detail::cuda::hybrid {

namespace k = kernels::hybrid;
using kernels::BoolChoice;
using kernels::with_constants;
using PayloadChoice = kernels::Choice<RailPayload, RailPayload::kBF16, RailPayload::kFP8Copy, RailPayload::kFP8F32G128,
                                      RailPayload::kFP8UE8M0G128, RailPayload::kFP8UE8M0G32>;

void launch_plan(const DispatchParams& p, const Modes& m, cudaStream_t stream) {
    const int grid = p.shape.num_experts + p.shape.num_ranks + p.shape.num_nodes + k::kStatusBlocks;
    with_constants([&](auto idx64) { k::plan_kernel<idx64()><<<grid, kernels::kThreads, 0, stream>>>(p); },
                   BoolChoice{m.idx64});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_header(const DispatchParams& p, const Modes& m, cudaStream_t stream) {
    with_constants([&](auto idx64) { k::header_kernel<idx64()><<<1, k::kSmallThreads, 0, stream>>>(p); },
                   BoolChoice{m.idx64});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_pack(const DispatchParams& p, const Modes& m, int grid, cudaStream_t stream) {
    with_constants([&](auto payload,
                       auto idx64) { k::pack_kernel<payload(), idx64()><<<grid, kernels::kThreads, 0, stream>>>(p); },
                   PayloadChoice{m.payload}, BoolChoice{m.idx64});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_forward(const DispatchParams& p, int grid, cudaStream_t stream) {
    k::forward_kernel<<<grid, kernels::kThreads, 0, stream>>>(p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_forward_publish(const DispatchParams& p, cudaStream_t stream) {
    k::forward_publish_kernel<<<1, k::kSmallThreads, 0, stream>>>(p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_exchange(const DispatchParams& p, cudaStream_t stream) {
    k::exchange_kernel<<<1, k::kSmallThreads, 0, stream>>>(p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_expand(const DispatchParams& p, const Modes& m, int grid, cudaStream_t stream) {
    with_constants(
        [&](auto fp8, auto contiguous) {
            k::expand_kernel<fp8(), contiguous()><<<grid, kernels::kThreads, 0, stream>>>(p);
        },
        BoolChoice{k::payload_is_fp8(m.payload)}, BoolChoice{m.contiguous});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_wait(const Params& p, const WaitSpec& w, cudaStream_t stream) {
    k::wait_kernel<<<1, 32, 0, stream>>>(p, w);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void load_dispatch_kernels() {
    cudaFuncAttributes attr{};
    ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::forward_kernel));
    ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::forward_publish_kernel));
    ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::exchange_kernel));
    ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::wait_kernel));
    kernels::for_all_constants(
        [&](auto idx64) {
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::plan_kernel<idx64()>));
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::header_kernel<idx64()>));
        },
        BoolChoice{});
    kernels::for_all_constants(
        [&](auto payload, auto idx64) {
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::pack_kernel<payload(), idx64()>));
        },
        PayloadChoice{}, BoolChoice{});
    kernels::for_all_constants(
        [&](auto fp8, auto contiguous) {
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::expand_kernel<fp8(), contiguous()>));
        },
        BoolChoice{}, BoolChoice{});
}

}  // namespace elasticep::detail::cuda::hybrid
