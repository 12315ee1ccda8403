// The reference MoE layer (serving.hpp, part 5): argument checks, the CPU path (plain loops), and
// the hand-off to the cuBLASLt path (moe_layer_cuda.cu) on a GPU.
//
// CPU arithmetic, per real row and local expert (fp32 throughout, sums in ascending index order):
//   bf16 weights:  g[n] = bf16(sum_k x[k] * W1[n][k]);  h[j] = bf16(silu(g[j]) * g[I + j]);
//                  y[n] = bf16(sum_j h[j] * W2[n][j])
//   FP8 weights:   g[n] = bf16(sum_kb (sx[kb] * sw1[n/128][kb]) * (sum_{k in kb} q(x_k) * q(W1[n][k])));
//                  h = silu(g[j]) * g[I + j] quantized per 1x128 group (amax floored at 1e-4,
//                  scale = amax / 448, q = e4m3(h * (448 / amax)));  y[n] likewise from (q(h), sh)
//   silu(v) = v / (1 + exp(-v)).
// The GPU path runs the same steps through cuBLASLt; its accumulation order differs, so the two
// agree within the bound docs/SERVING.md derives, not bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "core/numerics.hpp"
#include "elasticep/serving.hpp"
#include "moe/moe_internal.hpp"

namespace elasticep {

const char* gemm_path_name(GemmPath p) {
    switch (p) {
        case GemmPath::kCpuLoops:
            return "cpu-loops";
        case GemmPath::kCublasLtBf16:
            return "cublaslt-bf16";
        case GemmPath::kCublasLtFp8Blocked:
            return "cublaslt-fp8-blockscaled";
        case GemmPath::kCublasLtDequant:
            return "cublaslt-dequant-bf16";
    }
    return "?";
}

namespace {

using detail::cat;

void check_weight(const TensorRef& t, DType dtype, std::vector<int64_t> shape, const Device& dev, const char* name) {
    const TensorRef want = TensorRef::contiguous(nullptr, dtype, shape, dev);
    ELASTICEP_CHECK_ARG(t.dtype == dtype && t.shape == shape && t.device == dev && t.is_contiguous() &&
                            (t.data != nullptr || t.numel() == 0),
                        "ReferenceMoeLayer: ", name, " is ", t.describe(), " but must be contiguous ", want.describe());
}

void validate_weights(const ExpertWeights& w, const Device& dev) {
    const char* fn = "ReferenceMoeLayer";
    ELASTICEP_CHECK_ARG(w.kind == ExpertQuantKind::kBF16 || w.kind == ExpertQuantKind::kFP8Block128, fn,
                        ": MXFP8 experts (1x32 UE8M0 blocks) have no reference path; use bf16 or FP8 128x128 weights");
    ELASTICEP_CHECK_ARG(w.hidden >= 1 && w.intermediate >= 1, fn, ": hidden=", w.hidden,
                        ", intermediate=", w.intermediate, " must be positive");
    ELASTICEP_CHECK_ARG(w.gate_up.ndim() == 3 && w.gate_up.size(0) >= 1, fn, ": gate_up is ", w.gate_up.describe(),
                        " but must be [E_local, 2*intermediate, hidden]");
    const int64_t e = w.gate_up.size(0), h = w.hidden, i = w.intermediate;
    const bool fp8 = w.kind == ExpertQuantKind::kFP8Block128;
    const DType dt = fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
    check_weight(w.gate_up, dt, {e, 2 * i, h}, dev, "gate_up");
    check_weight(w.down, dt, {e, h, i}, dev, "down");
    if (fp8) {
        ELASTICEP_CHECK_ARG(h % 128 == 0 && i % 128 == 0, fn, ": FP8 128x128 blocks need hidden (", h,
                            ") and intermediate (", i, ") to be multiples of 128");
        ELASTICEP_CHECK_ARG(w.gate_up_scales && w.down_scales, fn, ": FP8 weights need gate_up_scales and down_scales");
        check_weight(*w.gate_up_scales, DType::kFloat32, {e, 2 * i / 128, h / 128}, dev, "gate_up_scales");
        check_weight(*w.down_scales, DType::kFloat32, {e, h / 128, i / 128}, dev, "down_scales");
    } else {
        ELASTICEP_CHECK_ARG(!w.gate_up_scales && !w.down_scales, fn, ": bf16 weights take no scales");
    }
}

float silu(float v) { return v / (1.0f + std::exp(-v)); }

// Value of activation scale (row, group g) of a dispatch output (f32_g128 or ue8m0_g128), read
// through the tensor's strides: [E, S, cols] masked (batch b) or [M, cols] contiguous.
float activation_scale(const TensorRef& s, ScaleFormat f, int64_t b, int64_t row, int64_t g) {
    const int nd = s.ndim();
    const int64_t base = (nd == 3 ? b * s.stride(0) : 0) + row * s.stride(nd - 2);
    if (f == ScaleFormat::kF32G128) return s.data_as<const float>()[base + g * s.stride(nd - 1)];
    const uint32_t word = s.data_as<const uint32_t>()[base + (g / 4) * s.stride(nd - 1)];
    return num::ue8m0_value(static_cast<uint8_t>(word >> (8 * (g % 4))));
}

}  // namespace

// ---- CPU path ----------------------------------------------------------------------------------

class CpuMoeLayer : public detail::MoeLayerBackend {
 public:
    explicit CpuMoeLayer(const ExpertWeights& w) : w_(w) {
        note_ = "CPU: plain loops with fp32 accumulation";
        for (int c = 0; c < 256; ++c) e4m3_[c] = num::e4m3_to_float(static_cast<uint8_t>(c));
    }

