// The oracle: SEMANTICS.md computed plainly from every rank's inputs at once, with none of the
// backends' code (no arena, no slots, no shared numerics). Tests and `elasticep bench` compare
// backend outputs against it with exact equality.
#pragma once

#include <cstdint>
#include <vector>

#include "elasticep/config.hpp"

namespace elasticep::reference {

// One rank's inputs, all row-major and host-resident.
struct RankInput {
    int64_t num_tokens = 0;
    std::vector<uint16_t> x;          // [T, H] bf16 bits (empty when pre-quantized)
    std::vector<uint8_t> x_fp8;       // [T, H] E4M3 bytes (pre-quantized input only)
    std::vector<uint32_t> x_scales;   // [T, scale_columns] fp32 bits or packed UE8M0 words
    std::vector<int64_t> topk_idx;    // [T, K]
    std::vector<float> topk_weights;  // [T, K], empty when the dispatch has no weights
};

struct DispatchOptions {
    Layout layout = Layout::kExpertContiguous;
    int expert_alignment = 1;
    bool host_sync = true;
    bool zero_padding = false;
};

// One rank's expected dispatch outputs, canonical row-major (scales row-major [rows, cols] even
// when the call asked for MN-major: compare element by element through the strides). Padding rows
// (contiguous segment tails, graph-mode rows >= M, masked rows >= masked_m) have weight 0, src -1,
// m_indices -1 and zero data/scales; compare their data only when zero_padding was asked for. Real
// rows of a dispatch without topk_weights carry weight 0.
struct RankDispatch {
    int64_t rows = 0;                   // contiguous: M (host sync) or M_cap; masked: E_local * R * C
    std::vector<uint8_t> recv_x;        // rows * H * elem_bytes (bf16 bits little-endian, or E4M3)
    std::vector<uint32_t> recv_scales;  // rows * scale_columns (fp8 payload only)
    std::vector<float> recv_weights;    // rows
    std::vector<int32_t> recv_src;      // rows
    std::vector<int32_t> m_indices;     // rows (contiguous only)
    std::vector<int32_t> counts;        // E_local
    std::vector<int32_t> offsets;       // E_local + 1 (contiguous only)
    std::vector<uint8_t> row_is_real;   // rows: 1 where the row carries a route (the rest is padding)
    int64_t num_rows = -1;              // M with host sync on the contiguous layout, else -1
};

// Expected outputs of every rank. Invalid routes (ids outside [-1, E), repeats) are dropped, as
// in graph mode; callers check host-sync rejection themselves with first_invalid_route.
std::vector<RankDispatch> dispatch(const BufferConfig& config, int num_ranks, const std::vector<RankInput>& inputs,
                                   const DispatchOptions& options);

// Expected combine output [T_s, H] bf16 bits of every rank. `y[d]` is rank d's expert output in
// the row positions of `expected[d]` (same row count, H columns, bf16 bits). `bias[s]` is empty
// or [T_s, H]. The reduction order follows config.ranks_per_node (SEMANTICS.md, "Combine"): flat over
// the destination ranks with one node, node partials first with several; the topology does not matter.
std::vector<std::vector<uint16_t>> combine(const BufferConfig& config, int num_ranks,
                                           const std::vector<RankInput>& inputs, const DispatchOptions& options,
                                           const std::vector<std::vector<uint16_t>>& y, bool weighted,
                                           const std::vector<std::vector<uint16_t>>& bias);

// The first invalid route of one rank in (token, k) order, or {-1, -1, 0} when there is none.
struct InvalidRoute {
    int64_t token = -1;
    int k = -1;
    int64_t value = 0;
};
InvalidRoute first_invalid_route(const BufferConfig& config, const RankInput& input);

// Threads the oracle's loops over tokens and destination ranks use: 0 (the default) means
// std::thread::hardware_concurrency(). Each output element is computed by one thread with the same
// arithmetic as a serial loop, so no result depends on it (tests/unit/test_oracle_threads.cpp).
void set_threads(int n);
int threads();

// Independent scalar references (used by the conversion tests).
uint8_t e4m3_from_float(float v);   // nearest of the 256 codes by exhaustive search, ties to even
uint16_t bf16_from_float(float v);  // round to nearest even; every NaN -> 0x7fc0
float float_from_bf16(uint16_t b);
float float_from_e4m3(uint8_t code);  // the OCP definition; NaN for S.1111.111

// One token row quantized as SEMANTICS.md says, with the oracle's own arithmetic: `hidden` bf16
// values in, `hidden` E4M3 bytes and scale_columns(format, hidden) words out (fp32 bits for
// f32_g128, packed UE8M0 exponent bytes otherwise, unused bytes zero).
void quantize_row(const uint16_t* x, int hidden, ScaleFormat format, uint8_t* q, uint32_t* scales);

}  // namespace elasticep::reference
