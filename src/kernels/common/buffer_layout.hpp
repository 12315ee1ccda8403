// Where every byte of a CUDA buffer lives, written once and used by host sizing, host carving and
// device addressing alike (the idea of DeepEP's layout.cuh):
//   Shape         the sizes of one buffer (from its config and rank count) and its path
//   RegionLayout  one rank's symmetric window: what peers write into it. Described by OFFSETS, since
//                 every rank addresses the same piece of many windows (team.window(peer) + offset)
//   Workspace     one rank's local scratch: typed POINTERS carved from one allocation, since only this
//                 rank touches it (carve(shape, nullptr).bytes sizes it, carve(shape, base) carves it)
//   CallState     the named words a call's kernels pass to each other
//   HostRecord    what the kernels report to the host, in host-mapped memory
// Plain integers and pointers only: usable on the host (.cpp included) and in kernels.
//
// Two paths share these structs (docs/PERFORMANCE.md, "Two paths"):
//   staged  messages go into a ring of `ring` slots per sender in the receiver's window, partials into
//           the origin's compact combine slots (one per message the origin sent)
//   direct  (Shape::direct: every rank a thread of one process on one GPU, so every rank can address
//           every other rank's ordinary device memory) senders write rows straight into the receivers'
//           outputs and origins read the holders' expert outputs in place; the window holds only
//           flags and what each rank publishes for its peers to read (counts, output pointers).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/hd.hpp"
#include "core/layout.hpp"
#include "core/protocol.hpp"

namespace elasticep::kernels {

using detail::MissingPeers;
using detail::PeerFault;
using detail::RouteStatus;

struct Shape {
    int num_ranks;          // R
    int num_experts;        // E
    int num_local_experts;  // E_local = E / R
    int num_topk;           // K
    int hidden;             // H
    int capacity;           // C (max_tokens_per_rank)
    MessageLayout msg;      // one token on the wire
    // Fields below default to the full staged layout when zero-initialised (Shape s{}).
    int ring;            // staged: message slots per sender in the window; 0 = capacity (no streaming)
    int ranks_per_node;  // P of the combine order (SEMANTICS.md, "Combine"); 0 = num_ranks (one node)
    bool direct;         // the direct path: no message or partial slots in the window

