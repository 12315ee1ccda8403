// The backend-independent front end: argument validation, the handle state machine, the
// broken-buffer rule, and the buffer registry.
#include <atomic>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unistd.h>

#include "core/backend.hpp"
#include "core/check.hpp"
#include "core/layout.hpp"
#include "core/outputs.hpp"
#include "elasticep/buffer.hpp"
#include "elasticep/version.hpp"

namespace elasticep {

const char* build_backends() { return detail::cuda_backend_compiled() ? "cpu,cuda" : "cpu"; }

// ---------------------------------------------------------------------------------------------
// Handle

Handle::Handle() = default;
Handle::~Handle() = default;
Handle::Handle(Handle&&) noexcept = default;
Handle& Handle::operator=(Handle&&) noexcept = default;
Handle::Handle(std::shared_ptr<detail::HandleState> state) : state_(std::move(state)) {}
bool Handle::valid() const { return state_ && !state_->consumed; }
int Handle::num_sms() const { return state_ ? state_->num_sms : 0; }
Layout Handle::layout() const { return state_ ? state_->layout : Layout::kExpertContiguous; }

namespace detail {
namespace {

std::atomic<uint64_t> g_next_buffer_id{1};

void check_device(const TensorRef& t, Device device, const char* name) {
    ELASTICEP_CHECK_ARG(t.device == device, name, " is on ", device_name(t.device), " but this buffer's backend works on ",
                        device_name(device), "; move the tensor there");
    ELASTICEP_CHECK_ARG(t.data != nullptr || t.numel() == 0, name, " has a null data pointer");
}

// Rows may be strided (a slice of a bigger tensor); elements inside a row must be contiguous.
// A tensor with no rows has no elements to address, so its strides say nothing (numpy reports
// (0, 0) for some empty arrays) and are not checked: a rank with 0 tokens is legal.
void check_matrix(const TensorRef& t, const char* name, int64_t rows, int64_t cols, Device device) {
    ELASTICEP_CHECK_ARG(t.ndim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " is ", t.describe(),
                        " but must be [", rows, ", ", cols, "]");
    check_device(t, device, name);
    if (rows == 0) return;
    ELASTICEP_CHECK_ARG(cols <= 1 || t.stride(1) == 1, name, " is ", t.describe(),
                        ": its last dimension must be contiguous (stride 1); call .contiguous() first");
    ELASTICEP_CHECK_ARG(rows <= 1 || t.stride(0) >= cols, name, " is ", t.describe(),
                        ": its row stride must be at least its row length");
}

}  // namespace

class BufferImpl {
   public:
    BufferImpl(std::shared_ptr<Group> group, const BufferConfig& config, BackendKind backend)
        : group_(std::move(group)), config_(config), backend_kind_(backend) {
        rank_ = group_->rank();
        num_ranks_ = group_->size();
    }

