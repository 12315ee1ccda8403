// Reading outputs back and comparing them, without a test framework (unit, gpu and MPI tests alike).
// Device results are first copied to the host (to_host); then observe() reads every tensor through
// its strides into the oracle's canonical form (ref::RankDispatch). The compare functions return the
// differences as sentences (empty: equal); test frameworks turn them into failures.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/scenario.hpp"

namespace eptest {

// ---------------------------------------------------------------------------------------------
// Canonical reads of tensors through their strides

template <class T>
std::vector<T> read_2d(const TensorRef& t, int64_t rows, int64_t cols) {
    std::vector<T> out(static_cast<size_t>(rows * cols));
    const auto* base = static_cast<const T*>(t.data);
    const int64_t s0 = t.stride(0), s1 = t.stride(1);
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) out[static_cast<size_t>(i * cols + j)] = base[i * s0 + j * s1];
    return out;
}

// A [rows] or [A, B] (canonically A*B rows) tensor as a flat vector.
template <class T>
std::vector<T> read_rows(const TensorRef& t) {
    if (t.ndim() == 1)
        return read_2d<T>(TensorRef{t.data, t.dtype, {t.size(0), 1}, {t.stride(0), 1}, t.device}, t.size(0), 1);
    std::vector<T> out;
    const auto* base = static_cast<const T*>(t.data);
    for (int64_t a = 0; a < t.size(0); ++a)
        for (int64_t b = 0; b < t.size(1); ++b) out.push_back(base[a * t.stride(0) + b * t.stride(1)]);
    return out;
}

// A [rows, C] or [A, B, C] tensor (rows = A*B) as row-major [rows, C].
template <class T>
std::vector<T> read_matrix(const TensorRef& t) {
    if (t.ndim() == 2) return read_2d<T>(t, t.size(0), t.size(1));
    std::vector<T> out;
    const auto* base = static_cast<const T*>(t.data);
    for (int64_t a = 0; a < t.size(0); ++a)
        for (int64_t b = 0; b < t.size(1); ++b)
            for (int64_t c = 0; c < t.size(2); ++c)
                out.push_back(base[a * t.stride(0) + b * t.stride(1) + c * t.stride(2)]);
    return out;
}

// dtype, shape and strides of one output (present = false: the result has no such tensor).
struct TensorMeta {
    bool present = false;
    DType dtype = DType::kUInt8;
    std::vector<int64_t> shape, strides;
    bool operator==(const TensorMeta&) const = default;
};

inline TensorMeta meta_of(const TensorRef* t) {
    TensorMeta m;
    if (t == nullptr) return m;
    m.present = true;
    m.dtype = t->dtype;
    m.shape = t->shape;
    for (int i = 0; i < t->ndim(); ++i) m.strides.push_back(t->stride(i));
    return m;
}

// One rank's observed dispatch output, canonical like ref::RankDispatch.
struct Observed {
    int64_t rows = 0;
    std::vector<uint8_t> recv_x;
    std::vector<uint32_t> recv_scales;
    std::vector<float> recv_weights;
    std::vector<int32_t> recv_src, m_indices, counts, offsets;
    int64_t num_rows = -1;
    std::vector<int64_t> x_shape, scale_strides;
    // every output's layout: recv_x, recv_scales, recv_weights, recv_src, m_indices, counts, offsets, masked_m
    std::vector<TensorMeta> metas;
};

inline Observed observe(const DispatchResult& r, const BufferConfig& cfg) {
    Observed o;
    const bool fp8 = cfg.payload == Payload::kFP8;
    o.x_shape = r.recv_x.shape;
    o.rows = r.recv_x.ndim() == 2 ? r.recv_x.size(0) : r.recv_x.size(0) * r.recv_x.size(1);
    if (fp8) {
        o.recv_x = read_matrix<uint8_t>(r.recv_x);
    } else {
        const auto v = read_matrix<uint16_t>(r.recv_x);
        o.recv_x.resize(v.size() * 2);
        if (!v.empty()) std::memcpy(o.recv_x.data(), v.data(), o.recv_x.size());
    }
    if (r.recv_scales) {
        o.recv_scales = read_matrix<uint32_t>(*r.recv_scales);
        for (int i = 0; i < r.recv_scales->ndim(); ++i) o.scale_strides.push_back(r.recv_scales->stride(i));
    }
    o.recv_weights = read_rows<float>(r.recv_weights);
    o.recv_src = read_rows<int32_t>(r.recv_src);
    if (r.layout == Layout::kExpertContiguous) {
        o.m_indices = read_rows<int32_t>(r.m_indices);
        o.offsets = read_rows<int32_t>(r.offsets);
        o.counts = read_rows<int32_t>(r.counts);
    } else {
        o.counts = read_rows<int32_t>(r.masked_m);
    }
    o.num_rows = r.num_rows;
    const bool contiguous = r.layout == Layout::kExpertContiguous;
    o.metas = {meta_of(&r.recv_x),
               meta_of(r.recv_scales ? &*r.recv_scales : nullptr),
               meta_of(&r.recv_weights),
               meta_of(&r.recv_src),
               meta_of(contiguous ? &r.m_indices : nullptr),
               meta_of(&r.counts),
               meta_of(contiguous ? &r.offsets : nullptr),
               meta_of(contiguous ? nullptr : &r.masked_m)};
    return o;
}

