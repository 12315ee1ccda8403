// The device side of a transport: a team of ranks that the kernels address by rank, never by raw
// peer pointers. The kernels are templates over the team type; this file holds the interface and its
// NVLink load/store implementation. A network team (issue "Hybrid topology": NCCL GIN puts with
// signals, NCCL point-to-point staging, an in-memory emulation) implements the same members and
// states its own ordering guarantee for each signal kind; the dispatch/combine kernels do not change.
//
// A Team provides (all device-side, force-inlined so the hot loops see plain address arithmetic):
//   int rank() const, size() const
//   static constexpr bool kLoadStore   true: window(peer) may be loaded from and stored to directly
//   uint8_t* window(int peer) const    base of peer's window as this rank addresses it
//   uint8_t* self() const              this rank's own window (no table load)
//   void signal(int peer, int64_t offset, uint64_t value) const
//        Release, system scope: every write this thread made before the call, and every write it
//        observed (for example through bar.sync with the writers of its block), is visible to `peer`
//        before the word at `offset` of peer's window reads `value`.
//   uint64_t peek(int64_t offset) const
//        Acquire, system scope: a word of this rank's own window; what the signaller wrote before it
//        is visible afterwards.
//   WaitStatus wait(int64_t offset, uint64_t value, const Deadline&) const
//        Spins (acquire) until the word at `offset` of this rank's own window is >= value; returns
//        kTimedOut once the deadline passed instead of spinning forever. Flags only grow (epochs).
//   static void fence()
//        System-scope fence: orders this thread's earlier writes (cumulatively) before its later ones.
// A load/store team whose peers all share this rank's GPU (the CUDA backend's direct path) may use
// the same operations at GPU scope, which is all that same-GPU peers need (no system-scope fence):
//   signal_gpu, peek_gpu, wait_gpu, static fence_gpu()   as above with .gpu instead of .sys
#pragma once

#include <cstdint>

#include "transport/symmetric_memory.hpp"

namespace elasticep::transport {

enum class WaitStatus : int32_t { kOk = 0, kTimedOut = 1 };

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// A bound on every wait of one kernel (the buffer's timeout, counted from the first wait).
struct Deadline {
    uint64_t start_ns;
    uint64_t budget_ns;
    __device__ __forceinline__ static Deadline from_now(uint64_t budget_ns) { return {global_timer_ns(), budget_ns}; }
    __device__ __forceinline__ bool expired() const { return global_timer_ns() - start_ns > budget_ns; }
};

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Peers are GPUs of one node (or ranks sharing a GPU): every window is mapped into this rank's
// address space, so a put is a store and a signal is a release store.
struct NvlinkTeam {
    NvlinkWindows w;

    static constexpr bool kLoadStore = true;

    __device__ __forceinline__ int rank() const { return w.rank; }
    __device__ __forceinline__ int size() const { return w.size; }
    __device__ __forceinline__ uint8_t* window(int peer) const { return w.windows[peer]; }
    __device__ __forceinline__ uint8_t* self() const { return w.self; }

    __device__ __forceinline__ void signal(int peer, int64_t offset, uint64_t value) const {
        st_release_sys(reinterpret_cast<uint64_t*>(window(peer) + offset), value);
    }
    __device__ __forceinline__ uint64_t peek(int64_t offset) const {
        return ld_acquire_sys(reinterpret_cast<const uint64_t*>(self() + offset));
    }
    __device__ __forceinline__ WaitStatus wait(int64_t offset, uint64_t value, const Deadline& deadline) const {
        while (peek(offset) < value) {
            if (deadline.expired()) return peek(offset) >= value ? WaitStatus::kOk : WaitStatus::kTimedOut;
            __nanosleep(64);
        }
        return WaitStatus::kOk;
    }
    __device__ __forceinline__ static void fence() { __threadfence_system(); }

    // GPU scope, for peers known to share this GPU (see the header comment)
    __device__ __forceinline__ void signal_gpu(int peer, int64_t offset, uint64_t value) const {
        st_release_gpu(reinterpret_cast<uint64_t*>(window(peer) + offset), value);
    }
    __device__ __forceinline__ uint64_t peek_gpu(int64_t offset) const {
        return ld_acquire_gpu(reinterpret_cast<const uint64_t*>(self() + offset));
    }
    __device__ __forceinline__ WaitStatus wait_gpu(int64_t offset, uint64_t value, const Deadline& deadline) const {
        while (peek_gpu(offset) < value) {
            if (deadline.expired()) return peek_gpu(offset) >= value ? WaitStatus::kOk : WaitStatus::kTimedOut;
            __nanosleep(32);
        }
        return WaitStatus::kOk;
    }
    __device__ __forceinline__ static void fence_gpu() { __threadfence(); }
};

}  // namespace elasticep::transport
