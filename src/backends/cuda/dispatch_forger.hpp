// Test-only fault injection for the CUDA backend (src/core/testing.hpp): lets a test play a sender
// that breaks the protocol, so the receivers' device-side peer checks can be proven across ranks and
// processes. Called by CudaBackend::dispatch only when a test installed a forger, between the send
// kernel (this rank's messages and route positions are in every receiver's window) and the exchange
// (which publishes the message counts and per-expert counts from this rank's workspace).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/backend.hpp"
#include "kernels/common/buffer_layout.hpp"

namespace elasticep::detail::cuda {

// Synchronises `stream`, then per receiver d: copies to the host what this rank is about to announce
// to d (the count and per-expert counts from the workspace, this rank's C message slots and route
// positions from d's window), calls `forger`, and writes back whatever it changed (a count outside
// int32 saturates: the workspace keeps counts as int32). Returns after the writes completed.
void forge_outgoing(const testing::DispatchForger& forger, int rank, const kernels::Shape& shape,
                    const kernels::RegionLayout& region, const std::vector<uint8_t*>& windows,
                    const kernels::Workspace& ws, cudaStream_t stream);

}  // namespace elasticep::detail::cuda
