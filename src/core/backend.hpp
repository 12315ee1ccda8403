// The contract between the backend-independent front end (src/core/buffer.cpp) and a backend.
// The front end validates every argument against the config, enforces the handle state machine
// and the broken-buffer rule; a backend only moves data and computes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/check.hpp"
#include "elasticep/buffer.hpp"

namespace elasticep::detail {

namespace testing {
struct OutgoingDispatch;  // core/testing.hpp
using DispatchForger = std::function<void(OutgoingDispatch&)>;
}  // namespace testing

struct HandleState {
    uint64_t buffer_id = 0;
    std::atomic<bool> consumed{false};  // set once, by the first combine that takes the handle
    Layout layout = Layout::kExpertContiguous;
    int num_sms = 0;
    bool has_weights = false;
    int64_t num_tokens = 0;              // T of this rank's dispatch (rows of the combine output)
    std::vector<int64_t> y_shape;        // shape combine's y must have
    std::shared_ptr<void> backend_data;  // what the backend keeps for combine
};

// A dispatch call after validation, with everything derived once.
struct DispatchRequest {
    const DispatchArgs* args = nullptr;
    int64_t num_tokens = 0;     // T
    bool prequantized = false;  // x arrives as fp8 (+ x_scales): moved as is
    bool quantize = false;      // bf16 x with fp8 payload: quantized inside dispatch
    bool has_weights = false;
    int64_t rows_cap = 0;  // contiguous: M_cap for this alignment; masked: R*C
};

class BackendBuffer {
 public:
    virtual ~BackendBuffer() = default;
    // Fills the result's tensors (not its handle); stores combine state in `handle`.
    virtual void dispatch(const DispatchRequest& req, HandleState& handle, DispatchResult& result) = 0;
    virtual TensorRef combine(HandleState& handle, const CombineArgs& args) = 0;
    // Raises (and clears) a sticky fault recorded by an earlier call.
    virtual void check() = 0;
    virtual Device device() const = 0;
    virtual size_t reserved_bytes() const = 0;
    // Cumulative rows received per local expert (kept by the backend so graph mode needs no sync).
    virtual std::vector<int64_t> expert_load() = 0;
    virtual void reset_expert_load() = 0;
    // Buffer::scaleout(): the network transport of a hybrid buffer with several nodes, else "none".
    virtual std::string scaleout() const { return "none"; }
    // Buffer::kernel_path(): the implementation a call runs ("reference" for the CPU backend).
    virtual std::string kernel_path() const { return "reference"; }
    // Test-only fault injection (core/testing.hpp): lets a test play a peer that breaks the protocol.
    virtual void set_dispatch_forger(testing::DispatchForger) {
        raise(ErrorCode::kUnsupported,
              "dispatch forging (a test hook) is implemented by the CPU and CUDA backends only");
    }
};

struct BackendContext {
    std::shared_ptr<Group> group;
    BufferConfig config;
    int rank = 0;
    int num_ranks = 1;
    uint64_t buffer_id = 0;
};

// A backend for (kind, topology) from the table in src/core/backends.cpp (kind already resolved:
// not kAuto); Unsupported for a pair no backend implements.
std::unique_ptr<BackendBuffer> make_backend(BackendKind kind, Topology topology, const BackendContext& ctx);
size_t backend_reservation_bytes(BackendKind kind, Topology topology, const BufferConfig& config, int num_ranks);

// The handle rule for a layer that rejects a combine before Buffer::combine sees it (the Python
// bindings converting their arguments): consumes `handle` exactly as a failed combine does.
void consume_handle(Handle& handle);

// Buffer::create's agreement, entered by a rank that rejected its arguments before it could build a
// BufferConfig (the Python bindings' conversions): every other rank's create raises "rank r rejected
// its config: <message>" at once instead of waiting for this rank. Rethrows `error` here.
[[noreturn]] void reject_create(const std::shared_ptr<Group>& group, const Error& error);

std::unique_ptr<BackendBuffer> make_cpu_backend(const BackendContext& ctx);
size_t cpu_reservation_bytes(const BufferConfig& config, int num_ranks);

// Implemented in src/backends/cuda when the CUDA backend is compiled in.
bool cuda_backend_compiled();
bool cuda_backend_available();
std::unique_ptr<BackendBuffer> make_cuda_backend(const BackendContext& ctx);
size_t cuda_reservation_bytes(const BufferConfig& config, int num_ranks);
// The hybrid topology's launch sequence (src/backends/cuda/hybrid_backend.cu).
std::unique_ptr<BackendBuffer> make_cuda_hybrid_backend(const BackendContext& ctx);
size_t cuda_hybrid_reservation_bytes(const BufferConfig& config, int num_ranks);

}  // namespace elasticep::detail
