// Where every byte of a CUDA hybrid buffer lives (the protocol: src/core/protocol.hpp, "The
// hierarchical (hybrid) protocol"), written once for host sizing, host carving and device addressing:
//   HybridShape    the sizes, and this rank's node n and local index i (P ranks per node, N nodes)
//   RailMessage    one token on the network: the direct message, then per route k the token's slot
//                  at its destination rank (dslot) and its position among the sender's routes to its
//                  expert (rpos), so the forwarder writes it straight into the destination's slots
//   RailHeader     at the start of every dispatch slab: epoch, message count, the sender's route
//                  status, and per destination rank of the node its count and per-expert counts
//   NodeRegion     one rank's NVLink window, shared with its node (offsets): the direct receive area
//                  (written by the node's forwarders) and the combine input of its forwarder role
//   RailRegion     one rank's network area (offsets): send and receive slabs per node for both
//                  phases, and the emulated transport's signal words
//   HybridWorkspace  local scratch (pointers)
//   HybridRecord   what the kernels report to the host (host-mapped)
// The slab of this rank's own node never crosses the network: kernels read it from the send area.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "core/hd.hpp"
#include "core/layout.hpp"
#include "core/protocol.hpp"

namespace elasticep::kernels::hybrid {

using detail::MissingPeers;
using detail::PeerFault;
using detail::RouteStatus;

struct HybridShape {
    int num_ranks;           // R
    int num_experts;         // E
    int num_local_experts;   // E_local
    int num_topk;            // K
    int hidden;              // H
    int capacity;            // C
    int node_size;           // P
    int num_nodes;           // N = R / P
    int node;                // this rank's node
    int local;               // this rank's index in its node
    MessageLayout msg;       // the direct message (the first bytes of a rail message)
    int32_t rail_msg_bytes;  // msg.bytes + dslot[K] + rpos[K], 16-byte aligned
    int32_t header_bytes;    // RailHeader with its per-rank arrays, 256-byte aligned

    ELASTICEP_HD static HybridShape make(int num_ranks, int num_experts, int num_topk, int hidden, int capacity,
                                         int node_size, int rank, MessageLayout msg) {
        HybridShape s{};
        s.num_ranks = num_ranks;
        s.num_experts = num_experts;
        s.num_local_experts = num_experts / num_ranks;
        s.num_topk = num_topk;
        s.hidden = hidden;
        s.capacity = capacity;
        s.node_size = node_size;
        s.num_nodes = num_ranks / node_size;
        s.node = rank / node_size;
        s.local = rank % node_size;
        s.msg = msg;
        s.rail_msg_bytes = static_cast<int32_t>(msg.bytes + round_up(int64_t{2} * num_topk * 4, 16));
        s.header_bytes = static_cast<int32_t>(
            round_up(kHeaderFixed + int64_t{node_size} * 4 + int64_t{node_size} * s.num_local_experts * 4, 256));
        return s;
    }
    static constexpr int64_t kHeaderFixed = 64;

    ELASTICEP_HD int rank() const { return node * node_size + local; }
    ELASTICEP_HD int64_t slots() const { return int64_t{num_ranks} * capacity; }  // R * C
    // the rail peer of this rank in node q, and the rank of node p's sender on this rank's rail
    ELASTICEP_HD int rail_rank(int q) const { return q * node_size + local; }
    ELASTICEP_HD int64_t dispatch_slab_bytes() const { return header_bytes + int64_t{capacity} * rail_msg_bytes; }
    ELASTICEP_HD int64_t combine_slab_bytes() const { return int64_t{capacity} * hidden * 2; }
    // offsets inside a rail message
    ELASTICEP_HD int32_t dslot_offset() const { return msg.bytes; }
    ELASTICEP_HD int32_t rpos_offset() const { return msg.bytes + num_topk * 4; }
};

// The fixed part of a dispatch slab's header; dest_count [P] and expert_count [P][E_local] int32 follow.
struct RailHeader {
    uint64_t epoch;  // the call; checked by the forwarder (nccl moves it in band)
    int64_t count;   // messages in the slab
    RouteStatus status;
    uint64_t pad[2];

