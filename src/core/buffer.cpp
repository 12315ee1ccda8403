// The backend-independent front end: argument validation, the handle state machine, the
// broken-buffer rule, and the buffer registry.
#include "elasticep/buffer.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "core/backend.hpp"
#include "core/check.hpp"
#include "core/layout.hpp"
#include "core/outputs.hpp"
#include "core/testing.hpp"
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
    ELASTICEP_CHECK_ARG(t.device == device, name, " is on ", device_name(t.device),
                        " but this buffer's backend works on ", device_name(device), "; move the tensor there");
    ELASTICEP_CHECK_ARG(t.data != nullptr || t.numel() == 0, name, " has a null data pointer");
}

// Every backend reads and writes tensors as typed values (the CUDA kernels load int32/int64 ids,
// fp32 weights and scales as such): a data pointer off its element size is a misaligned access,
// a fault that kills a CUDA context. Strides are in elements, so rows stay aligned once the
// pointer is.
void check_aligned(const TensorRef& t, const char* name) {
    if (t.numel() == 0) return;
    const size_t elem = dtype_size(t.dtype);
    const auto addr = reinterpret_cast<uintptr_t>(t.data);
    ELASTICEP_CHECK_ARG(elem != 0 && addr % elem == 0, name, " (", t.describe(), ") has data pointer ", t.data,
                        ", which is not aligned to its ", elem, "-byte elements (", addr % (elem ? elem : 1),
                        " bytes past a multiple of ", elem,
                        "): it is an odd-offset view (e.g. np.frombuffer(..., offset=1) or a byte-offset slice); "
                        "copy it into a freshly allocated tensor");
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
    // The last element's byte offset must be representable: no stride may make address arithmetic wrap.
    int64_t span = 0;
    const bool wraps = rows > 1 && (__builtin_mul_overflow(rows - 1, t.stride(0), &span) ||
                                    __builtin_add_overflow(span, cols, &span) ||
                                    span > (int64_t{1} << 56) / static_cast<int64_t>(dtype_size(t.dtype) | 1));
    ELASTICEP_CHECK_ARG(!wraps, name, " is ", t.describe(), ": its row stride ", t.stride(0),
                        " spans more memory than any tensor can; pass a view of real memory");
    check_aligned(t, name);
}

// ---- Buffer::create's agreement ---------------------------------------------------------------

constexpr size_t kWireMessage = 480;

void put_message(char (&dst)[kWireMessage], const std::string& s) {
    std::memset(dst, 0, kWireMessage);
    const size_t n = std::min(s.size(), kWireMessage - 1);
    std::memcpy(dst, s.data(), n);
    if (n < s.size()) std::memcpy(dst + kWireMessage - 5, " ...", 4);
}

std::string get_message(const char (&src)[kWireMessage]) { return std::string(src, strnlen(src, kWireMessage)); }

// The fields every rank must agree on (BufferConfig::group_key's fields, and the backend).
struct ConfigWire {
    int32_t num_experts, num_topk, hidden, max_tokens_per_rank, payload, scale_format, topology, ranks_per_node,
        scaleout, num_sms, backend;
    int64_t timeout_ms;
};

ConfigWire to_wire(const BufferConfig& c, BackendKind kind) {
    return ConfigWire{c.num_experts,
                      c.num_topk,
                      c.hidden,
                      c.max_tokens_per_rank,
                      int32_t(c.payload),
                      int32_t(c.scale_format),
                      int32_t(c.topology),
                      c.ranks_per_node,
                      int32_t(c.scaleout),
                      c.num_sms,
                      int32_t(kind),
                      static_cast<int64_t>(c.timeout.count())};
}

// "hidden: 256 on rank 1, 128 on rank 0" for every field that differs.
std::string config_difference(const ConfigWire& ref, int ref_rank, const ConfigWire& other, int other_rank) {
    std::string d;
    auto field = [&](const char* name, const std::string& a, const std::string& b) {
        if (a == b) return;
        d += cat(d.empty() ? "" : "; ", name, ": ", b, " on rank ", other_rank, ", ", a, " on rank ", ref_rank);
    };
    auto num = [](int64_t v) { return std::to_string(v); };
    field("num_experts", num(ref.num_experts), num(other.num_experts));
    field("num_topk", num(ref.num_topk), num(other.num_topk));
    field("hidden", num(ref.hidden), num(other.hidden));
    field("max_tokens_per_rank", num(ref.max_tokens_per_rank), num(other.max_tokens_per_rank));
    field("payload", payload_name(Payload(ref.payload)), payload_name(Payload(other.payload)));
    const bool bf16 = ref.payload == int32_t(Payload::kBF16) && other.payload == int32_t(Payload::kBF16);
    field(bf16 ? "scale_format (unused with payload=bf16, but part of the config)" : "scale_format",
          scale_format_name(ScaleFormat(ref.scale_format)), scale_format_name(ScaleFormat(other.scale_format)));
    field("topology", topology_name(Topology(ref.topology)), topology_name(Topology(other.topology)));
    field("ranks_per_node", num(ref.ranks_per_node), num(other.ranks_per_node));
    field("scaleout", scaleout_name(ScaleOut(ref.scaleout)), scaleout_name(ScaleOut(other.scaleout)));
    field("num_sms", num(ref.num_sms), num(other.num_sms));
    field("timeout_ms", num(ref.timeout_ms), num(other.timeout_ms));
    field("backend", backend_name(BackendKind(ref.backend)), backend_name(BackendKind(other.backend)));
    return d;
}

