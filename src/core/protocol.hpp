// The dispatch/combine protocol, written once for every backend. A backend keeps only how bytes
// move (host memcpy over a shared arena, NVLink stores from kernels, later a network); what is
// sent, in which order, what a flag means, how a bad route travels and what an error says are here.
//
// Calls and epochs. A buffer numbers its dispatches 1, 2, ...: dispatch n and the combine of its
// handle both carry epoch n. Strict alternation (SEMANTICS.md) means at most one epoch is in flight.
//
// Dispatch, epoch n, sender s, receiver d (every pair, s == d included):
//   1. s writes every token routed to d once, as one message (message_layout below), into d's slot
//      region at [s][j], j = the token's rank among s's tokens for d (t ascending).
//   2. s writes d's dispatch flag [s][n % 2]: the message count and s's route status, and LAST the
//      epoch n with release ordering (nothing of 1-2 may be visible after the epoch).
//   3. d waits (bounded) until every sender's flag [s][n % 2] has epoch >= n (acquire), then reads
//      counts, statuses and messages. Two parities: a sender already at n + 1 never overwrites the
//      flag a slow receiver still reads for n.
//   4. A bad route status from any sender fails the call on every rank alike (host sync), naming
//      the lowest such sender's first bad route.
// Combine, epoch n, expert holder d, origin s:
//   5. d forms one bf16 partial per received message (the token's routes to d, k ascending) and
//      writes it into s's combine slot [d][t], then releases s's combine flag [d] = n.
//   6. s waits (bounded) until every holder's flag reached n, then reduces in first-k destination
//      order (SEMANTICS.md, "Combine").
// Slot reuse. Before writing epoch n + 1 into d's slots, s must know d has read epoch n. A combine
// that completed on s implies it (every d published after reading). The CPU backend additionally
// waits on a per-receiver "read" epoch, so a combine rejected by its argument checks on every rank
// cannot let a fast rank overwrite slots a slow rank still reads.
// Waits. Every wait on a peer is bounded by the buffer's timeout; on expiry the call fails with
// timeout_message() and the buffer is unusable until rebuilt.
//
// Route status (one state machine, decide_route_status): each rank validates its own top-k rows; the
// first invalid route (token-major) is its status. host_sync: publish it (or a sticky fault left by an
// earlier graph-mode call, which is then cleared) so every rank fails. Graph mode: publish nothing,
// drop the bad routes, and keep the first one as this rank's sticky fault until check() or the next
// host-sync dispatch reports it.
//
// Peer data. A receiver trusts nothing a peer wrote as a bound: counts, per-expert counts, row
// positions, expert ids and source tokens are checked on receipt; a bad value is dropped and becomes a
// sticky peer fault naming the sender (peer_fault_message), never a write outside the reservation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/hd.hpp"
#include "core/layout.hpp"
#include "core/limits.hpp"
#include "elasticep/config.hpp"

namespace elasticep::detail {

// ---------------------------------------------------------------------------------------------
// Phases

enum Phase : int32_t { kPhaseNone = 0, kPhaseDispatch = 1, kPhaseCombine = 2 };

inline const char* phase_name(int32_t phase) { return phase == kPhaseCombine ? "combine" : "dispatch"; }

// ---------------------------------------------------------------------------------------------
// Route status: plain data, the same bytes on the host, in device memory and inside a peer's flag
// (no constructors, so it may live in __shared__ and in memset-initialised mapped memory).

enum RouteFault : int32_t { kRouteOk = 0, kRouteOutOfRange = 1, kRouteRepeated = 2 };

struct RouteStatus {
    int32_t kind;    // RouteFault
    int32_t token;   // t of the route
    int32_t k;       // its top-k column
    int32_t dup_of;  // kRouteRepeated: the earlier column holding the same id
    int64_t value;   // the id as given
    int32_t sticky;  // 1: a sticky fault of an earlier graph-mode call, reported now
    int32_t pad;

