// Scalar numerics: bf16 rounding, E4M3 both ways, and the three FP8 scale formats, checked against
// the oracle's exhaustive search, a formula written here, and values computed by hand.
#include <array>
#include <cmath>
#include <mutex>

#include "core/numerics.hpp"
#include "core/quantize.hpp"
#include "harness.hpp"

namespace eptest {
namespace {

float from_u32(uint32_t u) {
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

// The OCP E4M3 definition, written independently of both the library and the oracle.
float e4m3_formula(uint8_t c) {
    const bool neg = c & 0x80;
    const int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    return static_cast<float>(neg ? -mag : mag);
}

TEST(Numerics, E4m3ToFloatEveryCode) {
    for (int c = 0; c < 256; ++c) {
        const float want = e4m3_formula(static_cast<uint8_t>(c));
        const float got = num::e4m3_to_float(static_cast<uint8_t>(c));
        const float oracle = ref::float_from_e4m3(static_cast<uint8_t>(c));
        if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(got)) << "code 0x" << std::hex << c;
            EXPECT_TRUE(std::isnan(oracle)) << "code 0x" << std::hex << c;
        } else {
            EXPECT_EQ(bits(got), bits(want)) << "code 0x" << std::hex << c << ": " << got << " vs " << want;
            EXPECT_EQ(bits(oracle), bits(want)) << "code 0x" << std::hex << c;
        }
    }
    // a few by hand
    EXPECT_EQ(num::e4m3_to_float(0x7e), 448.0f);
    EXPECT_EQ(num::e4m3_to_float(0x38), 1.0f);
    EXPECT_EQ(num::e4m3_to_float(0xb8), -1.0f);
    EXPECT_EQ(num::e4m3_to_float(0x01), 0.001953125f);  // 2^-9, smallest subnormal
    EXPECT_EQ(num::e4m3_to_float(0x07), 7.0f / 512.0f);
    EXPECT_EQ(num::e4m3_to_float(0x08), 0.015625f);  // 2^-6, smallest normal
    EXPECT_EQ(bits(num::e4m3_to_float(0x80)), 0x80000000u);
    EXPECT_TRUE(std::isnan(num::e4m3_to_float(0xff)));
}

TEST(Numerics, OracleE4m3ByHand) {
    // the oracle itself on values worked out by hand
    EXPECT_EQ(ref::e4m3_from_float(1.0f), 0x38);
    EXPECT_EQ(ref::e4m3_from_float(448.0f), 0x7e);
    EXPECT_EQ(ref::e4m3_from_float(464.0f), 0x7e);  // would tie to 480: saturates
    EXPECT_EQ(ref::e4m3_from_float(1e9f), 0x7e);
    EXPECT_EQ(ref::e4m3_from_float(INFINITY), 0x7e);
    EXPECT_EQ(ref::e4m3_from_float(-INFINITY), 0xfe);
    EXPECT_EQ(ref::e4m3_from_float(NAN), 0x7f);
    EXPECT_EQ(ref::e4m3_from_float(-0.0f), 0x80);
    EXPECT_EQ(ref::e4m3_from_float(0.0009765625f), 0x00);    // 2^-10: tie between 0 and 2^-9 -> even
    EXPECT_EQ(ref::e4m3_from_float(0.0029296875f), 0x02);    // 3*2^-10: tie between 2^-9 and 2^-8 -> even
    EXPECT_EQ(ref::e4m3_from_float(0.0009766f), 0x01);       // just above 2^-10
    EXPECT_EQ(ref::e4m3_from_float(15.0f / 1024.0f), 0x08);  // tie between 0x07 and 0x08 -> even
    EXPECT_EQ(ref::e4m3_from_float(1.0625f), 0x38);          // tie between 1.0 and 1.125
    EXPECT_EQ(ref::e4m3_from_float(1.1875f), 0x3a);          // tie between 1.125 and 1.25
    EXPECT_EQ(ref::e4m3_from_float(232.0f), 0x76);           // tie between 224 and 240
    EXPECT_EQ(ref::e4m3_from_float(240.0f), 0x77);
    EXPECT_EQ(ref::e4m3_from_float(-225.0f), 0xf6);
}

void expect_e4m3_same(float v) {
    const uint8_t got = num::float_to_e4m3(v);
    const uint8_t want = ref::e4m3_from_float(v);
    ASSERT_EQ(got, want) << "float_to_e4m3(" << v << " = 0x" << std::hex << bits(v) << "): got 0x" << int{got}
                         << " want 0x" << int{want};
}

TEST(Numerics, FloatToE4m3EveryBf16Pattern) {
    for (uint32_t b = 0; b < 65536; ++b) expect_e4m3_same(from_bf16(static_cast<uint16_t>(b)));
}

TEST(Numerics, FloatToE4m3MidpointsAndRandomFloats) {
    // every midpoint between neighbouring codes, and its float neighbours
    for (int c = 0; c < 0x7e; ++c) {
        const float mid = (e4m3_formula(static_cast<uint8_t>(c)) + e4m3_formula(static_cast<uint8_t>(c + 1))) / 2.0f;
        for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
            expect_e4m3_same(v);
            expect_e4m3_same(-v);
        }
    }
    for (float v : {448.0f, 449.0f, 463.99997f, 464.0f, 480.0f, 1e38f, 3.4028235e38f, 1e-45f, 1e-38f, 0.0f}) {
        expect_e4m3_same(v);
        expect_e4m3_same(-v);
    }
    Rng rng(7);
    for (int i = 0; i < 200000; ++i) expect_e4m3_same(from_u32(static_cast<uint32_t>(rng.next())));
    // dense in the E4M3 range, where the rounding matters
    for (int i = 0; i < 200000; ++i) {
        const float v = static_cast<float>(std::ldexp(rng.unit(), rng.uniform(-12, 9)));
        expect_e4m3_same(rng.chance(0.5) ? v : -v);
    }
}

