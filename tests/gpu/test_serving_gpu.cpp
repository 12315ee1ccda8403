// The serving layer on a GPU: every grouped-GEMM adapter byte for byte against the CPU adapter
// (faults included, and replayed from a CUDA graph); the cuBLASLt reference MoE layer against the
// dense reference (bf16, FP8 blocked or dequantized, both layouts, weights in the adapter); the
// whole layer through the CUDA backend on 1, 2 and 4 ranks of one GPU, a DeepSeek-V3-sized one
// included; and the decode layer (dispatch -> masked GEMMs -> combine) captured in a CUDA graph and
// replayed with new inputs. Skips without a GPU.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "common/scoped_env.hpp"
#include "core/numerics.hpp"
#include "gpu_harness.hpp"
#include "moe/dense_reference.hpp"
#include "moe/synthetic_weights.hpp"

namespace eptest {
namespace {

namespace mr = elasticep::moe_ref;

const Device kGpu{DeviceType::kCUDA, 0};

struct WordRng {  // raw 32-bit words for the adapters' byte-for-byte tests
    std::mt19937_64 g;
    explicit WordRng(uint64_t s) : g(s) {}
    int uniform(int lo, int hi) { return lo + static_cast<int>(g() % static_cast<uint64_t>(hi - lo + 1)); }
    uint32_t word() { return static_cast<uint32_t>(g()); }
};

// One tensor on the host and its twin on the GPU (same bytes, same shape and strides).
struct Twin {
    std::vector<uint8_t> host;
    DevBuf dev;
    TensorRef h, d;
    Twin(DType dt, std::vector<int64_t> shape, std::vector<int64_t> strides, size_t storage_elems, uint8_t fill)
        : host(storage_elems * dtype_size(dt), fill), dev(storage_elems * dtype_size(dt)) {
        h = TensorRef::contiguous(host.data(), dt, shape);
        h.strides = strides;
        d = h;
        d.data = dev.ptr;
        d.device = kGpu;
        push();
    }
    static Twin of(DType dt, std::vector<int64_t> shape, uint8_t fill = 0x5a) {
        size_t n = 1;
        for (int64_t s : shape) n *= static_cast<size_t>(s);
        return Twin(dt, shape, {}, n, fill);
    }
    template <class T>
    static Twin from(const std::vector<T>& v, DType dt, std::vector<int64_t> shape) {
        Twin t = of(dt, shape);
        std::memcpy(t.host.data(), v.data(), v.size() * sizeof(T));
        t.push();
        return t;
    }
    void push() {
        cudaMemcpy(dev.ptr, host.data(), host.size(), cudaMemcpyHostToDevice);
        cudaStreamSynchronize(cudaStreamLegacy);  // landed before a non-blocking stream reads it
    }
    std::vector<uint8_t> pull() const { return download<uint8_t>(dev.ptr, host.size()); }
    bool same() const { return pull() == host; }
    Twin(Twin&&) = default;
};

// Runs an adapter on the host twins and on the device twins; every output twin must match byte for
// byte afterwards (with the status word), whatever was written or left untouched.
template <class Fn>
void both(Fn&& fn, std::vector<Twin*> outputs, const std::string& what) {
    int32_t host_status = 0;
    DevBuf dst(4);
    cudaMemset(dst.ptr, 0, 4);
    cudaStreamSynchronize(cudaStreamLegacy);
    fn(false, TensorRef::contiguous(&host_status, DType::kInt32, {1}));
    fn(true, TensorRef::contiguous(dst.ptr, DType::kInt32, {1}, kGpu));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    EXPECT_EQ(download<int32_t>(dst.ptr, 1)[0], host_status) << what << ": status";
    for (size_t i = 0; i < outputs.size(); ++i)
        EXPECT_TRUE(outputs[i]->same()) << what << ": output " << i << " differs";
}

TEST(ServingGpu, RepackAdaptersMatchTheCpuByteForByte) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    WordRng rng(1234);
    for (int iter = 0; iter < 60; ++iter) {
        const int64_t e = rng.uniform(1, 9), s = rng.uniform(0, 11), a = std::vector<int>{1, 2, 4, 16, 128}[iter % 5];
        const int kind = iter % 3;  // 0: bf16 rows (fused weights sometimes), 1: fp8 rows, 2: fp32 rows
        const DType dt = kind == 0 ? DType::kBFloat16 : kind == 1 ? DType::kFloat8E4M3 : DType::kFloat32;
        const int64_t w = rng.uniform(1, 3) * (kind == 1 ? 37 : 8) + (iter % 2);
        const int64_t g = rng.uniform(0, 6);
        const bool faults = iter % 7 == 6;
        std::vector<int32_t> mm(static_cast<size_t>(e));
        int64_t need = 0;
        for (auto& c : mm) {
            c = rng.uniform(0, static_cast<int>(s));
            if (faults && rng.uniform(0, 2) == 0) c = rng.uniform(-3, static_cast<int>(s) + 5);
            need += (std::clamp<int64_t>(c, 0, s) + a - 1) / a * a;
        }
        const int64_t mc = faults ? std::max<int64_t>(1, need - 3) : need + rng.uniform(0, 9);
        Twin slab = Twin::of(dt, {e, s, w});
        for (auto& b : slab.host) b = static_cast<uint8_t>(rng.word());
        if (kind == 0)
            for (size_t i = 1; i < slab.host.size(); i += 2) slab.host[i] &= 0xbf;  // keep bf16 finite mostly
        slab.push();
        Twin masked_m = Twin::from(mm, DType::kInt32, {e});
        Twin sc = Twin::of(DType::kInt32, {e, s, std::max<int64_t>(g, 1)});
        for (auto& b : sc.host) b = static_cast<uint8_t>(rng.word());
        sc.push();
        const int64_t pad = (mc + 3) / 4 * 4;
        const bool mn = g > 1 && iter % 2 == 0;
        Twin out_x = Twin::of(dt, {mc, w});
        Twin out_s = mn ? Twin(DType::kInt32, {mc, g}, {1, pad}, static_cast<size_t>(g * pad), 0x5a)
                        : Twin::of(DType::kInt32, {mc, std::max<int64_t>(g, 1)});
        Twin offsets = Twin::of(DType::kInt32, {e + 1}), m_idx = Twin::of(DType::kInt32, {mc});
        Twin wts = Twin::of(DType::kFloat32, {mc});
        for (size_t i = 0; i < wts.host.size(); i += 4) {
            const float f = static_cast<float>(rng.uniform(-300, 300)) / 64.0f;
            std::memcpy(&wts.host[i], &f, 4);
        }
        wts.push();
        const bool fuse = kind == 0 && iter % 2 == 1;
        both(
            [&](bool gpu, TensorRef status) {
                MaskedToContiguousArgs f;
                f.x = gpu ? slab.d : slab.h;
                f.masked_m = gpu ? masked_m.d : masked_m.h;
                if (g > 0) {
                    TensorRef si = gpu ? sc.d : sc.h;
                    f.scales = si;
                    f.out_scales = gpu ? out_s.d : out_s.h;
                }
                f.expert_alignment = static_cast<int>(a);
                f.out_x = gpu ? out_x.d : out_x.h;
                f.out_offsets = gpu ? offsets.d : offsets.h;
                f.out_m_indices = gpu ? m_idx.d : m_idx.h;
                if (fuse) f.weights = gpu ? wts.d : wts.h;
                f.status = status;
                masked_to_contiguous(f);
            },
            {&out_x, &out_s, &offsets, &m_idx}, "masked_to_contiguous iter " + std::to_string(iter));

        // back: contiguous -> masked, with (possibly damaged) counts and offsets
        std::vector<int32_t> counts(mm);
        std::vector<int32_t> offs(static_cast<size_t>(e + 1));
        std::memcpy(offs.data(), offsets.host.data(), offs.size() * 4);
        if (faults) offs[static_cast<size_t>(rng.uniform(0, static_cast<int>(e)))] += rng.uniform(-5, 5);
        Twin cnt = Twin::from(counts, DType::kInt32, {e}), off = Twin::from(offs, DType::kInt32, {e + 1});
        Twin back = Twin::of(dt, {e, s, w}), back_s = Twin::of(DType::kInt32, {e, s, std::max<int64_t>(g, 1)});
        Twin back_m = Twin::of(DType::kInt32, {e});
        Twin slab_w = Twin::of(DType::kFloat32, {e, s});
        for (size_t i = 0; i < slab_w.host.size(); i += 4) {
            const float f = static_cast<float>(rng.uniform(-300, 300)) / 32.0f;
            std::memcpy(&slab_w.host[i], &f, 4);
        }
        slab_w.push();
        both(
            [&](bool gpu, TensorRef status) {
                ContiguousToMaskedArgs b;
                b.x = gpu ? out_x.d : out_x.h;
                b.counts = gpu ? cnt.d : cnt.h;
                b.offsets = gpu ? off.d : off.h;
                if (g > 0) {
                    b.scales = gpu ? out_s.d : out_s.h;
                    TensorRef bs = gpu ? back_s.d : back_s.h;
                    b.out_scales = bs;
                }
                b.out_x = gpu ? back.d : back.h;
                b.out_masked_m = gpu ? back_m.d : back_m.h;
                if (fuse) b.weights = gpu ? slab_w.d : slab_w.h;
                b.status = status;
                contiguous_to_masked(b);
            },
            {&back, &back_s, &back_m}, "contiguous_to_masked iter " + std::to_string(iter));

        both(
            [&](bool gpu, TensorRef status) {
                m_indices_from_offsets(gpu ? cnt.d : cnt.h, gpu ? off.d : off.h, gpu ? m_idx.d : m_idx.h, status);
            },
            {&m_idx}, "m_indices iter " + std::to_string(iter));
    }
}

TEST(ServingGpu, RouteWeightsMatchTheCpuIncludingNaNs) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    WordRng rng(77);
    const int64_t e = 5, s = 7, h = 96;
    Twin y = Twin::of(DType::kBFloat16, {e, s, h});
    for (auto& b : y.host) b = static_cast<uint8_t>(rng.word());  // every bit pattern: NaNs, Infs, subnormals
    y.push();
    Twin w = Twin::of(DType::kFloat32, {e, s});
    for (size_t i = 0; i < w.host.size(); i += 4) {
        const float f = i % 20 == 0 ? 0.0f : static_cast<float>(rng.uniform(-1000, 1000)) / 77.0f;
        std::memcpy(&w.host[i], &f, 4);
    }
    w.push();
    Twin mm = Twin::from(std::vector<int32_t>{7, 0, 3, 9, -1}, DType::kInt32, {e});  // 9 > S, -1: faults
    Twin out = Twin::of(DType::kBFloat16, {e, s, h});
    both(
        [&](bool gpu, TensorRef st) {
            apply_route_weights(gpu ? y.d : y.h, gpu ? w.d : w.h, gpu ? mm.d : mm.h, gpu ? out.d : out.h, st);
        },
        {&out}, "masked route weights");
    // contiguous, in place
    Twin yc = Twin::of(DType::kBFloat16, {33, h});
    for (auto& b : yc.host) b = static_cast<uint8_t>(rng.word());
    yc.push();
    Twin wc = Twin::of(DType::kFloat32, {33});
    for (size_t i = 0; i < wc.host.size(); i += 4) {
        const float f = static_cast<float>(rng.uniform(-100, 100)) / 3.0f;
        std::memcpy(&wc.host[i], &f, 4);
    }
    wc.push();
    std::vector<int32_t> mi(33);
    for (auto& v : mi) v = rng.uniform(-1, 4);
    Twin mit = Twin::from(mi, DType::kInt32, {33});
    both(
        [&](bool gpu, TensorRef st) {
            const TensorRef t = gpu ? yc.d : yc.h;
            apply_route_weights(t, gpu ? wc.d : wc.h, gpu ? mit.d : mit.h, t, st);
        },
        {&yc}, "contiguous route weights in place");
}

