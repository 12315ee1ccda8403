// Dispatch kernels of the hybrid topology (protocol: src/core/protocol.hpp, H1-H3). On one stream:
//
// plan_kernel      grid E + R + N + kStatusBlocks, block kThreads. Ordered scans over this rank's tokens:
//                  block e < E: pos_in_expert and expert_count[e]; block E + d: slot_of (at the first k
//                  routed to rank d) and dest_count[d]; block E + R + q: node_slot (at the first k routed to
//                  node q) and node_count[q]; status blocks: first_bad_route (atomicMin), sticky_seen.
// header_kernel    one block. Advances ws.epoch (the call's epoch from here to the end of its combine),
//                  resolves the route status (decide_route_status) and writes every dispatch slab's
//                  header in the send area (epoch, count, status, per-rank and per-expert counts of that
//                  node), and the slab sizes (ws.send_bytes). A rejected host-sync call sends no message.
// pack_kernel      grid 2 * num_sms. Work item: a RowSlice of one token. Writes the token's rail message
//                  once per destination node into that node's send slab (FP8 quantization fused), and
//                  ws.clean_idx.
//   (the rail transport moves the send slabs of other nodes to their rail peers, then the network wait)
// forward_kernel   grid 2 * num_sms. Work item: a RowSlice of one arrived message (source node p, j).
//                  Checks the slab headers (epoch, count) and every address it uses (expert ids, the
//                  destination slot against the header's count), writes the direct message and its
//                  route-position row into each destination rank's window of this node, sender slot
//                  [p * P + i][dslot]. Records ws.fwd_count. Ends with a system fence per block.
// forward_publish_kernel  one block. Per (source node, rank of this node): the NodeFlag count and status
//                  and the per-expert counts, fenced, then the epoch released.
//   (the NVLink wait for every sender's NodeFlag)
// exchange_kernel  one block: counts, offsets, expert_base, msg_start, expert_load and the host record's
//                  summary from the flags in this rank's window (peer counts checked on receipt).
// expand_kernel    grid 2 * num_sms. Work item: a RowSlice of one received message. The caller's layout.
#pragma once

#include <cuda_fp8.h>

#include <type_traits>

#include "kernels/common/routes.cuh"
#include "kernels/hybrid/params.cuh"