// First difference of two equal-length sequences, or -1.
template <class A, class B>
int64_t first_diff(const std::vector<A>& a, const std::vector<B>& b) {
    if (a.size() != b.size()) return static_cast<int64_t>(std::min(a.size(), b.size()));
    for (size_t i = 0; i < a.size(); ++i)
        if (std::memcmp(&a[i], &b[i], sizeof(A)) != 0) return static_cast<int64_t>(i);
    return -1;
}

// Elements a strided view spans (0 for an empty one).
inline int64_t span_of(const TensorRef& t) {
    int64_t s = 1;
    for (int d = 0; d < t.ndim(); ++d) {
        if (t.size(d) == 0) return 0;
        s += (t.size(d) - 1) * t.stride(d);
    }
    return s;
}

// Copies from device (or host) memory to the host: copy(host_dst, src, bytes).
using CopyToHost = std::function<void(void*, const void*, size_t)>;

// A tensor copied to host memory (the bytes it spans, kept in `keep`), same shape and strides.
inline TensorRef tensor_to_host(const TensorRef& t, const CopyToHost& copy, std::vector<std::vector<uint8_t>>& keep) {
    TensorRef h = t;
    h.device = Device{};
    const size_t bytes = static_cast<size_t>(span_of(t)) * dtype_size(t.dtype);
    keep.emplace_back(bytes);  // (moving the outer vector keeps every inner buffer where it is)
    if (bytes) copy(keep.back().data(), t.data, bytes);
    h.data = bytes ? keep.back().data() : nullptr;
    return h;
}

// The result's tensors copied to host memory, same shapes and strides. The handle is not copied
// (combine consumes it before the outputs are read).
inline DispatchResult to_host(const DispatchResult& r, const CopyToHost& copy,
                              std::vector<std::vector<uint8_t>>& keep) {
    auto host = [&](const TensorRef& t) { return tensor_to_host(t, copy, keep); };
    DispatchResult v;
    v.layout = r.layout;
    v.recv_x = host(r.recv_x);
    if (r.recv_scales) v.recv_scales = host(*r.recv_scales);
    v.recv_weights = host(r.recv_weights);
    v.recv_src = host(r.recv_src);
    if (r.layout == Layout::kExpertContiguous) {
        v.m_indices = host(r.m_indices);
        v.offsets = host(r.offsets);
    }
    v.counts = host(r.counts);
    if (r.layout == Layout::kExpertMasked) v.masked_m = v.counts;
    v.num_rows = r.num_rows;
    return v;
}