    ELASTICEP_HD int64_t slots() const { return int64_t{num_ranks} * capacity; }  // R * C
    ELASTICEP_HD int ring_slots() const { return ring > 0 && ring < capacity ? ring : capacity; }
    ELASTICEP_HD int node_size() const { return ranks_per_node > 0 ? ranks_per_node : num_ranks; }
    ELASTICEP_HD bool node_level() const { return node_size() < num_ranks; }
    // compact combine slots of one origin: one per message it sends
    ELASTICEP_HD int64_t combine_rows() const { return detail::combine_slot_rows(num_ranks, capacity, num_topk); }
};

// 256-byte aligned pieces of one allocation (or of a window), in declaration order.
struct Carver {
    uintptr_t base;
    int64_t used = 0;
    ELASTICEP_HD int64_t take_bytes(int64_t n) {
        const int64_t at = used;
        used = round_up(used + n, 256);
        return at;
    }
    template <class T>
    ELASTICEP_HD T* take(int64_t count) {
        return reinterpret_cast<T*>(base + static_cast<uintptr_t>(take_bytes(count * static_cast<int64_t>(sizeof(T)))));
    }
};

// A receiver's dispatch flag for one sender and parity (protocol.hpp, "Dispatch", step 2): count and
// status first, the epoch word released last. One 64-byte line per flag.
struct DispatchFlag {
    uint64_t epoch;
    int64_t count;
    RouteStatus status;
    int64_t out_base;   // staged: the sender's first compact combine slot for this receiver's partials
    int64_t max_count;  // staged: the sender's largest count to any receiver (the call's number of rounds)
};
static_assert(sizeof(DispatchFlag) == 64, "DispatchFlag is one 64-byte line");
static_assert(offsetof(DispatchFlag, epoch) == 0, "signals address the flag's first word");

// Direct path: where a receiver's dispatch outputs are, published in its own window for the senders
// that write into them (pointers valid in this process), with its route status for the call.
struct DirectOutputs {
    uint8_t* recv_x;
    uint32_t* recv_scales;
    float* recv_weights;
    int32_t* recv_src;
    int32_t* m_indices;
    int64_t scale_expert, scale_row, scale_column;  // element strides of recv_scales (ScaleStrides)
    int32_t scales_mn_dynamic;  // contiguous MN-major buffer-owned scales with host sync: column stride
                                // mn_major_stride(M of the receiver), known only after the counts
    int32_t pad;
    RouteStatus status;
    uint64_t pad2[3];
};
static_assert(sizeof(DirectOutputs) == 128, "DirectOutputs is two 64-byte lines");

// One rank's symmetric window. Peers write (staged path):
//   dispatch_slots [R senders][S][msg.bytes]     messages, one per (sender, token) routed here; the
//                                                sender's j-th message for this rank in slot j % S
//                                                (S = ring: rounds of S messages when a host-sync call
//                                                has more)
//   route_pos      [R senders][S][K] int32       per route: its position among the sender's routes to
//                                                the same local expert (t ascending); -1 elsewhere
//   dispatch_flags [R senders][2 parities]       DispatchFlag
//   expert_counts  [R senders][2][E_local] int32 the sender's route count per local expert
//   combine_slots  [C * min(K, R)][H] bf16       the partial of every message this rank sent: its
//                                                j-th message to holder d in row out_base[d] + j
//   combine_flags  [R holders] uint64            the holder's combine epoch
//   round_flags    [R] uint64                    staged rounds: a peer's progress (epoch << 20 | step)
// and (direct path; the slots above are then empty):
//   plan_flags  [R senders] uint64   the sender published its counts and outputs for the epoch
//   sent_flags  [R senders] uint64   the sender wrote every row it sends here
//   ready_flags [R holders] uint64   the holder's y pointer for the epoch is published
//   done_flags  [R origins] uint64   the origin read every row it needs from this rank's y
// and (direct path) what this rank publishes in its OWN window for its peers to read:
//   published   [2 parities] DirectOutputs, counts [2][E] int32, y [2] pointer
struct RegionLayout {
    int64_t dispatch_slots, route_pos, dispatch_flags, expert_counts, combine_slots, combine_flags;
    int64_t round_flags;
    int64_t plan_flags, sent_flags, ready_flags, done_flags, published, published_counts, published_y;
    int64_t bytes;
    // strides of the pieces
    int32_t capacity, num_topk, num_local_experts, hidden, msg_bytes, ring, num_experts;

    ELASTICEP_HD static RegionLayout make(const Shape& s) {
        RegionLayout g{};
        Carver c{0};
        const int64_t ring = s.direct ? 0 : s.ring_slots();
        const int64_t senders = s.num_ranks;
        g.dispatch_slots = c.take_bytes(senders * ring * s.msg.bytes);
        g.route_pos = c.take_bytes(senders * ring * s.num_topk * 4);
        g.dispatch_flags = c.take_bytes(senders * 2 * static_cast<int64_t>(sizeof(DispatchFlag)));
        g.expert_counts = c.take_bytes(senders * 2 * s.num_local_experts * 4);
        g.combine_slots = c.take_bytes(s.direct ? 0 : s.combine_rows() * s.hidden * 2);
        g.combine_flags = c.take_bytes(senders * 8);
        g.round_flags = c.take_bytes(senders * 8);
        g.plan_flags = c.take_bytes(s.direct ? senders * 8 : 0);
        g.sent_flags = c.take_bytes(s.direct ? senders * 8 : 0);
        g.ready_flags = c.take_bytes(s.direct ? senders * 8 : 0);
        g.done_flags = c.take_bytes(s.direct ? senders * 8 : 0);
        g.published = c.take_bytes(s.direct ? 2 * static_cast<int64_t>(sizeof(DirectOutputs)) : 0);
        g.published_counts = c.take_bytes(s.direct ? int64_t{2} * s.num_experts * 4 : 0);
        g.published_y = c.take_bytes(s.direct ? 2 * 8 : 0);
        g.bytes = c.used;
        g.capacity = s.capacity;
        g.num_topk = s.num_topk;
        g.num_local_experts = s.num_local_experts;
        g.hidden = s.hidden;
        g.msg_bytes = s.msg.bytes;
        g.ring = static_cast<int32_t>(ring);
        g.num_experts = s.num_experts;
        return g;
    }

