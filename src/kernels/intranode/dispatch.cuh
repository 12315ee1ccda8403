// Dispatch kernels of the direct topology (protocol: src/core/protocol.hpp, "Dispatch"). Push model:
// a sender writes each token once per destination rank into that rank's window; the receiver expands
// the messages into the caller's layout. Four kernels on one stream, in this order:
//
// plan_kernel      grid plan_grid(shape, T), block kThreads. Host precondition: the workspace was
//                  zeroed once and first_bad_route holds kNoRouteKey.
//                  Reads this rank's topk_idx and (one thread) the host-mapped sticky word.
//                  Writes ws.pos_in_expert, ws.expert_count (scan e < E: ordered scan over tokens for
//                  expert e), ws.slot_of, ws.dest_count (scan E + d: the same for destination rank d;
//                  a scan is one warp over a shared-memory copy of the top-k table for
//                  T * K <= kPlanStagedRoutes, else one block),
//                  ws.first_bad_route (atomicMin of route_key), ws.state->sticky_seen. Waits on nobody.
// send_kernel      grid 2 * num_sms, block kThreads (2 blocks per SM). Work item: a RowSlice of one
//                  token. Reads x (+ x_scales), topk_idx / topk_weights and the plan. Writes, in every
//                  destination's window, the token's message (FP8 quantization fused) and its
//                  route_pos row, for the messages of round p.round (the j-th message to a receiver
//                  belongs to round j / S and goes into ring slot j % S); ws.clean_idx. Each block
//                  ends with a system fence; nothing is announced yet. A rejected host-sync call
//                  sends nothing.
// exchange_kernel  one block of kExchangeThreads. Resolves the call's route status (decide_route_status),
//                  writes count, status, the combine-slot base and the sender's largest count, and the
//                  per-expert counts into every receiver's dispatch flag and signals its epoch
//                  (release); then waits (bounded) for every sender's flag in this rank's window and
//                  derives recv_count, origin_base, out_base, msg_start, counts, offsets (segment
//                  starts), expert_base, expert_load, the number of rounds (every rank computes the
//                  same one from every sender's largest count) and the host record's summary (M, the
//                  first bad sender, the rounds; host-sync calls only). Each step is spread over the
//                  block (a lane per peer, a warp per sender or expert, warp scans). With host waits
//                  (SyncMode) it runs twice: publish only, the host waits, then wait only.
// expand_kernel    grid 2 * num_sms, block kThreads. Work item: a RowSlice of one received message of
//                  round p.round, (sender, slot) order. Reads this rank's window and workspace;
//                  writes recv_x, recv_scales, recv_weights, recv_src, m_indices, ws.recv_rows and
//                  ws.recv_w (the combine's route table: the ring is reused by later rounds), then
//                  (round 0) the padding rows' metadata (and data with zero_padding). Does nothing
//                  after a timeout or a rejection.
// round_kernel     one block of 32 threads, host-sync calls with more than one round only: every rank
//                  signals (epoch << 20 | step) into every peer's round flag and waits (bounded, a
//                  lane per peer) for all: between expand(r - 1) and send(r) (the ring is free) and
//                  between send(r) and expand(r) (the ring is full). Host waits: publish only, then
//                  wait only.
// Peer data (counts, per-expert counts, positions, expert ids, source tokens) is checked where it is
// first read (exchange, expand): a bad value is dropped and recorded as a peer fault naming the sender,
// so no row index a peer wrote can address outside the outputs.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/limits.hpp"
#include "core/numerics.hpp"
#include "kernels/common/primitives.cuh"
#include "kernels/common/routes.cuh"
#include "kernels/intranode/params.cuh"

