// Arguments and shared device helpers of the hybrid kernels (src/kernels/hybrid/{dispatch,combine}.cuh).
// The split of the intranode kernels' params: template constants (payload, index width, layout,
// weighting, bias, one node or several) chosen by with_constants; everything else one plain struct
// passed by value. The NVLink side is a transport::NvlinkTeam over this rank's node (rank() is the
// local index, window(i) the NodeRegion window of node rank i); the network side is the rail
// transport (src/transport/scaleout/), which moves whole slabs between the areas of RailRegion.
#pragma once

#include <cstdint>

#include "core/limits.hpp"
#include "core/numerics.hpp"
#include "kernels/common/primitives.cuh"
#include "kernels/hybrid/layout.hpp"
#include "transport/nvlink_team.cuh"

namespace elasticep::kernels::hybrid {

using detail::kPhaseCombine;
using detail::kPhaseDispatch;
using detail::kPhaseNone;
using transport::Deadline;
using transport::NvlinkTeam;
using transport::WaitStatus;

// What the pack kernel puts into a message's payload (template constant).
enum class RailPayload : int32_t {
    kBF16,          // bf16 rows moved as is
    kFP8Copy,       // pre-quantized fp8 rows and their scale words moved as is
    kFP8F32G128,    // bf16 quantized in the kernel, one fp32 scale per 128 channels
    kFP8UE8M0G128,  // ... one power-of-two (UE8M0 byte) scale per 128 channels
    kFP8UE8M0G32,   // ... per 32 channels (MXFP8)
};
constexpr bool payload_is_fp8(RailPayload p) { return p != RailPayload::kBF16; }
constexpr bool payload_quantizes(RailPayload p) { return p != RailPayload::kBF16 && p != RailPayload::kFP8Copy; }
constexpr bool payload_f32_scales(RailPayload p) { return p == RailPayload::kFP8F32G128; }
constexpr int payload_scale_group(RailPayload p) { return p == RailPayload::kFP8UE8M0G32 ? 32 : 128; }

constexpr int kStatusBlocks = 16;
constexpr int kSmallThreads = 256;  // one-block kernels (header, publish, exchange)

struct Params {
    NvlinkTeam node;  // this rank's node (rank() = local index)
    HybridShape shape;
    NodeRegion region;
    RailRegion rail;
    uint8_t* rail_base;  // this rank's network area
    HybridWorkspace ws;
    HybridRecord* record;  // host-mapped (device pointer)
    uint64_t timeout_ns;
    int32_t num_tokens;
};

struct DispatchParams : Params {
    const void* x;
    int64_t x_row_stride;
    bool x_aligned;
    const uint32_t* x_scales;
    int64_t x_scales_row_stride;
    const void* topk_idx;
    int64_t topk_idx_row_stride;
    const float* topk_weights;
    int64_t topk_weights_row_stride;
    int scale_columns;
    bool host_sync, zero_padding;
    int expert_alignment;  // 0: masked layout
    int64_t num_rows_out;
    uint8_t* recv_x;
    uint32_t* recv_scales;
    int64_t scale_expert_stride, scale_row_stride, scale_column_stride;
    float* recv_weights;
    int32_t* recv_src;
    int32_t* m_indices;
};

struct CombineParams : Params {
    const uint16_t* y;
    const uint16_t* bias;
    int64_t bias_row_stride;
    uint16_t* out;
    int64_t out_row_stride;
};

// Epoch words to wait for (>= the current epoch): word i at base + offset + i * stride +
// (epoch % 2) * parity_stride, for i in [0, count) except `skip`; word i belongs to rank
// first_rank + i * rank_stride. The host waits read the same words (host-wait mode).
struct WaitSpec {
    const uint8_t* base;  // this rank's own memory (a window or the network area)
    int64_t offset, stride, parity_stride;
    int32_t count, skip, first_rank, rank_stride;
    int32_t phase, hop;
};

// The first peer datum of the buffer's life that failed its check (any thread may call; one writes).
__device__ __forceinline__ void record_peer_fault(const HybridWorkspace& ws, HybridRecord* rec, int32_t kind,
                                                  int sender, int32_t phase, int64_t value, int64_t limit) {
    if (atomicCAS(ws.fault_claim, 0u, 1u) != 0u) return;
    volatile PeerFault* f = &rec->peer_fault;
    f->sender = sender;
    f->phase = phase;
    f->value = value;
    f->limit = limit;
    __threadfence_system();
    f->kind = kind;
    __threadfence_system();
}

// A timeout of this rank (the first one wins): phase, hop, the ranks still missing.
__device__ __forceinline__ void record_timeout(HybridRecord* rec, int32_t phase, int32_t hop, uint64_t expected,
                                               const MissingPeers& missing) {
    if (reinterpret_cast<volatile int32_t*>(&rec->timeout_phase)[0] != kPhaseNone) return;
    rec->timeout_expected = expected;
    rec->timeout_missing = missing;
    reinterpret_cast<volatile int32_t*>(&rec->timeout_hop)[0] = hop;
    __threadfence_system();
    reinterpret_cast<volatile int32_t*>(&rec->timeout_phase)[0] = phase;
    __threadfence_system();
}

// One thread: waits (bounded) for every word of `w`; records a timeout and returns kTimedOut.
__device__ inline WaitStatus wait_words(const WaitSpec& w, uint64_t epoch, const Deadline& deadline,
                                        HybridRecord* rec) {
    const int64_t parity = static_cast<int64_t>(epoch & 1) * w.parity_stride;
    auto word = [&](int i) {
        return transport::ld_acquire_sys(reinterpret_cast<const uint64_t*>(w.base + w.offset + i * w.stride + parity));
    };
    for (int i = 0; i < w.count; ++i) {
        if (i == w.skip) continue;
        while (word(i) < epoch) {
            if (deadline.expired()) {
                MissingPeers m{};
                m.observed = epoch;
                for (int q = 0; q < w.count; ++q) {
                    const uint64_t seen = q == w.skip ? epoch : word(q);
                    if (seen >= epoch) continue;
                    if (m.count < kMaxNamedPeers) m.named[m.count] = w.first_rank + q * w.rank_stride;
                    ++m.count;
                    m.observed = seen < m.observed ? seen : m.observed;
                }
                if (m.count == 0) break;  // arrived at the last moment
                record_timeout(rec, w.phase, w.hop, epoch, m);
                return WaitStatus::kTimedOut;
            }
            __nanosleep(64);
        }
    }
    return WaitStatus::kOk;
}

// Received messages of this rank in (sender, slot) order, as the intranode kernels number them.
__device__ __forceinline__ int load_starts(int32_t* start, int n, const int32_t* src) {
    for (int s = threadIdx.x; s <= n; s += blockDim.x) start[s] = src[s];
    __syncthreads();
    return start[n];
}

// The entry i falls in: the largest s with start[s] <= i (empty entries repeat their successor's start).
__device__ __forceinline__ int find_start(const int32_t* start, int n, int i) {
    int lo = 0, hi = n;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (start[mid] <= i)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

// Copies `bytes` (a multiple of 16) from src to every dsts[0..n) with one warp, chunks [c0, c1) of 16 B.
__device__ __forceinline__ void warp_copy(uint8_t* const* dsts, int n, const uint8_t* src, int c0, int c1) {
    const int lane = lane_id();
    for (int c = c0 + lane; c < c1; c += 4 * kWarpSize) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            v[u] = c + u * kWarpSize < c1 ? __ldcg(reinterpret_cast<const uint4*>(src) + c + u * kWarpSize)
                                          : make_uint4(0, 0, 0, 0);
        for (int i = 0; i < n; ++i)
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (c + u * kWarpSize < c1) reinterpret_cast<uint4*>(dsts[i])[c + u * kWarpSize] = v[u];
    }
}

}  // namespace elasticep::kernels::hybrid
