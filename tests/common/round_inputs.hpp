// Inputs of one dispatch -> combine round, shared by the GPU tests (ranks as threads) and the MPI
// test (ranks as processes): seeded random bf16 bit patterns, top-k rows, weights, bias, and the
// DispatchArgs over them. No test framework here, so programs without GoogleTest can use it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "elasticep/elasticep.hpp"

namespace elasticep::roundgen {

// A random bf16 bit pattern: mostly magnitudes around 1, sometimes large, tiny, zero or (where
// allowed) NaN, never Inf. Drawn as bits so no float->bf16 conversion of the code under test is used.
inline uint16_t random_bf16(std::mt19937_64& g, bool allow_nan = false) {
    const uint64_t r = g();
    const uint16_t sign = static_cast<uint16_t>((r & 1) << 15);
    const uint16_t mant = static_cast<uint16_t>((r >> 1) & 0x7f);
    const int mode = static_cast<int>((r >> 8) % 64);
    int exp = 127 - 4 + static_cast<int>((r >> 16) % 8);  // [2^-4, 2^4)
    if (mode == 0) exp = 127 + 10 + static_cast<int>((r >> 24) % 8);
    if (mode == 1) exp = 127 - 30 + static_cast<int>((r >> 24) % 8);
    if (mode == 2) return sign;  // +-0
    if (mode == 3 && allow_nan) return 0x7fc0;
    return static_cast<uint16_t>(sign | (exp << 7) | mant);
}

// One rank's inputs, host-resident.
struct Inputs {
    int64_t t = 0;
    std::vector<uint16_t> x;       // bf16 [T, H]
    std::vector<uint8_t> x_fp8;    // pre-quantized [T, H]
    std::vector<uint32_t> scales;  // pre-quantized [T, scale_columns]
    std::vector<int64_t> idx64;    // [T, K]
    std::vector<int32_t> idx32;
    std::vector<float> w;          // [T, K] or empty
    std::vector<uint16_t> bias;    // [T, H] or empty
};

// Distinct experts per token, 1 in 8 routes -1, 1 in 16 tokens with no route at all; with `hot`
// most tokens route to expert 0 first (one crowded expert). x may hold NaNs.
inline Inputs make_inputs(const BufferConfig& c, int64_t t, uint64_t seed, bool prequant, bool weights, bool bias,
                          bool hot = false) {
    std::mt19937_64 g(seed);
    Inputs in;
    in.t = t;
    const int64_t h = c.hidden, k = c.num_topk;
    if (prequant) {
        in.x_fp8.resize(static_cast<size_t>(t * h));
        for (auto& b : in.x_fp8) b = static_cast<uint8_t>(g());
        in.scales.resize(static_cast<size_t>(t * scale_columns(c.scale_format, c.hidden)));
        for (auto& s : in.scales) s = static_cast<uint32_t>(g());
    } else {
        in.x.resize(static_cast<size_t>(t * h));
        for (auto& v : in.x) v = random_bf16(g, true);
    }
    in.idx64.assign(static_cast<size_t>(t * k), -1);
    for (int64_t i = 0; i < t; ++i) {
        if (g() % 16 == 0) continue;  // a token with no routes at all
        std::vector<int64_t> row;
        while (static_cast<int64_t>(row.size()) < k) {
            const bool crowd = hot && row.empty() && g() % 4 != 0;
            const int64_t e = crowd ? 0 : static_cast<int64_t>(g() % static_cast<uint64_t>(c.num_experts));
            if (std::find(row.begin(), row.end(), e) == row.end()) row.push_back(e);
        }
        for (int64_t j = 0; j < k; ++j)
            in.idx64[static_cast<size_t>(i * k + j)] = g() % 8 == 0 ? -1 : row[static_cast<size_t>(j)];
    }
    in.idx32.assign(in.idx64.begin(), in.idx64.end());
    if (weights) {
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        in.w.resize(static_cast<size_t>(t * k));
        for (auto& v : in.w) v = u(g);
    }
    if (bias) {
        in.bias.resize(static_cast<size_t>(t * h));
        for (auto& v : in.bias) v = random_bf16(g, false);
    }
    return in;
}

// DispatchArgs over x (bf16, or fp8 + scales when `prequant`), topk_idx and topk_weights at the given
// addresses (host or device). `sc` is any scenario with the fields layout, alignment, host_sync,
// zero_padding, mn_major, weights and idx64.
template <class Scenario>
DispatchArgs dispatch_args(const BufferConfig& c, const Scenario& sc, bool prequant, int64_t t, const void* x,
                           const void* xs, const void* idx, const void* w, Device d) {
    const int64_t h = c.hidden, k = c.num_topk;
    const DType sdt = c.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32;
    DispatchArgs a;
    a.x = TensorRef::contiguous(const_cast<void*>(x), prequant ? DType::kFloat8E4M3 : DType::kBFloat16, {t, h}, d);
    if (prequant)
        a.x_scales = TensorRef::contiguous(const_cast<void*>(xs), sdt, {t, int64_t{scale_columns(c.scale_format, c.hidden)}}, d);
    a.topk_idx = TensorRef::contiguous(const_cast<void*>(idx), sc.idx64 ? DType::kInt64 : DType::kInt32, {t, k}, d);
    if (sc.weights) a.topk_weights = TensorRef::contiguous(const_cast<void*>(w), DType::kFloat32, {t, k}, d);
    a.layout = sc.layout;
    a.expert_alignment = sc.alignment;
    a.host_sync = sc.host_sync;
    a.zero_padding = sc.zero_padding;
    a.scales_mn_major = sc.mn_major;
    return a;
}

// The result's tensors without the handle (combine consumes the handle before the outputs are read;
// they stay valid until the buffer's next dispatch).
inline DispatchResult views_of(const DispatchResult& r) {
    DispatchResult v;
    v.layout = r.layout;
    v.recv_x = r.recv_x;
    v.recv_scales = r.recv_scales;
    v.recv_weights = r.recv_weights;
    v.recv_src = r.recv_src;
    v.m_indices = r.m_indices;
    v.counts = r.counts;
    v.offsets = r.offsets;
    v.masked_m = r.masked_m;
    v.num_rows = r.num_rows;
    return v;
}

}  // namespace elasticep::roundgen