TEST(ServingGpu, ScaleConversionsMatchTheCpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    WordRng rng(5);
    for (int64_t rows : {1, 3, 4, 130}) {
        for (int64_t g : {1, 2, 7, 56}) {
            for (int64_t b : {1, 4}) {
                const int64_t pad = (rows + 3) / 4 * 4;
                const std::vector<int64_t> shape =
                    b == 1 ? std::vector<int64_t>{rows, g} : std::vector<int64_t>{b, rows, g};
                const std::vector<int64_t> mstr =
                    b == 1 ? std::vector<int64_t>{1, pad} : std::vector<int64_t>{g * pad, 1, pad};
                Twin src = Twin::of(DType::kFloat32, shape);
                for (size_t i = 0; i < src.host.size(); i += 4) {  // fp32 scales, specials included
                    const uint32_t bits = i % 52 == 0   ? 0x7f800000u
                                          : i % 44 == 0 ? 0x7fc00001u
                                          : i % 36 == 0 ? 0u
                                                        : (rng.word() & 0x3fffffffu) + 0x20000000u;
                    std::memcpy(&src.host[i], &bits, 4);
                }
                src.push();
                Twin mn(DType::kFloat32, shape, mstr, static_cast<size_t>(b * g * pad), 0x5a);
                both([&](bool gpu, TensorRef) { convert_scale_layout(gpu ? src.d : src.h, gpu ? mn.d : mn.h); }, {&mn},
                     "to MN-major");
                Twin back = Twin::of(DType::kFloat32, shape);
                both([&](bool gpu, TensorRef) { convert_scale_layout(gpu ? mn.d : mn.h, gpu ? back.d : back.h); },
                     {&back}, "from MN-major");
                EXPECT_EQ(back.host, src.host);
                const int64_t words = (g + 3) / 4;
                std::vector<int64_t> ushape = shape;
                ushape.back() = words;
                const std::vector<int64_t> ustr =
                    b == 1 ? std::vector<int64_t>{1, pad} : std::vector<int64_t>{words * pad, 1, pad};
                Twin ue(DType::kInt32, ushape, ustr, static_cast<size_t>(b * words * pad), 0x5a);
                both([&](bool gpu, TensorRef) { fp32_scales_to_ue8m0(gpu ? src.d : src.h, gpu ? ue.d : ue.h); }, {&ue},
                     "to packed UE8M0");
            }
        }
    }
}

