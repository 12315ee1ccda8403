// The emulated network of the hybrid topology (scaleout=emulated): the library's own copies stand in
// for the network hop between nodes, with GIN's ordering guarantee: a receiver reads what a put wrote
// only after the put's signal arrived (acquire), and a sender signals only after its put's bytes are
// written (release). The CPU backend's scale-out is this; the CUDA backend's emulated transport
// (src/transport/scaleout/emulated_rail.cuh) follows the same rules on the device.
//
// Fault injection for tests (docs/SEMANTICS.md, "Topology"), read once when a buffer is built:
//   ELASTICEP_EMULATED_DELAY_US=n  every signal waits n microseconds after its put's data
//   ELASTICEP_EMULATED_REORDER=1   peers are served in reverse order and every put is written back to front
// A receiver that read before the signal would then see the previous call's bytes or a half-written row.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "core/check.hpp"

namespace elasticep::transport::scaleout {

struct EmulationKnobs {
    int64_t delay_us = 0;  // [0, 10^7]
    bool reorder = false;

    static constexpr int64_t kMaxDelayUs = 10'000'000;

    // Throws InvalidArgument naming the variable for a value that is not what it documents.
    static EmulationKnobs from_env() {
        EmulationKnobs k;
        if (const char* d = std::getenv("ELASTICEP_EMULATED_DELAY_US"); d != nullptr && *d != '\0') {
            char* end = nullptr;
            const long long v = std::strtoll(d, &end, 10);
            ELASTICEP_CHECK_ARG(end != d && *end == '\0' && v >= 0 && v <= kMaxDelayUs, "ELASTICEP_EMULATED_DELAY_US='",
                                d, "' must be a whole number of microseconds in [0, ", kMaxDelayUs,
                                "]; unset it for no delay");
            k.delay_us = v;
        }
        if (const char* r = std::getenv("ELASTICEP_EMULATED_REORDER"); r != nullptr && *r != '\0') {
            const std::string v = r;
            ELASTICEP_CHECK_ARG(v == "0" || v == "1", "ELASTICEP_EMULATED_REORDER='", v,
                                "' must be 0 or 1 (1: peers served in reverse order, puts written back to front)");
            k.reorder = v == "1";
        }
        return k;
    }

    // The i-th peer to serve of `count`.
    int peer_at(int i, int count) const { return reorder ? count - 1 - i : i; }

    // A put on the host: `bytes` from src to dst, back to front in 256-byte pieces when reordering.
    void put(void* dst, const void* src, size_t bytes) const {
        if (!reorder) {
            std::memcpy(dst, src, bytes);
            return;
        }
        constexpr size_t kPiece = 256;
        for (size_t end = bytes; end > 0;) {
            const size_t begin = end > kPiece ? end - kPiece : 0;
            std::memcpy(static_cast<uint8_t*>(dst) + begin, static_cast<const uint8_t*>(src) + begin, end - begin);
            end = begin;
        }
    }

    // Called between a put's last byte and its signal.
    void before_signal() const {
        if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    }
};

}  // namespace elasticep::transport::scaleout