    ELASTICEP_HD static int32_t* dest_counts(uint8_t* header) { return reinterpret_cast<int32_t*>(header + 64); }
    ELASTICEP_HD static const int32_t* dest_counts(const uint8_t* header) {
        return reinterpret_cast<const int32_t*>(header + 64);
    }
    ELASTICEP_HD static int32_t* expert_counts(uint8_t* header, int node_size) {
        return reinterpret_cast<int32_t*>(header + 64) + node_size;
    }
    ELASTICEP_HD static const int32_t* expert_counts(const uint8_t* header, int node_size) {
        return reinterpret_cast<const int32_t*>(header + 64) + node_size;
    }
};
static_assert(sizeof(RailHeader) == HybridShape::kHeaderFixed, "the header's fixed part is 64 bytes");

// The receiver's dispatch flag for one sender and parity, written by the sender's forwarder in this
// node (protocol H2): count and status first, the epoch released last.
struct NodeFlag {
    uint64_t epoch;
    int64_t count;
    RouteStatus status;
    uint64_t pad[2];
};
static_assert(sizeof(NodeFlag) == 64, "NodeFlag is one 64-byte line");

struct Carve {
    int64_t used = 0;
    ELASTICEP_HD int64_t take(int64_t n) {
        const int64_t at = used;
        used = round_up(used + n, 256);
        return at;
    }
};

// One rank's NVLink window. Written by the forwarders of its node (dispatch) and by its node's holders
// (combine, in the forwarder role):
//   slots        [R senders][C][msg.bytes]      direct messages
//   route_pos    [R senders][C][K] int32        per route its position in its expert (-1: not here)
//   flags        [R senders][2 parities]        NodeFlag
//   expert_counts [R senders][2][E_local] int32
//   comb_in      [N source nodes][P holders][C][H] bf16: holder i's partial of origin (p, this local)'s token t
//   comb_flags   [P holders] uint64              the holder's combine epoch
struct NodeRegion {
    int64_t slots, route_pos, flags, expert_counts, comb_in, comb_flags, bytes;
    int32_t capacity, num_topk, num_local_experts, hidden, msg_bytes, node_size;

    ELASTICEP_HD static NodeRegion make(const HybridShape& s) {
        NodeRegion g{};
        Carve c;
        g.slots = c.take(s.slots() * s.msg.bytes);
        g.route_pos = c.take(s.slots() * s.num_topk * 4);
        g.flags = c.take(int64_t{s.num_ranks} * 2 * static_cast<int64_t>(sizeof(NodeFlag)));
        g.expert_counts = c.take(int64_t{s.num_ranks} * 2 * s.num_local_experts * 4);
        g.comb_in = c.take(int64_t{s.num_nodes} * s.node_size * s.capacity * s.hidden * 2);
        g.comb_flags = c.take(int64_t{s.node_size} * 8);
        g.bytes = c.used;
        g.capacity = s.capacity;
        g.num_topk = s.num_topk;
        g.num_local_experts = s.num_local_experts;
        g.hidden = s.hidden;
        g.msg_bytes = s.msg.bytes;
        g.node_size = s.node_size;
        return g;
    }
    ELASTICEP_HD int64_t message(int sender, int64_t j) const {
        return slots + (int64_t{sender} * capacity + j) * msg_bytes;
    }
    ELASTICEP_HD int64_t route_pos_row(int sender, int64_t j) const {
        return route_pos + (int64_t{sender} * capacity + j) * num_topk * 4;
    }
    ELASTICEP_HD int64_t flag(int sender, int parity) const {
        return flags + (int64_t{sender} * 2 + parity) * static_cast<int64_t>(sizeof(NodeFlag));
    }
    ELASTICEP_HD int64_t expert_counts_row(int sender, int parity) const {
        return expert_counts + (int64_t{sender} * 2 + parity) * num_local_experts * 4;
    }
    ELASTICEP_HD int64_t comb_row(int src_node, int holder_local, int64_t token) const {
        return comb_in + ((int64_t{src_node} * node_size + holder_local) * capacity + token) * hidden * 2;
    }
    ELASTICEP_HD int64_t comb_flag(int holder_local) const { return comb_flags + int64_t{holder_local} * 8; }
};

// One rank's network area (offsets from its base; the emulated transport maps it symmetrically over
// the rail, GIN registers it as an NCCL window, NCCL point-to-point uses it as plain device memory):
//   disp_send [N][dispatch slab]  what this rank sends to node q's rail peer (q == own node: read locally)
//   disp_recv [N][dispatch slab]  what node p's rail sender sent here
//   comb_send [N][C][H] bf16      node partials for origin (p, local), rows in its message order
//   comb_recv [N][C][H] bf16      node q's node partials of this rank's tokens, rows in message order
//   signals   [2 phases][N] uint64  emulated transport: node p's epoch of each phase
struct RailRegion {
    int64_t disp_send, disp_recv, comb_send, comb_recv, signals, bytes;
    int64_t disp_slab, comb_slab;
    int32_t num_nodes;

