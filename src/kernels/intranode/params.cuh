// The parameter blocks of the intranode kernels, passed by value (one struct per kernel family).
// CallParams is what every kernel of a call needs; DispatchParams / CombineParams add the call's
// tensors and options. Layouts and offsets: src/kernels/common/layout.cuh.
#pragma once

#include <cstdint>

#include "kernels/common/layout.cuh"
#include "kernels/common/protocol.cuh"
#include "transport/nvlink_team.cuh"

namespace elasticep::kernels {

// How a call meets its peers. kDevice: one kernel publishes, then waits on the device (bounded).
// Ranks of one process that share a GPU cannot rely on that: CUDA may serialise their streams (they
// share hardware queues, or a tool such as compute-sanitizer runs kernels one at a time), and a
// waiting kernel then blocks the very kernel it waits for. For them the kernel only publishes
// (kPublishOnly), the host waits on the flags (bounded), then a kWaitOnly launch finds them set.
enum SyncMode : int32_t { kDevice = 0, kPublishOnly = 1, kWaitOnly = 2 };

// Element strides of recv_scales: masked [E_local][R*C][cols] uses all three, contiguous [rows][cols]
// uses row and column (row-major or MN-major alike).
struct ScaleStrides {
    int64_t expert, row, column;
};

struct CallParams {
    transport::NvlinkTeam team;  // this rank and its peers' windows
    Shape shape;
    RegionLayout region;  // offsets inside every rank's window
    Workspace ws;         // this rank's scratch
    HostRecord* record;   // host-mapped (device pointer)
    uint64_t timeout_ns;  // bound on every wait for a peer
    int32_t sync_mode;    // SyncMode
    int32_t num_tokens;   // T of this rank
};

struct DispatchParams : CallParams {
    // this rank's inputs (row strides in elements)
    const void* x;  // [T, H] bf16, or fp8 when pre-quantized
    int64_t x_row_stride;
    bool x_aligned;            // rows start 16-byte aligned: vector loads allowed
    const uint32_t* x_scales;  // pre-quantized fp8: [T, scale_columns] words
    int64_t x_scales_row_stride;
    const void* topk_idx;  // [T, K] int32 or int64
    int64_t topk_idx_row_stride;
    bool topk_idx_int64;
    const float* topk_weights;  // [T, K] or null
    int64_t topk_weights_row_stride;
    // payload
    bool fp8, quantize, prequantized, f32_scales;
    int scale_group_size;  // channels per scale group (128 or 32)
    int num_scale_groups;  // H / scale_group_size
    int scale_columns;     // stored scale words per row
    // layout
    bool contiguous, host_sync, zero_padding;
    int expert_alignment;
    int64_t num_rows_out;  // rows of the contiguous outputs (M with host sync, M_cap in graph mode)
    // outputs
    uint8_t* recv_x;
    uint32_t* recv_scales;  // fp32 bits or packed UE8M0 words: 4 bytes either way
    ScaleStrides recv_scale_strides;
    float* recv_weights;
    int32_t* recv_src;
    int32_t* m_indices;  // contiguous layout only
};

struct CombineParams : CallParams {
    const uint16_t* y;  // [rows of the dispatch, H] bf16
    bool weighted;
    const uint16_t* bias;  // [T, H] bf16 or null
    int64_t bias_row_stride;
    uint16_t* out;  // [T, H] bf16
    int64_t out_row_stride;
};

}  // namespace elasticep::kernels
