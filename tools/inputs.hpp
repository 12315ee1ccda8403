// Bench inputs: seeded token activations, skewed top-k routing and weights per rank, and the
// stand-in expert whose output combine reduces.
#pragma once

#include <cstdint>
#include <vector>

#include "bench.hpp"
#include "reference/oracle.hpp"

namespace elasticep::cli {

struct RankData {
    reference::RankInput input;  // what the oracle reads: x (bf16 or fp8 + scales), topk_idx int64, weights
    std::vector<int32_t> idx32;  // the same routes as int32, when the scenario asks for int32 ids
    std::vector<uint16_t> bias;  // [T, H] bf16 bits, or empty
};

// Deterministic in (scenario, rank): the same seed gives the same bytes on any machine.
// Routing: every rank draws each token's K distinct experts by weighted sampling without
// replacement from one popularity vector (1/(i+1)^skew over a seeded permutation of the
// experts), so a few experts and ranks are hot, as in a real MoE layer.
std::vector<RankData> make_inputs(const Scenario& s);

// The stand-in expert: a received row (bf16, or fp8 with its scale words) dequantized, times a
// per-expert constant, rounded to bf16. `scales` holds the row's scale words in storage order.
float expert_factor(int global_expert);
void expert_output_row(const BufferConfig& cfg, const uint8_t* x_row, const uint32_t* scales, int global_expert,
                       uint16_t* y_row);

// Runs fn(i) for i in [0, n) on up to hardware_concurrency threads; rethrows the first error.
void parallel_for(int n, const std::function<void(int)>& fn);

}  // namespace elasticep::cli
