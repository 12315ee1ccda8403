// Grouped-GEMM adapters (serving.hpp, part 4): argument checks, the CPU implementation, and the
// hand-off to the CUDA kernels for CUDA tensors. Both implementations follow the index maps and the
// arithmetic of src/kernels/moe/adapter_params.hpp; the gpu tests compare them byte for byte.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "elasticep/serving.hpp"
#include "kernels/moe/adapter_params.hpp"
#include "moe/moe_internal.hpp"

namespace elasticep {
namespace {

namespace km = kernels::moe;
using detail::cat;

constexpr int64_t kNoCap = int64_t{1} << 62;

void same_device(const TensorRef& t, const Device& d, const char* fn, const char* name) {
    ELASTICEP_CHECK_ARG(t.device == d, fn, ": ", name, " is on ", device_name(t.device), " but the data is on ",
                        device_name(d), "; every tensor of one call lives on one device");
    ELASTICEP_CHECK_ARG(t.data != nullptr || t.numel() == 0, fn, ": ", name, " has a null data pointer");
}

void check_vector(const TensorRef& t, DType dtype, int64_t n, const Device& d, const char* fn, const char* name) {
    ELASTICEP_CHECK_ARG(t.dtype == dtype && t.ndim() == 1 && t.size(0) == n, fn, ": ", name, " is ", t.describe(),
                        " but must be ", dtype_name(dtype), "[", n, "]");
    ELASTICEP_CHECK_ARG(n <= 1 || t.stride(0) == 1, fn, ": ", name, " must be contiguous");
    same_device(t, d, fn, name);
}

int32_t* status_ptr(const TensorRef& s, const Device& d, const char* fn) {
    check_vector(s, DType::kInt32, 1, d, fn, "status");
    return s.data_as<int32_t>();
}

// Rows of a [.., N, W] tensor as bytes; elements inside a row must be contiguous.
km::Rows rows_of(const TensorRef& t, const char* fn, const char* name) {
    const int nd = t.ndim();
    ELASTICEP_CHECK_ARG(t.size(nd - 1) <= 1 || t.stride(nd - 1) == 1, fn, ": ", name, " is ", t.describe(),
                        ": elements inside a row must be contiguous (stride 1)");
    const int64_t es = static_cast<int64_t>(dtype_size(t.dtype));
    km::Rows r;
    r.data = static_cast<uint8_t*>(t.data);
    r.row_stride = t.stride(nd - 2) * es;
    r.batch_stride = nd >= 3 ? t.stride(nd - 3) * es : 0;
    return r;
}

km::Scales scales_of(const TensorRef& t) {
    km::Scales s;
    const int nd = t.ndim();
    s.data = static_cast<uint32_t*>(t.data);
    s.sg = t.stride(nd - 1);
    s.sr = t.stride(nd - 2);
    s.sb = nd >= 3 ? t.stride(nd - 3) : 0;
    return s;
}

bool is_scale_dtype(DType d) { return d == DType::kFloat32 || d == DType::kInt32; }

void check_status_free_shapes(const TensorRef& t, const char* fn, const char* name) {
    for (int i = 0; i < t.ndim(); ++i)
        ELASTICEP_CHECK_ARG(t.size(i) >= 0, fn, ": ", name, " has a negative extent (", t.describe(), ")");
}

bool on_cuda(const Device& d) { return d.type == DeviceType::kCUDA; }

// ---- CPU implementations (the index maps of adapter_params.hpp, written as loops) ----------------

uint8_t* row_at(const km::Rows& r, int64_t b, int64_t i) { return r.data + b * r.batch_stride + i * r.row_stride; }
uint32_t& scale_at(const km::Scales& s, int64_t b, int64_t r, int64_t g) {
    return s.data[b * s.sb + r * s.sr + g * s.sg];
}

void copy_row(uint8_t* dst, const uint8_t* src, int64_t bytes, int64_t hidden, const float* weight) {
    if (!weight) {
        std::memmove(dst, src, static_cast<size_t>(bytes));
        return;
    }
    for (int64_t h = 0; h < hidden; ++h) {
        uint16_t v;
        std::memcpy(&v, src + 2 * h, 2);
        v = km::weighted_bf16(v, *weight);
        std::memcpy(dst + 2 * h, &v, 2);
    }
}

void cpu_masked_to_contiguous(const km::MaskedToContiguousParams& p) {
    int32_t faults = 0;
    std::vector<int64_t> count(static_cast<size_t>(p.num_experts)), start(static_cast<size_t>(p.num_experts) + 1);
    int64_t at = 0;
    for (int l = 0; l < p.num_experts; ++l) {
        count[l] = km::clamp_count(p.masked_m[l], p.slab_rows, faults);
        start[l] = at;
        at += km::round_up_a(count[l], p.alignment);
    }
    start[p.num_experts] = at;
    for (int l = 0; l <= p.num_experts; ++l) p.out_offsets[l] = static_cast<int32_t>(start[l]);
    if (at > p.out_rows) faults |= km::kFaultRows;
    for (int64_t i = 0; i < p.out_rows; ++i) {
        int32_t m = -1;
        if (i < at) {
            const int l = static_cast<int>(std::upper_bound(start.begin(), start.end(), i) - start.begin()) - 1;
            const int64_t r = i - start[l];
            uint8_t* dst = row_at(p.out_x, 0, i);
            if (r < count[l]) {
                m = l;
                copy_row(dst, row_at(p.x, l, r), p.row_bytes, p.hidden, p.weights ? p.weights + i : nullptr);
                for (int g = 0; g < p.scale_groups; ++g) scale_at(p.out_scales, 0, i, g) = scale_at(p.scales, l, r, g);
            } else {
                std::memset(dst, 0, static_cast<size_t>(p.row_bytes));
                for (int g = 0; g < p.scale_groups; ++g) scale_at(p.out_scales, 0, i, g) = 0;
            }
        }
        if (p.out_m_indices) p.out_m_indices[i] = m;
    }
    *p.status |= faults;
}

void cpu_contiguous_to_masked(const km::ContiguousToMaskedParams& p) {
    int32_t faults = 0;
    for (int l = 0; l < p.num_experts; ++l) {
        const int64_t c = km::segment_rows(p.counts[l], p.offsets[l], p.offsets[l + 1], p.slab_rows, p.in_rows, faults);
        if (p.out_masked_m) p.out_masked_m[l] = static_cast<int32_t>(c);
        for (int64_t r = 0; r < c; ++r) {
            const int64_t src = p.offsets[l] + r;
            copy_row(row_at(p.out_x, l, r), row_at(p.x, 0, src), p.row_bytes, p.hidden,
                     p.weights ? p.weights + l * p.weight_stride + r : nullptr);
            for (int g = 0; g < p.scale_groups; ++g) scale_at(p.out_scales, l, r, g) = scale_at(p.scales, 0, src, g);
        }
    }
    *p.status |= faults;
}

void cpu_m_indices(const km::MIndicesParams& p) {
    int32_t faults = 0;
    std::vector<int64_t> c(static_cast<size_t>(p.num_experts));
    for (int l = 0; l < p.num_experts; ++l)
        c[l] = km::segment_rows(p.counts[l], p.offsets[l], p.offsets[l + 1], kNoCap, p.rows, faults);
    for (int64_t i = 0; i < p.rows; ++i) {
        int32_t m = -1;
        for (int l = 0; l < p.num_experts && m < 0; ++l)  // the lowest expert whose segment holds i
            if (i >= p.offsets[l] && i < p.offsets[l] + c[l]) m = l;
        p.m_indices[i] = m;
    }
    *p.status |= faults;
}

void cpu_route_weights(const km::RouteWeightParams& p) {
    int32_t faults = 0;
    auto weigh = [&](int64_t b, int64_t r, float w) {
        const uint8_t* src = row_at(p.y, b, r);
        uint8_t* dst = row_at(p.out, b, r);
        copy_row(dst, src, 2 * p.hidden, p.hidden, &w);
    };
    if (p.masked) {
        for (int l = 0; l < p.num_experts; ++l) {
            const int64_t c = km::clamp_count(p.counts[l], p.slab_rows, faults);
            for (int64_t r = 0; r < c; ++r) weigh(l, r, p.weights[l * p.weight_stride + r]);
        }
    } else {
        for (int64_t i = 0; i < p.slab_rows; ++i)
            if (p.m_indices[i] >= 0) weigh(0, i, p.weights[i]);
    }
    *p.status |= faults;
}

void cpu_scale_convert(const km::ScaleConvertParams& p) {
    const int64_t lanes = std::max(p.rows, p.dst_pad_rows);
    for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t g = 0; g < p.groups; ++g)
            for (int64_t r = 0; r < lanes; ++r) {
                uint32_t v = 0;
                if (r < p.rows)
                    v = p.to_ue8m0 ? km::ue8m0_word(p.src, b, r, g, p.src_groups) : scale_at(p.src, b, r, g);
                scale_at(p.dst, b, r, g) = v;
            }
}

// ---- shared checks ---------------------------------------------------------------------------

// MN-major TMA-aligned: strides (.., 1, round_up(rows, 4)) with more than one column.
bool is_mn_major(const TensorRef& t) {
    const int nd = t.ndim();
    const int64_t rows = t.size(nd - 2), cols = t.size(nd - 1);
    return rows > 0 && cols > 1 && t.stride(nd - 2) == 1 && t.stride(nd - 1) == (rows + 3) / 4 * 4;
}

void check_scale_pair(const TensorRef& src, const TensorRef& dst, const char* fn) {
    ELASTICEP_CHECK_ARG(src.ndim() == dst.ndim() && (src.ndim() == 2 || src.ndim() == 3), fn, ": src ", src.describe(),
                        " and dst ", dst.describe(), " must both be [rows, G] or [B, rows, G]");
    same_device(dst, src.device, fn, "dst");
    same_device(src, src.device, fn, "src");
}

}  // namespace

