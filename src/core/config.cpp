#include "elasticep/config.hpp"

#include <limits>

#include "core/check.hpp"
#include "core/layout.hpp"
#include "core/limits.hpp"

namespace elasticep {

const char* payload_name(Payload p) { return p == Payload::kBF16 ? "bf16" : "fp8"; }

const char* scale_format_name(ScaleFormat f) {
    switch (f) {
        case ScaleFormat::kF32G128:
            return "f32_g128";
        case ScaleFormat::kUE8M0G128:
            return "ue8m0_g128";
        case ScaleFormat::kUE8M0G32:
            return "ue8m0_g32";
    }
    return "?";
}

const char* topology_name(Topology t) { return t == Topology::kDirect ? "direct" : "hybrid"; }
const char* layout_name(Layout l) { return l == Layout::kExpertContiguous ? "contiguous" : "masked"; }

const char* scaleout_name(ScaleOut s) {
    switch (s) {
        case ScaleOut::kAuto:
            return "auto";
        case ScaleOut::kGin:
            return "gin";
        case ScaleOut::kNccl:
            return "nccl";
        case ScaleOut::kEmulated:
            return "emulated";
    }
    return "?";
}

const char* backend_name(BackendKind b) {
    switch (b) {
        case BackendKind::kAuto:
            return "auto";
        case BackendKind::kCPU:
            return "cpu";
        case BackendKind::kCUDA:
            return "cuda";
    }
    return "?";
}

namespace {
template <class E, size_t N>
E parse_enum(const std::string& s, const char* what, const E (&values)[N], const char* (*name)(E)) {
    std::string choices;
    for (E v : values) {
        if (s == name(v)) return v;
        choices += choices.empty() ? "" : ", ";
        choices += name(v);
    }
    detail::raise(ErrorCode::kInvalidArgument, detail::cat("unknown ", what, " '", s, "'; choose one of: ", choices));
}
}  // namespace

Payload parse_payload(const std::string& s) {
    static constexpr Payload kAll[] = {Payload::kBF16, Payload::kFP8};
    return parse_enum(s, "payload", kAll, payload_name);
}
ScaleFormat parse_scale_format(const std::string& s) {
    static constexpr ScaleFormat kAll[] = {ScaleFormat::kF32G128, ScaleFormat::kUE8M0G128, ScaleFormat::kUE8M0G32};
    return parse_enum(s, "scale format", kAll, scale_format_name);
}
Topology parse_topology(const std::string& s) {
    static constexpr Topology kAll[] = {Topology::kDirect, Topology::kHybrid};
    return parse_enum(s, "topology", kAll, topology_name);
}
Layout parse_layout(const std::string& s) {
    static constexpr Layout kAll[] = {Layout::kExpertContiguous, Layout::kExpertMasked};
    return parse_enum(s, "layout", kAll, layout_name);
}
ScaleOut parse_scaleout(const std::string& s) {
    static constexpr ScaleOut kAll[] = {ScaleOut::kAuto, ScaleOut::kGin, ScaleOut::kNccl, ScaleOut::kEmulated};
    return parse_enum(s, "scaleout", kAll, scaleout_name);
}
BackendKind parse_backend(const std::string& s) {
    static constexpr BackendKind kAll[] = {BackendKind::kAuto, BackendKind::kCPU, BackendKind::kCUDA};
    return parse_enum(s, "backend", kAll, backend_name);
}

int scale_group_size(ScaleFormat f) { return f == ScaleFormat::kUE8M0G32 ? 32 : 128; }

namespace {
bool valid_scale_format(ScaleFormat f) {
    return f == ScaleFormat::kF32G128 || f == ScaleFormat::kUE8M0G128 || f == ScaleFormat::kUE8M0G32;
}
}  // namespace

int scale_columns(ScaleFormat f, int hidden) {
    ELASTICEP_CHECK_ARG(valid_scale_format(f), "scale_columns: scale format ", static_cast<int>(f),
                        " is not a ScaleFormat (f32_g128, ue8m0_g128, ue8m0_g32)");
    ELASTICEP_CHECK_ARG(hidden >= 1 && hidden <= kMaxHidden, "scale_columns: hidden=", hidden, " must be in [1, ",
                        kMaxHidden, "]");
    const int groups = static_cast<int>(ceil_div(hidden, scale_group_size(f)));
    return f == ScaleFormat::kF32G128 ? groups : static_cast<int>(ceil_div(groups, 4));
}

void validate_timeout(std::chrono::milliseconds timeout, const char* what) {
    ELASTICEP_CHECK_ARG(timeout.count() > 0, what, "=", timeout.count(), " ms must be positive (at least 1 ms)");
    ELASTICEP_CHECK_ARG(timeout <= kMaxTimeout, what, "=", timeout.count(), " ms is above the limit of ",
                        kMaxTimeout.count(),
                        " ms (7 days); every wait on a peer is bounded: pass a finite timeout of "
                        "at most 7 days");
}

void BufferConfig::validate(int num_ranks) const {
    using detail::cat;
    ELASTICEP_CHECK_ARG(num_ranks >= 1, "the group has ", num_ranks, " ranks; need at least 1");
    ELASTICEP_CHECK(num_ranks <= kMaxRanks, ErrorCode::kUnsupported, "the group has ", num_ranks,
                    " ranks; ElasticEP supports at most kMaxRanks=", kMaxRanks, " ranks per group");
    ELASTICEP_CHECK_ARG(payload == Payload::kBF16 || payload == Payload::kFP8, "payload=", static_cast<int>(payload),
                        " is not a Payload (bf16 or fp8)");
    ELASTICEP_CHECK_ARG(valid_scale_format(scale_format), "scale_format=", static_cast<int>(scale_format),
                        " is not a ScaleFormat (f32_g128, ue8m0_g128 or ue8m0_g32)");
    ELASTICEP_CHECK_ARG(topology == Topology::kDirect || topology == Topology::kHybrid,
                        "topology=", static_cast<int>(topology), " is not a Topology (direct or hybrid)");
    ELASTICEP_CHECK_ARG(num_experts >= 1, "num_experts=", num_experts, " must be positive");
    ELASTICEP_CHECK_ARG(num_experts <= kMaxExperts, "num_experts=", num_experts, " is above the limit of ", kMaxExperts,
                        "; use fewer experts");
    ELASTICEP_CHECK_ARG(num_experts % num_ranks == 0, "num_experts=", num_experts,
                        " must be a multiple of the number of ranks (", num_ranks, ")");
    ELASTICEP_CHECK_ARG(num_topk >= 1 && num_topk <= kMaxTopk, "num_topk=", num_topk, " must be in [1, ", kMaxTopk,
                        "] (kMaxTopk)");
    ELASTICEP_CHECK_ARG(num_topk <= num_experts, "num_topk=", num_topk, " exceeds num_experts=", num_experts,
                        " (a top-k row may not repeat an expert)");
    ELASTICEP_CHECK_ARG(hidden >= 1, "hidden=", hidden, " must be positive");
    ELASTICEP_CHECK_ARG(hidden <= kMaxHidden, "hidden=", hidden, " is above the limit of ", kMaxHidden,
                        " channels (message sizes and offsets are 32-bit); use hidden <= ", kMaxHidden);
    if (payload == Payload::kBF16) {
        ELASTICEP_CHECK_ARG(hidden % 8 == 0, "hidden=", hidden, " must be a multiple of 8 for bf16 payloads");
    } else {
        const int g = scale_group_size(scale_format);
        ELASTICEP_CHECK_ARG(hidden % g == 0, "hidden=", hidden, " must be a multiple of the scale group (", g,
                            ") for fp8 payload with scale format ", scale_format_name(scale_format));
    }
    ELASTICEP_CHECK_ARG(max_tokens_per_rank >= 1, "max_tokens_per_rank=", max_tokens_per_rank,
                        " must be at least 1 (it is the per-rank token capacity reserved in memory)");
    const int64_t slots = int64_t{num_ranks} * max_tokens_per_rank * num_topk;
    ELASTICEP_CHECK_ARG(slots < kMaxRouteSlots, "ranks * max_tokens_per_rank * num_topk = ", slots,
                        " is too large for int32 row indices (limit kMaxRouteSlots=2^30); lower max_tokens_per_rank");
    // The masked slab has E_local * R * C rows (= E * C): its row indices are int32 on every backend.
    const int64_t masked_rows = int64_t{num_experts} * max_tokens_per_rank;
    ELASTICEP_CHECK_ARG(masked_rows < kMaxRows, "num_experts * max_tokens_per_rank = ", masked_rows,
                        " rows of the masked layout (E_local * ranks * max_tokens_per_rank) is too large for int32 "
                        "row indices (limit kMaxRows=2^31); lower max_tokens_per_rank to at most ",
                        (kMaxRows - 1) / num_experts);
    ELASTICEP_CHECK_ARG(num_sms >= 0 && num_sms <= kMaxSms, "num_sms=", num_sms, " must be in [0, ", kMaxSms,
                        "] (0 picks it automatically)");
    validate_timeout(timeout, "timeout");
    ELASTICEP_CHECK_ARG(device >= -1, "device=", device, " must be -1 (the current device) or a device index >= 0");
    ELASTICEP_CHECK_ARG(scaleout == ScaleOut::kAuto || scaleout == ScaleOut::kGin || scaleout == ScaleOut::kNccl ||
                            scaleout == ScaleOut::kEmulated,
                        "scaleout=", static_cast<int>(scaleout), " is not a ScaleOut (auto, gin, nccl or emulated)");
    ELASTICEP_CHECK_ARG(ranks_per_node >= 0 && ranks_per_node <= num_ranks && node_size(num_ranks) >= 1 &&
                            num_ranks % node_size(num_ranks) == 0,
                        "ranks_per_node=", ranks_per_node, " must divide the number of ranks (", num_ranks,
                        "), or be 0 for all ranks in one node");
    ELASTICEP_CHECK_ARG(topology == Topology::kHybrid || scaleout == ScaleOut::kAuto,
                        "scaleout=", scaleout_name(scaleout),
                        " only applies to topology=hybrid (the network hop between nodes); leave it auto for "
                        "topology=direct");
}

std::string BufferConfig::key() const { return detail::cat(group_key(), ".dev", device); }

std::string BufferConfig::group_key() const {
    return detail::cat("E", num_experts, ".K", num_topk, ".H", hidden, ".C", max_tokens_per_rank, ".",
                       payload_name(payload), ".", scale_format_name(scale_format), ".", topology_name(topology),
                       ".rpn", ranks_per_node, ".", scaleout_name(scaleout), ".sms", num_sms, ".t", timeout.count());
}

std::string BufferConfig::describe() const {
    std::string s = detail::cat("num_experts=", num_experts, " num_topk=", num_topk, " hidden=", hidden,
                                " max_tokens_per_rank=", max_tokens_per_rank, " payload=", payload_name(payload));
    if (payload == Payload::kFP8) s += detail::cat(" scale_format=", scale_format_name(scale_format));
    s += detail::cat(" topology=", topology_name(topology));
    if (topology == Topology::kHybrid || ranks_per_node != 0) s += detail::cat(" ranks_per_node=", ranks_per_node);
    if (topology == Topology::kHybrid) s += detail::cat(" scaleout=", scaleout_name(scaleout));
    s += detail::cat(" num_sms=", num_sms, " timeout_ms=", timeout.count());
    return s;
}

}  // namespace elasticep
