// The host-mapped record of one CUDA buffer (kernels::HostRecord: timeouts, sticky faults, the
// host-sync summary), leased from a process-wide pool. Records are recycled and never freed:
// cudaFreeHost waits for the whole device, and a peer of this process may be running a kernel that
// waits for this rank (src/transport/device_pool.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/buffer_layout.hpp"

namespace elasticep::detail::cuda {

class HostRecordLease {
 public:
    HostRecordLease();  // a zeroed record
    ~HostRecordLease();
    HostRecordLease(const HostRecordLease&) = delete;
    HostRecordLease& operator=(const HostRecordLease&) = delete;

    kernels::HostRecord* host() const { return host_; }
    kernels::HostRecord* device() const { return device_; }  // the same memory as the kernels address it

 private:
    kernels::HostRecord* host_ = nullptr;
    kernels::HostRecord* device_ = nullptr;
};

// Page-locked host memory that a buffer's host waits copy the peers' flags into (PeerWatch). Into
// pageable memory every such read is a staged, synchronous copy through the driver, made again and
// again by every polling rank of the process: with 8 ranks on one H200, back-to-back calls took
// 23 / 9 ms (dispatch / combine) instead of 0.62 / 0.56 ms with this memory (docs/PERFORMANCE.md,
// runs 19-20). Leased from a process-wide pool by size class (powers of two from 4 KiB), recycled
// and never freed, like the records.
class PinnedScratch {
 public:
    explicit PinnedScratch(size_t bytes);
    ~PinnedScratch();
    PinnedScratch(const PinnedScratch&) = delete;
    PinnedScratch& operator=(const PinnedScratch&) = delete;

    void* data() const { return ptr_; }

    // A call's state as a host wait starts: the device's epoch word (calls completed) and its
    // timed-out word, read through the first 12 bytes of this memory on `stream`, synchronously.
    void read_call_state(const uint64_t* epoch_dev, const int32_t* timed_out_dev, cudaStream_t stream, uint64_t& epoch,
                         int32_t& timed_out);

 private:
    size_t bytes_ = 0;  // the size class: the pool list it goes back to
    void* ptr_ = nullptr;
};

}  // namespace elasticep::detail::cuda
