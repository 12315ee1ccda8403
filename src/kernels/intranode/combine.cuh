// Combine kernels of the direct topology.
//   partial_kernel  expert holder: warp per received message (sender s, slot j); forms the bf16
//                   partial over the token's routes to this rank (fmaf, k ascending) and writes it
//                   straight into origin s's comb_slots[holder][t].
//   publish_kernel  one thread: release.sys epoch into every origin's comb_flags[holder], then a
//                   bounded wait for every holder's flag in this rank's region.
//   reduce_kernel   origin: warp per token; bias + partials in first-k destination order.
#pragma once

#include "kernels/intranode/dispatch.cuh"

namespace elasticep::kernels {

__device__ __forceinline__ uint64_t* comb_flag(uint8_t* region, const Shape& sh, int holder) {
    return reinterpret_cast<uint64_t*>(region + sh.region.comb_flags) + holder;
}

__global__ void __launch_bounds__(kThreads) partial_kernel(CombineParams p) {
    const Shape& sh = p.sh;
    if (p.ws.state[0] != 0) return;
    const int lane = threadIdx.x & 31;
    const int warps_total = gridDim.x * kWarps;
    const MessageLayout& m = sh.msg;
    const int64_t rc = int64_t{sh.num_ranks} * sh.capacity;
    const uint8_t* slots = p.my_region + sh.region.disp_slots;
    const int chunks = sh.hidden / 8;
    for (int64_t g = blockIdx.x * kWarps + (threadIdx.x >> 5); g < rc; g += warps_total) {
        const int s = static_cast<int>(g / sh.capacity);
        const int j = static_cast<int>(g % sh.capacity);
        if (j >= p.ws.recv_count[s]) continue;
        const uint8_t* msg = slots + g * m.bytes;
        const bool active = lane < sh.num_topk;
        int32_t row = -1;
        float w = 1.0f;
        if (active) {
            row = p.ws.recv_rows[g * sh.num_topk + lane];
            if (p.weighted) w = __ldcg(reinterpret_cast<const float*>(msg + m.weight_offset) + lane);
        }
        const int32_t t = __ldcg(reinterpret_cast<const int32_t*>(msg + m.src_offset));
        const unsigned routes = __ballot_sync(0xffffffffu, row >= 0);
        uint16_t* dst = reinterpret_cast<uint16_t*>(p.ws.peers[s] + sh.region.comb_slots) +
                        (int64_t{sh.rank} * sh.capacity + t) * sh.hidden;
        for (int base = 0; base < chunks; base += 32) {
            const int c = base + lane;
            const bool ok = c < chunks;
            float acc[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
            for (unsigned rm = routes; rm; rm &= rm - 1) {
                const int k = __ffs(rm) - 1;
                const int64_t r = __shfl_sync(0xffffffffu, row, k);
                const float wk = __shfl_sync(0xffffffffu, w, k);
                if (ok) {
                    const uint4 v = *reinterpret_cast<const uint4*>(p.y + r * sh.hidden + c * 8);
                    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc[2 * i] = fmaf(wk, num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu)), acc[2 * i]);
                        acc[2 * i + 1] = fmaf(wk, num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16)), acc[2 * i + 1]);
                    }
                }
            }
            if (ok) {
                uint32_t out[4];
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    out[i] = static_cast<uint32_t>(num::float_to_bf16(acc[2 * i])) |
                             (static_cast<uint32_t>(num::float_to_bf16(acc[2 * i + 1])) << 16);
                *reinterpret_cast<uint4*>(dst + c * 8) = make_uint4(out[0], out[1], out[2], out[3]);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
}

__global__ void publish_kernel(CombineParams p) {
    const Shape& sh = p.sh;
    if (threadIdx.x != 0 || p.ws.state[0] != 0) return;
    const uint64_t epoch = *p.ws.epoch;
    if (p.sync_mode != kWaitOnly) {
        __threadfence_system();
        for (int s = 0; s < sh.num_ranks; ++s) st_release_sys(comb_flag(p.ws.peers[s], sh, sh.rank), epoch);
        if (p.sync_mode == kPublishOnly) return;  // the host waits, then launches the kWaitOnly half
    }
    const bool ok = wait_peers([&](int d) { return comb_flag(p.my_region, sh, d); }, sh.num_ranks, epoch, p.timeout_ns,
                               kPhaseCombine, p.rec);
    if (!ok) p.ws.state[0] = 1;
}

__global__ void __launch_bounds__(kThreads) reduce_kernel(CombineParams p) {
    const Shape& sh = p.sh;
    if (p.ws.state[0] != 0) return;
    const int lane = threadIdx.x & 31;
    const int warps_total = gridDim.x * kWarps;
    const int chunks = sh.hidden / 8;
    const uint16_t* slots = reinterpret_cast<const uint16_t*>(p.my_region + sh.region.comb_slots);
    for (int t = blockIdx.x * kWarps + (threadIdx.x >> 5); t < p.num_tokens; t += warps_total) {
        const bool active = lane < sh.num_topk;
        const int32_t clean = active ? p.ws.clean_idx[t * sh.num_topk + lane] : -1;
        const int d = clean >= 0 ? clean / sh.e_local : -1;
        const unsigned key = d >= 0 ? static_cast<unsigned>(d) : 0x80000000u | static_cast<unsigned>(lane);
        const unsigned same = __match_any_sync(0xffffffffu, key);
        const bool first = d >= 0 && (__ffs(same) - 1) == lane;
        const unsigned dests = __ballot_sync(0xffffffffu, first);
        for (int base = 0; base < chunks; base += 32) {
            const int c = base + lane;
            const bool ok = c < chunks;
            float acc[8];
            if (ok && p.bias) {
                const uint4 b = *reinterpret_cast<const uint4*>(p.bias + t * p.bias_stride + c * 8);
                const uint32_t words[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    acc[2 * i] = num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu));
                    acc[2 * i + 1] = num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16));
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
            }
            for (unsigned dm = dests; dm; dm &= dm - 1) {
                const int k = __ffs(dm) - 1;
                const int dd = __shfl_sync(0xffffffffu, d, k);
                if (ok) {
                    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(slots + (int64_t{dd} * sh.capacity + t) * sh.hidden +
                                                                          c * 8));
                    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc[2 * i] = __fadd_rn(acc[2 * i], num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu)));
                        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16)));
                    }
                }
            }
            if (ok) {
                uint32_t out[4];
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    out[i] = static_cast<uint32_t>(num::float_to_bf16(acc[2 * i])) |
                             (static_cast<uint32_t>(num::float_to_bf16(acc[2 * i + 1])) << 16);
                *reinterpret_cast<uint4*>(p.out + t * p.out_stride + c * 8) = make_uint4(out[0], out[1], out[2], out[3]);
            }
        }
    }
}

}  // namespace elasticep::kernels
