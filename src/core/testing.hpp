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
// announces them, so it may rewrite both.
struct OutgoingDispatch {
    int sender = 0;
    int receiver = 0;
    int64_t count = 0;         // messages announced to the receiver (the forger may change it)
    uint8_t* slots = nullptr;  // the receiver's slots for this sender: `capacity` messages of layout.bytes
    int64_t capacity = 0;      // max_tokens_per_rank
    MessageLayout layout;      // where payload, scales, ids, weights and the source token sit in a message
};

// Installs a forger on this rank's buffer, called once per receiver in every later dispatch (an
// empty function removes it). CPU backend only; others raise Unsupported.
void set_dispatch_forger(Buffer& buffer, DispatchForger forger);

}  // namespace elasticep::detail::testing