namespace elasticep::kernels::hybrid {

// launch: <<<1, 32>>>. The device half of a wait (host-wait mode polls the same words instead).
__global__ void __launch_bounds__(32) wait_kernel(Params p, WaitSpec w) {
    if (threadIdx.x != 0 || p.ws.state->timed_out != 0) return;
    const uint64_t epoch = *p.ws.epoch;
    if (wait_words(w, epoch, Deadline::from_now(p.timeout_ns), p.record) != WaitStatus::kOk) p.ws.state->timed_out = 1;
}

template <bool kIdx64>
__global__ void __launch_bounds__(kThreads) plan_kernel(DispatchParams p) {
    const HybridShape& sh = p.shape;
    const int b = blockIdx.x;
    const int t_count = p.num_tokens;
    const int e_end = sh.num_experts, d_end = e_end + sh.num_ranks, q_end = d_end + sh.num_nodes;
    if (b < q_end) {
        const int kind = b < e_end ? 0 : b < d_end ? 1 : 2;
        const int target = kind == 0 ? b : kind == 1 ? b - e_end : b - d_end;
        int running = 0;
        for (int base = 0; base < t_count; base += kThreads) {
            const int t = base + threadIdx.x;
            int hit_k = -1;  // the smallest valid k that hits (a repeat has a smaller twin)
            if (t < t_count) {
                for (int k = sh.num_topk - 1; k >= 0; --k) {
                    const int64_t v = topk_at<kIdx64>(p, t, k);
                    const bool valid = v >= 0 && v < sh.num_experts;
                    const int64_t d = valid ? v / sh.num_local_experts : -1;
                    const bool hit = kind == 0   ? v == target
                                     : kind == 1 ? d == target
                                                 : valid && d / sh.node_size == target;
                    if (hit) hit_k = k;
                }
            }
            const int pos = block_scan(hit_k >= 0, running);
            if (hit_k >= 0) {
                int32_t* out = kind == 0 ? p.ws.pos_in_expert : kind == 1 ? p.ws.slot_of : p.ws.node_slot;
                out[t * sh.num_topk + hit_k] = pos;
            }
        }
        if (threadIdx.x == 0) {
            int32_t* count = kind == 0 ? p.ws.expert_count : kind == 1 ? p.ws.dest_count : p.ws.node_count;
            count[target] = running;
        }
        return;
    }
    // status blocks (src/kernels/common/routes.cuh)
    if (b == q_end && threadIdx.x == 0) copy_sticky_word(p);
    scan_route_status<kIdx64>(p, (b - q_end) * kWarps + warp_id(), kStatusBlocks * kWarps);
}

template <bool kIdx64>
__global__ void __launch_bounds__(kSmallThreads) header_kernel(DispatchParams p) {
    const HybridShape& sh = p.shape;
    __shared__ uint64_t epoch;
    __shared__ bool reject;
    if (p.ws.state->timed_out != 0) return;
    if (threadIdx.x == 0) {
        epoch = *p.ws.epoch + 1;
        *p.ws.epoch = epoch;
        *p.ws.route_status = resolve_route_status<kIdx64>(p);
        reject = p.ws.route_status->any();
    }
    __syncthreads();
    const RouteStatus st = *p.ws.route_status;
    const int el = sh.num_local_experts;
    for (int q = 0; q < sh.num_nodes; ++q) {
        uint8_t* h = p.rail_base + p.rail.send_slab(kPhaseDispatch, q);
        const int64_t count = reject ? 0 : p.ws.node_count[q];
        if (threadIdx.x == 0) {
            auto* hd = reinterpret_cast<RailHeader*>(h);
            hd->epoch = epoch;
            hd->count = count;
            hd->status = st;
            p.ws.send_bytes[q] = sh.header_bytes + count * sh.rail_msg_bytes;
        }
        int32_t* dc = RailHeader::dest_counts(h);
        int32_t* ec = RailHeader::expert_counts(h, sh.node_size);
        for (int i = threadIdx.x; i < sh.node_size; i += blockDim.x)
            dc[i] = reject ? 0 : p.ws.dest_count[q * sh.node_size + i];
        for (int i = threadIdx.x; i < sh.node_size * el; i += blockDim.x)
            ec[i] = reject ? 0 : p.ws.expert_count[q * sh.node_size * el + i];
    }
}

template <RailPayload kPayload, bool kIdx64>
__global__ void __launch_bounds__(kThreads, 2) pack_kernel(DispatchParams p) {
    constexpr bool kFP8 = payload_is_fp8(kPayload);
    constexpr bool kFused = payload_quantizes(kPayload);
    constexpr bool kF32Scales = payload_f32_scales(kPayload);
    constexpr int kScaleGroup = payload_scale_group(kPayload);
    static_assert(kScaleGroup % 16 == 0 && kScaleGroup / 16 <= kWarpSize, "a scale group is whole lanes");
    const HybridShape& sh = p.shape;
    const MessageLayout& m = sh.msg;
    if (p.ws.state->timed_out != 0 || p.ws.route_status->any()) return;  // a rejected call sends nothing
    __shared__ uint8_t* dst_msg[kWarps][kMaxTopk];
    const int lane = lane_id(), warp = warp_id();
    const int warps_total = gridDim.x * kWarps;
    uint8_t** msgs = dst_msg[warp];
    const int chunks = kFP8 ? sh.hidden / 16 : sh.hidden / 8;
    const int iters = kFused ? (sh.hidden + 511) / 512 : (chunks + 127) / 128;
    const int slices = row_slices(p.num_tokens, iters, warps_total);
    const int64_t items = int64_t{p.num_tokens} * slices;
    for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int t = slice.row, it0 = slice.begin, it1 = slice.end;
        const bool first = slice.first;
        const bool active = lane < sh.num_topk;
        const int64_t v = active ? topk_at<kIdx64>(p, t, lane) : -1;
        int fault, dup;
        const int32_t clean = clean_route(v, active, sh.num_experts, fault, dup);
        const int dest = clean >= 0 ? clean / sh.num_local_experts : -1;
        const int node = dest >= 0 ? dest / sh.node_size : -1;
        if (active && first) p.ws.clean_idx[t * sh.num_topk + lane] = clean;
        // the token's slot at its destination rank: stored at that rank's first k
        const unsigned same_dest = __match_any_sync(kFullMask, dest >= 0 ? dest : 0x40000000 + lane);
        const int32_t my_slot = active ? p.ws.slot_of[t * sh.num_topk + lane] : 0;
        const int32_t dslot = __shfl_sync(kFullMask, my_slot, __ffs(same_dest) - 1);
        const bool leads = leads_group(node);
        const unsigned leaders = __ballot_sync(kFullMask, leads);
        if (leaders == 0) continue;
        const int num_dst = __popc(leaders);
        if (leads) {
            const int i = __popc(leaders & lanes_below(lane));
            const int32_t j = p.ws.node_slot[t * sh.num_topk + lane];
            msgs[i] =
                p.rail_base + p.rail.send_slab(kPhaseDispatch, node) + sh.header_bytes + int64_t{j} * sh.rail_msg_bytes;
        }
        __syncwarp();
        if (first) {
            const float w = (active && p.topk_weights) ? p.topk_weights[t * p.topk_weights_row_stride + lane] : 0.0f;
            const int32_t rpos = clean >= 0 ? p.ws.pos_in_expert[t * sh.num_topk + lane] : -1;
            for (int i = 0; i < num_dst; ++i) {
                uint8_t* msg = msgs[i];
                if (active) {
                    reinterpret_cast<int32_t*>(msg + m.idx_offset)[lane] = clean;
                    reinterpret_cast<float*>(msg + m.weight_offset)[lane] = w;
                    reinterpret_cast<int32_t*>(msg + sh.dslot_offset())[lane] = clean >= 0 ? dslot : -1;
                    reinterpret_cast<int32_t*>(msg + sh.rpos_offset())[lane] = rpos;
                }
                if (lane == 0) *reinterpret_cast<int32_t*>(msg + m.src_offset) = t;
            }
        }
        if constexpr (!kFused) {
            const int64_t row_off = t * p.x_row_stride * (kFP8 ? 1 : 2);
            for (int c0 = it0 * 128 + lane; c0 < min(chunks, it1 * 128); c0 += 128) {
                uint4 val[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int c = c0 + 32 * u;
                    val[u] = c < chunks ? load16(p.x, row_off + c * 16, p.x_aligned) : make_uint4(0, 0, 0, 0);
                }
                for (int i = 0; i < num_dst; ++i)
#pragma unroll
                    for (int u = 0; u < 4; ++u)
                        if (c0 + 32 * u < chunks) reinterpret_cast<uint4*>(msgs[i])[c0 + 32 * u] = val[u];
            }
            if (kPayload == RailPayload::kFP8Copy && first)
                for (int c = lane; c < p.scale_columns; c += 32) {
                    const uint32_t word = p.x_scales[t * p.x_scales_row_stride + c];
                    for (int i = 0; i < num_dst; ++i) reinterpret_cast<uint32_t*>(msgs[i] + m.payload_bytes)[c] = word;
                }
        } else {
            // lane owns 16 channels of each 512-channel step; a scale group is G / 16 consecutive lanes
            constexpr int kLanesPerGroup = kScaleGroup / 16;
            const int num_groups = sh.hidden / kScaleGroup;
            if (!kF32Scales && first && lane < p.scale_columns * 4 - num_groups)
                for (int i = 0; i < num_dst; ++i) (msgs[i] + m.payload_bytes)[num_groups + lane] = 0;
            const int64_t row_off = t * p.x_row_stride * 2;
            for (int base = it0 * 512; base < min(sh.hidden, it1 * 512); base += 512) {
                const int ch = base + lane * 16;
                const bool ok = ch < sh.hidden;
                uint4 raw0 = make_uint4(0, 0, 0, 0), raw1 = raw0;
                if (ok) {
                    raw0 = load16(p.x, row_off + ch * 2, p.x_aligned);
                    raw1 = load16(p.x, row_off + ch * 2 + 16, p.x_aligned);
                }
                float f[16];
                float amax = 0.0f;
                const uint32_t words[8] = {raw0.x, raw0.y, raw0.z, raw0.w, raw1.x, raw1.y, raw1.z, raw1.w};
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    f[2 * i] = num::bf16_to_float(static_cast<uint16_t>(words[i] & 0xffffu));
                    f[2 * i + 1] = num::bf16_to_float(static_cast<uint16_t>(words[i] >> 16));
                }
#pragma unroll
                for (int i = 0; i < 16; ++i) amax = num::fmax_ignore_nan(amax, num::abs_bits(f[i]));
#pragma unroll
                for (int o = kLanesPerGroup / 2; o > 0; o >>= 1)
                    amax = num::fmax_ignore_nan(amax, __shfl_xor_sync(kFullMask, amax, o));
                amax = num::fmax_ignore_nan(amax, num::kAmaxFloor);
                float mul;
                uint32_t scale_bits;
                if constexpr (kF32Scales) {
                    scale_bits = num::float_bits(__fdiv_rn(amax, num::kE4M3Max));
                    mul = __fdiv_rn(num::kE4M3Max, amax);
                } else {
                    const uint8_t byte = num::ue8m0_exponent_byte(__fdiv_rn(amax, num::kE4M3Max));
                    scale_bits = byte;
                    mul = num::ue8m0_inverse(byte);
                }
                uint32_t q[4] = {0, 0, 0, 0};
#pragma unroll
                for (int i = 0; i < 16; i += 2)
                    q[i / 4] |= static_cast<uint32_t>(e4m3x2(__fmul_rn(f[i], mul), __fmul_rn(f[i + 1], mul)))
                                << (8 * (i % 4));
                const int gi = ch / kScaleGroup;
                const bool leader = ok && (lane % kLanesPerGroup) == 0;
                if (ok)
                    for (int i = 0; i < num_dst; ++i) {
                        uint8_t* msg = msgs[i];
                        *reinterpret_cast<uint4*>(msg + ch) = make_uint4(q[0], q[1], q[2], q[3]);
                        if (leader) {
                            if constexpr (kF32Scales)
                                reinterpret_cast<uint32_t*>(msg + m.payload_bytes)[gi] = scale_bits;
                            else
                                (msg + m.payload_bytes)[gi] = static_cast<uint8_t>(scale_bits);
                        }
                    }
            }
        }
        __syncwarp();
    }
}

