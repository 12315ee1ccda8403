// The arguments of the intranode kernels, in two parts (the split of DeepEP's elastic Args):
//   Templated arguments: what changes the code a kernel runs (payload and its quantization, top-k
//     index width, layout, weighting, bias), kernel template parameters chosen from runtime values by
//     with_constants (src/kernels/common/static_switch.hpp), so dead branches leave the kernels. The
//     transport is one too: every kernel is a template over its Team (src/transport/nvlink_team.cuh).
//   Parameters: everything else, one plain struct passed by value. CallParams is what every kernel of
//     a call needs; DispatchParams / CombineParams add the call's tensors and options.
// Layouts and offsets: src/kernels/common/buffer_layout.hpp.
#pragma once

#include <cstdint>

#include "core/limits.hpp"
#include "kernels/common/buffer_layout.hpp"
#include "kernels/common/protocol.cuh"
#include "kernels/common/static_switch.hpp"
#include "transport/nvlink_team.cuh"

namespace elasticep::kernels {

// How a call meets its peers. kDevice: one kernel publishes, then waits on the device (bounded).
// Ranks of one process that share a GPU cannot rely on that: CUDA may serialise their streams (they
// share hardware queues, or a tool such as compute-sanitizer runs kernels one at a time), and a
// waiting kernel then blocks the very kernel it waits for. For them the kernel only publishes
// (kPublishOnly), the host waits on the flags (bounded), then a kWaitOnly launch finds them set.
enum SyncMode : int32_t { kDevice = 0, kPublishOnly = 1, kWaitOnly = 2 };

// ---- templated arguments ---------------------------------------------------------------------

// What the send kernel puts into a message's payload.
enum class SendPayload : int32_t {
    kBF16,          // bf16 rows moved as is
    kFP8Copy,       // pre-quantized fp8 rows and their scale words moved as is
    kFP8F32G128,    // bf16 quantized in the kernel, one fp32 scale per 128 channels
    kFP8UE8M0G128,  // ... one power-of-two (UE8M0 byte) scale per 128 channels
    kFP8UE8M0G32,   // ... per 32 channels (MXFP8)
};

constexpr bool payload_is_fp8(SendPayload p) { return p != SendPayload::kBF16; }
constexpr bool payload_quantizes(SendPayload p) { return p != SendPayload::kBF16 && p != SendPayload::kFP8Copy; }
constexpr bool payload_f32_scales(SendPayload p) { return p == SendPayload::kFP8F32G128; }
constexpr int payload_scale_group(SendPayload p) { return p == SendPayload::kFP8UE8M0G32 ? 32 : 128; }

using SendPayloadChoice = Choice<SendPayload, SendPayload::kBF16, SendPayload::kFP8Copy, SendPayload::kFP8F32G128,
                                 SendPayload::kFP8UE8M0G128, SendPayload::kFP8UE8M0G32>;

// ---- parameters ------------------------------------------------------------------------------

// Element strides of recv_scales: masked [E_local][R*C][cols] uses all three, contiguous [rows][cols]
// uses row and column (row-major or MN-major alike).
struct ScaleStrides {
    int64_t expert, row, column;
};

template <class Team>
struct CallParams {
    Team team;  // this rank and its peers' windows
    Shape shape;
    RegionLayout region;  // offsets inside every rank's window
    Workspace ws;         // this rank's scratch
    HostRecord* record;   // host-mapped (device pointer)
    uint64_t timeout_ns;  // bound on every wait for a peer
    int32_t sync_mode;    // SyncMode
    int32_t num_tokens;   // T of this rank
    int32_t step;         // round_kernel: the step of the call's rounds; direct kernels: DirectStep
};

template <class Team>
struct DispatchParams : CallParams<Team> {
    // this rank's inputs (row strides in elements)
    const void* x;  // [T, H] bf16, or fp8 when pre-quantized
    int64_t x_row_stride;
    bool x_aligned;            // rows start 16-byte aligned: vector loads allowed
    const uint32_t* x_scales;  // pre-quantized fp8: [T, scale_columns] words
    int64_t x_scales_row_stride;
    const void* topk_idx;  // [T, K] int32 or int64 (templated: kIdx64)
    int64_t topk_idx_row_stride;
    const float* topk_weights;  // [T, K] or null
    int64_t topk_weights_row_stride;
    // payload (templated: SendPayload)
    int scale_columns;  // stored scale words per row (0 for bf16)
    // layout (templated: kContiguous)
    bool host_sync, zero_padding;
    int expert_alignment;
    int64_t num_rows_out;    // rows of the contiguous outputs (M with host sync, M_cap in graph mode)
    int32_t round;           // staged: the round of send / expand (messages j with j / S == round)
    bool scales_mn_dynamic;  // direct: contiguous MN-major buffer-owned scales with host sync (DirectOutputs)
    // outputs
    uint8_t* recv_x;
    uint32_t* recv_scales;  // fp32 bits or packed UE8M0 words: 4 bytes either way
    ScaleStrides recv_scale_strides;
    float* recv_weights;
    int32_t* recv_src;
    int32_t* m_indices;  // contiguous layout only
};

template <class Team>
struct CombineParams : CallParams<Team> {
    const uint16_t* y;     // [rows of the dispatch, H] bf16 (templated: kWeighted)
    const uint16_t* bias;  // [T, H] bf16 or null (templated: kBias)
    int64_t bias_row_stride;
    uint16_t* out;  // [T, H] bf16
    int64_t out_row_stride;
    bool weighted;  // direct: route weights (else 1.0f)
};

}  // namespace elasticep::kernels