// masked -> contiguous captured once in a CUDA graph, replayed with new counts: the fixed grid
// follows whatever masked_m holds at replay time.
TEST(ServingGpu, AdapterReplaysFromACudaGraph) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const int64_t e = 4, s = 16, w = 64, a = 8, mc = e * (s + a - 1);
    WordRng rng(3);
    Twin slab = Twin::of(DType::kBFloat16, {e, s, w});
    for (auto& b : slab.host) b = static_cast<uint8_t>(rng.word() & 0x3f);
    slab.push();
    Twin mm = Twin::of(DType::kInt32, {e}), out = Twin::of(DType::kBFloat16, {mc, w}),
         off = Twin::of(DType::kInt32, {e + 1});
    Twin mi = Twin::of(DType::kInt32, {mc});
    DevBuf st(4);
    cudaMemset(st.ptr, 0, 4);
    cudaStreamSynchronize(cudaStreamLegacy);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    MaskedToContiguousArgs f;
    f.x = slab.d;
    f.masked_m = mm.d;
    f.expert_alignment = static_cast<int>(a);
    f.out_x = out.d;
    f.out_offsets = off.d;
    f.out_m_indices = mi.d;
    f.status = TensorRef::contiguous(st.ptr, DType::kInt32, {1}, kGpu);
    f.stream = stream;
    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    masked_to_contiguous(f);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int replay = 0; replay < 4; ++replay) {
        std::vector<int32_t> counts(static_cast<size_t>(e));
        for (auto& c : counts) c = rng.uniform(0, static_cast<int>(s));
        std::memcpy(mm.host.data(), counts.data(), counts.size() * 4);
        mm.push();
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        int32_t hs = 0;
        MaskedToContiguousArgs h = f;
        h.x = slab.h;
        h.masked_m = mm.h;
        h.out_x = out.h;
        h.out_offsets = off.h;
        h.out_m_indices = mi.h;
        h.status = TensorRef::contiguous(&hs, DType::kInt32, {1});
        h.stream = nullptr;
        masked_to_contiguous(h);
        EXPECT_TRUE(out.same() && off.same() && mi.same()) << "replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
}