    ELASTICEP_HD bool any() const { return kind != kRouteOk; }
};
static_assert(sizeof(RouteStatus) == 32, "RouteStatus travels inside a peer's 64-byte dispatch flag");

// A route's position in token-major order as one integer: the first invalid route of a call is the
// minimum over all routes (the CUDA plan kernel takes it with atomicMin).
ELASTICEP_HD unsigned long long route_key(int64_t token, int k) {
    return static_cast<unsigned long long>(token) * kMaxTopk + static_cast<unsigned long long>(k);
}
ELASTICEP_HD int64_t route_key_token(unsigned long long key) { return static_cast<int64_t>(key / kMaxTopk); }
ELASTICEP_HD int route_key_k(unsigned long long key) { return static_cast<int>(key % kMaxTopk); }
inline constexpr unsigned long long kNoRouteKey = ~0ull;

// What one rank's dispatch publishes and does to its sticky fault, given this call's first invalid
// route. The only place the rules of the header comment are written down as code.
struct RouteDecision {
    RouteStatus publish;  // any(): the call fails on every rank
    bool clear_sticky;    // the sticky fault is reported by this call
    bool record_sticky;   // first_bad becomes the sticky fault
};

ELASTICEP_HD RouteDecision decide_route_status(bool host_sync, const RouteStatus& sticky,
                                               const RouteStatus& first_bad) {
    RouteDecision d{};
    if (host_sync) {
        if (sticky.any()) {
            d.publish = sticky;
            d.publish.sticky = 1;
            d.clear_sticky = true;
        } else {
            d.publish = first_bad;
            d.publish.sticky = 0;
        }
    } else {
        d.record_sticky = first_bad.any() && !sticky.any();
    }
    return d;
}

// ---------------------------------------------------------------------------------------------
// Peers not heard from: one scan shared by the device wait, the CUDA host wait and the CPU backend.

struct MissingPeers {
    int count;                  // peers whose epoch is below the expected one
    int named[kMaxNamedPeers];  // the first of them, ascending
    uint64_t observed;          // the lowest epoch seen among them (expected when none)
};

template <class SeenOf>
ELASTICEP_HD MissingPeers scan_missing(SeenOf seen_of, int num_ranks, uint64_t expected) {
    MissingPeers m{};
    m.observed = expected;
    for (int q = 0; q < num_ranks; ++q) {
        const uint64_t seen = seen_of(q);
        if (seen >= expected) continue;
        if (m.count < kMaxNamedPeers) m.named[m.count] = q;
        ++m.count;
        m.observed = seen < m.observed ? seen : m.observed;
    }
    return m;
}

// ---------------------------------------------------------------------------------------------
// Peer data checked on receipt.

enum PeerFaultKind : int32_t {
    kPeerOk = 0,
    kPeerCount = 1,        // a message count outside [0, C]
    kPeerExpertCount = 2,  // a per-expert count outside [0, count], or their sum above count * min(K, E_local)
    kPeerPosition = 3,     // a route's position outside its expert's count
    kPeerExpertId = 4,     // an expert id outside [-1, E)
    kPeerToken = 5,        // a source token outside [0, C)
    kPeerSlot = 6,         // a combine slot range (base + count) beyond the origin's C * min(K, R) slots
    kPeerEpoch = 7,        // hybrid: a network slab of another call than the one expected
};

struct PeerFault {
    int32_t kind;    // PeerFaultKind
    int32_t sender;  // the rank whose data was bad
    int32_t phase;   // Phase
    int32_t pad;
    int64_t value;  // what it sent
    int64_t limit;  // the bound it broke
};

// ---------------------------------------------------------------------------------------------
// Sizes

// One token on the wire (layout.hpp: payload, scales, top-k ids, weights, source token).
MessageLayout message_layout(const BufferConfig& config);

// The receive reservation every backend makes per rank, by part (bytes).
struct Reservation {
    int64_t dispatch_slots;  // R * C messages
    int64_t combine_slots;   // R * C bf16 partial rows
    int64_t combine_out;     // C bf16 rows of the buffer-owned combine output
};

// The arithmetic itself, for host sizing and the CUDA window layout alike.
ELASTICEP_HD Reservation reservation_of(int num_ranks, int capacity, int hidden, int message_bytes) {
    const int64_t slots = int64_t{num_ranks} * capacity;
    return Reservation{slots * message_bytes, slots * hidden * 2, int64_t{capacity} * hidden * 2};
}
Reservation reservation(const BufferConfig& config, int num_ranks);

// The CUDA backend's reservation (docs/PERFORMANCE.md, "Memory"), by part (bytes). It does not grow
// with R x C for host-sync calls:
//   staged path (peers in other processes or on other GPUs): the window holds a ring of S message
//     slots per sender, S = staging_ring_slots (all C when R * C slots fit kStagingBudgetBytes, else
//     fewer; a host-sync call whose busiest (sender, receiver) pair has more than S messages streams
//     through the ring in rounds), and compact combine slots: one bf16 row per message this rank SENT
//     (at most C * min(K, R)), written by the expert holders. A graph-mode call cannot stream (no host
//     in the loop), so the first one on a buffer with S < C grows the ring to C slots (a collective
//     point, like the first call of a layout): graph_extension more bytes, kept until the buffer dies.
//   direct path (every rank a thread of this process on this GPU): senders write rows straight into
//     the receivers' outputs and origins read the expert outputs in place: no slots at all.
//   both: the workspace (route tables: R * C * K * 8 bytes for the staged path's received routes,
//     C * K * 12 (staged) or C * K * 20 (direct) for a rank's own routes) and the buffer-owned combine
//     output (C * H * 2).
inline constexpr int64_t kStagingBudgetBytes = int64_t{1} << 30;  // a window's message ring, per rank
inline constexpr int kMinRingSlots = 64;                          // the ring never shrinks below this (or C)

// Window bytes of one message slot: the message and its route-position row.
ELASTICEP_HD int64_t ring_slot_bytes(int num_topk, int message_bytes) {
    return int64_t{message_bytes} + int64_t{num_topk} * 4;
}

// Message slots per sender in the staged window (S above). `budget` is kStagingBudgetBytes unless a
// test overrides it.
ELASTICEP_HD int staging_ring_slots(int num_ranks, int capacity, int num_topk, int message_bytes, int64_t budget) {
    const int64_t per_slot = int64_t{num_ranks} * ring_slot_bytes(num_topk, message_bytes);
    int64_t s = per_slot > 0 ? budget / per_slot : capacity;
    if (s < kMinRingSlots) s = kMinRingSlots;
    return s < capacity ? static_cast<int>(s) : capacity;
}

// Combine slots of an origin: one per message it sends, at most C * min(K, R).
ELASTICEP_HD int64_t combine_slot_rows(int num_ranks, int capacity, int num_topk) {
    return int64_t{capacity} * (num_topk < num_ranks ? num_topk : num_ranks);
}

struct CudaReservation {
    int ring;                 // S: message slots per sender
    int64_t dispatch_ring;    // R * S * (message + K * 4)
    int64_t combine_slots;    // C * min(K, R) * H * 2
    int64_t route_tables;     // staged: R * C * K * 8 + C * K * 12
    int64_t combine_out;      // C * H * 2
    int64_t graph_extension;  // R * (C - S) * (message + K * 4): the first graph-mode call adds it (0 when S == C)
    int64_t direct;           // the direct path's whole reservation: C * K * 20 + combine output

