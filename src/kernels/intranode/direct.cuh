// Direct-path kernels of the direct topology: every rank is a thread of this process on this GPU, so
// every rank can address every other rank's ordinary device memory (outputs, expert outputs). Rows
// are written ONCE, by their sender, straight into their final place in the receiver's output; the
// origin reads its routes' expert outputs in place and reduces them itself. The protocol of
// src/core/protocol.hpp holds with "message" read as "row": what is published, when, and the route
// status are the same; the window holds only flags and what each rank publishes (RegionLayout).
//
// direct_dispatch_kernel  grid = SM share x occupancy, block kThreads, dynamic shared memory
//     direct_dispatch_smem_bytes. Device waits: two launches, kStepPublishMeet (plan and publish; the
//     block that publishes then waits for every plan flag and reads the tables) and kStepMoveFinish
//     (move; the last block to finish then waits for every sent flag). Only one block of a rank waits
//     for peers at a time, the rest of its grid planning or exited, as in the staged path's one-block
//     kernels: a grid whose blocks all waited for the peers' grids would need every rank's grid
//     resident at once, which other kernels on the GPU (a rank's GEMM, a graph replay) can prevent;
//     that deadlocked a test (docs/PERFORMANCE.md, "Two paths"). With host waits the host launches kStepPublish,
//     waits for the plan flags, kStepMove, waits for the sent flags, kStepFinish (one block).
//     kStepAll (one launch doing every step, every block waiting) is the measurement-only variant
//     ELASTICEP_DIRECT_ONE_KERNEL=1, which needs the GPU to itself.
//   plan      every block reads every token's top-k row once, chunk by chunk (one thread per token:
//             ids checked, repeats dropped), into a bitmap of the chunk's tokens per expert in shared
//             memory, so a route's position among the rank's routes to its expert (t ascending) is a
//             running count plus a popcount; each block writes the positions of its share of the
//             tokens (ws.pos_in_expert). No plan kernel. Block 0 alone reads the host-mapped sticky
//             word (a PCIe round trip), at its entry.
//   publish   block 0, once its own plan is done (every block's plan counted every token; the
//             positions are read only after the kernel boundary), or with kStepAll the last block to
//             finish its plan (ws.arrive), resolves the route status (decide_route_status) and writes,
//             in this rank's own window, its per-expert route counts and its DirectOutputs (output
//             pointers, scale strides, status); then signals every peer's plan flag (release, GPU
//             scope). With kStepAll, seeing its own flag tells every block of this rank that every
//             position is written.
//   tables    the publishing block (kStepPublishMeet; it leaves them in ws.direct_tables and
//             direct_desc for kStepMoveFinish's blocks), or every block of kStepAll and kStepMove,
//             waits (bounded) for every sender's plan flag and reads every rank's counts (the
//             publishing block reads each batch of senders as their flags arrive; kStageRows count
//             rows a round trip, staged in shared memory), checked on receipt (each in [0, C], per receiver at most C *
//             min(K, E_local); a sender that fails is dropped everywhere alike and recorded as a peer fault), as are
//             the statuses (any bad one rejects the call on every rank); from them come, for every receiver d and local
//             expert l, the segment start and this rank's first row there (SEMANTICS order: senders ascending).
//   move      warps take RowSlices of this rank's tokens: clean routes, quantize once (fp8 fused),
//             store the row into every route's receiver row, with its scales, weight, source and
//             m_indices; ws.route_row / route_w / clean_idx for the combine. Then the padding rows of
//             this rank's own outputs. The last block to finish (ws.arrive) signals every receiver's
//             sent flag, then writes this rank's counts, offsets, expert_load and host record (the
//             record's system fence in one block, after the signal).
//   finish    block 0 waits (bounded) for every sender's sent flag: this rank's outputs are complete.
//             It advances ws.epoch.
// direct_combine_kernel  grid and steps as above; device waits: kStepPublishMeet (one block publishes
//     and waits for every ready flag), kStepMoveFinish (the last block waits for every done flag).
//   publish   block 0 writes this call's y pointer into its own window and signals every peer's
//             ready flag.
//   move      every block waits for every holder's ready flag, then warps take RowSlices of this
//             rank's tokens: for each route (ws.route_row / route_w), the holder's y row, fmaf over k
//             ascending per destination, rounded to bf16 (the holder's partial of the staged path,
//             bit for bit), then the origin's order (SEMANTICS.md; node level when P < R), and out.
//             The last block signals every holder's done flag.
//   finish    block 0 waits for every origin's done flag: nobody reads this rank's y any more.
// Scope: every peer shares this GPU, so flags are released and acquired at GPU scope, and each block
// fences at GPU scope once, before its arrival.
// Programmatic launch (device waits): kStepMoveFinish is launched as a programmatic dependent of
// kStepPublishMeet (cuda::launch_direct_*; ELASTICEP_DIRECT_PDL=0: not) and waits for its completion
// before it reads anything (wait_for_previous_grid). The first launch's waiting block lets it be
// scheduled (allow_next_grid) only after it has seen every peer's flags, and the rest of that grid
// has exited by then: the second launch's blocks never hold SMs while a kernel of their rank waits on
// a peer (which, with ranks sharing a GPU, could keep a peer's first launch off the SMs).
// Points (ELASTICEP_STAGE_TIMES=1 only: ws.points set): thread 0 of the block that reaches each step
// stamps the device clock into ws.points (DevicePoint), which the stage timer reports per call.
#pragma once

#include "kernels/intranode/combine.cuh"