    static std::shared_ptr<Buffer> create(std::shared_ptr<Group> group, const BufferConfig& config,
                                          BackendKind requested) {
        ELASTICEP_CHECK_ARG(group != nullptr, "Buffer::create: group is null");
        config.validate(group->size());
        const BackendKind kind = Buffer::resolve_backend(requested);
        // Every rank must agree on the config and backend, or the symmetric layout is wrong.
        const std::string key = config.group_key() + "/" + backend_name(kind);
        const uint64_t h = std::hash<std::string>{}(key);
        const auto hashes = group->all_gather_value(h);
        for (int r = 0; r < group->size(); ++r)
            ELASTICEP_CHECK_ARG(hashes[static_cast<size_t>(r)] == h, "Buffer::create: rank ", r,
                                " passed a different config or backend than rank ", group->rank(), " (",
                                config.describe(), ", backend ", backend_name(kind),
                                "); every rank must build the same buffer");
        auto impl = std::make_unique<BufferImpl>(group, config, kind);
        impl->buffer_id_ = g_next_buffer_id.fetch_add(1);
        BackendContext ctx{group, config, impl->rank_, impl->num_ranks_, impl->buffer_id_};
        // Build locally, then agree that every rank succeeded before anyone publishes. A rank whose
        // backend failed raises the backend's own code (Unsupported, Cuda, InvalidArgument, ...);
        // ranks that succeeded raise Internal naming the ranks that failed.
        std::string failure;
        ErrorCode failure_code = ErrorCode::kInternal;
        try {
            impl->backend_ = make_backend(kind, config.topology, ctx);
        } catch (const Error& e) {
            failure = e.message();
            failure_code = e.code();
        } catch (const std::bad_alloc&) {
            failure = "out of host memory building the " + std::string(backend_name(kind)) + " backend (" +
                      config.describe() + "); lower max_tokens_per_rank or hidden";
        } catch (const std::exception& e) {
            failure = e.what();
        }
        const auto ok = group->all_gather_value(static_cast<int>(failure.empty()));
        if (!failure.empty()) throw Error(failure_code, "Buffer::create failed on this rank: " + failure);
        std::string failed_ranks;
        for (int r = 0; r < group->size(); ++r)
            if (!ok[static_cast<size_t>(r)]) failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
        ELASTICEP_CHECK(failed_ranks.empty(), ErrorCode::kInternal, "Buffer::create failed on rank ", failed_ranks,
                        " (see the error raised there); nothing was published");
        return std::shared_ptr<Buffer>(new Buffer(std::move(impl)));
    }

    void ensure_usable() const {
        ELASTICEP_CHECK(broken_.empty(), ErrorCode::kTimeout, "this buffer is unusable after an earlier failure (",
                        broken_, "); destroy it and build a new one (Buffer::create or get_buffer)");
    }

    template <class Fn>
    auto guarded(Fn&& fn) {
        try {
            return fn();
        } catch (const Error& e) {
            if (e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kCuda || e.code() == ErrorCode::kInternal)
                broken_ = e.message();
            throw;
        }
    }

