// Device half of the protocol (src/core/protocol.hpp): the bounded wait for every peer of a team.
// Every spin on a peer is bounded by the buffer's timeout; on expiry one thread records (phase,
// expected epoch, the peers not heard from) in the host-mapped HostRecord (buffer_layout.hpp) and the
// kernel leaves.
#pragma once

#include <cstdint>

#include "core/protocol.hpp"
#include "kernels/common/buffer_layout.hpp"
#include "transport/nvlink_team.cuh"

namespace elasticep::kernels {

using detail::kPhaseCombine;
using detail::kPhaseDispatch;
using detail::kPhaseNone;
using detail::MissingPeers;
using detail::RouteStatus;
using transport::Deadline;
using transport::WaitStatus;

// One thread waits until every peer's epoch word (at offset_of(q) in this rank's own window) reaches
// `epoch`. On expiry it records the peers still missing (unless an earlier timeout is recorded) and
// returns kTimedOut; a peer that arrives at the last moment is not a timeout.
// kGpuScope: the peers share this GPU (direct path), so acquire at GPU scope.
template <bool kGpuScope = false, class Team, class OffsetOf>
// `shift`: the flags hold (call << shift) | step (round flags); the record names calls.
__device__ WaitStatus wait_all(const Team& team, OffsetOf offset_of, uint64_t epoch, const Deadline& deadline,
                               int32_t phase, HostRecord* rec, int shift = 0) {
    auto wait = [&](int64_t off) {
        if constexpr (kGpuScope)
            return team.wait_gpu(off, epoch, deadline);
        else
            return team.wait(off, epoch, deadline);
    };
    auto peek = [&](int64_t off) {
        if constexpr (kGpuScope)
            return team.peek_gpu(off);
        else
            return team.peek(off);
    };
    for (int q = 0; q < team.size(); ++q) {
        if (wait(offset_of(q)) == WaitStatus::kOk) continue;
        const MissingPeers missing =
            detail::scan_missing([&](int r) { return peek(offset_of(r)); }, team.size(), epoch);
        if (missing.count == 0) continue;  // arrived at the last moment
        if (rec->timeout_phase == kPhaseNone) {
            rec->timeout_expected = epoch >> shift;
            rec->timeout_missing = missing;
            rec->timeout_missing.observed = missing.observed >> shift;
            __threadfence_system();
            *reinterpret_cast<volatile int32_t*>(&rec->timeout_phase) = phase;
            __threadfence_system();
        }
        return WaitStatus::kTimedOut;
    }
    return WaitStatus::kOk;
}

// The whole block calls: thread q waits for peer q's word (strided over the team), so when every
// peer has arrived the wait costs one peer's latency, not one per peer in series; only when some
// word was not seen before the deadline does thread 0 make wait_all's pass, which records the
// peers still missing. Returns the status to every thread; what the peers wrote before their
// signals is visible to every thread afterwards (each acquire, then the block barrier).
template <bool kGpuScope = false, class Team, class OffsetOf>
__device__ WaitStatus block_wait_all(const Team& team, OffsetOf offset_of, uint64_t epoch, const Deadline& deadline,
                                     int32_t phase, HostRecord* rec, int shift = 0) {
    __shared__ int late;
    __shared__ int timed_out;
    if (threadIdx.x == 0) late = 0;
    __syncthreads();
    for (int q = threadIdx.x; q < team.size(); q += blockDim.x) {
        WaitStatus st;
        if constexpr (kGpuScope)
            st = team.wait_gpu(offset_of(q), epoch, deadline);
        else
            st = team.wait(offset_of(q), epoch, deadline);
        if (st != WaitStatus::kOk) late = 1;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        timed_out = late && wait_all<kGpuScope>(team, offset_of, epoch, deadline, phase, rec, shift) != WaitStatus::kOk;
    __syncthreads();
    return timed_out ? WaitStatus::kTimedOut : WaitStatus::kOk;
}

// A peer's datum failed its check on receipt (protocol.hpp, "Peer data"): the first one of the
// buffer's life is recorded (claimed in device memory, so any thread of any kernel may call this;
// only the winner writes the host-mapped record). The caller drops the datum.
__device__ __forceinline__ void record_peer_fault(const Workspace& ws, HostRecord* rec, int32_t kind, int sender,
                                                  int32_t phase, int64_t value, int64_t limit) {
    if (atomicCAS(ws.fault_claim, 0u, 1u) != 0u) return;
    volatile detail::PeerFault* f = &rec->peer_fault;
    f->sender = sender;
    f->phase = phase;
    f->value = value;
    f->limit = limit;
    __threadfence_system();
    f->kind = kind;
    __threadfence_system();
}

// A dispatch's summary for the host (one thread): M, the first bad sender (-1: none) and its route
// status `bad`, the rounds; then a system fence, before the host reads it after the call.
__device__ __forceinline__ void write_host_summary(HostRecord* rec, int64_t num_rows, int bad_sender, int rounds,
                                                   const RouteStatus& bad) {
    volatile HostRecord* r = rec;
    r->num_rows = num_rows;
    r->bad_sender = bad_sender;
    r->num_rounds = rounds;
    if (bad_sender >= 0) {
        r->bad.kind = bad.kind;
        r->bad.token = bad.token;
        r->bad.k = bad.k;
        r->bad.dup_of = bad.dup_of;
        r->bad.value = bad.value;
        r->bad.sticky = bad.sticky;
    }
    __threadfence_system();
}

}  // namespace elasticep::kernels
