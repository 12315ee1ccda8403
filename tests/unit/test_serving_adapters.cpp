// The grouped-GEMM adapters on the CPU, each against a direct computation written here from the
// index maps of serving.hpp: tiny hand-checked cases first, then generated shapes, then every fault
// (clamped, dropped, skipped, reported) with guard bytes around every output.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "elasticep/elasticep.hpp"
#include "harness.hpp"

namespace {

using namespace elasticep;
using eptest::Guarded;
using eptest::Rng;
using eptest::throws_error;

TensorRef t_of(void* p, DType d, std::vector<int64_t> shape, std::vector<int64_t> strides = {}) {
    TensorRef t = TensorRef::contiguous(p, d, std::move(shape));
    t.strides = std::move(strides);
    return t;
}

struct Status {
    int32_t v = 0;
    TensorRef ref() { return t_of(&v, DType::kInt32, {1}); }
};

// ---- m_indices ---------------------------------------------------------------------------------

TEST(Adapters, MIndicesHandCase) {
    std::vector<int32_t> counts = {2, 0, 3}, offsets = {0, 4, 4, 8};
    std::vector<int32_t> m(10, 77);
    Status st;
    m_indices_from_offsets(t_of(counts.data(), DType::kInt32, {3}), t_of(offsets.data(), DType::kInt32, {4}),
                           t_of(m.data(), DType::kInt32, {10}), st.ref());
    EXPECT_EQ(m, (std::vector<int32_t>{0, 0, -1, -1, 2, 2, 2, -1, -1, -1}));
    EXPECT_EQ(st.v, 0);
}

TEST(Adapters, MIndicesFaults) {
    Status st;
    std::vector<int32_t> m(6, 77);
    {  // a segment that runs past the rows: the rows that exist are written, the rest dropped
        std::vector<int32_t> counts = {4, 4}, offsets = {0, 4, 8};
        m_indices_from_offsets(t_of(counts.data(), DType::kInt32, {2}), t_of(offsets.data(), DType::kInt32, {3}),
                               t_of(m.data(), DType::kInt32, {6}), st.ref());
        EXPECT_EQ(m, (std::vector<int32_t>{0, 0, 0, 0, 1, 1}));
        EXPECT_EQ(st.v, kAdapterRowsOverflow);
        EXPECT_TRUE(throws_error([&] { check_adapter_status(st.ref()); }, ErrorCode::kCapacityExceeded,
                                 {"more contiguous rows than the tensor has"}));
        EXPECT_EQ(st.v, 0);  // cleared
    }
    {  // a count longer than its segment, and a negative count: those experts are skipped
        std::vector<int32_t> counts = {3, -1, 1}, offsets = {0, 2, 4, 5};
        m_indices_from_offsets(t_of(counts.data(), DType::kInt32, {3}), t_of(offsets.data(), DType::kInt32, {4}),
                               t_of(m.data(), DType::kInt32, {6}), st.ref());
        EXPECT_EQ(m, (std::vector<int32_t>{-1, -1, -1, -1, 2, -1}));
        EXPECT_EQ(st.v, kAdapterBadLayout);
        EXPECT_TRUE(throws_error([&] { check_adapter_status(st.ref()); }, ErrorCode::kCapacityExceeded,
                                 {"segment shorter than its count"}));
    }
}

// ---- masked <-> contiguous ---------------------------------------------------------------------

// A slab [E, S, W] of bf16 with row (l, r) channel h = a pattern unique per (l, r, h).
uint16_t pattern(int64_t l, int64_t r, int64_t h) {
    return static_cast<uint16_t>(0x3c00 + ((l * 131 + r * 17 + h) % 1000));
}

TEST(Adapters, MaskedToContiguousHandCase) {
    const int64_t e = 2, s = 3, w = 8, a = 4, mc = 12;
    std::vector<uint16_t> slab(e * s * w);
    for (int64_t l = 0; l < e; ++l)
        for (int64_t r = 0; r < s; ++r)
            for (int64_t h = 0; h < w; ++h) slab[(l * s + r) * w + h] = pattern(l, r, h);
    std::vector<int32_t> masked_m = {3, 1};
    std::vector<float> scales(e * s * 2);
    for (size_t i = 0; i < scales.size(); ++i) scales[i] = 1.0f + static_cast<float>(i);
    Guarded out(mc * w * 2), out_s(mc * 2 * 4);
    std::vector<int32_t> offsets(3, 77), m(mc, 77);
    Status st;
    MaskedToContiguousArgs args;
    args.x = t_of(slab.data(), DType::kBFloat16, {e, s, w});
    args.masked_m = t_of(masked_m.data(), DType::kInt32, {e});
    args.scales = t_of(scales.data(), DType::kFloat32, {e, s, 2});
    args.expert_alignment = a;
    args.out_x = t_of(out.data(), DType::kBFloat16, {mc, w});
    args.out_scales = t_of(out_s.data(), DType::kFloat32, {mc, 2});
    args.out_offsets = t_of(offsets.data(), DType::kInt32, {3});
    args.out_m_indices = t_of(m.data(), DType::kInt32, {mc});
    args.status = st.ref();
    masked_to_contiguous(args);
    EXPECT_EQ(offsets, (std::vector<int32_t>{0, 4, 8}));
    EXPECT_EQ(m, (std::vector<int32_t>{0, 0, 0, -1, 1, -1, -1, -1, -1, -1, -1, -1}));
    const auto* o = static_cast<const uint16_t*>(out.data());
    const auto* os = static_cast<const float*>(out_s.data());
    for (int64_t h = 0; h < w; ++h) {
        EXPECT_EQ(o[0 * w + h], pattern(0, 0, h));
        EXPECT_EQ(o[2 * w + h], pattern(0, 2, h));
        EXPECT_EQ(o[3 * w + h], 0) << "padding row inside a segment is zeroed";
        EXPECT_EQ(o[4 * w + h], pattern(1, 0, h));
        EXPECT_EQ(o[8 * w + h], 0x5a5a) << "rows >= M are not written";
    }
    EXPECT_EQ(os[2 * 2 + 1], scales[(0 * s + 2) * 2 + 1]);
    EXPECT_EQ(os[4 * 2 + 0], scales[(1 * s + 0) * 2 + 0]);
    EXPECT_EQ(os[5 * 2 + 0], 0.0f);
    EXPECT_TRUE(out.guards_intact() && out_s.guards_intact());
    EXPECT_EQ(st.v, 0);
}

TEST(Adapters, ContiguousToMaskedHandCaseWithFusedWeights) {
    const int64_t e = 2, s = 3, w = 4, mc = 8;
    std::vector<uint16_t> y(mc * w);
    for (int64_t i = 0; i < mc; ++i)
        for (int64_t h = 0; h < w; ++h) y[i * w + h] = eptest::bf16(static_cast<float>(i * 10 + h) + 0.5f);
    std::vector<int32_t> counts = {2, 3}, offsets = {0, 4, 8};
    std::vector<float> weights = {0.5f, -2.0f, 9.0f, 0.25f, 3.0f, 1.0f};  // [E, S] destination rows
    Guarded slab(e * s * w * 2);
    std::vector<int32_t> mm(2, 77);
    Status st;
    ContiguousToMaskedArgs args;
    args.x = t_of(y.data(), DType::kBFloat16, {mc, w});
    args.counts = t_of(counts.data(), DType::kInt32, {e});
    args.offsets = t_of(offsets.data(), DType::kInt32, {e + 1});
    args.out_x = t_of(slab.data(), DType::kBFloat16, {e, s, w});
    args.out_masked_m = t_of(mm.data(), DType::kInt32, {e});
    args.weights = t_of(weights.data(), DType::kFloat32, {e, s});
    args.status = st.ref();
    contiguous_to_masked(args);
    EXPECT_EQ(mm, (std::vector<int32_t>{2, 3}));
    const auto* o = static_cast<const uint16_t*>(slab.data());
    for (int64_t h = 0; h < w; ++h) {
        // bf16(float(y) * w): 0.5 * (0.5 + h) and -2 * (10.5 + h) are exact in bf16 here
        EXPECT_EQ(o[(0 * s + 0) * w + h], eptest::bf16(0.5f * (0.5f + static_cast<float>(h))));
        EXPECT_EQ(o[(0 * s + 1) * w + h], eptest::bf16(-2.0f * (10.5f + static_cast<float>(h))));
        EXPECT_EQ(o[(0 * s + 2) * w + h], 0x5a5a) << "slab rows past the count are not written";
        EXPECT_EQ(o[(1 * s + 2) * w + h], eptest::bf16(1.0f * eptest::from_bf16(y[6 * w + h])));
    }
    EXPECT_TRUE(slab.guards_intact());
}

// Generated shapes and dtypes: both directions against the direct index map, with scales in
// row-major and MN-major layouts, fp8 and bf16 rows, odd widths.
TEST(Adapters, RepackMatrix) {
    Rng rng(99);
    for (int iter = 0; iter < 40; ++iter) {
        const int64_t e = rng.uniform(1, 7), s = rng.uniform(1, 9), a = rng.pick(std::vector<int>{1, 2, 4, 128});
        const bool fp8 = rng.chance(0.5);
        const int64_t w = fp8 ? rng.uniform(1, 40) : rng.uniform(1, 24);
        const int64_t g = rng.uniform(0, 5);
        const DType dt = fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
        const int64_t es = fp8 ? 1 : 2;
        std::vector<int32_t> mm(static_cast<size_t>(e));
        int64_t need = 0;
        for (auto& c : mm) {
            c = rng.uniform(0, static_cast<int>(s));
            need += (c + a - 1) / a * a;
        }
        const int64_t mc = need + rng.uniform(0, 5);
        std::vector<uint8_t> slab(static_cast<size_t>(e * s * w * es));
        for (auto& b : slab) b = static_cast<uint8_t>(rng.next());
        std::vector<uint32_t> sc(static_cast<size_t>(e * s * std::max<int64_t>(g, 1)));
        for (auto& v : sc) v = static_cast<uint32_t>(rng.next());
        const bool mn = g > 1 && rng.chance(0.5);
        const int64_t pad = (mc + 3) / 4 * 4;
        Guarded out(static_cast<size_t>(mc * w * es)), out_s(static_cast<size_t>(std::max<int64_t>(g, 1) * pad * 4));
        std::vector<int32_t> offsets(static_cast<size_t>(e + 1)), m(static_cast<size_t>(mc));
        Status st;
        MaskedToContiguousArgs f;
        f.x = t_of(slab.data(), dt, {e, s, w});
        f.masked_m = t_of(mm.data(), DType::kInt32, {e});
        f.expert_alignment = static_cast<int>(a);
        f.out_x = t_of(out.data(), dt, {mc, w});
        f.out_offsets = t_of(offsets.data(), DType::kInt32, {e + 1});
        f.out_m_indices = t_of(m.data(), DType::kInt32, {mc});
        f.status = st.ref();
        if (g > 0) {
            f.scales = t_of(sc.data(), DType::kInt32, {e, s, g});
            f.out_scales =
                t_of(out_s.data(), DType::kInt32, {mc, g}, mn ? std::vector<int64_t>{1, pad} : std::vector<int64_t>{});
        }
        masked_to_contiguous(f);
        ASSERT_EQ(st.v, 0);
        // direct: segment starts, then each row
        int64_t at = 0;
        const auto* o = static_cast<const uint8_t*>(out.data());
        const auto* os = static_cast<const uint32_t*>(out_s.data());
        for (int64_t l = 0; l < e; ++l) {
            ASSERT_EQ(offsets[static_cast<size_t>(l)], at);
            for (int64_t r = 0; r < (mm[static_cast<size_t>(l)] + a - 1) / a * a; ++r) {
                const int64_t i = at + r;
                const bool real = r < mm[static_cast<size_t>(l)];
                ASSERT_EQ(m[static_cast<size_t>(i)], real ? l : -1);
                for (int64_t b = 0; b < w * es; ++b)
                    ASSERT_EQ(o[i * w * es + b], real ? slab[static_cast<size_t>((l * s + r) * w * es + b)] : 0)
                        << "iter " << iter << " row " << i;
                for (int64_t c = 0; c < g; ++c)
                    ASSERT_EQ(os[mn ? c * pad + i : i * g + c],
                              real ? sc[static_cast<size_t>((l * s + r) * g + c)] : 0u);
            }
            at += (mm[static_cast<size_t>(l)] + a - 1) / a * a;
        }
        ASSERT_EQ(offsets[static_cast<size_t>(e)], at);
        for (int64_t i = at; i < mc; ++i) ASSERT_EQ(m[static_cast<size_t>(i)], -1);
        ASSERT_TRUE(out.guards_intact() && out_s.guards_intact());

        // back: contiguous -> masked from the rows just made (round trip of the real rows)
        Guarded back(static_cast<size_t>(e * s * w * es)),
            back_s(static_cast<size_t>(e * s * std::max<int64_t>(g, 1) * 4));
        std::vector<int32_t> counts(mm), mm2(static_cast<size_t>(e), 77);
        ContiguousToMaskedArgs bk;
        bk.x = f.out_x;
        bk.counts = t_of(counts.data(), DType::kInt32, {e});
        bk.offsets = f.out_offsets;
        bk.out_x = t_of(back.data(), dt, {e, s, w});
        bk.out_masked_m = t_of(mm2.data(), DType::kInt32, {e});
        bk.status = st.ref();
        if (g > 0) {
            bk.scales = f.out_scales;
            bk.out_scales = t_of(back_s.data(), DType::kInt32, {e, s, g});
        }
        contiguous_to_masked(bk);
        ASSERT_EQ(st.v, 0);
        ASSERT_EQ(mm2, mm);
        const auto* bo = static_cast<const uint8_t*>(back.data());
        const auto* bs = static_cast<const uint32_t*>(back_s.data());
        for (int64_t l = 0; l < e; ++l)
            for (int64_t r = 0; r < s; ++r) {
                const bool real = r < mm[static_cast<size_t>(l)];
                for (int64_t b = 0; b < w * es; ++b)
                    ASSERT_EQ(bo[(l * s + r) * w * es + b],
                              real ? slab[static_cast<size_t>((l * s + r) * w * es + b)] : 0x5a);
                for (int64_t c = 0; c < g; ++c)
                    ASSERT_EQ(bs[(l * s + r) * g + c],
                              real ? sc[static_cast<size_t>((l * s + r) * g + c)] : 0x5a5a5a5au);
            }
        ASSERT_TRUE(back.guards_intact() && back_s.guards_intact());
    }
}

TEST(Adapters, RepackFaultsNeverWritePastTheTensors) {
    const int64_t e = 3, s = 4, w = 16;
    std::vector<uint16_t> slab(e * s * w, 0x3f80);
    Status st;
    {  // masked_m above S is clamped; a contiguous tensor too short drops rows past its end
        std::vector<int32_t> mm = {9, 2, -3};
        const int64_t mc = 5;  // needs 4 + 2 = 6 rows at A = 1
        Guarded out(mc * w * 2);
        std::vector<int32_t> offsets(4), m(mc);
        MaskedToContiguousArgs f;
        f.x = t_of(slab.data(), DType::kBFloat16, {e, s, w});
        f.masked_m = t_of(mm.data(), DType::kInt32, {e});
        f.out_x = t_of(out.data(), DType::kBFloat16, {mc, w});
        f.out_offsets = t_of(offsets.data(), DType::kInt32, {e + 1});
        f.out_m_indices = t_of(m.data(), DType::kInt32, {mc});
        f.status = st.ref();
        masked_to_contiguous(f);
        EXPECT_EQ(offsets, (std::vector<int32_t>{0, 4, 6, 6}));
        EXPECT_EQ(m, (std::vector<int32_t>{0, 0, 0, 0, 1}));
        EXPECT_EQ(st.v, kAdapterCountOverflow | kAdapterRowsOverflow | kAdapterBadLayout);
        EXPECT_TRUE(out.guards_intact());
        EXPECT_TRUE(throws_error([&] { check_adapter_status(st.ref()); }, ErrorCode::kCapacityExceeded,
                                 {"clamped", "dropped", "skipped", "max_contiguous_rows"}));
    }
    {  // contiguous -> masked: a count above S, a segment past the rows, offsets that go backwards
        std::vector<uint16_t> y(6 * w, 0x4000);
        std::vector<int32_t> counts = {6, 2, 1}, offsets = {0, 5, 3, 6};
        Guarded out(e * s * w * 2);
        std::vector<int32_t> mm(3, 77);
        ContiguousToMaskedArgs b;
        b.x = t_of(y.data(), DType::kBFloat16, {6, w});
        b.counts = t_of(counts.data(), DType::kInt32, {e});
        b.offsets = t_of(offsets.data(), DType::kInt32, {e + 1});
        b.out_x = t_of(out.data(), DType::kBFloat16, {e, s, w});
        b.out_masked_m = t_of(mm.data(), DType::kInt32, {e});
        b.status = st.ref();
        contiguous_to_masked(b);
        // expert 0: 6 clamped to S = 4 (segment [0, 5) holds them); expert 1: offsets 5 -> 3 go
        // backwards, skipped; expert 2: segment [3, 6) holds its one row
        EXPECT_EQ(mm, (std::vector<int32_t>{4, 0, 1}));
        EXPECT_EQ(st.v, kAdapterCountOverflow | kAdapterBadLayout);
        EXPECT_TRUE(out.guards_intact());
        st.v = 0;
        counts = {1, 1, 4};
        offsets = {0, 1, 2, 8};  // expert 2's rows [2, 6) exist, but it may read 4 rows: fine; now past the end:
        offsets = {0, 1, 4, 8};  // [4, 8) runs past 6 rows: rows 4, 5 copied, the rest dropped
        contiguous_to_masked(b);
        EXPECT_EQ(mm, (std::vector<int32_t>{1, 1, 2}));
        EXPECT_EQ(st.v, kAdapterRowsOverflow);
        EXPECT_TRUE(out.guards_intact());
    }
}

// ---- route weights -----------------------------------------------------------------------------

TEST(Adapters, RouteWeightsRealRowsOnly) {
    Rng rng(5);
    const int64_t e = 3, s = 5, h = 24;
    std::vector<uint16_t> y(e * s * h);
    for (auto& v : y) v = eptest::random_bf16(rng);
    y[7] = 0x7f81;  // a signalling NaN: becomes the canonical 0x7fc0
    y[8] = 0x7f80;  // Inf
    std::vector<float> w(e * s);
    for (auto& v : w) v = static_cast<float>(rng.unit() * 4 - 2);
    w[0] = 0.0f;  // Inf * 0 = NaN
    std::vector<int32_t> mm = {2, 0, 5};
    std::vector<uint16_t> out(y.size(), 0x1234);
    Status st;
    apply_route_weights(t_of(y.data(), DType::kBFloat16, {e, s, h}), t_of(w.data(), DType::kFloat32, {e, s}),
                        t_of(mm.data(), DType::kInt32, {e}), t_of(out.data(), DType::kBFloat16, {e, s, h}), st.ref());
    for (int64_t l = 0; l < e; ++l)
        for (int64_t r = 0; r < s; ++r)
            for (int64_t c = 0; c < h; ++c) {
                const size_t i = static_cast<size_t>((l * s + r) * h + c);
                if (r >= mm[static_cast<size_t>(l)]) {
                    ASSERT_EQ(out[i], 0x1234);
                    continue;
                }
                const float v = eptest::from_bf16(y[i]) * w[static_cast<size_t>(l * s + r)];
                ASSERT_EQ(out[i], std::isnan(v) ? 0x7fc0 : eptest::bf16(v)) << l << " " << r << " " << c;
            }
    EXPECT_EQ(out[7], 0x7fc0);
    EXPECT_EQ(out[8], 0x7fc0);  // Inf * 0
    EXPECT_EQ(st.v, 0);
    // contiguous, in place: rows with m_indices < 0 untouched
    std::vector<uint16_t> yc = {0x3f80, 0x4000, 0x4040, 0x4080};  // 1, 2, 3, 4 as [4, 1]
    std::vector<float> wc = {3.0f, 5.0f, 0.5f, 0.25f};
    std::vector<int32_t> mi = {0, -1, 2, 2};
    const TensorRef yt = t_of(yc.data(), DType::kBFloat16, {4, 1});
    apply_route_weights(yt, t_of(wc.data(), DType::kFloat32, {4}), t_of(mi.data(), DType::kInt32, {4}), yt, st.ref());
    EXPECT_EQ(yc, (std::vector<uint16_t>{0x4040, 0x4000, 0x3fc0, 0x3f80}));  // 3, 2 (untouched), 1.5, 1
    // masked_m above S: clamped and reported
    mm = {9, 0, 0};
    apply_route_weights(t_of(y.data(), DType::kBFloat16, {e, s, h}), t_of(w.data(), DType::kFloat32, {e, s}),
                        t_of(mm.data(), DType::kInt32, {e}), t_of(out.data(), DType::kBFloat16, {e, s, h}), st.ref());
    EXPECT_EQ(st.v, kAdapterCountOverflow);
}

// ---- scale layouts -----------------------------------------------------------------------------

TEST(Adapters, ScaleLayoutRoundTrip) {
    Rng rng(3);
    for (int64_t rows : {1, 3, 4, 5, 17}) {
        for (int64_t g : {1, 2, 7}) {
            for (int64_t b : {1, 3}) {
                const int64_t pad = (rows + 3) / 4 * 4;
                std::vector<float> src(b * rows * g);
                for (auto& v : src) v = static_cast<float>(rng.unit());
                Guarded mn(b * g * pad * 4);
                std::vector<int64_t> shape = b == 1 ? std::vector<int64_t>{rows, g} : std::vector<int64_t>{b, rows, g};
                std::vector<int64_t> mstr =
                    b == 1 ? std::vector<int64_t>{1, pad} : std::vector<int64_t>{g * pad, 1, pad};
                convert_scale_layout(t_of(src.data(), DType::kFloat32, shape),
                                     t_of(mn.data(), DType::kFloat32, shape, mstr));
                const auto* m = static_cast<const uint32_t*>(mn.data());
                for (int64_t bi = 0; bi < b; ++bi)
                    for (int64_t c = 0; c < g; ++c)
                        for (int64_t r = 0; r < pad; ++r) {
                            const uint32_t got = m[bi * g * pad + c * pad + r];
                            if (g == 1) {  // one column: MN-major and row-major are the same, no padding lanes
                                if (r < rows) ASSERT_EQ(got, eptest::bits(src[static_cast<size_t>(bi * rows + r)]));
                                continue;
                            }
                            ASSERT_EQ(got,
                                      r < rows ? eptest::bits(src[static_cast<size_t>((bi * rows + r) * g + c)]) : 0u)
                                << "rows " << rows << " g " << g << " r " << r;
                        }
                EXPECT_TRUE(mn.guards_intact());
                std::vector<float> back(src.size(), -1.0f);
                convert_scale_layout(t_of(mn.data(), DType::kFloat32, shape, mstr),
                                     t_of(back.data(), DType::kFloat32, shape));
                EXPECT_EQ(back, src);
            }
        }
    }
}

TEST(Adapters, Ue8m0PackingRoundsUp) {
    // hand-checked bytes: 1.0 -> 127; 1.5 -> 128 (up to 2); 2^-3 -> 124; 0.3 -> 2^-1 = 126; 0 -> 0;
    // Inf and NaN -> 255; a subnormal -> 1; -4.0 -> 129 (sign ignored)
    std::vector<float> s = {1.0f, 1.5f, 0.125f, 0.3f, 0.0f, INFINITY, NAN, 1e-40f, -4.0f};  // one row, G = 9
    std::vector<int32_t> out(3, 77);
    convert_scale_layout(t_of(s.data(), DType::kFloat32, {1, 9}),
                         t_of(s.data(), DType::kFloat32, {1, 9}));  // same-place copy is a no-op
    fp32_scales_to_ue8m0(t_of(s.data(), DType::kFloat32, {1, 9}), t_of(out.data(), DType::kInt32, {1, 3}));
    auto word = [](uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3) {
        return static_cast<int32_t>(b0 | (b1 << 8) | (b2 << 16) | (b3 << 24));
    };
    EXPECT_EQ(out[0], word(127, 128, 124, 126));
    EXPECT_EQ(out[1], word(0, 255, 255, 1));
    EXPECT_EQ(out[2], word(129, 0, 0, 0)) << "bytes past G are zero";
    // generated: MN-major destination, every byte the rounded-up exponent, padding lanes zero
    Rng rng(8);
    for (int64_t rows : {1, 5, 8}) {
        const int64_t g = 6, words = 2, pad = (rows + 3) / 4 * 4;
        std::vector<float> src(rows * g);
        for (auto& v : src) v = static_cast<float>(std::ldexp(rng.unit() + 0.5, rng.uniform(-20, 20)));
        Guarded dst(words * pad * 4);
        fp32_scales_to_ue8m0(t_of(src.data(), DType::kFloat32, {rows, g}),
                             t_of(dst.data(), DType::kInt32, {rows, words}, {1, pad}));
        const auto* d = static_cast<const uint32_t*>(dst.data());
        for (int64_t r = 0; r < pad; ++r)
            for (int64_t wi = 0; wi < words; ++wi) {
                uint32_t want = 0;
                for (int j = 0; j < 4 && r < rows; ++j) {
                    const int64_t gi = wi * 4 + j;
                    if (gi >= g) continue;
                    const double v = src[static_cast<size_t>(r * g + gi)];
                    const int ex = static_cast<int>(std::ceil(std::log2(v)));  // 2^ex >= v, the smallest
                    want |= static_cast<uint32_t>(ex + 127) << (8 * j);
                }
                ASSERT_EQ(d[wi * pad + r], want) << "row " << r << " word " << wi;
            }
        EXPECT_TRUE(dst.guards_intact());
    }
}

TEST(Adapters, BadArgumentsAreRejected) {
    std::vector<int32_t> counts(2), offsets(3), m(4);
    Status st;
    EXPECT_TRUE(throws_error(
        [&] {
            m_indices_from_offsets(t_of(counts.data(), DType::kInt32, {2}), t_of(offsets.data(), DType::kInt32, {2}),
                                   t_of(m.data(), DType::kInt32, {4}), st.ref());
        },
        ErrorCode::kInvalidArgument, {"offsets", "int32[3]"}));
    EXPECT_TRUE(throws_error(
        [&] {
            m_indices_from_offsets(t_of(counts.data(), DType::kInt32, {2}), t_of(offsets.data(), DType::kInt32, {3}),
                                   t_of(m.data(), DType::kInt32, {4}), t_of(m.data(), DType::kInt32, {2}));
        },
        ErrorCode::kInvalidArgument, {"status"}));
    std::vector<uint16_t> y(64);
    std::vector<float> w(8);
    EXPECT_TRUE(throws_error(
        [&] {
            apply_route_weights(t_of(y.data(), DType::kFloat32, {8, 2}), t_of(w.data(), DType::kFloat32, {8}),
                                t_of(m.data(), DType::kInt32, {8}), t_of(y.data(), DType::kFloat32, {8, 2}), st.ref());
        },
        ErrorCode::kInvalidArgument, {"must be bf16"}));
    MaskedToContiguousArgs f;
    f.x = t_of(y.data(), DType::kFloat8E4M3, {2, 4, 8});
    f.masked_m = t_of(counts.data(), DType::kInt32, {2});
    f.out_x = t_of(y.data(), DType::kFloat8E4M3, {8, 8});
    f.out_offsets = t_of(offsets.data(), DType::kInt32, {3});
    f.weights = t_of(w.data(), DType::kFloat32, {8});
    f.status = st.ref();
    EXPECT_TRUE(
        throws_error([&] { masked_to_contiguous(f); }, ErrorCode::kInvalidArgument, {"fused route weights need bf16"}));
    f.weights.reset();
    f.expert_alignment = 0;
    EXPECT_TRUE(throws_error([&] { masked_to_contiguous(f); }, ErrorCode::kInvalidArgument, {"expert_alignment=0"}));
    EXPECT_TRUE(throws_error(
        [&] {
            fp32_scales_to_ue8m0(t_of(w.data(), DType::kFloat32, {2, 4}), t_of(m.data(), DType::kInt32, {2, 2}));
        },
        ErrorCode::kInvalidArgument, {"ceil(G/4) = 1"}));
    // CUDA tensors in a build or process without CUDA: Unsupported, never a crash
    if (!Buffer::backend_available(BackendKind::kCUDA)) {
        TensorRef c = t_of(counts.data(), DType::kInt32, {2});
        c.device = Device{DeviceType::kCUDA, 0};
        TensorRef o = t_of(offsets.data(), DType::kInt32, {3});
        o.device = c.device;
        TensorRef mi = t_of(m.data(), DType::kInt32, {4});
        mi.device = c.device;
        TensorRef s = st.ref();
        s.device = c.device;
        if (std::string(build_backends()).find("cuda") == std::string::npos)
            EXPECT_TRUE(
                throws_error([&] { m_indices_from_offsets(c, o, mi, s); }, ErrorCode::kUnsupported, {"no CUDA"}));
    }
}

}  // namespace
