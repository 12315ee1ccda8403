// The oracle splits its loops over tokens and destination ranks across threads
// (reference::set_threads). Its results must not depend on the split: every output of dispatch and
// combine computed with one thread equals, bit for bit, the same computed with 3 and 7 threads (chunk
// boundaries that fall inside ranks and token ranges of every length), on scenarios that exercise
// quantization (both scale formats), both layouts with alignment and padding, invalid and missing
// routes, bias and the hierarchical (node-partial) combine order.
#include <gtest/gtest.h>

#include "common/scenario.hpp"

namespace eptest {
namespace {

struct OracleRun {
    std::vector<ref::RankDispatch> dispatch;
    std::vector<std::vector<uint16_t>> out;
};

OracleRun run_oracle(const Scenario& sc, const std::vector<RankData>& data, int threads) {
    ref::set_threads(threads);
    std::vector<ref::RankInput> inputs;
    std::vector<std::vector<uint16_t>> bias;
    for (const RankData& d : data) {
        inputs.push_back(d.in);
        bias.push_back(d.bias);
    }
    OracleRun r;
    r.dispatch = ref::dispatch(sc.cfg, sc.num_ranks, inputs, sc.opt);
    // y: a value per (rank, row, channel) that does not come from the oracle
    std::vector<std::vector<uint16_t>> y(static_cast<size_t>(sc.num_ranks));
    for (int d = 0; d < sc.num_ranks; ++d) {
        const int64_t rows = r.dispatch[static_cast<size_t>(d)].rows;
        auto& yd = y[static_cast<size_t>(d)];
        yd.resize(static_cast<size_t>(rows * sc.cfg.hidden));
        for (int64_t row = 0; row < rows; ++row)
            for (int h = 0; h < sc.cfg.hidden; ++h)
                yd[static_cast<size_t>(row * sc.cfg.hidden + h)] = y_value(d, row, h);
    }
    r.out = ref::combine(sc.cfg, sc.num_ranks, inputs, sc.opt, y, sc.weighted, sc.bias ? bias : decltype(bias){});
    ref::set_threads(0);
    return r;
}

void expect_same(const OracleRun& a, const OracleRun& b, const std::string& what) {
    ASSERT_EQ(a.dispatch.size(), b.dispatch.size()) << what;
    for (size_t d = 0; d < a.dispatch.size(); ++d) {
        const ref::RankDispatch &x = a.dispatch[d], &z = b.dispatch[d];
        const std::string at = what + ", rank " + std::to_string(d);
        EXPECT_EQ(x.rows, z.rows) << at;
        EXPECT_EQ(x.num_rows, z.num_rows) << at;
        EXPECT_EQ(x.recv_x, z.recv_x) << at;
        EXPECT_EQ(x.recv_scales, z.recv_scales) << at;
        // weights compared as bits: -0.0 and 0.0 differ
        ASSERT_EQ(x.recv_weights.size(), z.recv_weights.size()) << at;
        for (size_t i = 0; i < x.recv_weights.size(); ++i)
            ASSERT_EQ(bits(x.recv_weights[i]), bits(z.recv_weights[i])) << at << ", weight of row " << i;
        EXPECT_EQ(x.recv_src, z.recv_src) << at;
        EXPECT_EQ(x.m_indices, z.m_indices) << at;
        EXPECT_EQ(x.counts, z.counts) << at;
        EXPECT_EQ(x.offsets, z.offsets) << at;
        EXPECT_EQ(x.row_is_real, z.row_is_real) << at;
    }
    EXPECT_EQ(a.out, b.out) << what << ": combine outputs";
}

TEST(OracleThreads, ResultsDoNotDependOnTheThreadCount) {
    std::vector<Scenario> cases;
    {  // fp8 f32_g128, contiguous with alignment, host sync, bias, ranks with 0 and 1 token
        Scenario sc = base_scenario(4, 16, 4, 256, 24);
        sc.cfg.payload = Payload::kFP8;
        sc.cfg.scale_format = ScaleFormat::kF32G128;
        sc.tokens = {24, 0, 1, 17};
        sc.opt.expert_alignment = 8;
        sc.bias = true;
        sc.p_token_none = 0.1;
        sc.seed = 11;
        cases.push_back(sc);
    }
    {  // fp8 ue8m0 g32, masked, graph mode, NaN inputs, unweighted, hierarchical combine (2 nodes of 3)
        Scenario sc = base_scenario(6, 24, 6, 128, 13);
        sc.cfg.payload = Payload::kFP8;
        sc.cfg.scale_format = ScaleFormat::kUE8M0G32;
        sc.cfg.ranks_per_node = 3;
        sc.tokens = {13, 5, 9, 0, 13, 2};
        sc.opt.layout = Layout::kExpertMasked;
        sc.opt.host_sync = false;
        sc.p_nan = 0.01;
        sc.weighted = false;
        sc.seed = 12;
        cases.push_back(sc);
    }
    {  // bf16, contiguous graph mode (M_cap rows), zero padding, invalid routes
        Scenario sc = base_scenario(3, 9, 3, 64, 10);
        sc.tokens = {10, 7, 3};
        sc.opt.host_sync = false;
        sc.opt.expert_alignment = 4;
        sc.opt.zero_padding = true;
        sc.routing = Routing::kInvalid;
        sc.seed = 13;
        cases.push_back(sc);
    }
    for (const Scenario& sc : cases) {
        const std::vector<RankData> data = make_inputs(sc);
        const OracleRun serial = run_oracle(sc, data, 1);
        // the scenario must produce outputs at all, or the comparison says nothing
        size_t real_rows = 0;
        for (const ref::RankDispatch& d : serial.dispatch)
            for (uint8_t v : d.row_is_real) real_rows += v;
        ASSERT_GT(real_rows, 0u) << sc.name();
        for (int threads : {3, 7})
            expect_same(serial, run_oracle(sc, data, threads), sc.name() + ", " + std::to_string(threads) + " threads");
    }
}

TEST(OracleThreads, DefaultIsTheHardwareAndNegativeMeansDefault) {
    ref::set_threads(0);
    const int hw = ref::threads();
    EXPECT_GE(hw, 1);
    ref::set_threads(5);
    EXPECT_EQ(ref::threads(), 5);
    ref::set_threads(-2);
    EXPECT_EQ(ref::threads(), hw);
    ref::set_threads(0);
}

}  // namespace
}  // namespace eptest