    void forward(const MoeDispatchOutput& in, const TensorRef& y, void*) override {
        const bool masked = in.layout == Layout::kExpertMasked;
        const int64_t e = w_.gate_up.size(0);
        const int32_t* counts = (masked ? in.masked_m : in.counts).data_as<const int32_t>();
        for (int64_t l = 0; l < e; ++l) {
            const int64_t n = masked ? std::min<int64_t>(counts[l], in.hidden_states.size(1)) : counts[l];
            if (n <= 0) continue;
            load_expert(l);
            const int64_t start = masked ? 0 : in.offsets.data_as<const int32_t>()[l];
            const int64_t b = masked ? l : 0;
            for (int64_t r = 0; r < n; ++r) {
                const int64_t row = start + r;
                read_row(in, b, row);
                run_row();
                write_row(y, b, row);
            }
        }
        if (in.weight_placement == WeightPlacement::kAdapter) {  // the route weights, real rows only
            int32_t status = 0;
            const TensorRef st = TensorRef::contiguous(&status, DType::kInt32, {1});
            apply_route_weights(y, in.recv_weights, masked ? in.masked_m : in.m_indices, y, st);
            check_adapter_status(st);
        }
    }

    void forward_dense(int l, const TensorRef& x, const TensorRef& y, void*) override {
        load_expert(l);
        const int64_t h = w_.hidden;
        for (int64_t t = 0; t < x.size(0); ++t) {
            const uint16_t* src = x.data_as<const uint16_t>() + t * x.stride(0);
            if (w_.kind == ExpertQuantKind::kFP8Block128) {  // quantize as dispatch does (f32_g128)
                xs_.assign(static_cast<size_t>(h / 128), 0.0f);
                xq_.assign(static_cast<size_t>(h), 0.0f);
                for (int64_t g = 0; g < h / 128; ++g) {
                    float amax = 0.0f;
                    for (int64_t i = 0; i < 128; ++i)
                        amax = num::fmax_ignore_nan(amax, num::abs_bits(num::bf16_to_float(src[g * 128 + i])));
                    amax = num::fmax_ignore_nan(amax, num::kAmaxFloor);
                    xs_[g] = amax / num::kE4M3Max;
                    const float mul = num::kE4M3Max / amax;
                    for (int64_t i = 0; i < 128; ++i)
                        xq_[g * 128 + i] = e4m3_[num::float_to_e4m3(num::bf16_to_float(src[g * 128 + i]) * mul)];
                }
            } else {
                xq_.resize(static_cast<size_t>(h));
                for (int64_t i = 0; i < h; ++i) xq_[i] = num::bf16_to_float(src[i]);
            }
            run_row();
            uint16_t* dst = y.data_as<uint16_t>() + t * y.stride(0);
            for (int64_t i = 0; i < h; ++i) dst[i] = out_[i];
        }
    }

