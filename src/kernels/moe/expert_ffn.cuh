// Device steps of the reference MoE layer's GPU path around its cuBLASLt GEMMs (host:
// src/moe/moe_layer_cuda.cu). Per local expert with m real rows and m_pad = round_up(m, 16):
//   gather_kernel    source rows r < m -> packed scratch [m_pad][H] (fp8 or bf16; rows >= m zeroed),
//                    activation scales -> fp32 MN-major [H/128][m_pad] (what cuBLASLt's VEC128_32F
//                    reads), or (dequant) bf16 rows bf16(e4m3(q) * s)
//   quantize_kernel  bf16 rows [T][H] -> the same scratch (dense shared-expert path; dispatch's
//                    f32_g128 formula)
//   act_fp8_kernel   G [m_pad][2I] bf16 -> h = silu(G[:, :I]) * G[:, I:] in fp32, quantized per 1x128
//                    group (fp8 [m_pad][I] + fp32 MN-major [I/128][m_pad]), or dequantized back to
//                    bf16 (the dequant path)
//   act_bf16_kernel  the same without quantization: h rounded to bf16
//   scatter_kernel   Y [m_pad][H] bf16 rows r < m -> destination rows
//   dequant_weights_kernel  fp8 [N][K] with 128x128 fp32 block scales -> bf16 (once, dequant path)
// One warp per row (or per row and 128-group); grids depend on shapes only. Memory owned: none.
// Launch contract: <<<grid >= 1, kThreads>>> (grid-stride loops), H and I multiples of 128 on the
// FP8 paths, scratch buffers non-overlapping with their sources.
#pragma once

#include <cstdint>

#include "core/numerics.hpp"
#include "kernels/moe/adapter_params.hpp"

