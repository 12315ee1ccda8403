// The dense MoE reference: one token at a time through its top-k experts (no dispatch, no
// layout), in double precision from the exact inputs and the exact (dequantized) weights, plus the
// error the tested path may show, propagated alongside every value. Tests and `elasticep bench
// --moe-layer` compare the layer against it. Nothing here is shared with the code under test.
//
// Error model (docs/SERVING.md derives it). Every rounding of a value v to a format with unit
// roundoff u (bf16 2^-8, E4M3 2^-4, fp32 2^-24) contributes an error |d| <= u|v| (E4M3 also an
// absolute 2^-10 s below its normal range, s the group scale), taken as independent and uniform:
// variance (u v)^2 / 3 (an upper estimate: the error of a value in [2^e, 2^(e+1)) is at most
// 2^(e-p), so u|v| overstates it by up to 2x). Each stage propagates to first order:
//   x~  (FP8 dispatch)  var_x = (u8 x)^2/3 + (2^-10 s)^2/3,    worst_x = u8|x| + 2^-10 s
//   g = W1 x           var_g = sum W^2 var_x + acc + out,      worst_g = sum |W| worst_x + ...
//   h = silu(a) * b    var_h = silu'(a)^2 b^2 var_a + silu(a)^2 var_b + requant/rounding of h
//   y = W2 h           as g
//   out = sum_k w_k y_k (+ shared)  var = sum w^2 var_y + bf16 roundings of route products,
//                                   per-rank partials and the output
// where acc = accumulation (u_acc = 2^-13 per product, for tensor-core FP8 accumulators) and out =
// the bf16 rounding of the GEMM output; with dequant_operands the bf16 rounding of both GEMM
// operands is added. sigma = sqrt(var) predicts the RMS error; worst is a first-order worst case
// (x2 for second-order terms when checked). A correct layer has RMS(err) / RMS(sigma) below 1
// (about 0.5 in practice) and every |err| <= 2 * worst; a wrong expert, weight or row gives errors
// of the size of the values themselves, tens of sigmas.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/parallel.hpp"
#include "elasticep/serving.hpp"