// ---- the reference MoE layer on the GPU ---------------------------------------------------------

// Synthetic experts uploaded to the GPU.
struct DeviceExperts {
    std::vector<DevBuf> bufs;
    ExpertWeights w;
    DeviceExperts(const mr::SyntheticExperts& sx, int64_t first, int64_t count) {
        w = sx.tensors(first, count);
        auto up = [&](TensorRef& t) {
            bufs.emplace_back(t.nbytes());
            cudaMemcpy(bufs.back().ptr, t.data, t.nbytes(), cudaMemcpyHostToDevice);
            cudaStreamSynchronize(cudaStreamLegacy);
            t.data = bufs.back().ptr;
            t.device = kGpu;
        };
        up(w.gate_up);
        up(w.down);
        if (w.gate_up_scales) up(*w.gate_up_scales);
        if (w.down_scales) up(*w.down_scales);
    }
};

std::string comparison_text(const mr::Comparison& c) {
    char buf[256];
    std::snprintf(buf, sizeof(buf),
                  "rms err / rms sigma %.3f (pass <= 1.5), max err / worst %.4f, max abs err %.3g over %lld",
                  c.rms_ratio(), c.max_worst_ratio, c.max_abs_err, static_cast<long long>(c.elements));
    return buf;
}

struct LayerCase {
    int ranks = 2;
    int experts = 16, topk = 4;
    int64_t hidden = 512, inter = 256;
    ExpertQuantKind kind = ExpertQuantKind::kFP8Block128;
    Phase phase = Phase::kPrefill;
    WeightPlacement placement = WeightPlacement::kCombine;
    bool shared = true;
    bool force_dequant = false;
    int capacity = 16;
    std::vector<int64_t> tokens;
    bool graph = false;  // decode captured in a CUDA graph, replayed `replays` times with new inputs
    int replays = 3;
};

