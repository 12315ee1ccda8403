// What one dispatch + combine round moves, counted from the routing. The one byte accounting that
// `elasticep bench`, `python -m elasticep.bench` and the baselines in bench/ report.
#pragma once

#include <cstdint>

#include "elasticep/config.hpp"
#include "elasticep/tensor.hpp"

namespace elasticep {

// Bytes of one token's dispatch message on the wire: payload H*elem, scales, K int32 expert ids,
// K fp32 weights and the source token, each field rounded up to 16 bytes.
int64_t message_bytes(const BufferConfig& config);

// Counts of one round, for one source rank (count_traffic) or summed over ranks (operator+=).
// A token travels once to each distinct destination rank among its routes, carrying its whole
// top-k row ("message"); combine sends one bf16 partial row (H*2 bytes) back per message.
struct Traffic {
    int64_t tokens = 0;          // source tokens
    int64_t routes = 0;          // (token, k) entries with an expert id >= 0
    int64_t peer_messages = 0;   // messages to ranks other than the source
    int64_t local_messages = 0;  // messages a rank sends to itself
    int64_t message_bytes = 0;   // message_bytes(config)
    int64_t partial_bytes = 0;   // one combine partial: H*2

    // Device-memory bytes of the staged data flow on one GPU holding every rank (docs/PERFORMANCE.md,
    // "HBM floor"; the bench's "floor"). Dispatch: read x (bf16, or fp8 + scales when pre-quantized),
    // write and read every message once, write every received row (payload + scales). Combine: read
    // every real row of y, write and read every partial once, write the output (bf16 [T, H]).
    int64_t dispatch_hbm_bytes = 0;
    int64_t combine_hbm_bytes = 0;
    // The least any implementation moves there: every row written once, into its final place (no
    // message or partial copy in between). Dispatch: read x, write every received row. Combine: read
    // every real row of y, write the output. What the bench reports as the "min floor".
    int64_t dispatch_min_hbm_bytes = 0;
    int64_t combine_min_hbm_bytes = 0;

    int64_t messages() const { return peer_messages + local_messages; }
    int64_t dispatch_peer_bytes() const { return peer_messages * message_bytes; }
    int64_t dispatch_local_bytes() const { return local_messages * message_bytes; }
    int64_t combine_peer_bytes() const { return peer_messages * partial_bytes; }
    int64_t combine_local_bytes() const { return local_messages * partial_bytes; }

    // Sums counts of ranks of one config (message sizes must agree).
    Traffic& operator+=(const Traffic& other);
};

// The traffic of rank `rank`'s routing: topk_idx is its [T, K] int32 or int64 host tensor (any
// strides), ids in [-1, E). `prequantized`: x arrives as fp8 with scales (dispatch reads fewer
// bytes). Throws InvalidArgument for a config invalid on `num_ranks` ranks, a rank out of range,
// a tensor that is not [T, K] on the host, or an id out of range (naming its position).
Traffic count_traffic(const BufferConfig& config, int num_ranks, int rank, const TensorRef& topk_idx,
                      bool prequantized = false);

}  // namespace elasticep