namespace elasticep::kernels {

constexpr int kStatusBlocks = 16;  // plan blocks that look for the first invalid route
constexpr int kExchangeThreads = 512;

// The plan's work split, a function of the call's token count (the launcher and the kernel agree):
// with few routes (decode: T * K <= kPlanStagedRoutes) each block first copies the whole top-k
// table into shared memory (a few loads per thread, all in flight at once), then one warp makes each
// ordered scan from there (kWarps scans per block: E + R scans in a few blocks instead of E + R
// blocks of mostly idle threads, and no global load latency per step); with more, a whole block
// makes each scan (block_scan) from global memory. Status blocks: one warp per token, at most
// kStatusBlocks of them.
constexpr int kPlanStagedRoutes = 4096;

struct PlanGrid {
    bool warp_scan;
    int scan_blocks, status_blocks;
    __host__ __device__ int blocks() const { return scan_blocks + status_blocks; }
};

__host__ __device__ inline PlanGrid plan_grid(const Shape& sh, int tokens) {
    PlanGrid g{};
    const int scans = sh.num_experts + sh.num_ranks;
    g.warp_scan = int64_t{tokens} * sh.num_topk <= kPlanStagedRoutes;
    g.scan_blocks = g.warp_scan ? (scans + kWarps - 1) / kWarps : scans;
    const int status = (tokens + kWarps - 1) / kWarps;
    g.status_blocks = status < 1 ? 1 : status > kStatusBlocks ? kStatusBlocks : status;
    return g;
}

// The call's top-k table in shared memory, cleaned to ids in [0, E) or -1 (the same hits as the raw
// ids): a few loads per thread, all in flight at once. The whole block calls (barrier after).
template <bool kIdx64, class Team>
__device__ __forceinline__ void stage_routes(const DispatchParams<Team>& p, int32_t* routes) {
    const Shape& sh = p.shape;
    const int n = p.num_tokens * sh.num_topk;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int64_t v = topk_at<kIdx64>(p, i / sh.num_topk, i % sh.num_topk);
        routes[i] = v >= 0 && v < sh.num_experts ? static_cast<int32_t>(v) : -1;
    }
    __syncthreads();
}

// One warp's ordered scan over the staged table: scan `target` < E is expert e = target, else
// destination rank d = target - E. store(t, k, pos) gets the position of every token t that hits
// it (at its smallest hitting k) among the earlier ones; returns the number of hits (every lane).
template <class Store>
__device__ __forceinline__ int warp_scan_routes(const int32_t* routes, const Shape& sh, int t_count, int target,
                                                Store&& store) {
    const int lane = lane_id();
    const bool by_expert = target < sh.num_experts;
    const int e = target, d = target - sh.num_experts;
    int running = 0;
    for (int base = 0; base < t_count; base += kWarpSize) {
        const int t = base + lane;
        int hit_k = -1;
        if (t < t_count)
            for (int k = sh.num_topk - 1; k >= 0; --k) {
                const int32_t v = routes[t * sh.num_topk + k];
                if (by_expert ? v == e : v >= 0 && v / sh.num_local_experts == d) hit_k = k;
            }
        const unsigned hits = __ballot_sync(kFullMask, hit_k >= 0);
        if (hit_k >= 0) store(t, hit_k, running + __popc(hits & lanes_below(lane)));
        running += __popc(hits);
    }
    return running;
}

template <class Team, bool kIdx64>
__global__ void __launch_bounds__(kThreads) plan_kernel(DispatchParams<Team> p) {
    wait_for_previous_grid();
    allow_next_grid();  // waits on no peer; the send kernel may be scheduled
    const Shape& sh = p.shape;
    const int b = blockIdx.x;
    const int t_count = p.num_tokens;
    const PlanGrid grid = plan_grid(sh, t_count);
    const int lane = lane_id();
    // scan `target` (< E: expert e = target; else destination rank d = target - E): the position of
    // every token that hits it among the earlier ones, in token order, and the number of hits
    auto hit_of = [&](int t, bool by_expert, int e, int d) {
        int hit_k = -1;  // the smallest k of the token that hits (a valid route: a repeat has a smaller twin)
#pragma unroll 4
        for (int k = sh.num_topk - 1; k >= 0; --k) {  // no early exit: the loads overlap
            const int64_t v = topk_at<kIdx64>(p, t, k);
            const bool hit = by_expert ? v == e : (v >= 0 && v < sh.num_experts && v / sh.num_local_experts == d);
            if (hit) hit_k = k;
        }
        return hit_k;
    };
    auto store = [&](bool by_expert, int t, int hit_k, int pos) {
        if (by_expert)
            p.ws.pos_in_expert[t * sh.num_topk + hit_k] = pos;
        else
            p.ws.slot_of[t * sh.num_topk + hit_k] = pos;
    };
    auto store_count = [&](bool by_expert, int e, int d, int count) {
        if (by_expert)
            p.ws.expert_count[e] = count;
        else
            p.ws.dest_count[d] = count;
    };
    if (b < grid.scan_blocks) {
        if (grid.warp_scan) {
            __shared__ int32_t routes[kPlanStagedRoutes];
            stage_routes<kIdx64>(p, routes);
            const int target = b * kWarps + warp_id();  // one warp per scan: no block barrier below
            if (target >= sh.num_experts + sh.num_ranks) return;
            const bool by_expert = target < sh.num_experts;
            const int count = warp_scan_routes(routes, sh, t_count, target,
                                               [&](int t, int k, int pos) { store(by_expert, t, k, pos); });
            if (lane == 0) store_count(by_expert, target, target - sh.num_experts, count);
            return;
        }
        const bool by_expert = b < sh.num_experts;
        const int e = b, d = b - sh.num_experts;
        int running = 0;
        for (int base = 0; base < t_count; base += kThreads) {
            const int t = base + threadIdx.x;
            const int hit_k = t < t_count ? hit_of(t, by_expert, e, d) : -1;
            const int pos = block_scan(hit_k >= 0, running);
            if (hit_k >= 0) store(by_expert, t, hit_k, pos);
        }
        if (threadIdx.x == 0) store_count(by_expert, e, d, running);
        return;
    }
    // status blocks
    if (b == grid.scan_blocks && threadIdx.x == 0) copy_sticky_word(p);
    scan_route_status<kIdx64>(p, (b - grid.scan_blocks) * kWarps + warp_id(), grid.status_blocks * kWarps);
}

