// The host-mapped record of one CUDA buffer (kernels::HostRecord: timeouts, sticky faults, the
// host-sync summary), leased from a process-wide pool. Records are recycled and never freed:
// cudaFreeHost waits for the whole device, and a peer of this process may be running a kernel that
// waits for this rank (src/transport/device_pool.hpp).
#pragma once

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

}  // namespace elasticep::detail::cuda
