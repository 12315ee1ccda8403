// The reference MoE layer on the CPU: a hand-checked bf16 case, then bf16 and FP8 experts against
// the independent dense reference (src/moe/dense_reference.hpp) in both layouts, the same rows
// from both layouts and from forward_dense, and a whole layer (dispatch -> experts -> combine,
// shared expert, routed scaling factor) on 1, 2 and 4 ranks against the dense reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "elasticep/elasticep.hpp"
#include "harness.hpp"
#include "moe/dense_reference.hpp"
#include "moe/synthetic_weights.hpp"

namespace {

using namespace elasticep;
namespace mr = elasticep::moe_ref;
namespace ref = elasticep::reference;
using eptest::all_ok;
using eptest::run_ranks;
using eptest::throws_error;

TensorRef host(void* p, DType d, std::vector<int64_t> shape) { return TensorRef::contiguous(p, d, std::move(shape)); }

TEST(ReferenceMoeLayer, HandCaseBf16) {
    // H = 2, I = 1: gate = x0, up = x1, y = [h, 2h] with h = bf16(silu(x0) * x1)
    std::vector<uint16_t> w1 = {0x3f80, 0x0000, 0x0000, 0x3f80};  // [[1, 0], [0, 1]]
    std::vector<uint16_t> w2 = {0x3f80, 0x4000};                  // [[1], [2]]
    ExpertWeights w;
    w.hidden = 2;
    w.intermediate = 1;
    w.gate_up = host(w1.data(), DType::kBFloat16, {1, 2, 2});
    w.down = host(w2.data(), DType::kBFloat16, {1, 2, 1});
    ReferenceMoeLayer layer(w, Device{});
    EXPECT_EQ(layer.path(), GemmPath::kCpuLoops);
    std::vector<uint16_t> x = {0x3f80, 0x3f80, 0x0000, 0x4000, 0xbf80, 0x3f80};  // (1, 1), (0, 2), (-1, 1)
    std::vector<uint16_t> y(6, 0xffff);
    layer.forward_dense(0, host(x.data(), DType::kBFloat16, {3, 2}), host(y.data(), DType::kBFloat16, {3, 2}));
    // silu(1) = 0.7310586 -> bf16 0.73046875 (0x3f3b); 2h = 1.4609375 (0x3fbb); silu(0) = 0;
    // silu(-1) = -0.2689414 -> bf16 -0.26953125 (0xbe8a), 2h = -0.5390625 (0xbf0a)
    EXPECT_EQ(y, (std::vector<uint16_t>{0x3f3b, 0x3fbb, 0x0000, 0x0000, 0xbe8a, 0xbf0a}));
}

// A hand-built dispatch output over host rows: contiguous [M, H] with the given per-expert rows
// (alignment 4), fp8 rows quantized the dispatch way (the oracle's quantizer).
struct HostDispatch {
    std::vector<uint8_t> x;        // rows
    std::vector<uint32_t> scales;  // [rows, H/128] fp32 bits
    std::vector<int32_t> counts, offsets, m_indices, masked_m;
    std::vector<float> weights;
    std::vector<uint16_t> rows_bf16;  // the bf16 source of every real row, in order
    MoeDispatchOutput out;
};

HostDispatch make_dispatch(const std::vector<int32_t>& counts, int64_t h, bool fp8, bool masked, int64_t slab,
                           uint64_t seed) {
    HostDispatch d;
    const int64_t e = static_cast<int64_t>(counts.size());
    d.counts = counts;
    d.offsets.push_back(0);
    for (int32_t c : counts) d.offsets.push_back(d.offsets.back() + (c + 3) / 4 * 4);
    const int64_t rows = masked ? e * slab : d.offsets.back();
    const int64_t es = fp8 ? 1 : 2, g = h / 128;
    d.x.assign(static_cast<size_t>(rows * h * es), 0);
    d.scales.assign(static_cast<size_t>(rows * std::max<int64_t>(g, 1)), 0);
    d.m_indices.assign(static_cast<size_t>(masked ? 0 : rows), -1);
    d.weights.assign(static_cast<size_t>(rows), 0.0f);
    eptest::Rng rng(seed);
    for (int64_t l = 0; l < e; ++l)
        for (int64_t r = 0; r < counts[static_cast<size_t>(l)]; ++r) {
            const int64_t row = masked ? l * slab + r : d.offsets[static_cast<size_t>(l)] + r;
            std::vector<uint16_t> src(static_cast<size_t>(h));
            for (auto& v : src) v = eptest::bf16(static_cast<float>(rng.unit() * 2 - 1));
            d.rows_bf16.insert(d.rows_bf16.end(), src.begin(), src.end());
            if (fp8)
                ref::quantize_row(src.data(), static_cast<int>(h), ScaleFormat::kF32G128, d.x.data() + row * h,
                                  d.scales.data() + row * g);
            else
                std::memcpy(d.x.data() + row * h * 2, src.data(), static_cast<size_t>(h) * 2);
            if (!masked) d.m_indices[static_cast<size_t>(row)] = static_cast<int32_t>(l);
            d.weights[static_cast<size_t>(row)] = static_cast<float>(rng.unit() + 0.25);
        }
    MoeDispatchOutput& o = d.out;
    const DType dt = fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
    o.layout = masked ? Layout::kExpertMasked : Layout::kExpertContiguous;
    o.phase = masked ? Phase::kDecode : Phase::kPrefill;
    o.hidden_states = masked ? host(d.x.data(), dt, {e, slab, h}) : host(d.x.data(), dt, {rows, h});
    if (fp8)
        o.hidden_states_scale = masked ? host(d.scales.data(), DType::kFloat32, {e, slab, g})
                                       : host(d.scales.data(), DType::kFloat32, {rows, g});
    o.counts = host(d.counts.data(), DType::kInt32, {e});
    if (masked) {
        o.masked_m = o.counts;
        o.max_m = slab;
        o.recv_weights = host(d.weights.data(), DType::kFloat32, {e, slab});
    } else {
        o.offsets = host(d.offsets.data(), DType::kInt32, {e + 1});
        o.m_indices = host(d.m_indices.data(), DType::kInt32, {rows});
        o.num_rows = rows;
        o.recv_weights = host(d.weights.data(), DType::kFloat32, {rows});
    }
    return d;
}

void check_against_dense(ExpertQuantKind kind, bool masked, WeightPlacement placement) {
    const int64_t e = 3, h = 256, inter = 384;
    const bool fp8 = kind == ExpertQuantKind::kFP8Block128;
    const mr::SyntheticExperts sx = mr::make_synthetic_experts(kind, 0, e, h, inter, 42);
    ReferenceMoeLayer layer(sx.tensors(0, e), Device{});
    HostDispatch d = make_dispatch({5, 0, 9}, h, fp8, masked, 10, 3);
    d.out.weight_placement = placement;
    const int64_t rows = d.out.hidden_states.numel() / h;
    std::vector<uint16_t> y(static_cast<size_t>(rows * h), 0x7777);
    layer.forward(d.out, host(y.data(), DType::kBFloat16, d.out.hidden_states.shape));
    const mr::ErrorModel model{.fp8 = fp8};
    mr::Comparison cmp;
    size_t src = 0;
    for (int64_t l = 0; l < e; ++l)
        for (int64_t r = 0; r < d.counts[static_cast<size_t>(l)]; ++r, src += static_cast<size_t>(h)) {
            const int64_t row = masked ? l * 10 + r : d.offsets[static_cast<size_t>(l)] + r;
            mr::Tracked want = mr::ffn(sx.view(l), mr::input_row(d.rows_bf16.data() + src, h, model), model);
            if (placement == WeightPlacement::kAdapter) {
                const double wt = d.weights[static_cast<size_t>(row)];
                for (int64_t n = 0; n < h; ++n) {
                    want.v[n] *= wt;
                    want.var[n] *= wt * wt;
                    want.worst[n] *= wt;
                }
                mr::add_rounding(want, mr::kUb);
            }
            for (int64_t n = 0; n < h; ++n) cmp.add(eptest::from_bf16(y[static_cast<size_t>(row * h + n)]), want, n);
        }
    cmp.finish();
    EXPECT_TRUE(cmp.pass()) << "rms err/sigma " << cmp.rms_ratio() << ", max err/worst " << cmp.max_worst_ratio
                            << ", max abs err " << cmp.max_abs_err;
    EXPECT_GT(cmp.rms_sigma, 0.0);
    // rows that are not real stay untouched
    for (int64_t row = 0; row < rows; ++row) {
        bool real;
        if (masked)
            real = row % 10 < d.counts[static_cast<size_t>(row / 10)];
        else
            real = d.m_indices[static_cast<size_t>(row)] >= 0;
        if (!real) ASSERT_EQ(y[static_cast<size_t>(row * h)], 0x7777) << "row " << row;
    }
}

TEST(ReferenceMoeLayer, Bf16ExpertsMatchTheDenseReference) {
    for (bool masked : {false, true})
        for (auto p : {WeightPlacement::kCombine, WeightPlacement::kAdapter})
            check_against_dense(ExpertQuantKind::kBF16, masked, p);
}

TEST(ReferenceMoeLayer, Fp8ExpertsMatchTheDenseReference) {
    for (bool masked : {false, true})
        for (auto p : {WeightPlacement::kCombine, WeightPlacement::kAdapter})
            check_against_dense(ExpertQuantKind::kFP8Block128, masked, p);
}

// The comparison is not blind: the right numbers through the wrong expert fail it by far.
TEST(ReferenceMoeLayer, DenseComparisonDetectsAWrongExpert) {
    const int64_t h = 256, inter = 256;
    const mr::SyntheticExperts sx = mr::make_synthetic_experts(ExpertQuantKind::kFP8Block128, 0, 2, h, inter, 9);
    ReferenceMoeLayer layer(sx.tensors(0, 2), Device{});
    HostDispatch d = make_dispatch({4, 0}, h, true, false, 0, 5);
    std::vector<uint16_t> y(static_cast<size_t>(d.out.hidden_states.numel()));
    layer.forward(d.out, host(y.data(), DType::kBFloat16, d.out.hidden_states.shape));
    const mr::ErrorModel model{.fp8 = true};
    mr::Comparison right, wrong;
    for (int64_t r = 0; r < 4; ++r) {
        const mr::Tracked in = mr::input_row(d.rows_bf16.data() + r * h, h, model);
        const mr::Tracked a = mr::ffn(sx.view(0), in, model), b = mr::ffn(sx.view(1), in, model);
        for (int64_t n = 0; n < h; ++n) {
            right.add(eptest::from_bf16(y[static_cast<size_t>(r * h + n)]), a, n);
            wrong.add(eptest::from_bf16(y[static_cast<size_t>(r * h + n)]), b, n);
        }
    }
    right.finish();
    wrong.finish();
    EXPECT_TRUE(right.pass()) << right.rms_ratio();
    EXPECT_FALSE(wrong.pass());
    EXPECT_GT(wrong.rms_ratio(), 10.0);
}

// The CPU path computes a row the same way whatever layout it came in, and forward_dense (which
// quantizes with dispatch's formula) matches the dispatched rows bit for bit.
TEST(ReferenceMoeLayer, LayoutsAndDenseAgreeBitForBit) {
    for (auto kind : {ExpertQuantKind::kBF16, ExpertQuantKind::kFP8Block128}) {
        const bool fp8 = kind == ExpertQuantKind::kFP8Block128;
        const int64_t h = 128, inter = 256;
        const mr::SyntheticExperts sx = mr::make_synthetic_experts(kind, 0, 2, h, inter, 77);
        ReferenceMoeLayer layer(sx.tensors(0, 2), Device{});
        HostDispatch c = make_dispatch({3, 6}, h, fp8, false, 0, 12);
        HostDispatch m = make_dispatch({3, 6}, h, fp8, true, 7, 12);
        ASSERT_EQ(c.rows_bf16, m.rows_bf16);
        std::vector<uint16_t> yc(static_cast<size_t>(c.out.hidden_states.numel())),
            ym(static_cast<size_t>(m.out.hidden_states.numel()));
        layer.forward(c.out, host(yc.data(), DType::kBFloat16, c.out.hidden_states.shape));
        layer.forward(m.out, host(ym.data(), DType::kBFloat16, m.out.hidden_states.shape));
        std::vector<uint16_t> dense_in(c.rows_bf16.begin() + 3 * h, c.rows_bf16.end());  // expert 1's six rows
        std::vector<uint16_t> yd(dense_in.size());
        layer.forward_dense(1, host(dense_in.data(), DType::kBFloat16, {6, h}),
                            host(yd.data(), DType::kBFloat16, {6, h}));
        for (int64_t r = 0; r < 6; ++r)
            for (int64_t n = 0; n < h; ++n) {
                const uint16_t vc = yc[static_cast<size_t>((c.offsets[1] + r) * h + n)];
                ASSERT_EQ(vc, ym[static_cast<size_t>((7 + r) * h + n)]) << "row " << r;
                ASSERT_EQ(vc, yd[static_cast<size_t>(r * h + n)]) << "row " << r;
            }
    }
}

TEST(ReferenceMoeLayer, BadWeightsAndInputsAreRejected) {
    const mr::SyntheticExperts sx = mr::make_synthetic_experts(ExpertQuantKind::kFP8Block128, 0, 1, 128, 128, 1);
    ExpertWeights w = sx.tensors(0, 1);
    w.kind = ExpertQuantKind::kMXFP8;
    EXPECT_TRUE(throws_error([&] { ReferenceMoeLayer l(w, Device{}); }, ErrorCode::kInvalidArgument, {"MXFP8"}));
    w = sx.tensors(0, 1);
    w.down_scales.reset();
    EXPECT_TRUE(throws_error([&] { ReferenceMoeLayer l(w, Device{}); }, ErrorCode::kInvalidArgument, {"down_scales"}));
    w = sx.tensors(0, 1);
    w.gate_up.shape[1] = 128;
    EXPECT_TRUE(throws_error([&] { ReferenceMoeLayer l(w, Device{}); }, ErrorCode::kInvalidArgument, {"gate_up is"}));
    w = sx.tensors(0, 1);
    w.gate_up.device = Device{DeviceType::kCUDA, 0};
    w.down.device = w.gate_up.device;
    w.gate_up_scales->device = w.gate_up.device;
    w.down_scales->device = w.gate_up.device;
    if (std::string(build_backends()).find("cuda") == std::string::npos)
        EXPECT_TRUE(throws_error(
            [&] {
                ReferenceMoeLayer l(w, Device{DeviceType::kCUDA, 0});
            },
            ErrorCode::kUnsupported, {"no CUDA"}));
    ReferenceMoeLayer layer(sx.tensors(0, 1), Device{});
    HostDispatch d = make_dispatch({2}, 128, false, false, 0, 1);  // bf16 rows into FP8 experts
    std::vector<uint16_t> y(static_cast<size_t>(d.out.hidden_states.numel()));
    EXPECT_TRUE(throws_error([&] { layer.forward(d.out, host(y.data(), DType::kBFloat16, d.out.hidden_states.shape)); },
                             ErrorCode::kInvalidArgument, {"fp8 dispatch"}));
    HostDispatch f = make_dispatch({2}, 128, true, false, 0, 1);
    EXPECT_TRUE(throws_error(
        [&] {
            layer.forward(f.out, host(y.data(), DType::kBFloat16, {1, 128}));
        },
        ErrorCode::kInvalidArgument, {"shape of hidden_states"}));
    EXPECT_TRUE(throws_error(
        [&] {
            layer.forward_dense(1, host(y.data(), DType::kBFloat16, {1, 128}),
                                host(y.data(), DType::kBFloat16, {1, 128}));
        },
        ErrorCode::kInvalidArgument, {"expert 1 is not in [0, 1)"}));
}

// ---- the whole layer on ranks as threads --------------------------------------------------------

struct LayerRun {
    int ranks = 2;
    int experts = 8, topk = 3;
    int64_t hidden = 256, inter = 256;
    ExpertQuantKind kind = ExpertQuantKind::kFP8Block128;
    Phase phase = Phase::kPrefill;
    WeightPlacement placement = WeightPlacement::kCombine;
    bool shared = true;
    float routed_scaling = 2.5f;
    std::vector<int64_t> tokens;
};

void run_layer(const LayerRun& lr) {
    const bool fp8 = lr.kind == ExpertQuantKind::kFP8Block128;
    BufferConfig cfg{.num_experts = lr.experts,
                     .num_topk = lr.topk,
                     .hidden = static_cast<int>(lr.hidden),
                     .max_tokens_per_rank = 8};
    cfg = serving_buffer_config(
        cfg, fp8 ? check_expert_quant(QuantizationConfig{.present = true,
                                                         .quant_method = "fp8",
                                                         .fmt = "e4m3",
                                                         .activation_scheme = "dynamic",
                                                         .weight_block_size = std::vector<int64_t>{128, 128}})
                 : check_expert_quant(QuantizationConfig{}));
    const int e_local = lr.experts / lr.ranks;
    const mr::SyntheticExperts all = mr::make_synthetic_experts(lr.kind, 0, lr.experts, lr.hidden, lr.inter, 2024);
    const mr::SyntheticExperts shared = mr::make_synthetic_experts(lr.kind, 1000, 1, lr.hidden, lr.inter, 2024);
    // Every rank's inputs from the shared generator (tests/common/scenario.hpp), unstrided: the call
    // and the dense reference below both read the storage (x, idx64, w).
    eptest::Scenario sc;
    sc.cfg = cfg;
    sc.num_ranks = lr.ranks;
    sc.tokens = lr.tokens;
    sc.p_none = 0.125;
    sc.p_token_none = 1.0 / 16;
    sc.idx64 = true;
    sc.seed = 500;
    std::vector<eptest::RankData> in = eptest::make_inputs(sc);
    for (eptest::RankData& x : in) {
        for (auto& v : x.x) v = eptest::bf16(static_cast<float>((v & 0xff) / 128.0 - 1.0));  // O(1), finite
        for (auto& w : x.w) w = std::fabs(w) * lr.routed_scaling;  // the routed scaling factor, folded in
    }
    std::vector<std::vector<uint16_t>> outs(static_cast<size_t>(lr.ranks));
    auto groups = ThreadGroup::create(lr.ranks);
    all_ok(run_ranks(lr.ranks, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        MoeDispatcher disp(buf, DispatcherOptions{.expert_alignment = 4, .weight_placement = lr.placement});
        ReferenceMoeLayer experts(all.tensors(r * e_local, e_local), Device{});
        ReferenceMoeLayer shared_expert(shared.tensors(0, 1), Device{});
        eptest::RankData& x = in[static_cast<size_t>(r)];
        const int64_t t = x.in.num_tokens;
        const TensorRef xt = host(x.x.data(), DType::kBFloat16, {t, lr.hidden});
        std::vector<uint16_t> shared_out(static_cast<size_t>(t * lr.hidden));
        const TensorRef st = host(shared_out.data(), DType::kBFloat16, {t, lr.hidden});
        shared_expert.forward_dense(0, xt, st);
        const MoeDispatchOutput d = disp.dispatch(lr.phase, xt, host(x.idx64.data(), DType::kInt64, {t, lr.topk}),
                                                  host(x.w.data(), DType::kFloat32, {t, lr.topk}));
        std::vector<uint16_t> y(static_cast<size_t>(d.hidden_states.numel()));
        const TensorRef yt = host(y.data(), DType::kBFloat16, d.hidden_states.shape);
        experts.forward(d, yt);
        const TensorRef o = disp.combine(yt, nullptr, lr.shared ? std::optional<TensorRef>(st) : std::nullopt);
        outs[static_cast<size_t>(r)] = eptest::read_2d<uint16_t>(o, t, lr.hidden);
    }));
    const mr::ErrorModel model{.fp8 = fp8};
    const mr::ExpertView sv = shared.view(0);
    mr::Comparison cmp;
    for (int r = 0; r < lr.ranks; ++r) {
        const eptest::RankData& x = in[static_cast<size_t>(r)];
        for (int64_t t = 0; t < x.in.num_tokens; ++t) {
            const mr::Tracked want = mr::moe_token(
                x.x.data() + t * lr.hidden, lr.hidden, x.idx64.data() + t * lr.topk, x.w.data() + t * lr.topk, lr.topk,
                [&](int64_t e) { return all.view(e); }, lr.shared ? &sv : nullptr, model);
            for (int64_t n = 0; n < lr.hidden; ++n)
                cmp.add(eptest::from_bf16(outs[static_cast<size_t>(r)][static_cast<size_t>(t * lr.hidden + n)]), want,
                        n);
        }
    }
    cmp.finish();
    EXPECT_TRUE(cmp.pass()) << "R=" << lr.ranks << " " << phase_name(lr.phase) << " "
                            << weight_placement_name(lr.placement) << ": rms err/sigma " << cmp.rms_ratio()
                            << ", max err/worst " << cmp.max_worst_ratio << ", max abs err " << cmp.max_abs_err
                            << " over " << cmp.elements;
}

TEST(ReferenceMoeLayer, WholeLayerMatchesTheDenseReference) {
    for (Phase ph : {Phase::kPrefill, Phase::kDecode})
        for (auto p : {WeightPlacement::kCombine, WeightPlacement::kAdapter}) {
            run_layer(LayerRun{.ranks = 2, .phase = ph, .placement = p, .tokens = {8, 5}});
            run_layer(LayerRun{.ranks = 4, .phase = ph, .placement = p, .tokens = {3, 0, 8, 1}});
        }
    run_layer(LayerRun{.ranks = 1, .experts = 4, .topk = 2, .tokens = {6}});
    run_layer(LayerRun{.ranks = 2,
                       .kind = ExpertQuantKind::kBF16,
                       .phase = Phase::kDecode,
                       .shared = false,
                       .routed_scaling = 1.0f,
                       .tokens = {7, 7}});
    run_layer(LayerRun{.ranks = 2, .tokens = {0, 0}});
}

}  // namespace