// =============================================================================================

void check_adapter_status(const TensorRef& status, void* stream) {
    const Device d = status.device;
    int32_t* s = status_ptr(status, d, "check_adapter_status");
    int32_t bits;
    if (on_cuda(d)) {
        bits = detail::cuda_read_and_clear_status(s, d.index, stream);
    } else {
        bits = *s;
        *s = 0;
    }
    if (bits == 0) return;
    std::string what;
    auto add = [&](const char* text) { what += (what.empty() ? "" : "; ") + std::string(text); };
    if (bits & kAdapterCountOverflow) add("a count exceeded the slab's rows per expert (clamped to them)");
    if (bits & kAdapterRowsOverflow)
        add("the layout needed more contiguous rows than the tensor has (rows past its end were dropped)");
    if (bits & kAdapterBadLayout)
        add("a negative count, decreasing offsets or a segment shorter than its count (that expert was skipped)");
    throw Error(ErrorCode::kCapacityExceeded,
                cat("grouped-GEMM adapter fault (status ", bits, "): ", what,
                    ". Pass the dispatch's own counts/offsets, and outputs sized for its layout: contiguous rows >= "
                    "Buffer::max_contiguous_rows(alignment), slab rows >= R * max_tokens_per_rank"));
}

void m_indices_from_offsets(const TensorRef& counts, const TensorRef& offsets, const TensorRef& m_indices,
                            const TensorRef& status, void* stream) {
    const char* fn = "m_indices_from_offsets";
    const Device d = m_indices.device;
    ELASTICEP_CHECK_ARG(counts.ndim() == 1, fn, ": counts is ", counts.describe(), " but must be int32[E_local]");
    const int64_t e = counts.size(0);
    ELASTICEP_CHECK_ARG(e >= 1 && e <= km::kMaxLocalExperts, fn, ": ", e, " local experts; must be in [1, ",
                        km::kMaxLocalExperts, "]");
    check_vector(counts, DType::kInt32, e, d, fn, "counts");
    check_vector(offsets, DType::kInt32, e + 1, d, fn, "offsets");
    ELASTICEP_CHECK_ARG(m_indices.ndim() == 1, fn, ": m_indices is ", m_indices.describe(), " but must be int32[rows]");
    check_vector(m_indices, DType::kInt32, m_indices.size(0), d, fn, "m_indices");
    km::MIndicesParams p;
    p.num_experts = static_cast<int>(e);
    p.rows = m_indices.size(0);
    p.counts = counts.data_as<int32_t>();
    p.offsets = offsets.data_as<int32_t>();
    p.m_indices = m_indices.data_as<int32_t>();
    p.status = status_ptr(status, d, fn);
    if (on_cuda(d))
        detail::cuda_m_indices(p, d.index, stream);
    else
        cpu_m_indices(p);
}

