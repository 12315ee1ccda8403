// elasticep._C's serving half: the start-up checks, the grouped-GEMM adapters, the reference MoE
// layer and the synthetic weights of include/elasticep/serving.hpp, for python/elasticep/serving.py.
// Tensors arrive as _ServingTensor (a DLPack view plus the element type the Python layer named) and
// are the caller's memory throughout: nothing here allocates tensors for Python. Calls that may run
// kernels or loops release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "elasticep/elasticep.hpp"
#include "moe/synthetic_weights.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace elasticep::python {
namespace {

[[noreturn]] void bad(const std::string& m) { throw Error(ErrorCode::kInvalidArgument, m); }

std::optional<DType> dtype_named(const std::string& s) {
    if (s == "bf16") return DType::kBFloat16;
    if (s == "fp8_e4m3") return DType::kFloat8E4M3;
    if (s == "fp32") return DType::kFloat32;
    if (s == "int32") return DType::kInt32;
    if (s == "int64") return DType::kInt64;
    if (s == "uint8") return DType::kUInt8;
    return std::nullopt;
}

// One tensor argument: the imported view (kept alive) and the TensorRef over it.
struct ServingTensor {
    nb::ndarray<nb::ro> array;
    TensorRef ref;
};

void serving_tensor_init(ServingTensor* self, nb::ndarray<nb::ro> a, const std::string& dtype,
                         const std::string& name) {
    const std::optional<DType> dt = dtype_named(dtype);
    if (!dt) bad(name + ": unknown element type '" + dtype + "'");
    if (static_cast<size_t>(a.dtype().bits) != 8 * dtype_size(*dt) || a.dtype().lanes != 1)
        bad(name + " is a " + std::to_string(a.dtype().bits) + "-bit view but " + dtype + " needs " +
            std::to_string(8 * dtype_size(*dt)) + " bits per element");
    TensorRef r;
    r.data = const_cast<void*>(a.data());
    r.dtype = *dt;
    for (size_t i = 0; i < a.ndim(); ++i) {
        r.shape.push_back(static_cast<int64_t>(a.shape(i)));
        r.strides.push_back(a.stride(i));
    }
    if (r.numel() == 0) r.strides.clear();
    const int dev = a.device_type();
    if (dev == nb::device::cuda::value || dev == nb::device::cuda_managed::value)
        r.device = Device{DeviceType::kCUDA, a.device_id()};
    else if (dev == nb::device::cpu::value || dev == nb::device::cuda_host::value)
        r.device = Device{DeviceType::kCPU, 0};
    else
        bad(name + " lives on DLPack device type " + std::to_string(dev) + "; ElasticEP takes cpu or cuda");
    new (self) ServingTensor{std::move(a), std::move(r)};
}

const TensorRef& ref(const ServingTensor& t) { return t.ref; }
std::optional<TensorRef> opt(const ServingTensor* t) {
    if (!t) return std::nullopt;
    return t->ref;
}
void* as_stream(uintptr_t s) { return reinterpret_cast<void*>(s); }

// ---- checks ------------------------------------------------------------------------------------

template <class T>
T get(const nb::dict& d, const char* key, T fallback) {
    if (!d.contains(key)) return fallback;
    nb::handle v = d[key];
    if (v.is_none()) return fallback;
    return nb::cast<T>(v);
}

nb::dict budget(const nb::dict& a) {
    ServingBudget b;
    b.max_tokens_per_rank = get<int64_t>(a, "max_tokens_per_rank", 0);
    b.role = parse_serving_role(get<std::string>(a, "role", "mixed"));
    b.chunked_prefill_size = get<int64_t>(a, "chunked_prefill_size", 0);
    b.max_prefill_tokens = get<int64_t>(a, "max_prefill_tokens", 0);
    b.dynamic_chunk_probe_size = get<int64_t>(a, "dynamic_chunk_probe_size", 0);
    b.decode_cuda_graphs = get<bool>(a, "decode_cuda_graphs", true);
    b.cuda_graph_max_bs = get<int64_t>(a, "cuda_graph_max_bs", 0);
    b.max_running_requests = get<int64_t>(a, "max_running_requests", 0);
    b.dp_attention = get<bool>(a, "dp_attention", false);
    b.attention_dp_size = get<int64_t>(a, "attention_dp_size", 1);
    b.speculative_num_draft_tokens = get<int64_t>(a, "speculative_num_draft_tokens", 0);
    const BudgetReport r = check_serving_budget(b);
    nb::dict o;
    o["capacity"] = r.capacity;
    o["prefill_checked"] = r.prefill_checked;
    o["prefill_tokens"] = r.prefill_tokens;
    o["prefill_source"] = r.prefill_source;
    o["decode_checked"] = r.decode_checked;
    o["decode_batch"] = r.decode_batch;
    o["tokens_per_request"] = r.tokens_per_request;
    o["decode_tokens"] = r.decode_tokens;
    o["decode_source"] = r.decode_source;
    o["describe"] = r.describe();
    return o;
}

const char* kind_name(ExpertQuantKind k) {
    switch (k) {
        case ExpertQuantKind::kBF16:
            return "bf16";
        case ExpertQuantKind::kFP8Block128:
            return "fp8_block128";
        case ExpertQuantKind::kMXFP8:
            return "mxfp8";
    }
    return "?";
}

ExpertQuantKind parse_kind(const std::string& s) {
    if (s == "bf16") return ExpertQuantKind::kBF16;
    if (s == "fp8_block128") return ExpertQuantKind::kFP8Block128;
    if (s == "mxfp8") return ExpertQuantKind::kMXFP8;
    bad("unknown expert kind '" + s + "'; choose bf16, fp8_block128 or mxfp8");
}

// `fields`: the Python layer's flattening of a quantization_config (None: no config).
ExpertQuant quant_of(const nb::object& fields) {
    QuantizationConfig q;
    if (!fields.is_none()) {
        const nb::dict d = nb::cast<nb::dict>(fields);
        q.present = true;
        q.quant_method = get<std::string>(d, "quant_method", "");
        q.fmt = get<std::string>(d, "fmt", "");
        q.activation_scheme = get<std::string>(d, "activation_scheme", "");
        q.format = get<std::string>(d, "format", "");
        q.quant_algo = get<std::string>(d, "quant_algo", "");
        q.bits = get<int64_t>(d, "bits", 0);
        if (d.contains("weight_block_size") && !d["weight_block_size"].is_none())
            q.weight_block_size = nb::cast<std::vector<int64_t>>(d["weight_block_size"]);
    }
    return check_expert_quant(q);
}

nb::dict quant_dict(const ExpertQuant& e) {
    nb::dict o;
    o["kind"] = kind_name(e.kind);
    o["payload"] = payload_name(e.payload());
    o["weight_block_n"] = e.weight_block_n;
    o["weight_block_k"] = e.weight_block_k;
    o["activation_group"] = e.activation_group;
    o["source"] = e.source;
    o["describe"] = e.describe();
    nb::list formats;
    for (ScaleFormat f : {ScaleFormat::kF32G128, ScaleFormat::kUE8M0G128, ScaleFormat::kUE8M0G32})
        if (e.accepts(f)) formats.append(scale_format_name(f));
    o["scale_formats"] = formats;
    return o;
}

// ---- the reference MoE layer -------------------------------------------------------------------

struct PyMoeLayer {
    std::unique_ptr<ReferenceMoeLayer> layer;
};

void layer_init(PyMoeLayer* self, const std::string& kind, int hidden, int inter, const ServingTensor& gate_up,
                const ServingTensor* gate_up_scales, const ServingTensor& down, const ServingTensor* down_scales,
                bool graph_safe, bool force_dequant) {
    ExpertWeights w;
    w.kind = parse_kind(kind);
    w.hidden = hidden;
    w.intermediate = inter;
    w.gate_up = gate_up.ref;
    w.gate_up_scales = opt(gate_up_scales);
    w.down = down.ref;
    w.down_scales = opt(down_scales);
    const Device dev = gate_up.ref.device;
    std::unique_ptr<ReferenceMoeLayer> l;
    {
        nb::gil_scoped_release nogil;
        l = std::make_unique<ReferenceMoeLayer>(w, dev, MoeLayerOptions{graph_safe, force_dequant});
    }
    new (self) PyMoeLayer{std::move(l)};
}

MoeDispatchOutput dispatch_output(const std::string& layout, const ServingTensor& x, const ServingTensor* scales,
                                  const std::string& scale_format, const ServingTensor& counts,
                                  const ServingTensor* offsets, const ServingTensor* m_indices,
                                  const ServingTensor& recv_weights, const std::string& placement) {
    MoeDispatchOutput d;
    d.layout = parse_layout(layout);
    d.hidden_states = x.ref;
    d.hidden_states_scale = opt(scales);
    d.scale_format = parse_scale_format(scale_format);
    d.counts = counts.ref;
    d.recv_weights = recv_weights.ref;
    d.weight_placement = parse_weight_placement(placement);
    if (d.layout == Layout::kExpertMasked) {
        d.masked_m = counts.ref;
        d.max_m = x.ref.ndim() == 3 ? x.ref.size(1) : 0;
    } else {
        if (!offsets || !m_indices) bad("ReferenceMoeLayer.forward: a contiguous dispatch needs offsets and m_indices");
        d.offsets = offsets->ref;
        d.m_indices = m_indices->ref;
        d.num_rows = x.ref.ndim() >= 1 ? x.ref.size(0) : 0;
    }
    return d;
}

nb::tuple synthetic(const std::string& kind, int64_t first, int64_t count, int64_t hidden, int64_t inter, uint64_t seed,
                    int threads) {
    moe_ref::SyntheticExperts x;
    {
        nb::gil_scoped_release nogil;
        x = moe_ref::make_synthetic_experts(parse_kind(kind), first, count, hidden, inter, seed, threads);
    }
    auto bytes = [](const void* p, size_t n) { return nb::bytes(static_cast<const char*>(p), n); };
    return nb::make_tuple(bytes(x.w1.data(), x.w1.size()), bytes(x.s1.data(), x.s1.size() * 4),
                          bytes(x.w2.data(), x.w2.size()), bytes(x.s2.data(), x.s2.size() * 4));
}

}  // namespace