// The arrived dispatch slab of source node p, checked: its message count (-1: unusable, nothing of
// it is forwarded) and status. Faults are recorded naming the sender.
struct SlabView {
    const uint8_t* base;
    int32_t count;
    RouteStatus status;
};

__device__ __forceinline__ SlabView view_slab(const DispatchParams& p, int src_node, uint64_t epoch, bool record) {
    const HybridShape& sh = p.shape;
    SlabView v;
    v.base = p.rail_base + p.rail.arrived_slab(kPhaseDispatch, src_node, sh.node);
    const auto* h = reinterpret_cast<const volatile RailHeader*>(v.base);
    const uint64_t e = h->epoch;
    const int64_t count = h->count;
    const int sender = sh.rail_rank(src_node);
    v.count = -1;
    v.status = RouteStatus{};
    if (e != epoch) {
        if (record) record_peer_fault(p.ws, p.record, detail::kPeerEpoch, sender, kPhaseDispatch, e, epoch);
    } else if (count < 0 || count > sh.capacity) {
        if (record) record_peer_fault(p.ws, p.record, detail::kPeerCount, sender, kPhaseDispatch, count, sh.capacity);
    } else {
        v.count = static_cast<int32_t>(count);
        v.status.kind = h->status.kind;
        v.status.token = h->status.token;
        v.status.k = h->status.k;
        v.status.dup_of = h->status.dup_of;
        v.status.value = h->status.value;
        v.status.sticky = h->status.sticky;
        if (v.status.any()) v.count = 0;  // a rejected call carries no message
    }
    return v;
}