// Step 1: what each rank says before any rank builds.
struct Verdict {
    int32_t ok;
    int32_t code;
    int32_t rank;
    int32_t size;
    uint64_t identity_hash;
    ConfigWire config;
    char message[kWireMessage];
};

// Step 2: whether each rank built its part.
struct Outcome {
    int32_t ok;
    int32_t code;
    char message[kWireMessage];
};

// (code, message) of an exception caught while checking or building.
std::pair<ErrorCode, std::string> explain(const std::exception_ptr& e, const std::string& what) {
    try {
        std::rethrow_exception(e);
    } catch (const Error& err) {
        return {err.code(), err.message()};
    } catch (const std::bad_alloc&) {
        return {ErrorCode::kCapacityExceeded,
                cat("out of host memory ", what, "; lower max_tokens_per_rank (or hidden, or the number of ranks)")};
    } catch (const std::exception& x) {
        return {ErrorCode::kInternal, x.what()};
    } catch (...) {
        return {ErrorCode::kInternal, "unknown exception"};
    }
}

// The group's size() as create may use it for a gather: a Group whose size() throws or is out of
// range cannot take part in any collective, so its rank fails alone. Above kMaxRanks that is every
// rank of the group, each with the same Unsupported error as BufferConfig::validate's.
int checked_group_size(Group& group) {
    const int size = group.size();
    ELASTICEP_CHECK_ARG(size >= 1, "Buffer::create: the group's size() is ", size,
                        ", below 1; fix the Group implementation");
    ELASTICEP_CHECK(size <= kMaxRanks, ErrorCode::kUnsupported, "Buffer::create: the group has ", size,
                    " ranks (its size()); ElasticEP supports at most kMaxRanks=", kMaxRanks, " ranks per group");
    return size;
}

// Every rank deposits its verdict; a rank that failed raises its own error, every other rank raises
// the lowest failed rank's code and message. Returns every rank's verdict when all are fine.
std::vector<Verdict> agree_on_arguments(Group& group, int size, Verdict me, const std::exception_ptr& own) {
    if (own) {
        const auto [code, message] = explain(own, "checking the buffer's arguments");
        me.ok = 0;
        me.code = static_cast<int32_t>(code);
        put_message(me.message, message);
    }
    std::vector<Verdict> all(static_cast<size_t>(size));
    try {
        group.all_gather(&me, sizeof(me), all.data());
    } catch (...) {
        if (own) std::rethrow_exception(own);  // the real reason beats the gather's timeout
        throw;
    }
    if (own) std::rethrow_exception(own);
    for (int r = 0; r < size; ++r) {
        const Verdict& v = all[static_cast<size_t>(r)];
        if (!v.ok)
            raise(static_cast<ErrorCode>(v.code), cat("Buffer::create: rank ", r, " rejected its config: ",
                                                      get_message(v.message), " (no rank built a buffer)"));
    }
    return all;
}

// ---- one call at a time -------------------------------------------------------------------------

std::string thread_name(std::thread::id id) {
    std::ostringstream os;
    os << id;
    return os.str();
}

}  // namespace

class BufferImpl {
 public:
    BufferImpl(std::shared_ptr<Group> group, const BufferConfig& config, BackendKind backend, int rank, int num_ranks)
        : group_(std::move(group)), config_(config), backend_kind_(backend), rank_(rank), num_ranks_(num_ranks) {}

    static BufferImpl& of(Buffer& b) { return *b.impl_; }

