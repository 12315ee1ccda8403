// elasticep._C: the nanobind layer between the C++ library and the pure-Python package.
//
// Tensors cross as DLPack (nb::ndarray, zero-copy in both directions). The Python layer names each
// tensor's element type (it knows torch.bfloat16, ml_dtypes.bfloat16, uint16-as-bf16-bits ...) and
// hands in raw-bit views; outputs go back as raw-bit views (bf16 -> uint16, fp8 -> uint8) that the
// Python layer turns into the caller's framework and dtype. Every collective call releases the GIL,
// so ranks played by Python threads run concurrently; a Group implemented in Python (a trampoline)
// takes the GIL back for its own collectives.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/trampoline.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "elasticep/elasticep.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace elasticep::python {
namespace {

using Array = nb::ndarray<nb::ro>;

// ---- errors -----------------------------------------------------------------------------------

// Set by elasticep/errors.py at import: make(code_name, message, what) -> exception instance.
nb::object& error_factory() {
    static nb::object* f = new nb::object();  // leaked on purpose: outlives module teardown order
    return *f;
}

[[noreturn]] void raise_arg(const std::string& message) { throw Error(ErrorCode::kInvalidArgument, message); }

void translate_error(const std::exception_ptr& p, void*) {
    try {
        std::rethrow_exception(p);
    } catch (const Error& e) {
        nb::object& factory = error_factory();
        if (factory.is_valid()) {
            try {
                nb::object exc = factory(error_code_name(e.code()), e.message(), e.what());
                PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
                return;
            } catch (nb::python_error& pe) {
                pe.restore();
                return;
            }
        }
        PyErr_SetString(PyExc_RuntimeError, e.what());
    }
}

// ---- tensors ----------------------------------------------------------------------------------

const char* dlpack_dtype_name(nb::dlpack::dtype dt) {
    using C = nb::dlpack::dtype_code;
    const auto code = static_cast<C>(dt.code);
    if (dt.lanes != 1) return "vector";
    switch (code) {
        case C::Int: return dt.bits == 8 ? "int8" : dt.bits == 16 ? "int16" : dt.bits == 32 ? "int32" : "int64";
        case C::UInt: return dt.bits == 8 ? "uint8" : dt.bits == 16 ? "uint16" : dt.bits == 32 ? "uint32" : "uint64";
        case C::Float: return dt.bits == 16 ? "float16" : dt.bits == 32 ? "fp32" : "float64";
        case C::Bfloat: return "bf16";
        case C::Bool: return "bool";
        case C::Complex: return "complex";
        case C::Float8_E4M3FN: return "fp8_e4m3";
        case C::Float8_E5M2: return "float8_e5m2";
        default: return "an unsupported type";
    }
}

std::optional<DType> dtype_from_dlpack(nb::dlpack::dtype dt) {
    using C = nb::dlpack::dtype_code;
    if (dt.lanes != 1) return std::nullopt;
    const auto code = static_cast<C>(dt.code);
    if (code == C::Bfloat && dt.bits == 16) return DType::kBFloat16;
    if (code == C::Float && dt.bits == 32) return DType::kFloat32;
    if (code == C::Int && dt.bits == 32) return DType::kInt32;
    if (code == C::Int && dt.bits == 64) return DType::kInt64;
    if (code == C::UInt && dt.bits == 8) return DType::kUInt8;
    if (code == C::Float8_E4M3FN && dt.bits == 8) return DType::kFloat8E4M3;
    return std::nullopt;
}

std::optional<DType> dtype_from_name(const std::string& s) {
    if (s == "bf16") return DType::kBFloat16;
    if (s == "fp8_e4m3") return DType::kFloat8E4M3;
    if (s == "fp32") return DType::kFloat32;
    if (s == "int32") return DType::kInt32;
    if (s == "int64") return DType::kInt64;
    if (s == "uint8") return DType::kUInt8;
    return std::nullopt;
}

std::string shape_text(const Array& a) {
    std::string s = "[";
    for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
    return s + "]";
}

// One tensor argument: the imported DLPack view (kept alive here) and the TensorRef over it.
struct TensorArg {
    Array array;
    TensorRef ref;
    std::string name;
};

// `dtype`: the element type the Python layer determined ("bf16", "fp8_e4m3", ...), or "" to take
// DLPack's. The view's element size must match it (raw-bit views: uint16 for bf16, uint8 for fp8).
void tensor_arg_init(TensorArg* self, Array a, const std::string& dtype, const std::string& name) {
    std::optional<DType> dt;
    if (dtype.empty()) {
        dt = dtype_from_dlpack(a.dtype());
        if (!dt)
            raise_arg(name + " has dtype " + dlpack_dtype_name(a.dtype()) + " " + shape_text(a) +
                      ", which ElasticEP does not take (it takes bf16, fp8_e4m3, fp32, int32, int64)");
    } else {
        dt = dtype_from_name(dtype);
        if (!dt) raise_arg(name + ": unknown element type name '" + dtype + "'");
        if (static_cast<size_t>(a.dtype().bits) != 8 * dtype_size(*dt) || a.dtype().lanes != 1)
            raise_arg(name + " is a " + std::to_string(a.dtype().bits) + "-bit view but " + dtype + " needs " +
                      std::to_string(8 * dtype_size(*dt)) + " bits per element");
    }
    TensorRef ref;
    ref.data = const_cast<void*>(a.data());
    ref.dtype = *dt;
    ref.shape.resize(a.ndim());
    ref.strides.resize(a.ndim());
    for (size_t i = 0; i < a.ndim(); ++i) {
        ref.shape[i] = static_cast<int64_t>(a.shape(i));
        ref.strides[i] = a.stride(i);
    }
    // An empty tensor's strides carry no information (numpy reports zeros for [0, H]): call it
    // contiguous so a rank with no tokens passes the stride checks.
    if (ref.numel() == 0) ref.strides.clear();
    const int dev = a.device_type();
    if (dev == nb::device::cpu::value) {
        ref.device = Device{DeviceType::kCPU, 0};
    } else if (dev == nb::device::cuda::value || dev == nb::device::cuda_managed::value) {
        ref.device = Device{DeviceType::kCUDA, a.device_id()};
    } else if (dev == nb::device::cuda_host::value) {
        ref.device = Device{DeviceType::kCPU, 0};  // pinned host memory is host memory
    } else {
        raise_arg(name + " lives on DLPack device type " + std::to_string(dev) +
                  ", which ElasticEP does not take (cpu or cuda)");
    }
    new (self) TensorArg{std::move(a), std::move(ref), name};
}

// Raw-bit DLPack dtype of an output: bf16 -> uint16, fp8 -> uint8 (the Python layer re-types them;
// numpy has no bf16/fp8 and DLPack float8 support varies between frameworks).
nb::dlpack::dtype raw_dtype(DType d) {
    switch (d) {
        case DType::kBFloat16: return nb::dtype<uint16_t>();
        case DType::kFloat8E4M3: return nb::dtype<uint8_t>();
        case DType::kFloat32: return nb::dtype<float>();
        case DType::kInt32: return nb::dtype<int32_t>();
        case DType::kInt64: return nb::dtype<int64_t>();
        case DType::kUInt8: return nb::dtype<uint8_t>();
    }
    return nb::dtype<uint8_t>();
}

// A view of library or caller memory; `owner` keeps that memory alive while the view lives.
nb::object export_ref(const TensorRef& t, nb::handle owner) {
    std::vector<size_t> shape(t.shape.begin(), t.shape.end());
    std::vector<int64_t> strides(t.shape.size());
    for (int i = 0; i < t.ndim(); ++i) strides[static_cast<size_t>(i)] = t.stride(i);
    const bool cuda = t.device.type == DeviceType::kCUDA;
    nb::ndarray<nb::array_api> arr(t.data, shape.size(), shape.data(), owner, strides.data(), raw_dtype(t.dtype),
                      cuda ? nb::device::cuda::value : nb::device::cpu::value, cuda ? t.device.index : 0);
    return arr.cast(nb::rv_policy::reference);
}

std::chrono::milliseconds to_ms(double seconds) {
    if (!(seconds > 0)) raise_arg("timeout=" + std::to_string(seconds) + " s must be positive");
    const double ms = seconds * 1000.0;
    return std::chrono::milliseconds(ms < 1.0 ? 1 : static_cast<int64_t>(ms + 0.5));
}

// ---- groups -----------------------------------------------------------------------------------

// A Group implemented in Python (e.g. over torch.distributed). C++ calls it with the GIL released,
// so every override takes the GIL first.
class PyGroup : public Group {
   public:
    NB_TRAMPOLINE(Group);

