// Where every byte of a CUDA buffer lives, written once and used by host sizing, host carving and
// device addressing alike (the idea of DeepEP's layout.cuh):
//   Shape         the sizes of one buffer (from its config and rank count)
//   RegionLayout  one rank's symmetric window: what peers write into it. Described by OFFSETS, since
//                 every rank addresses the same piece of many windows (team.window(peer) + offset)
//   Workspace     one rank's local scratch: typed POINTERS carved from one allocation, since only this
//                 rank touches it (carve(shape, nullptr).bytes sizes it, carve(shape, base) carves it)
//   CallState     the named words a call's kernels pass to each other
//   HostRecord    what the kernels report to the host, in host-mapped memory
// Plain integers and pointers only: usable on the host (.cpp included) and in kernels.
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

    ELASTICEP_HD int64_t slots() const { return int64_t{num_ranks} * capacity; }  // R * C
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
    uint64_t pad[2];
};
static_assert(sizeof(DispatchFlag) == 64, "DispatchFlag is one 64-byte line");
static_assert(offsetof(DispatchFlag, epoch) == 0, "signals address the flag's first word");

// One rank's symmetric window. Peers write:
//   dispatch_slots [R senders][C][msg.bytes]     messages, one per (sender, token) routed here
//   route_pos      [R senders][C][K] int32       per route: its position among the sender's routes to
//                                                the same local expert (t ascending); -1 elsewhere
//   dispatch_flags [R senders][2 parities]       DispatchFlag
//   expert_counts  [R senders][2][E_local] int32 the sender's route count per local expert
//   combine_slots  [R holders][C][H] bf16        combine partials for this rank's own tokens
//   combine_flags  [R holders] uint64            the holder's combine epoch
struct RegionLayout {
    int64_t dispatch_slots, route_pos, dispatch_flags, expert_counts, combine_slots, combine_flags;
    int64_t bytes;
    // strides of the pieces
    int32_t capacity, num_topk, num_local_experts, hidden, msg_bytes;

    ELASTICEP_HD static RegionLayout make(const Shape& s) {
        RegionLayout g{};
        Carver c{0};
        const detail::Reservation slots = detail::reservation_of(s.num_ranks, s.capacity, s.hidden, s.msg.bytes);
        g.dispatch_slots = c.take_bytes(slots.dispatch_slots);
        g.route_pos = c.take_bytes(s.slots() * s.num_topk * 4);
        g.dispatch_flags = c.take_bytes(int64_t{s.num_ranks} * 2 * static_cast<int64_t>(sizeof(DispatchFlag)));
        g.expert_counts = c.take_bytes(int64_t{s.num_ranks} * 2 * s.num_local_experts * 4);
        g.combine_slots = c.take_bytes(slots.combine_slots);
        g.combine_flags = c.take_bytes(int64_t{s.num_ranks} * 8);
        g.bytes = c.used;
        g.capacity = s.capacity;
        g.num_topk = s.num_topk;
        g.num_local_experts = s.num_local_experts;
        g.hidden = s.hidden;
        g.msg_bytes = s.msg.bytes;
        return g;
    }

    // Byte offsets inside a window. `slot` is a sender's slot s * C + j.
    ELASTICEP_HD int64_t message(int64_t slot) const { return dispatch_slots + slot * msg_bytes; }
    ELASTICEP_HD int64_t route_pos_row(int64_t slot) const { return route_pos + slot * num_topk * 4; }
    ELASTICEP_HD int64_t dispatch_flag(int sender, int parity) const {
        return dispatch_flags + (int64_t{sender} * 2 + parity) * static_cast<int64_t>(sizeof(DispatchFlag));
    }
    ELASTICEP_HD int64_t expert_counts_row(int sender, int parity) const {
        return expert_counts + (int64_t{sender} * 2 + parity) * num_local_experts * 4;
    }
    ELASTICEP_HD int64_t combine_row(int holder, int64_t token) const {
        return combine_slots + (int64_t{holder} * capacity + token) * hidden * 2;
    }
    ELASTICEP_HD int64_t combine_flag(int holder) const { return combine_flags + int64_t{holder} * 8; }

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
};

// One rank's local scratch, device memory only this rank touches.
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
    int32_t* recv_rows;                   // [R * C][K] the output row of every received route (-1: none)
    int64_t* expert_load;                 // [E_local] cumulative rows received per local expert
    unsigned* fault_claim;                // [1] 1 once a peer fault is recorded (never reset: the buffer is done)
    int64_t bytes;                        // the whole workspace

    // The one list of the pieces: sizes it (base == nullptr) and carves it (base = the allocation).
    ELASTICEP_HD static Workspace carve(const Shape& s, void* base) {
        Workspace w{};
        Carver c{reinterpret_cast<uintptr_t>(base)};
        const int64_t routes = int64_t{s.capacity} * s.num_topk;
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
        w.recv_rows = c.take<int32_t>(s.slots() * s.num_topk);
        w.expert_load = c.take<int64_t>(s.num_local_experts);
        w.fault_claim = c.take<unsigned>(1);
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
    int32_t pad1;
    RouteStatus bad;  // that sender's status
    // the first peer datum that failed its check on receipt (sticky; the buffer is unusable after it)
    PeerFault peer_fault;
};

}  // namespace elasticep::kernels
