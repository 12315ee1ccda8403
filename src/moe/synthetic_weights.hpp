// Synthetic expert weights for tests and `elasticep bench --moe-layer`: seeded, a pure function of
// (seed, expert, element) so ranks and threads can each make their own slice, scaled so that
// activations stay O(1) through the FFN (uniform entries of variance 1/K per dot product of
// length K). FP8: every 128x128 block gets its own scale in [0.5, 1] x the bf16 amplitude / 448,
// and its codes are the E4M3 rounding of uniform values in +-448.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "core/numerics.hpp"
#include "elasticep/serving.hpp"
#include "moe/dense_reference.hpp"

namespace elasticep::moe_ref {

inline uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

inline double unit(uint64_t seed, uint64_t a, uint64_t b) {  // in [0, 1)
    return static_cast<double>(mix64(seed ^ mix64(a * 0x100000001b3ull + b)) >> 11) * (1.0 / 9007199254740992.0);
}

struct SyntheticExperts {
    ExpertQuantKind kind = ExpertQuantKind::kBF16;
    int64_t experts = 0, hidden = 0, inter = 0;
    std::vector<uint8_t> w1, w2;  // [E][2I][H] and [E][H][I]: E4M3 codes, or bf16 bits (2 bytes each)
    std::vector<float> s1, s2;    // [E][2I/128][H/128] and [E][H/128][I/128] (FP8)

    int64_t elem() const { return kind == ExpertQuantKind::kFP8Block128 ? 1 : 2; }
    ExpertView view(int64_t l) const {
        ExpertView v;
        v.kind = kind;
        v.hidden = hidden;
        v.inter = inter;
        v.w1 = w1.data() + l * 2 * inter * hidden * elem();
        v.w2 = w2.data() + l * hidden * inter * elem();
        if (kind == ExpertQuantKind::kFP8Block128) {
            v.s1 = s1.data() + l * (2 * inter / 128) * (hidden / 128);
            v.s2 = s2.data() + l * (hidden / 128) * (inter / 128);
        }
        return v;
    }
    // The weights of local experts [first, first + count) as host tensors (views into this object).
    ExpertWeights tensors(int64_t first, int64_t count) const {
        ExpertWeights w;
        w.kind = kind;
        w.hidden = static_cast<int>(hidden);
        w.intermediate = static_cast<int>(inter);
        const DType dt = kind == ExpertQuantKind::kFP8Block128 ? DType::kFloat8E4M3 : DType::kBFloat16;
        w.gate_up = TensorRef::contiguous(const_cast<uint8_t*>(w1.data()) + first * 2 * inter * hidden * elem(), dt,
                                          {count, 2 * inter, hidden});
        w.down = TensorRef::contiguous(const_cast<uint8_t*>(w2.data()) + first * hidden * inter * elem(), dt,
                                       {count, hidden, inter});
        if (kind == ExpertQuantKind::kFP8Block128) {
            w.gate_up_scales =
                TensorRef::contiguous(const_cast<float*>(s1.data()) + first * (2 * inter / 128) * (hidden / 128),
                                      DType::kFloat32, {count, 2 * inter / 128, hidden / 128});
            w.down_scales =
                TensorRef::contiguous(const_cast<float*>(s2.data()) + first * (hidden / 128) * (inter / 128),
                                      DType::kFloat32, {count, hidden / 128, inter / 128});
        }
        return w;
    }
};

// Fills one [n][k] matrix of expert `e` (tag separates gate/up from down).
inline void fill_matrix(ExpertQuantKind kind, uint64_t seed, uint64_t tag, int64_t n, int64_t k, uint8_t* w, float* s) {
    const double amp = std::sqrt(3.0 / static_cast<double>(k));
    if (kind == ExpertQuantKind::kFP8Block128) {
        const int64_t kb = k / 128;
        for (int64_t bn = 0; bn < n / 128; ++bn)
            for (int64_t bk = 0; bk < kb; ++bk)
                s[bn * kb + bk] = static_cast<float>(
                    amp * (0.5 + 0.5 * unit(seed, tag ^ 0x5ca1e, static_cast<uint64_t>(bn * kb + bk))) / 448.0);
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < k; ++j) {
                const double u = unit(seed, tag, static_cast<uint64_t>(i * k + j));
                w[i * k + j] = num::float_to_e4m3(static_cast<float>((2.0 * u - 1.0) * 448.0));
            }
    } else {
        auto* b = reinterpret_cast<uint16_t*>(w);
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < k; ++j) {
                const double u = unit(seed, tag, static_cast<uint64_t>(i * k + j));
                b[i * k + j] = num::float_to_bf16(static_cast<float>((2.0 * u - 1.0) * amp));
            }
    }
}

// Experts [first, first + count) of a model with `seed` (expert ids are global: every rank that
// makes expert e makes the same bytes). Spread over `threads` threads.
inline SyntheticExperts make_synthetic_experts(ExpertQuantKind kind, int64_t first, int64_t count, int64_t hidden,
                                               int64_t inter, uint64_t seed, int threads = 1) {
    SyntheticExperts x;
    x.kind = kind;
    x.experts = count;
    x.hidden = hidden;
    x.inter = inter;
    const int64_t es = x.elem();
    x.w1.resize(static_cast<size_t>(count * 2 * inter * hidden * es));
    x.w2.resize(static_cast<size_t>(count * hidden * inter * es));
    const bool fp8 = kind == ExpertQuantKind::kFP8Block128;
    if (fp8) {
        x.s1.resize(static_cast<size_t>(count * (2 * inter / 128) * (hidden / 128)));
        x.s2.resize(static_cast<size_t>(count * (hidden / 128) * (inter / 128)));
    }
    auto work = [&](int64_t l) {
        const uint64_t e = static_cast<uint64_t>(first + l);
        fill_matrix(kind, seed, 2 * e + 1, 2 * inter, hidden, x.w1.data() + l * 2 * inter * hidden * es,
                    fp8 ? x.s1.data() + l * (2 * inter / 128) * (hidden / 128) : nullptr);
        fill_matrix(kind, seed, 2 * e + 2, hidden, inter, x.w2.data() + l * hidden * inter * es,
                    fp8 ? x.s2.data() + l * (hidden / 128) * (inter / 128) : nullptr);
    };
    const int t = std::max(1, std::min<int>(threads, static_cast<int>(count)));
    std::vector<std::thread> pool;
    for (int i = 0; i < t; ++i)
        pool.emplace_back([&, i] {
            for (int64_t l = i; l < count; l += t) work(l);
        });
    for (auto& th : pool) th.join();
    return x;
}

}  // namespace elasticep::moe_ref