// dispatch -> ReferenceMoeLayer (cuBLASLt) -> combine through the CUDA backend, ranks as threads of
// one GPU, compared with the dense reference.
void run_layer_gpu(const LayerCase& lc) {
    const bool fp8 = lc.kind == ExpertQuantKind::kFP8Block128;
    QuantizationConfig q;
    if (fp8)
        q = QuantizationConfig{.present = true,
                               .quant_method = "fp8",
                               .fmt = "e4m3",
                               .activation_scheme = "dynamic",
                               .weight_block_size = std::vector<int64_t>{128, 128}};
    BufferConfig cfg{.num_experts = lc.experts,
                     .num_topk = lc.topk,
                     .hidden = static_cast<int>(lc.hidden),
                     .max_tokens_per_rank = lc.capacity};
    cfg.device = 0;
    cfg.timeout = std::chrono::milliseconds(60000);
    cfg = serving_buffer_config(cfg, check_expert_quant(q));
    const int e_local = lc.experts / lc.ranks;
    const mr::SyntheticExperts all = mr::make_synthetic_experts(lc.kind, 0, lc.experts, lc.hidden, lc.inter, 31, 8);
    const mr::SyntheticExperts shared = mr::make_synthetic_experts(lc.kind, 999, 1, lc.hidden, lc.inter, 31);
    const int rounds = lc.graph ? lc.replays : 1;
    // inputs[round][rank]
    // Every rank's inputs from the shared generator (tests/common/scenario.hpp), unstrided: the calls
    // and the dense reference both read the storage (x, idx64, w). Round 1 crowds one expert.
    std::vector<std::vector<RankData>> in(static_cast<size_t>(rounds));
    for (int i = 0; i < rounds; ++i) {
        Scenario sc;
        sc.cfg = cfg;
        sc.num_ranks = lc.ranks;
        sc.tokens = lc.tokens;
        sc.routing = i == 1 ? Routing::kHotExpert : Routing::kRandom;
        sc.p_none = 1.0 / 8;
        sc.p_token_none = 1.0 / 16;
        sc.idx64 = true;
        sc.seed = 100 * static_cast<uint64_t>(i) + 7;
        in[static_cast<size_t>(i)] = make_inputs(sc);
        for (RankData& x : in[static_cast<size_t>(i)]) {
            for (auto& v : x.x) v = num::float_to_bf16(static_cast<float>((v & 0xff) / 128.0 - 1.0));
            for (auto& w : x.w) w = std::fabs(w) * 2.5f;  // routed scaling factor folded into the weights
        }
    }
    std::vector<std::vector<std::vector<uint16_t>>> outs(
        static_cast<size_t>(rounds), std::vector<std::vector<uint16_t>>(static_cast<size_t>(lc.ranks)));
    std::string note;
    auto groups = ThreadGroup::create(lc.ranks);
    const auto errors = run_ranks(lc.ranks, [&](int r) {
        cudaSetDevice(0);
        cudaStream_t s;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCUDA);
        MoeDispatcher disp(buf, DispatcherOptions{.weight_placement = lc.placement});
        DeviceExperts dexp(all, r * e_local, e_local), dshared(shared, 0, 1);
        ReferenceMoeLayer experts(dexp.w, kGpu,
                                  MoeLayerOptions{.graph_safe = lc.graph, .force_dequant = lc.force_dequant});
        ReferenceMoeLayer shared_expert(dshared.w, kGpu, MoeLayerOptions{.force_dequant = lc.force_dequant});
        if (r == 0) note = experts.path_note();
        const int64_t t = lc.tokens[static_cast<size_t>(r)];
        const RankData& x0 = in[0][static_cast<size_t>(r)];
        DevBuf dx = DevBuf::upload(x0.x), didx = DevBuf::upload(x0.idx64), dw = DevBuf::upload(x0.w);
        DevBuf dshared_out(static_cast<size_t>(std::max<int64_t>(t, 1) * lc.hidden) * 2);
        DevBuf dout(static_cast<size_t>(std::max<int64_t>(t, 1) * lc.hidden) * 2);
        const TensorRef xt = TensorRef::contiguous(dx.ptr, DType::kBFloat16, {t, lc.hidden}, kGpu);
        const TensorRef it = TensorRef::contiguous(didx.ptr, DType::kInt64, {t, lc.topk}, kGpu);
        const TensorRef wt = TensorRef::contiguous(dw.ptr, DType::kFloat32, {t, lc.topk}, kGpu);
        const TensorRef st = TensorRef::contiguous(dshared_out.ptr, DType::kBFloat16, {t, lc.hidden}, kGpu);
        const TensorRef ot = TensorRef::contiguous(dout.ptr, DType::kBFloat16, {t, lc.hidden}, kGpu);
        const int64_t slab_rows = int64_t{e_local} * lc.ranks * lc.capacity;
        DevBuf dy(static_cast<size_t>(std::max<int64_t>(slab_rows, buf->max_contiguous_rows(128)) * lc.hidden) * 2);
        auto step = [&] {
            shared_expert.forward_dense(0, xt, st, s);
            const MoeDispatchOutput d = disp.dispatch(lc.phase, xt, it, wt, s);
            const TensorRef yt = TensorRef::contiguous(dy.ptr, DType::kBFloat16, d.hidden_states.shape, kGpu);
            experts.forward(d, yt, s);
            disp.combine(yt, s, lc.shared ? std::optional<TensorRef>(st) : std::nullopt, ot);
        };
        buf->group()->barrier();
        if (!lc.graph) {
            step();
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            outs[0][static_cast<size_t>(r)] = download<uint16_t>(dout.ptr, static_cast<size_t>(t * lc.hidden));
        } else {
            step();  // warm-up: buffer outputs, cuBLASLt plans and layer scratch are made here
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            cudaGraph_t graph;
            ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
            step();
            ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
            cudaGraphExec_t exec;
            ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
            for (int i = 0; i < rounds; ++i) {
                const RankData& xi = in[static_cast<size_t>(i)][static_cast<size_t>(r)];
                cudaMemcpyAsync(dx.ptr, xi.x.data(), xi.x.size() * 2, cudaMemcpyHostToDevice, s);
                cudaMemcpyAsync(didx.ptr, xi.idx64.data(), xi.idx64.size() * 8, cudaMemcpyHostToDevice, s);
                cudaMemcpyAsync(dw.ptr, xi.w.data(), xi.w.size() * 4, cudaMemcpyHostToDevice, s);
                ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
                ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
                outs[static_cast<size_t>(i)][static_cast<size_t>(r)] =
                    download<uint16_t>(dout.ptr, static_cast<size_t>(t * lc.hidden));
            }
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
        }
        buf->check();
        cudaStreamDestroy(s);
    });
    if (!all_ok(errors, "serving layer")) return;
    const mr::ErrorModel model{.fp8 = fp8, .dequant_operands = note.find("DEQUANTIZED") != std::string::npos};
    const mr::ExpertView sv = shared.view(0);
    for (int i = 0; i < rounds; ++i) {
        std::vector<std::pair<int, int64_t>> rows;  // (rank, token)
        for (int r = 0; r < lc.ranks; ++r)
            for (int64_t t = 0; t < lc.tokens[static_cast<size_t>(r)]; ++t) rows.emplace_back(r, t);
        std::vector<mr::Tracked> want(rows.size());
        mr::parallel_for(static_cast<int64_t>(rows.size()), mr::hardware_threads(), [&](int64_t j) {
            const auto [r, t] = rows[static_cast<size_t>(j)];
            const RankData& x = in[static_cast<size_t>(i)][static_cast<size_t>(r)];
            want[static_cast<size_t>(j)] = mr::moe_token(
                x.x.data() + t * lc.hidden, lc.hidden, x.idx64.data() + t * lc.topk, x.w.data() + t * lc.topk, lc.topk,
                [&](int64_t e) { return all.view(e); }, lc.shared ? &sv : nullptr, model);
        });
        mr::Comparison cmp;
        for (size_t j = 0; j < rows.size(); ++j) {
            const auto [r, t] = rows[j];
            const auto& got = outs[static_cast<size_t>(i)][static_cast<size_t>(r)];
            ASSERT_EQ(got.size(), static_cast<size_t>(lc.tokens[static_cast<size_t>(r)] * lc.hidden));
            for (int64_t n = 0; n < lc.hidden; ++n)
                cmp.add(num::bf16_to_float(got[static_cast<size_t>(t * lc.hidden + n)]), want[j], n);
        }
        cmp.finish();
        std::printf("[ serving ] R=%d %s %s %s%s round %d: %s\n  path: %s\n", lc.ranks, phase_name(lc.phase),
                    weight_placement_name(lc.placement), fp8 ? "fp8" : "bf16", lc.graph ? " (graph replay)" : "", i,
                    comparison_text(cmp).c_str(), note.c_str());
        EXPECT_TRUE(cmp.pass()) << comparison_text(cmp) << "; " << note;
    }
}

