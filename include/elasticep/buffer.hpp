// Buffer: the dispatch/combine engine of one rank. See docs/SEMANTICS.md for what it computes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "elasticep/config.hpp"
#include "elasticep/group.hpp"
#include "elasticep/tensor.hpp"

namespace elasticep {

namespace detail {
struct HandleState;
class BufferImpl;
}  // namespace detail

// What combine needs from the dispatch that made it. Single-use: combine consumes it.
// Move-only; a moved-from or consumed handle is invalid.
class Handle {
 public:
    Handle();
    ~Handle();
    Handle(Handle&&) noexcept;
    Handle& operator=(Handle&&) noexcept;
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;

    bool valid() const;   // made by a dispatch and not yet consumed
    int num_sms() const;  // the SM count dispatch used; combine reuses it
    Layout layout() const;

 private:
    friend class detail::BufferImpl;
    explicit Handle(std::shared_ptr<detail::HandleState> state);
    std::shared_ptr<detail::HandleState> state_;
};

// Caller-provided dispatch outputs. Each present tensor must have exactly the fixed worst-case
// shape of its layout (see docs/SEMANTICS.md): contiguous rows = M_cap, masked [E_local, R*C, ...].
// Absent ones are buffer-owned.
struct DispatchOutputs {
    std::optional<TensorRef> recv_x;
    std::optional<TensorRef> recv_scales;
    std::optional<TensorRef> recv_weights;
    std::optional<TensorRef> recv_src;
    std::optional<TensorRef> m_indices;
};

struct DispatchArgs {
    TensorRef x;                            // [T, H] bf16, or fp8 when pre-quantized
    std::optional<TensorRef> x_scales;      // pre-quantized fp8 only: [T, scale_columns] row-major
    TensorRef topk_idx;                     // [T, K] int32 or int64, values in [-1, E)
    std::optional<TensorRef> topk_weights;  // [T, K] fp32; required for weighted combine
    Layout layout = Layout::kExpertContiguous;
    int expert_alignment = 1;      // contiguous layout: segment start alignment A >= 1
    bool host_sync = true;         // contiguous: false = graph mode (fixed M_cap rows, M on device)
    bool zero_padding = false;     // zero padding rows' data and scales
    bool scales_mn_major = false;  // fp8: store recv scales column-major, row stride rounded to 4
    DispatchOutputs outputs;       // optional caller-provided outputs
    void* stream = nullptr;        // cudaStream_t for the CUDA backend; ignored on CPU
};

// Buffer-owned tensors hold their values until the next dispatch on the same buffer, which rewrites
// the same memory (pointers are stable per layout and alignment, so a captured CUDA graph replays);
// the memory itself is never freed or moved while the buffer lives (docs/SEMANTICS.md).
struct DispatchResult {
    Layout layout = Layout::kExpertContiguous;
    TensorRef recv_x;                      // contiguous [M or M_cap, H]; masked [E_local, R*C, H]
    std::optional<TensorRef> recv_scales;  // fp8 only
    TensorRef recv_weights;                // fp32, [M] or [E_local, R*C]
    TensorRef recv_src;                    // int32 s*C+t, [M] or [E_local, R*C]; -1 on padding
    TensorRef m_indices;                   // contiguous only: int32 [M], -1 on padding
    TensorRef counts;                      // int32 [E_local] real rows per local expert
    TensorRef offsets;                     // contiguous only: int32 [E_local + 1]
    TensorRef masked_m;                    // masked only: int32 [E_local] (same memory as counts)
    int64_t num_rows = -1;                 // contiguous with host_sync: M; otherwise -1
    Handle handle;
};

struct CombineArgs {
    TensorRef y;                    // expert outputs bf16, in the dispatch's row positions
    bool weighted = true;           // multiply by the route weights the handle carries
    std::optional<TensorRef> bias;  // [T, H] bf16, added once per token
    std::optional<TensorRef> out;   // [T, H] bf16 caller-provided; else buffer-owned
    void* stream = nullptr;
};

struct CombineResult {
    TensorRef out;  // [T, H] bf16 (buffer-owned: valid until the next combine)
};

// One rank's endpoint. It takes one call at a time: dispatch, combine, check, expert_load or
// reset_expert_load entered while another runs on the same buffer raises InvalidArgument naming
// the call in progress. Different buffers may be used from different threads at once.
class Buffer {
 public:
    // Collective over `group`: every rank calls it with the same config. The ranks first agree that
    // every rank's arguments are valid (a rank that rejects its own makes every rank raise its
    // reason at once), then build, then agree that every rank built its part before any returns it.
    static std::shared_ptr<Buffer> create(std::shared_ptr<Group> group, const BufferConfig& config,
                                          BackendKind backend = BackendKind::kAuto);
    // Bytes one rank reserves when built: its receive slots, combine slots and combine output.
    // Layout outputs are allocated on first use (see `elasticep info` for their sizes).
    static size_t reservation_bytes(const BufferConfig& config, int num_ranks, BackendKind backend);
    // Whether a backend is compiled in and usable here (CUDA: a GPU is present).
    static bool backend_available(BackendKind backend);
    // kAuto resolved: CUDA when available, else CPU.
    static BackendKind resolve_backend(BackendKind backend);

    ~Buffer();
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;

    // Collective. Errors on this rank's own input are raised before any communication.
    DispatchResult dispatch(const DispatchArgs& args);
    // Collective. Consumes the handle, also on failure (whatever rejected the call).
    CombineResult combine(Handle&& handle, const CombineArgs& args);
    // Raises a sticky device fault (invalid routes in graph mode) or a past timeout, if any.
    void check();

    // Cumulative rows received per local expert since creation or the last reset (int64 [E_local]).
    std::vector<int64_t> expert_load() const;
    void reset_expert_load();

    const BufferConfig& config() const;
    BackendKind backend() const;
    // The network hop this buffer uses: "emulated", "nccl" or "gin" for topology=hybrid with several
    // nodes (what scaleout=auto chose), "none" otherwise.
    std::string scaleout() const;
    // The implementation this buffer's calls run, chosen when it was built (the same on every rank):
    // "reference" (CPU backend); CUDA: "direct" (every rank a thread of this process on this GPU:
    // rows written once into the receivers' outputs), "staged" (every other placement, or
    // ELASTICEP_KERNEL_VARIANT=staged: messages through the receivers' windows), "hybrid"
    // (topology=hybrid). docs/PERFORMANCE.md, "Two paths".
    std::string kernel_path() const;
    int rank() const;
    int num_ranks() const;
    int num_local_experts() const;
    // Worst-case rows of the contiguous layout: R*C*min(K, E_local) + E_local*(A-1).
    int64_t max_contiguous_rows(int expert_alignment) const;
    std::shared_ptr<Group> group() const;

 private:
    friend class detail::BufferImpl;
    explicit Buffer(std::unique_ptr<detail::BufferImpl> impl);
    std::unique_ptr<detail::BufferImpl> impl_;
};

// The registry: one buffer per (group identity, config, backend), rebuilt collectively when the
// key changes. Collective like Buffer::create.
std::shared_ptr<Buffer> get_buffer(std::shared_ptr<Group> group, const BufferConfig& config,
                                   BackendKind backend = BackendKind::kAuto);
// Drops every cached buffer of this process (local; buffers still referenced elsewhere live on).
void reset_buffers();

}  // namespace elasticep