namespace elasticep::kernels {

// kStepPublishMeet: publish, then one block waits for the first flags (dispatch: plan; combine:
// ready); kStepMoveFinish: move, then the last block waits for the second (sent; done).
enum DirectStep : int32_t {
    kStepAll = 0,
    kStepPublish = 1,
    kStepMove = 2,
    kStepFinish = 3,
    kStepPublishMeet = 4,
    kStepMoveFinish = 5
};

constexpr int kDirectMaxRanks = 64;      // senders dropped as corrupt are one 64-bit mask
constexpr int kDirectMaxExperts = 2048;  // per-expert tables in shared memory
constexpr int kPlanWords = 8192;         // the plan's bitmap: E * chunk / 32 words (32 KB)
constexpr int kStageRows = 8;            // the tables: senders' count rows staged per round trip

// Tokens of one plan chunk: as many as the bitmap holds (at most 1024, a multiple of 32), fewer when
// the rank has fewer tokens.
__host__ __device__ constexpr int plan_chunk_tokens(int num_experts, int num_tokens) {
    int per = kPlanWords / (num_experts > 0 ? num_experts : 1);
    per = per < 1 ? 1 : per > 32 ? 32 : per;
    const int rounded = (num_tokens + 31) / 32;
    return 32 * (rounded < per ? (rounded > 0 ? rounded : 1) : per);
}
// dynamic shared memory of direct_dispatch_kernel: base, seg, total [E], m_of [R] (the tables, one
// run of words), then the plan's running [E], the chunk's kept-route masks [chunk] and its bitmap
// [E][chunk / 32], whose words the tables reuse once the plan is published, for kStageRows senders'
// count rows [kStageRows][E]
__host__ __device__ constexpr int direct_dispatch_smem_bytes(int num_experts, int num_ranks, int num_tokens) {
    const int chunk = plan_chunk_tokens(num_experts, num_tokens);
    const int plan = num_experts + chunk + num_experts * (chunk / 32), stage = kStageRows * num_experts;
    return (3 * num_experts + num_ranks + (plan > stage ? plan : stage)) * 4;
}

// Position of token t among the tokens whose bit is set in `row` (bits t ascending, 32 per word).
__device__ __forceinline__ int bitmap_rank(const uint32_t* row, int t) {
    int c = 0;
    for (int w = 0; w < t / 32; ++w) c += __popc(row[w]);
    return c + __popc(row[t / 32] & lanes_below(t % 32));
}

// One (sender, receiver) pair's counts, read 32 local experts at a time across a warp's lanes: their
// sum and the first count outside [0, C], as a serial scan over the experts finds it. Every lane
// calls (add with the same `in` pattern on each).
struct PairCheck {
    int64_t sum = 0;
    int32_t bad_c = 0;
    bool each_ok = true;
    __device__ __forceinline__ void add(int32_t v, bool in, int cap) {
        sum += v;
        const unsigned bad = __ballot_sync(kFullMask, in && !(v >= 0 && v <= cap));
        if (bad != 0 && each_ok) {
            bad_c = __shfl_sync(kFullMask, v, __ffs(bad) - 1);
            each_ok = false;
        }
    }
    __device__ __forceinline__ int64_t total() const {  // the sum over the warp
        int64_t t = sum;
#pragma unroll
        for (int o = kWarpSize / 2; o > 0; o >>= 1) t += __shfl_xor_sync(kFullMask, t, o);
        return t;
    }
};

// The last block of the grid to call this (after its writes) returns true, with every block's writes
// visible to it; the counter is reset for the next launch. Every thread must call.
__device__ __forceinline__ bool last_block_arrives(unsigned* counter) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
        if (last) {
            atomicExch(counter, 0u);
            __threadfence();
        }
    }
    __syncthreads();
    return last;
}

// The whole block waits (bounded) for every peer's flag at offset_of(q) to reach `epoch`, each thread
// one peer's word (block_wait_all: one peer's latency when all have arrived); on expiry the workspace
// is marked timed out. Every thread must call; returns true when every peer arrived.
template <class Team, class OffsetOf>
__device__ __forceinline__ bool block_meet(const Team& team, OffsetOf offset_of, uint64_t epoch, uint64_t timeout_ns,
                                           int32_t phase, HostRecord* rec, const Workspace& ws) {
    const bool met =
        block_wait_all<true>(team, offset_of, epoch, Deadline::from_now(timeout_ns), phase, rec) == WaitStatus::kOk;
    if (!met && threadIdx.x == 0) ws.state->timed_out = 1;
    return met;
}

// Thread 0 writes the device clock into point `i` of this call (DevicePoint), when the stage timer asked
// for points; i < 0: none.
__device__ __forceinline__ void stamp(const Workspace& ws, int i) {
    if (ws.points != nullptr && i >= 0 && threadIdx.x == 0) ws.points[i] = transport::global_timer_ns();
}

// The entry point of a direct launch of `step` (block 0 stamps it): the first launch's or the second's.
__device__ __forceinline__ int entry_point(int step, int first, int second) {
    return step == kStepFinish ? -1 : (step == kStepMove || step == kStepMoveFinish) ? second : first;
}

