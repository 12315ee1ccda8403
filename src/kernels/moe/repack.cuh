// Repack kernels between the two dispatch layouts, m_indices, and the fused route weight.
//
// Index maps (E = local experts, S = slab rows per expert, Mc = contiguous rows, A = alignment):
//   slab row (l, r), r < S          <->  contiguous row start_l + r
//   start_0 = 0, start_{l+1} = start_l + round_up(count_l, A), count_l clamped to [0, S]
//   masked_to_contiguous writes contiguous rows i < min(start_E, Mc): real rows (r < count_l) copied,
//     padding rows inside a segment zeroed (data and scales); m_indices[i] for every i < Mc (-1 off
//     real rows); rows >= start_E are not otherwise written.
//   contiguous_to_masked writes slab rows r < n_l, n_l = segment_rows(count_l, offsets[l],
//     offsets[l+1]) (adapter_params.hpp); the rest of the slab is not written.
// Who writes what: each output row is written by exactly one warp; the fault word by atomicOr.
// Memory owned: none (all tensors are the caller's); no shared state between launches.
//
// Launch contract (host: adapters_cuda.cu):
//   offsets_kernel         <<<1, 1024>>>             E <= kMaxLocalExperts (1024 threads scan E)
//   masked_to_contiguous_* <<<grid(Mc), kThreads>>>   after offsets_kernel on the same stream
//   contiguous_to_masked_* <<<(E, chunks), kThreads>>>
//   m_indices_kernel       <<<grid(Mc), kThreads>>>
//   route_weights_kernel   <<<grid(rows), kThreads>>>
// Grids depend on shapes only (never on counts), so a captured CUDA graph replays them as is.
// kVec: bytes per copy (16, 8, 4, 2 or 1); the host picks the widest that divides the row bytes,
// the base addresses and the row strides.
#pragma once

#include <cstdint>

#include "kernels/moe/adapter_params.hpp"