__global__ void __launch_bounds__(kThreads, 2) forward_kernel(DispatchParams p) {
    const HybridShape& sh = p.shape;
    const MessageLayout& m = sh.msg;
    const NodeRegion& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    __shared__ int32_t start[kMaxRanks + 1];
    __shared__ uint8_t* dst_msg[kWarps][kMaxTopk];
    __shared__ int32_t* dst_pos[kWarps][kMaxTopk];
    const uint64_t epoch = *p.ws.epoch;
    if (threadIdx.x == 0) {
        int32_t total = 0;
        for (int q = 0; q < sh.num_nodes; ++q) {
            start[q] = total;
            const SlabView v = view_slab(p, q, epoch, blockIdx.x == 0);
            const int32_t n = v.count > 0 ? v.count : 0;
            if (blockIdx.x == 0) {
                p.ws.fwd_count[q] = n;
                p.ws.send_bytes[sh.num_nodes + q] = int64_t{n} * sh.hidden * 2;
            }
            total += n;
        }
        start[sh.num_nodes] = total;
    }
    __syncthreads();
    const int num_msgs = start[sh.num_nodes];
    const int lane = lane_id(), warp = warp_id();
    const int warps_total = gridDim.x * kWarps;
    const int chunks = m.bytes / 16;
    const int iters = (chunks + 127) / 128;
    const int slices = row_slices(num_msgs, iters, warps_total);
    const int64_t items = int64_t{num_msgs} * slices;
    for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int src_node = find_start(start, sh.num_nodes, slice.row);
        const int j = slice.row - start[src_node];
        const int sender = sh.rail_rank(src_node);
        const uint8_t* slab = p.rail_base + p.rail.arrived_slab(kPhaseDispatch, src_node, sh.node);
        const int32_t* dest_count = RailHeader::dest_counts(slab);
        const uint8_t* msg = slab + sh.header_bytes + int64_t{j} * sh.rail_msg_bytes;
        const bool active = lane < sh.num_topk;
        int32_t e = -1, dslot = -1, rpos = -1;
        if (active) {
            e = __ldcg(reinterpret_cast<const int32_t*>(msg + m.idx_offset) + lane);
            dslot = __ldcg(reinterpret_cast<const int32_t*>(msg + sh.dslot_offset()) + lane);
            rpos = __ldcg(reinterpret_cast<const int32_t*>(msg + sh.rpos_offset()) + lane);
        }
        const bool id_ok = e >= -1 && e < sh.num_experts;
        if (slice.first && active && !id_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerExpertId, sender, kPhaseDispatch, e, sh.num_experts);
        const int d = id_ok && e >= 0 ? e / sh.num_local_experts : -1;
        int dl = d >= 0 && d / sh.node_size == sh.node ? d % sh.node_size : -1;  // a rank of this node
        if (dl >= 0) {
            const int32_t limit = __ldcg(dest_count + dl);
            if (dslot < 0 || dslot >= limit || limit > sh.capacity) {
                if (slice.first)
                    record_peer_fault(p.ws, p.record, detail::kPeerPosition, sender, kPhaseDispatch, dslot, limit);
                dl = -1;
            }
        }
        const bool leads = leads_group(dl);
        const unsigned leaders = __ballot_sync(kFullMask, leads);
        const int n = __popc(leaders);
        if (leads) {
            const int i = __popc(leaders & lanes_below(lane));
            uint8_t* window = p.node.window(dl);
            dst_msg[warp][i] = window + region.message(sender, dslot);
            dst_pos[warp][i] = reinterpret_cast<int32_t*>(window + region.route_pos_row(sender, dslot));
        }
        __syncwarp();
        if (slice.first)
            for (int i = 0; i < n; ++i) {
                // lane k: its route position where route k goes to this destination, else -1
                const int leader = __fns(leaders, 0, i + 1);
                const int di = __shfl_sync(kFullMask, dl, leader);
                if (active) dst_pos[warp][i][lane] = dl == di && dl >= 0 ? rpos : -1;
            }
        warp_copy(dst_msg[warp], n, msg, slice.begin * 128, min(chunks, slice.end * 128));
        __syncwarp();
    }
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
}