    // Byte offsets inside a window. `slot` is a sender's ring slot s * S + (j % S).
    ELASTICEP_HD int64_t ring_slot(int sender, int64_t j) const { return int64_t{sender} * ring + j % ring; }
    ELASTICEP_HD int64_t message(int64_t slot) const { return dispatch_slots + slot * msg_bytes; }
    ELASTICEP_HD int64_t route_pos_row(int64_t slot) const { return route_pos + slot * num_topk * 4; }
    ELASTICEP_HD int64_t dispatch_flag(int sender, int parity) const {
        return dispatch_flags + (int64_t{sender} * 2 + parity) * static_cast<int64_t>(sizeof(DispatchFlag));
    }
    ELASTICEP_HD int64_t expert_counts_row(int sender, int parity) const {
        return expert_counts + (int64_t{sender} * 2 + parity) * num_local_experts * 4;
    }
    // The compact combine slot `row` (an origin's message number out_base[d] + j).
    ELASTICEP_HD int64_t combine_slot(int64_t row) const { return combine_slots + row * hidden * 2; }
    // Kept for code written against the earlier holder-indexed combine area ([R holders][C] rows):
    // that layout holds R * C rows, which make() reserves only when min(K, R) == R (R <= K). New code
    // uses combine_slot with the origin's message numbers.
    ELASTICEP_HD int64_t combine_row(int holder, int64_t token) const {
        return combine_slots + (int64_t{holder} * capacity + token) * hidden * 2;
    }
    ELASTICEP_HD int64_t combine_flag(int holder) const { return combine_flags + int64_t{holder} * 8; }
    ELASTICEP_HD int64_t round_flag(int peer) const { return round_flags + int64_t{peer} * 8; }
    ELASTICEP_HD int64_t plan_flag(int sender) const { return plan_flags + int64_t{sender} * 8; }
    ELASTICEP_HD int64_t sent_flag(int sender) const { return sent_flags + int64_t{sender} * 8; }
    ELASTICEP_HD int64_t ready_flag(int holder) const { return ready_flags + int64_t{holder} * 8; }
    ELASTICEP_HD int64_t done_flag(int origin) const { return done_flags + int64_t{origin} * 8; }
    ELASTICEP_HD int64_t published_outputs(int parity) const {
        return published + int64_t{parity} * static_cast<int64_t>(sizeof(DirectOutputs));
    }
    ELASTICEP_HD int64_t published_count_row(int parity) const {
        return published_counts + int64_t{parity} * num_experts * 4;
    }
    ELASTICEP_HD int64_t published_y_word(int parity) const { return published_y + int64_t{parity} * 8; }

