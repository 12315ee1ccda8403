#include "core/outputs.hpp"

#include "core/check.hpp"
#include "core/layout.hpp"

namespace elasticep::detail {
namespace {

OutputSpec row_major(DType dtype, std::vector<int64_t> shape) {
    OutputSpec s;
    s.dtype = dtype;
    s.shape = std::move(shape);
    s.strides.resize(s.shape.size());
    int64_t st = 1;
    for (size_t i = s.shape.size(); i-- > 0;) {
        s.strides[i] = st;
        st *= s.shape[i];
    }
    s.storage_elems = st;
    return s;
}

}  // namespace

TensorRef OutputSpec::bind(void* data, Device device) const {
    TensorRef t;
    t.data = data;
    t.dtype = dtype;
    t.shape = shape;
    t.strides = strides;
    t.device = device;
    return t;
}

DispatchOutputSpecs dispatch_output_specs(const BufferConfig& cfg, int num_ranks, Layout layout, int64_t rows,
                                          bool mn_major) {
    const int64_t e_local = cfg.num_experts / num_ranks;
    const int64_t rc = int64_t{num_ranks} * cfg.max_tokens_per_rank;
    const bool fp8 = cfg.payload == Payload::kFP8;
    const DType xdt = fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
    const DType sdt = cfg.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32;
    const int64_t cols = fp8 ? scale_columns(cfg.scale_format, cfg.hidden) : 0;
    DispatchOutputSpecs o;
    if (layout == Layout::kExpertContiguous) {
        o.recv_x = row_major(xdt, {rows, cfg.hidden});
        o.recv_weights = row_major(DType::kFloat32, {rows});
        o.recv_src = row_major(DType::kInt32, {rows});
        o.m_indices = row_major(DType::kInt32, {rows});
        if (fp8) {
            if (mn_major) {
                OutputSpec s;
                s.dtype = sdt;
                s.shape = {rows, cols};
                s.strides = {1, mn_major_stride(rows)};
                s.storage_elems = cols * mn_major_stride(rows);
                o.recv_scales = s;
            } else {
                o.recv_scales = row_major(sdt, {rows, cols});
            }
        }
    } else {
        o.recv_x = row_major(xdt, {e_local, rc, cfg.hidden});
        o.recv_weights = row_major(DType::kFloat32, {e_local, rc});
        o.recv_src = row_major(DType::kInt32, {e_local, rc});
        if (fp8) {
            if (mn_major) {
                OutputSpec s;
                s.dtype = sdt;
                s.shape = {e_local, rc, cols};
                s.strides = {cols * mn_major_stride(rc), 1, mn_major_stride(rc)};
                s.storage_elems = e_local * cols * mn_major_stride(rc);
                o.recv_scales = s;
            } else {
                o.recv_scales = row_major(sdt, {e_local, rc, cols});
            }
        }
    }
    return o;
}

void check_output(const TensorRef& t, const OutputSpec& spec, Device device, const char* name) {
    TensorRef expect = spec.bind(nullptr, device);
    const bool strides_ok = t.strides == spec.strides || (t.is_contiguous() && expect.is_contiguous());
    const bool ok =
        t.dtype == spec.dtype && t.shape == spec.shape && t.device == device && t.data != nullptr && strides_ok;
    ELASTICEP_CHECK_ARG(ok, "caller-provided output ", name, " is ", t.describe(), " but this dispatch needs ",
                        expect.describe(), (expect.is_contiguous() ? "" : " (MN-major scale layout)"),
                        t.data == nullptr ? " (data pointer is null)" : "");
}

}  // namespace elasticep::detail