    // A Buffer serves one call at a time; a second thread entering while a call runs is told which
    // call holds it, instead of both silently mixing their rounds.
    class CallScope {
     public:
        CallScope(BufferImpl& b, const char* call) : b_(b) {
            std::lock_guard<std::mutex> lock(b_.call_mu_);
            if (b_.call_ != nullptr) {
                const bool same = b_.call_thread_ == std::this_thread::get_id();
                raise(ErrorCode::kInvalidArgument,
                      cat("Buffer::", call, " called from thread ", thread_name(std::this_thread::get_id()), " while ",
                          same ? "this same thread" : "thread " + thread_name(b_.call_thread_),
                          " is inside Buffer::", b_.call_, " on this buffer (rank ", b_.rank_,
                          "); a Buffer is one rank's endpoint and "
                          "takes one call at a time: serialize the calls, or give each thread its own buffer"));
            }
            b_.call_ = call;
            b_.call_thread_ = std::this_thread::get_id();
        }
        ~CallScope() {
            std::lock_guard<std::mutex> lock(b_.call_mu_);
            b_.call_ = nullptr;
        }
        CallScope(const CallScope&) = delete;
        CallScope& operator=(const CallScope&) = delete;

     private:
        BufferImpl& b_;
    };

    // The agreement on the arguments (before anything is built), then the agreement on the build
    // (before anything is published): every rank raises the real reason of the first rank that failed.
    static std::shared_ptr<Buffer> create(std::shared_ptr<Group> group, const BufferConfig& config,
                                          BackendKind requested) {
        ELASTICEP_CHECK_ARG(group != nullptr, "Buffer::create: group is null");
        const int size = checked_group_size(*group);
        Verdict me{};
        me.ok = 1;
        me.size = size;
        std::exception_ptr own;
        BackendKind kind = BackendKind::kCPU;
        try {
            me.rank = group->rank();
            ELASTICEP_CHECK_ARG(me.rank >= 0 && me.rank < size, "Buffer::create: the group's rank() is ", me.rank,
                                ", outside [0, size() = ", size, "); fix the Group implementation");
            config.validate(size);
            kind = Buffer::resolve_backend(requested);
            me.identity_hash = std::hash<std::string>{}(group->identity());
            me.config = to_wire(config, kind);
        } catch (...) {
            own = std::current_exception();
        }
        const std::vector<Verdict> all = agree_on_arguments(*group, size, me, own);
        for (int r = 0; r < size; ++r) {
            const Verdict& v = all[static_cast<size_t>(r)];
            ELASTICEP_CHECK_ARG(v.rank == r && v.size == size,
                                "Buffer::create: the group's all_gather put the "
                                "contribution of a rank whose rank() is ",
                                v.rank, " and size() is ", v.size, " at position ", r, " of ", size,
                                "; a Group must number its ranks 0..size()-1, each "
                                "once, and return all_gather results rank-major");
            ELASTICEP_CHECK_ARG(v.identity_hash == all[0].identity_hash, "Buffer::create: rank ", r,
                                "'s group reports "
                                "a different identity() than rank 0's; identity() must be the same on every rank of "
                                "a group");
            const std::string diff = config_difference(all[0].config, 0, v.config, r);
            ELASTICEP_CHECK_ARG(diff.empty(), "Buffer::create: rank ", r,
                                " passed a different config or backend than "
                                "rank 0 (",
                                diff, "); every rank must build the same buffer");
        }
        auto impl = std::make_unique<BufferImpl>(group, config, kind, me.rank, size);
        impl->buffer_id_ = g_next_buffer_id.fetch_add(1);
        BackendContext ctx{group, config, impl->rank_, impl->num_ranks_, impl->buffer_id_};
        // Build locally, then agree that every rank succeeded before anyone publishes. A rank whose
        // backend failed raises the backend's own code (Unsupported, Cuda, CapacityExceeded, ...);
        // every other rank raises the same code with that rank's message.
        std::exception_ptr failure;
        try {
            impl->backend_ = make_backend(kind, config.topology, ctx);
        } catch (...) {
            failure = std::current_exception();
        }
        Outcome mine{};
        mine.ok = failure ? 0 : 1;
        if (failure) {
            const auto [code, message] =
                explain(failure, cat("building the ", backend_name(kind), " backend (", config.describe(), ")"));
            mine.code = static_cast<int32_t>(code);
            put_message(mine.message, message);
        }
        const auto outcomes = group->all_gather_value(mine);
        if (failure)
            throw Error(static_cast<ErrorCode>(mine.code),
                        "Buffer::create failed on this rank: " + get_message(mine.message));
        std::string failed_ranks;
        int first = -1;
        for (int r = 0; r < size; ++r)
            if (!outcomes[static_cast<size_t>(r)].ok) {
                failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
                if (first < 0) first = r;
            }
        if (first >= 0) {
            const Outcome& o = outcomes[static_cast<size_t>(first)];
            raise(static_cast<ErrorCode>(o.code), cat("Buffer::create failed on rank ", failed_ranks, " (rank ", first,
                                                      ": ", get_message(o.message), "); nothing was published"));
        }
        return std::shared_ptr<Buffer>(new Buffer(std::move(impl)));
    }