template <class Team, SendPayload kPayload, bool kIdx64>
__global__ void __launch_bounds__(kThreads, 2) send_kernel(DispatchParams<Team> p) {
    wait_for_previous_grid();
    allow_next_grid();  // waits on no peer; the one-block exchange may be scheduled
    constexpr bool kFP8 = payload_is_fp8(kPayload);
    constexpr bool kFused = payload_quantizes(kPayload);  // bf16 in, fp8 + scales out
    constexpr bool kF32Scales = payload_f32_scales(kPayload);
    constexpr int kScaleGroup = payload_scale_group(kPayload);
    static_assert(kScaleGroup % 16 == 0 && kScaleGroup / 16 <= kWarpSize,
                  "a scale group is whole lanes of 16 channels");
    static_assert(Team::kLoadStore, "the send kernel stores into its peers' windows");
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    // host-sync call rejected (this call's invalid route, or a sticky fault): nothing is sent; the
    // exchange derives the same decision from the same words
    __shared__ bool reject;
    // per warp: the token's destinations in first-k order (at most K): their message and route-position
    // row in the destination's window, and the destination rank
    __shared__ uint8_t* dst_msg[kWarps][kMaxTopk];
    __shared__ int32_t* dst_route_pos[kWarps][kMaxTopk];
    __shared__ int32_t dst_rank[kWarps][kMaxTopk];
    if (threadIdx.x == 0)
        reject = p.round == 0 && p.host_sync &&
                 (*p.ws.first_bad_route != detail::kNoRouteKey || p.ws.state->sticky_seen != 0);
    __syncthreads();
    if (reject) return;
    const int lane = lane_id(), warp = warp_id();
    const int warps_total = gridDim.x * kWarps;
    const MessageLayout& m = sh.msg;
    const int rank = p.team.rank();
    const int ring = region.ring;
    uint8_t** msgs = dst_msg[warp];
    int32_t** route_pos_rows = dst_route_pos[warp];
    int32_t* dests = dst_rank[warp];
    // work items: RowSlice over this rank's tokens
    const int chunks = kFP8 ? sh.hidden / 16 : sh.hidden / 8;  // 16-byte chunks moved as is
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
        if (active && first && p.round == 0) p.ws.clean_idx[t * sh.num_topk + lane] = clean;
        // the token's distinct destinations in first-k order: lane k leads destination d when no lower
        // lane routes to d (the plan kernel stored the token's slot at d under that same k); only the
        // destinations whose message belongs to this round
        const bool leads_any = leads_group(dest);
        const int32_t j = leads_any ? p.ws.slot_of[t * sh.num_topk + lane] : 0;
        const bool leads = leads_any && j / ring == p.round;
        const unsigned leaders = __ballot_sync(kFullMask, leads);
        if (leaders == 0) continue;
        const int num_dst = __popc(leaders);
        if (leads) {  // (the previous token's lists were read before the loop's closing __syncwarp)
            const int i = __popc(leaders & lanes_below(lane));
            const int64_t slot = region.ring_slot(rank, j);
            uint8_t* window = p.team.window(dest);
            msgs[i] = window + region.message(slot);
            route_pos_rows[i] = RegionLayout::at<int32_t>(window, region.route_pos_row(slot));
            dests[i] = dest;
        }
        __syncwarp();
        const float w = (active && p.topk_weights) ? p.topk_weights[t * p.topk_weights_row_stride + lane] : 0.0f;
        const int pos = clean >= 0 ? p.ws.pos_in_expert[t * sh.num_topk + lane] : -1;
        // metadata (the first slice)
        if (first) {
            for (int i = 0; i < num_dst; ++i) {
                uint8_t* msg = msgs[i];
                if (active) {
                    reinterpret_cast<int32_t*>(msg + m.idx_offset)[lane] = clean;
                    reinterpret_cast<float*>(msg + m.weight_offset)[lane] = w;
                    route_pos_rows[i][lane] = dest == dests[i] ? pos : -1;
                }
                if (lane == 0) *reinterpret_cast<int32_t*>(msg + m.src_offset) = t;
            }
        }
        // payload
        if constexpr (!kFused) {
            // moved as is: 4 loads in flight per lane before their stores
            const int64_t row_off = t * p.x_row_stride * (kFP8 ? 1 : 2);
            for (int c0 = it0 * 128 + lane; c0 < min(chunks, it1 * 128); c0 += 128) {
                uint4 v[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int c = c0 + 32 * u;
                    v[u] = c < chunks ? load16(p.x, row_off + c * 16, p.x_aligned) : make_uint4(0, 0, 0, 0);
                }
                for (int i = 0; i < num_dst; ++i)
#pragma unroll
                    for (int u = 0; u < 4; ++u)
                        if (c0 + 32 * u < chunks) reinterpret_cast<uint4*>(msgs[i])[c0 + 32 * u] = v[u];
            }
            if (kPayload == SendPayload::kFP8Copy && first)
                for (int c = lane; c < p.scale_columns; c += 32) {
                    const uint32_t word = p.x_scales[t * p.x_scales_row_stride + c];
                    for (int i = 0; i < num_dst; ++i) reinterpret_cast<uint32_t*>(msgs[i] + m.payload_bytes)[c] = word;
                }
        } else {
            // fused quantization: lane owns 16 channels (one 16-byte fp8 store per destination); a
            // group is G/16 consecutive lanes; the next step's 32 bytes are loaded ahead
            constexpr int kLanesPerGroup = kScaleGroup / 16;
            const int num_groups = sh.hidden / kScaleGroup;
            if (!kF32Scales && first && lane < p.scale_columns * 4 - num_groups)
                for (int i = 0; i < num_dst; ++i) (msgs[i] + m.payload_bytes)[num_groups + lane] = 0;
            const int64_t row_off = t * p.x_row_stride * 2;
            const int begin = it0 * 512, end = min(sh.hidden, it1 * 512);
            uint4 next0 = make_uint4(0, 0, 0, 0), next1 = next0;
            if (begin + lane * 16 < end) {
                next0 = load16(p.x, row_off + (begin + lane * 16) * 2, p.x_aligned);
                next1 = load16(p.x, row_off + (begin + lane * 16) * 2 + 16, p.x_aligned);
            }
            for (int base = begin; base < end; base += 512) {
                const int ch = base + lane * 16;
                const bool ok = ch < sh.hidden;
                const uint4 raw0 = next0, raw1 = next1;
                if (ch + 512 < end) {  // prefetch
                    next0 = load16(p.x, row_off + (ch + 512) * 2, p.x_aligned);
                    next1 = load16(p.x, row_off + (ch + 512) * 2 + 16, p.x_aligned);
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
    // one system-scope fence per block, after the block's writes (cumulative through the barrier);
    // the exchange's signals then publish them
    __syncthreads();
    if (threadIdx.x == 0) Team::fence();
}

template <class Team, bool kIdx64>
__global__ void __launch_bounds__(kExchangeThreads) exchange_kernel(DispatchParams<Team> p) {
    wait_for_previous_grid();
    static_assert(kMaxLocalExperts <= 1024, "segment sizes are scanned in one block's shared memory");
    static_assert(kExchangeThreads % kWarpSize == 0 && kExchangeThreads >= kWarpSize, "whole warps");
    static_assert(Team::kLoadStore, "the exchange writes the counts into its peers' windows");
    // Every step is spread over the block (a thread per peer, a warp per sender or expert, warp-0
    // scans in shared memory): the kernel sits on the critical path of every call, and one thread
    // walking R or E_local entries of global memory pays one load latency per entry.
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    const Team& team = p.team;
    const int rank = team.rank();
    const int lane = lane_id(), warp = warp_id();
    constexpr int kExchangeWarps = kExchangeThreads / kWarpSize;
    const uint64_t epoch = *p.ws.epoch + 1;
    const int parity = static_cast<int>(epoch & 1);
    uint8_t* mine = team.self();
    __shared__ int32_t scan[kMaxRanks + 1];  // per-rank values, then their exclusive prefix sums
    if (p.sync_mode != kWaitOnly) {
        __shared__ int32_t max_out;
        if (threadIdx.x == 0) *p.ws.route_status = resolve_route_status<kIdx64>(p);
        for (int d = threadIdx.x; d < sh.num_ranks; d += blockDim.x) scan[d] = p.ws.dest_count[d];
        // this rank's compact combine slots: its messages to holder d start at out_base[d]
        block_exclusive_scan(scan, sh.num_ranks, &max_out);
        const RouteStatus st = *p.ws.route_status;
        const bool reject = st.any();
        for (int d = threadIdx.x; d < sh.num_ranks; d += blockDim.x) {
            p.ws.out_base[d] = scan[d];
            DispatchFlag* f = RegionLayout::at<DispatchFlag>(team.window(d), region.dispatch_flag(rank, parity));
            f->count = reject ? 0 : p.ws.dest_count[d];
            f->status = st;
            f->out_base = scan[d];
            f->max_count = reject ? 0 : max_out;
        }
        for (int i = threadIdx.x; i < sh.num_ranks * sh.num_local_experts; i += blockDim.x) {
            const int d = i / sh.num_local_experts, l = i % sh.num_local_experts;
            RegionLayout::at<int32_t>(team.window(d), region.expert_counts_row(rank, parity))[l] =
                reject ? 0 : p.ws.expert_count[d * sh.num_local_experts + l];
        }
        // one system fence for the block (cumulative: after a barrier with the writers), then every
        // thread signals its share of the receivers; each signal releases the block's writes above
        __syncthreads();
        if (threadIdx.x == 0) team.fence();
        __syncthreads();
        for (int d = threadIdx.x; d < sh.num_ranks; d += blockDim.x)
            team.signal(d, region.dispatch_flag(rank, parity), epoch);
        if (p.sync_mode == kPublishOnly) return;  // the host waits, then launches the kWaitOnly half
    }
    // with kWaitOnly the host has already seen every flag: this returns at once
    const bool ok = block_wait_all(
                        team, [&](int s) { return region.dispatch_flag(s, parity); }, epoch,
                        Deadline::from_now(p.timeout_ns), kPhaseDispatch, p.record) == WaitStatus::kOk;
    if (threadIdx.x == 0) {
        *p.ws.epoch = epoch;
        p.ws.state->timed_out = ok ? 0 : 1;
    }
    if (!ok) return;
    auto flag_of = [&](int s) { return RegionLayout::at<DispatchFlag>(mine, region.dispatch_flag(s, parity)); };
    auto expert_counts_of = [&](int s) { return RegionLayout::at<int32_t>(mine, region.expert_counts_row(s, parity)); };
    // Received messages per sender (a warp each, its lanes over the per-expert counts), checked on
    // receipt: a count outside [0, C], a per-expert count outside [0, count], per-expert counts
    // summing above count * min(K, E_local) (a token carries at most that many routes to one rank),
    // or a combine-slot range beyond the sender's C * min(K, R) slots drop the sender (-1 here) and
    // record a peer fault. Peer data is read through L2 (__ldcg) after the acquire above.
    __shared__ int32_t recv_count[kMaxRanks];
    __shared__ unsigned long long most_in;  // the largest count any sender sends to any rank: the rounds
    __shared__ int first_bad_sender;
    if (threadIdx.x == 0) {
        most_in = 0;
        first_bad_sender = sh.num_ranks;
    }
    __syncthreads();
    const int64_t routes_per_token = sh.num_topk < sh.num_local_experts ? sh.num_topk : sh.num_local_experts;
    const int64_t slot_rows = sh.combine_rows();
    for (int s = warp; s < sh.num_ranks; s += kExchangeWarps) {
        const DispatchFlag* f = flag_of(s);
        const int64_t count = __ldcg(&f->count);
        const int32_t kind = __ldcg(&f->status.kind);
        const bool count_ok = count >= 0 && count <= sh.capacity;
        const int32_t* counts_row = expert_counts_of(s);
        int64_t sum = 0, bad_count = 0;
        int bad_l = kMaxLocalExperts;  // this lane's first per-expert count outside [0, count]
#pragma unroll 4
        for (int l = lane; l < sh.num_local_experts; l += kWarpSize) {
            const int64_t c = __ldcg(counts_row + l);
            sum += c;
            const bool ok_c = c >= 0 && c <= count;
            if (!ok_c && bad_l == kMaxLocalExperts) {
                bad_l = l;
                bad_count = c;
            }
        }
#pragma unroll
        for (int o = kWarpSize / 2; o > 0; o >>= 1) {
            sum += __shfl_xor_sync(kFullMask, sum, o);
            bad_l = min(bad_l, __shfl_xor_sync(kFullMask, bad_l, o));
        }
        const bool each_ok = bad_l == kMaxLocalExperts;
        // the first bad per-expert count, from the lane that holds it (l % 32 == that lane)
        bad_count = __shfl_sync(kFullMask, bad_count, bad_l % kWarpSize);
        if (lane != 0) continue;
        const int64_t base = __ldcg(&f->out_base);
        const int64_t most = __ldcg(&f->max_count);
        const bool sum_ok = sum <= count * routes_per_token;
        const bool slots_ok = base >= 0 && base <= slot_rows && count <= slot_rows - base;
        if (!count_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerCount, s, kPhaseDispatch, count, sh.capacity);
        else if (!each_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerExpertCount, s, kPhaseDispatch, bad_count, count);
        else if (!sum_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerExpertCount, s, kPhaseDispatch, sum,
                              count * routes_per_token);
        else if (!slots_ok)
            record_peer_fault(p.ws, p.record, detail::kPeerSlot, s, kPhaseDispatch, base + count, slot_rows);
        const bool keep = count_ok && each_ok && sum_ok && slots_ok;
        recv_count[s] = keep ? static_cast<int32_t>(count) : -1;
        p.ws.recv_count[s] = recv_count[s];
        p.ws.origin_base[s] = keep ? static_cast<int32_t>(base) : 0;
        if (kind != detail::kRouteOk) atomicMin(&first_bad_sender, s);
        // the rounds need every sender's largest count, to any rank (clamped: C bounds every count)
        atomicMax(&most_in, static_cast<unsigned long long>(most < 0 ? 0 : most > sh.capacity ? sh.capacity : most));
    }
    __syncthreads();
    // per local expert: where each sender's share of the expert starts (a prefix over the senders),
    // the expert's total, its segment. Up to kThreadPerExpertRanks senders a thread takes an expert
    // and loads its R counts kLoadsInFlight at a time; with more senders a warp takes an expert, its
    // lanes over the senders (a warp scan, 32 senders at a time).
    __shared__ int32_t seg[kMaxLocalExperts + 1];  // rounded segment sizes, then the segment starts
    auto finish_expert = [&](int l, int32_t total) {
        p.ws.counts[l] = total;
        p.ws.expert_load[l] += total;
        seg[l] = p.expert_alignment > 0 ? static_cast<int32_t>(round_up(total, p.expert_alignment)) : 0;
    };
    constexpr int kThreadPerExpertRanks = 64, kLoadsInFlight = 8;
    if (sh.num_ranks <= kThreadPerExpertRanks) {
        for (int l = threadIdx.x; l < sh.num_local_experts; l += blockDim.x) {
            int32_t total = 0;
            for (int s0 = 0; s0 < sh.num_ranks; s0 += kLoadsInFlight) {
                int32_t c[kLoadsInFlight];
#pragma unroll
                for (int u = 0; u < kLoadsInFlight; ++u) {
                    const int s = s0 + u;
                    c[u] = s < sh.num_ranks && recv_count[s] >= 0 ? __ldcg(expert_counts_of(s) + l) : 0;
                }
#pragma unroll
                for (int u = 0; u < kLoadsInFlight; ++u)
                    if (s0 + u < sh.num_ranks) {
                        p.ws.expert_base[(s0 + u) * sh.num_local_experts + l] = total;
                        total += c[u];
                    }
            }
            finish_expert(l, total);
        }
    } else {
        for (int l = warp; l < sh.num_local_experts; l += kExchangeWarps) {
            int32_t carry = 0;
            for (int s0 = 0; s0 < sh.num_ranks; s0 += kWarpSize) {
                const int s = s0 + lane;
                const int32_t c = s < sh.num_ranks && recv_count[s] >= 0 ? __ldcg(expert_counts_of(s) + l) : 0;
                int32_t x = c;
#pragma unroll
                for (int o = 1; o < kWarpSize; o <<= 1) {
                    const int32_t y = __shfl_up_sync(kFullMask, x, o);
                    if (lane >= o) x += y;
                }
                if (s < sh.num_ranks) p.ws.expert_base[s * sh.num_local_experts + l] = carry + x - c;
                carry += __shfl_sync(kFullMask, x, kWarpSize - 1);
            }
            if (lane == 0) finish_expert(l, carry);
        }
    }
    // message starts per sender and segment starts per expert
    for (int s = threadIdx.x; s < sh.num_ranks; s += blockDim.x) scan[s] = recv_count[s] > 0 ? recv_count[s] : 0;
    block_exclusive_scan(scan, sh.num_ranks);
    block_exclusive_scan(seg, sh.num_local_experts);
    for (int s = threadIdx.x; s <= sh.num_ranks; s += blockDim.x) p.ws.msg_start[s] = scan[s];
    for (int l = threadIdx.x; l <= sh.num_local_experts; l += blockDim.x) p.ws.offsets[l] = seg[l];
    if (threadIdx.x == 0) {
        const int32_t at = seg[sh.num_local_experts];
        const int bad_sender = first_bad_sender < sh.num_ranks ? first_bad_sender : -1;
        const int32_t rounds = most_in > static_cast<unsigned long long>(region.ring)
                                   ? static_cast<int32_t>(ceil_div(static_cast<int64_t>(most_in), region.ring))
                                   : 1;
        p.ws.state->rejected = bad_sender >= 0 ? 1 : 0;
        p.ws.state->num_rows = at;
        p.ws.state->num_rounds = rounds;
        // the host reads the summary after a host-sync call only (graph mode publishes no route
        // status, so no sender is bad there): no mapped-memory writes and system fence otherwise
        if (!p.host_sync) return;
        write_host_summary(p.record, at, bad_sender, rounds,
                           bad_sender >= 0 ? flag_of(bad_sender)->status : RouteStatus{});
    }
}

// Between the rounds of a host-sync call whose busiest pair has more than S messages: every rank
// signals (epoch << 20 | step) into every peer's round flag, then waits (bounded) for every peer's.
// Step 2r - 1 (before send(r)): every rank expanded round r - 1, so the rings are free; step 2r
// (before expand(r)): every rank wrote round r. The block fence of the send kernel (or the expand
// kernel's completion) comes before the signal, which releases it.
constexpr int kRoundShift = 20;  // round flags hold (epoch << kRoundShift) | step

template <class Team>
__global__ void __launch_bounds__(kWarpSize) round_kernel(DispatchParams<Team> p) {
    wait_for_previous_grid();
    const Team& team = p.team;
    const RegionLayout& region = p.region;
    if (p.ws.state->timed_out != 0) return;
    const uint64_t value = (*p.ws.epoch << kRoundShift) | static_cast<uint64_t>(p.step);
    if (p.sync_mode != kWaitOnly) {
        team.fence();
        for (int q = threadIdx.x; q < team.size(); q += blockDim.x)
            team.signal(q, region.round_flag(team.rank()), value);
        if (p.sync_mode == kPublishOnly) return;
    }
    const WaitStatus st = block_wait_all(
        team, [&](int q) { return region.round_flag(q); }, value, Deadline::from_now(p.timeout_ns), kPhaseDispatch,
        p.record, kRoundShift);
    if (threadIdx.x == 0 && st != WaitStatus::kOk) p.ws.state->timed_out = 1;
}

// The received messages of this rank, in (sender, slot) order: message i is slot i - start[s] of
// sender s, where start[s] <= i < start[s + 1]. Each block copies the exchange's scan into shared
// memory (`start`, R + 1 entries) and returns the number of messages.
__device__ __forceinline__ int load_message_starts(int32_t* start, const Shape& sh, const int32_t* msg_start) {
    for (int s = threadIdx.x; s <= sh.num_ranks; s += blockDim.x) start[s] = msg_start[s];
    __syncthreads();
    return start[sh.num_ranks];
}

// The global slot (s * C + j) of message i and its sender s: the largest s with start[s] <= i
// (senders with no messages repeat their successor's start, so the largest one holds i).
__device__ __forceinline__ int64_t message_slot(const int32_t* start, const Shape& sh, int i, int& sender) {
    int lo = 0, hi = sh.num_ranks;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (start[mid] <= i)
            lo = mid;
        else
            hi = mid;
    }
    sender = lo;
    return int64_t{lo} * sh.capacity + (i - start[lo]);
}

// The received messages of round `round` (at most S per sender: the j-th message of sender s is in
// round j / S): each block computes the per-sender starts (`start`, R + 1 entries) from the
// exchange's recv_count and returns the number of messages of the round.
__device__ __forceinline__ int load_round_starts(int32_t* start, const Shape& sh, const int32_t* recv_count, int round,
                                                 int ring) {
    const int64_t skip = int64_t{round} * ring;
    for (int s = threadIdx.x; s < sh.num_ranks; s += blockDim.x) {  // the loads in parallel, then one scan
        const int64_t left = int64_t{recv_count[s]} - skip;
        start[s] = static_cast<int32_t>(left <= 0 ? 0 : left < ring ? left : ring);
    }
    block_exclusive_scan(start, sh.num_ranks);
    return start[sh.num_ranks];
}

template <class Team, bool kFP8, bool kContiguous>
__global__ void __launch_bounds__(kThreads, 2) expand_kernel(DispatchParams<Team> p) {
    wait_for_previous_grid();
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    __shared__ int64_t expand_rows[kWarps][kMaxTopk];
    __shared__ int32_t msg_start[kMaxRanks + 1];
    if (p.ws.state->timed_out != 0 || p.ws.state->rejected != 0) return;
    const int lane = lane_id();
    const int rank = p.team.rank();
    const int warps_total = gridDim.x * kWarps;
    const MessageLayout& m = sh.msg;
    const int64_t rc = sh.slots();
    const int row_bytes = sh.hidden * (kFP8 ? 1 : 2);
    const uint8_t* mine = p.team.self();
    const ScaleStrides& sst = p.recv_scale_strides;
    // work items: RowSlice over the received messages of this round
    const int ring = region.ring;
    const int num_msgs = load_round_starts(msg_start, sh, p.ws.recv_count, p.round, ring);
    const int row_chunks = row_bytes / 16;
    const int iters = (row_chunks + 127) / 128;
    const int slices = row_slices(num_msgs, iters, warps_total);
    const int64_t items = int64_t{num_msgs} * slices;
    for (int64_t item = blockIdx.x * kWarps + warp_id(); item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int it0 = slice.begin, it1 = slice.end;
        const bool first = slice.first;
        int s = 0;
        const int64_t in_ring = message_slot(msg_start, sh, slice.row, s) - int64_t{s} * sh.capacity;
        const int64_t g = int64_t{s} * sh.capacity + int64_t{p.round} * ring + in_ring;  // sender's slot s * C + j
        const int64_t slot = int64_t{s} * ring + in_ring;                                // its ring slot
        const uint8_t* msg = mine + region.message(slot);
        const bool active = lane < sh.num_topk;
        int32_t v = -1;
        float w = 0.0f;
        int32_t src_t = 0;
        if (active) {
            v = __ldcg(reinterpret_cast<const int32_t*>(msg + m.idx_offset) + lane);
            w = __ldcg(reinterpret_cast<const float*>(msg + m.weight_offset) + lane);
        }
        src_t = __ldcg(reinterpret_cast<const int32_t*>(msg + m.src_offset));
        // checked on receipt (protocol.hpp, "Peer data"): the source token, every expert id, and the
        // position of every local route inside the sender's share of its expert; a bad one is dropped
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
            const int32_t sent_pos = __ldcg(RegionLayout::at<int32_t>(mine, region.route_pos_row(slot)) + lane);
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
        if (active && first) {
            p.ws.recv_rows[g * sh.num_topk + lane] = static_cast<int32_t>(row);
            p.ws.recv_w[g * sh.num_topk + lane] = w;
        }
        const unsigned locals = __ballot_sync(kFullMask, local);
        const int num_local = __popc(locals);
        // rows of the local routes, k ascending, for the whole warp
        int64_t* rows = expand_rows[warp_id()];
        if (local) rows[__popc(locals & lanes_below(lane))] = row;
        __syncwarp();
        // 4 loads in flight per lane before their stores
        for (int c0 = it0 * 128 + lane; c0 < min(row_chunks, it1 * 128); c0 += 128) {
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
                        kContiguous ? r * sst.row + c * sst.column : ll * sst.expert + ps * sst.row + c * sst.column;
                    p.recv_scales[at] = word;
                }
            }
        }
        __syncwarp();
    }
    // padding rows (once: round 0)
    if (p.round != 0) return;
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
                int lo = 0, hi = sh.num_local_experts;  // largest l with offsets[l] <= r
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
                        kContiguous ? r * sst.row + c * sst.column : l * sst.expert + pos * sst.row + c * sst.column;
                    p.recv_scales[at] = 0;
                }
        }
    }
}

}  // namespace elasticep::kernels
