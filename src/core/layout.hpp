// Sizes and offsets shared by host sizing and device addressing: the wire message of one token,
// and the output shapes of both layouts. Plain integers only, usable from .cu files.
#pragma once

#include <cstdint>

#include "core/hd.hpp"

namespace elasticep {

ELASTICEP_HD int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
ELASTICEP_HD int64_t ceil_div(int64_t v, int64_t a) { return (v + a - 1) / a; }

// One token on the wire, 16-byte aligned fields:
// [payload H*elem][scales scale_cols*4][topk idx K*int32][topk weights K*f32][src token int32]
struct MessageLayout {
    int32_t payload_bytes = 0;
    int32_t scale_bytes = 0;
    int32_t idx_offset = 0;
    int32_t weight_offset = 0;
    int32_t src_offset = 0;
    int32_t bytes = 0;

    ELASTICEP_HD static MessageLayout make(int hidden, int num_topk, int payload_elem_bytes, int scale_cols) {
        MessageLayout m;
        m.payload_bytes = static_cast<int32_t>(round_up(int64_t{hidden} * payload_elem_bytes, 16));
        m.scale_bytes = static_cast<int32_t>(round_up(int64_t{scale_cols} * 4, 16));
        m.idx_offset = m.payload_bytes + m.scale_bytes;
        m.weight_offset = m.idx_offset + static_cast<int32_t>(round_up(int64_t{num_topk} * 4, 16));
        m.src_offset = m.weight_offset + static_cast<int32_t>(round_up(int64_t{num_topk} * 4, 16));
        m.bytes = m.src_offset + 16;
        return m;
    }
};

// Worst-case rows of the contiguous layout (SEMANTICS.md): R*C*min(K, E_local) + E_local*(A-1).
ELASTICEP_HD int64_t contiguous_rows_cap(int num_ranks, int capacity, int num_topk, int num_local_experts,
                                         int alignment) {
    const int64_t k = num_topk < num_local_experts ? num_topk : num_local_experts;
    return int64_t{num_ranks} * capacity * k + int64_t{num_local_experts} * (alignment - 1);
}

// MN-major scale storage: column-major with the row stride rounded up to a multiple of 4.
ELASTICEP_HD int64_t mn_major_stride(int64_t rows) { return round_up(rows, 4); }

}  // namespace elasticep