    static void reject(const std::shared_ptr<Group>& group, const Error& error) {
        if (group == nullptr) throw error;
        int size = 0;
        try {
            size = checked_group_size(*group);
        } catch (...) {
            throw error;  // no collective is possible: this rank fails alone
        }
        Verdict me{};
        me.size = size;
        try {
            me.rank = group->rank();
        } catch (...) {
            me.rank = -1;
        }
        agree_on_arguments(*group, size, me, std::make_exception_ptr(error));
        throw error;  // not reached: agree_on_arguments rethrows it
    }

    static void consume(Handle& h) {
        if (h.state_) h.state_->consumed = true;
        h.state_.reset();
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
        } catch (const std::bad_alloc&) {
            // Backends allocate before they communicate, so this rank failed alone and the buffer is intact.
            raise(ErrorCode::kCapacityExceeded,
                  cat("out of host memory for this call's buffer-owned outputs (", config_.describe(),
                      "); pass caller-provided outputs, or lower "
                      "max_tokens_per_rank"));
        }
    }

    DispatchRequest validate_dispatch(const DispatchArgs& a) const {
        const BufferConfig& c = config_;
        const Device dev = backend_->device();
        DispatchRequest req;
        req.args = &a;
        ELASTICEP_CHECK_ARG(a.x.ndim() == 2, "dispatch: x is ", a.x.describe(),
                            " but must be 2-D [num_tokens, hidden]");
        const int64_t t = a.x.size(0);
        req.num_tokens = t;
        ELASTICEP_CHECK_ARG(t >= 0, "dispatch: x is ", a.x.describe(), ": a dimension cannot be negative");
        ELASTICEP_CHECK(t <= c.max_tokens_per_rank, ErrorCode::kCapacityExceeded, "dispatch: rank ", rank_, " has ", t,
                        " tokens but the buffer was built with max_tokens_per_rank=", c.max_tokens_per_rank,
                        "; raise max_tokens_per_rank to at least ", t,
                        ", or lower the serving engine's chunked prefill size / CUDA-graph batch size");
        if (a.x.dtype == DType::kFloat8E4M3) {
            check_matrix(a.x, "dispatch: x", t, c.hidden, dev);
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
            check_matrix(a.x, "dispatch: x", t, c.hidden, dev);
            ELASTICEP_CHECK_ARG(!a.x_scales.has_value(),
                                "dispatch: x_scales given but x is bf16; scales go with "
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
        ELASTICEP_CHECK_ARG(a.layout == Layout::kExpertContiguous || a.layout == Layout::kExpertMasked,
                            "dispatch: layout=", static_cast<int>(a.layout), " is not a Layout (contiguous or masked)");
        const int e_local = c.num_local_experts(num_ranks_);
        if (a.layout == Layout::kExpertContiguous) {
            ELASTICEP_CHECK_ARG(a.expert_alignment >= 1 && a.expert_alignment <= kMaxExpertAlignment,
                                "dispatch: expert_alignment=", a.expert_alignment, " must be in [1, ",
                                kMaxExpertAlignment, "]");
            req.rows_cap =
                contiguous_rows_cap(num_ranks_, c.max_tokens_per_rank, c.num_topk, e_local, a.expert_alignment);
            ELASTICEP_CHECK_ARG(req.rows_cap < kMaxRows, "dispatch: worst-case rows ", req.rows_cap,
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
        for (const auto* out : {&o.recv_x, &o.recv_scales, &o.recv_weights, &o.recv_src, &o.m_indices})
            if (*out) check_aligned(**out, "dispatch: caller-provided output");
        return req;
    }

    DispatchResult dispatch(const DispatchArgs& args) {
        CallScope scope(*this, "dispatch");
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
        // Consumed whatever happens below, also when it belongs to another buffer or another thread
        // is inside this one: the buffer that made it must not be blocked forever by a handle its
        // caller can no longer hold.
        ELASTICEP_CHECK_ARG(!st->consumed.exchange(true),
                            "combine: the handle was already consumed by an earlier "
                            "combine; each dispatch's handle is single-use");
        ELASTICEP_CHECK_ARG(st->buffer_id == buffer_id_,
                            "combine: the handle belongs to another buffer (it was "
                            "released; that buffer can dispatch again)");
        CallScope scope(*this, "combine");
        ELASTICEP_INTERNAL(outstanding_ == st, "combine: handle is not this buffer's outstanding one");
        ensure_usable();
        const Device dev = backend_->device();
        ELASTICEP_CHECK_ARG(args.y.dtype == DType::kBFloat16, "combine: y is ", args.y.describe(), " but must be bf16");
        ELASTICEP_CHECK_ARG(args.y.shape == st->y_shape, "combine: y is ", args.y.describe(),
                            " but must have the shape of dispatch's recv_x ",
                            TensorRef::contiguous(nullptr, DType::kBFloat16, st->y_shape, dev).describe());
        check_device(args.y, dev, "combine: y");
        // (an empty y, a rank that received no rows, may carry any strides)
        ELASTICEP_CHECK_ARG(args.y.numel() == 0 || args.y.is_contiguous(), "combine: y is ", args.y.describe(),
                            " but must be contiguous");
        check_aligned(args.y, "combine: y");
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

    void check() {
        CallScope scope(*this, "check");
        ensure_usable();
        guarded([&] {
            backend_->check();
            return 0;
        });
    }

    std::vector<int64_t> expert_load() {
        CallScope scope(*this, "expert_load");
        return backend_->expert_load();
    }

    void reset_expert_load() {
        CallScope scope(*this, "reset_expert_load");
        backend_->reset_expert_load();
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
    std::mutex call_mu_;
    const char* call_ = nullptr;  // the call in progress, if any
    std::thread::id call_thread_;
};

void consume_handle(Handle& handle) { BufferImpl::consume(handle); }

void reject_create(const std::shared_ptr<Group>& group, const Error& error) {
    BufferImpl::reject(group, error);
    throw error;
}

namespace testing {
void set_dispatch_forger(Buffer& buffer, DispatchForger forger) {
    BufferImpl::of(buffer).backend_->set_dispatch_forger(std::move(forger));
}
}  // namespace testing

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
        case BackendKind::kCPU:
            return true;
        case BackendKind::kCUDA:
            return detail::cuda_backend_compiled() && detail::cuda_backend_available();
    }
    return false;
}

BackendKind Buffer::resolve_backend(BackendKind backend) {
    if (backend == BackendKind::kAuto)
        return backend_available(BackendKind::kCUDA) ? BackendKind::kCUDA : BackendKind::kCPU;
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
        ELASTICEP_CHECK(detail::cuda_backend_compiled(), ErrorCode::kUnsupported,
                        "the CUDA backend is not compiled in");
    return detail::backend_reservation_bytes(kind, config.topology, config, num_ranks);
}

DispatchResult Buffer::dispatch(const DispatchArgs& args) { return impl_->dispatch(args); }

CombineResult Buffer::combine(Handle&& handle, const CombineArgs& args) {
    return impl_->combine(std::move(handle), args);
}

void Buffer::check() { impl_->check(); }

std::vector<int64_t> Buffer::expert_load() const { return impl_->expert_load(); }
void Buffer::reset_expert_load() { impl_->reset_expert_load(); }
const BufferConfig& Buffer::config() const { return impl_->config_; }
BackendKind Buffer::backend() const { return impl_->backend_kind_; }
std::string Buffer::scaleout() const { return impl_->backend_->scaleout(); }
std::string Buffer::kernel_path() const { return impl_->backend_->kernel_path(); }
int Buffer::rank() const { return impl_->rank_; }
int Buffer::num_ranks() const { return impl_->num_ranks_; }
int Buffer::num_local_experts() const { return impl_->config_.num_local_experts(impl_->num_ranks_); }
std::shared_ptr<Group> Buffer::group() const { return impl_->group_; }

int64_t Buffer::max_contiguous_rows(int expert_alignment) const {
    ELASTICEP_CHECK_ARG(expert_alignment >= 1 && expert_alignment <= kMaxExpertAlignment,
                        "expert_alignment=", expert_alignment, " must be in [1, ", kMaxExpertAlignment, "]");
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
        // identity() names a group: two live Group objects with one identity would share a buffer
        // that talks over only one of them.
        ELASTICEP_CHECK_ARG(it == g_registry.end() || it->second.buffer->group() == group, "get_buffer: rank ",
                            group->rank(), " of group identity '", group->identity(),
                            "' has a cached buffer that "
                            "was built over another Group object with the same identity(); two live groups must not "
                            "share an identity: pass the Group object the buffer was built with, make identity() "
                            "unique per group, or call reset_buffers() first");
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
