// elasticep._C: the nanobind layer between the C++ library and the pure-Python package.
//
// The C++ argument structs are bound as classes: BufferConfig, DispatchArgs (with its
// DispatchOutputs), DispatchResult and CombineArgs. Each field is registered once, in one line,
// with its Python name and the checked conversion of a Python value (an error names the parameter,
// the value and its range); each class lists its field names (`fields`) so that the Python layer
// fills and reads them by name. A new option is one line here and one in the Python signature.
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

#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "elasticep/elasticep.hpp"
#include "serving_bindings.hpp"

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

// ---- checked conversions of Python values ----------------------------------------------------------

std::string py_repr(nb::handle v) {
    try {
        return nb::cast<std::string>(nb::repr(v));
    } catch (...) {
        return "<unprintable>";
    }
}

std::string py_type(nb::handle v) { return nb::cast<std::string>(nb::str(v.type().attr("__name__"))); }

// An integer parameter: a Python int or anything with __index__ (numpy integers), never a float
// (8.7 is not silently 8). `range` says what the library accepts, for the error.
int64_t to_int64(nb::handle v, const char* name, const char* range) {
    PyObject* index = PyNumber_Index(v.ptr());
    if (index == nullptr) {
        PyErr_Clear();
        raise_arg(std::string(name) + "=" + py_repr(v) + " (" + py_type(v) + ") must be an integer (" + range + ")");
    }
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (overflow != 0) raise_arg(std::string(name) + "=" + py_repr(v) + " is out of range: " + range);
    return x;
}

int to_int(nb::handle v, const char* name, const char* range) {
    const int64_t x = to_int64(v, name, range);
    if (x < INT_MIN || x > INT_MAX)
        raise_arg(std::string(name) + "=" + std::to_string(x) + " is out of range: " + range);
    return static_cast<int>(x);
}

bool to_bool(nb::handle v, const char* name) {
    const int b = PyObject_IsTrue(v.ptr());
    if (b < 0) {
        PyErr_Clear();
        raise_arg(std::string(name) + "=" + py_repr(v) + " is not a truth value");
    }
    return b != 0;
}

std::string to_str(nb::handle v) { return nb::cast<std::string>(nb::str(v)); }

// Seconds as a Python number -> milliseconds, in [1 ms, kMaxTimeout]; inf and nan are refused
// (every wait is bounded), and nothing wraps.
std::chrono::milliseconds to_ms(nb::handle v, const char* name) {
    const double seconds = PyFloat_AsDouble(v.ptr());
    if (seconds == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        raise_arg(std::string(name) + "=" + py_repr(v) + " must be a number of seconds");
    }
    const double max_s = static_cast<double>(kMaxTimeout.count()) / 1000.0;
    if (!(seconds > 0)) raise_arg(std::string(name) + "=" + py_repr(v) + " s must be positive");
    if (!(seconds <= max_s))
        raise_arg(std::string(name) + "=" + py_repr(v) + " s is above the limit of " + std::to_string(int64_t(max_s)) +
                  " s (7 days); every wait on a peer is bounded: pass a finite timeout of at most 7 days");
    const double ms = seconds * 1000.0;
    return std::chrono::milliseconds(ms < 1.0 ? 1 : static_cast<int64_t>(ms + 0.5));
}

// ---- tensors ----------------------------------------------------------------------------------