void masked_to_contiguous(const MaskedToContiguousArgs& a) {
    const char* fn = "masked_to_contiguous";
    const Device d = a.x.device;
    ELASTICEP_CHECK_ARG(a.x.ndim() == 3, fn, ": x is ", a.x.describe(), " but must be the slab [E_local, S, W]");
    check_status_free_shapes(a.x, fn, "x");
    const int64_t e = a.x.size(0), s = a.x.size(1), w = a.x.size(2);
    ELASTICEP_CHECK_ARG(e >= 1 && e <= km::kMaxLocalExperts, fn, ": ", e, " local experts; must be in [1, ",
                        km::kMaxLocalExperts, "]");
    same_device(a.x, d, fn, "x");
    ELASTICEP_CHECK_ARG(a.out_x.ndim() == 2 && a.out_x.size(1) == w && a.out_x.dtype == a.x.dtype, fn, ": out_x is ",
                        a.out_x.describe(), " but must be ", dtype_name(a.x.dtype), "[rows, ", w, "]");
    same_device(a.out_x, d, fn, "out_x");
    const int64_t mc = a.out_x.size(0);
    ELASTICEP_CHECK_ARG(a.expert_alignment >= 1 && a.expert_alignment <= (1 << 16), fn,
                        ": expert_alignment=", a.expert_alignment, " must be in [1, 65536]");
    ELASTICEP_CHECK_ARG(e * (s + a.expert_alignment - 1) < (int64_t{1} << 31), fn,
                        ": E_local * (S + A - 1) = ", e * (s + a.expert_alignment - 1), " overflows int32 offsets");
    ELASTICEP_CHECK_ARG(mc < (int64_t{1} << 31), fn, ": out_x has ", mc, " rows; at most 2^31 - 1");
    check_vector(a.masked_m, DType::kInt32, e, d, fn, "masked_m");
    check_vector(a.out_offsets, DType::kInt32, e + 1, d, fn, "out_offsets");
    if (a.out_m_indices) check_vector(*a.out_m_indices, DType::kInt32, mc, d, fn, "out_m_indices");
    km::MaskedToContiguousParams p;
    p.num_experts = static_cast<int>(e);
    p.slab_rows = s;
    p.alignment = a.expert_alignment;
    p.out_rows = mc;
    p.hidden = w;
    p.row_bytes = w * static_cast<int64_t>(dtype_size(a.x.dtype));
    p.x = rows_of(a.x, fn, "x");
    p.out_x = rows_of(a.out_x, fn, "out_x");
    p.masked_m = a.masked_m.data_as<int32_t>();
    ELASTICEP_CHECK_ARG(a.scales.has_value() == a.out_scales.has_value(), fn,
                        ": give scales and out_scales together, or neither");
    if (a.scales) {
        const TensorRef& sc = *a.scales;
        const TensorRef& os = *a.out_scales;
        ELASTICEP_CHECK_ARG(sc.ndim() == 3 && sc.size(0) == e && sc.size(1) == s && is_scale_dtype(sc.dtype), fn,
                            ": scales is ", sc.describe(), " but must be fp32/int32 [", e, ", ", s, ", G]");
        ELASTICEP_CHECK_ARG(os.ndim() == 2 && os.size(0) == mc && os.size(1) == sc.size(2) && os.dtype == sc.dtype, fn,
                            ": out_scales is ", os.describe(), " but must be ", dtype_name(sc.dtype), "[", mc, ", ",
                            sc.size(2), "]");
        same_device(sc, d, fn, "scales");
        same_device(os, d, fn, "out_scales");
        p.scale_groups = static_cast<int>(sc.size(2));
        p.scales = scales_of(sc);
        p.out_scales = scales_of(os);
    }
    p.out_offsets = a.out_offsets.data_as<int32_t>();
    p.out_m_indices = a.out_m_indices ? a.out_m_indices->data_as<int32_t>() : nullptr;
    if (a.weights) {
        ELASTICEP_CHECK_ARG(a.x.dtype == DType::kBFloat16, fn, ": fused route weights need bf16 rows; x is ",
                            a.x.describe());
        check_vector(*a.weights, DType::kFloat32, mc, d, fn, "weights");
        p.weights = a.weights->data_as<float>();
    }
    p.status = status_ptr(a.status, d, fn);
    if (on_cuda(d))
        detail::cuda_masked_to_contiguous(p, d.index, a.stream);
    else
        cpu_masked_to_contiguous(p);
}

