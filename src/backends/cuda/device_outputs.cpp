#include "backends/cuda/device_outputs.hpp"

#include <chrono>
#include <cstdio>

#include "core/check.hpp"
#include "core/outputs.hpp"
#include "kernels/common/cuda_check.hpp"

namespace elasticep::detail::cuda {
namespace {

// Warns on stderr when a host-side CUDA call of the protocol took long: with several ranks on one
// GPU that is the sign of a call that waited for a peer's kernel (see cuda_backend.cu).
class SlowCallWatch {
 public:
    SlowCallWatch(const char* what, int rank) : what_(what), rank_(rank), t0_(std::chrono::steady_clock::now()) {}
    ~SlowCallWatch() {
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0_).count();
        if (ms >= 1000)
            std::fprintf(stderr, "[elasticep] rank %d: %s took %lld ms (did it wait for a peer's kernel?)\n", rank_,
                         what_, static_cast<long long>(ms));
    }

 private:
    const char* what_;
    int rank_;
    std::chrono::steady_clock::time_point t0_;
};

}  // namespace

DeviceOutputs::DeviceOutputs(const BufferConfig& config, int num_ranks, int rank, int device, cudaStream_t stream)
    : config_(config), num_ranks_(num_ranks), rank_(rank), device_(device), stream_(stream) {
    combine_out_ = transport::pool_alloc(
        static_cast<size_t>(config.max_tokens_per_rank) * static_cast<size_t>(config.hidden) * 2, device, stream);
}

DeviceOutputs::~DeviceOutputs() {
    for (void* p : graveyard_) cudaFreeAsync(p, stream_);
    for (transport::GrowingBlock* b : {&x_, &scales_, &weights_, &src_, &m_indices_})
        if (b->ptr) cudaFreeAsync(b->ptr, stream_);
    if (combine_out_) cudaFreeAsync(combine_out_, stream_);
    cudaGetLastError();
}

DispatchTargets DeviceOutputs::dispatch_targets(const DispatchArgs& a, int64_t rows_cap, bool capturing,
                                                cudaStream_t stream) {
    const auto cap = dispatch_output_specs(config_, num_ranks_, a.layout, rows_cap, a.scales_mn_major);
    auto ptr_of = [&](const std::optional<TensorRef>& given, const OutputSpec& spec,
                      transport::GrowingBlock& block) -> void* {
        if (given) {
            ELASTICEP_CHECK_ARG(reinterpret_cast<uintptr_t>(given->data) % 16 == 0,
                                "caller-provided dispatch output at ", given->data,
                                " must be 16-byte aligned for the CUDA backend");
            return given->data;
        }
        const size_t need = static_cast<size_t>(spec.storage_elems) * dtype_size(spec.dtype);
        if (need > block.bytes) {
            ELASTICEP_CHECK_ARG(!capturing, "dispatch: the first call with this layout (", layout_name(a.layout),
                                ", expert_alignment ", a.expert_alignment,
                                ") allocates the buffer-owned outputs and cannot be captured; run it once before "
                                "capturing the graph");
            SlowCallWatch watch("allocating buffer-owned dispatch outputs", rank_);
            block.reserve(need, device_, stream, graveyard_);
        }
        return block.ptr;
    };
    DispatchTargets t;
    t.recv_x = static_cast<uint8_t*>(ptr_of(a.outputs.recv_x, cap.recv_x, x_));
    t.recv_weights = static_cast<float*>(ptr_of(a.outputs.recv_weights, cap.recv_weights, weights_));
    t.recv_src = static_cast<int32_t*>(ptr_of(a.outputs.recv_src, cap.recv_src, src_));
    if (cap.recv_scales)
        t.recv_scales = static_cast<uint32_t*>(ptr_of(a.outputs.recv_scales, *cap.recv_scales, scales_));
    if (cap.m_indices) t.m_indices = static_cast<int32_t*>(ptr_of(a.outputs.m_indices, *cap.m_indices, m_indices_));
    return t;
}

void DeviceOutputs::bind_dispatch(const DispatchArgs& a, const DispatchTargets& t, int64_t rows_cap, int64_t rows,
                                  DispatchResult& result) const {
    const auto cap = dispatch_output_specs(config_, num_ranks_, a.layout, rows_cap, a.scales_mn_major);
    const auto specs = dispatch_output_specs(config_, num_ranks_, a.layout, rows, a.scales_mn_major);
    const Device dev{DeviceType::kCUDA, device_};
    auto bind = [&](const std::optional<TensorRef>& given, const OutputSpec& cap_spec, const OutputSpec& spec,
                    void* ptr) {
        TensorRef r = spec.bind(ptr, dev);
        if (given) r.strides = cap_spec.strides;
        return r;
    };
    result.recv_x = bind(a.outputs.recv_x, cap.recv_x, specs.recv_x, t.recv_x);
    result.recv_weights = bind(a.outputs.recv_weights, cap.recv_weights, specs.recv_weights, t.recv_weights);
    result.recv_src = bind(a.outputs.recv_src, cap.recv_src, specs.recv_src, t.recv_src);
    if (specs.recv_scales)
        result.recv_scales = bind(a.outputs.recv_scales, *cap.recv_scales, *specs.recv_scales, t.recv_scales);
    if (specs.m_indices) result.m_indices = bind(a.outputs.m_indices, *cap.m_indices, *specs.m_indices, t.m_indices);
}

TensorRef DeviceOutputs::combine_out(const CombineArgs& args, int64_t num_tokens) const {
    if (args.out) return *args.out;
    return TensorRef::contiguous(combine_out_, DType::kBFloat16, {num_tokens, config_.hidden},
                                 Device{DeviceType::kCUDA, device_});
}

std::vector<int64_t> read_expert_load(const int64_t* counts, int num_local_experts) {
    std::vector<int64_t> v(static_cast<size_t>(num_local_experts));
    ELASTICEP_CUDA_CALL(cudaMemcpy(v.data(), counts, v.size() * sizeof(v[0]), cudaMemcpyDeviceToHost));
    return v;
}

void clear_expert_load(int64_t* counts, int num_local_experts, cudaStream_t stream) {
    // on the buffer's stream and waited for: a cudaMemset on the legacy stream would be asynchronous
    // and unordered with the next call's (non-blocking) stream
    ELASTICEP_CUDA_CALL(cudaMemsetAsync(counts, 0, static_cast<size_t>(num_local_experts) * sizeof(int64_t), stream));
    ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
}

}  // namespace elasticep::detail::cuda
