// Dispatch kernels of the direct topology. Push model: the sender writes each token once per
// destination rank into that receiver's slot region; the receiver expands it locally.
//   plan_kernel     sender: per global expert / per destination ordered scans over tokens
//                   (route positions, slot indices, counts) and the call's route status.
//   send_kernel     sender: warp per token; FP8 quantization fused; 16-byte stores into peers.
//   exchange_kernel one block: publishes count/status/expert counts to every receiver (data
//                   before the release.sys epoch), waits (bounded) for every sender, derives
//                   counts, segment starts and per-sender bases.
//   expand_kernel   receiver: messages in (sender, slot) order into the chosen layout, padding
//                   rows' metadata (and data with zero_padding).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "core/limits.hpp"
#include "core/numerics.hpp"
#include "kernels/intranode/params.cuh"

namespace elasticep::kernels {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ int64_t load_idx(const void* p, bool idx64, int64_t stride, int t, int k) {
    return idx64 ? static_cast<const int64_t*>(p)[t * stride + k] : static_cast<const int32_t*>(p)[t * stride + k];
}

// Lane k < K holds raw id v of token t. Returns the cleaned id (-1 for no route or invalid) and
// sets `bad_kind` (1 out of range, 2 repeat) and `dup_of`. Whole warp must call.
__device__ __forceinline__ int32_t clean_route(int64_t v, bool active, int num_experts, int& bad_kind, int& dup_of) {
    const int lane = threadIdx.x & 31;
    const bool in_range = active && v >= 0 && v < num_experts;
    // inactive / no-route lanes get unique keys so they never match
    const unsigned long long key =
        in_range ? static_cast<unsigned long long>(v) : (0xffffffff00000000ull | static_cast<unsigned>(lane));
    const unsigned same = __match_any_sync(0xffffffffu, key);
    const int first = __ffs(same) - 1;
    bad_kind = 0;
    dup_of = -1;
    if (active && (v < -1 || v >= num_experts)) bad_kind = 1;
    else if (in_range && first != lane) {
        bad_kind = 2;
        dup_of = first;
    }
    return (in_range && first == lane) ? static_cast<int32_t>(v) : -1;
}

// Exclusive ordered scan of one flag per thread across the block; returns the thread's prefix
// and adds the block total to `running` (same value in every thread).
__device__ __forceinline__ int block_scan(bool flag, int& running) {
    __shared__ int warp_sums[kWarps];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) {
        const int s = warp_sums[w];
        if (w < warp) before += s;
        total += s;
    }
    __syncthreads();
    const int prefix = running + before + __popc(ballot & ((1u << lane) - 1u));
    running += total;
    return prefix;
}

constexpr int kStatusBlocks = 16;

__global__ void __launch_bounds__(kThreads) plan_kernel(DispatchParams p) {
    const Shape& sh = p.sh;
    const int b = blockIdx.x;
    const int t_count = p.num_tokens;
    if (b < sh.num_experts + sh.num_ranks) {
        const bool by_expert = b < sh.num_experts;
        const int e = b;
        const int d = b - sh.num_experts;
        int running = 0;
        for (int base = 0; base < t_count; base += kThreads) {
            const int t = base + threadIdx.x;
            int hit_k = -1;
            if (t < t_count) {
#pragma unroll 4
                for (int k = sh.num_topk - 1; k >= 0; --k) {  // no early exit: the loads overlap
                    const int64_t v = load_idx(p.idx, p.idx64, p.idx_stride, t, k);
                    const bool hit = by_expert ? v == e
                                               : (v >= 0 && v < sh.num_experts && v / sh.e_local == d);
                    if (hit) hit_k = k;
                }
            }
            const int pos = block_scan(hit_k >= 0, running);
            if (hit_k >= 0) {
                if (by_expert) p.ws.pos_in_expert[t * sh.num_topk + hit_k] = pos;
                else p.ws.slot_of[t * sh.num_topk + hit_k] = pos;
            }
        }
        if (threadIdx.x == 0) {
            if (by_expert) p.ws.expert_count[e] = running;
            else p.ws.dest_count[d] = running;
        }
        return;
    }
    // status blocks: the first invalid route (t, k) in token-major order, as a global minimum.
    // One thread copies the sticky word from host-mapped memory for the send kernel: reads of
    // mapped memory cross PCIe one at a time, so no wide kernel may read it.
    if (b == sh.num_experts + sh.num_ranks && threadIdx.x == 0)
        p.ws.state[3] = reinterpret_cast<volatile int32_t*>(&p.rec->sticky.kind)[0];
    const int lane = threadIdx.x & 31;
    const int first_warp = (b - sh.num_experts - sh.num_ranks) * kWarps + (threadIdx.x >> 5);
    for (int t = first_warp; t < t_count; t += kStatusBlocks * kWarps) {
        const bool active = lane < sh.num_topk;
        const int64_t v = active ? load_idx(p.idx, p.idx64, p.idx_stride, t, lane) : -1;
        int kind, dup;
        clean_route(v, active, sh.num_experts, kind, dup);
        const unsigned bad = __ballot_sync(0xffffffffu, kind != 0);
        if (bad && lane == 0) atomicMin(p.ws.bad_key, static_cast<unsigned long long>(t) * 32ull + (__ffs(bad) - 1));
    }
}