TEST(ServingGpu, LayerMatchesTheDenseReference) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    for (int ranks : {1, 2, 4})
        for (Phase ph : {Phase::kPrefill, Phase::kDecode}) {
            std::vector<int64_t> tokens(static_cast<size_t>(ranks), 12);
            if (ranks > 1) tokens[1] = 0;  // a rank without tokens
            run_layer_gpu(LayerCase{.ranks = ranks, .phase = ph, .tokens = tokens});
        }
    run_layer_gpu(
        LayerCase{.ranks = 2, .phase = Phase::kDecode, .placement = WeightPlacement::kAdapter, .tokens = {9, 16}});
    run_layer_gpu(
        LayerCase{.ranks = 2, .phase = Phase::kPrefill, .placement = WeightPlacement::kAdapter, .tokens = {16, 3}});
    run_layer_gpu(LayerCase{.ranks = 2, .kind = ExpertQuantKind::kBF16, .tokens = {10, 12}});
    run_layer_gpu(LayerCase{.ranks = 2, .kind = ExpertQuantKind::kBF16, .phase = Phase::kDecode, .tokens = {10, 12}});
    run_layer_gpu(LayerCase{.ranks = 2, .force_dequant = true, .tokens = {8, 8}});
    run_layer_gpu(LayerCase{.ranks = 2, .tokens = {0, 0}});
}

