// Dispatch and combine outputs of a CUDA buffer (SEMANTICS.md, "Outputs"): caller-provided tensors,
// checked for the 16-byte alignment the kernels store with, or buffer-owned device memory sized for
// the layout's worst case and grown stream-ordered at the first call that needs more (that call
// cannot be captured in a graph). Pointers stay the same while the sizes do, so graphs replay.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "elasticep/buffer.hpp"
#include "transport/device_pool.hpp"

namespace elasticep::detail::cuda {

struct DispatchTargets {
    uint8_t* recv_x = nullptr;
    uint32_t* recv_scales = nullptr;  // fp8 only
    float* recv_weights = nullptr;
    int32_t* recv_src = nullptr;
    int32_t* m_indices = nullptr;  // contiguous only
};

// The per-local-expert route counts a buffer keeps on the device (ws.expert_load): read back, and
// zeroed on `stream`; both return with the work done. The caller has synchronised its last call.
std::vector<int64_t> read_expert_load(const int64_t* counts, int num_local_experts);
void clear_expert_load(int64_t* counts, int num_local_experts, cudaStream_t stream);

class DeviceOutputs {
 public:
    DeviceOutputs(const BufferConfig& config, int num_ranks, int rank, int device, cudaStream_t stream);
    ~DeviceOutputs();
    DeviceOutputs(const DeviceOutputs&) = delete;
    DeviceOutputs& operator=(const DeviceOutputs&) = delete;

    // Where this call's kernels write (allocating buffer-owned storage on `stream` when it must grow).
    DispatchTargets dispatch_targets(const DispatchArgs& args, int64_t rows_cap, bool capturing, cudaStream_t stream);
    // The result's tensors over `targets`: `rows` rows for the contiguous layout; caller-provided
    // tensors keep the strides of their worst-case (rows_cap) shape.
    void bind_dispatch(const DispatchArgs& args, const DispatchTargets& targets, int64_t rows_cap, int64_t rows,
                       DispatchResult& result) const;
    // The caller's out, or the buffer-owned [T, H] combine output.
    TensorRef combine_out(const CombineArgs& args, int64_t num_tokens) const;

 private:
    BufferConfig config_;
    int num_ranks_, rank_, device_;
    cudaStream_t stream_;  // frees are ordered on it
    transport::GrowingBlock x_, scales_, weights_, src_, m_indices_;
    void* combine_out_ = nullptr;
    std::vector<void*> graveyard_;  // replaced blocks: a captured graph may still reference them
};

}  // namespace elasticep::detail::cuda