    GemmPath path() const override { return GemmPath::kCpuLoops; }
    const std::string& note() const override { return note_; }

 private:
    // Expert l's weights as fp32 (FP8: the E4M3 values; the block scales stay apart).
    void load_expert(int64_t l) {
        if (l == loaded_) return;
        const int64_t h = w_.hidden, i = w_.intermediate;
        auto load = [&](const TensorRef& t, int64_t n, std::vector<float>& out) {
            out.resize(static_cast<size_t>(n));
            if (w_.kind == ExpertQuantKind::kFP8Block128) {
                const uint8_t* q = t.data_as<const uint8_t>() + l * n;
                for (int64_t k = 0; k < n; ++k) out[k] = e4m3_[q[k]];
            } else {
                const uint16_t* q = t.data_as<const uint16_t>() + l * n;
                for (int64_t k = 0; k < n; ++k) out[k] = num::bf16_to_float(q[k]);
            }
        };
        load(w_.gate_up, 2 * i * h, w1_);
        load(w_.down, h * i, w2_);
        if (w_.kind == ExpertQuantKind::kFP8Block128) {
            s1_ = w_.gate_up_scales->data_as<const float>() + l * (2 * i / 128) * (h / 128);
            s2_ = w_.down_scales->data_as<const float>() + l * (h / 128) * (i / 128);
        }
        loaded_ = l;
    }

    void read_row(const MoeDispatchOutput& in, int64_t b, int64_t row) {
        const TensorRef& x = in.hidden_states;
        const int nd = x.ndim();
        const int64_t h = w_.hidden;
        const int64_t at = (nd == 3 ? b * x.stride(0) : 0) + row * x.stride(nd - 2);
        xq_.resize(static_cast<size_t>(h));
        if (w_.kind == ExpertQuantKind::kFP8Block128) {
            ELASTICEP_CHECK_ARG(x.dtype == DType::kFloat8E4M3 && in.hidden_states_scale.has_value(),
                                "ReferenceMoeLayer: FP8 experts need an fp8 dispatch with scales; got ", x.describe());
            ELASTICEP_CHECK(in.scale_format != ScaleFormat::kUE8M0G32, ErrorCode::kUnsupported,
                            "ReferenceMoeLayer: 1x32 (MXFP8) activation scales do not fit 128x128 FP8 weights");
            const uint8_t* q = x.data_as<const uint8_t>() + at;
            for (int64_t k = 0; k < h; ++k) xq_[k] = e4m3_[q[k]];
            xs_.resize(static_cast<size_t>(h / 128));
            for (int64_t g = 0; g < h / 128; ++g)
                xs_[g] = activation_scale(*in.hidden_states_scale, in.scale_format, b, row, g);
        } else {
            ELASTICEP_CHECK_ARG(x.dtype == DType::kBFloat16,
                                "ReferenceMoeLayer: bf16 experts need a bf16 dispatch; got ", x.describe());
            const uint16_t* q = x.data_as<const uint16_t>() + at;
            for (int64_t k = 0; k < h; ++k) xq_[k] = num::bf16_to_float(q[k]);
        }
    }