// DeepSeek-V3's expert shape (H = 7168, I = 2048, top-8) with 16 experts, through cuBLASLt.
TEST(ServingGpu, DeepSeekV3ShapedLayer) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    run_layer_gpu(LayerCase{
        .ranks = 2, .experts = 16, .topk = 8, .hidden = 7168, .inter = 2048, .capacity = 8, .tokens = {6, 8}});
    run_layer_gpu(LayerCase{.ranks = 2,
                            .experts = 16,
                            .topk = 8,
                            .hidden = 7168,
                            .inter = 2048,
                            .phase = Phase::kDecode,
                            .capacity = 8,
                            .tokens = {8, 5}});
}

// The decode layer captured once in a CUDA graph (dispatch -> masked GEMMs over fixed slab shapes
// -> combine, plus the shared expert), replayed with new tokens, routes and weights.
TEST(ServingGpu, DecodeLayerReplaysFromACudaGraph) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    for (int ranks : {1, 2})
        for (auto p : {WeightPlacement::kCombine, WeightPlacement::kAdapter})
            run_layer_gpu(LayerCase{.ranks = ranks,
                                    .phase = Phase::kDecode,
                                    .placement = p,
                                    .capacity = 8,
                                    .tokens = std::vector<int64_t>(static_cast<size_t>(ranks), 7),
                                    .graph = true});
}

// The same replays on the direct path (two ranks as threads on this GPU). Its kernels once waited
// for their peers in every block of one grid, which deadlocked here beside the layer's GEMMs
// (device run of 2026-12-01); now one block of a rank waits at a time.
TEST(ServingGpu, DecodeLayerReplaysFromACudaGraphOnTheDirectPath) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const ScopedEnv direct("ELASTICEP_KERNEL_VARIANT", "direct");
    for (auto p : {WeightPlacement::kCombine, WeightPlacement::kAdapter})
        run_layer_gpu(LayerCase{.ranks = 2,
                                .phase = Phase::kDecode,
                                .placement = p,
                                .capacity = 8,
                                .tokens = std::vector<int64_t>(2, 7),
                                .graph = true});
}

}  // namespace
}  // namespace eptest
