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

__device__ __forceinline__ int64_t comb_flag_offset(const Shape& sh, int holder) {
    return sh.region.comb_flags + int64_t{holder} * static_cast<int64_t>(sizeof(uint64_t));
}

// Sums in registers: acc[i] = fmaf(w, y[i], acc[i]) over the 8 bf16 channels of one 16-byte chunk.
__device__ __forceinline__ void fma_chunk(float (&acc)[8], float w, const uint4& v) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] = fmaf(w, num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu)), acc[2 * i]);
        acc[2 * i + 1] = fmaf(w, num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16)), acc[2 * i + 1]);
    }
}

__device__ __forceinline__ uint4 pack_chunk(const float (&acc)[8]) {
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        out[i] = static_cast<uint32_t>(num::float_to_bf16(acc[2 * i])) |
                 (static_cast<uint32_t>(num::float_to_bf16(acc[2 * i + 1])) << 16);
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// Loads are issued in batches (kBatch sources x 2 chunks per lane) before the arithmetic, so a warp
// keeps many reads in flight; the arithmetic order (sources ascending) is unchanged.
constexpr int kBatch = 4;

__global__ void __launch_bounds__(kThreads, 2) partial_kernel(CombineParams p) {
    const Shape& sh = p.sh;
    if (p.ws.state[0] != 0) return;
    __shared__ int64_t route_rows[kWarps][kMaxTopk];
    __shared__ float route_w[kWarps][kMaxTopk];
    __shared__ int32_t msg_start[kMaxRanks + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps_total = gridDim.x * kWarps;
    const MessageLayout& m = sh.msg;
    const uint8_t* slots = p.team.self() + sh.region.disp_slots;
    const int chunks = sh.hidden / 8;
    int64_t* rows = route_rows[warp];
    float* ws = route_w[warp];
    // work items: RowSlice over the received messages
    const int num_msgs = load_message_starts(msg_start, sh, p.ws.msg_start);
    const int iters = (chunks + 63) / 64;
    const int slices = row_slices(num_msgs, iters, warps_total);
    const int64_t items = int64_t{num_msgs} * slices;
    for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int it0 = slice.begin, it1 = slice.end;
        int s = 0;
        const int64_t g = message_slot(msg_start, sh, slice.row, s);
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
        const int n = __popc(routes);
        __syncwarp();  // the previous message's rows are read
        if (row >= 0) {
            const int at = __popc(routes & ((1u << lane) - 1u));  // k ascending
            rows[at] = row;
            ws[at] = w;
        }
        __syncwarp();
        uint16_t* dst = reinterpret_cast<uint16_t*>(p.team.window(s) + sh.region.comb_slots) +
                        (int64_t{sh.rank} * sh.capacity + t) * sh.hidden;
        for (int base = it0 * 64; base < min(chunks, it1 * 64); base += 64) {
            const int c0 = base + lane, c1 = c0 + 32;
            const bool ok0 = c0 < chunks, ok1 = c1 < chunks;
            float a0[8], a1[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) a0[i] = a1[i] = 0.0f;
            for (int j0 = 0; j0 < n; j0 += kBatch) {
                uint4 v0[kBatch], v1[kBatch];
#pragma unroll
                for (int b = 0; b < kBatch; ++b) {
                    const bool has = j0 + b < n;
                    const uint16_t* yr = p.y + (has ? rows[j0 + b] : 0) * sh.hidden;
                    v0[b] = has && ok0 ? *reinterpret_cast<const uint4*>(yr + c0 * 8) : make_uint4(0, 0, 0, 0);
                    v1[b] = has && ok1 ? *reinterpret_cast<const uint4*>(yr + c1 * 8) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int b = 0; b < kBatch; ++b)
                    if (j0 + b < n) {
                        const float wk = ws[j0 + b];
                        fma_chunk(a0, wk, v0[b]);
                        fma_chunk(a1, wk, v1[b]);
                    }
            }
            if (ok0) *reinterpret_cast<uint4*>(dst + c0 * 8) = pack_chunk(a0);
            if (ok1) *reinterpret_cast<uint4*>(dst + c1 * 8) = pack_chunk(a1);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
}

__global__ void publish_kernel(CombineParams p) {
    const Shape& sh = p.sh;
    const transport::NvlinkTeam& team = p.team;
    if (p.ws.state[0] != 0) return;
    const uint64_t epoch = *p.ws.epoch;
    if (p.sync_mode != kWaitOnly) {
        // every lane signals its share of the origins, after the partial kernel's writes
        team.fence();
        for (int s = threadIdx.x; s < sh.num_ranks; s += blockDim.x)
            team.signal(s, comb_flag_offset(sh, team.rank()), epoch);
        if (p.sync_mode == kPublishOnly) return;  // the host waits, then launches the kWaitOnly half
    }
    if (threadIdx.x != 0) return;
    const WaitStatus st = wait_all(team, [&](int d) { return comb_flag_offset(sh, d); }, epoch,
                                   Deadline::from_now(p.timeout_ns), kPhaseCombine, p.rec);
    if (st != WaitStatus::kOk) p.ws.state[0] = 1;
}

__device__ __forceinline__ void add_chunk(float (&acc)[8], const uint4& v) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] = __fadd_rn(acc[2 * i], num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu)));
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16)));
    }
}