    template <class T>
    ELASTICEP_HD static T* at(uint8_t* window, int64_t offset) {
        return reinterpret_cast<T*>(window + offset);
    }
    template <class T>
    ELASTICEP_HD static const T* at(const uint8_t* window, int64_t offset) {
        return reinterpret_cast<const T*>(window + offset);
    }
};

// The words a call's kernels pass to each other (zero between calls except where noted).
struct CallState {
    int32_t timed_out;    // this rank's wait expired: every later kernel of the buffer does nothing
    int32_t rejected;     // a sender published a bad route status: nothing is expanded
    int32_t num_rows;     // M of the contiguous layout, from the count exchange
    int32_t sticky_seen;  // the plan kernel's copy of the host-mapped sticky word, for the send kernel
    int32_t num_rounds;   // staged: rounds of this call (1 unless a pair has more than S messages)
    int32_t pad[3];
};

// Device-clock points of one call of the direct path (global timer, ns), written by thread 0 of the block
// named when Workspace::points is set (ELASTICEP_STAGE_TIMES=1; cuda::StageTimer reads and names them).
enum DevicePoint : int {
    kPtDispatchEntry = 0,  // publish-and-meet launch, block 0 starts
    kPtPlanned,            // its publisher (block 0; kStepAll: the last block) has planned
    kPtPublished,          // ... and signalled every peer's plan flag
    kPtPlansSeen,          // ... and seen every sender's
    kPtMoveEntry,          // move-and-finish launch, block 0 starts
    kPtTablesRead,         // block 0 has read every sender's counts and outputs
    kPtMoved,              // the last block to finish moving arrives
    kPtRowsSeen,           // ... and has seen every sender's sent flag
    kPtCombineEntry,       // combine publish-and-meet launch (one block) starts
    kPtReadySeen,          // ... it has seen every holder's ready flag
    kPtReduceEntry,        // combine move-and-finish launch, block 0 starts
    kPtReduceReady,        // block 0 has met the ready flags and read every holder's y pointer
    kPtReduced,            // the last block to finish reducing arrives
    kPtDoneSeen,           // ... and has seen every origin's done flag
    kPtMoveResident,       // move-and-finish launch, block 0 resident (before it waits for the first launch)
    kPtReduceResident,     // combine move-and-finish launch, block 0 resident (likewise)
    kPtTablesMade,         // the dispatch's waiting block has read every sender's counts and outputs
    kNumDevicePoints
};

// One rank's local scratch, device memory only this rank touches (the direct path's peers read
// nothing here either: what they read is published in the window).
struct Workspace {
    int32_t* pos_in_expert;               // [C][K] route's position among this rank's routes to its expert
    int32_t* slot_of;                     // [C][K] at the first k of each destination: the token's slot there
    int32_t* clean_idx;                   // [C][K] routes after validation (-1: none or dropped), for the reduce
    int32_t* expert_count;                // [E] this rank's routes per global expert
    int32_t* dest_count;                  // [R] this rank's tokens per destination rank
    RouteStatus* route_status;            // [1] the status this call published
    unsigned long long* first_bad_route;  // [1] route_key of the call's first invalid route (kNoRouteKey:
                                          // none); the exchange reads and resets it
    uint64_t* epoch;                      // [1] calls completed
    CallState* state;                     // [1]
    int32_t* msg_start;                   // [R + 1] received messages per sender, exclusive scan
    int32_t* expert_base;                 // [R][E_local] a sender's first position within each local expert
    int32_t* counts;                      // [E_local] the counts / masked_m output
    int32_t* offsets;                     // [E_local + 1] the offsets output (segment starts)
    int32_t* recv_rows;                   // staged [R * C][K] the output row of every received route (-1: none)
    int64_t* expert_load;                 // [E_local] cumulative rows received per local expert
    unsigned* fault_claim;                // [1] 1 once a peer fault is recorded (never reset: the buffer is done)
    // added for the bounded staged window and the direct path
    float* recv_w;               // staged [R * C][K] the weight of every received route (the ring is reused)
    int32_t* recv_count;         // staged [R] messages received per sender (-1: dropped as corrupt)
    int32_t* origin_base;        // staged [R] sender s's first combine slot for this rank's partials
    int32_t* out_base;           // staged [R] this rank's first combine slot for holder d's partials
    int32_t* route_row;          // direct [C][K] the row each of this rank's routes got at its destination
    float* route_w;              // direct [C][K] the weight of each of this rank's routes
    unsigned* arrive;            // direct [4] blocks of a grid that finished a stage (the last resets it)
    unsigned long long* bad_at;  // direct [1] the call's first invalid route found by a fused plan
    int32_t* direct_tables;      // direct [3E + R + 3] a dispatch's tables, from its first launch's waiting
                                 // block for its second: base [E], seg [E], total [E], m_of [R], then
                                 // the dropped senders' mask (two words) and the first bad sender
    DirectOutputs* direct_desc;  // direct [R] every receiver's published outputs, likewise
    int64_t bytes;               // the whole workspace
    uint64_t* points = nullptr;  // [kNumDevicePoints] or nullptr (not carved: the stage timer's memory)