    int rank() const override {
        nb::gil_scoped_acquire gil;
        NB_OVERRIDE_PURE(rank);
    }
    int size() const override {
        nb::gil_scoped_acquire gil;
        NB_OVERRIDE_PURE(size);
    }
    void barrier() override {
        nb::gil_scoped_acquire gil;
        NB_OVERRIDE_PURE(barrier);
    }
    std::string identity() const override {
        nb::gil_scoped_acquire gil;
        NB_OVERRIDE_PURE(identity);
    }
    // Python signature: all_gather(data: bytes) -> bytes (rank-major concatenation) or list[bytes].
    void all_gather(const void* send, size_t bytes, void* recv) override {
        nb::gil_scoped_acquire gil;
        constexpr uint64_t kHash = nb::detail::str_hash("all_gather");
        nb::detail::ticket ticket(nb_trampoline, "all_gather", kHash, true);
        nb::object result = nb_trampoline.base().attr(ticket.key)(nb::bytes(send, bytes));
        const int n = size();
        auto* out = static_cast<char*>(recv);
        if (nb::isinstance<nb::bytes>(result)) {
            nb::bytes b = nb::borrow<nb::bytes>(result);
            if (b.size() != bytes * static_cast<size_t>(n))
                throw Error(ErrorCode::kInternal, "Group.all_gather (Python) returned " + std::to_string(b.size()) +
                                                      " bytes; expected size() * " + std::to_string(bytes) + " = " +
                                                      std::to_string(bytes * static_cast<size_t>(n)));
            std::memcpy(out, b.c_str(), b.size());
            return;
        }
        size_t i = 0;
        for (nb::handle item : result) {
            nb::bytes b = nb::cast<nb::bytes>(item);
            if (b.size() != bytes || i >= static_cast<size_t>(n))
                throw Error(ErrorCode::kInternal, "Group.all_gather (Python) returned a list whose item " +
                                                      std::to_string(i) + " has " + std::to_string(b.size()) +
                                                      " bytes (expected " + std::to_string(n) + " items of " +
                                                      std::to_string(bytes) + " bytes)");
            std::memcpy(out + i * bytes, b.c_str(), bytes);
            ++i;
        }
        if (i != static_cast<size_t>(n))
            throw Error(ErrorCode::kInternal, "Group.all_gather (Python) returned " + std::to_string(i) +
                                                  " items; expected " + std::to_string(n));
    }
};

// ---- buffer -----------------------------------------------------------------------------------

struct PyHandle {
    Handle handle;
    bool consumed = false;
    uint64_t buffer_tag = 0;
};

BufferConfig make_config(int num_experts, int num_topk, int hidden, int max_tokens_per_rank, const std::string& payload,
                         const std::string& scale_format, const std::string& topology, int ranks_per_node, int num_sms,
                         double timeout, int device) {
    BufferConfig c;
    c.num_experts = num_experts;
    c.num_topk = num_topk;
    c.hidden = hidden;
    c.max_tokens_per_rank = max_tokens_per_rank;
    c.payload = parse_payload(payload);
    c.scale_format = parse_scale_format(scale_format);
    c.topology = parse_topology(topology);
    c.ranks_per_node = ranks_per_node;
    c.num_sms = num_sms;
    c.timeout = to_ms(timeout);
    c.device = device;
    return c;
}

const TensorRef* opt_ref(const TensorArg* a) { return a ? &a->ref : nullptr; }

nb::object buffer_owner(Buffer& b) {
    nb::handle h = nb::find(&b);
    if (!h.is_valid()) throw Error(ErrorCode::kInternal, "buffer has no Python object");
    return nb::borrow(h);
}

nb::tuple dispatch(Buffer& b, const TensorArg& x, const TensorArg* x_scales, const TensorArg& topk_idx,
                   const TensorArg* topk_weights, const std::string& layout, int expert_alignment,
                   bool host_sync, bool zero_padding, bool scales_mn_major, const TensorArg* out_x,
                   const TensorArg* out_scales, const TensorArg* out_weights,
                   const TensorArg* out_src, const TensorArg* out_m_indices,
                   uintptr_t stream) {
    DispatchArgs a;
    a.x = x.ref;
    if (auto* r = opt_ref(x_scales)) a.x_scales = *r;
    a.topk_idx = topk_idx.ref;
    if (auto* r = opt_ref(topk_weights)) a.topk_weights = *r;
    a.layout = parse_layout(layout);
    a.expert_alignment = expert_alignment;
    a.host_sync = host_sync;
    a.zero_padding = zero_padding;
    a.scales_mn_major = scales_mn_major;
    if (auto* r = opt_ref(out_x)) a.outputs.recv_x = *r;
    if (auto* r = opt_ref(out_scales)) a.outputs.recv_scales = *r;
    if (auto* r = opt_ref(out_weights)) a.outputs.recv_weights = *r;
    if (auto* r = opt_ref(out_src)) a.outputs.recv_src = *r;
    if (auto* r = opt_ref(out_m_indices)) a.outputs.m_indices = *r;
    a.stream = reinterpret_cast<void*>(stream);

    DispatchResult res;
    {
        nb::gil_scoped_release nogil;
        res = b.dispatch(a);
    }
    nb::object owner = buffer_owner(b);
    auto owner_of = [&](const TensorArg* given) -> nb::object {
        if (given) return nb::borrow(nb::find(given));  // the caller's tensor: its TensorArg keeps it alive
        return owner;
    };
    const bool contiguous = res.layout == Layout::kExpertContiguous;
    nb::object none = nb::none();
    nb::object recv_scales = res.recv_scales ? export_ref(*res.recv_scales, owner_of(out_scales)) : none;
    auto handle = std::make_unique<PyHandle>();
    handle->handle = std::move(res.handle);
    handle->buffer_tag = reinterpret_cast<uintptr_t>(&b);
    return nb::make_tuple(export_ref(res.recv_x, owner_of(out_x)), recv_scales,
                          export_ref(res.recv_weights, owner_of(out_weights)),
                          export_ref(res.recv_src, owner_of(out_src)),
                          contiguous ? export_ref(res.m_indices, owner_of(out_m_indices)) : none,
                          export_ref(res.counts, owner), contiguous ? export_ref(res.offsets, owner) : none,
                          contiguous ? none : export_ref(res.masked_m, owner), res.num_rows,
                          nb::cast(handle.release(), nb::rv_policy::take_ownership));
}

nb::object combine(Buffer& b, PyHandle& h, const TensorArg& y, bool weighted, const TensorArg* bias,
                   const TensorArg* out, uintptr_t stream) {
    if (h.consumed)
        raise_arg("combine: the handle was already consumed by an earlier combine; each dispatch's handle is single-use");
    // Checked here too (C++ checks it after taking the handle's state): a handle passed to the wrong
    // buffer stays usable with its own.
    if (h.buffer_tag != reinterpret_cast<uintptr_t>(&b)) raise_arg("combine: the handle belongs to another buffer");
    CombineArgs a;
    a.y = y.ref;
    a.weighted = weighted;
    if (auto* r = opt_ref(bias)) a.bias = *r;
    if (auto* r = opt_ref(out)) a.out = *r;
    a.stream = reinterpret_cast<void*>(stream);
    h.consumed = true;  // consumed whatever happens below, as in C++ (a failed combine releases it)
    Handle moved = std::move(h.handle);
    CombineResult r;
    {
        nb::gil_scoped_release nogil;
        r = b.combine(std::move(moved), a);
    }
    return export_ref(r.out, out ? nb::borrow(nb::find(out)) : buffer_owner(b));
}

}  // namespace
}  // namespace elasticep::python

