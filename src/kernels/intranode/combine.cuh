// Combine kernels of the direct topology, staged path (protocol: src/core/protocol.hpp, "Combine").
// The reduction order is SEMANTICS.md's: per destination rank an fmaf chain over k ascending rounded
// to bf16 on the expert holder; at the origin, with one node, bias + partials in first-k destination
// order; with ranks_per_node = P < R, per destination node first (node partial = bf16 of the sum of
// its ranks' partials in list order), then bias + node partials in order of each node's first rank.
// Three kernels:
//
// partial_kernel  grid 2 * num_sms (the dispatch's), block kThreads. Work item: a RowSlice of one
//                 message this rank received in the dispatch (sender s, its j-th message here). Reads
//                 y at the rows ws.recv_rows gave its routes and the route weights ws.recv_w (the
//                 expand kernel's tables: with rounds the ring no longer holds every message); writes
//                 the bf16 partial into origin s's window, compact combine slot origin_base[s] + j.
//                 Each block ends with a system fence. Does nothing after a timeout.
// publish_kernel  one warp. Signals this rank's epoch into every origin's combine_flags[this rank]
//                 (release), then waits (bounded; a lane per holder) until every holder's flag in this
//                 rank's window reached the epoch. Host waits (SyncMode): publish only, then wait only.
// reduce_kernel   grid 2 * num_sms, block kThreads. Work item: a RowSlice of one of this rank's
//                 tokens. Reads the partials in this rank's window (slot out_base[d] + the token's
//                 slot at d) in the order above (ws.clean_idx and ws.slot_of from the dispatch), the
//                 bias; writes out. Does nothing after a timeout.
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
    wait_for_previous_grid();
    allow_next_grid();  // waits on no peer; the one-warp publish kernel may be scheduled
    static_assert(Team::kLoadStore, "the partial kernel stores into the origins' windows");
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    __shared__ int64_t route_rows[kWarps][kMaxTopk];
    __shared__ float route_w[kWarps][kMaxTopk];
    __shared__ int32_t msg_start[kMaxRanks + 1];
    const int lane = lane_id(), warp = warp_id();
    const int warps_total = gridDim.x * kWarps;
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
        const int64_t j = g - int64_t{s} * sh.capacity;
        const bool active = lane < sh.num_topk;
        int32_t row = -1;
        float w = 1.0f;
        if (active) {
            row = p.ws.recv_rows[g * sh.num_topk + lane];
            if constexpr (kWeighted) w = p.ws.recv_w[g * sh.num_topk + lane];
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
        // the exchange checked origin_base[s] + count <= C * min(K, R) (the origin's slots)
        uint16_t* dst =
            RegionLayout::at<uint16_t>(p.team.window(s), region.combine_slot(int64_t{p.ws.origin_base[s]} + j));
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
    wait_for_previous_grid();
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
    const WaitStatus st = block_wait_all(
        team, [&](int d) { return region.combine_flag(d); }, epoch, Deadline::from_now(p.timeout_ns), kPhaseCombine,
        p.record);
    if (threadIdx.x == 0 && st != WaitStatus::kOk) p.ws.state->timed_out = 1;
}

// The order in which an origin adds a token's destinations (SEMANTICS.md, "Combine"): lane k < K
// holds the destination rank d of route k (-1: none). Returns, on the lane that leads its destination
// (the lowest k routing to it), the destination's place in the order and sets `node_end` (the last
// destination of its node, kNodes only); -1 on the other lanes. One node (kNodes false): first-k
// order. P ranks per node: grouped by node, nodes in order of their first rank, ranks inside a node
// in first-k order. `n` gets the number of destinations. The whole warp must call.
template <bool kNodes>
__device__ __forceinline__ int destination_order(int d, int node_size, int& n, bool& node_end) {
    const int lane = lane_id();
    const bool lead = leads_group(d);
    const unsigned leaders = __ballot_sync(kFullMask, lead);
    n = __popc(leaders);
    node_end = false;
    const int dest_idx = __popc(leaders & lanes_below(lane));
    if constexpr (!kNodes) {
        return lead ? dest_idx : -1;
    } else {
        const int node = d >= 0 ? d / node_size : -1;
        const bool node_lead = leads_group(node);
        const unsigned node_leaders = __ballot_sync(kFullMask, node_lead);
        // the node's index among the nodes in first-appearance order, from the node's leading lane
        const unsigned same_node = __match_any_sync(kFullMask, node >= 0 ? node : -1 - lane);
        const int node_lane = __ffs(same_node) - 1;
        const int node_idx = __popc(node_leaders & lanes_below(node_lane));
        const int key = lead ? node_idx * kWarpSize + dest_idx : 0x7fffffff;
        int pos = 0, later_same_node = 0;
#pragma unroll 4
        for (int i = 0; i < kWarpSize; ++i) {
            const int other = __shfl_sync(kFullMask, key, i);
            pos += other < key;
            later_same_node += other != 0x7fffffff && other > key && other / kWarpSize == node_idx;
        }
        node_end = lead && later_same_node == 0;
        return lead ? pos : -1;
    }
}