    // out_ = FFN(xq_, xs_) as bf16 bits.
    void run_row() {
        const int64_t h = w_.hidden, i = w_.intermediate;
        const bool fp8 = w_.kind == ExpertQuantKind::kFP8Block128;
        g_.resize(static_cast<size_t>(2 * i));
        gemm_row(xq_.data(), xs_.data(), w1_.data(), s1_, 2 * i, h, g_.data());
        hq_.resize(static_cast<size_t>(i));
        hs_.assign(static_cast<size_t>(fp8 ? i / 128 : 0), 0.0f);
        std::vector<float> act(static_cast<size_t>(i));
        for (int64_t j = 0; j < i; ++j) act[j] = silu(g_[j]) * g_[i + j];
        if (fp8) {
            for (int64_t gi = 0; gi < i / 128; ++gi) {
                float amax = 0.0f;
                for (int64_t j = 0; j < 128; ++j) amax = num::fmax_ignore_nan(amax, num::abs_bits(act[gi * 128 + j]));
                amax = num::fmax_ignore_nan(amax, num::kAmaxFloor);
                hs_[gi] = amax / num::kE4M3Max;
                const float mul = num::kE4M3Max / amax;
                for (int64_t j = 0; j < 128; ++j)
                    hq_[gi * 128 + j] = e4m3_[num::float_to_e4m3(act[gi * 128 + j] * mul)];
            }
        } else {
            for (int64_t j = 0; j < i; ++j) hq_[j] = num::bf16_to_float(num::float_to_bf16(act[j]));
        }
        std::vector<float> out(static_cast<size_t>(h));
        gemm_row(hq_.data(), hs_.data(), w2_.data(), s2_, h, i, out.data());
        out_.resize(static_cast<size_t>(h));
        for (int64_t n = 0; n < h; ++n) out_[n] = num::float_to_bf16(out[n]);
    }

    // out[n] = bf16-rounded dot(x, W[n]) (FP8: per 128-block products scaled by sx * sw).
    void gemm_row(const float* x, const float* sx, const float* w, const float* sw, int64_t n_out, int64_t k,
                  float* out) const {
        const bool fp8 = w_.kind == ExpertQuantKind::kFP8Block128;
        for (int64_t n = 0; n < n_out; ++n) {
            const float* wr = w + n * k;
            float acc = 0.0f;
            if (fp8) {
                for (int64_t kb = 0; kb < k / 128; ++kb) {
                    float inner = 0.0f;
                    for (int64_t j = kb * 128; j < kb * 128 + 128; ++j) inner += x[j] * wr[j];
                    acc += (sx[kb] * sw[(n / 128) * (k / 128) + kb]) * inner;
                }
            } else {
                for (int64_t j = 0; j < k; ++j) acc += x[j] * wr[j];
            }
            out[n] = num::bf16_to_float(num::float_to_bf16(acc));
        }
    }

    void write_row(const TensorRef& y, int64_t b, int64_t row) {
        const int nd = y.ndim();
        uint16_t* dst = y.data_as<uint16_t>() + (nd == 3 ? b * y.stride(0) : 0) + row * y.stride(nd - 2);
        for (int64_t n = 0; n < w_.hidden; ++n) dst[n] = out_[n];
    }