NB_MODULE(_C, m) {
    using namespace elasticep;
    using namespace elasticep::python;
    m.doc() = "ElasticEP native extension (internal; use the `elasticep` package)";
    nb::register_exception_translator(translate_error);
    // Buffers cached in the C++ registry (and the Python groups they hold) legitimately live until
    // process exit; nanobind's shutdown leak report would flag them.
    nb::set_leak_warnings(false);

    m.def("_set_error_factory", [](nb::object f) { error_factory() = std::move(f); });
    m.def("version", [] { return std::string(version_string()); });
    m.def("build_backends", [] { return std::string(build_backends()); });
    m.def("backend_available", [](const std::string& b) { return Buffer::backend_available(parse_backend(b)); });
    m.def("resolve_backend", [](const std::string& b) {
        return std::string(backend_name(Buffer::resolve_backend(parse_backend(b))));
    });
    m.def("scale_columns", [](const std::string& f, int hidden) { return scale_columns(parse_scale_format(f), hidden); });
    m.def("system_info", []() -> nb::dict {
        SystemInfo s = system_info();
        nb::list gpus;
        for (const GpuInfo& g : s.gpus) {
            nb::dict d;
            d["index"] = g.index;
            d["name"] = g.name;
            d["major"] = g.major;
            d["minor"] = g.minor;
            d["memory_bytes"] = g.memory_bytes;
            d["num_sms"] = g.num_sms;
            gpus.append(d);
        }
        nb::dict d;
        d["version"] = s.version;
        d["backends_compiled"] = s.backends_compiled;
        d["cuda_runtime_version"] = s.cuda_runtime_version;
        d["cuda_driver_version"] = s.cuda_driver_version;
        d["nccl_version"] = s.nccl_version;
        d["gpus"] = gpus;
        d["note"] = s.note;
        return d;
    });

    nb::class_<TensorArg>(m, "TensorArg")
        .def("__init__", &tensor_arg_init, "array"_a, "dtype"_a, "name"_a)
        .def_prop_ro("describe", [](const TensorArg& t) { return t.ref.describe(); });

    nb::class_<Group, PyGroup>(m, "Group")
        .def(nb::init<>())
        .def("rank", &Group::rank)
        .def("size", &Group::size)
        .def("identity", &Group::identity)
        .def("barrier", [](Group& g) {
            nb::gil_scoped_release nogil;
            g.barrier();
        })
        .def("all_gather", [](Group& g, nb::bytes data) {
            const std::string send(data.c_str(), data.size());
            std::string recv(send.size() * static_cast<size_t>(g.size()), '\0');
            {
                nb::gil_scoped_release nogil;
                g.all_gather(send.data(), send.size(), recv.data());
            }
            return nb::bytes(recv.data(), recv.size());
        });

    m.def("thread_group", [](int n, double timeout) { return ThreadGroup::create(n, to_ms(timeout)); }, "num_ranks"_a,
          "timeout"_a);
    m.def("mpi_available", [] { return MpiGroup::available(); });
    m.def("mpi_world", [](double timeout) {
        nb::gil_scoped_release nogil;
        return MpiGroup::world(to_ms(timeout));
    });

    nb::class_<PyHandle>(m, "Handle")
        .def_prop_ro("valid", [](const PyHandle& h) { return !h.consumed && h.handle.valid(); })
        .def_prop_ro("num_sms", [](const PyHandle& h) { return h.handle.num_sms(); })
        .def_prop_ro("layout", [](const PyHandle& h) { return std::string(layout_name(h.handle.layout())); });

    nb::class_<Buffer>(m, "Buffer")
        .def_static(
            "create",
            [](std::shared_ptr<Group> group, int num_experts, int num_topk, int hidden, int max_tokens_per_rank,
               const std::string& payload, const std::string& scale_format, const std::string& topology,
               int ranks_per_node, int num_sms, double timeout, int device, const std::string& backend, bool cached) {
                const BufferConfig c = make_config(num_experts, num_topk, hidden, max_tokens_per_rank, payload,
                                                   scale_format, topology, ranks_per_node, num_sms, timeout, device);
                const BackendKind kind = parse_backend(backend);
                nb::gil_scoped_release nogil;
                return cached ? get_buffer(std::move(group), c, kind) : Buffer::create(std::move(group), c, kind);
            },
            "group"_a, "num_experts"_a, "num_topk"_a, "hidden"_a, "max_tokens_per_rank"_a, "payload"_a,
            "scale_format"_a, "topology"_a, "ranks_per_node"_a, "num_sms"_a, "timeout"_a, "device"_a, "backend"_a,
            "cached"_a)
        .def_static("reservation_bytes",
                    [](int num_ranks, int num_experts, int num_topk, int hidden, int max_tokens_per_rank,
                       const std::string& payload, const std::string& scale_format, const std::string& topology,
                       int ranks_per_node, const std::string& backend) {
                        const BufferConfig c = make_config(num_experts, num_topk, hidden, max_tokens_per_rank, payload,
                                                           scale_format, topology, ranks_per_node, 0, 30.0, -1);
                        return Buffer::reservation_bytes(c, num_ranks, parse_backend(backend));
                    })
        .def("dispatch", &dispatch, "x"_a, "x_scales"_a.none(), "topk_idx"_a, "topk_weights"_a.none(), "layout"_a,
             "expert_alignment"_a, "host_sync"_a, "zero_padding"_a, "scales_mn_major"_a, "out_x"_a.none(),
             "out_scales"_a.none(), "out_weights"_a.none(), "out_src"_a.none(), "out_m_indices"_a.none(),
             "stream"_a)
        .def("combine", &combine, "handle"_a, "y"_a, "weighted"_a, "bias"_a.none(), "out"_a.none(), "stream"_a)
        .def("check",
             [](Buffer& b) {
                 nb::gil_scoped_release nogil;
                 b.check();
             })
        .def("expert_load", &Buffer::expert_load)
        .def("reset_expert_load", &Buffer::reset_expert_load)
        .def("max_contiguous_rows", &Buffer::max_contiguous_rows)
        .def_prop_ro("backend", [](const Buffer& b) { return std::string(backend_name(b.backend())); })
        .def_prop_ro("rank", &Buffer::rank)
        .def_prop_ro("num_ranks", &Buffer::num_ranks)
        .def_prop_ro("num_local_experts", &Buffer::num_local_experts)
        .def_prop_ro("config", [](const Buffer& b) { return b.config().describe(); })
        .def_prop_ro("group", &Buffer::group);

    m.def("reset_buffers", [] {
        nb::gil_scoped_release nogil;
        reset_buffers();
    });

    // ---- byte accounting (include/elasticep/traffic.hpp) for python -m elasticep.bench ---------
    // count_traffic(num_ranks, rank, num_experts, num_topk, hidden, payload, scale_format, topk_idx,
    // prequantized) -> dict: one source rank's counts, as `elasticep bench` reports them. topk_idx:
    // a host int32/int64 [T, K] array (any strides).
    m.def(
        "count_traffic",
        [](int num_ranks, int rank, int num_experts, int num_topk, int hidden, const std::string& payload,
           const std::string& scale_format, nb::ndarray<nb::ro, nb::device::cpu> topk_idx, bool prequantized) {
            const BufferConfig c =
                make_config(num_experts, num_topk, hidden, 1, payload, scale_format, "direct", 0, 0, 30.0, -1);
            const bool i64 = topk_idx.dtype() == nb::dtype<int64_t>(), i32 = topk_idx.dtype() == nb::dtype<int32_t>();
            if (!i64 && !i32) raise_arg("count_traffic: topk_idx must be int32 or int64");
            TensorRef t;
            t.data = const_cast<void*>(topk_idx.data());
            t.dtype = i64 ? DType::kInt64 : DType::kInt32;
            for (size_t d = 0; d < topk_idx.ndim(); ++d) {
                t.shape.push_back(static_cast<int64_t>(topk_idx.shape(d)));
                t.strides.push_back(static_cast<int64_t>(topk_idx.stride(d)));
            }
            const Traffic tr = count_traffic(c, num_ranks, rank, t, prequantized);
            nb::dict d;
            d["tokens"] = tr.tokens;
            d["routes"] = tr.routes;
            d["peer_messages"] = tr.peer_messages;
            d["local_messages"] = tr.local_messages;
            d["message_bytes"] = tr.message_bytes;
            d["partial_bytes"] = tr.partial_bytes;
            d["dispatch_hbm_bytes"] = tr.dispatch_hbm_bytes;
            d["combine_hbm_bytes"] = tr.combine_hbm_bytes;
            return d;
        },
        "num_ranks"_a, "rank"_a, "num_experts"_a, "num_topk"_a, "hidden"_a, "payload"_a, "scale_format"_a, "topk_idx"_a,
        "prequantized"_a);
}