// The call's route status, resolved once by the exchange (one thread): this call's first invalid
// route, or with host sync a sticky fault left by an earlier graph-mode call (reported, cleared).
// Graph mode publishes no rejection and records the first invalid route as sticky instead.
__device__ RouteStatus resolve_status(const DispatchParams& p) {
    const Shape& sh = p.sh;
    const unsigned long long key = *p.ws.bad_key;
    *p.ws.bad_key = ~0ull;
    RouteStatus bad{};
    if (key != ~0ull) {
        const int t = static_cast<int>(key / 32), k = static_cast<int>(key % 32);
        const int64_t v = load_idx(p.idx, p.idx64, p.idx_stride, t, k);
        bad.token = t;
        bad.k = k;
        bad.value = v;
        bad.dup_of = -1;
        if (v < -1 || v >= sh.num_experts) {
            bad.kind = 1;
        } else {
            bad.kind = 2;
            for (int j = 0; j < k; ++j)
                if (load_idx(p.idx, p.idx64, p.idx_stride, t, j) == v) {
                    bad.dup_of = j;
                    break;
                }
        }
    }
    volatile RouteStatus* sticky = &p.rec->sticky;
    RouteStatus now{};
    now.kind = sticky->kind;
    now.token = sticky->token;
    now.k = sticky->k;
    now.dup_of = sticky->dup_of;
    now.value = sticky->value;
    const detail::RouteDecision d = detail::decide_route_status(p.host_sync, now, bad);
    if (d.clear_sticky) sticky->kind = 0;
    if (d.record_sticky) {
        sticky->token = bad.token;
        sticky->k = bad.k;
        sticky->dup_of = bad.dup_of;
        sticky->value = bad.value;
        __threadfence_system();
        sticky->kind = bad.kind;
    }
    return d.publish;
}

// Two floats to E4M3 (RNE, satfinite, NaN -> 0x7f): the hardware conversion. Equal to
// num::float_to_e4m3 for every fp32 input (checked exhaustively by cuda_e4m3_mismatches, run by the
// gpu tests); the low byte holds `lo`.
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
    return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

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

