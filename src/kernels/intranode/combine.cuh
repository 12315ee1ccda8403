// Combine kernels of the direct topology (protocol: src/core/protocol.hpp, "Combine"). The reduction
// order is SEMANTICS.md's: per destination rank an fmaf chain over k ascending rounded to bf16 on the
// expert holder, then at the origin bias + partials in first-k destination order. Three kernels:
//
// partial_kernel  grid 2 * num_sms (the dispatch's), block kThreads. Work item: a RowSlice of one
//                 message this rank received in the dispatch (sender s, slot j). Reads y at the rows
//                 ws.recv_rows gave its routes, the route weights in the message; writes the bf16
//                 partial into origin s's window, combine_slots[this rank][t]. Each block ends with a
//                 system fence. Does nothing after a timeout.
// publish_kernel  one warp. Signals this rank's epoch into every origin's combine_flags[this rank]
//                 (release), then one thread waits (bounded) until every holder's flag in this rank's
//                 window reached the epoch. Host waits (SyncMode): publish only, then wait only.
// reduce_kernel   grid 2 * num_sms, block kThreads. Work item: a RowSlice of one of this rank's
//                 tokens. Reads the partials in this rank's window in the token's first-k destination
//                 order (ws.clean_idx from the dispatch), the bias; writes out. Does nothing after a
//                 timeout.
#pragma once

#include "kernels/intranode/dispatch.cuh"

namespace elasticep::kernels {

constexpr int kPublishThreads = 32;

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

// Loads are issued in batches (kBatch sources x 2 chunks per lane) before the arithmetic, so a warp
// keeps many reads in flight; the arithmetic order (sources ascending) is unchanged.
constexpr int kBatch = 4;

template <class Team, bool kWeighted>
__global__ void __launch_bounds__(kThreads, 2) partial_kernel(CombineParams<Team> p) {
    static_assert(Team::kLoadStore, "the partial kernel stores into the origins' windows");
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    __shared__ int64_t route_rows[kWarps][kMaxTopk];
    __shared__ float route_w[kWarps][kMaxTopk];
    __shared__ int32_t msg_start[kMaxRanks + 1];
    const int lane = lane_id(), warp = warp_id();
    const int rank = p.team.rank();
    const int warps_total = gridDim.x * kWarps;
    const MessageLayout& m = sh.msg;
    const uint8_t* mine = p.team.self();
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
        const uint8_t* msg = mine + region.message(g);
        const bool active = lane < sh.num_topk;
        int32_t row = -1;
        float w = 1.0f;
        if (active) {
            row = p.ws.recv_rows[g * sh.num_topk + lane];
            if constexpr (kWeighted) w = __ldcg(reinterpret_cast<const float*>(msg + m.weight_offset) + lane);
        }
        const int32_t t = __ldcg(reinterpret_cast<const int32_t*>(msg + m.src_offset));
        if (t < 0 || t >= sh.capacity) {  // dropped by the expand kernel already (a peer fault)
            if (lane == 0) record_peer_fault(p.ws, p.record, detail::kPeerToken, s, kPhaseCombine, t, sh.capacity);
            continue;
        }
        const unsigned routes = __ballot_sync(kFullMask, row >= 0);
        const int n = __popc(routes);
        __syncwarp();  // the previous message's rows are read
        if (row >= 0) {
            const int at = __popc(routes & lanes_below(lane));  // k ascending
            rows[at] = row;
            ws[at] = w;
        }
        __syncwarp();
        uint16_t* dst = RegionLayout::at<uint16_t>(p.team.window(s), region.combine_row(rank, t));
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
    if (threadIdx.x == 0) Team::fence();
}

template <class Team>
__global__ void __launch_bounds__(kPublishThreads) publish_kernel(CombineParams<Team> p) {
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    const Team& team = p.team;
    if (p.ws.state->timed_out != 0) return;
    const uint64_t epoch = *p.ws.epoch;
    if (p.sync_mode != kWaitOnly) {
        // every lane signals its share of the origins, after the partial kernel's writes
        team.fence();
        for (int s = threadIdx.x; s < sh.num_ranks; s += blockDim.x)
            team.signal(s, region.combine_flag(team.rank()), epoch);
        if (p.sync_mode == kPublishOnly) return;  // the host waits, then launches the kWaitOnly half
    }
    if (threadIdx.x != 0) return;
    const WaitStatus st = wait_all(
        team, [&](int d) { return region.combine_flag(d); }, epoch, Deadline::from_now(p.timeout_ns), kPhaseCombine,
        p.record);
    if (st != WaitStatus::kOk) p.ws.state->timed_out = 1;
}

template <class Team, bool kBias>
__global__ void __launch_bounds__(kThreads, 2) reduce_kernel(CombineParams<Team> p) {
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    __shared__ int32_t dest_list[kWarps][kMaxTopk];
    const int lane = lane_id(), warp = warp_id();
    const int warps_total = gridDim.x * kWarps;
    const int chunks = sh.hidden / 8;
    const uint16_t* slots = RegionLayout::at<uint16_t>(p.team.self(), region.combine_slots);
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
        const int d = clean >= 0 ? clean / sh.num_local_experts : -1;
        const bool first = leads_group(d);
        const unsigned dests = __ballot_sync(kFullMask, first);
        const int n = __popc(dests);
        __syncwarp();                                          // the previous token's list is read
        if (first) dl[__popc(dests & lanes_below(lane))] = d;  // first-k destination order
        __syncwarp();
        for (int base = it0 * 64; base < min(chunks, it1 * 64); base += 64) {
            const int c0 = base + lane, c1 = c0 + 32;
            const bool ok0 = c0 < chunks, ok1 = c1 < chunks;
            float a0[8], a1[8];
            if constexpr (kBias) {
                const uint16_t* br = p.bias + t * p.bias_row_stride;
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
            if (ok0) *reinterpret_cast<uint4*>(p.out + t * p.out_row_stride + c0 * 8) = pack_chunk(a0);
            if (ok1) *reinterpret_cast<uint4*>(p.out + t * p.out_row_stride + c1 * 8) = pack_chunk(a1);
        }
    }
}

}  // namespace elasticep::kernels