void register_serving(nb::module_& m) {
    nb::class_<ServingTensor>(m, "_ServingTensor")
        .def("__init__", &serving_tensor_init, "array"_a, "dtype"_a, "name"_a)
        .def_prop_ro("describe", [](const ServingTensor& t) { return t.ref.describe(); });

    m.def("serving_budget", &budget, "settings"_a);
    m.def(
        "serving_expert_quant", [](const nb::object& f) { return quant_dict(quant_of(f)); }, "fields"_a.none());
    m.def(
        "serving_check_quant_buffer",
        [](const nb::object& f, const std::string& payload, const std::string& scale_format) {
            BufferConfig c;
            c.payload = parse_payload(payload);
            c.scale_format = parse_scale_format(scale_format);
            quant_of(f).check_buffer(c);
        },
        "fields"_a.none(), "payload"_a, "scale_format"_a);
    m.def("serving_scale_format_for_device",
          [](int d) { return std::string(scale_format_name(scale_format_for_device(d))); });
    m.def("serving_scale_format_for_cc",
          [](int major) { return std::string(scale_format_name(scale_format_for_compute_capability(major))); });
    m.def("serving_expected_m", &MoeDispatcher::expected_m);

    m.def("adapter_check_status", [](const ServingTensor& s, uintptr_t stream) {
        nb::gil_scoped_release nogil;
        check_adapter_status(s.ref, as_stream(stream));
    });
    m.def("adapter_m_indices", [](const ServingTensor& c, const ServingTensor& o, const ServingTensor& mi,
                                  const ServingTensor& st, uintptr_t stream) {
        nb::gil_scoped_release nogil;
        m_indices_from_offsets(c.ref, o.ref, mi.ref, st.ref, as_stream(stream));
    });
    m.def(
        "adapter_masked_to_contiguous",
        [](const ServingTensor& x, const ServingTensor& mm, const ServingTensor* sc, int alignment,
           const ServingTensor& ox, const ServingTensor* os, const ServingTensor& off, const ServingTensor* mi,
           const ServingTensor* w, const ServingTensor& st, uintptr_t stream) {
            MaskedToContiguousArgs a;
            a.x = x.ref;
            a.masked_m = mm.ref;
            a.scales = opt(sc);
            a.expert_alignment = alignment;
            a.out_x = ox.ref;
            a.out_scales = opt(os);
            a.out_offsets = off.ref;
            a.out_m_indices = opt(mi);
            a.weights = opt(w);
            a.status = st.ref;
            a.stream = as_stream(stream);
            nb::gil_scoped_release nogil;
            masked_to_contiguous(a);
        },
        "x"_a, "masked_m"_a, "scales"_a.none(), "alignment"_a, "out_x"_a, "out_scales"_a.none(), "out_offsets"_a,
        "out_m_indices"_a.none(), "weights"_a.none(), "status"_a, "stream"_a);
    m.def(
        "adapter_contiguous_to_masked",
        [](const ServingTensor& x, const ServingTensor& c, const ServingTensor& off, const ServingTensor* sc,
           const ServingTensor& ox, const ServingTensor* os, const ServingTensor* omm, const ServingTensor* w,
           const ServingTensor& st, uintptr_t stream) {
            ContiguousToMaskedArgs a;
            a.x = x.ref;
            a.counts = c.ref;
            a.offsets = off.ref;
            a.scales = opt(sc);
            a.out_x = ox.ref;
            a.out_scales = opt(os);
            a.out_masked_m = opt(omm);
            a.weights = opt(w);
            a.status = st.ref;
            a.stream = as_stream(stream);
            nb::gil_scoped_release nogil;
            contiguous_to_masked(a);
        },
        "x"_a, "counts"_a, "offsets"_a, "scales"_a.none(), "out_x"_a, "out_scales"_a.none(), "out_masked_m"_a.none(),
        "weights"_a.none(), "status"_a, "stream"_a);
    m.def("adapter_route_weights", [](const ServingTensor& y, const ServingTensor& w, const ServingTensor& rows,
                                      const ServingTensor& out, const ServingTensor& st, uintptr_t stream) {
        nb::gil_scoped_release nogil;
        apply_route_weights(y.ref, w.ref, rows.ref, out.ref, st.ref, as_stream(stream));
    });
    m.def("adapter_convert_scales", [](const ServingTensor& s, const ServingTensor& d, uintptr_t stream) {
        nb::gil_scoped_release nogil;
        convert_scale_layout(s.ref, d.ref, as_stream(stream));
    });
    m.def("adapter_fp32_to_ue8m0", [](const ServingTensor& s, const ServingTensor& d, uintptr_t stream) {
        nb::gil_scoped_release nogil;
        fp32_scales_to_ue8m0(s.ref, d.ref, as_stream(stream));
    });

    nb::class_<PyMoeLayer>(m, "MoeLayer")
        .def("__init__", &layer_init, "kind"_a, "hidden"_a, "intermediate"_a, "gate_up"_a, "gate_up_scales"_a.none(),
             "down"_a, "down_scales"_a.none(), "graph_safe"_a, "force_dequant"_a)
        .def(
            "forward",
            [](PyMoeLayer& l, const std::string& layout, const ServingTensor& x, const ServingTensor* scales,
               const std::string& scale_format, const ServingTensor& counts, const ServingTensor* offsets,
               const ServingTensor* m_indices, const ServingTensor& recv_weights, const std::string& placement,
               const ServingTensor& y, uintptr_t stream) {
                const MoeDispatchOutput d = dispatch_output(layout, x, scales, scale_format, counts, offsets, m_indices,
                                                            recv_weights, placement);
                nb::gil_scoped_release nogil;
                l.layer->forward(d, y.ref, as_stream(stream));
            },
            "layout"_a, "x"_a, "scales"_a.none(), "scale_format"_a, "counts"_a, "offsets"_a.none(),
            "m_indices"_a.none(), "recv_weights"_a, "placement"_a, "y"_a, "stream"_a)
        .def("forward_dense",
             [](PyMoeLayer& l, int expert, const ServingTensor& x, const ServingTensor& y, uintptr_t stream) {
                 nb::gil_scoped_release nogil;
                 l.layer->forward_dense(expert, x.ref, y.ref, as_stream(stream));
             })
        .def_prop_ro("path", [](const PyMoeLayer& l) { return std::string(gemm_path_name(l.layer->path())); })
        .def_prop_ro("path_note", [](const PyMoeLayer& l) { return l.layer->path_note(); })
        .def_prop_ro("num_local_experts", [](const PyMoeLayer& l) { return l.layer->num_local_experts(); });

    m.def("serving_synthetic_experts", &synthetic, "kind"_a, "first"_a, "count"_a, "hidden"_a, "intermediate"_a,
          "seed"_a, "threads"_a);
}

}  // namespace elasticep::python