__global__ void __launch_bounds__(kSmallThreads) forward_publish_kernel(DispatchParams p) {
    const HybridShape& sh = p.shape;
    const NodeRegion& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    const uint64_t epoch = *p.ws.epoch;
    const int parity = static_cast<int>(epoch & 1);
    const int el = sh.num_local_experts;
    for (int x = threadIdx.x; x < sh.num_nodes * sh.node_size; x += blockDim.x) {
        const int q = x / sh.node_size, i = x % sh.node_size;
        const SlabView v = view_slab(p, q, epoch, false);
        const int sender = sh.rail_rank(q);
        int32_t count = v.count > 0 ? RailHeader::dest_counts(v.base)[i] : 0;
        if (count < 0 || count > sh.capacity) {
            record_peer_fault(p.ws, p.record, detail::kPeerCount, sender, kPhaseDispatch, count, sh.capacity);
            count = 0;
        }
        uint8_t* window = p.node.window(i);
        auto* f = reinterpret_cast<NodeFlag*>(window + region.flag(sender, parity));
        f->count = count;
        f->status = v.status;
        int32_t* ec = reinterpret_cast<int32_t*>(window + region.expert_counts_row(sender, parity));
        const int32_t* src = RailHeader::expert_counts(v.base, sh.node_size) + i * el;
        for (int l = 0; l < el; ++l) ec[l] = count > 0 ? src[l] : 0;
    }
    __threadfence_system();
    __syncthreads();
    for (int x = threadIdx.x; x < sh.num_nodes * sh.node_size; x += blockDim.x) {
        const int q = x / sh.node_size, i = x % sh.node_size;
        transport::st_release_sys(reinterpret_cast<uint64_t*>(p.node.window(i) + region.flag(sh.rail_rank(q), parity)),
                                  epoch);
    }
}