    ExpertWeights w_;
    std::string note_;
    float e4m3_[256];
    int64_t loaded_ = -1;
    std::vector<float> w1_, w2_, xq_, xs_, g_, hq_, hs_;
    std::vector<uint16_t> out_;
    const float* s1_ = nullptr;
    const float* s2_ = nullptr;
};

// ---- the public class --------------------------------------------------------------------------

struct ReferenceMoeLayer::Impl {
    ExpertWeights weights;
    Device device;
    MoeLayerOptions options;
    std::unique_ptr<detail::MoeLayerBackend> backend;
};

ReferenceMoeLayer::ReferenceMoeLayer(const ExpertWeights& weights, Device device, MoeLayerOptions options)
    : impl_(std::make_unique<Impl>()) {
    validate_weights(weights, device);
    impl_->weights = weights;
    impl_->device = device;
    impl_->options = options;
    if (device.type == DeviceType::kCUDA) {
        ELASTICEP_CHECK(detail::moe_cuda_compiled(), ErrorCode::kUnsupported, "ReferenceMoeLayer: the weights are on ",
                        device_name(device), " but this build has no CUDA; rebuild with nvcc, or pass host weights");
        impl_->backend = detail::make_cuda_moe_layer(weights, device, options);
    } else {
        impl_->backend = std::make_unique<CpuMoeLayer>(weights);
    }
}

ReferenceMoeLayer::~ReferenceMoeLayer() = default;

void ReferenceMoeLayer::forward(const MoeDispatchOutput& in, const TensorRef& y, void* stream) {
    const ExpertWeights& w = impl_->weights;
    const TensorRef& x = in.hidden_states;
    const int64_t e = w.gate_up.size(0);
    const bool masked = in.layout == Layout::kExpertMasked;
    ELASTICEP_CHECK_ARG(x.device == impl_->device, "ReferenceMoeLayer.forward: the dispatch output is on ",
                        device_name(x.device), " but the layer's weights are on ", device_name(impl_->device));
    ELASTICEP_CHECK_ARG(masked ? (x.ndim() == 3 && x.size(0) == e) : x.ndim() == 2,
                        "ReferenceMoeLayer.forward: hidden_states ", x.describe(), " does not fit ", e,
                        " local experts in the ", layout_name(in.layout), " layout");
    ELASTICEP_CHECK_ARG(x.size(x.ndim() - 1) == w.hidden, "ReferenceMoeLayer.forward: hidden_states ", x.describe(),
                        " but the weights have hidden=", w.hidden);
    ELASTICEP_CHECK_ARG(
        y.dtype == DType::kBFloat16 && y.shape == x.shape && y.device == x.device && y.stride(y.ndim() - 1) == 1,
        "ReferenceMoeLayer.forward: y is ", y.describe(), " but must be bf16 in the shape of hidden_states (",
        x.describe(), ") with contiguous rows");
    if (in.hidden_states_scale) {
        const TensorRef& sc = *in.hidden_states_scale;
        std::vector<int64_t> want = x.shape;
        want.back() = scale_columns(in.scale_format, w.hidden);
        ELASTICEP_CHECK_ARG(
            sc.shape == want && sc.device == x.device &&
                sc.dtype == (in.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32),
            "ReferenceMoeLayer.forward: hidden_states_scale is ", sc.describe(), " but ",
            scale_format_name(in.scale_format), " scales of ", x.describe(), " must be ",
            TensorRef::contiguous(nullptr, in.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32,
                                  want, x.device)
                .describe());
    }
    for (const TensorRef* t : {&in.counts, masked ? &in.masked_m : &in.offsets})
        ELASTICEP_CHECK_ARG(t->device == x.device && t->dtype == DType::kInt32,
                            "ReferenceMoeLayer.forward: counts/offsets ", t->describe(), " must be int32 on ",
                            device_name(x.device), " with hidden_states");
    ELASTICEP_CHECK_ARG(in.counts.numel() == e && (masked ? in.masked_m.numel() == e : in.offsets.numel() == e + 1),
                        "ReferenceMoeLayer.forward: the dispatch's counts/offsets do not describe ", e,
                        " local experts");
    impl_->backend->forward(in, y, stream);
}

void ReferenceMoeLayer::forward_dense(int local_expert, const TensorRef& x, const TensorRef& y, void* stream) {
    const ExpertWeights& w = impl_->weights;
    ELASTICEP_CHECK_ARG(local_expert >= 0 && local_expert < w.gate_up.size(0),
                        "ReferenceMoeLayer.forward_dense: expert ", local_expert, " is not in [0, ", w.gate_up.size(0),
                        ")");
    ELASTICEP_CHECK_ARG(x.dtype == DType::kBFloat16 && x.ndim() == 2 && x.size(1) == w.hidden &&
                            x.device == impl_->device && (x.size(0) == 0 || x.stride(1) == 1),
                        "ReferenceMoeLayer.forward_dense: x is ", x.describe(), " but must be bf16[T, ", w.hidden,
                        "] on ", device_name(impl_->device));
    ELASTICEP_CHECK_ARG(y.dtype == DType::kBFloat16 && y.shape == x.shape && y.device == x.device &&
                            (y.size(0) == 0 || y.stride(1) == 1),
                        "ReferenceMoeLayer.forward_dense: y is ", y.describe(), " but must be bf16 in x's shape");
    if (x.size(0) == 0) return;
    impl_->backend->forward_dense(local_expert, x, y, stream);
}

GemmPath ReferenceMoeLayer::path() const { return impl_->backend->path(); }
const std::string& ReferenceMoeLayer::path_note() const { return impl_->backend->note(); }
int ReferenceMoeLayer::num_local_experts() const { return static_cast<int>(impl_->weights.gate_up.size(0)); }

}  // namespace elasticep