template <class Team, SendPayload kPayload, bool kIdx64>
__global__ void __launch_bounds__(kThreads, 2) direct_dispatch_kernel(DispatchParams<Team> p) {
    constexpr bool kFP8 = payload_is_fp8(kPayload);
    constexpr bool kFused = payload_quantizes(kPayload);
    constexpr bool kF32Scales = payload_f32_scales(kPayload);
    constexpr int kScaleGroup = payload_scale_group(kPayload);
    constexpr int kLanesPerGroup = kScaleGroup / 16;
    static_assert(kScaleGroup % 16 == 0 && kScaleGroup / 16 <= kWarpSize, "a scale group is whole lanes");
    static_assert(Team::kLoadStore, "the direct path loads and stores peers' memory");
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    const Team& team = p.team;
    const int rank = team.rank(), nr = sh.num_ranks, ne = sh.num_experts, el = sh.num_local_experts;
    const int kk = sh.num_topk, cap = sh.capacity;
    const int t_count = p.num_tokens;
    const int lane = lane_id(), warp = warp_id();
    const int step = p.step;
    const bool contiguous = p.expert_alignment > 0;  // 0: the masked layout
    if (step == kStepMoveFinish) {
        if (blockIdx.x == 0) stamp(p.ws, kPtMoveResident);
        wait_for_previous_grid();
    }
    if (p.ws.state->timed_out != 0) return;
    if (blockIdx.x == 0) stamp(p.ws, entry_point(step, kPtDispatchEntry, kPtMoveEntry));
    // the host-mapped sticky word (a PCIe round trip): loaded here by block 0's thread 0 alone, which
    // publishes (kStepPublish, kStepPublishMeet) or, with kStepAll, stores it in ws.state->sticky_seen
    // before its plan's arrival for the last block, which publishes (the arrival orders the two)
    const bool first_launch = step == kStepAll || step == kStepPublish || step == kStepPublishMeet;
    const int32_t sticky_kind = first_launch && blockIdx.x == 0 && threadIdx.x == 0
                                    ? reinterpret_cast<volatile int32_t*>(&p.record->sticky.kind)[0]
                                    : detail::kRouteOk;
    const uint64_t epoch = *p.ws.epoch + 1;
    const int parity = static_cast<int>(epoch & 1);
    const int64_t rc = sh.slots();

    extern __shared__ int32_t dyn[];
    int32_t* base = dyn;       // [E] this rank's first row at (d, l) (e = d * E_local + l)
    int32_t* seg = base + ne;  // [E] start of (d, l)'s rows at receiver d
    int32_t* total = seg + ne;
    int32_t* m_of = total + ne;    // [R] rows of receiver d's contiguous output
    int32_t* running = m_of + nr;  // [E] plan: this rank's routes per expert in the chunks so far
    const int chunk = plan_chunk_tokens(ne, t_count);
    const int words = chunk / 32;
    uint32_t* valid = reinterpret_cast<uint32_t*>(running + ne);  // [chunk] bit k: route k kept
    uint32_t* bitmap = valid + chunk;                             // [E][words] the chunk's tokens per expert

    __shared__ unsigned long long first_bad;
    __shared__ unsigned long long dropped;  // senders whose counts failed their check
    __shared__ int bad_sender;
    __shared__ DirectOutputs desc[kDirectMaxRanks];
    __shared__ uint8_t* win[kDirectMaxRanks];  // every rank's window (the team's device table, read once)
    __shared__ uint8_t* dst_x[kWarps][kMaxTopk];
    __shared__ uint32_t* dst_sc[kWarps][kMaxTopk];
    __shared__ int64_t dst_cs[kWarps][kMaxTopk];

    // ---- tables: every sender's counts and status, into shared memory (base, seg, total, m_of, desc,
    // dropped, bad_sender), read by the dispatch's waiting block when a second launch follows
    // (kStepPublishMeet, which leaves them in ws.direct_tables / direct_desc: store_tables,
    // load_tables), else by every block of the move once every flag is seen (kStepAll, kStepMove).
    // Block 0 records a peer fault. kStageRows senders' count rows per round trip, staged in shared
    // memory, checked and summed there (read_senders); the waiting block reads each batch of senders
    // as their flags arrive (gather_tables), so that after the last flag only the last senders are
    // left (a form that read every sender after the last flag, in two round trips over all of them,
    // was the default until run 46 measured this one: docs/PERFORMANCE.md, "Twelfth session").
    // (Latency: the block's threads share the loads, so each step costs one round trip, not one per
    // peer or per expert in series.)
    int32_t* const stage = running;  // [kStageRows][E] senders' count rows (the plan's words, once published)
    __shared__ int sender_list[kDirectMaxRanks];
    __shared__ int list_size;
    auto start_tables = [&] {
        if (threadIdx.x == 0) {
            dropped = 0;
            bad_sender = nr;
        }
        for (int q = threadIdx.x; q < nr; q += blockDim.x) win[q] = team.window(q);
        for (int e = threadIdx.x; e < ne; e += blockDim.x) {
            total[e] = 0;
            base[e] = 0;  // this rank's first row at e, from the senders below it (seg added at the end)
        }
        __syncthreads();
    };
    auto counts_of = [&](int q) { return RegionLayout::at<const int32_t>(win[q], region.published_count_row(parity)); };
    auto load_desc = [&](const int* list, int n) {  // senders list[0, n)'s DirectOutputs (list null: 0..n-1)
        for (int i = threadIdx.x; i < n * 16; i += blockDim.x) {
            const int q = list ? list[i / 16] : i / 16, w = i % 16;
            const uint64_t* src = RegionLayout::at<const uint64_t>(win[q], region.published_outputs(parity));
            reinterpret_cast<uint64_t*>(&desc[q])[w] = __ldcg(reinterpret_cast<const unsigned long long*>(src) + w);
        }
    };
    // the end of one (sender s, receiver) pair's check on the warp's PairCheck (lane 0 acts): a count
    // outside [0, C], or more than C * min(K, E_local) in all, drops s everywhere alike
    auto end_pair = [&](const PairCheck& c, int s) {
        const int64_t sum = c.total(), per_receiver = int64_t{cap} * (kk < el ? kk : el);
        if (lane == 0 && (!c.each_ok || sum > per_receiver)) {
            atomicOr(&dropped, 1ull << s);
            if (blockIdx.x == 0)
                record_peer_fault(p.ws, p.record, detail::kPeerExpertCount, s, kPhaseDispatch,
                                  c.each_ok ? sum : c.bad_c, c.each_ok ? per_receiver : cap);
        }
    };
    // senders list[0, n), n <= kStageRows: their DirectOutputs and count rows in one round
    // trip, each (sender, receiver) pair checked from shared memory, then the kept senders' counts
    // added to total and, for senders below this rank, to base. Every thread calls.
    auto read_senders = [&](const int* list, int n) {
        load_desc(list, n);
        const int words_n = n * ne;
        for (int i0 = threadIdx.x; i0 < words_n; i0 += 8 * blockDim.x) {  // 8 loads in flight
            int32_t v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int i = i0 + u * static_cast<int>(blockDim.x);
                v[u] = i < words_n ? __ldcg(counts_of(list[i / ne]) + i % ne) : 0;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int i = i0 + u * static_cast<int>(blockDim.x);
                if (i < words_n) stage[i] = v[u];
            }
        }
        __syncthreads();
        for (int pair = warp; pair < n * nr; pair += kWarps) {  // a warp per (sender, receiver) pair
            const int32_t* row = stage + (pair / nr) * ne + (pair % nr) * el;
            PairCheck c;
            for (int l0 = 0; l0 < el; l0 += kWarpSize) {
                const int l = l0 + lane;
                c.add(l < el ? row[l] : 0, l < el, cap);
            }
            end_pair(c, list[pair / nr]);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < ne; e += blockDim.x) {
            int32_t tot = 0, below = 0;
            for (int j = 0; j < n; ++j) {
                const int s = list[j];
                const int32_t v = (dropped >> s) & 1ull ? 0 : stage[j * ne + e];
                tot += v;
                below += s < rank ? v : 0;
            }
            total[e] += tot;
            base[e] += below;
        }
        __syncthreads();
    };
    auto read_all_senders = [&] {  // every plan flag seen
        for (int q = threadIdx.x; q < nr; q += blockDim.x) sender_list[q] = q;
        __syncthreads();
        for (int j0 = 0; j0 < nr; j0 += kStageRows) read_senders(sender_list + j0, min(kStageRows, nr - j0));
    };
    // the waiting block: every sender's plan flag (bounded by the timeout), each batch of
    // senders whose flags arrived since the last look read at once (read_senders). Once every flag is
    // seen, the second launch may be scheduled. Returns false (every thread) on a timeout, recorded as
    // block_meet records it.
    auto gather_tables = [&]() -> bool {
        __shared__ unsigned long long seen, fresh;
        __shared__ int expired, late;
        const unsigned long long everyone = nr >= 64 ? ~0ull : (1ull << nr) - 1;
        const Deadline deadline = Deadline::from_now(p.timeout_ns);
        auto flag = [&](int q) { return region.plan_flag(q); };
        if (threadIdx.x == 0) seen = 0;
        for (;;) {
            __syncthreads();  // (the last look's fresh and list read)
            if (threadIdx.x == 0) {
                fresh = 0;
                expired = deadline.expired() ? 1 : 0;
            }
            __syncthreads();
            const unsigned long long had = seen;
            for (int q = threadIdx.x; q < nr; q += blockDim.x)  // each thread acquires its peers' flags
                if (!((had >> q) & 1ull) && team.peek_gpu(flag(q)) >= epoch) atomicOr(&fresh, 1ull << q);
            __syncthreads();
            const unsigned long long got = fresh;
            if (got == 0) {
                if (expired) {  // wait_all's pass records the peers still missing, if any still are
                    if (threadIdx.x == 0)
                        late = wait_all<true>(team, flag, epoch, deadline, kPhaseDispatch, p.record) != WaitStatus::kOk;
                    __syncthreads();
                    if (late) {
                        if (threadIdx.x == 0) p.ws.state->timed_out = 1;
                        allow_next_grid();
                        return false;
                    }
                } else {
                    __nanosleep(32);
                }
                continue;
            }
            if (threadIdx.x == 0) {
                int n = 0;
                for (unsigned long long m = got; m; m &= m - 1)
                    sender_list[n++] = __ffsll(static_cast<long long>(m)) - 1;
                list_size = n;
                seen = had | got;
            }
            __syncthreads();
            const bool all_seen = (had | got) == everyone;
            if (all_seen) {
                stamp(p.ws, kPtPlansSeen);
                allow_next_grid();  // this block waits on no peer any more
            }
            const int n = list_size;
            for (int j0 = 0; j0 < n; j0 += kStageRows) read_senders(sender_list + j0, min(kStageRows, n - j0));
            if (all_seen) return true;
        }
    };
    // every sender read: the statuses (any bad one rejects the call on every rank), then for every
    // receiver d and local expert l the segment start and this rank's first row there (SEMANTICS
    // order: senders ascending)
    auto end_tables = [&] {
        for (int q = threadIdx.x; q < nr; q += blockDim.x)
            if (reinterpret_cast<volatile int32_t*>(&desc[q].status.kind)[0] != detail::kRouteOk)
                atomicMin(&bad_sender, q);
        __syncthreads();
        if (bad_sender < nr)
            for (int e = threadIdx.x; e < ne; e += blockDim.x) total[e] = base[e] = 0;
        __syncthreads();
        // segment starts: a warp per receiver scans its local experts' aligned totals, 32 at a time
        for (int d = warp; d < nr; d += kWarps) {
            int64_t at = 0;
            for (int l0 = 0; l0 < el; l0 += kWarpSize) {
                const int l = l0 + lane, e = d * el + l;
                const int32_t v = contiguous && l < el ? round_up(total[e], p.expert_alignment) : 0;
                int32_t x = v;  // inclusive scan of v over the warp
#pragma unroll
                for (int o = 1; o < kWarpSize; o <<= 1) {
                    const int32_t y = __shfl_up_sync(kFullMask, x, o);
                    if (lane >= o) x += y;
                }
                if (l < el) seg[e] = contiguous ? static_cast<int32_t>(at + x - v) : static_cast<int32_t>(l * rc);
                at += __shfl_sync(kFullMask, x, kWarpSize - 1);
            }
            if (lane == 0) m_of[d] = static_cast<int32_t>(contiguous ? at : int64_t{el} * rc);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < ne; e += blockDim.x) base[e] += seg[e];
        __syncthreads();
    };
    // the tables in the workspace: base, seg, total and m_of as they lie in dyn (3E + R words), then
    // the dropped mask (two words) and bad_sender; every receiver's DirectOutputs beside
    int32_t* const tables = p.ws.direct_tables;
    auto copy_tables = [&](int32_t* to, const int32_t* from, DirectOutputs* to_desc, const DirectOutputs* from_desc) {
        for (int i = threadIdx.x; i < 3 * ne + nr; i += blockDim.x) to[i] = from[i];
        for (int i = threadIdx.x; i < nr * 16; i += blockDim.x)
            reinterpret_cast<uint64_t*>(to_desc)[i] = reinterpret_cast<const uint64_t*>(from_desc)[i];
    };
    auto store_tables = [&] {
        copy_tables(tables, dyn, p.ws.direct_desc, desc);
        if (threadIdx.x == 0) {
            tables[3 * ne + nr] = static_cast<int32_t>(dropped & 0xffffffffull);
            tables[3 * ne + nr + 1] = static_cast<int32_t>(dropped >> 32);
            tables[3 * ne + nr + 2] = bad_sender;
        }
    };
    auto load_tables = [&] {  // the second launch, after the kernel boundary
        copy_tables(dyn, tables, desc, p.ws.direct_desc);
        if (threadIdx.x == 0) {
            dropped = static_cast<uint32_t>(tables[3 * ne + nr]) |
                      (static_cast<unsigned long long>(static_cast<uint32_t>(tables[3 * ne + nr + 1])) << 32);
            bad_sender = tables[3 * ne + nr + 2];
        }
        __syncthreads();
    };

    if (step != kStepFinish) {
        // the plan and publish run in the first launch only (the second, kStepMove or kStepMoveFinish,
        // reads what the first wrote: ws.pos_in_expert and the published counts)
        if (first_launch) {
            // ---- plan: every block reads every token (one thread each), chunk by chunk ----
            for (int e = threadIdx.x; e < ne; e += blockDim.x) running[e] = 0;
            if (threadIdx.x == 0) first_bad = detail::kNoRouteKey;
            for (int c0 = 0; c0 < t_count; c0 += chunk) {
                for (int i = threadIdx.x; i < ne * words; i += blockDim.x) bitmap[i] = 0;
                __syncthreads();
                for (int tl = threadIdx.x; tl < chunk && c0 + tl < t_count; tl += blockDim.x) {
                    const int t = c0 + tl;
                    uint32_t keep = 0;
                    unsigned long long bad = detail::kNoRouteKey;
                    for (int k0 = 0; k0 < kk; k0 += 8) {
                        int64_t ids[8];  // 8 loads in flight; repeats within them checked in registers
#pragma unroll
                        for (int u = 0; u < 8; ++u) ids[u] = k0 + u < kk ? topk_at<kIdx64>(p, t, k0 + u) : -1;
#pragma unroll
                        for (int u = 0; u < 8; ++u) {
                            const int k = k0 + u;
                            const int64_t v = ids[u];
                            if (k >= kk || v == -1) continue;
                            bool fine = v >= 0 && v < ne;
                            for (int j = 0; fine && j < k0; ++j) fine = topk_at<kIdx64>(p, t, j) != v;  // (K > 8)
#pragma unroll
                            for (int j = 0; j < u; ++j) fine = fine && ids[j] != v;
                            if (!fine) {  // out of range, or a repeat of an earlier column (dropped)
                                if (bad == detail::kNoRouteKey) bad = detail::route_key(t, k);
                                continue;
                            }
                            keep |= 1u << k;
                            atomicOr(&bitmap[v * words + tl / 32], 1u << (tl % 32));
                        }
                    }
                    valid[tl] = keep;
                    if (bad != detail::kNoRouteKey) atomicMin(&first_bad, bad);
                }
                __syncthreads();
                // positions of this block's share of the chunk's tokens
                for (int tl = threadIdx.x; tl < chunk && c0 + tl < t_count; tl += blockDim.x) {
                    const int t = c0 + tl;
                    if (t % static_cast<int>(gridDim.x) != static_cast<int>(blockIdx.x)) continue;
                    for (uint32_t m = valid[tl]; m; m &= m - 1) {
                        const int k = __ffs(m) - 1;
                        const int e = static_cast<int>(topk_at<kIdx64>(p, t, k));
                        p.ws.pos_in_expert[t * kk + k] = running[e] + bitmap_rank(bitmap + e * words, tl);
                    }
                }
                __syncthreads();
                for (int e = threadIdx.x; e < ne; e += blockDim.x) {
                    int c = 0;
                    for (int w = 0; w < words; ++w) c += __popc(bitmap[e * words + w]);
                    running[e] += c;
                }
                __syncthreads();
            }
            // ---- publish ----
            // Every block's plan read every token, so each holds the rank's counts and first invalid
            // route. When a kernel boundary follows (kStepPublish, kStepPublishMeet), block 0
            // publishes as soon as its own plan is done: the peers read only what it writes, and this
            // rank's positions are read after the boundary. kStepAll moves in the same grid, so the
            // last block to finish its plan publishes (every block's positions written).
            // (kStepAll: the last block publishes, and reads block 0's copy of the sticky word)
            if (step == kStepAll && blockIdx.x == 0 && threadIdx.x == 0) p.ws.state->sticky_seen = sticky_kind;
            if (step == kStepAll ? last_block_arrives(&p.ws.arrive[2]) : blockIdx.x == 0) {
                stamp(p.ws, kPtPlanned);
                uint8_t* mine = team.self();
                int32_t* counts_out = RegionLayout::at<int32_t>(mine, region.published_count_row(parity));
                for (int e = threadIdx.x; e < ne; e += blockDim.x) counts_out[e] = running[e];
                if (threadIdx.x == 0) {
                    // no invalid route in this call and no sticky fault: OK whatever the mode (the host
                    // record's other words are not read)
                    const int32_t sticky_seen = step == kStepAll
                                                    ? reinterpret_cast<volatile int32_t*>(&p.ws.state->sticky_seen)[0]
                                                    : sticky_kind;  // this thread's own load
                    const RouteStatus st = first_bad == detail::kNoRouteKey && sticky_seen == detail::kRouteOk
                                               ? RouteStatus{}
                                               : resolve_route_status_of<kIdx64>(p, first_bad);
                    *p.ws.route_status = st;
                    DirectOutputs* o = RegionLayout::at<DirectOutputs>(mine, region.published_outputs(parity));
                    o->recv_x = p.recv_x;
                    o->recv_scales = p.recv_scales;
                    o->recv_weights = p.recv_weights;
                    o->recv_src = p.recv_src;
                    o->m_indices = p.m_indices;
                    o->scale_expert = p.recv_scale_strides.expert;
                    o->scale_row = p.recv_scale_strides.row;
                    o->scale_column = p.recv_scale_strides.column;
                    o->scales_mn_dynamic = p.scales_mn_dynamic ? 1 : 0;
                    o->status = st;
                }
                Team::fence_gpu();
                __syncthreads();
                for (int q = threadIdx.x; q < nr; q += blockDim.x) team.signal_gpu(q, region.plan_flag(rank), epoch);
                stamp(p.ws, kPtPublished);
                // this one block waits for every sender's plan
                // (the plan's other blocks need not have exited: none of them waits on a peer), then reads
                // the tables for the second launch, which it lets be scheduled first (its blocks wait for
                // this grid's completion, and this block waits on no peer any more)
                if (step == kStepPublishMeet) {
                    start_tables();
                    if (gather_tables()) {
                        end_tables();
                        store_tables();
                        stamp(p.ws, kPtTablesMade);
                    }
                }
            }
            if (step == kStepPublish || step == kStepPublishMeet) return;
        }

        // ---- tables: left by the first launch's waiting block when this is the second launch;
        // otherwise this block waits for every plan flag and reads them ----
        bool ok = true;
        if (step == kStepMoveFinish) {
            load_tables();
        } else {
            start_tables();
            ok = block_meet(
                team, [&](int q) { return region.plan_flag(q); }, epoch, p.timeout_ns, kPhaseDispatch, p.record, p.ws);
            if (ok) {
                read_all_senders();
                end_tables();
            }
        }
        if (ok) {
            const bool rejected = bad_sender < nr;
            if (blockIdx.x == 0) stamp(p.ws, kPtTablesRead);

            // ---- move: this rank's rows into their receivers' outputs ----
            if (!rejected && !((dropped >> rank) & 1ull)) {
                const int warps_total = gridDim.x * kWarps;
                const int row_bytes = sh.hidden * (kFP8 ? 1 : 2);
                const int chunks = row_bytes / 16;
                const int iters = kFused ? (sh.hidden + 511) / 512 : (chunks + 127) / 128;
                const int slices = row_slices(t_count, iters, warps_total);
                const int64_t items = int64_t{t_count} * slices;
                uint8_t** xs = dst_x[warp];
                uint32_t** scs = dst_sc[warp];
                int64_t* css = dst_cs[warp];
                for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
                    const RowSlice slice = row_slice(item, slices, iters);
                    const int t = slice.row, it0 = slice.begin, it1 = slice.end;
                    const bool first = slice.first;
                    const bool active = lane < kk;
                    const int64_t v = active ? topk_at<kIdx64>(p, t, lane) : -1;
                    int fault, dup;
                    const int32_t clean = clean_route(v, active, ne, fault, dup);
                    const int d = clean >= 0 ? clean / el : 0;
                    const int l = clean >= 0 ? clean % el : 0;
                    // the plan kept exactly the routes clean_route keeps
                    const int32_t row = clean >= 0 ? base[clean] + p.ws.pos_in_expert[t * kk + lane] : -1;
                    const float w =
                        (active && p.topk_weights) ? p.topk_weights[t * p.topk_weights_row_stride + lane] : 0.0f;
                    if (active && first) {
                        p.ws.clean_idx[t * kk + lane] = clean;
                        p.ws.route_row[t * kk + lane] = row;
                        p.ws.route_w[t * kk + lane] = w;
                    }
                    const unsigned routes = __ballot_sync(kFullMask, row >= 0);
                    if (routes == 0) continue;
                    const int n = __popc(routes);
                    if (row >= 0) {  // (the previous token's lists were read before the closing __syncwarp)
                        const DirectOutputs& o = desc[d];
                        const int i = __popc(routes & lanes_below(lane));
                        xs[i] = o.recv_x + int64_t{row} * row_bytes;
                        if constexpr (kFP8) {
                            if (contiguous) {
                                scs[i] = o.recv_scales + int64_t{row} * o.scale_row;
                                css[i] = o.scales_mn_dynamic ? mn_major_stride(m_of[d]) : o.scale_column;
                            } else {
                                scs[i] = o.recv_scales + l * o.scale_expert + (int64_t{row} - l * rc) * o.scale_row;
                                css[i] = o.scale_column;
                            }
                        }
                        if (first) {
                            o.recv_weights[row] = w;
                            o.recv_src[row] = rank * cap + t;
                            if (contiguous) o.m_indices[row] = l;
                        }
                    }
                    __syncwarp();
                    if constexpr (!kFused) {
                        // moved as is: 4 loads in flight per lane before their stores
                        const int64_t row_off = t * p.x_row_stride * (kFP8 ? 1 : 2);
                        for (int c0 = it0 * 128 + lane; c0 < min(chunks, it1 * 128); c0 += 128) {
                            uint4 val[4];
#pragma unroll
                            for (int u = 0; u < 4; ++u) {
                                const int c = c0 + 32 * u;
                                val[u] =
                                    c < chunks ? load16(p.x, row_off + c * 16, p.x_aligned) : make_uint4(0, 0, 0, 0);
                            }
                            for (int i = 0; i < n; ++i)
#pragma unroll
                                for (int u = 0; u < 4; ++u)
                                    if (c0 + 32 * u < chunks) reinterpret_cast<uint4*>(xs[i])[c0 + 32 * u] = val[u];
                        }
                        if (kPayload == SendPayload::kFP8Copy && first)
                            for (int c = lane; c < p.scale_columns; c += 32) {
                                const uint32_t word = p.x_scales[t * p.x_scales_row_stride + c];
                                for (int i = 0; i < n; ++i) scs[i][c * css[i]] = word;
                            }
                    } else {
                        // fused quantization: lane owns 16 channels (one 16-byte fp8 store per route); a group
                        // is G/16 consecutive lanes; the next step's 32 bytes are loaded ahead
                        const int64_t row_off = t * p.x_row_stride * 2;
                        const int begin = it0 * 512, end = min(sh.hidden, it1 * 512);
                        uint4 next0 = make_uint4(0, 0, 0, 0), next1 = next0;
                        if (begin + lane * 16 < end) {
                            next0 = load16(p.x, row_off + (begin + lane * 16) * 2, p.x_aligned);
                            next1 = load16(p.x, row_off + (begin + lane * 16) * 2 + 16, p.x_aligned);
                        }
                        for (int b0 = begin; b0 < end; b0 += 512) {
                            const int ch = b0 + lane * 16;
                            const bool in = ch < end;
                            const uint4 raw0 = next0, raw1 = next1;
                            if (ch + 512 < end) {  // prefetch
                                next0 = load16(p.x, row_off + (ch + 512) * 2, p.x_aligned);
                                next1 = load16(p.x, row_off + (ch + 512) * 2 + 16, p.x_aligned);
                            }
                            float f[16];
                            float amax = 0.0f;
                            const uint32_t wd[8] = {raw0.x, raw0.y, raw0.z, raw0.w, raw1.x, raw1.y, raw1.z, raw1.w};
#pragma unroll
                            for (int i = 0; i < 8; ++i) {
                                f[2 * i] = num::bf16_to_float(static_cast<uint16_t>(wd[i] & 0xffffu));
                                f[2 * i + 1] = num::bf16_to_float(static_cast<uint16_t>(wd[i] >> 16));
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
                                q[i / 4] |=
                                    static_cast<uint32_t>(e4m3x2(__fmul_rn(f[i], mul), __fmul_rn(f[i + 1], mul)))
                                    << (8 * (i % 4));
                            if (in)
                                for (int i = 0; i < n; ++i)
                                    *reinterpret_cast<uint4*>(xs[i] + ch) = make_uint4(q[0], q[1], q[2], q[3]);
                            if constexpr (kF32Scales) {
                                if (in && (lane % kLanesPerGroup) == 0) {
                                    const int gi = ch / kScaleGroup;
                                    for (int i = 0; i < n; ++i) scs[i][gi * css[i]] = scale_bits;
                                }
                            } else {
                                // four groups' exponent bytes per scale word (group g in byte g % 4 of word
                                // g / 4); the word's first lane gathers them; groups past H give 0
                                constexpr int kLanesPerWord = 4 * kLanesPerGroup;
                                const int word_lane = lane & ~(kLanesPerWord - 1);
                                uint32_t word = 0;
#pragma unroll
                                for (int b = 0; b < 4; ++b) {
                                    const uint32_t byte =
                                        __shfl_sync(kFullMask, in ? scale_bits : 0u, word_lane + b * kLanesPerGroup);
                                    word |= (byte & 0xffu) << (8 * b);
                                }
                                const int wi = ch / (4 * kScaleGroup);
                                if (in && lane == word_lane && wi < p.scale_columns)
                                    for (int i = 0; i < n; ++i) scs[i][wi * css[i]] = word;
                            }
                        }
                    }
                    __syncwarp();
                }
            }

            // ---- padding rows of this rank's own outputs (SEMANTICS: metadata always) ----
            if (!rejected) {
                const int32_t m_rows = contiguous ? m_of[rank] : 0;
                const int64_t rows_total =
                    contiguous ? (p.host_sync ? int64_t{m_rows} : p.num_rows_out) : int64_t{el} * rc;
                const int32_t* my_seg = seg + rank * el;
                const int32_t* my_total = total + rank * el;
                const int row_bytes = sh.hidden * (kFP8 ? 1 : 2);
                const ScaleStrides& sst = p.recv_scale_strides;
                const int64_t mn_col = p.scales_mn_dynamic ? mn_major_stride(m_rows) : sst.column;
                for (int64_t r = blockIdx.x * int64_t{kThreads} + threadIdx.x; r < rows_total;
                     r += int64_t{gridDim.x} * kThreads) {
                    int64_t l = 0, pos = 0;
                    bool pad;
                    if (contiguous) {
                        if (r >= m_rows) {
                            pad = true;
                        } else {
                            int lo = 0, hi = el;  // largest l with seg[l] <= r
                            while (hi - lo > 1) {
                                const int mid = (lo + hi) / 2;
                                if (my_seg[mid] <= r)
                                    lo = mid;
                                else
                                    hi = mid;
                            }
                            l = lo;
                            pos = r - my_seg[l];
                            pad = pos >= my_total[l];
                        }
                    } else {
                        l = r / rc;
                        pos = r % rc;
                        pad = pos >= my_total[l];
                    }
                    if (!pad) continue;
                    p.recv_weights[r] = 0.0f;
                    p.recv_src[r] = -1;
                    if (contiguous) p.m_indices[r] = -1;
                    if (p.zero_padding) {
                        uint4* dst = reinterpret_cast<uint4*>(p.recv_x + r * row_bytes);
                        for (int c = 0; c < row_bytes / 16; ++c) dst[c] = make_uint4(0, 0, 0, 0);
                        if constexpr (kFP8)
                            for (int c = 0; c < p.scale_columns; ++c) {
                                const int64_t at = contiguous ? r * sst.row + c * mn_col
                                                              : l * sst.expert + pos * sst.row + c * sst.column;
                                p.recv_scales[at] = 0;
                            }
                    }
                }
            }
        }
        // ---- every block done: the last one tells every receiver (and, kStepMoveFinish, finishes) ----
        bool finisher = blockIdx.x == 0;
        if (!ok) {
            if (blockIdx.x != 0) return;
        } else {
            const bool last = last_block_arrives(&p.ws.arrive[0]);
            if (last) stamp(p.ws, kPtMoved);
            if (last)
                for (int q = threadIdx.x; q < nr; q += blockDim.x) team.signal_gpu(q, region.sent_flag(rank), epoch);
            // this rank as a receiver: the call's outputs and summary, written by the last block after it
            // has signalled (its host-record writes and system fence off every block's move)
            if (last) {
                const bool rejected = bad_sender < nr;
                for (int l = threadIdx.x; l < el; l += blockDim.x) {
                    const int32_t c = total[rank * el + l];
                    p.ws.counts[l] = c;
                    p.ws.offsets[l] = contiguous ? seg[rank * el + l] : 0;
                    p.ws.expert_load[l] += c;
                }
                if (threadIdx.x == 0) {
                    const int32_t m_rows = contiguous ? m_of[rank] : 0;
                    p.ws.offsets[el] = m_rows;
                    p.ws.state->rejected = rejected ? 1 : 0;
                    p.ws.state->num_rows = m_rows;
                    p.ws.state->num_rounds = 1;
                    write_host_summary(p.record, m_rows, rejected ? bad_sender : -1, 1,
                                       rejected ? desc[bad_sender].status : RouteStatus{});
                }
            }
            if (step == kStepMoveFinish) finisher = last;
        }
        if (step == kStepMove || !finisher) return;
    }
    // ---- finish (block 0, or kStepMoveFinish's last block): every sender wrote its rows here ----
    if (step == kStepFinish && blockIdx.x != 0) return;
    __shared__ int skip;
    if (threadIdx.x == 0) skip = p.ws.state->timed_out;
    __syncthreads();
    if (skip == 0) {
        block_meet(
            team, [&](int q) { return region.sent_flag(q); }, epoch, p.timeout_ns, kPhaseDispatch, p.record, p.ws);
        stamp(p.ws, kPtRowsSeen);
    }
    if (threadIdx.x == 0) *p.ws.epoch = epoch;
}

