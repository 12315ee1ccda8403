// The phase-aware dispatcher on the CPU backend (ranks as threads): the layout per phase against the
// oracle, expected_m, MN-major scales, the handle lifecycle, T = 0 on some or all ranks, and both
// places for the route weights (combine vs the adapter before an unweighted combine), each checked
// against an independent computation.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <vector>

#include "elasticep/elasticep.hpp"
#include "harness.hpp"

namespace {

using namespace elasticep;
namespace ref = elasticep::reference;
using eptest::all_ok;
using eptest::run_ranks;
using eptest::throws_error;

// Every rank's inputs from the shared generator (tests/common/scenario.hpp): finite bf16 x, int64 top-k
// ids (1 in 8 routes -1, 1 in 16 tokens with no route at all), fp32 weights; unstrided storage, so
// d.x, d.idx64 and d.w are the rows the oracle reads in d.in.
std::vector<eptest::RankData> round_inputs(const BufferConfig& c, const std::vector<int64_t>& tokens, uint64_t seed,
                                           bool weights = true) {
    eptest::Scenario sc;
    sc.cfg = c;
    sc.num_ranks = static_cast<int>(tokens.size());
    sc.tokens = tokens;
    sc.p_none = 0.125;
    sc.p_token_none = 1.0 / 16;
    sc.idx64 = true;
    sc.has_weights = weights;
    sc.seed = seed;
    return eptest::make_inputs(sc);
}

struct Round {
    BufferConfig cfg;
    int ranks = 2;
    std::vector<int64_t> tokens;
    Phase phase = Phase::kDecode;
    DispatcherOptions opt;
    uint64_t seed = 7;
};

TensorRef host(void* p, DType d, std::vector<int64_t> shape) { return TensorRef::contiguous(p, d, std::move(shape)); }

// One dispatch -> identity experts (y = recv_x) -> combine round; checks layout and outputs.
void run_round(const Round& rd) {
    const BufferConfig& c = rd.cfg;
    // (the generator's x is finite: the weighted sums are compared bit for bit)
    std::vector<eptest::RankData> in = round_inputs(c, rd.tokens, rd.seed);
    std::vector<ref::RankInput> oin;
    for (const auto& d : in) oin.push_back(d.in);
    ref::DispatchOptions o;
    o.layout = rd.phase == Phase::kDecode ? Layout::kExpertMasked : Layout::kExpertContiguous;
    o.expert_alignment = rd.phase == Phase::kDecode ? 1 : rd.opt.expert_alignment;
    o.host_sync = rd.phase != Phase::kDecode;
    const auto want = ref::dispatch(c, rd.ranks, oin, o);
    std::vector<std::vector<uint16_t>> y_oracle(static_cast<size_t>(rd.ranks));
    for (int d = 0; d < rd.ranks; ++d) {  // identity experts: y = recv_x (bf16 payload)
        const auto& rx = want[static_cast<size_t>(d)].recv_x;
        y_oracle[static_cast<size_t>(d)].resize(rx.size() / 2);
        if (!rx.empty()) std::memcpy(y_oracle[static_cast<size_t>(d)].data(), rx.data(), rx.size());
    }
    const bool adapter = rd.opt.weight_placement == WeightPlacement::kAdapter;
    std::vector<std::vector<uint16_t>> want_out;
    if (!adapter) want_out = ref::combine(c, rd.ranks, oin, o, y_oracle, true, {});
    const int e_local = c.num_experts / rd.ranks;
    auto groups = ThreadGroup::create(rd.ranks);
    all_ok(run_ranks(rd.ranks, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], c, BackendKind::kCPU);
        MoeDispatcher disp(buf, rd.opt);
        eptest::RankData& x = in[static_cast<size_t>(r)];
        const int64_t t = x.in.num_tokens;
        const auto out = disp.dispatch(rd.phase, host(x.x.data(), DType::kBFloat16, {t, c.hidden}),
                                       host(x.idx64.data(), DType::kInt64, {t, c.num_topk}),
                                       host(x.w.data(), DType::kFloat32, {t, c.num_topk}));
        EXPECT_TRUE(disp.pending());
        const auto& w = want[static_cast<size_t>(r)];
        const std::vector<int32_t> counts = eptest::read_rows<int32_t>(out.counts);
        EXPECT_EQ(counts, w.counts);
        EXPECT_EQ(out.num_tokens, t);
        if (rd.phase == Phase::kDecode) {
            EXPECT_EQ(out.layout, Layout::kExpertMasked);
            EXPECT_EQ(out.hidden_states.shape,
                      (std::vector<int64_t>{e_local, rd.ranks * c.max_tokens_per_rank, c.hidden}));
            EXPECT_EQ(eptest::read_rows<int32_t>(out.masked_m), w.counts);
            EXPECT_EQ(out.max_m, rd.ranks * c.max_tokens_per_rank);
            // DeepEP's formula, computed here independently: (T * R * K + E) / E, at least 1
            const int64_t em = (t * rd.ranks * c.num_topk + c.num_experts) / c.num_experts;
            EXPECT_EQ(out.expected_m, em < 1 ? 1 : em);
        } else {
            EXPECT_EQ(out.layout, Layout::kExpertContiguous);
            const std::vector<int32_t> offsets = eptest::read_rows<int32_t>(out.offsets);
            EXPECT_EQ(offsets, w.offsets);
            for (int32_t v : offsets) EXPECT_EQ(v % rd.opt.expert_alignment, 0) << v;
            EXPECT_EQ(out.num_rows, offsets.back());
            EXPECT_EQ(out.hidden_states.size(0), offsets.back());
            EXPECT_EQ(eptest::read_rows<int32_t>(out.m_indices), w.m_indices);
        }
        // Expert side: identity (y = recv_x), weighted here when the placement says so.
        const int64_t rows = out.hidden_states.numel() / c.hidden;
        std::vector<uint16_t> y(static_cast<size_t>(rows * c.hidden));
        if (rows) std::memcpy(y.data(), out.hidden_states.data, y.size() * 2);
        TensorRef yt = TensorRef::contiguous(y.data(), DType::kBFloat16, out.hidden_states.shape);
        if (adapter) {
            int32_t status = 0;
            const TensorRef st = host(&status, DType::kInt32, {1});
            apply_route_weights(yt, out.recv_weights, rd.phase == Phase::kDecode ? out.masked_m : out.m_indices, yt,
                                st);
            check_adapter_status(st);
        }
        const TensorRef combined = disp.combine(yt);
        EXPECT_FALSE(disp.pending());
        const std::vector<uint16_t> got = eptest::read_2d<uint16_t>(combined, t, c.hidden);
        if (!adapter) {
            EXPECT_EQ(got, want_out[static_cast<size_t>(r)]) << "rank " << r;
            return;
        }
        // Adapter placement, computed directly: y_k = bf16(x_t * w_k); per destination rank (in
        // first-appearance order) p = sum of its y_k in k order (fp32), partial = bf16(p); out =
        // bf16(sum of partials).
        for (int64_t tok = 0; tok < t; ++tok) {
            std::vector<int> dests;
            std::map<int, float> p;
            for (int k = 0; k < c.num_topk; ++k) {
                const int64_t e = x.idx64[static_cast<size_t>(tok * c.num_topk + k)];
                if (e < 0) continue;
                const int d = static_cast<int>(e / e_local);
                if (!p.count(d)) dests.push_back(d);
                (void)p[d];
            }
            for (int64_t h = 0; h < c.hidden; ++h) {
                float acc = 0.0f;
                for (int d : dests) {
                    float pd = 0.0f;
                    for (int k = 0; k < c.num_topk; ++k) {
                        const int64_t e = x.idx64[static_cast<size_t>(tok * c.num_topk + k)];
                        if (e < 0 || e / e_local != d) continue;
                        const float xv = eptest::from_bf16(x.x[static_cast<size_t>(tok * c.hidden + h)]);
                        pd = std::fmaf(
                            1.0f, eptest::from_bf16(eptest::bf16(xv * x.w[static_cast<size_t>(tok * c.num_topk + k)])),
                            pd);
                    }
                    acc = acc + eptest::from_bf16(eptest::bf16(pd));
                }
                ASSERT_EQ(got[static_cast<size_t>(tok * c.hidden + h)], eptest::bf16(acc))
                    << "rank " << r << " token " << tok << " channel " << h;
            }
        }
    }));
}

