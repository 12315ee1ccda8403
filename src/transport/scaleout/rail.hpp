// The scale-out ("rail") transport of the hybrid topology: the network hop between the ranks with one
// local index, one per node (docs/SEMANTICS.md, "Topology"). Three implementations, chosen by
// BufferConfig::scaleout and never silently replaced by another:
//   EmulatedRail  the library's own peer copies over symmetric memory, with GIN's ordering (a signal is
//                 released after its slab's bytes; the receiver reads only after acquiring it); delay and
//                 reordering injection for tests (emulation.hpp). src/transport/scaleout/emulated_rail.cu
//   NcclRail      NCCL host point-to-point: grouped ncclSend/ncclRecv on the call's stream.
//                 src/transport/scaleout/nccl_rail.cpp
//   GinRail       NCCL's device API: GPU-initiated puts with signals (ncclGin), window from
//                 ncclCommWindowRegister. src/transport/scaleout/gin_rail.cu
// Every implementation moves, for one phase, the send slab of node q (RailRegion::send_slab) of this
// rank into the receive slab [this node] of its rail peer in node q, for every node but its own
// (whose slab the kernels read where it was written), and makes the move visible:
//   emulated, gin  sizes on the device (RailCall::send_bytes, written by the kernels); the wait is a
//                  bounded device wait on the signals (or a host poll: EmulatedRail::signal_words)
//   nccl           sizes on the host (whole slabs in graph mode, exact sizes after the count exchange
//                  with host sync); visibility is stream order; a host watchdog bounds eager calls.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "elasticep/config.hpp"
#include "elasticep/group.hpp"
#include "kernels/hybrid/layout.hpp"

namespace elasticep::transport::scaleout {

// What a transport's kernels read on the device for one phase of one call (plain data).
struct RailCall {
    const uint64_t* epoch;      // the call's epoch (device)
    const int64_t* send_bytes;  // [N] bytes of each outgoing slab of this phase (device)
    kernels::hybrid::HybridState* state;
    kernels::hybrid::HybridRecord* record;  // host-mapped (device pointer)
    uint64_t timeout_ns;
    uint8_t* base;  // this rank's network area
    kernels::hybrid::RailRegion region;
    int32_t num_nodes, node, local, node_size;
    int32_t phase;      // detail::Phase
    uint64_t expected;  // the call number of this call (host side: Timeout messages)
};

// Host-known sizes of one move (NCCL): bytes to send to / receive from each node, from `offset` of the slabs.
struct HostSizes {
    int64_t offset = 0;
    std::vector<int64_t> send, recv;  // [N]; this rank's own node ignored
};

class Rail {
 public:
    virtual ~Rail() = default;
    virtual ScaleOut kind() const = 0;
    virtual uint8_t* base() const = 0;
    // Enqueues the move of every other node's slab of call.phase on `stream` (no wait).
    virtual void send(const RailCall& call, cudaStream_t stream, const HostSizes* sizes, bool capturing) = 0;
    // Enqueues the bounded device wait for the slabs of call.phase from every other node (gin); false when
    // this transport's wait is elsewhere (emulated: the caller waits on signal words; nccl: stream order).
    virtual bool device_wait(const RailCall& call, cudaStream_t stream) = 0;
    // nccl: the watchdog of the last eager move: waits (bounded by the buffer's timeout, counted from the
    // move) for it to complete, or aborts the communicator and raises Timeout naming the rail peers not
    // heard from (`expected`: the call number for the message). Others: nothing to do.
    virtual void settle(uint64_t expected) { (void)expected; }
    // After a timeout a late peer may still write into this rank's area: never free it.
    virtual void keep_memory() {}
};

// The NCCL communicator of one rail, built from the Group (unique id through all_gather). Sets
// NCCL_CUMEM_ENABLE=1 unless the environment sets it. Defined only when the library has NCCL.
class NcclComm;

// Whether this build has NCCL (its device API included) and the version it was built against.
bool nccl_compiled();
std::string nccl_build_version();

// Factories (collective over `rail`: every member calls them at once). Throw Unsupported naming what
// is missing. `tag` names the rank in errors.
std::unique_ptr<Rail> make_emulated_rail(Group& rail, const kernels::hybrid::RailRegion& region, int device,
                                         cudaStream_t stream, int node, int local, int node_size);
// `blocking` false: a non-blocking communicator (NcclComm), what the NCCL point-to-point rail needs to
// bound its waits; GIN's set-up takes a blocking one.
std::shared_ptr<NcclComm> make_nccl_comm(Group& rail, int device, bool blocking, std::chrono::milliseconds timeout);
// `comm` when it is non-blocking (or NCCL has no non-blocking communicators); else a new non-blocking
// one on the same rail, `comm` released first (collective, like make_nccl_comm).
std::shared_ptr<NcclComm> nonblocking_nccl_comm(std::shared_ptr<NcclComm> comm, Group& rail, int device,
                                                std::chrono::milliseconds timeout);
std::unique_ptr<Rail> make_nccl_rail(std::shared_ptr<NcclComm> comm, const kernels::hybrid::RailRegion& region,
                                     int device, int node, int local, int node_size, std::chrono::milliseconds timeout);
// GIN on the rail: throws Unsupported with NCCL's own reason when NCCL creates no GIN context here.
std::unique_ptr<Rail> make_gin_rail(std::shared_ptr<NcclComm> comm, const kernels::hybrid::RailRegion& region,
                                    int device, cudaStream_t stream, int node);

}  // namespace elasticep::transport::scaleout
