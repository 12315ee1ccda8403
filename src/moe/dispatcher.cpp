// The phase-aware dispatcher (serving.hpp, part 3): the layout per inference phase, the one
// outstanding handle, expected_m, and where the route weights are applied.
#include <string>

#include "core/check.hpp"
#include "elasticep/serving.hpp"

namespace elasticep {

const char* phase_name(Phase p) {
    switch (p) {
        case Phase::kDecode:
            return "decode";
        case Phase::kPrefill:
            return "prefill";
        case Phase::kExtend:
            return "extend";
    }
    return "?";
}

Phase parse_phase(const std::string& s) {
    if (s == "decode") return Phase::kDecode;
    if (s == "prefill") return Phase::kPrefill;
    if (s == "extend") return Phase::kExtend;
    ELASTICEP_CHECK_ARG(false, "unknown phase '", s, "'; choose decode, prefill or extend");
    return Phase::kDecode;
}

const char* weight_placement_name(WeightPlacement w) { return w == WeightPlacement::kCombine ? "combine" : "adapter"; }

WeightPlacement parse_weight_placement(const std::string& s) {
    if (s == "combine") return WeightPlacement::kCombine;
    if (s == "adapter") return WeightPlacement::kAdapter;
    ELASTICEP_CHECK_ARG(false, "unknown weight placement '", s, "'; choose combine or adapter");
    return WeightPlacement::kCombine;
}

MoeDispatcher::MoeDispatcher(std::shared_ptr<Buffer> buffer, DispatcherOptions options)
    : buffer_(std::move(buffer)), options_(options) {
    ELASTICEP_CHECK_ARG(buffer_ != nullptr, "MoeDispatcher: buffer is null");
    ELASTICEP_CHECK_ARG(options_.expert_alignment >= 1 && options_.expert_alignment <= (1 << 16),
                        "MoeDispatcher: expert_alignment=", options_.expert_alignment,
                        " must be in [1, 65536] (the contiguous GEMM's M block, 128 for DeepGEMM)");
}

int64_t MoeDispatcher::expected_m(int64_t num_tokens, int num_ranks, int num_topk, int num_experts) {
    ELASTICEP_CHECK_ARG(num_experts >= 1, "expected_m: num_experts=", num_experts, " must be positive");
    // DeepEP's low-latency convention (SGLang's deepep dispatchers): the mean rows per expert if
    // every rank sent this rank's batch, rounded up by one; a schedule hint, never a bound.
    const int64_t m = (num_tokens * num_ranks * num_topk + num_experts) / num_experts;
    return m < 1 ? 1 : m;
}

bool MoeDispatcher::pending() const { return handle_.valid(); }

MoeDispatchOutput MoeDispatcher::dispatch(Phase phase, const TensorRef& x, const TensorRef& topk_idx,
                                          const std::optional<TensorRef>& topk_weights, void* stream,
                                          const std::optional<TensorRef>& x_scales) {
    ELASTICEP_CHECK_ARG(!handle_.valid(), "MoeDispatcher.dispatch(", phase_name(phase), "): the previous dispatch (",
                        phase_name(last_phase_),
                        ") was not combined yet; call combine(y) with its expert outputs before the next dispatch");
    ELASTICEP_CHECK_ARG(options_.weight_placement != WeightPlacement::kAdapter || topk_weights.has_value(),
                        "MoeDispatcher.dispatch: weight placement 'adapter' applies recv_weights on the expert side, "
                        "so topk_weights is required");
    const BufferConfig& cfg = buffer_->config();
    const bool fp8 = cfg.payload == Payload::kFP8;
    DispatchArgs a;
    a.x = x;
    a.x_scales = x_scales;
    a.topk_idx = topk_idx;
    a.topk_weights = topk_weights;
    a.zero_padding = options_.zero_padding;
    a.scales_mn_major = fp8 && options_.scales_mn_major;
    a.stream = stream;
    if (phase == Phase::kDecode) {
        a.layout = Layout::kExpertMasked;
        a.host_sync = false;  // masked shapes never depend on data: capturable
    } else {
        a.layout = Layout::kExpertContiguous;
        a.expert_alignment = options_.expert_alignment;
        a.host_sync = true;  // exactly M rows for the contiguous GEMM
    }
    DispatchResult r = buffer_->dispatch(a);

    MoeDispatchOutput o;
    o.phase = phase;
    o.layout = r.layout;
    o.weight_placement = options_.weight_placement;
    o.hidden_states = r.recv_x;
    o.hidden_states_scale = r.recv_scales;
    o.scale_format = cfg.scale_format;
    o.scales_mn_major = a.scales_mn_major;
    o.recv_weights = r.recv_weights;
    o.recv_src = r.recv_src;
    o.counts = r.counts;
    o.num_tokens = x.ndim() >= 1 ? x.size(0) : 0;
    if (phase == Phase::kDecode) {
        o.masked_m = r.masked_m;
        o.max_m = int64_t{buffer_->num_ranks()} * cfg.max_tokens_per_rank;
        o.expected_m = expected_m(o.num_tokens, buffer_->num_ranks(), cfg.num_topk, cfg.num_experts);
    } else {
        o.m_indices = r.m_indices;
        o.offsets = r.offsets;
        o.num_rows = r.num_rows;
        o.expert_alignment = options_.expert_alignment;
    }
    handle_ = std::move(r.handle);
    has_weights_ = topk_weights.has_value();
    last_phase_ = phase;
    return o;
}

TensorRef MoeDispatcher::combine(const TensorRef& y, void* stream, const std::optional<TensorRef>& bias,
                                 const std::optional<TensorRef>& out) {
    ELASTICEP_CHECK_ARG(handle_.valid(),
                        "MoeDispatcher.combine: no dispatch is waiting for its combine (combine "
                        "follows each dispatch exactly once)");
    // Released whatever happens below: a failed combine must not block the next dispatch.
    Handle h = std::move(handle_);
    handle_ = Handle();
    CombineArgs c;
    c.y = y;
    c.weighted = options_.weight_placement == WeightPlacement::kCombine && has_weights_;
    c.bias = bias;
    c.out = out;
    c.stream = stream;
    return buffer_->combine(std::move(h), c).out;
}

}  // namespace elasticep