void contiguous_to_masked(const ContiguousToMaskedArgs& a) {
    const char* fn = "contiguous_to_masked";
    const Device d = a.x.device;
    ELASTICEP_CHECK_ARG(a.x.ndim() == 2, fn, ": x is ", a.x.describe(), " but must be [rows, W]");
    ELASTICEP_CHECK_ARG(a.out_x.ndim() == 3 && a.out_x.size(2) == a.x.size(1) && a.out_x.dtype == a.x.dtype, fn,
                        ": out_x is ", a.out_x.describe(), " but must be the slab ", dtype_name(a.x.dtype),
                        "[E_local, S, ", a.x.size(1), "]");
    check_status_free_shapes(a.out_x, fn, "out_x");
    same_device(a.x, d, fn, "x");
    same_device(a.out_x, d, fn, "out_x");
    const int64_t e = a.out_x.size(0), s = a.out_x.size(1), w = a.x.size(1), mc = a.x.size(0);
    ELASTICEP_CHECK_ARG(e >= 1 && e <= km::kMaxLocalExperts, fn, ": ", e, " local experts; must be in [1, ",
                        km::kMaxLocalExperts, "]");
    check_vector(a.counts, DType::kInt32, e, d, fn, "counts");
    check_vector(a.offsets, DType::kInt32, e + 1, d, fn, "offsets");
    if (a.out_masked_m) check_vector(*a.out_masked_m, DType::kInt32, e, d, fn, "out_masked_m");
    km::ContiguousToMaskedParams p;
    p.num_experts = static_cast<int>(e);
    p.slab_rows = s;
    p.in_rows = mc;
    p.hidden = w;
    p.row_bytes = w * static_cast<int64_t>(dtype_size(a.x.dtype));
    p.x = rows_of(a.x, fn, "x");
    p.out_x = rows_of(a.out_x, fn, "out_x");
    p.counts = a.counts.data_as<int32_t>();
    p.offsets = a.offsets.data_as<int32_t>();
    ELASTICEP_CHECK_ARG(a.scales.has_value() == a.out_scales.has_value(), fn,
                        ": give scales and out_scales together, or neither");
    if (a.scales) {
        const TensorRef& sc = *a.scales;
        const TensorRef& os = *a.out_scales;
        ELASTICEP_CHECK_ARG(sc.ndim() == 2 && sc.size(0) == mc && is_scale_dtype(sc.dtype), fn, ": scales is ",
                            sc.describe(), " but must be fp32/int32 [", mc, ", G]");
        ELASTICEP_CHECK_ARG(
            os.ndim() == 3 && os.size(0) == e && os.size(1) == s && os.size(2) == sc.size(1) && os.dtype == sc.dtype,
            fn, ": out_scales is ", os.describe(), " but must be ", dtype_name(sc.dtype), "[", e, ", ", s, ", ",
            sc.size(1), "]");
        same_device(sc, d, fn, "scales");
        same_device(os, d, fn, "out_scales");
        p.scale_groups = static_cast<int>(sc.size(1));
        p.scales = scales_of(sc);
        p.out_scales = scales_of(os);
    }
    if (a.out_masked_m) p.out_masked_m = a.out_masked_m->data_as<int32_t>();
    if (a.weights) {
        const TensorRef& wt = *a.weights;
        ELASTICEP_CHECK_ARG(a.x.dtype == DType::kBFloat16, fn, ": fused route weights need bf16 rows; x is ",
                            a.x.describe());
        ELASTICEP_CHECK_ARG(wt.dtype == DType::kFloat32 && wt.ndim() == 2 && wt.size(0) == e && wt.size(1) == s &&
                                (s <= 1 || wt.stride(1) == 1),
                            fn, ": weights is ", wt.describe(), " but must be fp32[", e, ", ", s,
                            "] with contiguous rows (a masked dispatch's recv_weights)");
        same_device(wt, d, fn, "weights");
        p.weights = wt.data_as<float>();
        p.weight_stride = wt.stride(0);
    }
    p.status = status_ptr(a.status, d, fn);
    if (on_cuda(d))
        detail::cuda_contiguous_to_masked(p, d.index, a.stream);
    else
        cpu_contiguous_to_masked(p);
}