__global__ void __launch_bounds__(kSmallThreads) exchange_kernel(DispatchParams p) {
    static_assert(kMaxLocalExperts <= 1024, "segment sizes are scanned in shared memory");
    const HybridShape& sh = p.shape;
    const NodeRegion& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    const uint64_t epoch = *p.ws.epoch;
    const int parity = static_cast<int>(epoch & 1);
    const uint8_t* mine = p.node.self();
    auto flag_of = [&](int s) { return reinterpret_cast<const volatile NodeFlag*>(mine + region.flag(s, parity)); };
    __shared__ int32_t recv_count[kMaxRanks];
    const int64_t routes_per_token = sh.num_topk < sh.num_local_experts ? sh.num_topk : sh.num_local_experts;
    for (int s = threadIdx.x; s < sh.num_ranks; s += blockDim.x) {
        const int64_t count = flag_of(s)->count;
        const bool count_ok = count >= 0 && count <= sh.capacity;
        const int32_t* row = reinterpret_cast<const int32_t*>(mine + region.expert_counts_row(s, parity));
        int64_t sum = 0, bad = 0;
        bool each_ok = true;
        for (int l = 0; l < sh.num_local_experts; ++l) {
            const int64_t c = __ldcg(row + l);
            sum += c;
            const bool ok = c >= 0 && c <= count;
            bad = each_ok && !ok ? c : bad;
            each_ok = each_ok && ok;
        }
        const bool sum_ok = sum <= count * routes_per_token;
        if (!count_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerCount, s, kPhaseDispatch, count, sh.capacity);
        else if (!each_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerExpertCount, s, kPhaseDispatch, bad, count);
        else if (!sum_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerExpertCount, s, kPhaseDispatch, sum,
                              count * routes_per_token);
        recv_count[s] = count_ok && each_ok && sum_ok ? static_cast<int32_t>(count) : -1;
    }
    __syncthreads();
    __shared__ int32_t seg[kMaxLocalExperts];
    for (int l = threadIdx.x; l < sh.num_local_experts; l += blockDim.x) {
        int32_t total = 0;
        for (int s = 0; s < sh.num_ranks; ++s) {
            p.ws.expert_base[s * sh.num_local_experts + l] = total;
            if (recv_count[s] >= 0)
                total += __ldcg(reinterpret_cast<const int32_t*>(mine + region.expert_counts_row(s, parity)) + l);
        }
        p.ws.counts[l] = total;
        p.ws.expert_load[l] += total;
        seg[l] = p.expert_alignment > 0 ? static_cast<int32_t>(round_up(total, p.expert_alignment)) : 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t received = 0;
        for (int s = 0; s < sh.num_ranks; ++s) {
            p.ws.msg_start[s] = received;
            if (recv_count[s] > 0) received += recv_count[s];
        }
        p.ws.msg_start[sh.num_ranks] = received;
        int32_t at = 0;
        p.ws.offsets[0] = 0;
        for (int l = 0; l < sh.num_local_experts; ++l) {
            at += seg[l];
            p.ws.offsets[l + 1] = at;
        }
        int bad_sender = -1;
        for (int s = 0; s < sh.num_ranks && bad_sender < 0; ++s)
            if (flag_of(s)->status.kind != detail::kRouteOk) bad_sender = s;
        p.ws.state->rejected = bad_sender >= 0 ? 1 : 0;
        p.ws.state->num_rows = at;
        volatile HybridRecord* r = p.record;
        r->num_rows = at;
        r->bad_sender = bad_sender;
        if (bad_sender >= 0) {
            const volatile NodeFlag* f = flag_of(bad_sender);
            r->bad.kind = f->status.kind;
            r->bad.token = f->status.token;
            r->bad.k = f->status.k;
            r->bad.dup_of = f->status.dup_of;
            r->bad.value = f->status.value;
            r->bad.sticky = f->status.sticky;
        }
        __threadfence_system();
    }
}

