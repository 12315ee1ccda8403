// Stream-ordered device memory for everything a CUDA buffer allocates while peers may be running
// kernels: receive windows of same-process groups, workspaces, peer tables, buffer-owned outputs.
//
// Why a pool: cudaMalloc / cudaFree may wait for the whole device, and with several ranks of one
// process on one GPU a peer's kernel may be spinning on this rank (tests/gpu/probe_blocking.cu
// measures which calls wait). cudaMallocFromPoolAsync / cudaFreeAsync never do. One pool per
// device, created on first use and never destroyed; every device that can reach it as a peer gets
// access (pool memory ignores cudaDeviceEnablePeerAccess).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace elasticep::transport {

cudaMemPool_t device_pool(int device);

// At least 256 bytes, 256-byte aligned, ordered on `stream`.
void* pool_alloc(size_t bytes, int device, cudaStream_t stream);

// Device memory that only grows (buffer-owned outputs): pointers stay the same while the size
// does, so a captured graph replays. A replaced block goes to `graveyard` and is freed with the
// buffer (a graph captured earlier may still reference it).
struct GrowingBlock {
    void* ptr = nullptr;
    size_t bytes = 0;
    void reserve(size_t n, int device, cudaStream_t stream, std::vector<void*>& graveyard);
};

}  // namespace elasticep::transport
