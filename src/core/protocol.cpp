#include "core/protocol.hpp"

#include "core/check.hpp"

namespace elasticep::detail {

MessageLayout message_layout(const BufferConfig& c) {
    const bool fp8 = c.payload == Payload::kFP8;
    return MessageLayout::make(c.hidden, c.num_topk, fp8 ? 1 : 2, fp8 ? scale_columns(c.scale_format, c.hidden) : 0);
}

Reservation reservation(const BufferConfig& c, int num_ranks) {
    return reservation_of(num_ranks, c.max_tokens_per_rank, c.hidden, message_layout(c).bytes);
}

CudaReservation cuda_reservation(const BufferConfig& c, int num_ranks) {
    return cuda_reservation_of(num_ranks, c.max_tokens_per_rank, c.num_topk, c.hidden, message_layout(c).bytes,
                               kStagingBudgetBytes);
}

std::string describe_bad_route(const RouteStatus& b, int rank, int num_experts) {
    if (b.kind == kRouteOutOfRange)
        return cat("invalid expert id at rank ", rank, ", token ", b.token, ", k=", b.k, ": value ", b.value,
                   " is outside [-1, ", num_experts, ") (-1 means no route)");
    return cat("invalid top-k row at rank ", rank, ", token ", b.token, ", k=", b.k, ": expert id ", b.value,
               " repeats k=", b.dup_of, " (a token may pick each expert once)");
}

std::string sticky_fault_message(const RouteStatus& b, int rank, int num_experts) {
    return "sticky fault from an earlier graph-mode dispatch: " + describe_bad_route(b, rank, num_experts) +
           " (those routes were dropped)";
}

std::string rejected_dispatch_message(const RouteStatus& b, int sender, int num_experts) {
    return cat(
        "dispatch: ", b.sticky ? "sticky fault from an earlier graph-mode dispatch (those routes were dropped): " : "",
        describe_bad_route(b, sender, num_experts), "; no rank published outputs for this call");
}

std::string timeout_message(int32_t phase, int rank, int64_t timeout_ms, const MissingPeers& missing,
                            uint64_t expected) {
    std::string peers;
    const int named = missing.count < kMaxNamedPeers ? missing.count : kMaxNamedPeers;
    for (int i = 0; i < named; ++i) peers += (i ? ", " : "") + std::to_string(missing.named[i]);
    if (missing.count > named) peers += cat(" and ", missing.count - named, " more");
    const char* name = phase_name(phase);
    return cat(name, ": rank ", rank, " waited ", timeout_ms, " ms for rank(s) ", peers, " (expected call #", expected,
               ", last seen #", missing.observed, "); a peer did not call ", name,
               " or is stuck. This buffer is unusable now: rebuild it");
}

std::string hybrid_timeout_message(int32_t phase, int32_t hop, int rank, int64_t timeout_ms,
                                   const MissingPeers& missing, uint64_t expected, int ranks_per_node) {
    std::string peers;
    const int named = missing.count < kMaxNamedPeers ? missing.count : kMaxNamedPeers;
    const int p = ranks_per_node > 0 ? ranks_per_node : 1;
    for (int i = 0; i < named; ++i) peers += cat(i ? ", " : "", missing.named[i], " (node ", missing.named[i] / p, ")");
    if (missing.count > named) peers += cat(" and ", missing.count - named, " more");
    const char* name = phase_name(phase);
    return cat(name, " (", hop_name(hop), " hop): rank ", rank, " (node ", rank / p, ") waited ", timeout_ms,
               " ms for rank(s) ", peers, " (expected call #", expected, ", last seen #", missing.observed,
               "); a peer did not call ", name,
               ", is stuck, or its node is unreachable. This buffer is unusable now: rebuild it");
}

std::string peer_fault_message(const PeerFault& f, int rank) {
    std::string what;
    switch (f.kind) {
        case kPeerCount:
            what = cat("a message count of ", f.value, " (max_tokens_per_rank is ", f.limit, ")");
            break;
        case kPeerExpertCount:
            what = cat("a per-expert route count of ", f.value, " where at most ", f.limit, " fit its messages");
            break;
        case kPeerPosition:
            what = cat("a row position ", f.value, " outside its expert's ", f.limit, " rows");
            break;
        case kPeerExpertId:
            what = cat("an expert id ", f.value, " outside [-1, ", f.limit, ")");
            break;
        case kPeerToken:
            what = cat("a source token ", f.value, " outside [0, ", f.limit, ")");
            break;
        case kPeerSlot:
            what = cat("a combine slot range ending at ", f.value, " beyond the origin's ", f.limit, " slots");
            break;
        case kPeerEpoch:
            what = cat("a network slab of call #", f.value, " where call #", f.limit, " was expected");
            break;
        default:
            what = cat("an unknown fault (kind ", f.kind, ")");
            break;
    }
    return cat(phase_name(f.phase), ": rank ", rank, " received corrupt data from rank ", f.sender, ": ", what,
               "; it was dropped. The peer's memory or library build differs from this rank's; this buffer is "
               "unusable now: rebuild it");
}

}  // namespace elasticep::detail