namespace elasticep::moe_ref {

inline constexpr double kU8 = 1.0 / 16;       // E4M3: 4 significant bits
inline constexpr double kUb = 1.0 / 256;      // bf16: 8 significant bits
inline constexpr double kUacc = 1.0 / 8192;   // accumulation, per product magnitude
inline constexpr double kSub = 1.0 / 1024;    // E4M3 absolute error below 2^-6, in units of the scale
inline constexpr double kSiluSlope = 1.0999;  // max |silu'(v)|

inline double e4m3_value(uint8_t c) {  // the OCP definition, written out on its own
    const int s = c >> 7, e = (c >> 3) & 0xf, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    return s ? -v : v;
}

inline double bf16_value(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// One expert's weights on the host: bf16 bits, or E4M3 codes with fp32 128x128 block scales.
struct ExpertView {
    ExpertQuantKind kind = ExpertQuantKind::kBF16;
    int64_t hidden = 0, inter = 0;
    const void* w1 = nullptr;   // [2I][H]
    const float* s1 = nullptr;  // [2I/128][H/128]
    const void* w2 = nullptr;   // [H][I]
    const float* s2 = nullptr;  // [H/128][I/128]
};

struct ErrorModel {
    bool fp8 = false;               // activations are quantized to E4M3 (dispatch and before the down GEMM)
    bool dequant_operands = false;  // the GEMMs ran on bf16-rounded dequantized operands
};

// A vector with its propagated error: value, variance and first-order worst case.
struct Tracked {
    std::vector<double> v, var, worst;
    explicit Tracked(size_t n = 0) : v(n, 0.0), var(n, 0.0), worst(n, 0.0) {}
};

// The E4M3 1x128-group quantization error of `t` (amax / 448 scales, or up to 2x that for UE8M0).
inline void add_fp8_quantization(Tracked& t, int64_t group = 128) {
    const int64_t n = static_cast<int64_t>(t.v.size());
    for (int64_t g0 = 0; g0 < n; g0 += group) {
        double amax = 1e-4;
        for (int64_t i = g0; i < g0 + group && i < n; ++i) amax = std::fmax(amax, std::fabs(t.v[i]));
        const double s = 2.0 * amax / 448.0;  // covers fp32 (amax/448) and rounded-up UE8M0 scales
        for (int64_t i = g0; i < g0 + group && i < n; ++i) {
            const double w = kU8 * std::fabs(t.v[i]) + kSub * s;
            t.var[i] += w * w / 3.0;
            t.worst[i] += w;
        }
    }
}

inline void add_rounding(Tracked& t, double u) {
    for (size_t i = 0; i < t.v.size(); ++i) {
        const double w = u * std::fabs(t.v[i]);
        t.var[i] += w * w / 3.0;
        t.worst[i] += w;
    }
}

// out[n] = sum_k W[n][k] in[k] for W [n_out][k] (bf16 bits or E4M3 with 128x128 block scales).
inline Tracked gemv(const ExpertView& e, const void* w, const float* s, int64_t n_out, int64_t k, const Tracked& in,
                    const ErrorModel& m) {
    Tracked out(static_cast<size_t>(n_out));
    double lut[256];
    for (int c = 0; c < 256; ++c) lut[c] = e4m3_value(static_cast<uint8_t>(c));
    const bool fp8 = e.kind == ExpertQuantKind::kFP8Block128;
    std::vector<double> row(static_cast<size_t>(k));
    for (int64_t n = 0; n < n_out; ++n) {
        if (fp8) {
            const uint8_t* q = static_cast<const uint8_t*>(w) + n * k;
            const float* sr = s + (n / 128) * (k / 128);
            for (int64_t j = 0; j < k; ++j) row[j] = lut[q[j]] * sr[j / 128];
        } else {
            const uint16_t* q = static_cast<const uint16_t*>(w) + n * k;
            for (int64_t j = 0; j < k; ++j) row[j] = bf16_value(q[j]);
        }
        double v = 0, var = 0, worst = 0, mag = 0, mag2 = 0;
        for (int64_t j = 0; j < k; ++j) {
            const double wj = row[j], xj = in.v[j];
            v += wj * xj;
            var += wj * wj * in.var[j];
            worst += std::fabs(wj) * in.worst[j];
            mag += std::fabs(wj * xj);
            mag2 += wj * wj * xj * xj;
        }
        const double u_op = m.dequant_operands ? 2 * kUb : 0.0;  // both operands rounded to bf16
        const double u_acc = kUacc + static_cast<double>(k) / 16777216.0;
        out.v[n] = v;
        out.var[n] = var + (u_acc * u_acc + u_op * u_op) * mag2 / 3.0;
        out.worst[n] = worst + (u_acc + u_op) * mag;
    }
    add_rounding(out, kUb);  // the GEMM writes bf16
    return out;
}

// One token row x (exact values) through one expert, with the error of the tested path.
inline Tracked ffn(const ExpertView& e, const Tracked& x, const ErrorModel& m) {
    const int64_t h = e.hidden, i = e.inter;
    const Tracked g = gemv(e, e.w1, e.s1, 2 * i, h, x, m);
    Tracked act(static_cast<size_t>(i));
    for (int64_t j = 0; j < i; ++j) {
        const double a = g.v[j], b = g.v[i + j];
        const double sig = 1.0 / (1.0 + std::exp(-a));
        const double silu = a * sig;
        act.v[j] = silu * b;
        act.var[j] = kSiluSlope * kSiluSlope * b * b * g.var[j] + silu * silu * g.var[i + j];
        act.worst[j] = kSiluSlope * std::fabs(b) * g.worst[j] + std::fabs(silu) * g.worst[i + j];
        const double w = 4.0 / 16777216.0 * std::fabs(act.v[j]);  // fp32 evaluation of silu * up
        act.var[j] += w * w / 3.0;
        act.worst[j] += w;
    }
    if (m.fp8)
        add_fp8_quantization(act);
    else
        add_rounding(act, kUb);
    return gemv(e, e.w2, e.s2, h, i, act, m);
}

// A bf16 token row as the reference input, with the dispatch's quantization error when FP8.
inline Tracked input_row(const uint16_t* x, int64_t h, const ErrorModel& m) {
    Tracked t(static_cast<size_t>(h));
    for (int64_t k = 0; k < h; ++k) t.v[k] = bf16_value(x[k]);
    if (m.fp8) add_fp8_quantization(t);
    return t;
}

// One token's MoE output: sum over its routes of w_k * FFN_{e_k}(x), plus the shared expert's
// FFN(x) when given, with combine's roundings: each route product (adapter placement), each
// destination rank's partial and the output are bf16.
template <class ExpertOf>
Tracked moe_token(const uint16_t* x, int64_t h, const int64_t* idx, const float* w, int k, ExpertOf&& expert_of,
                  const ExpertView* shared, const ErrorModel& m) {
    const Tracked in = input_row(x, h, m);
    Tracked out(static_cast<size_t>(h));
    std::vector<double> route_abs(static_cast<size_t>(h), 0.0);  // sum_k |w_k y_k|
    for (int r = 0; r < k; ++r) {
        if (idx[r] < 0) continue;
        const Tracked y = ffn(expert_of(idx[r]), in, m);
        const double wr = w ? w[r] : 1.0;
        for (int64_t n = 0; n < h; ++n) {
            out.v[n] += wr * y.v[n];
            out.var[n] += wr * wr * y.var[n];
            out.worst[n] += std::fabs(wr) * y.worst[n];
            route_abs[n] += std::fabs(wr * y.v[n]);
        }
    }
    for (int64_t n = 0; n < h; ++n) {
        // the bf16 route products (adapter placement) and the bf16 per-rank partials, each at most
        // u_b * sum_k |w_k y_k| in total
        const double p = 2 * kUb * route_abs[n];
        out.var[n] += p * p / 3.0;
        out.worst[n] += p;
    }
    if (shared) {
        const Tracked s = ffn(*shared, in, m);
        for (int64_t n = 0; n < h; ++n) {
            out.v[n] += s.v[n];
            const double p = kUb * std::fabs(s.v[n]);  // the bias is bf16
            out.var[n] += s.var[n] + p * p / 3.0;
            out.worst[n] += s.worst[n] + p;
        }
    }
    add_rounding(out, kUb);  // the combine output
    return out;
}

// fn(i) for i in [0, n) on up to `threads` threads (the reference is the slow part of a check)
using detail::hardware_threads;
using detail::parallel_for;

// How far a tested output is from the reference, in the model's units.
struct Comparison {
    int64_t elements = 0;
    double max_abs_err = 0, rms_err = 0, rms_sigma = 0, max_sigmas = 0, max_worst_ratio = 0;
    int64_t nonfinite = 0;
    double rms_ratio() const { return rms_sigma > 0 ? rms_err / rms_sigma : (rms_err > 0 ? INFINITY : 0.0); }
    // The layer passes when its RMS error is within 1.5x the predicted RMS and no element exceeds 2x
    // its first-order worst case.
    bool pass() const { return nonfinite == 0 && rms_ratio() <= 1.5 && max_worst_ratio <= 2.0; }
    void add(double got, const Tracked& ref, int64_t n) {
        ++elements;
        const double err = std::fabs(got - ref.v[n]);
        if (!std::isfinite(got)) {
            ++nonfinite;
            return;
        }
        const double sigma = std::sqrt(ref.var[n]);
        max_abs_err = std::fmax(max_abs_err, err);
        rms_err += err * err;
        rms_sigma += ref.var[n];
        if (sigma > 0) max_sigmas = std::fmax(max_sigmas, err / sigma);
        const double wc = ref.worst[n] > 0 ? err / ref.worst[n] : (err > 0 ? INFINITY : 0.0);
        max_worst_ratio = std::fmax(max_worst_ratio, wc);
    }
    void finish() {
        if (elements) {
            rms_err = std::sqrt(rms_err / static_cast<double>(elements));
            rms_sigma = std::sqrt(rms_sigma / static_cast<double>(elements));
        }
    }
};

}  // namespace elasticep::moe_ref