// The differences between the oracle's expected dispatch outputs and a backend's. Padding rows'
// data and scales are compared only with zero_padding (SEMANTICS.md); their metadata always.
// `fatal`: the shapes differ, so nothing else could be compared.
inline std::vector<std::string> dispatch_mismatches(const ref::RankDispatch& want, const Observed& got,
                                                    const BufferConfig& cfg, bool zero_padding, bool* fatal = nullptr) {
    std::vector<std::string> out;
    auto add = [&](const std::string& s) { out.push_back(s); };
    auto num = [](auto v) {
        std::ostringstream os;
        os << v;
        return os.str();
    };
    if (fatal) *fatal = false;
    const bool fp8 = cfg.payload == Payload::kFP8;
    const size_t row_bytes = static_cast<size_t>(cfg.hidden) * (fp8 ? 1 : 2);
    const size_t scols = fp8 ? static_cast<size_t>(scale_columns(cfg.scale_format, cfg.hidden)) : 0;
    if (got.rows != want.rows) {
        add("rows: got " + num(got.rows) + ", want " + num(want.rows));
        if (fatal) *fatal = true;
        return out;
    }
    if (got.num_rows != want.num_rows) add("num_rows: got " + num(got.num_rows) + ", want " + num(want.num_rows));
    if (got.counts != want.counts) add("counts differ");
    if (!want.offsets.empty() && got.offsets != want.offsets) add("offsets differ");
    int64_t i = first_diff(got.recv_weights, want.recv_weights);
    if (i != -1) {
        const size_t at = static_cast<size_t>(i);
        add("recv_weights differ at row " + num(i) + ": got " +
            num(at < got.recv_weights.size() ? got.recv_weights[at] : 0.0f) + " want " +
            num(at < want.recv_weights.size() ? want.recv_weights[at] : 0.0f));
    }
    i = first_diff(got.recv_src, want.recv_src);
    if (i != -1) add("recv_src differ at row " + num(i));
    if (!want.m_indices.empty()) {
        i = first_diff(got.m_indices, want.m_indices);
        if (i != -1) add("m_indices differ at row " + num(i));
    }
    if (got.recv_x.size() != want.recv_x.size() || got.recv_scales.size() != want.recv_scales.size()) {
        add("recv_x / recv_scales sizes differ: got " + num(got.recv_x.size()) + " / " + num(got.recv_scales.size()) +
            ", want " + num(want.recv_x.size()) + " / " + num(want.recv_scales.size()));
        if (fatal) *fatal = true;
        return out;
    }
    int64_t bad_rows = 0, first_bad = -1;
    for (int64_t r = 0; r < want.rows; ++r) {
        if (!want.row_is_real[static_cast<size_t>(r)] && !zero_padding) continue;
        const bool x_same = std::memcmp(&got.recv_x[static_cast<size_t>(r) * row_bytes],
                                        &want.recv_x[static_cast<size_t>(r) * row_bytes], row_bytes) == 0;
        const bool s_same =
            scols == 0 || std::memcmp(&got.recv_scales[static_cast<size_t>(r) * scols],
                                      &want.recv_scales[static_cast<size_t>(r) * scols], scols * 4) == 0;
        if (!x_same || !s_same) {
            if (first_bad < 0) first_bad = r;
            ++bad_rows;
        }
    }
    if (bad_rows != 0)
        add(num(bad_rows) + " recv_x/recv_scales rows differ, first at row " + num(first_bad) +
            (!want.row_is_real[static_cast<size_t>(first_bad)] ? " (padding)" : ""));
    return out;
}

// Two backends' outputs of the same call: the same dtype, shape and strides for every tensor, and the
// same bytes wherever the contract defines them (`want`: the oracle's view of which rows are real).
inline std::vector<std::string> backend_mismatches(const Observed& a, const Observed& b, const ref::RankDispatch& want,
                                                   const BufferConfig& cfg, bool zero_padding) {
    static const char* const kNames[] = {"recv_x",    "recv_scales", "recv_weights", "recv_src",
                                         "m_indices", "counts",      "offsets",      "masked_m"};
    std::vector<std::string> out;
    for (size_t i = 0; i < a.metas.size() && i < b.metas.size(); ++i)
        if (!(a.metas[i] == b.metas[i])) out.push_back(std::string(kNames[i]) + ": dtype, shape or strides differ");
    if (a.metas.size() != b.metas.size()) out.push_back("the results hold different tensors");
    if (!out.empty()) return out;
    ref::RankDispatch as_ref;
    as_ref.rows = a.rows;
    as_ref.recv_x = a.recv_x;
    as_ref.recv_scales = a.recv_scales;
    as_ref.recv_weights = a.recv_weights;
    as_ref.recv_src = a.recv_src;
    as_ref.m_indices = a.m_indices;
    as_ref.counts = a.counts;
    as_ref.offsets = a.offsets;
    as_ref.row_is_real = want.row_is_real;
    as_ref.num_rows = a.num_rows;
    if (a.rows != want.rows)
        return {"rows: " + std::to_string(a.rows) + " vs the oracle's " + std::to_string(want.rows)};
    for (const std::string& m : dispatch_mismatches(as_ref, b, cfg, zero_padding)) out.push_back(m);
    return out;
}

// The first difference of two combine outputs ([T, H] bf16), or "" when equal.
inline std::string combine_mismatch(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int hidden) {
    const int64_t i = first_diff(got, want);
    if (i == -1) return "";
    std::ostringstream os;
    os << "combine differs at token " << i / hidden << " channel " << i % hidden << ": got 0x" << std::hex
       << (i < static_cast<int64_t>(got.size()) ? got[static_cast<size_t>(i)] : 0) << " want 0x"
       << (i < static_cast<int64_t>(want.size()) ? want[static_cast<size_t>(i)] : 0) << std::dec
       << (got.size() != want.size() ? " (sizes differ)" : "");
    // how much differs: the count of values, and the first tokens with a difference
    const size_t n = std::min(got.size(), want.size());
    int64_t values = 0;
    std::vector<int64_t> tokens;
    for (size_t j = 0; j < n; ++j) {
        if (got[j] == want[j]) continue;
        ++values;
        const int64_t t = static_cast<int64_t>(j) / hidden;
        if (tokens.size() < 8 && (tokens.empty() || tokens.back() != t)) tokens.push_back(t);
    }
    os << "; " << values << " of " << n << " values differ, in tokens";
    for (const int64_t t : tokens) os << " " << t;
    if (tokens.size() == 8) os << " ...";
    return os.str();
}

}  // namespace eptest