template <bool kFP8, bool kContiguous>
__global__ void __launch_bounds__(kThreads, 2) expand_kernel(DispatchParams p) {
    const HybridShape& sh = p.shape;
    const NodeRegion& region = p.region;
    __shared__ int64_t expand_rows[kWarps][kMaxTopk];
    __shared__ int32_t msg_start[kMaxRanks + 1];
    if (p.ws.state->timed_out != 0 || p.ws.state->rejected != 0) return;
    const int lane = lane_id();
    const int rank = sh.rank();
    const int warps_total = gridDim.x * kWarps;
    const MessageLayout& m = sh.msg;
    const int64_t rc = sh.slots();
    const int row_bytes = sh.hidden * (kFP8 ? 1 : 2);
    const uint8_t* mine = p.node.self();
    const int num_msgs = load_starts(msg_start, sh.num_ranks, p.ws.msg_start);
    const int row_chunks = row_bytes / 16;
    const int iters = (row_chunks + 127) / 128;
    const int slices = row_slices(num_msgs, iters, warps_total);
    const int64_t items = int64_t{num_msgs} * slices;
    for (int64_t item = blockIdx.x * kWarps + warp_id(); item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const bool first = slice.first;
        const int s = find_start(msg_start, sh.num_ranks, slice.row);
        const int j = slice.row - msg_start[s];
        const int64_t g = int64_t{s} * sh.capacity + j;
        const uint8_t* msg = mine + region.message(s, j);
        const bool active = lane < sh.num_topk;
        int32_t v = -1;
        float w = 0.0f;
        if (active) {
            v = __ldcg(reinterpret_cast<const int32_t*>(msg + m.idx_offset) + lane);
            w = __ldcg(reinterpret_cast<const float*>(msg + m.weight_offset) + lane);
        }
        const int32_t src_t = __ldcg(reinterpret_cast<const int32_t*>(msg + m.src_offset));
        const bool token_ok = src_t >= 0 && src_t < sh.capacity;
        const bool id_ok = !active || (v >= -1 && v < sh.num_experts);
        if (first && lane == 0 && !token_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerToken, s, kPhaseDispatch, src_t, sh.capacity);
        if (first && !id_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerExpertId, s, kPhaseDispatch, v, sh.num_experts);
        bool local = token_ok && id_ok && v >= 0 && v / sh.num_local_experts == rank;
        const int l = local ? v % sh.num_local_experts : 0;
        int64_t pos = 0, row = -1;
        if (local) {
            const int32_t sent_pos = __ldcg(reinterpret_cast<const int32_t*>(mine + region.route_pos_row(s, j)) + lane);
            const int32_t base = p.ws.expert_base[s * sh.num_local_experts + l];
            const int32_t share =
                (s + 1 < sh.num_ranks ? p.ws.expert_base[(s + 1) * sh.num_local_experts + l] : p.ws.counts[l]) - base;
            if (sent_pos < 0 || sent_pos >= share) {
                if (first) record_peer_fault(p.ws, p.record, detail::kPeerPosition, s, kPhaseDispatch, sent_pos, share);
                local = false;
            } else {
                pos = sent_pos + base;
                row = kContiguous ? p.ws.offsets[l] + pos : l * rc + pos;
                if (first) {
                    p.recv_weights[row] = w;
                    p.recv_src[row] = static_cast<int32_t>(s * sh.capacity + src_t);
                    if constexpr (kContiguous) p.m_indices[row] = l;
                }
            }
        }
        if (active && first) p.ws.recv_rows[g * sh.num_topk + lane] = static_cast<int32_t>(row);
        const unsigned locals = __ballot_sync(kFullMask, local);
        const int num_local = __popc(locals);
        int64_t* rows = expand_rows[warp_id()];
        if (local) rows[__popc(locals & lanes_below(lane))] = row;
        __syncwarp();
        for (int c0 = slice.begin * 128 + lane; c0 < min(row_chunks, slice.end * 128); c0 += 128) {
            uint4 val[4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
                val[u] = c0 + 32 * u < row_chunks ? __ldcg(reinterpret_cast<const uint4*>(msg) + c0 + 32 * u)
                                                  : make_uint4(0, 0, 0, 0);
            for (int i = 0; i < num_local; ++i)
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    if (c0 + 32 * u < row_chunks)
                        reinterpret_cast<uint4*>(p.recv_x + rows[i] * row_bytes)[c0 + 32 * u] = val[u];
        }
        if (kFP8 && first) {
            for (unsigned lm = locals; lm; lm &= lm - 1) {
                const int k = __ffs(lm) - 1;
                const int64_t r = __shfl_sync(kFullMask, row, k);
                const int64_t ps = __shfl_sync(kFullMask, pos, k);
                const int ll = __shfl_sync(kFullMask, l, k);
                for (int c = lane; c < p.scale_columns; c += 32) {
                    const uint32_t word = __ldcg(reinterpret_cast<const uint32_t*>(msg + m.payload_bytes) + c);
                    const int64_t at =
                        kContiguous ? r * p.scale_row_stride + c * p.scale_column_stride
                                    : ll * p.scale_expert_stride + ps * p.scale_row_stride + c * p.scale_column_stride;
                    p.recv_scales[at] = word;
                }
            }
        }
        __syncwarp();
    }
    // padding rows
    const int64_t total = kContiguous ? p.num_rows_out : int64_t{sh.num_local_experts} * rc;
    const int64_t m_rows = p.ws.state->num_rows;
    for (int64_t r = blockIdx.x * int64_t{kThreads} + threadIdx.x; r < total; r += int64_t{gridDim.x} * kThreads) {
        int64_t l, pos;
        bool pad;
        if constexpr (kContiguous) {
            if (r >= m_rows) {
                pad = true;
                l = 0;
                pos = 0;
            } else {
                int lo = 0, hi = sh.num_local_experts;
                while (hi - lo > 1) {
                    const int mid = (lo + hi) / 2;
                    if (p.ws.offsets[mid] <= r)
                        lo = mid;
                    else
                        hi = mid;
                }
                l = lo;
                pos = r - p.ws.offsets[l];
                pad = pos >= p.ws.counts[l];
            }
        } else {
            l = r / rc;
            pos = r % rc;
            pad = pos >= p.ws.counts[l];
        }
        if (!pad) continue;
        p.recv_weights[r] = 0.0f;
        p.recv_src[r] = -1;
        if constexpr (kContiguous) p.m_indices[r] = -1;
        if (p.zero_padding) {
            uint4* dst = reinterpret_cast<uint4*>(p.recv_x + r * row_bytes);
            for (int c = 0; c < row_bytes / 16; ++c) dst[c] = make_uint4(0, 0, 0, 0);
            if constexpr (kFP8)
                for (int c = 0; c < p.scale_columns; ++c) {
                    const int64_t at =
                        kContiguous ? r * p.scale_row_stride + c * p.scale_column_stride
                                    : l * p.scale_expert_stride + pos * p.scale_row_stride + c * p.scale_column_stride;
                    p.recv_scales[at] = 0;
                }
        }
    }
}

}  // namespace elasticep::kernels::hybrid