BufferConfig small_config(Payload p = Payload::kBF16) {
    BufferConfig c{.num_experts = 8, .num_topk = 3, .hidden = 256, .max_tokens_per_rank = 6};
    c.payload = p;
    return c;
}

TEST(MoeDispatcher, DecodeIsMaskedWithoutHostSync) {
    Round rd{.cfg = small_config(), .ranks = 2, .tokens = {6, 4}, .phase = Phase::kDecode};
    run_round(rd);
}

TEST(MoeDispatcher, PrefillAndExtendAreContiguousAligned) {
    for (Phase ph : {Phase::kPrefill, Phase::kExtend}) {
        Round rd{.cfg = small_config(), .ranks = 2, .tokens = {5, 6}, .phase = ph};
        run_round(rd);
        rd.opt.expert_alignment = 4;  // the GEMM's alignment when it is not 128
        rd.ranks = 4;
        rd.tokens = {1, 6, 3, 2};
        run_round(rd);
    }
}

TEST(MoeDispatcher, ZeroTokensOnSomeOrAllRanks) {
    for (Phase ph : {Phase::kDecode, Phase::kPrefill}) {
        run_round(Round{.cfg = small_config(), .ranks = 2, .tokens = {0, 5}, .phase = ph});
        run_round(Round{.cfg = small_config(), .ranks = 4, .tokens = {3, 0, 0, 6}, .phase = ph});
        run_round(Round{.cfg = small_config(), .ranks = 2, .tokens = {0, 0}, .phase = ph});
        run_round(Round{.cfg = small_config(), .ranks = 1, .tokens = {0}, .phase = ph});
    }
}