void apply_route_weights(const TensorRef& y, const TensorRef& weights, const TensorRef& rows_or_counts,
                         const TensorRef& out, const TensorRef& status, void* stream) {
    const char* fn = "apply_route_weights";
    const Device d = y.device;
    ELASTICEP_CHECK_ARG(y.dtype == DType::kBFloat16 && (y.ndim() == 2 || y.ndim() == 3), fn, ": y is ", y.describe(),
                        " but must be bf16 [E_local, S, H] (masked) or [M, H] (contiguous)");
    ELASTICEP_CHECK_ARG(out.dtype == DType::kBFloat16 && out.shape == y.shape, fn, ": out is ", out.describe(),
                        " but must have y's shape and dtype (", y.describe(), ")");
    same_device(y, d, fn, "y");
    same_device(out, d, fn, "out");
    check_status_free_shapes(y, fn, "y");
    km::RouteWeightParams p;
    p.masked = y.ndim() == 3;
    p.y = rows_of(y, fn, "y");
    p.out = rows_of(out, fn, "out");
    p.hidden = y.size(y.ndim() - 1);
    if (p.masked) {
        const int64_t e = y.size(0), s = y.size(1);
        ELASTICEP_CHECK_ARG(weights.dtype == DType::kFloat32 && weights.ndim() == 2 && weights.size(0) == e &&
                                weights.size(1) == s && (s <= 1 || weights.stride(1) == 1),
                            fn, ": weights is ", weights.describe(), " but must be fp32[", e, ", ", s, "]");
        same_device(weights, d, fn, "weights");
        check_vector(rows_or_counts, DType::kInt32, e, d, fn, "masked_m");
        p.num_experts = static_cast<int>(e);
        p.slab_rows = s;
        p.weight_stride = weights.stride(0);
        p.counts = rows_or_counts.data_as<int32_t>();
    } else {
        const int64_t m = y.size(0);
        check_vector(weights, DType::kFloat32, m, d, fn, "weights");
        check_vector(rows_or_counts, DType::kInt32, m, d, fn, "m_indices");
        p.slab_rows = m;
        p.m_indices = rows_or_counts.data_as<int32_t>();
    }
    p.weights = weights.data_as<float>();
    p.status = status_ptr(status, d, fn);
    if (on_cuda(d))
        detail::cuda_route_weights(p, d.index, stream);
    else
        cpu_route_weights(p);
}