__global__ void __launch_bounds__(kThreads, 2) send_kernel(DispatchParams p) {
    const Shape& sh = p.sh;
    // host-sync call rejected (this call's invalid route, or a sticky fault): nothing is sent; the
    // exchange derives the same decision from the same words
    __shared__ bool reject;
    // per warp: the token's destinations in first-k order (at most K): their message and route-position
    // row in the destination's window, and the destination rank
    __shared__ uint8_t* dst_msg[kWarps][kMaxTopk];
    __shared__ int32_t* dst_route_pos[kWarps][kMaxTopk];
    __shared__ int32_t dst_rank[kWarps][kMaxTopk];
    if (threadIdx.x == 0)
        reject = p.host_sync && (*p.ws.bad_key != ~0ull || p.ws.state[3] != 0);
    __syncthreads();
    if (reject) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps_total = gridDim.x * kWarps;
    const MessageLayout& m = sh.msg;
    const int64_t slot_base = int64_t{sh.rank} * sh.capacity;
    uint8_t** msgs = dst_msg[warp];
    int32_t** route_pos_rows = dst_route_pos[warp];
    int32_t* dests = dst_rank[warp];
    // work items: RowSlice over this rank's tokens
    const bool fused = p.fp8 && !p.prequantized;
    const int chunks = p.fp8 ? sh.hidden / 16 : sh.hidden / 8;  // 16-byte chunks moved as is
    const int iters = fused ? (sh.hidden + 511) / 512 : (chunks + 127) / 128;
    const int slices = row_slices(p.num_tokens, iters, warps_total);
    const int64_t items = int64_t{p.num_tokens} * slices;
    for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int t = slice.row, it0 = slice.begin, it1 = slice.end;
        const bool first = slice.first;
        const bool active = lane < sh.num_topk;
        const int64_t v = active ? load_idx(p.idx, p.idx64, p.idx_stride, t, lane) : -1;
        int kind, dup;
        const int32_t clean = clean_route(v, active, sh.num_experts, kind, dup);
        const int dest = clean >= 0 ? clean / sh.e_local : -1;
        if (active && first) p.ws.clean_idx[t * sh.num_topk + lane] = clean;
        // the token's distinct destinations in first-k order: lane k leads destination d when no lower
        // lane routes to d (the plan kernel stored the token's slot at d under that same k)
        const unsigned same_dest =
            __match_any_sync(0xffffffffu, dest >= 0 ? static_cast<unsigned>(dest) : 0x80000000u | static_cast<unsigned>(lane));
        const bool leads = dest >= 0 && (__ffs(same_dest) - 1) == lane;
        const unsigned leaders = __ballot_sync(0xffffffffu, leads);
        if (leaders == 0) continue;
        const int num_dst = __popc(leaders);
        if (leads) {  // (the previous token's lists were read before the loop's closing __syncwarp)
            const int i = __popc(leaders & ((1u << lane) - 1u));
            const int64_t slot = slot_base + p.ws.slot_of[t * sh.num_topk + lane];
            uint8_t* window = p.team.window(dest);
            msgs[i] = window + sh.region.disp_slots + slot * m.bytes;
            route_pos_rows[i] = reinterpret_cast<int32_t*>(window + sh.region.route_pos) + slot * sh.num_topk;
            dests[i] = dest;
        }
        __syncwarp();
        const float w = (active && p.weights) ? p.weights[t * p.w_stride + lane] : 0.0f;
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
        if (!p.fp8 || p.prequantized) {
            // moved as is: 4 loads in flight per lane before their stores
            const int64_t row_off = t * p.x_stride * (p.fp8 ? 1 : 2);
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
            if (p.prequantized && first)
                for (int c = lane; c < p.scale_cols; c += 32) {
                    const uint32_t word = p.x_scales[t * p.xs_stride + c];
                    for (int i = 0; i < num_dst; ++i) reinterpret_cast<uint32_t*>(msgs[i] + m.payload_bytes)[c] = word;
                }
        } else {
            // fused quantization: lane owns 16 channels (one 16-byte fp8 store per destination); a
            // group is G/16 consecutive lanes; the next step's 32 bytes are loaded ahead
            const int lanes_per_group = p.group / 16;
            if (first && !p.f32_scales && lane < p.scale_cols * 4 - p.num_groups)
                for (int i = 0; i < num_dst; ++i) (msgs[i] + m.payload_bytes)[p.num_groups + lane] = 0;
            const int64_t row_off = t * p.x_stride * 2;
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
                for (int o = lanes_per_group / 2; o > 0; o >>= 1)
                    amax = num::fmax_ignore_nan(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                amax = num::fmax_ignore_nan(amax, num::kAmaxFloor);
                float mul;
                uint32_t scale_bits;
                if (p.f32_scales) {
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
                const int gi = ch / p.group;
                const bool leader = ok && (lane % lanes_per_group) == 0;
                if (ok)
                    for (int i = 0; i < num_dst; ++i) {
                        uint8_t* msg = msgs[i];
                        *reinterpret_cast<uint4*>(msg + ch) = make_uint4(q[0], q[1], q[2], q[3]);
                        if (leader) {
                            if (p.f32_scales) reinterpret_cast<uint32_t*>(msg + m.payload_bytes)[gi] = scale_bits;
                            else (msg + m.payload_bytes)[gi] = static_cast<uint8_t>(scale_bits);
                        }
                    }
            }
        }
        __syncwarp();
    }
    // one system-scope fence per block, after the block's writes (cumulative through the barrier);
    // the exchange's release store then publishes them
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
}