    // The one list of the pieces: sizes it (base == nullptr) and carves it (base = the allocation).
    ELASTICEP_HD static Workspace carve(const Shape& s, void* base) {
        Workspace w{};
        Carver c{reinterpret_cast<uintptr_t>(base)};
        const int64_t routes = int64_t{s.capacity} * s.num_topk;
        const int64_t received = s.direct ? 0 : s.slots() * s.num_topk;
        const int64_t own = s.direct ? routes : 0;
        w.pos_in_expert = c.take<int32_t>(routes);
        w.slot_of = c.take<int32_t>(routes);
        w.clean_idx = c.take<int32_t>(routes);
        w.expert_count = c.take<int32_t>(s.num_experts);
        w.dest_count = c.take<int32_t>(s.num_ranks);
        w.route_status = c.take<RouteStatus>(1);
        w.first_bad_route = c.take<unsigned long long>(1);
        w.epoch = c.take<uint64_t>(1);
        w.state = c.take<CallState>(1);
        w.msg_start = c.take<int32_t>(int64_t{s.num_ranks} + 1);
        w.expert_base = c.take<int32_t>(int64_t{s.num_ranks} * s.num_local_experts);
        w.counts = c.take<int32_t>(s.num_local_experts);
        w.offsets = c.take<int32_t>(int64_t{s.num_local_experts} + 1);
        w.recv_rows = c.take<int32_t>(received);
        w.expert_load = c.take<int64_t>(s.num_local_experts);
        w.fault_claim = c.take<unsigned>(1);
        w.recv_w = c.take<float>(received);
        w.recv_count = c.take<int32_t>(s.num_ranks);
        w.origin_base = c.take<int32_t>(s.num_ranks);
        w.out_base = c.take<int32_t>(s.num_ranks);
        w.route_row = c.take<int32_t>(own);
        w.route_w = c.take<float>(own);
        w.arrive = c.take<unsigned>(4);
        w.bad_at = c.take<unsigned long long>(1);
        w.direct_tables = c.take<int32_t>(s.direct ? 3 * int64_t{s.num_experts} + s.num_ranks + 3 : 0);
        w.direct_desc = c.take<DirectOutputs>(s.direct ? s.num_ranks : 0);
        w.bytes = c.used;
        return w;
    }
};

// Host-mapped record of one rank (written by the device, read by the host after a sync).
struct HostRecord {
    // timeout (first one wins; the buffer is unusable afterwards)
    int32_t timeout_phase;
    int32_t pad0;
    uint64_t timeout_expected;
    MissingPeers timeout_missing;  // the scan of every peer's flag at expiry
    // sticky fault of a graph-mode dispatch (cleared by the host in check(), by the device when a
    // host-sync dispatch reports it)
    RouteStatus sticky;
    // host-sync dispatch summary, written by the count exchange
    int64_t num_rows;    // M
    int32_t bad_sender;  // first sender whose status is bad, or -1
    int32_t num_rounds;  // staged: rounds of the call (the ring's S messages per pair per round)
    RouteStatus bad;     // that sender's status
    // the first peer datum that failed its check on receipt (sticky; the buffer is unusable after it)
    PeerFault peer_fault;
};

}  // namespace elasticep::kernels