// acc += the partials p_j (one uint4 of 8 bf16 channels per destination, in order), with or without
// the node level: one node: acc = acc + float(p_j); nodes: q = 0.0f, q = q + float(p_j) over the
// node's ranks, acc = acc + float(bf16_rne(q)) at the node's end.
template <bool kNodes>
__device__ __forceinline__ void add_partial(float (&acc)[8], float (&q)[8], const uint4& v, bool node_end) {
    if constexpr (!kNodes) {
        add_chunk(acc, v);
    } else {
        add_chunk(q, v);
        if (node_end) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                acc[i] = __fadd_rn(acc[i], num::bf16_to_float(num::float_to_bf16(q[i])));
                q[i] = 0.0f;
            }
        }
    }
}

template <class Team, bool kBias, bool kNodes = false>
__global__ void __launch_bounds__(kThreads, 2) reduce_kernel(CombineParams<Team> p) {
    wait_for_previous_grid();
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    __shared__ int64_t slot_list[kWarps][kMaxTopk];
    __shared__ bool end_list[kWarps][kMaxTopk];
    const int lane = lane_id(), warp = warp_id();
    const int warps_total = gridDim.x * kWarps;
    const int chunks = sh.hidden / 8;
    const uint16_t* slots = RegionLayout::at<uint16_t>(p.team.self(), region.combine_slot(0));
    int64_t* sl = slot_list[warp];
    bool* el = end_list[warp];
    // work items: RowSlice over this rank's tokens; with the node level one chunk per lane and step
    // (three accumulators per channel), else two
    constexpr int kPer = kNodes ? 1 : 2;
    constexpr int kStep = 32 * kPer;
    const int iters = (chunks + kStep - 1) / kStep;
    const int slices = row_slices(p.num_tokens, iters, warps_total);
    const int64_t items = int64_t{p.num_tokens} * slices;
    for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int t = slice.row, it0 = slice.begin, it1 = slice.end;
        const bool active = lane < sh.num_topk;
        const int32_t clean = active ? p.ws.clean_idx[t * sh.num_topk + lane] : -1;
        const int d = clean >= 0 ? clean / sh.num_local_experts : -1;
        int n = 0;
        bool node_end = false;
        const int at = destination_order<kNodes>(d, sh.node_size(), n, node_end);
        __syncwarp();  // the previous token's list is read
        if (at >= 0) {
            // the token's partial from d: this rank's message slot_of[t][k] to d, in its compact rows
            sl[at] = int64_t{p.ws.out_base[d]} + p.ws.slot_of[t * sh.num_topk + lane];
            el[at] = node_end;
        }
        __syncwarp();
        for (int base = it0 * kStep; base < min(chunks, it1 * kStep); base += kStep) {
            float a[kPer][8], q[kPer][8];
            bool ok[kPer];
            int c[kPer];
#pragma unroll
            for (int u = 0; u < kPer; ++u) {
                c[u] = base + lane + 32 * u;
                ok[u] = c[u] < chunks;
#pragma unroll
                for (int i = 0; i < 8; ++i) q[u][i] = 0.0f;
                if constexpr (kBias) {
                    const uint16_t* br = p.bias + t * p.bias_row_stride;
                    load_chunk(a[u], ok[u] ? *reinterpret_cast<const uint4*>(br + c[u] * 8) : make_uint4(0, 0, 0, 0));
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) a[u][i] = 0.0f;
                }
            }
            for (int j0 = 0; j0 < n; j0 += kBatch) {
                uint4 v[kBatch][kPer];
#pragma unroll
                for (int b = 0; b < kBatch; ++b) {
                    const bool has = j0 + b < n;
                    const uint16_t* pr = slots + (has ? sl[j0 + b] : 0) * sh.hidden;
#pragma unroll
                    for (int u = 0; u < kPer; ++u)
                        v[b][u] = has && ok[u] ? __ldcg(reinterpret_cast<const uint4*>(pr + c[u] * 8))
                                               : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int b = 0; b < kBatch; ++b)
                    if (j0 + b < n)
#pragma unroll
                        for (int u = 0; u < kPer; ++u) add_partial<kNodes>(a[u], q[u], v[b][u], el[j0 + b]);
            }
#pragma unroll
            for (int u = 0; u < kPer; ++u)
                if (ok[u]) *reinterpret_cast<uint4*>(p.out + t * p.out_row_stride + c[u] * 8) = pack_chunk(a[u]);
        }
    }
}

}  // namespace elasticep::kernels
