// Combine kernels of the hybrid topology (protocol: src/core/protocol.hpp, H4-H6; the order:
// docs/SEMANTICS.md, "Combine"). On one stream:
//
// partial_kernel       grid 2 * num_sms. Work item: a RowSlice of one message this rank received. The
//                      bf16 partial (fmaf over the message's routes here, k ascending) goes into the
//                      window of the origin's rail peer in this node, comb_in[origin's node][local][t].
// comb_publish_kernel  one warp: fence, then this rank's epoch into comb_flags[local] of every rank of the node.
//   (the NVLink wait for the node's holders)
// node_reduce_kernel   grid 2 * num_sms. Work item: a RowSlice of one message this rank forwarded (source
//                      node p, j). q = 0.0f; q += float(partial) over the token's ranks in this node in
//                      first-k order; bf16 into comb_send[p] row j. Several nodes only.
//   (the rail transport moves comb_send[p] to origin node p's rank, then the network wait)
// reduce_kernel        grid 2 * num_sms. Work item: a RowSlice of one of this rank's tokens. Several nodes:
//                      bias, then the node partials in the order of their first rank in the token's list
//                      (row node_slot of the node's slab); one node: bias, then the rank partials of
//                      comb_in in first-k order (the flat order).
#pragma once

#include "kernels/hybrid/params.cuh"

namespace elasticep::kernels::hybrid {

__device__ __forceinline__ void fma_chunk(float (&acc)[8], float w, const uint4& v) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] = fmaf(w, num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu)), acc[2 * i]);
        acc[2 * i + 1] = fmaf(w, num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16)), acc[2 * i + 1]);
    }
}

__device__ __forceinline__ void add_chunk(float (&acc)[8], const uint4& v) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] = __fadd_rn(acc[2 * i], num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu)));
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16)));
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

__device__ __forceinline__ void load_chunk(float (&acc)[8], const uint4& v) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] = num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu));
        acc[2 * i + 1] = num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16));
    }
}

__device__ __forceinline__ void zero(float (&acc)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
}

