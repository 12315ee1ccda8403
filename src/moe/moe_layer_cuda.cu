// The reference MoE layer on a GPU: per local expert, gate/up and down GEMMs through cuBLASLt with
// the device steps of src/kernels/moe/expert_ffn.cuh between them.
//
// GEMM orientation (cuBLASLt is column-major): Y[m][n] = sum_k X[m][k] W[n][k] is computed as
// D (n x m, ld n) = op(A) B with A = W stored k x n (ld k, TRANSA = T) and B = X stored k x m (ld k),
// the "TN" form Hopper's FP8 kernels need. FP8 scales: A (weights) CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
// one fp32 per 128x128 block, [n/128][round_up(k/128, 4)]; B (activations) VEC128_32F, one fp32 per
// 128 channels of a row, stored MN-major [k/128][m] (m, a multiple of 16 here, fastest), the layout
// PyTorch's _scaled_mm hands cuBLASLt for 1x128 x 128x128 scaling. Whether this cuBLASLt runs them,
// and reads the scales that way, is probed when the layer is built: a heuristic query, then a small
// GEMM compared with the dequantized product. Otherwise FP8 is dequantized to bf16, said in the note.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/check.hpp"
#include "core/numerics.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/common/device_scope.hpp"
#include "kernels/moe/expert_ffn.cuh"
#include "moe/moe_internal.hpp"