namespace elasticep::kernels::moe {

struct GatherParams {
    const uint8_t* src = nullptr;  // row 0 of the expert's rows
    int64_t src_row_stride = 0;    // bytes
    int64_t rows = 0, rows_pad = 0, hidden = 0;
    bool fp8 = false;                  // source rows are E4M3 (else bf16)
    const uint32_t* scales = nullptr;  // row 0's scales (fp8 only)
    int64_t scale_sr = 0, scale_sg = 0;
    bool ue8m0 = false;           // packed UE8M0 words (else fp32)
    bool dequant = false;         // write bf16 = bf16(e4m3(q) * s) instead of q and scales
    uint8_t* dst = nullptr;       // [rows_pad][hidden] fp8 or bf16
    float* dst_scales = nullptr;  // [hidden/128][rows_pad]
};

struct QuantizeParams {
    const uint16_t* x = nullptr;  // bf16 rows
    int64_t x_row_stride = 0;     // elements
    int64_t rows = 0, rows_pad = 0, hidden = 0;
    bool dequant = false;
    uint8_t* dst = nullptr;       // fp8 [rows_pad][hidden], or bf16 when dequant
    float* dst_scales = nullptr;  // [hidden/128][rows_pad]
};

struct ActParams {
    const uint16_t* g = nullptr;  // [rows_pad][2I] bf16
    int64_t rows_pad = 0, inter = 0;
    bool dequant = false;
    uint8_t* h = nullptr;       // fp8 [rows_pad][I] (bf16 when dequant or on the bf16 path)
    float* h_scales = nullptr;  // [I/128][rows_pad]
};

struct ScatterParams {
    const uint16_t* y = nullptr;  // [rows_pad][hidden]
    int64_t rows = 0, hidden = 0;
    uint16_t* dst = nullptr;     // row 0 of the destination rows
    int64_t dst_row_stride = 0;  // elements
};

struct DequantWeightsParams {
    const uint8_t* w = nullptr;     // [n][k] E4M3
    const float* scales = nullptr;  // [n/128][k/128]
    int64_t n = 0, k = 0;
    uint16_t* out = nullptr;  // [n][k] bf16
};

__device__ __forceinline__ float scale_of(const GatherParams& p, int64_t r, int64_t g) {
    const uint32_t* row = p.scales + r * p.scale_sr;
    if (!p.ue8m0) return __uint_as_float(row[g * p.scale_sg]);
    return num::ue8m0_value(static_cast<uint8_t>(row[(g / 4) * p.scale_sg] >> (8 * (g % 4))));
}

__device__ __forceinline__ float warp_amax(float v) {
    for (int o = 16; o > 0; o >>= 1) v = num::fmax_ignore_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__global__ void __launch_bounds__(kThreads) gather_kernel(GatherParams p) {
    const int lane = threadIdx.x % 32;
    const int64_t groups = p.fp8 ? p.hidden / 128 : 0;
    for (int64_t r = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; r < p.rows_pad;
         r += int64_t{gridDim.x} * kWarps) {
        const bool real = r < p.rows;
        const uint8_t* src = p.src + r * p.src_row_stride;
        if (!p.fp8) {
            uint16_t* d = reinterpret_cast<uint16_t*>(p.dst) + r * p.hidden;
            for (int64_t h = lane; h < p.hidden; h += 32) d[h] = real ? reinterpret_cast<const uint16_t*>(src)[h] : 0;
            continue;
        }
        for (int64_t g = 0; g < groups; ++g) {
            const float s = real ? scale_of(p, r, g) : 0.0f;
            if (!p.dequant && lane == 0) p.dst_scales[g * p.rows_pad + r] = s;
            for (int64_t h = g * 128 + lane; h < g * 128 + 128; h += 32) {
                const uint8_t q = real ? src[h] : 0;
                if (p.dequant)
                    reinterpret_cast<uint16_t*>(p.dst)[r * p.hidden + h] =
                        num::float_to_bf16(mul_rn(num::e4m3_to_float(q), s));
                else
                    p.dst[r * p.hidden + h] = q;
            }
        }
    }
}

__global__ void __launch_bounds__(kThreads) quantize_kernel(QuantizeParams p) {
    const int lane = threadIdx.x % 32;
    const int64_t groups = p.hidden / 128;
    const int64_t items = p.rows_pad * groups;
    for (int64_t it = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; it < items; it += int64_t{gridDim.x} * kWarps) {
        const int64_t r = it / groups, g = it % groups;
        float v[4];
        float amax = 0.0f;
        for (int j = 0; j < 4; ++j) {
            v[j] = r < p.rows ? num::bf16_to_float(p.x[r * p.x_row_stride + g * 128 + lane + 32 * j]) : 0.0f;
            amax = num::fmax_ignore_nan(amax, num::abs_bits(v[j]));
        }
        amax = num::fmax_ignore_nan(warp_amax(amax), num::kAmaxFloor);
        const float s = r < p.rows ? __fdiv_rn(amax, num::kE4M3Max) : 0.0f;
        const float mul = __fdiv_rn(num::kE4M3Max, amax);
        if (!p.dequant && lane == 0) p.dst_scales[g * p.rows_pad + r] = s;
        for (int j = 0; j < 4; ++j) {
            const int64_t h = g * 128 + lane + 32 * j;
            const uint8_t q = num::float_to_e4m3(mul_rn(v[j], mul));
            if (p.dequant)
                reinterpret_cast<uint16_t*>(p.dst)[r * p.hidden + h] =
                    num::float_to_bf16(mul_rn(num::e4m3_to_float(q), s));
            else
                p.dst[r * p.hidden + h] = q;
        }
    }
}

__device__ __forceinline__ float silu_mul(float g, float u) { return __fdiv_rn(g, 1.0f + expf(-g)) * u; }

__global__ void __launch_bounds__(kThreads) act_fp8_kernel(ActParams p) {
    const int lane = threadIdx.x % 32;
    const int64_t groups = p.inter / 128;
    const int64_t items = p.rows_pad * groups;
    for (int64_t it = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; it < items; it += int64_t{gridDim.x} * kWarps) {
        const int64_t r = it / groups, gi = it % groups;
        const uint16_t* row = p.g + r * 2 * p.inter;
        float v[4];
        float amax = 0.0f;
        for (int j = 0; j < 4; ++j) {
            const int64_t c = gi * 128 + lane + 32 * j;
            v[j] = silu_mul(num::bf16_to_float(row[c]), num::bf16_to_float(row[p.inter + c]));
            amax = num::fmax_ignore_nan(amax, num::abs_bits(v[j]));
        }
        amax = num::fmax_ignore_nan(warp_amax(amax), num::kAmaxFloor);
        const float s = __fdiv_rn(amax, num::kE4M3Max);
        const float mul = __fdiv_rn(num::kE4M3Max, amax);
        if (!p.dequant && lane == 0) p.h_scales[gi * p.rows_pad + r] = s;
        for (int j = 0; j < 4; ++j) {
            const int64_t c = gi * 128 + lane + 32 * j;
            const uint8_t q = num::float_to_e4m3(mul_rn(v[j], mul));
            if (p.dequant)
                reinterpret_cast<uint16_t*>(p.h)[r * p.inter + c] =
                    num::float_to_bf16(mul_rn(num::e4m3_to_float(q), s));
            else
                p.h[r * p.inter + c] = q;
        }
    }
}

__global__ void __launch_bounds__(kThreads) act_bf16_kernel(ActParams p) {
    const int64_t n = p.rows_pad * p.inter;
    for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
        const int64_t r = i / p.inter, c = i % p.inter;
        const uint16_t* row = p.g + r * 2 * p.inter;
        reinterpret_cast<uint16_t*>(p.h)[i] =
            num::float_to_bf16(silu_mul(num::bf16_to_float(row[c]), num::bf16_to_float(row[p.inter + c])));
    }
}

__global__ void __launch_bounds__(kThreads) scatter_kernel(ScatterParams p) {
    const int lane = threadIdx.x % 32;
    for (int64_t r = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; r < p.rows; r += int64_t{gridDim.x} * kWarps)
        for (int64_t h = lane; h < p.hidden; h += 32) p.dst[r * p.dst_row_stride + h] = p.y[r * p.hidden + h];
}

__global__ void __launch_bounds__(kThreads) dequant_weights_kernel(DequantWeightsParams p) {
    const int64_t n = p.n * p.k;
    for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
        const int64_t r = i / p.k, c = i % p.k;
        const float s = p.scales[(r / 128) * (p.k / 128) + c / 128];
        p.out[i] = num::float_to_bf16(mul_rn(num::e4m3_to_float(p.w[i]), s));
    }
}

}  // namespace elasticep::kernels::moe