template <bool kWeighted>
__global__ void __launch_bounds__(kThreads, 2) partial_kernel(CombineParams p) {
    const HybridShape& sh = p.shape;
    const NodeRegion& region = p.region;
    const MessageLayout& m = sh.msg;
    if (p.ws.state->timed_out != 0) return;
    __shared__ int32_t route_rows[kWarps][kMaxTopk];
    __shared__ float route_w[kWarps][kMaxTopk];
    __shared__ int32_t msg_start[kMaxRanks + 1];
    const int lane = lane_id(), warp = warp_id();
    const int warps_total = gridDim.x * kWarps;
    const uint8_t* mine = p.node.self();
    const int chunks = sh.hidden / 8;
    const int num_msgs = load_starts(msg_start, sh.num_ranks, p.ws.msg_start);
    const int iters = (chunks + 31) / 32;
    const int slices = row_slices(num_msgs, iters, warps_total);
    const int64_t items = int64_t{num_msgs} * slices;
    for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int s = find_start(msg_start, sh.num_ranks, slice.row);
        const int j = slice.row - msg_start[s];
        const int64_t g = int64_t{s} * sh.capacity + j;
        const uint8_t* msg = mine + region.message(s, j);
        int32_t row = -1;
        float w = 1.0f;
        if (lane < sh.num_topk) {
            row = p.ws.recv_rows[g * sh.num_topk + lane];
            if constexpr (kWeighted) w = __ldcg(reinterpret_cast<const float*>(msg + m.weight_offset) + lane);
        }
        const int32_t t = __ldcg(reinterpret_cast<const int32_t*>(msg + m.src_offset));
        if (t < 0 || t >= sh.capacity) continue;  // dropped (and named) by the expand kernel
        const unsigned routes = __ballot_sync(kFullMask, row >= 0);
        const int n = __popc(routes);
        __syncwarp();
        if (row >= 0) {
            const int at = __popc(routes & lanes_below(lane));
            route_rows[warp][at] = row;
            route_w[warp][at] = w;
        }
        __syncwarp();
        uint16_t* dst = reinterpret_cast<uint16_t*>(p.node.window(s % sh.node_size) +
                                                    region.comb_row(s / sh.node_size, sh.local, t));
        for (int c = slice.begin * 32 + lane; c < min(chunks, slice.end * 32); c += 32) {
            float acc[8];
            zero(acc);
            for (int r = 0; r < n; ++r)
                fma_chunk(acc, route_w[warp][r],
                          *reinterpret_cast<const uint4*>(p.y + int64_t{route_rows[warp][r]} * sh.hidden + c * 8));
            *reinterpret_cast<uint4*>(dst + c * 8) = pack_chunk(acc);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
}

__global__ void __launch_bounds__(32) comb_publish_kernel(CombineParams p) {
    if (p.ws.state->timed_out != 0) return;
    const HybridShape& sh = p.shape;
    const uint64_t epoch = *p.ws.epoch;
    __threadfence_system();
    for (int i = threadIdx.x; i < sh.node_size; i += blockDim.x)
        transport::st_release_sys(reinterpret_cast<uint64_t*>(p.node.window(i) + p.region.comb_flag(sh.local)), epoch);
}

// The lanes leading each distinct non-negative key, in lane (first-k) order; the whole warp calls.
__device__ __forceinline__ unsigned leaders_of(int key) { return __ballot_sync(kFullMask, leads_group(key)); }

__global__ void __launch_bounds__(kThreads, 2) node_reduce_kernel(CombineParams p) {
    const HybridShape& sh = p.shape;
    const MessageLayout& m = sh.msg;
    const NodeRegion& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    __shared__ int32_t start[kMaxRanks + 1];
    __shared__ int32_t dests[kWarps][kMaxTopk];
    if (threadIdx.x == 0) {
        int32_t total = 0;
        for (int q = 0; q < sh.num_nodes; ++q) {
            start[q] = total;
            total += p.ws.fwd_count[q];
        }
        start[sh.num_nodes] = total;
    }
    __syncthreads();
    const int num_msgs = start[sh.num_nodes];
    const int lane = lane_id(), warp = warp_id();
    const int warps_total = gridDim.x * kWarps;
    const int chunks = sh.hidden / 8;
    const int iters = (chunks + 31) / 32;
    const int slices = row_slices(num_msgs, iters, warps_total);
    const int64_t items = int64_t{num_msgs} * slices;
    const uint8_t* mine = p.node.self();
    for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int src_node = find_start(start, sh.num_nodes, slice.row);
        const int j = slice.row - start[src_node];
        const uint8_t* msg = p.rail_base + p.rail.arrived_slab(kPhaseDispatch, src_node, sh.node) + sh.header_bytes +
                             int64_t{j} * sh.rail_msg_bytes;
        const int32_t t = __ldcg(reinterpret_cast<const int32_t*>(msg + m.src_offset));
        int32_t e = lane < sh.num_topk ? __ldcg(reinterpret_cast<const int32_t*>(msg + m.idx_offset) + lane) : -1;
        if (e < -1 || e >= sh.num_experts) e = -1;  // named by the forward kernel
        const int d = e >= 0 ? e / sh.num_local_experts : -1;
        const int dl = d >= 0 && d / sh.node_size == sh.node ? d % sh.node_size : -1;
        const unsigned lead = leaders_of(dl);
        const int n = __popc(lead);
        __syncwarp();
        if (dl >= 0 && ((lead >> lane) & 1u)) dests[warp][__popc(lead & lanes_below(lane))] = dl;
        __syncwarp();
        uint16_t* dst = reinterpret_cast<uint16_t*>(p.rail_base + p.rail.send_slab(kPhaseCombine, src_node)) +
                        int64_t{j} * sh.hidden;
        const bool token_ok = t >= 0 && t < sh.capacity;
        for (int c = slice.begin * 32 + lane; c < min(chunks, slice.end * 32); c += 32) {
            float acc[8];
            zero(acc);
            for (int i = 0; token_ok && i < n; ++i)
                add_chunk(acc, __ldcg(reinterpret_cast<const uint4*>(
                                   mine + region.comb_row(src_node, dests[warp][i], t) + int64_t{c} * 16)));
            *reinterpret_cast<uint4*>(dst + c * 8) = pack_chunk(acc);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
}

template <bool kBias, bool kNodes>
__global__ void __launch_bounds__(kThreads, 2) reduce_kernel(CombineParams p) {
    const HybridShape& sh = p.shape;
    const NodeRegion& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    __shared__ const uint8_t* rows[kWarps][kMaxTopk];
    const int lane = lane_id(), warp = warp_id();
    const int warps_total = gridDim.x * kWarps;
    const int chunks = sh.hidden / 8;
    const int iters = (chunks + 31) / 32;
    const int slices = row_slices(p.num_tokens, iters, warps_total);
    const int64_t items = int64_t{p.num_tokens} * slices;
    const uint8_t* mine = p.node.self();
    for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int t = slice.row;
        const int32_t clean = lane < sh.num_topk ? p.ws.clean_idx[t * sh.num_topk + lane] : -1;
        const int d = clean >= 0 ? clean / sh.num_local_experts : -1;
        // several nodes: the destination nodes in first-rank order, each its node partial's row;
        // one node: the destination ranks in first-k order, each its partial in comb_in
        const int key = kNodes ? (d >= 0 ? d / sh.node_size : -1) : d;
        const unsigned lead = leaders_of(key);
        const int n = __popc(lead);
        __syncwarp();
        if (key >= 0 && ((lead >> lane) & 1u)) {
            const uint8_t* row;
            if constexpr (kNodes) {
                const int32_t j = p.ws.node_slot[t * sh.num_topk + lane];
                row = p.rail_base + p.rail.arrived_slab(kPhaseCombine, key, sh.node) + int64_t{j} * sh.hidden * 2;
            } else {
                row = mine + region.comb_row(0, key % sh.node_size, t);
            }
            rows[warp][__popc(lead & lanes_below(lane))] = row;
        }
        __syncwarp();
        for (int c = slice.begin * 32 + lane; c < min(chunks, slice.end * 32); c += 32) {
            float acc[8];
            if constexpr (kBias)
                load_chunk(acc, *reinterpret_cast<const uint4*>(p.bias + t * p.bias_row_stride + c * 8));
            else
                zero(acc);
            for (int i = 0; i < n; ++i) add_chunk(acc, __ldcg(reinterpret_cast<const uint4*>(rows[warp][i]) + c));
            *reinterpret_cast<uint4*>(p.out + t * p.out_row_stride + c * 8) = pack_chunk(acc);
        }
    }
}

}  // namespace elasticep::kernels::hybrid
