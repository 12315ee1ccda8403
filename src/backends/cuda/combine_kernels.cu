// The combine kernels' instantiations and launchers (kernel_launch.hpp).
#include "backends/cuda/kernel_launch.hpp"
#include "backends/cuda/programmatic_launch.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/intranode/combine.cuh"

namespace elasticep::detail::cuda {

using kernels::BoolChoice;
using kernels::with_constants;

void launch_partial(const CombineParams& p, bool weighted, int grid, cudaStream_t stream) {
    with_constants(
        [&](auto w) { launch_programmatic(kernels::partial_kernel<Team, w()>, grid, kernels::kThreads, stream, p); },
        BoolChoice{weighted});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_publish(const CombineParams& p, cudaStream_t stream) {
    launch_programmatic(kernels::publish_kernel<Team>, 1, kernels::kPublishThreads, stream, p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_reduce(const CombineParams& p, bool bias, bool nodes, int grid, cudaStream_t stream) {
    with_constants(
        [&](auto b, auto n) {
            launch_programmatic(kernels::reduce_kernel<Team, b(), n()>, grid, kernels::kThreads, stream, p);
        },
        BoolChoice{bias}, BoolChoice{nodes});
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void launch_reduce(const CombineParams& p, bool bias, int grid, cudaStream_t stream) {
    launch_reduce(p, bias, p.shape.node_level(), grid, stream);
}

void load_combine_kernels() {
    cudaFuncAttributes attr{};
    ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, kernels::publish_kernel<Team>));
    kernels::for_all_constants(
        [&](auto flag) { ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, kernels::partial_kernel<Team, flag()>)); },
        BoolChoice{});
    kernels::for_all_constants(
        [&](auto b, auto n) {
            ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, kernels::reduce_kernel<Team, b(), n()>));
        },
        BoolChoice{}, BoolChoice{});
}

}  // namespace elasticep::detail::cuda
