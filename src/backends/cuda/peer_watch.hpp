// Waiting for peers on the host, and reporting every timeout and peer fault. Shares the device wait's logic and
// texts (src/core/protocol.hpp: scan_missing, timeout_message) and writes the same HostRecord fields,
// so a timeout reads the same whichever side detected it.
//
// Host waits (LaunchConfig::host_waits): ranks of one process that share a GPU cannot rely on their
// kernels running at the same time, so the meeting kernel runs twice, publish only and wait only, and
// this rank polls the flags in its own window in between, bounded by the buffer's timeout. Reads go
// through the buffer's own non-blocking stream, which no peer's kernel waits on, into page-locked memory.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <string>

#include "backends/cuda/host_records.hpp"
#include "kernels/common/buffer_layout.hpp"
#include "transport/symmetric_memory.hpp"

namespace elasticep::detail::cuda {

class PeerWatch {
 public:
    PeerWatch(int rank, int num_ranks, std::chrono::milliseconds timeout, const kernels::RegionLayout& region,
              const transport::SymmetricMemory& window, kernels::HostRecord* record, const kernels::Workspace& ws,
              cudaStream_t own_stream);

    // After this rank's publish ran on `call_stream`: waits until every peer's flag of the call in
    // `phase` is in this rank's window; raises Timeout (recorded as the device wait records it).
    void host_wait(cudaStream_t call_stream, int32_t phase);
    // The same for R words (one per peer, uint64) at `offset` of this rank's window: waits until each
    // reaches `expected`, computed from the device's epoch word (calls completed) as
    // (epoch + epoch_delta) << shift | step. Direct-path flags (shift 0) and round flags.
    void host_wait_words(cudaStream_t call_stream, int32_t phase, int64_t offset, uint64_t epoch_delta, int shift = 0,
                         uint64_t step = 0);

    bool timed_out() const;
    // Raises Timeout when a wait (device or host) of this buffer has expired.
    void raise_if_timed_out();
    // Raises Internal when a peer's datum failed its check on receipt (sticky: the buffer is unusable).
    void raise_if_peer_fault() const;
    // Both, timeouts first: what every call checks before it starts and after it synchronised.
    void raise_faults() {
        raise_if_timed_out();
        raise_if_peer_fault();
    }

 private:
    // What this rank sees after a timeout: whether the device copy of the peer table is intact, and
    // every sender's flags in this rank's window (read on the legacy stream, which does not wait for
    // the ranks' non-blocking streams).
    std::string diagnose() const;
    // After `call_stream` drained: the device's epoch word (calls completed) and its timed-out word.
    void read_epoch(cudaStream_t call_stream, uint64_t& epoch, int32_t& aborted);
    // Polls `read` (fills `seen` with every peer's word) until every word reaches `expected`.
    template <class Read>
    void poll(int32_t phase, uint64_t expected, int shift, Read&& read);

    int rank_, num_ranks_;
    std::chrono::milliseconds timeout_;
    kernels::RegionLayout region_;
    const transport::SymmetricMemory& window_;
    kernels::HostRecord* record_;
    kernels::Workspace ws_;
    cudaStream_t own_stream_;
    // what the polls copy from the device: the epoch word and the timed-out word (first line), then
    // every sender's dispatch flags (2 R) or R words
    PinnedScratch scratch_;
    static constexpr size_t kFlagsAt = 64;
};

}  // namespace elasticep::detail::cuda
