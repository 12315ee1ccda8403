// Test-only hooks into a buffer's protocol (fault injection). Nothing in the library or its bindings
// calls them; tests use them to play a peer that breaks the protocol, and check that the receiver
// turns what it reads into a named error instead of writing outside its reservation.
#pragma once

#include <cstdint>
#include <functional>

#include "core/backend.hpp"
#include "core/layout.hpp"
#include "elasticep/buffer.hpp"

namespace elasticep::detail::testing {

// What one rank is about to announce to one receiver in a dispatch. The forger runs after the
// rank wrote its messages into the receiver's slots and before it publishes the flag that
// announces them, so it may rewrite both. Every pointer is host memory: the CPU backend passes its
// arena itself; the CUDA backend passes host copies of what lies in the receiver's window and writes
// back whatever the forger changed before it publishes (src/backends/cuda/dispatch_forger.hpp).
struct OutgoingDispatch {
    int sender = 0;
    int receiver = 0;
    int64_t count = 0;         // messages announced to the receiver (the forger may change it)
    uint8_t* slots = nullptr;  // the receiver's slots for this sender: `capacity` messages of layout.bytes
    int64_t capacity = 0;      // max_tokens_per_rank
    MessageLayout layout;      // where payload, scales, ids, weights and the source token sit in a message
    // CUDA backend only (null elsewhere): the rest of what its protocol announces
    int32_t* expert_counts = nullptr;  // [num_local_experts] the sender's routes per local expert of the receiver
    int32_t* route_pos = nullptr;      // [capacity][num_topk] each route's position among the sender's routes to
                                       // its expert (-1 on routes to other ranks)
    int num_local_experts = 0;
};

// Installs a forger on this rank's buffer, called once per receiver in every later dispatch (an
// empty function removes it). CPU and CUDA backends; others raise Unsupported. (CUDA: the dispatch
// synchronises its stream around the forger, so a forged call cannot be captured in a graph.)
void set_dispatch_forger(Buffer& buffer, DispatchForger forger);

}  // namespace elasticep::detail::testing