TEST(Numerics, Bf16Rounding) {
    for (uint32_t b = 0; b < 65536; ++b) ASSERT_EQ(bits(num::bf16_to_float(static_cast<uint16_t>(b))), b << 16);
    EXPECT_EQ(num::float_to_bf16(1.00390625f), 0x3f80);                        // tie -> even (down)
    EXPECT_EQ(num::float_to_bf16(1.01171875f), 0x3f82);                        // tie -> even (up)
    EXPECT_EQ(num::float_to_bf16(std::nextafter(1.00390625f, 2.0f)), 0x3f81);  // just above the tie
    EXPECT_EQ(num::float_to_bf16(from_u32(0x7f7fffff)), 0x7f80);               // max float rounds to inf
    EXPECT_EQ(num::float_to_bf16(-0.0f), 0x8000);
    EXPECT_EQ(num::float_to_bf16(INFINITY), 0x7f80);
    EXPECT_EQ(num::float_to_bf16(from_u32(0x00000001)), 0x0000);  // smallest subnormal -> 0
    EXPECT_EQ(num::float_to_bf16(from_u32(0x00008000)), 0x0000);  // tie at the subnormal end -> even
    EXPECT_EQ(num::float_to_bf16(from_u32(0x00018000)), 0x0002);
    EXPECT_EQ(num::float_to_bf16(-INFINITY), 0xff80);
    EXPECT_EQ(num::float_to_bf16(from_u32(0x7f800001)), 0x7fc0);  // signalling NaN -> the canonical quiet NaN
    Rng rng(11);
    for (int i = 0; i < 300000; ++i) {
        const float v = from_u32(static_cast<uint32_t>(rng.next()));
        const uint16_t got = num::float_to_bf16(v), want = ref::bf16_from_float(v);
        ASSERT_EQ(got, want) << std::hex << bits(v);
    }
}