TEST(MoeDispatcher, WeightsFusedIntoTheAdapterBeforeAnUnweightedCombine) {
    for (Phase ph : {Phase::kDecode, Phase::kPrefill}) {
        Round rd{.cfg = small_config(), .ranks = 2, .tokens = {6, 3}, .phase = ph};
        rd.opt.weight_placement = WeightPlacement::kAdapter;
        rd.opt.expert_alignment = 8;
        run_round(rd);
        rd.ranks = 4;
        rd.tokens = {2, 0, 6, 5};
        rd.seed = 11;
        run_round(rd);
    }
}

// fp8: the dispatcher asks for TMA-aligned MN-major scales (stride round_up(rows, 4)).
TEST(MoeDispatcher, Fp8ScalesAreMnMajor) {
    BufferConfig c = small_config(Payload::kFP8);
    c.max_tokens_per_rank = 5;  // R*C = 10 rows per expert: the stride rounds up to 12
    auto groups = ThreadGroup::create(2);
    all_ok(run_ranks(2, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], c, BackendKind::kCPU);
        MoeDispatcher disp(buf);
        eptest::RankData x = round_inputs(c, {5}, 3 + static_cast<uint64_t>(r))[0];
        for (Phase ph : {Phase::kDecode, Phase::kPrefill}) {
            const auto out = disp.dispatch(ph, host(x.x.data(), DType::kBFloat16, {5, c.hidden}),
                                           host(x.idx64.data(), DType::kInt64, {5, c.num_topk}),
                                           host(x.w.data(), DType::kFloat32, {5, c.num_topk}));
            ASSERT_TRUE(out.hidden_states_scale.has_value());
            const TensorRef& s = *out.hidden_states_scale;
            EXPECT_TRUE(out.scales_mn_major);
            EXPECT_EQ(out.scale_format, ScaleFormat::kF32G128);
            const int nd = s.ndim();
            const int64_t rows = s.size(nd - 2);
            EXPECT_EQ(s.stride(nd - 2), 1);
            EXPECT_EQ(s.stride(nd - 1), (rows + 3) / 4 * 4);
            if (ph == Phase::kDecode) EXPECT_EQ(rows, 10);
            std::vector<uint16_t> y(static_cast<size_t>(out.hidden_states.numel()), 0);
            disp.combine(TensorRef::contiguous(y.data(), DType::kBFloat16, out.hidden_states.shape));
        }
    }));
}

TEST(MoeDispatcher, HandleLifecycle) {
    const BufferConfig c = small_config();
    auto groups = ThreadGroup::create(1);
    auto buf = Buffer::create(groups[0], c, BackendKind::kCPU);
    MoeDispatcher disp(buf);
    eptest::RankData x = round_inputs(c, {4}, 5)[0];
    auto xt = host(x.x.data(), DType::kBFloat16, {4, c.hidden});
    auto it = host(x.idx64.data(), DType::kInt64, {4, c.num_topk});
    auto wt = host(x.w.data(), DType::kFloat32, {4, c.num_topk});
    std::vector<uint16_t> y(static_cast<size_t>(8 * 6 * c.hidden), 0);
    // combine without a dispatch
    EXPECT_TRUE(throws_error(
        [&] {
            disp.combine(host(y.data(), DType::kBFloat16, {8, 6, c.hidden}));
        },
        ErrorCode::kInvalidArgument, {"no dispatch is waiting"}));
    const auto out = disp.dispatch(Phase::kDecode, xt, it, wt);
    // a second dispatch before the combine
    EXPECT_TRUE(throws_error([&] { disp.dispatch(Phase::kPrefill, xt, it, wt); }, ErrorCode::kInvalidArgument,
                             {"previous dispatch (decode) was not combined"}));
    EXPECT_TRUE(disp.pending());
    // a failed combine (y of the wrong shape) releases the handle
    EXPECT_TRUE(throws_error(
        [&] {
            disp.combine(host(y.data(), DType::kBFloat16, {1, 6, c.hidden}));
        },
        ErrorCode::kInvalidArgument, {"shape of dispatch's recv_x"}));
    EXPECT_FALSE(disp.pending());
    EXPECT_TRUE(throws_error([&] { disp.combine(host(y.data(), DType::kBFloat16, out.hidden_states.shape)); },
                             ErrorCode::kInvalidArgument, {"no dispatch is waiting"}));
    // ... so the next round works
    const auto again = disp.dispatch(Phase::kPrefill, xt, it, wt);
    std::vector<uint16_t> y2(static_cast<size_t>(again.hidden_states.numel()), 0);
    disp.combine(TensorRef::contiguous(y2.data(), DType::kBFloat16, again.hidden_states.shape));
    // a dispatch that fails its checks leaves nothing pending
    EXPECT_TRUE(throws_error(
        [&] {
            disp.dispatch(Phase::kDecode, host(x.x.data(), DType::kBFloat16, {7, c.hidden}), it, wt);
        },
        ErrorCode::kCapacityExceeded, {"max_tokens_per_rank=6"}));
    EXPECT_FALSE(disp.pending());
}

