// Plain parameter blocks and per-element arithmetic of the grouped-GEMM adapters, shared by the
// CPU implementation (src/moe/adapters.cpp) and the CUDA kernels (repack.cuh, scales.cuh), so both
// follow one index map and one rounding rule. Host/device, no CUDA types.
//
// Arithmetic (the whole of it; everything else is byte copies):
//   fused weight:   out = bf16_rne(float(y) * w), one IEEE fp32 multiply (never contracted),
//                   every NaN -> 0x7fc0 (numerics.hpp)
//   UE8M0 byte:     biased exponent of |s| plus one when any mantissa bit is set (2^ceil(log2|s|)),
//                   0 for s = 0, 255 for Inf/NaN; group g in byte g % 4 of word g / 4, unused bytes 0
//   segment starts: start_0 = 0, start_{l+1} = start_l + round_up(clamped count_l, A) (int64, then int32)
#pragma once

#include <cstdint>

#include "core/hd.hpp"
#include "core/limits.hpp"
#include "core/numerics.hpp"

namespace elasticep::kernels::moe {

using ::elasticep::kMaxLocalExperts;  // core/limits.hpp: per-block tables in shared memory
inline constexpr int kThreads = 256;  // threads per block of every adapter kernel
inline constexpr int kWarps = kThreads / 32;

// Fault bits (serving.hpp AdapterFault).
inline constexpr int32_t kFaultCount = 1;
inline constexpr int32_t kFaultRows = 2;
inline constexpr int32_t kFaultLayout = 4;

// Rows of bytes: element (b, r) starts at data + b * batch_stride + r * row_stride.
struct Rows {
    uint8_t* data = nullptr;
    int64_t batch_stride = 0;  // bytes
    int64_t row_stride = 0;    // bytes
};

// 4-byte scale elements (fp32 or packed int32), element (b, r, g) at data[b*sb + r*sr + g*sg].
struct Scales {
    uint32_t* data = nullptr;
    int64_t sb = 0, sr = 0, sg = 0;  // elements
};

struct MaskedToContiguousParams {
    int num_experts = 0;    // E_local
    int64_t slab_rows = 0;  // S
    int alignment = 1;      // A
    int64_t out_rows = 0;   // Mc
    int64_t row_bytes = 0;  // W * element size
    int64_t hidden = 0;     // W (elements; bf16 when fusing)
    Rows x;                 // [E_local][S]
    Rows out_x;             // [Mc]
    const int32_t* masked_m = nullptr;
    int scale_groups = 0;              // 0: no scales
    Scales scales;                     // [E_local][S][G]
    Scales out_scales;                 // [Mc][G]
    int32_t* out_offsets = nullptr;    // [E_local + 1]
    int32_t* out_m_indices = nullptr;  // [Mc] or null
    const float* weights = nullptr;    // [Mc] or null (fused, bf16 rows)
    int32_t* status = nullptr;
};

struct ContiguousToMaskedParams {
    int num_experts = 0;
    int64_t slab_rows = 0;  // S
    int64_t in_rows = 0;    // Mc
    int64_t row_bytes = 0;
    int64_t hidden = 0;
    Rows x;      // [Mc]
    Rows out_x;  // [E_local][S]
    const int32_t* counts = nullptr;
    const int32_t* offsets = nullptr;
    int scale_groups = 0;
    Scales scales;      // [Mc][G]
    Scales out_scales;  // [E_local][S][G]
    int32_t* out_masked_m = nullptr;
    const float* weights = nullptr;  // [E_local][S] at weight_stride per expert
    int64_t weight_stride = 0;
    int32_t* status = nullptr;
};

struct MIndicesParams {
    int num_experts = 0;
    int64_t rows = 0;
    const int32_t* counts = nullptr;
    const int32_t* offsets = nullptr;
    int32_t* m_indices = nullptr;
    int32_t* status = nullptr;
};

struct RouteWeightParams {
    bool masked = false;
    int num_experts = 0;    // masked
    int64_t slab_rows = 0;  // masked: S; contiguous: M
    int64_t hidden = 0;
    Rows y, out;  // bf16 rows: masked [E][S], contiguous [M]
    const float* weights = nullptr;
    int64_t weight_stride = 0;           // masked: per expert
    const int32_t* counts = nullptr;     // masked
    const int32_t* m_indices = nullptr;  // contiguous
    int32_t* status = nullptr;
};

// convert_scale_layout (to_ue8m0 = false) and fp32_scales_to_ue8m0 (to_ue8m0 = true).
struct ScaleConvertParams {
    int64_t batch = 1, rows = 0, groups = 0;  // groups: destination columns
    int64_t src_groups = 0;                   // source columns (== groups, or the fp32 groups for ue8m0)
    Scales src, dst;
    int64_t dst_pad_rows = 0;  // > rows: dst is MN-major, lanes [rows, dst_pad_rows) of each column are zeroed
    bool to_ue8m0 = false;
};

// ---- per-element arithmetic ----

ELASTICEP_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

ELASTICEP_HD uint16_t weighted_bf16(uint16_t y, float w) {
    return num::float_to_bf16(mul_rn(num::bf16_to_float(y), w));
}

ELASTICEP_HD uint32_t ue8m0_byte(uint32_t fp32_bits) {
    const uint32_t a = fp32_bits & 0x7fffffffu;
    if (a == 0) return 0;
    return num::ue8m0_exponent_byte(num::bits_float(a));
}

// Word w of packed UE8M0 scales from fp32 groups [4w, 4w + 4) of one row.
ELASTICEP_HD uint32_t ue8m0_word(const Scales& s, int64_t b, int64_t r, int64_t w, int64_t groups) {
    uint32_t word = 0;
    for (int j = 0; j < 4; ++j) {
        const int64_t g = 4 * w + j;
        if (g < groups) word |= ue8m0_byte(s.data[b * s.sb + r * s.sr + g * s.sg]) << (8 * j);
    }
    return word;
}

// A count as the adapters use it: negative -> 0 (layout fault), above `cap` -> cap (count fault).
ELASTICEP_HD int64_t clamp_count(int32_t c, int64_t cap, int32_t& faults) {
    if (c < 0) {
        faults |= kFaultLayout;
        return 0;
    }
    if (c > cap) {
        faults |= kFaultCount;
        return cap;
    }
    return c;
}

// Rows [o0, o0 + result) of a contiguous segment that may be read or written, for a segment given by
// (count, offsets[l], offsets[l + 1]) and a tensor of `rows` rows; cap: rows per expert on the other side.
ELASTICEP_HD int64_t segment_rows(int32_t count, int32_t o0, int32_t o1, int64_t cap, int64_t rows, int32_t& faults) {
    int64_t c = clamp_count(count, cap, faults);
    if (o0 < 0 || o1 < o0 || int64_t{o1} - o0 < c) {
        faults |= kFaultLayout;
        return 0;
    }
    if (int64_t{o0} + c > rows) {
        faults |= kFaultRows;
        c = int64_t{o0} < rows ? rows - o0 : 0;
    }
    return c;
}

ELASTICEP_HD int64_t round_up_a(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

}  // namespace elasticep::kernels::moe