    DispatchRequest validate_dispatch(const DispatchArgs& a) const {
        const BufferConfig& c = config_;
        const Device dev = backend_->device();
        DispatchRequest req;
        req.args = &a;
        ELASTICEP_CHECK_ARG(a.x.ndim() == 2, "dispatch: x is ", a.x.describe(), " but must be 2-D [num_tokens, hidden]");
        const int64_t t = a.x.size(0);
        req.num_tokens = t;
        ELASTICEP_CHECK(t <= c.max_tokens_per_rank, ErrorCode::kCapacityExceeded, "dispatch: rank ", rank_, " has ", t,
                        " tokens but the buffer was built with max_tokens_per_rank=", c.max_tokens_per_rank,
                        "; raise max_tokens_per_rank to at least ", t,
                        ", or lower the serving engine's chunked prefill size / CUDA-graph batch size");
        check_matrix(a.x, "dispatch: x", t, c.hidden, dev);
        if (a.x.dtype == DType::kFloat8E4M3) {
            ELASTICEP_CHECK_ARG(c.payload == Payload::kFP8,
                                "dispatch: x is fp8 but the buffer's payload is bf16; pass bf16 x or build the "
                                "buffer with payload=fp8");
            ELASTICEP_CHECK_ARG(a.x_scales.has_value(), "dispatch: x is pre-quantized fp8, so x_scales [", t, ", ",
                                scale_columns(c.scale_format, c.hidden), "] (", scale_format_name(c.scale_format),
                                ") is required");
            const DType sdt = c.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32;
            ELASTICEP_CHECK_ARG(a.x_scales->dtype == sdt, "dispatch: x_scales is ", a.x_scales->describe(),
                                " but scale format ", scale_format_name(c.scale_format), " needs ", dtype_name(sdt));
            check_matrix(*a.x_scales, "dispatch: x_scales", t, scale_columns(c.scale_format, c.hidden), dev);
            req.prequantized = true;
        } else {
            ELASTICEP_CHECK_ARG(a.x.dtype == DType::kBFloat16, "dispatch: x is ", a.x.describe(),
                                " but must be bf16 (or fp8 with x_scales when the payload is fp8)");
            ELASTICEP_CHECK_ARG(!a.x_scales.has_value(), "dispatch: x_scales given but x is bf16; scales go with "
                                "pre-quantized fp8 x only");
            req.quantize = c.payload == Payload::kFP8;
        }
        ELASTICEP_CHECK_ARG(a.topk_idx.dtype == DType::kInt32 || a.topk_idx.dtype == DType::kInt64,
                            "dispatch: topk_idx is ", a.topk_idx.describe(), " but must be int32 or int64");
        check_matrix(a.topk_idx, "dispatch: topk_idx", t, c.num_topk, dev);
        if (a.topk_weights) {
            ELASTICEP_CHECK_ARG(a.topk_weights->dtype == DType::kFloat32, "dispatch: topk_weights is ",
                                a.topk_weights->describe(), " but must be fp32");
            check_matrix(*a.topk_weights, "dispatch: topk_weights", t, c.num_topk, dev);
            req.has_weights = true;
        }
        const int e_local = c.num_local_experts(num_ranks_);
        if (a.layout == Layout::kExpertContiguous) {
            ELASTICEP_CHECK_ARG(a.expert_alignment >= 1 && a.expert_alignment <= (1 << 16), "dispatch: expert_alignment=",
                                a.expert_alignment, " must be in [1, 65536]");
            req.rows_cap = contiguous_rows_cap(num_ranks_, c.max_tokens_per_rank, c.num_topk, e_local, a.expert_alignment);
            ELASTICEP_CHECK_ARG(req.rows_cap < (int64_t{1} << 31), "dispatch: worst-case rows ", req.rows_cap,
                                " overflow int32 offsets; lower max_tokens_per_rank or expert_alignment");
        } else {
            req.rows_cap = int64_t{num_ranks_} * c.max_tokens_per_rank;
        }
        ELASTICEP_CHECK_ARG(!a.scales_mn_major || c.payload == Payload::kFP8,
                            "dispatch: scales_mn_major needs an fp8 payload (bf16 rows have no scales)");
        const auto specs = dispatch_output_specs(c, num_ranks_, a.layout, req.rows_cap, a.scales_mn_major);
        const DispatchOutputs& o = a.outputs;
        if (o.recv_x) check_output(*o.recv_x, specs.recv_x, dev, "recv_x");
        if (o.recv_scales) {
            ELASTICEP_CHECK_ARG(specs.recv_scales.has_value(), "caller-provided recv_scales given for a bf16 payload");
            check_output(*o.recv_scales, *specs.recv_scales, dev, "recv_scales");
        }
        if (o.recv_weights) check_output(*o.recv_weights, specs.recv_weights, dev, "recv_weights");
        if (o.recv_src) check_output(*o.recv_src, specs.recv_src, dev, "recv_src");
        if (o.m_indices) {
            ELASTICEP_CHECK_ARG(specs.m_indices.has_value(), "caller-provided m_indices given for the masked layout");
            check_output(*o.m_indices, *specs.m_indices, dev, "m_indices");
        }
        return req;
    }

    DispatchResult dispatch(const DispatchArgs& args) {
        ensure_usable();
        ELASTICEP_CHECK_ARG(!outstanding_ || outstanding_->consumed,
                            "dispatch: the handle of this buffer's previous dispatch was never combined; every "
                            "dispatch must be followed by combine(handle) before the next dispatch");
        const DispatchRequest req = validate_dispatch(args);
        auto state = std::make_shared<HandleState>();
        state->buffer_id = buffer_id_;
        state->layout = args.layout;
        state->has_weights = req.has_weights;
        state->num_tokens = req.num_tokens;
        DispatchResult result;
        result.layout = args.layout;
        guarded([&] {
            backend_->dispatch(req, *state, result);
            return 0;
        });
        state->y_shape = result.recv_x.shape;
        outstanding_ = state;
        result.handle = Handle(state);
        return result;
    }