__device__ __forceinline__ int64_t disp_flag_offset(const Shape& sh, int sender, int parity) {
    return sh.region.disp_flags + (int64_t{sender} * 2 + parity) * static_cast<int64_t>(sizeof(DispFlag));
}
// the epoch word of that flag (its first member)
__device__ __forceinline__ int64_t disp_epoch_offset(const Shape& sh, int sender, int parity) {
    static_assert(offsetof(DispFlag, epoch) == 0, "the epoch is the flag's first word");
    return disp_flag_offset(sh, sender, parity);
}
__device__ __forceinline__ DispFlag* disp_flag(uint8_t* region, const Shape& sh, int sender, int parity) {
    return reinterpret_cast<DispFlag*>(region + disp_flag_offset(sh, sender, parity));
}
__device__ __forceinline__ int32_t* disp_ecounts(uint8_t* region, const Shape& sh, int sender, int parity) {
    return reinterpret_cast<int32_t*>(region + sh.region.disp_ecounts) + (int64_t{sender} * 2 + parity) * sh.e_local;
}

__global__ void __launch_bounds__(256) exchange_kernel(DispatchParams p) {
    const Shape& sh = p.sh;
    static_assert(kMaxLocalExperts <= 1024, "segment sizes are scanned in one block's shared memory");
    __shared__ bool ok;
    const uint64_t epoch = *p.ws.epoch + 1;
    const int parity = static_cast<int>(epoch & 1);
    const transport::NvlinkTeam& team = p.team;
    uint8_t* my_region = team.self();
    if (p.sync_mode != kWaitOnly) {
        if (threadIdx.x == 0) *p.ws.status = resolve_status(p);
        __syncthreads();
        const RouteStatus st = *p.ws.status;
        const bool reject = st.kind != 0;
        for (int i = threadIdx.x; i < sh.num_ranks; i += blockDim.x) {
            DispFlag* f = disp_flag(team.window(i), sh, team.rank(), parity);
            f->count = reject ? 0 : p.ws.dest_count[i];
            f->status = st;
        }
        for (int i = threadIdx.x; i < sh.num_ranks * sh.e_local; i += blockDim.x) {
            const int d = i / sh.e_local, l = i % sh.e_local;
            disp_ecounts(team.window(d), sh, team.rank(), parity)[l] = reject ? 0 : p.ws.expert_count[d * sh.e_local + l];
        }
        team.fence();
        __syncthreads();
        // every thread signals its share of the receivers; each signal releases the block's writes
        // above (fenced, then observed through the barrier)
        for (int d = threadIdx.x; d < sh.num_ranks; d += blockDim.x)
            team.signal(d, disp_epoch_offset(sh, team.rank(), parity), epoch);
        if (p.sync_mode == kPublishOnly) return;  // the host waits, then launches the kWaitOnly half
    }
    if (threadIdx.x == 0) {
        // with kWaitOnly the host has already seen every flag: this returns at once
        ok = wait_all(team, [&](int s) { return disp_epoch_offset(sh, s, parity); }, epoch,
                      Deadline::from_now(p.timeout_ns), kPhaseDispatch, p.rec) == WaitStatus::kOk;
        *p.ws.epoch = epoch;
        p.ws.state[0] = ok ? 0 : 1;
    }
    __syncthreads();
    if (!ok) return;
    // received messages per sender, as an exclusive scan (the expand and partial kernels' work list)
    __shared__ int32_t recv_count[kMaxRanks];
    for (int s = threadIdx.x; s < sh.num_ranks; s += blockDim.x)
        recv_count[s] = static_cast<int32_t>(reinterpret_cast<volatile int64_t*>(&disp_flag(my_region, sh, s, parity)->count)[0]);
    __shared__ int32_t seg[kMaxLocalExperts];  // rounded segment sizes
    for (int l = threadIdx.x; l < sh.e_local; l += blockDim.x) {
        int32_t total = 0;
        for (int s = 0; s < sh.num_ranks; ++s) {
            p.ws.base[s * sh.e_local + l] = total;
            total += reinterpret_cast<volatile int32_t*>(disp_ecounts(my_region, sh, s, parity))[l];
        }
        p.ws.counts[l] = total;
        p.ws.load[l] += total;
        seg[l] = p.contiguous ? static_cast<int32_t>(round_up(total, p.alignment)) : 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t received = 0;
        for (int s = 0; s < sh.num_ranks; ++s) {
            p.ws.msg_start[s] = received;
            received += recv_count[s];
        }
        p.ws.msg_start[sh.num_ranks] = received;
        int32_t at = 0;
        p.ws.start[0] = 0;
        for (int l = 0; l < sh.e_local; ++l) {
            at += seg[l];
            p.ws.start[l + 1] = at;
        }
        int bad_sender = -1;
        for (int s = 0; s < sh.num_ranks && bad_sender < 0; ++s)
            if (reinterpret_cast<volatile int32_t*>(&disp_flag(my_region, sh, s, parity)->status.kind)[0] != 0)
                bad_sender = s;
        p.ws.state[1] = bad_sender >= 0 ? 1 : 0;
        p.ws.state[2] = at;
        volatile HostRecord* r = p.rec;
        r->num_rows = at;
        r->bad_sender = bad_sender;
        if (bad_sender >= 0) {
            const RouteStatus b = disp_flag(my_region, sh, bad_sender, parity)->status;
            r->bad.kind = b.kind;
            r->bad.token = b.token;
            r->bad.k = b.k;
            r->bad.dup_of = b.dup_of;
            r->bad.value = b.value;
            r->bad.sticky = b.sticky;
        }
        __threadfence_system();
    }
}