// SEMANTICS.md decision: every NaN that bf16 rounding produces is 0x7fc0, whatever the sign,
// payload or quietness of the fp32 NaN (the payload an fmaf propagates differs between the CPU and
// the GPU). Checked over every one of the 2 * (2^23 - 1) fp32 NaNs, for the library and the oracle.
TEST(Numerics, Bf16EveryNaNIsCanonical) {
    const uint32_t hand[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu,
                             0x7fa00000u, 0x7f80ffffu, 0xffbfffffu, 0x7fc00001u, 0xffe12345u};
    for (uint32_t u : hand) {
        ASSERT_TRUE(std::isnan(from_u32(u))) << std::hex << u;
        EXPECT_EQ(num::float_to_bf16(from_u32(u)), 0x7fc0) << std::hex << u;
        EXPECT_EQ(ref::bf16_from_float(from_u32(u)), 0x7fc0) << std::hex << u;
    }
    int64_t lib_bad = 0, ref_bad = 0, checked = 0;
    uint32_t first_lib_bad = 0;
    for (uint32_t sign : {0u, 0x80000000u})
        for (uint32_t mant = 1; mant < (1u << 23); ++mant) {
            const uint32_t u = sign | 0x7f800000u | mant;
            const float v = from_u32(u);
            if (num::float_to_bf16(v) != 0x7fc0 && lib_bad++ == 0) first_lib_bad = u;
            if (ref::bf16_from_float(v) != 0x7fc0) ++ref_bad;
            ++checked;
        }
    EXPECT_EQ(checked, 2 * ((int64_t{1} << 23) - 1));
    EXPECT_EQ(lib_bad, 0) << "first at fp32 0x" << std::hex << first_lib_bad;
    EXPECT_EQ(ref_bad, 0);
    // the neighbours of the NaN range are not NaN: infinities stay, the largest finite rounds up to inf
    EXPECT_EQ(num::float_to_bf16(from_u32(0x7f800000u)), 0x7f80);
    EXPECT_EQ(num::float_to_bf16(from_u32(0xff800000u)), 0xff80);
    EXPECT_EQ(num::float_to_bf16(from_u32(0xff7fffffu)), 0xff80);
    EXPECT_EQ(num::float_to_bf16(from_u32(0x7f7f0000u)), 0x7f7f);  // exact: no rounding
    // E4M3 keeps its own NaN rule (0x7f for every NaN), unchanged by the bf16 one
    for (uint32_t u : hand) {
        EXPECT_EQ(num::float_to_e4m3(from_u32(u)), num::kE4M3NaN) << std::hex << u;
        EXPECT_EQ(ref::e4m3_from_float(from_u32(u)), 0x7f) << std::hex << u;
    }
}

