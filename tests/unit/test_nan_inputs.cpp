// The inputs the GPU and MPI suites draw (tests/common/scenario.hpp: NaN elements in x, tokens with no
// route at all, -1 slots) on the CPU backend against the oracle, for every payload mode and both
// layouts: the reference side of those suites' comparisons is exact on them too.
#include "harness.hpp"

namespace eptest {
namespace {

TEST(GeneratorOptions, NanInputsAndRoutelessTokensEqualOracle) {
    struct P {
        Payload payload;
        ScaleFormat format;
        bool prequantized;
    };
    const P payloads[] = {{Payload::kBF16, ScaleFormat::kF32G128, false},
                          {Payload::kFP8, ScaleFormat::kF32G128, false},
                          {Payload::kFP8, ScaleFormat::kUE8M0G128, false},
                          {Payload::kFP8, ScaleFormat::kUE8M0G32, false},
                          {Payload::kFP8, ScaleFormat::kUE8M0G32, true}};
    uint64_t seed = 4000;
    int64_t nans = 0, routeless = 0;  // NaN elements (bf16 inputs) and tokens without a route drawn
    for (const P& p : payloads)
        for (Layout l : {Layout::kExpertContiguous, Layout::kExpertMasked}) {
            Scenario s;
            s.cfg = BufferConfig{.num_experts = 16, .num_topk = 4, .hidden = 256, .max_tokens_per_rank = 6};
            s.cfg.payload = p.payload;
            s.cfg.scale_format = p.format;
            s.prequantized = p.prequantized;
            s.num_ranks = 4;
            s.tokens = {6, 1, 0, 5};
            s.p_none = 1.0 / 8;
            s.p_token_none = 1.0 / 4;
            s.p_nan = 1.0 / 16;
            s.opt.layout = l;
            s.opt.expert_alignment = 4;
            s.bias = true;
            s.seed = seed++;
            // the options take effect (counted over every scenario, checked below)
            for (const RankData& d : make_inputs(s)) {
                for (uint16_t v : d.in.x) nans += v == 0x7fc0;
                for (int64_t t = 0; t < d.in.num_tokens; ++t)
                    routeless += std::all_of(d.in.topk_idx.begin() + t * 4, d.in.topk_idx.begin() + t * 4 + 4,
                                             [](int64_t e) { return e < 0; });
            }
            run_scenario(s);
        }
    EXPECT_GT(nans, 0);
    EXPECT_GT(routeless, 0);
}

}  // namespace
}  // namespace eptest