// The received messages of this rank, in (sender, slot) order: message i is slot i - start[s] of
// sender s, where start[s] <= i < start[s + 1]. Each block copies the exchange's scan into shared
// memory (`start`, R + 1 entries) and returns the number of messages.
__device__ __forceinline__ int load_message_starts(int32_t* start, const Shape& sh, const int32_t* msg_start) {
    for (int s = threadIdx.x; s <= sh.num_ranks; s += blockDim.x) start[s] = msg_start[s];
    __syncthreads();
    return start[sh.num_ranks];
}

// The sender of message i: the largest s with start[s] <= i (senders with no messages repeat their
// successor's start, so the largest such s is the one whose range holds i).
__device__ __forceinline__ int64_t message_slot(const int32_t* start, const Shape& sh, int i, int& sender) {
    int lo = 0, hi = sh.num_ranks;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (start[mid] <= i) lo = mid;
        else hi = mid;
    }
    sender = lo;
    return int64_t{lo} * sh.capacity + (i - start[lo]);
}

__global__ void __launch_bounds__(kThreads, 2) expand_kernel(DispatchParams p) {
    const Shape& sh = p.sh;
    __shared__ int64_t expand_rows[kWarps][kMaxTopk];
    __shared__ int32_t msg_start[kMaxRanks + 1];
    if (p.ws.state[0] != 0 || p.ws.state[1] != 0) return;
    const int lane = threadIdx.x & 31;
    const int warps_total = gridDim.x * kWarps;
    const MessageLayout& m = sh.msg;
    const int64_t rc = int64_t{sh.num_ranks} * sh.capacity;
    const int row_bytes = sh.hidden * (p.fp8 ? 1 : 2);
    const uint8_t* slots = p.team.self() + sh.region.disp_slots;
    const int32_t* route_pos = reinterpret_cast<const int32_t*>(p.team.self() + sh.region.route_pos);
    // work items: RowSlice over the received messages
    const int num_msgs = load_message_starts(msg_start, sh, p.ws.msg_start);
    const int row_chunks = row_bytes / 16;
    const int iters = (row_chunks + 127) / 128;
    const int slices = row_slices(num_msgs, iters, warps_total);
    const int64_t items = int64_t{num_msgs} * slices;
    for (int64_t item = blockIdx.x * kWarps + (threadIdx.x >> 5); item < items; item += warps_total) {
        const RowSlice slice = row_slice(item, slices, iters);
        const int it0 = slice.begin, it1 = slice.end;
        const bool first = slice.first;
        int s = 0;
        const int64_t g = message_slot(msg_start, sh, slice.row, s);
        const uint8_t* msg = slots + g * m.bytes;
        const bool active = lane < sh.num_topk;
        int32_t v = -1;
        float w = 0.0f;
        int32_t src_t = 0;
        if (active) {
            v = __ldcg(reinterpret_cast<const int32_t*>(msg + m.idx_offset) + lane);
            w = __ldcg(reinterpret_cast<const float*>(msg + m.weight_offset) + lane);
        }
        src_t = __ldcg(reinterpret_cast<const int32_t*>(msg + m.src_offset));
        const bool local = v >= 0 && v / sh.e_local == sh.rank;
        const int l = local ? v % sh.e_local : 0;
        int64_t pos = 0, row = -1;
        if (local) {
            pos = __ldcg(route_pos + g * sh.num_topk + lane) + p.ws.base[s * sh.e_local + l];
            row = p.contiguous ? p.ws.start[l] + pos : l * rc + pos;
            if (first) {
                p.rw[row] = w;
                p.rs[row] = static_cast<int32_t>(s * sh.capacity + src_t);
                if (p.mi) p.mi[row] = l;
            }
        }
        if (active && first) p.ws.recv_rows[g * sh.num_topk + lane] = static_cast<int32_t>(row);
        const unsigned locals = __ballot_sync(0xffffffffu, local);
        const int num_local = __popc(locals);
        // rows of the local routes, k ascending, for the whole warp
        int64_t* rows = expand_rows[threadIdx.x >> 5];
        if (local) rows[__popc(locals & ((1u << lane) - 1u))] = row;
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
                    if (c0 + 32 * u < row_chunks) reinterpret_cast<uint4*>(p.rx + rows[i] * row_bytes)[c0 + 32 * u] = val[u];
        }
        if (p.scale_cols > 0 && first) {
            for (unsigned lm = locals; lm; lm &= lm - 1) {
                const int k = __ffs(lm) - 1;
                const int64_t r = __shfl_sync(0xffffffffu, row, k);
                const int64_t ps = __shfl_sync(0xffffffffu, pos, k);
                const int ll = __shfl_sync(0xffffffffu, l, k);
                for (int c = lane; c < p.scale_cols; c += 32) {
                    const uint32_t word = __ldcg(reinterpret_cast<const uint32_t*>(msg + m.payload_bytes) + c);
                    const int64_t at = p.contiguous ? r * p.sst0 + c * p.sst1 : ll * p.sst0 + ps * p.sst1 + c * p.sst2;
                    p.rsc[at] = word;
                }
            }
        }
        __syncwarp();
    }
    // padding rows
    const int64_t total = p.contiguous ? p.rows_out : int64_t{sh.e_local} * rc;
    const int64_t m_rows = p.ws.state[2];
    for (int64_t r = blockIdx.x * int64_t{kThreads} + threadIdx.x; r < total; r += int64_t{gridDim.x} * kThreads) {
        int64_t l, pos;
        bool pad;
        if (p.contiguous) {
            if (r >= m_rows) {
                pad = true;
                l = 0;
                pos = 0;
            } else {
                int lo = 0, hi = sh.e_local;  // largest l with start[l] <= r
                while (hi - lo > 1) {
                    const int mid = (lo + hi) / 2;
                    if (p.ws.start[mid] <= r) lo = mid;
                    else hi = mid;
                }
                l = lo;
                pos = r - p.ws.start[l];
                pad = pos >= p.ws.counts[l];
            }
        } else {
            l = r / rc;
            pos = r % rc;
            pad = pos >= p.ws.counts[l];
        }
        if (!pad) continue;
        p.rw[r] = 0.0f;
        p.rs[r] = -1;
        if (p.mi) p.mi[r] = -1;
        if (p.zero_padding) {
            uint4* dst = reinterpret_cast<uint4*>(p.rx + r * row_bytes);
            for (int c = 0; c < row_bytes / 16; ++c) dst[c] = make_uint4(0, 0, 0, 0);
            for (int c = 0; c < p.scale_cols; ++c) {
                const int64_t at = p.contiguous ? r * p.sst0 + c * p.sst1 : l * p.sst0 + pos * p.sst1 + c * p.sst2;
                p.rsc[at] = 0;
            }
        }
    }
}

}  // namespace elasticep::kernels