template <class Team, bool kNodes>
__global__ void __launch_bounds__(kThreads, 2) direct_combine_kernel(CombineParams<Team> p) {
    static_assert(Team::kLoadStore, "the direct path loads peers' memory");
    const Shape& sh = p.shape;
    const RegionLayout& region = p.region;
    const Team& team = p.team;
    const int rank = team.rank(), nr = sh.num_ranks, kk = sh.num_topk;
    const int lane = lane_id(), warp = warp_id();
    const int step = p.step;
    if (step == kStepMoveFinish) {
        if (blockIdx.x == 0) stamp(p.ws, kPtReduceResident);
        wait_for_previous_grid();
    }
    if (p.ws.state->timed_out != 0) return;
    if (blockIdx.x == 0) stamp(p.ws, entry_point(step, kPtCombineEntry, kPtReduceEntry));
    const uint64_t epoch = *p.ws.epoch;
    const int parity = static_cast<int>(epoch & 1);
    __shared__ const uint16_t* ys[kDirectMaxRanks];
    __shared__ const uint16_t* src_list[kWarps][kMaxTopk];
    __shared__ float w_list[kWarps][kMaxTopk];
    __shared__ uint8_t end_list[kWarps][kMaxTopk];  // bit 0: last route of its destination; bit 1: of its node

    if (step != kStepFinish) {
        // ---- publish (block 0, first launch only): where this rank's y is ----
        if ((step == kStepAll || step == kStepPublish || step == kStepPublishMeet) && blockIdx.x == 0) {
            if (threadIdx.x == 0)
                *RegionLayout::at<const uint16_t*>(team.self(), region.published_y_word(parity)) = p.y;
            Team::fence_gpu();
            __syncthreads();
            for (int q = threadIdx.x; q < nr; q += blockDim.x) team.signal_gpu(q, region.ready_flag(rank), epoch);
        }
        if (step == kStepPublish) return;
        auto ready = [&](int q) { return region.ready_flag(q); };
        if (step == kStepPublishMeet) {  // one block: every holder's y is published
            block_meet(team, ready, epoch, p.timeout_ns, kPhaseCombine, p.record, p.ws);
            stamp(p.ws, kPtReadySeen);
            allow_next_grid();
            return;
        }
        // ---- move: every holder's y, this rank's tokens reduced ----
        if (!block_meet(team, ready, epoch, p.timeout_ns, kPhaseCombine, p.record, p.ws)) return;
        for (int q = threadIdx.x; q < nr; q += blockDim.x)
            ys[q] = reinterpret_cast<const uint16_t*>(__ldcg(reinterpret_cast<const unsigned long long*>(
                RegionLayout::at<const uint64_t>(team.window(q), region.published_y_word(parity)))));
        __syncthreads();
        if (blockIdx.x == 0) stamp(p.ws, kPtReduceReady);
        const int warps_total = gridDim.x * kWarps;
        const int chunks = sh.hidden / 8;
        const int iters = (chunks + 31) / 32;
        const int slices = row_slices(p.num_tokens, iters, warps_total);
        const int64_t items = int64_t{p.num_tokens} * slices;
        const uint16_t** srcs = src_list[warp];
        float* wts = w_list[warp];
        uint8_t* ends = end_list[warp];
        for (int64_t item = blockIdx.x * kWarps + warp; item < items; item += warps_total) {
            const RowSlice slice = row_slice(item, slices, iters);
            const int t = slice.row, it0 = slice.begin, it1 = slice.end;
            const bool active = lane < kk;
            const int32_t clean = active ? p.ws.clean_idx[t * kk + lane] : -1;
            const int d = clean >= 0 ? clean / sh.num_local_experts : -1;
            const int32_t row = clean >= 0 ? p.ws.route_row[t * kk + lane] : -1;
            const float w = p.weighted && clean >= 0 ? p.ws.route_w[t * kk + lane] : 1.0f;
            int n_dest = 0;
            bool node_end = false;
            const int dest_at = destination_order<kNodes>(d, sh.node_size(), n_dest, node_end);
            // every route of a destination, k ascending, destinations in the origin's order
            const unsigned same = __match_any_sync(kFullMask, d >= 0 ? d : -1 - lane);
            const int leader = __ffs(same) - 1;
            const int my_dest_at = __shfl_sync(kFullMask, dest_at, leader);
            const bool my_node_end = __shfl_sync(kFullMask, node_end, leader);
            const unsigned valid = __ballot_sync(kFullMask, d >= 0);
            const int n = __popc(valid);
            const int key = d >= 0 ? my_dest_at * kWarpSize + lane : 0x7fffffff;
            int at = 0;
#pragma unroll 4
            for (int i = 0; i < kWarpSize; ++i) at += __shfl_sync(kFullMask, key, i) < key;
            const bool dest_last = d >= 0 && (same >> lane) == 1u;  // no higher lane routes to d
            __syncwarp();                                           // the previous token's lists are read
            if (d >= 0) {
                srcs[at] = row >= 0 ? ys[d] + int64_t{row} * sh.hidden : nullptr;
                wts[at] = w;
                ends[at] = static_cast<uint8_t>((dest_last ? 1 : 0) | (dest_last && my_node_end ? 2 : 0));
            }
            __syncwarp();
            for (int b0 = it0 * 32; b0 < min(chunks, it1 * 32); b0 += 32) {
                const int c = b0 + lane;
                const bool in = c < chunks;
                float acc[8], part[8], q[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) part[i] = q[i] = 0.0f;
                if (p.bias != nullptr) {
                    load_chunk(acc, in ? *reinterpret_cast<const uint4*>(p.bias + t * p.bias_row_stride + c * 8)
                                       : make_uint4(0, 0, 0, 0));
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
                }
                for (int j0 = 0; j0 < n; j0 += kBatch) {
                    uint4 v[kBatch];
#pragma unroll
                    for (int b = 0; b < kBatch; ++b) {
                        const uint16_t* src = j0 + b < n ? srcs[j0 + b] : nullptr;
                        v[b] = in && src != nullptr ? __ldcg(reinterpret_cast<const uint4*>(src + c * 8))
                                                    : make_uint4(0, 0, 0, 0);
                    }
#pragma unroll
                    for (int b = 0; b < kBatch; ++b)
                        if (j0 + b < n) {
                            fma_chunk(part, wts[j0 + b], v[b]);
                            const uint8_t e = ends[j0 + b];
                            if (e & 1) {  // the destination's partial, as the holder would have rounded it
                                add_partial<kNodes>(acc, q, pack_chunk(part), (e & 2) != 0);
#pragma unroll
                                for (int i = 0; i < 8; ++i) part[i] = 0.0f;
                            }
                        }
                }
                if (in) *reinterpret_cast<uint4*>(p.out + t * p.out_row_stride + c * 8) = pack_chunk(acc);
            }
            (void)n_dest;
        }
        const bool last = last_block_arrives(&p.ws.arrive[1]);
        if (last) stamp(p.ws, kPtReduced);
        if (last)
            for (int q = threadIdx.x; q < nr; q += blockDim.x) team.signal_gpu(q, region.done_flag(rank), epoch);
        if (step == kStepMove || (step == kStepMoveFinish ? !last : blockIdx.x != 0)) return;
    }
    // ---- finish (block 0, or kStepMoveFinish's last block): no origin reads this rank's y any more ----
    if (step == kStepFinish && blockIdx.x != 0) return;
    block_meet(
        team, [&](int q) { return region.done_flag(q); }, epoch, p.timeout_ns, kPhaseCombine, p.record, p.ws);
    stamp(p.ws, kPtDoneSeen);
}

}  // namespace elasticep::kernels