    CombineResult combine(Handle&& handle, const CombineArgs& args) {
        std::shared_ptr<HandleState> st = std::move(handle.state_);
        ELASTICEP_CHECK_ARG(st != nullptr, "combine: the handle is empty (moved from, or not made by dispatch)");
        ELASTICEP_CHECK_ARG(!st->consumed, "combine: the handle was already consumed by an earlier combine; each "
                            "dispatch's handle is single-use");
        // Released whatever happens below, also when it belongs to another buffer: that buffer's
        // next dispatch must not be blocked forever by a handle its caller can no longer hold.
        st->consumed = true;
        ELASTICEP_CHECK_ARG(st->buffer_id == buffer_id_, "combine: the handle belongs to another buffer (it was "
                            "released; that buffer can dispatch again)");
        ELASTICEP_INTERNAL(outstanding_ == st, "combine: handle is not this buffer's outstanding one");
        ensure_usable();
        const Device dev = backend_->device();
        ELASTICEP_CHECK_ARG(args.y.dtype == DType::kBFloat16, "combine: y is ", args.y.describe(), " but must be bf16");
        ELASTICEP_CHECK_ARG(args.y.shape == st->y_shape, "combine: y is ", args.y.describe(), " but must have the shape of dispatch's recv_x ",
                            TensorRef::contiguous(nullptr, DType::kBFloat16, st->y_shape, dev).describe());
        check_device(args.y, dev, "combine: y");
        // (an empty y, a rank that received no rows, may carry any strides)
        ELASTICEP_CHECK_ARG(args.y.numel() == 0 || args.y.is_contiguous(), "combine: y is ", args.y.describe(),
                            " but must be contiguous");
        ELASTICEP_CHECK_ARG(!args.weighted || st->has_weights,
                            "combine: weighted=true but the dispatch had no topk_weights; pass topk_weights to "
                            "dispatch or combine with weighted=false");
        const int64_t t = st->num_tokens;
        if (args.bias) {
            ELASTICEP_CHECK_ARG(args.bias->dtype == DType::kBFloat16, "combine: bias is ", args.bias->describe(),
                                " but must be bf16");
            check_matrix(*args.bias, "combine: bias", t, config_.hidden, dev);
        }
        if (args.out) {
            ELASTICEP_CHECK_ARG(args.out->dtype == DType::kBFloat16, "combine: out is ", args.out->describe(),
                                " but must be bf16");
            check_matrix(*args.out, "combine: out", t, config_.hidden, dev);
        }
        CombineResult r;
        r.out = guarded([&] { return backend_->combine(*st, args); });
        return r;
    }