namespace {

km::ScaleConvertParams scale_params(const TensorRef& src, const TensorRef& dst, bool to_ue8m0) {
    km::ScaleConvertParams p;
    const int nd = src.ndim();
    p.batch = nd == 3 ? src.size(0) : 1;
    p.rows = src.size(nd - 2);
    p.src_groups = src.size(nd - 1);
    p.groups = dst.size(nd - 1);
    p.src = scales_of(src);
    p.dst = scales_of(dst);
    p.dst_pad_rows = is_mn_major(dst) ? (p.rows + 3) / 4 * 4 : p.rows;
    p.to_ue8m0 = to_ue8m0;
    return p;
}

void run_scale_convert(const km::ScaleConvertParams& p, const Device& d, void* stream) {
    if (p.batch * p.rows * p.groups == 0) return;
    if (on_cuda(d))
        detail::cuda_scale_convert(p, d.index, stream);
    else
        cpu_scale_convert(p);
}

}  // namespace

void convert_scale_layout(const TensorRef& src, const TensorRef& dst, void* stream) {
    const char* fn = "convert_scale_layout";
    check_scale_pair(src, dst, fn);
    ELASTICEP_CHECK_ARG(src.shape == dst.shape && src.dtype == dst.dtype && is_scale_dtype(src.dtype), fn, ": src ",
                        src.describe(), " and dst ", dst.describe(), " must be fp32 or int32 of one shape");
    run_scale_convert(scale_params(src, dst, false), src.device, stream);
}

void fp32_scales_to_ue8m0(const TensorRef& src, const TensorRef& dst, void* stream) {
    const char* fn = "fp32_scales_to_ue8m0";
    check_scale_pair(src, dst, fn);
    const int nd = src.ndim();
    const int64_t g = src.size(nd - 1);
    std::vector<int64_t> want = src.shape;
    want[static_cast<size_t>(nd - 1)] = (g + 3) / 4;
    ELASTICEP_CHECK_ARG(src.dtype == DType::kFloat32, fn, ": src is ", src.describe(), " but must be fp32");
    ELASTICEP_CHECK_ARG(dst.dtype == DType::kInt32 && dst.shape == want, fn, ": dst is ", dst.describe(),
                        " but must be int32 with ceil(G/4) = ", (g + 3) / 4, " packed words per row");
    run_scale_convert(scale_params(src, dst, true), src.device, stream);
}

}  // namespace elasticep