namespace elasticep::kernels::moe {

template <int kVec>
struct VecType;
template <>
struct VecType<16> {
    using T = int4;
};
template <>
struct VecType<8> {
    using T = int2;
};
template <>
struct VecType<4> {
    using T = int32_t;
};
template <>
struct VecType<2> {
    using T = int16_t;
};
template <>
struct VecType<1> {
    using T = int8_t;
};

template <int kVec>
__device__ __forceinline__ void copy_row(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
    using V = typename VecType<kVec>::T;
    const int64_t n = bytes / kVec;
    for (int64_t i = lane; i < n; i += 32) reinterpret_cast<V*>(dst)[i] = reinterpret_cast<const V*>(src)[i];
}

template <int kVec>
__device__ __forceinline__ void zero_row(uint8_t* dst, int64_t bytes, int lane) {
    using V = typename VecType<kVec>::T;
    const int64_t n = bytes / kVec;
    const V z{};
    for (int64_t i = lane; i < n; i += 32) reinterpret_cast<V*>(dst)[i] = z;
}

__device__ __forceinline__ void weigh_row(uint16_t* dst, const uint16_t* src, int64_t hidden, float w, int lane) {
    for (int64_t h = lane; h < hidden; h += 32) dst[h] = weighted_bf16(src[h], w);
}

// Segment starts of the masked -> contiguous layout (one block; thread l owns expert l).
__global__ void __launch_bounds__(1024) offsets_kernel(MaskedToContiguousParams p) {
    __shared__ int64_t scan[1024];
    __shared__ int32_t faults;
    const int l = threadIdx.x;
    if (l == 0) faults = 0;
    __syncthreads();
    int32_t f = 0;
    int64_t seg = 0;
    if (l < p.num_experts) seg = round_up_a(clamp_count(p.masked_m[l], p.slab_rows, f), p.alignment);
    if (f) atomicOr(&faults, f);
    scan[l] = seg;
    __syncthreads();
    for (int step = 1; step < 1024; step <<= 1) {  // inclusive Hillis-Steele scan
        const int64_t v = l >= step ? scan[l - step] : 0;
        __syncthreads();
        scan[l] += v;
        __syncthreads();
    }
    if (l < p.num_experts) p.out_offsets[l + 1] = static_cast<int32_t>(scan[l]);
    if (l == 0) {
        p.out_offsets[0] = 0;
        const int64_t total = scan[p.num_experts - 1];
        int32_t all = faults;
        if (total > p.out_rows) all |= kFaultRows;
        if (all) atomicOr(p.status, all);
    }
}

template <int kVec>
__global__ void __launch_bounds__(kThreads) masked_to_contiguous_kernel(MaskedToContiguousParams p) {
    __shared__ int32_t start[kMaxLocalExperts + 1];
    __shared__ int32_t count[kMaxLocalExperts];
    for (int l = threadIdx.x; l <= p.num_experts; l += kThreads) {
        start[l] = p.out_offsets[l];
        if (l < p.num_experts) {
            int32_t f = 0;  // reported by offsets_kernel
            count[l] = static_cast<int32_t>(clamp_count(p.masked_m[l], p.slab_rows, f));
        }
    }
    __syncthreads();
    const int lane = threadIdx.x % 32;
    const int64_t total = start[p.num_experts];
    for (int64_t i = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; i < p.out_rows;
         i += int64_t{gridDim.x} * kWarps) {
        int32_t m = -1;
        if (i < total) {
            int lo = 0, hi = p.num_experts;  // the last l with start[l] <= i (start[E] > i)
            while (hi - lo > 1) {
                const int mid = (lo + hi) / 2;
                if (start[mid] <= i)
                    lo = mid;
                else
                    hi = mid;
            }
            const int l = lo;
            const int64_t r = i - start[l];
            uint8_t* dst = p.out_x.data + i * p.out_x.row_stride;
            if (r < count[l]) {
                m = l;
                const uint8_t* src = p.x.data + l * p.x.batch_stride + r * p.x.row_stride;
                if (p.weights)
                    weigh_row(reinterpret_cast<uint16_t*>(dst), reinterpret_cast<const uint16_t*>(src), p.hidden,
                              p.weights[i], lane);
                else
                    copy_row<kVec>(dst, src, p.row_bytes, lane);
                for (int g = lane; g < p.scale_groups; g += 32)
                    p.out_scales.data[i * p.out_scales.sr + g * p.out_scales.sg] =
                        p.scales.data[l * p.scales.sb + r * p.scales.sr + g * p.scales.sg];
            } else {
                zero_row<kVec>(dst, p.row_bytes, lane);
                for (int g = lane; g < p.scale_groups; g += 32)
                    p.out_scales.data[i * p.out_scales.sr + g * p.out_scales.sg] = 0;
            }
        }
        if (p.out_m_indices && lane == 0) p.out_m_indices[i] = m;
    }
}

template <int kVec>
__global__ void __launch_bounds__(kThreads) contiguous_to_masked_kernel(ContiguousToMaskedParams p) {
    const int l = blockIdx.x;
    int32_t f = 0;
    const int64_t n = segment_rows(p.counts[l], p.offsets[l], p.offsets[l + 1], p.slab_rows, p.in_rows, f);
    if (blockIdx.y == 0 && threadIdx.x == 0) {
        if (p.out_masked_m) p.out_masked_m[l] = static_cast<int32_t>(n);
        if (f) atomicOr(p.status, f);
    }
    const int lane = threadIdx.x % 32;
    const int64_t o0 = p.offsets[l];
    for (int64_t r = int64_t{blockIdx.y} * kWarps + threadIdx.x / 32; r < n; r += int64_t{gridDim.y} * kWarps) {
        const int64_t src_row = o0 + r;
        const uint8_t* src = p.x.data + src_row * p.x.row_stride;
        uint8_t* dst = p.out_x.data + l * p.out_x.batch_stride + r * p.out_x.row_stride;
        if (p.weights)
            weigh_row(reinterpret_cast<uint16_t*>(dst), reinterpret_cast<const uint16_t*>(src), p.hidden,
                      p.weights[l * p.weight_stride + r], lane);
        else
            copy_row<kVec>(dst, src, p.row_bytes, lane);
        for (int g = lane; g < p.scale_groups; g += 32)
            p.out_scales.data[l * p.out_scales.sb + r * p.out_scales.sr + g * p.out_scales.sg] =
                p.scales.data[src_row * p.scales.sr + g * p.scales.sg];
    }
}

__global__ void __launch_bounds__(kThreads) m_indices_kernel(MIndicesParams p) {
    __shared__ int32_t seg_start[kMaxLocalExperts];
    __shared__ int32_t seg_rows[kMaxLocalExperts];
    for (int l = threadIdx.x; l < p.num_experts; l += kThreads) {
        int32_t f = 0;
        seg_start[l] = p.offsets[l];
        seg_rows[l] = static_cast<int32_t>(
            segment_rows(p.counts[l], p.offsets[l], p.offsets[l + 1], int64_t{1} << 62, p.rows, f));
        if (f && blockIdx.x == 0) atomicOr(p.status, f);
    }
    __syncthreads();
    for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < p.rows; i += int64_t{gridDim.x} * kThreads) {
        int32_t m = -1;
        for (int l = 0; l < p.num_experts && m < 0; ++l)  // the lowest expert whose segment holds i
            if (i >= seg_start[l] && i < int64_t{seg_start[l]} + seg_rows[l]) m = l;
        p.m_indices[i] = m;
    }
}

__global__ void __launch_bounds__(kThreads) route_weights_kernel(RouteWeightParams p) {
    const int lane = threadIdx.x % 32;
    if (p.masked && blockIdx.x == 0)  // faults once per expert, also when the slab has no rows
        for (int l = threadIdx.x; l < p.num_experts; l += kThreads) {
            int32_t f = 0;
            clamp_count(p.counts[l], p.slab_rows, f);
            if (f) atomicOr(p.status, f);
        }
    const int64_t rows = p.masked ? int64_t{p.num_experts} * p.slab_rows : p.slab_rows;
    for (int64_t i = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; i < rows; i += int64_t{gridDim.x} * kWarps) {
        int64_t b = 0, r = i;
        float w;
        if (p.masked) {
            b = i / p.slab_rows;
            r = i % p.slab_rows;
            int32_t f = 0;
            if (r >= clamp_count(p.counts[b], p.slab_rows, f)) continue;
            w = p.weights[b * p.weight_stride + r];
        } else {
            if (p.m_indices[i] < 0) continue;
            w = p.weights[i];
        }
        weigh_row(reinterpret_cast<uint16_t*>(p.out.data + b * p.out.batch_stride + r * p.out.row_stride),
                  reinterpret_cast<const uint16_t*>(p.y.data + b * p.y.batch_stride + r * p.y.row_stride), p.hidden, w,
                  lane);
    }
}

}  // namespace elasticep::kernels::moe