    std::shared_ptr<Group> group_;
    BufferConfig config_;
    BackendKind backend_kind_;
    int rank_ = 0;
    int num_ranks_ = 1;
    uint64_t buffer_id_ = 0;
    std::string broken_;
    std::shared_ptr<HandleState> outstanding_;
    std::unique_ptr<BackendBuffer> backend_;
};

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Buffer

Buffer::Buffer(std::unique_ptr<detail::BufferImpl> impl) : impl_(std::move(impl)) {}
Buffer::~Buffer() = default;

std::shared_ptr<Buffer> Buffer::create(std::shared_ptr<Group> group, const BufferConfig& config, BackendKind backend) {
    return detail::BufferImpl::create(std::move(group), config, backend);
}

bool Buffer::backend_available(BackendKind backend) {
    switch (backend) {
        case BackendKind::kAuto:
        case BackendKind::kCPU: return true;
        case BackendKind::kCUDA: return detail::cuda_backend_compiled() && detail::cuda_backend_available();
    }
    return false;
}

BackendKind Buffer::resolve_backend(BackendKind backend) {
    if (backend == BackendKind::kAuto) return backend_available(BackendKind::kCUDA) ? BackendKind::kCUDA : BackendKind::kCPU;
    if (backend == BackendKind::kCUDA) {
        ELASTICEP_CHECK(detail::cuda_backend_compiled(), ErrorCode::kUnsupported,
                        "the CUDA backend is not compiled into this build (backends: ", build_backends(),
                        "); rebuild with nvcc available, or use backend=cpu");
        ELASTICEP_CHECK(detail::cuda_backend_available(), ErrorCode::kUnsupported,
                        "backend=cuda asked for but no usable CUDA device was found; use backend=cpu or auto");
    }
    return backend;
}

size_t Buffer::reservation_bytes(const BufferConfig& config, int num_ranks, BackendKind backend) {
    config.validate(num_ranks);
    const BackendKind kind = backend == BackendKind::kAuto ? resolve_backend(backend) : backend;
    if (kind == BackendKind::kCUDA)
        ELASTICEP_CHECK(detail::cuda_backend_compiled(), ErrorCode::kUnsupported, "the CUDA backend is not compiled in");
    return detail::backend_reservation_bytes(kind, config.topology, config, num_ranks);
}

DispatchResult Buffer::dispatch(const DispatchArgs& args) { return impl_->dispatch(args); }

CombineResult Buffer::combine(Handle&& handle, const CombineArgs& args) {
    return impl_->combine(std::move(handle), args);
}

void Buffer::check() {
    impl_->ensure_usable();
    impl_->guarded([&] {
        impl_->backend_->check();
        return 0;
    });
}

std::vector<int64_t> Buffer::expert_load() const { return impl_->backend_->expert_load(); }
void Buffer::reset_expert_load() { impl_->backend_->reset_expert_load(); }
const BufferConfig& Buffer::config() const { return impl_->config_; }
BackendKind Buffer::backend() const { return impl_->backend_kind_; }
int Buffer::rank() const { return impl_->rank_; }
int Buffer::num_ranks() const { return impl_->num_ranks_; }
int Buffer::num_local_experts() const { return impl_->config_.num_local_experts(impl_->num_ranks_); }
std::shared_ptr<Group> Buffer::group() const { return impl_->group_; }

int64_t Buffer::max_contiguous_rows(int expert_alignment) const {
    ELASTICEP_CHECK_ARG(expert_alignment >= 1, "expert_alignment=", expert_alignment, " must be >= 1");
    return contiguous_rows_cap(num_ranks(), config().max_tokens_per_rank, config().num_topk, num_local_experts(),
                               expert_alignment);
}

// ---------------------------------------------------------------------------------------------
// Registry

namespace {
struct RegistryEntry {
    std::string key;
    std::shared_ptr<Buffer> buffer;
};
std::mutex g_registry_mu;
std::map<std::string, RegistryEntry> g_registry;  // group identity + rank -> entry
}  // namespace

std::shared_ptr<Buffer> get_buffer(std::shared_ptr<Group> group, const BufferConfig& config, BackendKind backend) {
    ELASTICEP_CHECK_ARG(group != nullptr, "get_buffer: group is null");
    const std::string slot = group->identity() + "#" + std::to_string(group->rank());
    const std::string key = config.key() + "/" + backend_name(Buffer::resolve_backend(backend));
    {
        std::lock_guard<std::mutex> lock(g_registry_mu);
        auto it = g_registry.find(slot);
        if (it != g_registry.end() && it->second.key == key) return it->second.buffer;
    }
    // Collective rebuild; the old buffer is replaced only once the new one exists everywhere.
    auto fresh = Buffer::create(group, config, backend);
    std::lock_guard<std::mutex> lock(g_registry_mu);
    g_registry[slot] = RegistryEntry{key, fresh};
    return fresh;
}

void reset_buffers() {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    g_registry.clear();
}

}  // namespace elasticep
