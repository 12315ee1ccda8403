// Warp- and block-level building blocks shared by the kernels: route cleaning, ordered block scans,
// the row/slice work split, unaligned 16-byte loads, and the hardware E4M3 pair conversion.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "core/limits.hpp"
#include "core/protocol.hpp"

namespace elasticep::kernels {

constexpr int kThreads = 512;  // threads of every row-moving kernel
constexpr int kWarps = kThreads / kWarpSize;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & (kWarpSize - 1); }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) / kWarpSize; }
__device__ __forceinline__ unsigned lanes_below(int lane) { return (1u << lane) - 1u; }

// Lane k < K holds raw id v of a token's route k. Returns the cleaned id (-1 for no route or an
// invalid one) and sets `fault` (RouteFault) and `dup_of`. The whole warp must call.
__device__ __forceinline__ int32_t clean_route(int64_t v, bool active, int num_experts, int& fault, int& dup_of) {
    const int lane = lane_id();
    const bool in_range = active && v >= 0 && v < num_experts;
    // inactive / no-route lanes get unique keys so they never match
    const unsigned long long key =
        in_range ? static_cast<unsigned long long>(v) : (0xffffffff00000000ull | static_cast<unsigned>(lane));
    const unsigned same = __match_any_sync(kFullMask, key);
    const int first = __ffs(same) - 1;
    fault = detail::kRouteOk;
    dup_of = -1;
    if (active && (v < -1 || v >= num_experts)) {
        fault = detail::kRouteOutOfRange;
    } else if (in_range && first != lane) {
        fault = detail::kRouteRepeated;
        dup_of = first;
    }
    return (in_range && first == lane) ? static_cast<int32_t>(v) : -1;
}

// Lanes with the same non-negative `group` (a destination rank, say): true on the lowest such lane,
// so the leaders list the distinct groups in lane order. The whole warp must call.
__device__ __forceinline__ bool leads_group(int group) {
    const int lane = lane_id();
    const unsigned key = group >= 0 ? static_cast<unsigned>(group) : 0x80000000u | static_cast<unsigned>(lane);
    const unsigned same = __match_any_sync(kFullMask, key);
    return group >= 0 && (__ffs(same) - 1) == lane;
}

// Exclusive ordered scan of one flag per thread across the block (kThreads threads); returns the
// thread's prefix and adds the block total to `running` (same value in every thread).
__device__ __forceinline__ int block_scan(bool flag, int& running) {
    __shared__ int warp_sums[kWarps];
    const int lane = lane_id(), warp = warp_id();
    const unsigned ballot = __ballot_sync(kFullMask, flag);
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) {
        const int s = warp_sums[w];
        if (w < warp) before += s;
        total += s;
    }
    __syncthreads();
    const int prefix = running + before + __popc(ballot & lanes_below(lane));
    running += total;
    return prefix;
}

// Programmatic dependent launch (sm_90+; opt-in, backends/cuda/programmatic_launch.hpp). A kernel
// launched with programmatic stream serialization may be scheduled before the previous kernel of its stream
// has finished: wait_for_previous_grid() returns once that grid has completed and its writes are
// visible, so every staged kernel calls it before anything else (a no-op for a normal launch).
// allow_next_grid() lets the next kernel of the stream be scheduled now (it still waits in
// wait_for_previous_grid); only kernels that wait on no peer call it, so a kernel that spins on a
// peer never has its successor's blocks holding SMs.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Exclusive prefix sums of a[0, n) in place in shared memory, a[n] = the total (a holds n + 1
// entries); `most` (optional) gets the largest element. Warp 0 scans 32 entries per step, so n
// entries cost n / 32 shuffle scans instead of n dependent steps of one thread. The whole block
// calls (blockDim.x >= 32); barriers before and after.
__device__ __forceinline__ void block_exclusive_scan(int32_t* a, int n, int32_t* most = nullptr) {
    __syncthreads();
    if (warp_id() == 0) {
        const int lane = lane_id();
        int32_t carry = 0, top = 0;
        for (int i0 = 0; i0 < n; i0 += kWarpSize) {
            const int i = i0 + lane;
            const int32_t v = i < n ? a[i] : 0;
            int32_t x = v, m = v;
#pragma unroll
            for (int o = 1; o < kWarpSize; o <<= 1) {
                const int32_t y = __shfl_up_sync(kFullMask, x, o);
                if (lane >= o) x += y;
                m = max(m, __shfl_xor_sync(kFullMask, m, o));
            }
            if (i < n) a[i] = carry + x - v;
            carry += __shfl_sync(kFullMask, x, kWarpSize - 1);
            top = max(top, m);
        }
        if (lane == 0) {
            a[n] = carry;
            if (most) *most = top;
        }
    }
    __syncthreads();
}

// Work split of a kernel whose unit is a row of `steps` serial steps: with fewer rows than warps
// (decode) a row's steps are split over several warps, otherwise (prefill) a warp takes whole rows.
// Work item i is slice i % slices of row i / slices and covers steps [begin, end).
struct RowSlice {
    int row, begin, end;
    bool first;  // the slice that also writes the row's metadata
};

__device__ __forceinline__ int row_slices(int rows, int steps, int warps) {
    return max(1, min(steps, warps / max(rows, 1)));
}

__device__ __forceinline__ RowSlice row_slice(int64_t item, int slices, int steps) {
    const int sl = static_cast<int>(item % slices);
    return {static_cast<int>(item / slices), sl * steps / slices, (sl + 1) * steps / slices, sl == 0};
}

// 16 bytes at base + byte_off; byte-wise when the source is not 16-byte aligned.
__device__ __forceinline__ uint4 load16(const void* base, int64_t byte_off, bool aligned) {
    const uint8_t* src = static_cast<const uint8_t*>(base) + byte_off;
    if (aligned) return *reinterpret_cast<const uint4*>(src);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = static_cast<uint32_t>(src[4 * i]) | (static_cast<uint32_t>(src[4 * i + 1]) << 8) |
               (static_cast<uint32_t>(src[4 * i + 2]) << 16) | (static_cast<uint32_t>(src[4 * i + 3]) << 24);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Two floats to E4M3 (RNE, satfinite, NaN -> 0x7f): the hardware conversion. Equal to
// num::float_to_e4m3 for every fp32 input (checked exhaustively by the gpu tests,
// tests/gpu/e4m3_selftest.cu); the low byte holds `lo`.
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
    return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

}  // namespace elasticep::kernels