TEST(MoeDispatcher, AdapterPlacementNeedsWeights) {
    const BufferConfig c = small_config();
    auto groups = ThreadGroup::create(1);
    auto buf = Buffer::create(groups[0], c, BackendKind::kCPU);
    MoeDispatcher disp(buf, DispatcherOptions{.weight_placement = WeightPlacement::kAdapter});
    eptest::RankData x = round_inputs(c, {2}, 5, false)[0];
    EXPECT_TRUE(throws_error(
        [&] {
            disp.dispatch(Phase::kDecode, host(x.x.data(), DType::kBFloat16, {2, c.hidden}),
                          host(x.idx64.data(), DType::kInt64, {2, c.num_topk}), std::nullopt);
        },
        ErrorCode::kInvalidArgument, {"topk_weights is required"}));
    EXPECT_TRUE(throws_error([&] { MoeDispatcher(buf, DispatcherOptions{.expert_alignment = 0}); },
                             ErrorCode::kInvalidArgument, {"expert_alignment=0"}));
    EXPECT_TRUE(throws_error([&] { MoeDispatcher(nullptr); }, ErrorCode::kInvalidArgument, {"buffer is null"}));
}

// Without topk_weights a kCombine dispatcher combines unweighted (w = 1).
TEST(MoeDispatcher, NoWeightsCombinesUnweighted) {
    const BufferConfig c = small_config();
    auto groups = ThreadGroup::create(1);
    auto buf = Buffer::create(groups[0], c, BackendKind::kCPU);
    MoeDispatcher disp(buf);
    const uint16_t one = 0x3f80;
    std::vector<uint16_t> x(static_cast<size_t>(c.hidden), one);
    std::vector<int64_t> idx = {0, 3, 5};  // three routes on the one rank
    const auto out = disp.dispatch(Phase::kPrefill, host(x.data(), DType::kBFloat16, {1, c.hidden}),
                                   host(idx.data(), DType::kInt64, {1, 3}), std::nullopt);
    std::vector<uint16_t> y(static_cast<size_t>(out.hidden_states.numel()));
    std::memcpy(y.data(), out.hidden_states.data, y.size() * 2);
    const TensorRef o = disp.combine(TensorRef::contiguous(y.data(), DType::kBFloat16, out.hidden_states.shape));
    for (int64_t h = 0; h < c.hidden; ++h) ASSERT_EQ(o.data_as<uint16_t>()[h], 0x4040) << h;  // 1 + 1 + 1 = 3
}

TEST(MoeDispatcher, ExpectedMMatchesDeepEpFormula) {
    EXPECT_EQ(MoeDispatcher::expected_m(0, 8, 8, 256), 1);
    EXPECT_EQ(MoeDispatcher::expected_m(128, 8, 8, 256), (128 * 8 * 8 + 256) / 256);  // 33
    EXPECT_EQ(MoeDispatcher::expected_m(1, 1, 1, 1), 2);
    EXPECT_EQ(MoeDispatcher::expected_m(3, 2, 2, 8), 2);
    for (int64_t t : {0, 1, 7, 64, 512})
        for (int r : {1, 2, 8})
            for (int k : {1, 6, 8})
                for (int e : {8, 64, 256}) EXPECT_EQ(MoeDispatcher::expected_m(t, r, k, e), (t * r * k + e) / e);
}

TEST(MoeDispatcher, PhaseAndPlacementNames) {
    EXPECT_EQ(parse_phase("extend"), Phase::kExtend);
    EXPECT_STREQ(phase_name(Phase::kDecode), "decode");
    EXPECT_EQ(parse_weight_placement("adapter"), WeightPlacement::kAdapter);
    EXPECT_TRUE(throws_error([] { parse_phase("idle"); }, ErrorCode::kInvalidArgument, {"decode, prefill or extend"}));
    EXPECT_TRUE(
        throws_error([] { parse_weight_placement("gemm"); }, ErrorCode::kInvalidArgument, {"combine or adapter"}));
}

}  // namespace
