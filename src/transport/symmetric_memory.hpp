// Symmetric memory over NVLink / PCIe peer access: the host half of the load/store transport.
//
// Every rank of a group allocates one window of the same size; after the collective constructor
// each rank holds the base of every peer's window as it can address it, on the host and in a device
// table the kernels read through NvlinkTeam (src/transport/nvlink_team.cuh). This module is the
// only place that knows how a window is reached:
//   - every rank a thread of this process: the window comes from the device's stream-ordered pool
//     (device_pool.hpp), peers on other GPUs reach it through the pool's access list;
//   - ranks in other processes: cudaMalloc'd (IPC-exportable), its cudaIpcMemHandle exchanged
//     through the Group and opened by every peer process; peers on other GPUs of this process
//     need peer access (cudaDeviceEnablePeerAccess).
// A network transport (issue "Hybrid topology") adds its own window registration beside this one
// (an NCCL window, or the emulation's host memory) and its own device team; the protocol above does
// not change.
//
// Collective calls, in order, on every rank: Placement::gather, then the SymmetricMemory
// constructor (one all_gather). Each carries a "ready" flag, so a rank that failed before a collective
// still takes part in it and its peers raise at the same point instead of falling out of step. Nothing here waits for
// the whole device while a peer of this process may run kernels (see device_pool.hpp), except cudaMalloc / cudaFree /
// peer access of groups that span processes, whose peers cannot be held up by this process's context.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <vector>

#include "elasticep/group.hpp"

namespace elasticep::transport {

// Where the ranks of a group run. The same answer on every rank (it comes from one all_gather).
struct Placement {
    int rank = 0;
    int num_ranks = 1;
    int device = 0;
    bool one_process = true;             // every rank is a thread of this process
    bool remote_gpu = false;             // some rank uses another GPU than this one
    int ranks_on_my_gpu = 1;             // ranks (this one included) on this rank's GPU
    bool shared_gpu_in_process = false;  // some GPU holds two ranks of one process

    // `failure`: this rank's error before the call (null: none). The all_gather runs either way; then
    // this rank rethrows its error, and every other rank raises Internal naming the failed ranks.
    static Placement gather(Group& group, int rank, int device, std::exception_ptr failure = nullptr);
};

// What the device side of the NVLink team reads (plain data; NvlinkTeam wraps it in device code).
struct NvlinkWindows {
    int rank;
    int size;
    uint8_t* const* windows;  // device array [size]: every rank's window as this rank addresses it
    uint8_t* self;            // this rank's own window (windows[rank])
};

class SymmetricMemory {
 public:
    // Collective: allocates `bytes` (zeroed) for this rank, exchanges and maps every peer's window.
    // `stream` orders the pool allocations and the zeroing; it is synchronised before returning.
    SymmetricMemory(Group& group, const Placement& where, size_t bytes, cudaStream_t stream);
    ~SymmetricMemory();
    SymmetricMemory(const SymmetricMemory&) = delete;
    SymmetricMemory& operator=(const SymmetricMemory&) = delete;

    size_t bytes() const { return bytes_; }
    uint8_t* local() const { return local_; }
    // Every rank's window as this rank addresses it (host copy of the device table).
    const std::vector<uint8_t*>& windows() const { return windows_; }
    uint8_t* const* device_windows() const { return device_windows_; }
    NvlinkWindows nvlink_windows() const;

    // After a timeout a late peer may still write into this window: never free it.
    void keep_local_window() { keep_local_ = true; }

 private:
    void map(Group& group);  // the constructor's work (allocate, exchange, open, upload the table)
    void release();          // frees what map() got so far

    Placement where_;
    size_t bytes_ = 0;
    cudaStream_t stream_ = nullptr;
    uint8_t* local_ = nullptr;
    bool local_from_pool_ = false;
    bool keep_local_ = false;
    std::vector<uint8_t*> windows_;
    uint8_t** device_windows_ = nullptr;
    std::vector<void*> opened_;  // IPC mappings of peer processes' windows
};

}  // namespace elasticep::transport
