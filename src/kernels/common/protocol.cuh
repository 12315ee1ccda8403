// Device-side protocol helpers shared by the intranode kernels: system-scope release/acquire
// flags, the bounded wait on a peer, and the records the kernels leave in host-mapped memory.
// Every spin on a peer checks %globaltimer against the buffer's timeout; on expiry one thread
// records (phase, rank, peer, expected, observed) and the kernel leaves.
#pragma once

#include <cstdint>

#include "core/protocol.hpp"

namespace elasticep::kernels {

using detail::kPhaseCombine;
using detail::kPhaseDispatch;
using detail::kPhaseNone;
using detail::RouteStatus;

// Host-mapped record of one rank (written by the device, read by the host after a sync).
struct HostRecord {
    // timeout (first one wins; the buffer is unusable afterwards)
    int32_t timeout_phase;
    int32_t timeout_peer;  // first peer not heard from
    uint64_t timeout_missing;  // bit p: peer p not heard from (p < 64)
    uint64_t timeout_expected;
    uint64_t timeout_observed;
    // sticky fault of a graph-mode dispatch (cleared by the host in check(), by the device when a
    // host-sync dispatch reports it)
    RouteStatus sticky;
    // host-sync dispatch summary, written by the count exchange
    int64_t num_rows;     // M
    int32_t bad_sender;   // first sender whose status is bad, or -1
    int32_t pad;
    RouteStatus bad;      // that sender's status
};

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Waits (one thread) until every peer's epoch word reaches `epoch`. `flag_of(p)` is the address of
// peer p's word. Returns false after recording a timeout in `rec`.
template <class FlagOf>
__device__ bool wait_peers(FlagOf flag_of, int num_ranks, uint64_t epoch, uint64_t timeout_ns, int32_t phase,
                           HostRecord* rec) {
    const uint64_t start = global_timer_ns();
    for (int p = 0; p < num_ranks; ++p) {
        while (ld_acquire_sys(flag_of(p)) < epoch) {
            if (global_timer_ns() - start > timeout_ns) {
                uint64_t missing = 0, observed = epoch;
                int first = -1;
                for (int q = 0; q < num_ranks; ++q) {
                    const uint64_t seen = ld_acquire_sys(flag_of(q));
                    if (seen < epoch) {
                        if (first < 0) first = q;
                        if (q < 64) missing |= uint64_t{1} << q;
                        observed = seen < observed ? seen : observed;
                    }
                }
                if (first < 0) break;  // arrived at the last moment
                if (rec->timeout_phase == kPhaseNone) {
                    rec->timeout_peer = first;
                    rec->timeout_missing = missing;
                    rec->timeout_expected = epoch;
                    rec->timeout_observed = observed;
                    __threadfence_system();
                    *reinterpret_cast<volatile int32_t*>(&rec->timeout_phase) = phase;
                    __threadfence_system();
                }
                return false;
            }
            __nanosleep(64);
        }
    }
    return true;
}

}  // namespace elasticep::kernels