__device__ __forceinline__ void load_chunk(float (&acc)[8], const uint4& v) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] = num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu));
        acc[2 * i + 1] = num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16));
    }
}

__global__ void __launch_bounds__(kThreads, 2) reduce_kernel(CombineParams p) {
    const Shape& sh = p.sh;
    if (p.ws.state[0] != 0) return;
    __shared__ int32_t dest_list[kWarps][kMaxTopk];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps_total = gridDim.x * kWarps;
    const int chunks = sh.hidden / 8;
    const uint16_t* slots = reinterpret_cast<const uint16_t*>(p.team.self() + sh.region.comb_slots);
    int32_t* dl = dest_list[warp];
    // work items: RowSlice over this rank's tokens
    const int iters = (chunks + 63) / 64;
    const int slices = row_slices(p.num_tokens, iters, warps_total);
    const int64_t items = int64_t{p.num_tokens} * slices;
    for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int t = slice.row, it0 = slice.begin, it1 = slice.end;
        const bool active = lane < sh.num_topk;
        const int32_t clean = active ? p.ws.clean_idx[t * sh.num_topk + lane] : -1;
        const int d = clean >= 0 ? clean / sh.e_local : -1;
        const unsigned key = d >= 0 ? static_cast<unsigned>(d) : 0x80000000u | static_cast<unsigned>(lane);
        const unsigned same = __match_any_sync(0xffffffffu, key);
        const bool first = d >= 0 && (__ffs(same) - 1) == lane;
        const unsigned dests = __ballot_sync(0xffffffffu, first);
        const int n = __popc(dests);
        __syncwarp();  // the previous token's list is read
        if (first) dl[__popc(dests & ((1u << lane) - 1u))] = d;  // first-k destination order
        __syncwarp();
        for (int base = it0 * 64; base < min(chunks, it1 * 64); base += 64) {
            const int c0 = base + lane, c1 = c0 + 32;
            const bool ok0 = c0 < chunks, ok1 = c1 < chunks;
            float a0[8], a1[8];
            if (p.bias) {
                const uint16_t* br = p.bias + t * p.bias_stride;
                load_chunk(a0, ok0 ? *reinterpret_cast<const uint4*>(br + c0 * 8) : make_uint4(0, 0, 0, 0));
                load_chunk(a1, ok1 ? *reinterpret_cast<const uint4*>(br + c1 * 8) : make_uint4(0, 0, 0, 0));
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) a0[i] = a1[i] = 0.0f;
            }
            for (int j0 = 0; j0 < n; j0 += kBatch) {
                uint4 v0[kBatch], v1[kBatch];
#pragma unroll
                for (int b = 0; b < kBatch; ++b) {
                    const bool has = j0 + b < n;
                    const uint16_t* pr = slots + (int64_t{has ? dl[j0 + b] : 0} * sh.capacity + t) * sh.hidden;
                    v0[b] = has && ok0 ? __ldcg(reinterpret_cast<const uint4*>(pr + c0 * 8)) : make_uint4(0, 0, 0, 0);
                    v1[b] = has && ok1 ? __ldcg(reinterpret_cast<const uint4*>(pr + c1 * 8)) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int b = 0; b < kBatch; ++b)
                    if (j0 + b < n) {
                        add_chunk(a0, v0[b]);
                        add_chunk(a1, v1[b]);
                    }
            }
            if (ok0) *reinterpret_cast<uint4*>(p.out + t * p.out_stride + c0 * 8) = pack_chunk(a0);
            if (ok1) *reinterpret_cast<uint4*>(p.out + t * p.out_stride + c1 * 8) = pack_chunk(a1);
        }
    }
}

}  // namespace elasticep::kernels