// NaN entering combine (through y, through 0 * Inf, through the bias, on a token with no routes)
// comes out as exactly 0x7fc0, and the rest of the output still matches the oracle bit for bit.
//   R=2, E=4 (rank 0 holds experts 0, 1; rank 1 holds 2, 3), K=2, H=16, C=4, bias on both ranks.
TEST(Numerics, CombineNaNIsCanonical) {
    constexpr int kH = 16, kR = 2;
    BufferConfig cfg{.num_experts = 4, .num_topk = 2, .hidden = kH, .max_tokens_per_rank = 4};
    struct Plan {
        std::vector<int64_t> idx;
        std::vector<float> w;
    };
    const Plan plans[kR] = {
        // t0 plain; t1 NaN y from both holders; t2 weight 0 on a +Inf y; t3 no routes, NaN bias
        {{0, 2, 1, 3, 2, -1, -1, -1}, {0.5f, 0.25f, 1.0f, 1.0f, 0.0f, 0.5f, 0.3f, 0.7f}},
        // t0 one NaN partial of two; t1 two NaN routes on one holder; t2 NaN bias with routes
        {{3, 0, 2, 3, 0, 1}, {0.75f, -1.0f, 0.5f, 2.0f, 0.25f, 0.125f}},
    };
    // Poisoned y: (holder rank, source rank, token, global expert, channel) -> bf16 bits. None is
    // 0x7fc0 itself, so passing a payload through would show.
    struct Poison {
        int holder, src, token, expert, channel;
        uint16_t bits;
    };
    const std::vector<Poison> poison = {
        {0, 0, 1, 1, 5, 0xffa3},  // negative signalling NaN
        {1, 0, 1, 3, 5, 0x7fc5},  // quiet NaN with a payload
        {1, 0, 2, 2, 7, 0x7f80},  // +Inf times weight 0: fmaf makes a NaN
        {1, 1, 0, 3, 0, 0xff81},  // -sNaN on one holder only
        {1, 1, 1, 2, 9, 0x7f81},  // two NaN operands in one partial
        {1, 1, 1, 3, 9, 0xffc1},
    };
    struct BiasNaN {
        int rank, token, channel;
        uint16_t bits;
    };
    const std::vector<BiasNaN> bias_nan = {{0, 3, 2, 0xfff1}, {1, 2, 4, 0x7f90}};
    // Where the output must be NaN, worked out from the lists above.
    const std::vector<std::array<int, 3>> nan_at = {{0, 1, 5}, {0, 2, 7}, {0, 3, 2}, {1, 0, 0}, {1, 1, 9}, {1, 2, 4}};

    std::vector<ref::RankInput> inputs(kR);
    std::vector<std::vector<uint16_t>> x(kR), bias(kR);
    for (int r = 0; r < kR; ++r) {
        const int64_t t = static_cast<int64_t>(plans[r].idx.size()) / 2;
        auto& in = inputs[static_cast<size_t>(r)];
        in.num_tokens = t;
        in.topk_idx = plans[r].idx;
        in.topk_weights = plans[r].w;
        for (int64_t i = 0; i < t * kH; ++i) x[static_cast<size_t>(r)].push_back(bf16(0.5f + static_cast<float>(i)));
        in.x = x[static_cast<size_t>(r)];
        for (int64_t tt = 0; tt < t; ++tt)
            for (int h = 0; h < kH; ++h) bias[static_cast<size_t>(r)].push_back(y_value(100 + r, tt, h));
        for (const auto& b : bias_nan)
            if (b.rank == r) bias[static_cast<size_t>(r)][static_cast<size_t>(b.token * kH + b.channel)] = b.bits;
    }
    auto groups = ThreadGroup::create(kR);
    std::vector<Observed> got(kR);
    std::vector<std::vector<uint16_t>> ys(kR), outs(kR);
    int poisoned_rows = 0;
    std::mutex mu;
    auto errors = run_ranks(kR, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        const auto& in = inputs[static_cast<size_t>(r)];
        const int64_t t = in.num_tokens;
        std::vector<int64_t> idx = in.topk_idx;
        std::vector<float> w = in.topk_weights;
        DispatchArgs a;
        a.x = TensorRef::contiguous(x[static_cast<size_t>(r)].data(), DType::kBFloat16, {t, kH});
        a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt64, {t, 2});
        a.topk_weights = TensorRef::contiguous(w.data(), DType::kFloat32, {t, 2});
        DispatchResult d = buf->dispatch(a);
        Observed o = observe(d, cfg);
        auto& y = ys[static_cast<size_t>(r)];
        y.resize(static_cast<size_t>(o.rows * kH));
        for (int64_t row = 0; row < o.rows; ++row) {
            const int32_t src = o.recv_src[static_cast<size_t>(row)];
            const int expert = r * 2 + o.m_indices[static_cast<size_t>(row)];
            for (int h = 0; h < kH; ++h) {
                uint16_t v = y_value(r, row, h);
                for (const auto& p : poison)
                    if (p.holder == r && src == p.src * 4 + p.token && p.expert == expert && p.channel == h) {
                        v = p.bits;
                        std::lock_guard<std::mutex> lock(mu);
                        ++poisoned_rows;
                    }
                y[static_cast<size_t>(row * kH + h)] = v;
            }
        }
        CombineArgs c;
        c.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape);
        c.bias = TensorRef::contiguous(bias[static_cast<size_t>(r)].data(), DType::kBFloat16, {t, kH});
        CombineResult cr = buf->combine(std::move(d.handle), c);
        outs[static_cast<size_t>(r)] = read_2d<uint16_t>(cr.out, t, kH);
        got[static_cast<size_t>(r)] = std::move(o);
    });
    ASSERT_TRUE(all_ok(errors));
    ASSERT_EQ(poisoned_rows, static_cast<int>(poison.size()));  // every poison landed on a real row
    const ref::DispatchOptions opt;
    const auto want_dispatch = ref::dispatch(cfg, kR, inputs, opt);
    for (int r = 0; r < kR; ++r)
        expect_dispatch_equal(want_dispatch[static_cast<size_t>(r)], got[static_cast<size_t>(r)], cfg, false,
                              "rank " + std::to_string(r));
    const auto want = ref::combine(cfg, kR, inputs, opt, ys, true, bias);
    for (int r = 0; r < kR; ++r) {
        const auto& o = outs[static_cast<size_t>(r)];
        for (size_t i = 0; i < o.size(); ++i) {
            const int t = static_cast<int>(i / kH), h = static_cast<int>(i % kH);
            bool expect_nan = false;
            for (const auto& n : nan_at) expect_nan = expect_nan || (n[0] == r && n[1] == t && n[2] == h);
            if (expect_nan) {
                EXPECT_EQ(o[i], 0x7fc0) << "rank " << r << " token " << t << " channel " << h << std::hex << ": 0x"
                                        << o[i];
            } else {
                EXPECT_FALSE(std::isnan(from_bf16(o[i]))) << "rank " << r << " token " << t << " channel " << h;
            }
            EXPECT_EQ(o[i], want[static_cast<size_t>(r)][i])
                << "oracle disagrees at rank " << r << " token " << t << " channel " << h;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Scale formats

struct Quantized {
    std::vector<uint8_t> q;
    std::vector<uint32_t> scales;
};

Quantized quantize(const std::vector<float>& row, ScaleFormat f) {
    std::vector<uint16_t> x;
    for (float v : row) {
        x.push_back(bf16(v));
        EXPECT_EQ(from_bf16(x.back()), v) << "test value not exact in bf16";
    }
    Quantized out;
    out.q.assign(row.size(), 0xcc);
    out.scales.assign(static_cast<size_t>(scale_columns(f, static_cast<int>(row.size()))), 0xcccccccc);
    detail::quantize_row(x.data(), static_cast<int>(row.size()), f, out.q.data(), out.scales.data());
    // the oracle agrees byte for byte
    Quantized o;
    o.q.assign(row.size(), 0);
    o.scales.assign(out.scales.size(), 0);
    ref::quantize_row(x.data(), static_cast<int>(row.size()), f, o.q.data(), o.scales.data());
    EXPECT_EQ(out.q, o.q);
    EXPECT_EQ(out.scales, o.scales);
    return out;
}

// Group 0: amax 448 (scale 1, values pass unchanged: normal, subnormal, ties); group 1: amax
// 896 from a negative element (quotient exactly 2).
std::vector<float> two_group_row() {
    std::vector<float> row(256, 0.0f);
    row[0] = 448.0f;
    row[1] = -1.0f;
    row[2] = 0.001953125f;     // 2^-9 -> 0x01
    row[3] = 0.0009765625f;    // 2^-10: tie -> 0x00
    row[4] = 0.0029296875f;    // 3*2^-10: tie -> 0x02
    row[5] = 15.0f / 1024.0f;  // tie 0x07/0x08 -> 0x08
    row[128] = -896.0f;
    row[129] = 1.0f;
    return row;
}

void expect_two_group_codes(const Quantized& r) {
    EXPECT_EQ(r.q[0], 0x7e);
    EXPECT_EQ(r.q[1], 0xb8);
    EXPECT_EQ(r.q[2], 0x01);
    EXPECT_EQ(r.q[3], 0x00);
    EXPECT_EQ(r.q[4], 0x02);
    EXPECT_EQ(r.q[5], 0x08);
    for (int i = 6; i < 128; ++i) EXPECT_EQ(r.q[static_cast<size_t>(i)], 0x00) << i;
    EXPECT_EQ(r.q[128], 0xfe);  // -896 * 0.5 = -448
    EXPECT_EQ(r.q[129], 0x30);  // 0.5
    for (int i = 130; i < 256; ++i) EXPECT_EQ(r.q[static_cast<size_t>(i)], 0x00) << i;
}

TEST(Numerics, ScalesF32G128ByHand) {
    const Quantized r = quantize(two_group_row(), ScaleFormat::kF32G128);
    ASSERT_EQ(r.scales.size(), 2u);
    EXPECT_EQ(r.scales[0], 0x3f800000u);  // 448 / 448 = 1
    EXPECT_EQ(r.scales[1], 0x40000000u);  // 896 / 448 = 2
    expect_two_group_codes(r);

    // zero group: amax floored at 1e-4; scale = 1e-4f / 448 (0x346facad)
    std::vector<float> zero(128, 0.0f);
    const Quantized z = quantize(zero, ScaleFormat::kF32G128);
    EXPECT_EQ(z.scales[0], 0x346facadu);
    for (uint8_t c : z.q) EXPECT_EQ(c, 0x00);

    // tiny values under the floor: mul = 448 / 1e-4f = 4480000; 2^-20 * 4480000 = 4.27 -> 4.5 (0x49)
    std::vector<float> tiny(128, 0.0f);
    tiny[7] = std::ldexp(1.0f, -20);
    tiny[8] = -std::ldexp(1.0f, -20);
    const Quantized t = quantize(tiny, ScaleFormat::kF32G128);
    EXPECT_EQ(t.scales[0], 0x346facadu);
    EXPECT_EQ(t.q[7], 0x49);
    EXPECT_EQ(t.q[8], 0xc9);

    // amax 900: scale 900/448 = 0x40009249, mul 448/900 = 0x3efedcbb; 900*mul = 448, 1*mul = 0.4978 -> 0.5
    std::vector<float> odd(128, 0.0f);
    odd[0] = 900.0f;
    odd[1] = 1.0f;
    const Quantized o = quantize(odd, ScaleFormat::kF32G128);
    EXPECT_EQ(o.scales[0], 0x40009249u);
    EXPECT_EQ(o.q[0], 0x7e);
    EXPECT_EQ(o.q[1], 0x30);

    // amax 1: scale 1/448 = 0x3b124925, mul 448: 1 -> 448, 0.5 -> 224
    std::vector<float> one(128, 0.0f);
    one[3] = 1.0f;
    one[4] = 0.5f;
    const Quantized u = quantize(one, ScaleFormat::kF32G128);
    EXPECT_EQ(u.scales[0], 0x3b124925u);
    EXPECT_EQ(u.q[3], 0x7e);
    EXPECT_EQ(u.q[4], 0x76);
}

TEST(Numerics, ScalesUe8m0G128ByHand) {
    const Quantized r = quantize(two_group_row(), ScaleFormat::kUE8M0G128);
    ASSERT_EQ(r.scales.size(), 1u);       // two groups packed into one word, the rest of it zero
    EXPECT_EQ(r.scales[0], 0x0000807fu);  // quotients exactly 1 and 2: bytes 127, 128
    expect_two_group_codes(r);

    // five groups -> two words; quotients: just above 2 (900), just below 2 (892), floor, 1/448, 448
    std::vector<float> row(640, 0.0f);
    row[0] = 900.0f;     // 900/448 = 2.009 -> 2^2: byte 129, q = 225 -> 224 (0x76)
    row[1] = 1.0f;       // 0.25 -> 0x28
    row[128] = -892.0f;  // 892/448 = 1.991 -> 2^1: byte 128, q = -446 -> -448 (0xfe)
    // group 2 all zero: 1e-4/448 = 2.23e-7 -> 2^-22: byte 105, q = 0
    row[384] = 1.0f;                   // 1/448 -> 2^-8: byte 119, q = 256 (0x78)
    row[385] = std::ldexp(1.0f, -20);  // * 2^8 = 2^-12: below half of 2^-9 -> 0
    row[512] = 448.0f;                 // byte 127
    const Quantized f = quantize(row, ScaleFormat::kUE8M0G128);
    ASSERT_EQ(f.scales.size(), 2u);
    EXPECT_EQ(f.scales[0], 0x77698081u);
    EXPECT_EQ(f.scales[1], 0x0000007fu);
    EXPECT_EQ(f.q[0], 0x76);
    EXPECT_EQ(f.q[1], 0x28);
    EXPECT_EQ(f.q[128], 0xfe);
    EXPECT_EQ(f.q[384], 0x78);
    EXPECT_EQ(f.q[385], 0x00);
    EXPECT_EQ(f.q[512], 0x7e);

    // under the floor: 2^-20 * 2^22 = 4 exactly (0x48)
    std::vector<float> tiny(128, 0.0f);
    tiny[9] = std::ldexp(1.0f, -20);
    const Quantized t = quantize(tiny, ScaleFormat::kUE8M0G128);
    EXPECT_EQ(t.scales[0], 105u);
    EXPECT_EQ(t.q[9], 0x48);
}

TEST(Numerics, ScalesUe8m0G32ByHand) {
    std::vector<float> row(160, 0.0f);  // five groups of 32 -> two words
    row[0] = 448.0f;                    // byte 127
    row[32] = -896.0f;                  // byte 128
    row[64] = 900.0f;                   // byte 129
    // group 3 zero: byte 105
    row[128] = 1.0f;  // byte 119, q = 256
    const Quantized r = quantize(row, ScaleFormat::kUE8M0G32);
    ASSERT_EQ(r.scales.size(), 2u);
    EXPECT_EQ(r.scales[0], 0x6981807fu);
    EXPECT_EQ(r.scales[1], 0x00000077u);
    EXPECT_EQ(r.q[0], 0x7e);
    EXPECT_EQ(r.q[32], 0xfe);
    EXPECT_EQ(r.q[64], 0x76);
    EXPECT_EQ(r.q[128], 0x78);
}

TEST(Numerics, QuantizeRowMatchesOracleOnRandomRows) {
    Rng rng(3);
    for (ScaleFormat f : {ScaleFormat::kF32G128, ScaleFormat::kUE8M0G128, ScaleFormat::kUE8M0G32}) {
        for (int trial = 0; trial < 60; ++trial) {
            const int h = 128 * rng.uniform(1, 5);
            std::vector<uint16_t> x(static_cast<size_t>(h));
            const int scale_exp = rng.uniform(-40, 40);  // whole-row magnitude, far from 1 at times
            for (auto& v : x) {
                const int kind = rng.uniform(0, 99);
                if (kind == 0)
                    v = 0x7fc0;  // NaN: ignored by amax, stays NaN
                else if (kind == 1)
                    v = 0xff80;  // -inf
                else if (kind < 6)
                    v = 0;
                else
                    v = bf16(static_cast<float>(std::ldexp(rng.unit() * 2 - 1, scale_exp + rng.uniform(-12, 0))));
            }
            if (trial % 3 == 0)  // finite rows most of the time
                for (auto& v : x)
                    if ((v & 0x7f80) == 0x7f80) v = 0x3f80;
            std::vector<uint8_t> q(static_cast<size_t>(h)), qo(static_cast<size_t>(h));
            std::vector<uint32_t> s(static_cast<size_t>(scale_columns(f, h))), so(s.size());
            detail::quantize_row(x.data(), h, f, q.data(), s.data());
            ref::quantize_row(x.data(), h, f, qo.data(), so.data());
            ASSERT_EQ(q, qo) << scale_format_name(f) << " trial " << trial;
            ASSERT_EQ(s, so) << scale_format_name(f) << " trial " << trial;
        }
    }
}

// Row-major vs MN-major recv scales: the same values, the MN-major row stride rounded up to 4.
TEST(Numerics, ScaleLayoutRowVsMnMajor) {
    for (ScaleFormat f : {ScaleFormat::kF32G128, ScaleFormat::kUE8M0G128, ScaleFormat::kUE8M0G32}) {
        BufferConfig cfg{.num_experts = 2, .num_topk = 1, .hidden = 640, .max_tokens_per_rank = 5};
        cfg.payload = Payload::kFP8;
        cfg.scale_format = f;
        auto groups = ThreadGroup::create(1);
        auto buf = Buffer::create(groups[0], cfg, BackendKind::kCPU);
        const int64_t t = 5, h = cfg.hidden, cols = scale_columns(f, 640);
        Rng rng(static_cast<uint64_t>(f) + 100);
        std::vector<uint16_t> x(static_cast<size_t>(t * h));
        for (auto& v : x) v = random_bf16(rng);
        std::vector<int32_t> idx = {0, 1, 0, 0, 1};  // M = 5 rows: MN stride 8
        std::vector<std::vector<uint32_t>> seen;
        for (bool mn : {false, true}) {
            DispatchArgs a;
            a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {t, h});
            a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {t, 1});
            a.scales_mn_major = mn;
            DispatchResult r = buf->dispatch(a);
            ASSERT_TRUE(r.recv_scales.has_value());
            ASSERT_EQ(r.recv_scales->shape, (std::vector<int64_t>{5, cols}));
            EXPECT_EQ(r.recv_scales->dtype, f == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32);
            const auto* s = static_cast<const uint32_t*>(r.recv_scales->data);
            std::vector<uint32_t> canon;
            for (int64_t row = 0; row < 5; ++row)
                for (int64_t c = 0; c < cols; ++c) canon.push_back(mn ? s[c * 8 + row] : s[row * cols + c]);
            EXPECT_EQ(r.recv_scales->stride(0), mn ? 1 : cols);
            EXPECT_EQ(r.recv_scales->stride(1), mn ? 8 : 1);
            seen.push_back(canon);
            // and the expected values: rows ordered expert 0 (tokens 0, 2, 3), expert 1 (tokens 1, 4)
            const int order[5] = {0, 2, 3, 1, 4};
            for (int row = 0; row < 5; ++row) {
                std::vector<uint8_t> q(static_cast<size_t>(h));
                std::vector<uint32_t> sc(static_cast<size_t>(cols));
                ref::quantize_row(&x[static_cast<size_t>(order[row] * h)], static_cast<int>(h), f, q.data(), sc.data());
                for (int64_t c = 0; c < cols; ++c)
                    EXPECT_EQ(canon[static_cast<size_t>(row * cols + c)], sc[static_cast<size_t>(c)]);
                EXPECT_EQ(
                    std::memcmp(static_cast<const uint8_t*>(r.recv_x.data) + row * h, q.data(), static_cast<size_t>(h)),
                    0);
            }
            buf->combine(std::move(r.handle),
                         {.y = TensorRef::contiguous(std::vector<uint16_t>(static_cast<size_t>(5 * h)).data(),
                                                     DType::kBFloat16, {5, h}),
                          .weighted = false});
        }
        EXPECT_EQ(seen[0], seen[1]) << scale_format_name(f);
    }
}

}  // namespace
}  // namespace eptest
