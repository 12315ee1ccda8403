// The hybrid combine kernels' instantiations and launchers (hybrid_launch.hpp).
#include "backends/cuda/hybrid_launch.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/common/static_switch.hpp"
#include "kernels/hybrid/combine.cuh"

namespace elasticep::detail::cuda::hybrid {

namespace k = kernels::hybrid;
using kernels::BoolChoice;
using kernels::with_constants;

void launch_partial(const CombineParams& p, bool weighted, int grid, cudaStream_t stream) {
    with_constants([&](auto w) { k::partial_kernel<w()><<<grid, kernels::kThreads, 0, stream>>>(p); },
                   BoolChoice{weighted});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_comb_publish(const CombineParams& p, cudaStream_t stream) {
    k::comb_publish_kernel<<<1, 32, 0, stream>>>(p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_node_reduce(const CombineParams& p, int grid, cudaStream_t stream) {
    k::node_reduce_kernel<<<grid, kernels::kThreads, 0, stream>>>(p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_reduce(const CombineParams& p, bool bias, bool nodes, int grid, cudaStream_t stream) {
    with_constants([&](auto b, auto n) { k::reduce_kernel<b(), n()><<<grid, kernels::kThreads, 0, stream>>>(p); },
                   BoolChoice{bias}, BoolChoice{nodes});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void load_combine_kernels() {
    cudaFuncAttributes attr{};
    ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::comb_publish_kernel));
    ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::node_reduce_kernel));
    kernels::for_all_constants(
        [&](auto w) { ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::partial_kernel<w()>)); }, BoolChoice{});
    kernels::for_all_constants(
        [&](auto b, auto n) { ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, k::reduce_kernel<b(), n()>)); },
        BoolChoice{}, BoolChoice{});
}

}  // namespace elasticep::detail::cuda::hybrid
