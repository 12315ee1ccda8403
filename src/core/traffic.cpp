#include "elasticep/traffic.hpp"

#include <vector>

#include "core/check.hpp"
#include "core/protocol.hpp"

namespace elasticep {
namespace {

int64_t row_payload_bytes(const BufferConfig& c) {
    if (c.payload == Payload::kBF16) return int64_t{c.hidden} * 2;
    return int64_t{c.hidden} + int64_t{scale_columns(c.scale_format, c.hidden)} * 4;
}

}  // namespace

int64_t message_bytes(const BufferConfig& c) { return detail::message_layout(c).bytes; }

Traffic& Traffic::operator+=(const Traffic& o) {
    ELASTICEP_CHECK_ARG(message_bytes == 0 || o.message_bytes == 0 || message_bytes == o.message_bytes,
                        "Traffic: adding counts of different configs (message of ", message_bytes, " and ",
                        o.message_bytes, " bytes)");
    if (message_bytes == 0) {
        message_bytes = o.message_bytes;
        partial_bytes = o.partial_bytes;
    }
    tokens += o.tokens;
    routes += o.routes;
    peer_messages += o.peer_messages;
    local_messages += o.local_messages;
    dispatch_hbm_bytes += o.dispatch_hbm_bytes;
    combine_hbm_bytes += o.combine_hbm_bytes;
    dispatch_min_hbm_bytes += o.dispatch_min_hbm_bytes;
    combine_min_hbm_bytes += o.combine_min_hbm_bytes;
    return *this;
}

Traffic count_traffic(const BufferConfig& config, int num_ranks, int rank, const TensorRef& topk_idx,
                      bool prequantized) {
    config.validate(num_ranks);
    ELASTICEP_CHECK_ARG(rank >= 0 && rank < num_ranks, "count_traffic: rank ", rank, " is outside [0, ", num_ranks,
                        ")");
    ELASTICEP_CHECK_ARG(topk_idx.device.type == DeviceType::kCPU, "count_traffic: topk_idx is ", topk_idx.describe(),
                        "; it reads the ids on the host: pass a host copy");
    ELASTICEP_CHECK_ARG(topk_idx.dtype == DType::kInt32 || topk_idx.dtype == DType::kInt64,
                        "count_traffic: topk_idx is ", topk_idx.describe(), "; want int32 or int64");
    ELASTICEP_CHECK_ARG(topk_idx.ndim() == 2 && topk_idx.size(1) == config.num_topk, "count_traffic: topk_idx is ",
                        topk_idx.describe(), "; want [T, ", config.num_topk, "] (num_topk)");
    const int64_t t_count = topk_idx.size(0);
    const int k = config.num_topk;
    const int e_local = config.num_local_experts(num_ranks);
    ELASTICEP_CHECK_ARG(t_count == 0 || topk_idx.data != nullptr, "count_traffic: topk_idx has no data");

    Traffic tr;
    tr.tokens = t_count;
    tr.message_bytes = message_bytes(config);
    tr.partial_bytes = int64_t{config.hidden} * 2;
    std::vector<int64_t> seen(static_cast<size_t>(num_ranks), -1);  // last token that went to rank d
    for (int64_t t = 0; t < t_count; ++t) {
        for (int j = 0; j < k; ++j) {
            const int64_t at = t * topk_idx.stride(0) + j * topk_idx.stride(1);
            const int64_t x = topk_idx.dtype == DType::kInt64 ? static_cast<const int64_t*>(topk_idx.data)[at]
                                                              : static_cast<const int32_t*>(topk_idx.data)[at];
            ELASTICEP_CHECK_ARG(x >= -1 && x < config.num_experts, "count_traffic: topk_idx[", t, ", ", j, "] = ", x,
                                " is outside [-1, ", config.num_experts, ") (num_experts)");
            if (x < 0) continue;
            ++tr.routes;
            const int d = static_cast<int>(x / e_local);
            if (seen[static_cast<size_t>(d)] == t) continue;
            seen[static_cast<size_t>(d)] = t;
            ++(d == rank ? tr.local_messages : tr.peer_messages);
        }
    }

    const int64_t h = config.hidden;
    const int64_t x_bytes =
        prequantized && config.payload == Payload::kFP8 ? t_count * row_payload_bytes(config) : t_count * h * 2;
    tr.dispatch_hbm_bytes = x_bytes + 2 * tr.messages() * tr.message_bytes + tr.routes * row_payload_bytes(config);
    tr.combine_hbm_bytes = tr.routes * h * 2 + 2 * tr.messages() * tr.partial_bytes + t_count * h * 2;
    tr.dispatch_min_hbm_bytes = x_bytes + tr.routes * row_payload_bytes(config);
    tr.combine_min_hbm_bytes = tr.routes * h * 2 + t_count * h * 2;
    return tr;
}

}  // namespace elasticep