#define ELASTICEP_CUBLAS_CALL(expr)                                                                           \
    do {                                                                                                      \
        const cublasStatus_t elasticep_st_ = (expr);                                                          \
        if (elasticep_st_ != CUBLAS_STATUS_SUCCESS)                                                           \
            ::elasticep::detail::raise(                                                                       \
                ::elasticep::ErrorCode::kCuda,                                                                \
                ::elasticep::detail::cat(#expr, " failed: cuBLAS status ", static_cast<int>(elasticep_st_))); \
    } while (0)

namespace elasticep::detail {
namespace {

namespace km = kernels::moe;

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

int64_t round_up16(int64_t v) { return (v + 15) / 16 * 16; }

unsigned grid_for(int64_t items, int64_t per_block) {
    const int64_t b = (items + per_block - 1) / per_block;
    return static_cast<unsigned>(std::clamp<int64_t>(b, 1, 8192));
}

using cuda::DeviceScope;  // (ranks sharing a process may differ)

// Device memory that grows on demand (never while the stream is being captured).
struct Scratch {
    void* ptr = nullptr;
    size_t bytes = 0;
    ~Scratch() {
        if (ptr) cudaFree(ptr);
    }
    template <class T>
    T* get(size_t need, cudaStream_t s, const char* what) {
        if (need > bytes) {
            cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
            ELASTICEP_CUDA_CALL(cudaStreamIsCapturing(s, &cap));
            ELASTICEP_CHECK_ARG(cap == cudaStreamCaptureStatusNone, "ReferenceMoeLayer: the ", what,
                                " scratch must grow to ", need,
                                " bytes while the stream is being captured; run the same call once before "
                                "capturing (the first call of a shape allocates)");
            if (ptr) ELASTICEP_CUDA_CALL(cudaFree(ptr));
            ptr = nullptr;
            ELASTICEP_CUDA_CALL(cudaMalloc(&ptr, need));
            bytes = need;
        }
        return static_cast<T*>(ptr);
    }
};

struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool found = false;
};

std::string gpu_name(int device, int* major, int* minor) {
    cudaDeviceProp prop{};
    ELASTICEP_CUDA_CALL(cudaGetDeviceProperties(&prop, device));
    *major = prop.major;
    *minor = prop.minor;
    return prop.name;
}

class CudaMoeLayer : public MoeLayerBackend {
 public:
    CudaMoeLayer(const ExpertWeights& w, Device dev, const MoeLayerOptions& opt) : w_(w), dev_(dev), opt_(opt) {
        DeviceScope scope(dev_.index);
        ELASTICEP_CUBLAS_CALL(cublasLtCreate(&lt_));
        ELASTICEP_CUDA_CALL(cudaMalloc(&workspace_, kWorkspaceBytes));
        ELASTICEP_CUDA_CALL(cudaMalloc(&status_, sizeof(int32_t)));
        ELASTICEP_CUDA_CALL(cudaMemset(status_, 0, sizeof(int32_t)));
        // the legacy stream's memset is asynchronous and the callers' streams may be non-blocking
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(cudaStreamLegacy));
        int major = 0, minor = 0;
        const std::string name = gpu_name(dev_.index, &major, &minor);
        const size_t ver = cublasLtGetVersion();
        const std::string where = cat(name, " (sm_", major, minor, "), cuBLASLt ", ver);
        experts_ = w_.gate_up.size(0);
        if (w_.kind == ExpertQuantKind::kBF16) {
            path_ = GemmPath::kCublasLtBf16;
            note_ = cat("GPU ", where, ": bf16 GEMMs through cuBLASLt (fp32 accumulation)");
            return;
        }
        prepare_weight_scales();
        std::string why;
        if (opt_.force_dequant)
            why = "the FP8 block-scaled path was switched off (force_dequant)";
        else
            why = probe_fp8();
        if (why.empty()) {
            path_ = GemmPath::kCublasLtFp8Blocked;
            note_ = cat("GPU ", where,
                        ": FP8 E4M3 GEMMs through cuBLASLt with CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F activation "
                        "scales and BLK128x128_32F weight scales (heuristic found kernels; self-check max relative "
                        "error ",
                        probe_err_, ")");
        } else {
            path_ = GemmPath::kCublasLtDequant;
            note_ = cat("GPU ", where,
                        ": FP8 weights and activations DEQUANTIZED to bf16, then bf16 cuBLASLt GEMMs, "
                        "because ",
                        why);
            dequantize_weights();
        }
    }

    ~CudaMoeLayer() override {
        int prev = 0;
        cudaGetDevice(&prev);
        cudaSetDevice(dev_.index);
        for (auto& [k, p] : plans_) {
            if (p.desc) cublasLtMatmulDescDestroy(p.desc);
            if (p.a) cublasLtMatrixLayoutDestroy(p.a);
            if (p.b) cublasLtMatrixLayoutDestroy(p.b);
            if (p.d) cublasLtMatrixLayoutDestroy(p.d);
        }
        for (void* p : owned_) cudaFree(p);
        if (workspace_) cudaFree(workspace_);
        if (status_) cudaFree(status_);
        if (lt_) cublasLtDestroy(lt_);
        cudaSetDevice(prev);
    }

    GemmPath path() const override { return path_; }
    const std::string& note() const override { return note_; }

    void forward(const MoeDispatchOutput& in, const TensorRef& y, void* stream_ptr) override {
        DeviceScope scope(dev_.index);
        cudaStream_t s = as_stream(stream_ptr);
        const bool masked = in.layout == Layout::kExpertMasked;
        const bool fp8_in = in.hidden_states.dtype == DType::kFloat8E4M3;
        check_input(in, fp8_in);
        std::vector<int32_t> rows(static_cast<size_t>(experts_)), start(static_cast<size_t>(experts_) + 1, 0);
        const bool graph_safe = masked && opt_.graph_safe;
        if (graph_safe) {
            std::fill(rows.begin(), rows.end(), static_cast<int32_t>(in.hidden_states.size(1)));
        } else {  // host read of the counts (prefill already synchronised in dispatch)
            const TensorRef& c = masked ? in.masked_m : in.counts;
            ELASTICEP_CUDA_CALL(cudaMemcpyAsync(rows.data(), c.data, rows.size() * 4, cudaMemcpyDeviceToHost, s));
            if (!masked)
                ELASTICEP_CUDA_CALL(
                    cudaMemcpyAsync(start.data(), in.offsets.data, start.size() * 4, cudaMemcpyDeviceToHost, s));
            ELASTICEP_CUDA_CALL(cudaStreamSynchronize(s));
        }
        const TensorRef& x = in.hidden_states;
        const int nd = x.ndim();
        const int64_t es = static_cast<int64_t>(dtype_size(x.dtype));
        int64_t most = 0;  // scratch for the largest expert first: nothing is freed while kernels use it
        for (int64_t l = 0; l < experts_; ++l)
            most = std::max<int64_t>(most, masked ? std::min<int64_t>(rows[l], x.size(1)) : rows[l]);
        reserve(round_up16(most), s);
        for (int64_t l = 0; l < experts_; ++l) {
            const int64_t m = masked ? std::min<int64_t>(rows[l], x.size(1)) : rows[l];
            if (m <= 0) continue;
            const int64_t first = masked ? 0 : start[l];
            const int64_t base = (nd == 3 ? l * x.stride(0) : 0) + first * x.stride(nd - 2);
            km::GatherParams g;
            g.src = static_cast<const uint8_t*>(x.data) + base * es;
            g.src_row_stride = x.stride(nd - 2) * es;
            g.rows = m;
            g.hidden = w_.hidden;
            g.fp8 = fp8_in;
            if (fp8_in) {
                const TensorRef& sc = *in.hidden_states_scale;
                g.scales = static_cast<const uint32_t*>(sc.data) + (nd == 3 ? l * sc.stride(0) : 0) +
                           first * sc.stride(nd - 2);
                g.scale_sr = sc.stride(nd - 2);
                g.scale_sg = sc.stride(nd - 1);
                g.ue8m0 = in.scale_format != ScaleFormat::kF32G128;
            }
            const TensorRef& ynd = y;
            uint16_t* dst =
                static_cast<uint16_t*>(ynd.data) + (nd == 3 ? l * ynd.stride(0) : 0) + first * ynd.stride(nd - 2);
            run_expert(l, &g, nullptr, m, dst, ynd.stride(nd - 2), s);
        }
        if (in.weight_placement == WeightPlacement::kAdapter) {
            const TensorRef st = TensorRef::contiguous(status_, DType::kInt32, {1}, dev_);
            apply_route_weights(y, in.recv_weights, masked ? in.masked_m : in.m_indices, y, st, stream_ptr);
            if (!graph_safe) check_adapter_status(st, stream_ptr);
        }
    }

    void forward_dense(int l, const TensorRef& x, const TensorRef& y, void* stream_ptr) override {
        DeviceScope scope(dev_.index);
        km::QuantizeParams q;
        q.x = x.data_as<const uint16_t>();
        q.x_row_stride = x.stride(0);
        q.rows = x.size(0);
        q.hidden = w_.hidden;
        reserve(round_up16(x.size(0)), as_stream(stream_ptr));
        run_expert(l, nullptr, &q, x.size(0), y.data_as<uint16_t>(), y.stride(0), as_stream(stream_ptr));
    }

 private:
    using Key = std::tuple<int, int64_t, int64_t, int64_t>;  // (fp8, m, n, k)

    void check_input(const MoeDispatchOutput& in, bool fp8_in) const {
        if (w_.kind == ExpertQuantKind::kBF16) {
            ELASTICEP_CHECK_ARG(!fp8_in, "ReferenceMoeLayer: bf16 experts need a bf16 dispatch; got ",
                                in.hidden_states.describe());
            return;
        }
        ELASTICEP_CHECK_ARG(fp8_in && in.hidden_states_scale.has_value(),
                            "ReferenceMoeLayer: FP8 experts need an fp8 dispatch with scales; got ",
                            in.hidden_states.describe());
        ELASTICEP_CHECK(in.scale_format != ScaleFormat::kUE8M0G32, ErrorCode::kUnsupported,
                        "ReferenceMoeLayer: 1x32 (MXFP8) activation scales do not fit 128x128 FP8 weights");
    }

    // Scratch for experts of up to `mp` rows (grows only here, before any kernel of the call).
    void reserve(int64_t mp, cudaStream_t s) {
        const int64_t h = w_.hidden, inter = w_.intermediate;
        x_.get<uint8_t>(static_cast<size_t>(mp * h) * 2, s, "activation");
        xsc_.get<float>(static_cast<size_t>(mp * (h / 128 + 1)) * 4, s, "activation scale");
        g_.get<uint16_t>(static_cast<size_t>(mp * 2 * inter) * 2, s, "gate/up");
        h_.get<uint8_t>(static_cast<size_t>(mp * inter) * 2, s, "activation");
        hsc_.get<float>(static_cast<size_t>(mp * (inter / 128 + 1)) * 4, s, "activation scale");
        y_.get<uint16_t>(static_cast<size_t>(mp * h) * 2, s, "output");
    }

    void* alloc(size_t bytes) {
        void* p = nullptr;
        ELASTICEP_CUDA_CALL(cudaMalloc(&p, bytes));
        owned_.push_back(p);
        return p;
    }

    // Weight scales as cuBLASLt's BLK128x128_32F reads them: [n/128][round_up(k/128, 4)] per expert.
    void prepare_weight_scales() {
        auto pad = [&](const TensorRef& sc, int64_t nb, int64_t kb, int64_t& kb_pad) {
            kb_pad = (kb + 3) / 4 * 4;
            auto* d = static_cast<float*>(alloc(static_cast<size_t>(experts_ * nb * kb_pad) * 4));
            ELASTICEP_CUDA_CALL(cudaMemset(d, 0, static_cast<size_t>(experts_ * nb * kb_pad) * 4));
            ELASTICEP_CUDA_CALL(cudaMemcpy2D(d, static_cast<size_t>(kb_pad) * 4, sc.data, static_cast<size_t>(kb) * 4,
                                             static_cast<size_t>(kb) * 4, static_cast<size_t>(experts_ * nb),
                                             cudaMemcpyDeviceToDevice));
            return d;
        };
        s1_ = pad(*w_.gate_up_scales, 2 * w_.intermediate / 128, w_.hidden / 128, kb1_);
        s2_ = pad(*w_.down_scales, w_.hidden / 128, w_.intermediate / 128, kb2_);
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(cudaStreamLegacy));  // before any caller stream reads them
    }

    void dequantize_weights() {
        auto deq = [&](const TensorRef& w, const TensorRef& sc, int64_t n, int64_t k) {
            auto* out = static_cast<uint16_t*>(alloc(static_cast<size_t>(experts_ * n * k) * 2));
            for (int64_t l = 0; l < experts_; ++l) {
                km::DequantWeightsParams p;
                p.w = w.data_as<const uint8_t>() + l * n * k;
                p.scales = sc.data_as<const float>() + l * (n / 128) * (k / 128);
                p.n = n;
                p.k = k;
                p.out = out + l * n * k;
                km::dequant_weights_kernel<<<grid_for(n * k, km::kThreads), km::kThreads>>>(p);
                ELASTICEP_CUDA_CHECK_LAUNCH();
            }
            return out;
        };
        w1_bf16_ = deq(w_.gate_up, *w_.gate_up_scales, 2 * w_.intermediate, w_.hidden);
        w2_bf16_ = deq(w_.down, *w_.down_scales, w_.hidden, w_.intermediate);
        ELASTICEP_CUDA_CALL(cudaDeviceSynchronize());
    }

    Plan& plan(bool fp8, int64_t m, int64_t n, int64_t k) {
        const Key key{fp8 ? 1 : 0, m, n, k};
        auto it = plans_.find(key);
        if (it != plans_.end()) return it->second;
        Plan p;
        const cudaDataType_t in_type = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
        ELASTICEP_CUBLAS_CALL(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        ELASTICEP_CUBLAS_CALL(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        ELASTICEP_CUBLAS_CALL(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        if (fp8) {
            const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
            const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
            ELASTICEP_CUBLAS_CALL(
                cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
            ELASTICEP_CUBLAS_CALL(
                cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
            const int8_t fast = 0;
            ELASTICEP_CUBLAS_CALL(
                cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
        }
        ELASTICEP_CUBLAS_CALL(
            cublasLtMatrixLayoutCreate(&p.a, in_type, static_cast<uint64_t>(k), static_cast<uint64_t>(n), k));
        ELASTICEP_CUBLAS_CALL(
            cublasLtMatrixLayoutCreate(&p.b, in_type, static_cast<uint64_t>(k), static_cast<uint64_t>(m), k));
        ELASTICEP_CUBLAS_CALL(
            cublasLtMatrixLayoutCreate(&p.d, CUDA_R_16BF, static_cast<uint64_t>(n), static_cast<uint64_t>(m), n));
        cublasLtMatmulPreference_t pref = nullptr;
        ELASTICEP_CUBLAS_CALL(cublasLtMatmulPreferenceCreate(&pref));
        const size_t ws = kWorkspaceBytes;
        ELASTICEP_CUBLAS_CALL(
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        cublasLtMatmulHeuristicResult_t result{};
        int count = 0;
        const cublasStatus_t st =
            cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.a, p.b, p.d, p.d, pref, 1, &result, &count);
        cublasLtMatmulPreferenceDestroy(pref);
        p.found = st == CUBLAS_STATUS_SUCCESS && count > 0;
        if (p.found) p.algo = result.algo;
        return plans_.emplace(key, p).first->second;
    }

    // D[m][n] (bf16) = X[m][k] . W[n][k]^T; fp8: with the scales described at the top of this file.
    void gemm(bool fp8, int64_t m, int64_t n, int64_t k, const void* w, const float* w_scales, const void* x,
              const float* x_scales, void* d, cudaStream_t s) {
        Plan& p = plan(fp8, m, n, k);
        ELASTICEP_CHECK(p.found, ErrorCode::kUnsupported, "ReferenceMoeLayer: cuBLASLt ", cublasLtGetVersion(),
                        " has no ", fp8 ? "FP8 block-scaled" : "bf16", " GEMM for m=", m, ", n=", n, ", k=", k,
                        " on this GPU");
        if (fp8) {
            ELASTICEP_CUBLAS_CALL(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                                 &w_scales, sizeof(w_scales)));
            ELASTICEP_CUBLAS_CALL(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                                 &x_scales, sizeof(x_scales)));
        }
        const float alpha = 1.0f, beta = 0.0f;
        ELASTICEP_CUBLAS_CALL(cublasLtMatmul(lt_, p.desc, &alpha, w, p.a, x, p.b, &beta, d, p.d, d, p.d, &p.algo,
                                             workspace_, kWorkspaceBytes, s));
    }

    // One expert over m rows: from a dispatch output (gather) or from dense bf16 rows (quantize).
    void run_expert(int64_t l, km::GatherParams* gather, km::QuantizeParams* quant, int64_t m, uint16_t* dst,
                    int64_t dst_stride, cudaStream_t s) {
        const int64_t mp = round_up16(m), h = w_.hidden, inter = w_.intermediate;
        const bool fp8_w = w_.kind == ExpertQuantKind::kFP8Block128;
        const bool blocked = path_ == GemmPath::kCublasLtFp8Blocked;
        const bool dequant = path_ == GemmPath::kCublasLtDequant;
        // activations: fp8 rows + fp32 MN-major scales (blocked), or bf16 rows
        uint8_t* xs = x_.get<uint8_t>(static_cast<size_t>(mp * h) * 2, s, "activation");
        float* xsc = xsc_.get<float>(static_cast<size_t>(mp * (h / 128 + 1)) * 4, s, "activation scale");
        if (gather) {
            gather->rows_pad = mp;
            gather->dequant = dequant;
            gather->dst = xs;
            gather->dst_scales = xsc;
            km::gather_kernel<<<grid_for(mp, km::kWarps), km::kThreads, 0, s>>>(*gather);
        } else if (fp8_w) {
            quant->rows_pad = mp;
            quant->dequant = dequant;
            quant->dst = xs;
            quant->dst_scales = xsc;
            km::quantize_kernel<<<grid_for(mp * (h / 128), km::kWarps), km::kThreads, 0, s>>>(*quant);
        } else {
            km::GatherParams g;  // dense bf16 rows: a plain gather
            g.src = reinterpret_cast<const uint8_t*>(quant->x);
            g.src_row_stride = quant->x_row_stride * 2;
            g.rows = m;
            g.rows_pad = mp;
            g.hidden = h;
            g.dst = xs;
            km::gather_kernel<<<grid_for(mp, km::kWarps), km::kThreads, 0, s>>>(g);
        }
        ELASTICEP_CUDA_CHECK_LAUNCH();
        uint16_t* g = g_.get<uint16_t>(static_cast<size_t>(mp * 2 * inter) * 2, s, "gate/up");
        const int64_t es = blocked ? 1 : 2;
        const void* w1 = blocked   ? static_cast<const uint8_t*>(w_.gate_up.data) + l * 2 * inter * h
                         : dequant ? static_cast<const void*>(w1_bf16_ + l * 2 * inter * h)
                                   : static_cast<const uint16_t*>(w_.gate_up.data) + l * 2 * inter * h;
        const void* w2 = blocked   ? static_cast<const uint8_t*>(w_.down.data) + l * h * inter
                         : dequant ? static_cast<const void*>(w2_bf16_ + l * h * inter)
                                   : static_cast<const uint16_t*>(w_.down.data) + l * h * inter;
        gemm(blocked, mp, 2 * inter, h, w1, blocked ? s1_ + l * (2 * inter / 128) * kb1_ : nullptr, xs, xsc, g, s);
        uint8_t* hb = h_.get<uint8_t>(static_cast<size_t>(mp * inter) * es, s, "activation");
        float* hsc = hsc_.get<float>(static_cast<size_t>(mp * (inter / 128 + 1)) * 4, s, "activation scale");
        km::ActParams a;
        a.g = g;
        a.rows_pad = mp;
        a.inter = inter;
        a.dequant = dequant;
        a.h = hb;
        a.h_scales = hsc;
        if (fp8_w)
            km::act_fp8_kernel<<<grid_for(mp * (inter / 128), km::kWarps), km::kThreads, 0, s>>>(a);
        else
            km::act_bf16_kernel<<<grid_for(mp * inter, km::kThreads), km::kThreads, 0, s>>>(a);
        ELASTICEP_CUDA_CHECK_LAUNCH();
        uint16_t* yb = y_.get<uint16_t>(static_cast<size_t>(mp * h) * 2, s, "output");
        gemm(blocked, mp, h, inter, w2, blocked ? s2_ + l * (h / 128) * kb2_ : nullptr, hb, hsc, yb, s);
        km::ScatterParams sp;
        sp.y = yb;
        sp.rows = m;
        sp.hidden = h;
        sp.dst = dst;
        sp.dst_row_stride = dst_stride;
        km::scatter_kernel<<<grid_for(m, km::kWarps), km::kThreads, 0, s>>>(sp);
        ELASTICEP_CUDA_CHECK_LAUNCH();
    }

    // "" when the blocked FP8 path runs correctly here, else why not.
    std::string probe_fp8() {
        for (auto [n, k] : {std::pair<int64_t, int64_t>{2 * w_.intermediate, w_.hidden}, {w_.hidden, w_.intermediate}})
            if (!plan(true, 16, n, k).found)
                return cat(
                    "cuBLASLt's heuristic returned no FP8 kernel with VEC128_32F x BLK128x128_32F scales for an ", n,
                    " x ", k, " weight on this GPU (those scale modes run on Hopper only)");
        // k = 512: four 128-blocks per row, where a padded and an unpadded weight-scale row agree. The
        // second check (k = 384, three blocks: the padding to four matters) runs only when this layer's
        // own block counts are not multiples of four.
        std::string why = self_check(512);
        if (why.empty() && ((w_.hidden / 128) % 4 != 0 || (w_.intermediate / 128) % 4 != 0)) why = self_check(384);
        return why;
    }

    // A small FP8 GEMM (m = 16, n = 256) with scales that differ per block and per row, compared with the
    // dequantized product computed here on the host.
    std::string self_check(int64_t k) {
        const int64_t m = 16, n = 256, nb = 2, kb = k / 128, kbp = (kb + 3) / 4 * 4;
        if (!plan(true, m, n, k).found)
            return cat("cuBLASLt's heuristic returned no FP8 block-scaled kernel for the self-check shape (k = ", k,
                       ")");
        std::vector<uint8_t> xq(static_cast<size_t>(m * k)), wq(static_cast<size_t>(n * k));
        std::vector<float> xs(static_cast<size_t>(kb * m)), ws(static_cast<size_t>(nb * kbp), 0.0f);
        uint32_t z = 12345;
        auto next = [&] {
            z = z * 1664525u + 1013904223u;
            return z >> 8;
        };
        auto code = [&] {  // |v| in [2^-3, 8), never NaN
            uint8_t c;
            do c = static_cast<uint8_t>(next());
            while (((c >> 3) & 0xf) > 9 || ((c >> 3) & 0xf) < 4);
            return c;
        };
        for (auto& v : xq) v = code();
        for (auto& v : wq) v = code();
        for (int64_t b = 0; b < kb; ++b)
            for (int64_t r = 0; r < m; ++r)
                xs[static_cast<size_t>(b * m + r)] = std::ldexp(1.0f + 0.125f * static_cast<float>(next() % 8),
                                                                static_cast<int>(b) - static_cast<int>(r % 5));
        for (int64_t i = 0; i < nb; ++i)
            for (int64_t b = 0; b < kb; ++b)
                ws[static_cast<size_t>(i * kbp + b)] =
                    std::ldexp(1.0f + 0.25f * static_cast<float>(b), static_cast<int>(2 * i - b));
        auto* dx = static_cast<uint8_t*>(alloc(xq.size()));
        auto* dw = static_cast<uint8_t*>(alloc(wq.size()));
        auto* dxs = static_cast<float*>(alloc(xs.size() * 4));
        auto* dws = static_cast<float*>(alloc(ws.size() * 4));
        auto* dd = static_cast<uint16_t*>(alloc(static_cast<size_t>(m * n) * 2));
        ELASTICEP_CUDA_CALL(cudaMemcpy(dx, xq.data(), xq.size(), cudaMemcpyHostToDevice));
        ELASTICEP_CUDA_CALL(cudaMemcpy(dw, wq.data(), wq.size(), cudaMemcpyHostToDevice));
        ELASTICEP_CUDA_CALL(cudaMemcpy(dxs, xs.data(), xs.size() * 4, cudaMemcpyHostToDevice));
        ELASTICEP_CUDA_CALL(cudaMemcpy(dws, ws.data(), ws.size() * 4, cudaMemcpyHostToDevice));
        gemm(true, m, n, k, dw, dws, dx, dxs, dd, nullptr);
        ELASTICEP_CUDA_CALL(cudaDeviceSynchronize());
        std::vector<uint16_t> d(static_cast<size_t>(m * n));
        ELASTICEP_CUDA_CALL(cudaMemcpy(d.data(), dd, d.size() * 2, cudaMemcpyDeviceToHost));
        double worst = 0.0;
        for (int64_t r = 0; r < m; ++r)
            for (int64_t c = 0; c < n; ++c) {
                double ref = 0.0, mag = 0.0;
                for (int64_t i = 0; i < k; ++i) {
                    const double v = static_cast<double>(num::e4m3_to_float(xq[static_cast<size_t>(r * k + i)])) *
                                     xs[static_cast<size_t>((i / 128) * m + r)] *
                                     num::e4m3_to_float(wq[static_cast<size_t>(c * k + i)]) *
                                     ws[static_cast<size_t>((c / 128) * kbp + i / 128)];
                    ref += v;
                    mag += std::fabs(v);
                }
                const double err =
                    std::fabs(static_cast<double>(num::bf16_to_float(d[static_cast<size_t>(r * n + c)])) - ref) / mag;
                worst = std::max(worst, err);
            }
        probe_err_ = std::max(probe_err_, worst);
        if (!(worst < 1.0 / 64))
            return cat("cuBLASLt's FP8 block-scaled GEMM disagreed with the dequantized product on a self-check (k = ",
                       k, ", max error ", worst,
                       " of the magnitude sum): the scale layout this code passes is not what "
                       "this cuBLASLt reads");
        return "";
    }

    ExpertWeights w_;
    Device dev_;
    MoeLayerOptions opt_;
    int64_t experts_ = 0;
    cublasLtHandle_t lt_ = nullptr;
    void* workspace_ = nullptr;
    int32_t* status_ = nullptr;
    GemmPath path_ = GemmPath::kCublasLtBf16;
    std::string note_;
    double probe_err_ = 0.0;
    float* s1_ = nullptr;
    float* s2_ = nullptr;
    int64_t kb1_ = 0, kb2_ = 0;
    uint16_t* w1_bf16_ = nullptr;
    uint16_t* w2_bf16_ = nullptr;
    std::vector<void*> owned_;
    std::map<Key, Plan> plans_;
    Scratch x_, xsc_, g_, h_, hsc_, y_;
};

}  // namespace

std::unique_ptr<MoeLayerBackend> make_cuda_moe_layer(const ExpertWeights& weights, Device device,
                                                     const MoeLayerOptions& options) {
    return std::make_unique<CudaMoeLayer>(weights, device, options);
}

}  // namespace elasticep::detail