    ELASTICEP_HD int64_t staged() const { return dispatch_ring + combine_slots + route_tables + combine_out; }
    ELASTICEP_HD int64_t staged_graph_mode() const { return staged() + graph_extension; }
};

// The arithmetic of the figures above (flags, counts and 256-byte alignment, a few KB, not included).
ELASTICEP_HD CudaReservation cuda_reservation_of(int num_ranks, int capacity, int num_topk, int hidden,
                                                 int message_bytes, int64_t budget) {
    CudaReservation r{};
    r.ring = staging_ring_slots(num_ranks, capacity, num_topk, message_bytes, budget);
    const int64_t slot = ring_slot_bytes(num_topk, message_bytes);
    r.dispatch_ring = int64_t{num_ranks} * r.ring * slot;
    r.combine_slots = combine_slot_rows(num_ranks, capacity, num_topk) * hidden * 2;
    const int64_t own_routes = int64_t{capacity} * num_topk;
    r.route_tables = int64_t{num_ranks} * capacity * num_topk * 8 + own_routes * 12;
    r.combine_out = int64_t{capacity} * hidden * 2;
    r.graph_extension = int64_t{num_ranks} * (capacity - r.ring) * slot;
    r.direct = own_routes * 20 + r.combine_out;
    return r;
}
CudaReservation cuda_reservation(const BufferConfig& config, int num_ranks);

// ---------------------------------------------------------------------------------------------
// Error texts (one wording for every backend)

// "invalid expert id at rank r, token t, k=k: value v is outside [-1, E) ..." / "... repeats k=j ...".
std::string describe_bad_route(const RouteStatus& b, int rank, int num_experts);

// check(), or any call that finds a sticky route fault: the text after the error code.
std::string sticky_fault_message(const RouteStatus& b, int rank, int num_experts);

// A host-sync dispatch that a rank's bad route status failed on every rank.
std::string rejected_dispatch_message(const RouteStatus& b, int sender, int num_experts);

// "dispatch: rank 0 waited 300 ms for rank(s) 2 (expected call #5, last seen #4); ..."
std::string timeout_message(int32_t phase, int rank, int64_t timeout_ms, const MissingPeers& missing,
                            uint64_t expected);

// A peer's data that failed its check on receipt.
std::string peer_fault_message(const PeerFault& f, int rank);

// ---------------------------------------------------------------------------------------------
// The hierarchical (hybrid) protocol: nodes of P = ranks_per_node ranks, N = R / P nodes.
//
// Rank r is local index i = r % P of node n = r / P. Its rail is {q * P + i : q in [0, N)}: the ranks
// with its local index, one per node, which the network connects; its node's ranks are connected by
// NVLink. Dispatch, epoch n, sender s:
//   H1. for every destination node q of a token (nodes of its destination ranks, first-k order), s puts
//       the token once (the direct message) into its rail peer f = q * P + i, as message j_q of s's
//       messages for q (t ascending); then signals f's rail flag [node of s] with the count, s's route
//       status and epoch n (GIN ordering: nothing of the put is read before the signal).
//   H2. f waits (bounded; a missing node is named) for every rail sender's signal, checks the messages
//       (peer data rules) and forwards each over NVLink to the token's destination ranks in f's node,
//       into the direct slots [s][j] of destination d (j: the token's rank among s's tokens for d), then
//       publishes d's dispatch flag [s] (count, s's status, epoch) as the direct sender would.
//   H3. every receiver then proceeds exactly as in direct topology (steps 3-4 above).
// Combine, epoch n:
//   H4. holder d writes its bf16 partial of (s, t) into forwarder f = node(d) * P + s % P (the rail peer
//       of s in d's node), then signals f.
//   H5. f waits for its node's holders, forms node partial (s, t) (SEMANTICS.md, "Combine" step 4) over
//       the token's ranks in its node, puts it into origin s's node slot [node of f][t] and signals s.
//   H6. s waits for every node's signal and reduces the node partials in first-rank order.
// Slot reuse: a rail sender waits for its rail peer's "forwarded" epoch, a forwarder for its node's
// receivers' "read" epoch, before writing epoch n + 1.

enum Hop : int32_t { kHopNvlink = 0, kHopNetwork = 1 };

inline const char* hop_name(int32_t hop) { return hop == kHopNetwork ? "network" : "nvlink"; }

// The hybrid wording of timeout_message: the hop and the node of every rank named. `missing.named`
// holds ranks. "dispatch (network hop): rank 0 waited 300 ms for rank(s) 4 (node 1) ...".
std::string hybrid_timeout_message(int32_t phase, int32_t hop, int rank, int64_t timeout_ms,
                                   const MissingPeers& missing, uint64_t expected, int ranks_per_node);

}  // namespace elasticep::detail