const char* dlpack_dtype_name(nb::dlpack::dtype dt) {
    using C = nb::dlpack::dtype_code;
    const auto code = static_cast<C>(dt.code);
    if (dt.lanes != 1) return "vector";
    switch (code) {
        case C::Int:
            return dt.bits == 8 ? "int8" : dt.bits == 16 ? "int16" : dt.bits == 32 ? "int32" : "int64";
        case C::UInt:
            return dt.bits == 8 ? "uint8" : dt.bits == 16 ? "uint16" : dt.bits == 32 ? "uint32" : "uint64";
        case C::Float:
            return dt.bits == 16 ? "float16" : dt.bits == 32 ? "fp32" : "float64";
        case C::Bfloat:
            return "bf16";
        case C::Bool:
            return "bool";
        case C::Complex:
            return "complex";
        case C::Float8_E4M3FN:
            return "fp8_e4m3";
        case C::Float8_E5M2:
            return "float8_e5m2";
        default:
            return "an unsupported type";
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
    bool writable = false;  // imported as writable: the library may write it
};

// `dtype`: the element type the Python layer determined ("bf16", "fp8_e4m3", ...), or "" to take
// DLPack's. The view's element size must match it (raw-bit views: uint16 for bf16, uint8 for fp8).
// `writable`: the library writes this tensor (a caller-provided output), so a read-only source
// (numpy writeable=False, an array over bytes, a read-only mapping) is refused instead of written.
void tensor_arg_init(TensorArg* self, nb::handle obj, const std::string& dtype, const std::string& name,
                     bool writable) {
    Array a;
    if (writable) {
        nb::ndarray<> w;
        if (nb::try_cast(obj, w)) {
            a = Array(w);
        } else if (nb::try_cast(obj, a)) {
            raise_arg(name + " is read-only (" + shape_text(a) + " " + dlpack_dtype_name(a.dtype()) +
                      "), but the library writes it: pass a writable array (numpy: one with flags.writeable, not a "
                      "view of bytes or of a read-only mapping; or a .copy())");
        }
    }
    if (!writable && !nb::try_cast(obj, a))
        raise_arg(name + " is " + py_type(obj) +
                  ", which is not an array: pass a numpy array, a torch tensor, or "
                  "another object with __dlpack__ or the buffer protocol");
    if (writable && !a.is_valid())
        raise_arg(name + " is " + py_type(obj) +
                  ", which is not an array: pass a numpy array, a torch tensor, or "
                  "another object with __dlpack__ or the buffer protocol");
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
    new (self) TensorArg{std::move(a), std::move(ref), name, writable};
}

// Raw-bit DLPack dtype of an output: bf16 -> uint16, fp8 -> uint8 (the Python layer re-types them;
// numpy has no bf16/fp8 and DLPack float8 support varies between frameworks).
nb::dlpack::dtype raw_dtype(DType d) {
    switch (d) {
        case DType::kBFloat16:
            return nb::dtype<uint16_t>();
        case DType::kFloat8E4M3:
            return nb::dtype<uint8_t>();
        case DType::kFloat32:
            return nb::dtype<float>();
        case DType::kInt32:
            return nb::dtype<int32_t>();
        case DType::kInt64:
            return nb::dtype<int64_t>();
        case DType::kUInt8:
            return nb::dtype<uint8_t>();
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

// ---- one registry of fields per bound struct ------------------------------------------------

// Registers the fields of a bound argument struct: each as a checked property, its name appended
// to the class's `fields` tuple (and, unless it is a tensor, to `options`), its setter to
// `setters()` (for filling a struct from keyword arguments in C++). `ref(self)` returns a reference
// to the C++ field.
template <class Self>
class Fields {
 public:
    using Setter = std::function<void(Self&, nb::handle)>;
    static std::map<std::string, Setter>& setters() {
        static auto* m = new std::map<std::string, Setter>();  // leaked on purpose, like error_factory
        return *m;
    }

    explicit Fields(nb::class_<Self>& cls) : cls_(cls) {}

    template <class Ref>
    Fields& integer(const char* name, Ref ref, const char* range) {
        return add(
            name, [ref](Self& s) { return ref(s); },
            [ref, name, range](Self& s, nb::handle v) { ref(s) = to_int(v, name, range); });
    }
    template <class Ref>
    Fields& flag(const char* name, Ref ref) {
        return add(
            name, [ref](Self& s) { return ref(s); }, [ref, name](Self& s, nb::handle v) { ref(s) = to_bool(v, name); });
    }
    // An enum read and written by its name ("bf16", "masked", ...).
    template <class Ref, class Enum>
    Fields& choice(const char* name, Ref ref, Enum (*parse)(const std::string&), const char* (*name_of)(Enum)) {
        return add(
            name, [ref, name_of](Self& s) { return std::string(name_of(ref(s))); },
            [ref, parse](Self& s, nb::handle v) { ref(s) = parse(to_str(v)); });
    }
    // std::chrono::milliseconds read and written as seconds.
    template <class Ref>
    Fields& seconds(const char* name, Ref ref) {
        return add(
            name, [ref](Self& s) { return static_cast<double>(ref(s).count()) / 1000.0; },
            [ref, name](Self& s, nb::handle v) { ref(s) = to_ms(v, name); });
    }
    // A cudaStream_t as an int handle.
    template <class Ref>
    Fields& stream(const char* name, Ref ref) {
        return add(
            name, [ref](Self& s) { return reinterpret_cast<uintptr_t>(ref(s)); },
            [ref, name](Self& s, nb::handle v) {
                ref(s) = reinterpret_cast<void*>(static_cast<uintptr_t>(to_int64(v, name, "a cudaStream_t handle")));
            });
    }
    // A tensor: a _C.TensorArg (kept alive by the struct), or None where the field is optional.
    // `ref(self)` returns the TensorRef (or std::optional<TensorRef>) field; `output`: the library
    // writes it, so it must have been imported writable.
    template <class Ref>
    Fields& tensor(const char* name, Ref ref, bool output = false) {
        using Field = std::remove_reference_t<decltype(ref(std::declval<Self&>()))>;
        constexpr bool kOptional = !std::is_same_v<Field, TensorRef>;
        return add(
            name, false, [name](Self& s) -> nb::object { return s.kept(name); },
            [ref, name, output](Self& s, nb::handle v) {
                if (v.is_none()) {
                    if constexpr (kOptional) {
                        ref(s).reset();
                        s.keep(name, nb::none());
                        return;
                    }
                    raise_arg(std::string(name) + " is required (got None)");
                }
                TensorArg* t = nullptr;
                if (!nb::try_cast(v, t) || t == nullptr)
                    raise_arg(std::string(name) + " must be a _C.TensorArg (elasticep's own wrapper), got " +
                              py_type(v));
                if (output && !t->writable)
                    throw Error(ErrorCode::kInternal, t->name + " was imported read-only but the library writes it");
                ref(s) = t->ref;
                s.keep(name, nb::borrow(v));
            });
    }

    void done() {
        cls_.attr("fields") = nb::tuple(names_);
        cls_.attr("options") = nb::tuple(options_);
    }

 private:
    template <class Get>
    Fields& add(const char* name, Get get, Setter set) {
        return add(name, true, std::move(get), std::move(set));
    }
    template <class Get>
    Fields& add(const char* name, bool option, Get get, Setter set) {
        cls_.def_prop_rw(
            name, get, [set](Self& s, nb::handle v) { set(s, v); }, nb::for_setter(nb::arg("value").none()));
        setters()[name] = set;
        names_.append(nb::str(name));
        if (option) options_.append(nb::str(name));
        return *this;
    }
    nb::class_<Self>& cls_;
    nb::list names_, options_;
};

// The Python objects a bound struct's tensor fields point into, kept alive with it.
struct Keeper {
    std::map<std::string, nb::object> kept_;
    void keep(const char* name, nb::object o) { kept_[name] = std::move(o); }
    nb::object kept(const char* name) const {
        auto it = kept_.find(name);
        return it == kept_.end() ? nb::none() : it->second;
    }
};

struct PyDispatchOutputs : Keeper {
    DispatchOutputs refs;
};

struct PyDispatchArgs : Keeper {
    DispatchArgs args;
    PyDispatchOutputs outputs;
};

struct PyCombineArgs : Keeper {
    CombineArgs args;
};

struct PyHandle {
    Handle handle;
    bool consumed = false;
};

// A dispatch's result: every tensor already exported as a view with the right owner.
struct PyDispatchResult {
    Layout layout = Layout::kExpertContiguous;
    int64_t num_rows = -1;
    std::map<std::string, nb::object> tensors;
    nb::object handle;
};

// The tensor attributes of DispatchResult, in the order of the C++ struct.
const char* const kResultTensors[] = {"recv_x",    "recv_scales", "recv_weights", "recv_src",
                                      "m_indices", "counts",      "offsets",      "masked_m"};

// ---- groups -----------------------------------------------------------------------------------

// A Group implemented in Python (e.g. over torch.distributed). C++ calls it with the GIL released,
// so every override takes the GIL first, and what a Python method returns is checked with an error
// that says what it must return.
class PyGroup : public Group {
 public:
    NB_TRAMPOLINE(Group);

    int rank() const override {
        nb::gil_scoped_acquire gil;
        return checked_int(call("rank"), "rank");
    }
    int size() const override {
        nb::gil_scoped_acquire gil;
        return checked_int(call("size"), "size");
    }
    void barrier() override {
        nb::gil_scoped_acquire gil;
        call("barrier");
    }
    std::string identity() const override {
        nb::gil_scoped_acquire gil;
        nb::object id = call("identity");
        if (!nb::isinstance<nb::str>(id))
            raise_arg("Group.identity() (Python) returned " + py_repr(id) + " (" + py_type(id) +
                      "); it must return a str, the same on every rank of the group");
        return nb::cast<std::string>(id);
    }
    // Python signature: all_gather(data: bytes) -> bytes (rank-major concatenation) or a list of
    // bytes; any object with the buffer protocol (bytearray, memoryview, numpy) stands for bytes.
    void all_gather(const void* send, size_t bytes, void* recv) override {
        nb::gil_scoped_acquire gil;
        nb::object result = call("all_gather", nb::bytes(send, bytes));
        const int n = size();
        auto* out = static_cast<char*>(recv);
        const size_t total = bytes * static_cast<size_t>(n);
        if (PyObject_CheckBuffer(result.ptr())) {
            const std::string b = buffer_bytes(result, "returned");
            if (b.size() != total)
                throw Error(ErrorCode::kInternal, "Group.all_gather (Python) returned " + std::to_string(b.size()) +
                                                      " bytes; expected size() * " + std::to_string(bytes) + " = " +
                                                      std::to_string(total));
            if (total != 0) std::memcpy(out, b.data(), total);
            return;
        }
        if (!nb::isinstance<nb::list>(result) && !nb::isinstance<nb::tuple>(result))
            raise_arg("Group.all_gather (Python) returned " + py_type(result) +
                      "; it must return bytes (every rank's data, rank-major) or a list of bytes (one per rank)");
        size_t i = 0;
        for (nb::handle item : result) {
            if (!PyObject_CheckBuffer(item.ptr()))
                raise_arg("Group.all_gather (Python) returned a list whose item " + std::to_string(i) + " is " +
                          py_type(item) + "; each item must be bytes (that rank's data)");
            const std::string b = buffer_bytes(item, "returned a list whose item " + std::to_string(i) + " is");
            if (b.size() != bytes || i >= static_cast<size_t>(n))
                throw Error(ErrorCode::kInternal, "Group.all_gather (Python) returned a list whose item " +
                                                      std::to_string(i) + " has " + std::to_string(b.size()) +
                                                      " bytes (expected " + std::to_string(n) + " items of " +
                                                      std::to_string(bytes) + " bytes)");
            if (bytes != 0) std::memcpy(out + i * bytes, b.data(), bytes);
            ++i;
        }
        if (i != static_cast<size_t>(n))
            throw Error(ErrorCode::kInternal, "Group.all_gather (Python) returned " + std::to_string(i) +
                                                  " items; expected " + std::to_string(n));
    }

 private:
    template <class... A>
    nb::object call(const char* name, A&&... args) const {
        nb::detail::ticket ticket(nb_trampoline, name, nb::detail::str_hash(name), true);
        return nb_trampoline.base().attr(ticket.key)(std::forward<A>(args)...);
    }
    static int checked_int(const nb::object& v, const char* what) {
        if (PyBool_Check(v.ptr()) || !PyLong_Check(v.ptr()))
            raise_arg(std::string("Group.") + what + "() (Python) returned " + py_repr(v) + " (" + py_type(v) +
                      "); it must return an int");
        int overflow = 0;
        const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
        if (overflow != 0 || x < INT_MIN || x > INT_MAX)
            raise_arg(std::string("Group.") + what + "() (Python) returned " + py_repr(v) + ", outside the int range");
        return static_cast<int>(x);
    }
    static std::string buffer_bytes(nb::handle obj, const std::string& what) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
            PyErr_Clear();
            raise_arg("Group.all_gather (Python) " + what + " " + py_type(obj) +
                      ", a buffer that is not contiguous bytes; return bytes");
        }
        std::string b(static_cast<const char*>(view.buf), static_cast<size_t>(view.len));
        PyBuffer_Release(&view);
        return b;
    }
};

// ---- buffer -----------------------------------------------------------------------------------

// Fills `c` (and the backend) from Buffer(...)'s keyword arguments, by field name.
BackendKind fill_config(BufferConfig& c, const nb::dict& params) {
    BackendKind kind = BackendKind::kAuto;
    for (auto [k, v] : params) {
        const std::string name = to_str(k);
        if (name == "backend") {
            kind = parse_backend(to_str(v));
            continue;
        }
        auto& setters = Fields<BufferConfig>::setters();
        auto it = setters.find(name);
        if (it == setters.end()) raise_arg("unknown buffer option '" + name + "'");
        it->second(c, v);
    }
    return kind;
}

nb::object buffer_owner(Buffer& b) {
    nb::handle h = nb::find(&b);
    if (!h.is_valid()) throw Error(ErrorCode::kInternal, "buffer has no Python object");
    return nb::borrow(h);
}

PyDispatchResult dispatch(Buffer& b, PyDispatchArgs& a) {
    a.args.outputs = a.outputs.refs;
    DispatchResult res;
    {
        nb::gil_scoped_release nogil;
        res = b.dispatch(a.args);
    }
    nb::object owner = buffer_owner(b);
    // a caller-provided output's view is owned by its TensorArg, which holds the caller's array
    auto owner_of = [&](const char* name) -> nb::object {
        nb::object given = a.outputs.kept(name);
        return given.is_none() ? owner : given;
    };
    PyDispatchResult r;
    r.layout = res.layout;
    r.num_rows = res.num_rows;
    const bool contiguous = res.layout == Layout::kExpertContiguous;
    auto put = [&](const char* name, const TensorRef* t, nb::handle own) {
        r.tensors[name] = t ? export_ref(*t, own) : nb::none();
    };
    put("recv_x", &res.recv_x, owner_of("recv_x"));
    put("recv_scales", res.recv_scales ? &*res.recv_scales : nullptr, owner_of("recv_scales"));
    put("recv_weights", &res.recv_weights, owner_of("recv_weights"));
    put("recv_src", &res.recv_src, owner_of("recv_src"));
    put("m_indices", contiguous ? &res.m_indices : nullptr, owner_of("m_indices"));
    put("counts", &res.counts, owner);
    put("offsets", contiguous ? &res.offsets : nullptr, owner);
    put("masked_m", contiguous ? nullptr : &res.masked_m, owner);
    auto handle = std::make_unique<PyHandle>();
    handle->handle = std::move(res.handle);
    r.handle = nb::cast(handle.release(), nb::rv_policy::take_ownership);
    return r;
}

nb::object combine(Buffer& b, PyHandle& h, PyCombineArgs& a) {
    if (h.consumed)
        raise_arg(
            "combine: the handle was already consumed by an earlier combine; each dispatch's handle is single-use");
    h.consumed = true;  // consumed whatever happens below (SEMANTICS.md: a failed combine releases its handle)
    Handle moved = std::move(h.handle);
    CombineResult r;
    {
        nb::gil_scoped_release nogil;
        r = b.combine(std::move(moved), a.args);
    }
    nb::object out = a.kept("out");
    return export_ref(r.out, out.is_none() ? buffer_owner(b) : out);
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
    m.def("resolve_backend",
          [](const std::string& b) { return std::string(backend_name(Buffer::resolve_backend(parse_backend(b)))); });
    m.def("scale_columns", [](nb::handle f, nb::handle hidden) {
        return scale_columns(parse_scale_format(to_str(f)), to_int(hidden, "hidden", "[1, 65536]"));
    });
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
        .def("__init__", &tensor_arg_init, "array"_a.none(), "dtype"_a, "name"_a, "writable"_a = false)
        .def_prop_ro("describe", [](const TensorArg& t) { return t.ref.describe(); })
        .def_prop_ro("writable", [](const TensorArg& t) { return t.writable; });

    // ---- the argument structs, one line per field ----
    auto config_cls = nb::class_<BufferConfig>(m, "BufferConfig");
    config_cls.def(nb::init<>())
        .def("validate", &BufferConfig::validate, "num_ranks"_a)
        .def("describe", &BufferConfig::describe)
        .def("__repr__", [](const BufferConfig& c) { return "BufferConfig(" + c.describe() + ")"; });
    Fields<BufferConfig>(config_cls)
        .integer(
            "num_experts", [](BufferConfig& c) -> int& { return c.num_experts; },
            "[1, 65536], a multiple of the number of ranks")
        .integer(
            "num_topk", [](BufferConfig& c) -> int& { return c.num_topk; }, "[1, 32]")
        .integer(
            "hidden", [](BufferConfig& c) -> int& { return c.hidden; }, "[1, 65536]")
        .integer(
            "max_tokens_per_rank", [](BufferConfig& c) -> int& { return c.max_tokens_per_rank; },
            "at least 1, with ranks * max_tokens_per_rank * num_topk < 2^30; lower it")
        .choice(
            "payload", [](BufferConfig& c) -> Payload& { return c.payload; }, parse_payload, payload_name)
        .choice(
            "scale_format", [](BufferConfig& c) -> ScaleFormat& { return c.scale_format; }, parse_scale_format,
            scale_format_name)
        .choice(
            "topology", [](BufferConfig& c) -> Topology& { return c.topology; }, parse_topology, topology_name)
        .integer(
            "ranks_per_node", [](BufferConfig& c) -> int& { return c.ranks_per_node; },
            "0 (all ranks one node) or a divisor of the number of ranks")
        .choice(
            "scaleout", [](BufferConfig& c) -> ScaleOut& { return c.scaleout; }, parse_scaleout, scaleout_name)
        .integer(
            "num_sms", [](BufferConfig& c) -> int& { return c.num_sms; }, "[0, 1024]")
        .seconds("timeout", [](BufferConfig& c) -> std::chrono::milliseconds& { return c.timeout; })
        .integer(
            "device", [](BufferConfig& c) -> int& { return c.device; }, "-1 (the current device) or a device index")
        .done();

    auto outputs_cls = nb::class_<PyDispatchOutputs>(m, "DispatchOutputs");
    outputs_cls.def(nb::init<>());
    Fields<PyDispatchOutputs>(outputs_cls)
        .tensor(
            "recv_x", [](PyDispatchOutputs & o) -> auto& { return o.refs.recv_x; }, true)
        .tensor(
            "recv_scales", [](PyDispatchOutputs & o) -> auto& { return o.refs.recv_scales; }, true)
        .tensor(
            "recv_weights", [](PyDispatchOutputs & o) -> auto& { return o.refs.recv_weights; }, true)
        .tensor(
            "recv_src", [](PyDispatchOutputs & o) -> auto& { return o.refs.recv_src; }, true)
        .tensor(
            "m_indices", [](PyDispatchOutputs & o) -> auto& { return o.refs.m_indices; }, true)
        .done();

    auto dargs_cls = nb::class_<PyDispatchArgs>(m, "DispatchArgs");
    dargs_cls.def(nb::init<>())
        .def_prop_ro(
            "outputs", [](PyDispatchArgs& a) -> PyDispatchOutputs& { return a.outputs; },
            nb::rv_policy::reference_internal);
    Fields<PyDispatchArgs>(dargs_cls)
        .tensor(
            "x", [](PyDispatchArgs & a) -> auto& { return a.args.x; })
        .tensor(
            "x_scales", [](PyDispatchArgs & a) -> auto& { return a.args.x_scales; })
        .tensor(
            "topk_idx", [](PyDispatchArgs & a) -> auto& { return a.args.topk_idx; })
        .tensor(
            "topk_weights", [](PyDispatchArgs & a) -> auto& { return a.args.topk_weights; })
        .choice(
            "layout", [](PyDispatchArgs& a) -> Layout& { return a.args.layout; }, parse_layout, layout_name)
        .integer(
            "expert_alignment", [](PyDispatchArgs& a) -> int& { return a.args.expert_alignment; }, "[1, 65536]")
        .flag("host_sync", [](PyDispatchArgs& a) -> bool& { return a.args.host_sync; })
        .flag("zero_padding", [](PyDispatchArgs& a) -> bool& { return a.args.zero_padding; })
        .flag("scales_mn_major", [](PyDispatchArgs& a) -> bool& { return a.args.scales_mn_major; })
        .stream("stream", [](PyDispatchArgs& a) -> void*& { return a.args.stream; })
        .done();

    auto cargs_cls = nb::class_<PyCombineArgs>(m, "CombineArgs");
    cargs_cls.def(nb::init<>());
    Fields<PyCombineArgs>(cargs_cls)
        .tensor(
            "y", [](PyCombineArgs & a) -> auto& { return a.args.y; })
        .flag("weighted", [](PyCombineArgs& a) -> bool& { return a.args.weighted; })
        .tensor(
            "bias", [](PyCombineArgs & a) -> auto& { return a.args.bias; })
        .tensor(
            "out", [](PyCombineArgs & a) -> auto& { return a.args.out; }, true)
        .stream("stream", [](PyCombineArgs& a) -> void*& { return a.args.stream; })
        .done();

    auto result_cls = nb::class_<PyDispatchResult>(m, "DispatchResult");
    result_cls.def_prop_ro("layout", [](const PyDispatchResult& r) { return std::string(layout_name(r.layout)); })
        .def_ro("num_rows", &PyDispatchResult::num_rows)
        .def_prop_ro("handle", [](const PyDispatchResult& r) { return r.handle; });
    nb::list result_tensors;
    for (const char* name : kResultTensors) {
        result_cls.def_prop_ro(name, [name](const PyDispatchResult& r) { return r.tensors.at(name); });
        result_tensors.append(nb::str(name));
    }
    result_cls.attr("tensors") = nb::tuple(result_tensors);

    // ---- groups ----
    nb::class_<Group, PyGroup>(m, "Group")
        .def(nb::init<>())
        .def("rank", &Group::rank)
        .def("size", &Group::size)
        .def("identity", &Group::identity)
        .def("barrier",
             [](Group& g) {
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

    m.def(
        "thread_group",
        [](nb::handle n, nb::handle timeout) {
            return ThreadGroup::create(to_int(n, "ThreadGroup: num_ranks", "[1, 65536]"),
                                       to_ms(timeout, "ThreadGroup: timeout"));
        },
        "num_ranks"_a, "timeout"_a);
    m.def("mpi_available", [] { return MpiGroup::available(); });
    m.def("mpi_world", [](nb::handle timeout) {
        const auto ms = to_ms(timeout, "MpiWorld: timeout");
        nb::gil_scoped_release nogil;
        return MpiGroup::world(ms);
    });

    nb::class_<PyHandle>(m, "Handle")
        .def_prop_ro("valid", [](const PyHandle& h) { return !h.consumed && h.handle.valid(); })
        .def_prop_ro("num_sms", [](const PyHandle& h) { return h.handle.num_sms(); })
        .def_prop_ro("layout", [](const PyHandle& h) { return std::string(layout_name(h.handle.layout())); })
        // The handle rule when the Python layer rejects a combine before C++ sees it.
        .def("_release", [](PyHandle& h) {
            h.consumed = true;
            detail::consume_handle(h.handle);
        });

    nb::class_<Buffer>(m, "Buffer")
        .def_static(
            "create",
            [](std::shared_ptr<Group> group, nb::dict params, bool cached) {
                BufferConfig c;
                BackendKind kind = BackendKind::kAuto;
                try {
                    kind = fill_config(c, params);
                } catch (const Error& e) {
                    // This rank cannot even form its config: it still takes part in create's
                    // agreement, so that its peers raise this reason now instead of timing out.
                    nb::gil_scoped_release nogil;
                    detail::reject_create(group, e);
                }
                nb::gil_scoped_release nogil;
                return cached ? get_buffer(std::move(group), c, kind) : Buffer::create(std::move(group), c, kind);
            },
            "group"_a, "params"_a, "cached"_a)
        .def_static(
            "reservation_bytes",
            [](const BufferConfig& c, nb::handle num_ranks, const std::string& backend) {
                return Buffer::reservation_bytes(c, to_int(num_ranks, "num_ranks", "[1, 1024]"),
                                                 parse_backend(backend));
            },
            "config"_a, "num_ranks"_a, "backend"_a)
        .def("dispatch", &dispatch, "args"_a)
        .def("combine", &combine, "handle"_a, "args"_a)
        .def("check",
             [](Buffer& b) {
                 nb::gil_scoped_release nogil;
                 b.check();
             })
        .def("expert_load", &Buffer::expert_load)
        .def("reset_expert_load", &Buffer::reset_expert_load)
        .def("max_contiguous_rows",
             [](Buffer& b, nb::handle a) { return b.max_contiguous_rows(to_int(a, "expert_alignment", "[1, 65536]")); })
        .def_prop_ro("backend", [](const Buffer& b) { return std::string(backend_name(b.backend())); })
        .def_prop_ro("kernel_path", &Buffer::kernel_path)
        .def_prop_ro("rank", &Buffer::rank)
        .def_prop_ro("num_ranks", &Buffer::num_ranks)
        .def_prop_ro("num_local_experts", &Buffer::num_local_experts)
        .def_prop_ro("config", [](const Buffer& b) { return b.config().describe(); })
        // The configuration as a structure (a copy): the fields of _C.BufferConfig, read by name.
        .def_prop_ro("settings", [](const Buffer& b) -> BufferConfig { return b.config(); })
        .def_prop_ro("group", &Buffer::group);

    register_serving(m);  // elasticep.serving: checks, adapters, reference MoE layer (serving_bindings.cpp)

    m.def("reset_buffers", [] {
        nb::gil_scoped_release nogil;
        reset_buffers();
    });

    // ---- byte accounting (include/elasticep/traffic.hpp) for python -m elasticep.bench ---------
    // count_traffic(params, num_ranks, rank, topk_idx, prequantized) -> dict: one source rank's
    // counts, as `elasticep bench` reports them. `params`: Buffer(...)'s keyword arguments (the same
    // names, through the same field table); topk_idx: a host int32/int64 [T, K] array (any strides).
    m.def(
        "count_traffic",
        [](const nb::dict& params, int num_ranks, int rank, nb::ndarray<nb::ro, nb::device::cpu> topk_idx,
           bool prequantized) {
            BufferConfig c;
            c.max_tokens_per_rank = 1;
            fill_config(c, params);
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
            d["dispatch_min_hbm_bytes"] = tr.dispatch_min_hbm_bytes;
            d["combine_min_hbm_bytes"] = tr.combine_min_hbm_bytes;
            return d;
        },
        "params"_a, "num_ranks"_a, "rank"_a, "topk_idx"_a, "prequantized"_a);
}