    ELASTICEP_HD static RailRegion make(const HybridShape& s) {
        RailRegion g{};
        Carve c;
        g.disp_slab = round_up(s.dispatch_slab_bytes(), 256);
        g.comb_slab = round_up(s.combine_slab_bytes(), 256);
        g.disp_send = c.take(int64_t{s.num_nodes} * g.disp_slab);
        g.disp_recv = c.take(int64_t{s.num_nodes} * g.disp_slab);
        g.comb_send = c.take(int64_t{s.num_nodes} * g.comb_slab);
        g.comb_recv = c.take(int64_t{s.num_nodes} * g.comb_slab);
        g.signals = c.take(int64_t{2} * s.num_nodes * 8);
        g.bytes = round_up(c.used, 4096);  // NCCL windows want 4 KiB granularity
        g.num_nodes = s.num_nodes;
        return g;
    }
    ELASTICEP_HD int64_t send_slab(int phase, int q) const {
        return phase == detail::kPhaseDispatch ? disp_send + q * disp_slab : comb_send + q * comb_slab;
    }
    ELASTICEP_HD int64_t recv_slab(int phase, int p) const {
        return phase == detail::kPhaseDispatch ? disp_recv + p * disp_slab : comb_recv + p * comb_slab;
    }
    // where a kernel reads node p's slab of `phase`: the own node's slab was never sent
    ELASTICEP_HD int64_t arrived_slab(int phase, int p, int own_node) const {
        return p == own_node ? send_slab(phase, p) : recv_slab(phase, p);
    }
    ELASTICEP_HD int64_t signal(int phase, int p) const {
        return signals + (int64_t{phase == detail::kPhaseDispatch ? 0 : 1} * num_nodes + p) * 8;
    }
};

struct HybridState {
    int32_t timed_out;    // a wait expired: every later kernel of the buffer does nothing
    int32_t rejected;     // a sender published a bad route status: nothing is expanded
    int32_t num_rows;     // M of the contiguous layout
    int32_t sticky_seen;  // the plan kernel's copy of the host-mapped sticky word
};

struct HybridWorkspace {
    int32_t* clean_idx;                   // [C][K] routes after validation (-1: none or dropped)
    int32_t* pos_in_expert;               // [C][K] route's position among this rank's routes to its expert
    int32_t* slot_of;                     // [C][K] at the first k of each destination rank: the token's slot there
    int32_t* node_slot;                   // [C][K] at the first k of each destination node: its message index there
    int32_t* expert_count;                // [E]
    int32_t* dest_count;                  // [R]
    int32_t* node_count;                  // [N]
    RouteStatus* route_status;            // [1] the status this call published
    unsigned long long* first_bad_route;  // [1] route_key of the first invalid route (kNoRouteKey: none)
    uint64_t* epoch;                      // [1] the current call (dispatch n and its combine: n)
    HybridState* state;                   // [1]
    int64_t* send_bytes;                  // [2 phases][N] bytes of each outgoing slab (device-sized transports)
    int32_t* fwd_count;                   // [N] messages forwarded from node p's sender (combine rows back)
    int32_t* msg_start;                   // [R + 1] received messages per sender, exclusive scan
    int32_t* expert_base;                 // [R][E_local]
    int32_t* counts;                      // [E_local] counts / masked_m output
    int32_t* offsets;                     // [E_local + 1]
    int32_t* recv_rows;                   // [R * C][K] output row of every received route (-1: none)
    int64_t* expert_load;                 // [E_local]
    unsigned* fault_claim;                // [1]
    int64_t bytes;

    ELASTICEP_HD static HybridWorkspace carve(const HybridShape& s, void* base) {
        HybridWorkspace w{};
        Carve c;
        const uintptr_t b = reinterpret_cast<uintptr_t>(base);  // null: sizing only
        auto take = [&](auto*& ptr, int64_t count) {
            using T = std::remove_reference_t<decltype(*ptr)>;
            ptr = reinterpret_cast<T*>(b + static_cast<uintptr_t>(c.take(count * static_cast<int64_t>(sizeof(T)))));
        };
        const int64_t routes = int64_t{s.capacity} * s.num_topk;
        take(w.clean_idx, routes);
        take(w.pos_in_expert, routes);
        take(w.slot_of, routes);
        take(w.node_slot, routes);
        take(w.expert_count, s.num_experts);
        take(w.dest_count, s.num_ranks);
        take(w.node_count, s.num_nodes);
        take(w.route_status, 1);
        take(w.first_bad_route, 1);
        take(w.epoch, 1);
        take(w.state, 1);
        take(w.send_bytes, int64_t{2} * s.num_nodes);
        take(w.fwd_count, s.num_nodes);
        take(w.msg_start, int64_t{s.num_ranks} + 1);
        take(w.expert_base, int64_t{s.num_ranks} * s.num_local_experts);
        take(w.counts, s.num_local_experts);
        take(w.offsets, int64_t{s.num_local_experts} + 1);
        take(w.recv_rows, s.slots() * s.num_topk);
        take(w.expert_load, s.num_local_experts);
        take(w.fault_claim, 1);
        w.bytes = c.used;
        return w;
    }
};

// Host-mapped record of one rank (the device writes, the host reads after a sync).
struct HybridRecord {
    int32_t timeout_phase;  // kPhaseNone until a wait expires (first one wins)
    int32_t timeout_hop;    // detail::Hop
    uint64_t timeout_expected;
    MissingPeers timeout_missing;  // ranks
    RouteStatus sticky;            // sticky route fault of a graph-mode dispatch
    int64_t num_rows;              // host-sync summary: M
    int32_t bad_sender;            // first sender whose status is bad, or -1
    int32_t pad;
    RouteStatus bad;
    PeerFault peer_fault;  // the first peer datum that failed its check (sticky)
};

}  // namespace elasticep::kernels::hybrid
