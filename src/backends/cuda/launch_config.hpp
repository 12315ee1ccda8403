// How a CUDA buffer launches its kernels: the SM count of every row-moving kernel (grid = 2 blocks
// per SM) and how a call meets its peers (kernels::SyncMode), decided once at build from where the
// ranks run (transport::Placement), the same way on every rank.
#pragma once

#include <chrono>
#include <cstdint>

#include "elasticep/config.hpp"
#include "transport/symmetric_memory.hpp"

namespace elasticep::detail::cuda {

struct LaunchConfig {
    int num_sms = 1;
    // Some GPU holds two ranks of one process: the device waits are replaced by host waits
    // (publish, synchronise, poll the flags, then a wait-only launch); see cuda_backend.cu.
    // ELASTICEP_SHARED_GPU_DEVICE_WAITS=1 keeps the device waits (kernel benchmarks on one GPU).
    bool host_waits = false;

    // num_sms = config.num_sms when set (at most the device's), else a bandwidth model of the link:
    // ranks sharing a GPU split its SMs (they share its HBM), NVLink saturates at about 24 SMs, a
    // group on one GPU alone takes all of them.
    static LaunchConfig choose(const BufferConfig& config, const transport::Placement& where, int device_sms);
};

// The buffer's timeout in ns for the kernels' bounded waits, saturating (a wait with an enormous
// bound simply never expires).
uint64_t timeout_ns(std::chrono::milliseconds t);

}  // namespace elasticep::detail::cuda
