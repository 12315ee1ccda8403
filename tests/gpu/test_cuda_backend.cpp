// CUDA backend against the CPU backend: the same inputs on every rank, outputs compared with exact
// equality (real rows, counts, offsets, weights, src, m_indices, scales, combine outputs). Ranks
// are threads; several ranks share one GPU, or one rank per GPU when two or more are present.
#include "gpu_harness.hpp"

#include "e4m3_selftest.hpp"

#include <algorithm>
#include <sstream>

namespace elasticep::gputest {
namespace {

#if ELASTICEP_TEST_HAVE_CUDA

struct Scenario {
    int ranks = 2;
    int gpus = 1;
    Payload payload = Payload::kBF16;
    ScaleFormat format = ScaleFormat::kF32G128;
    bool prequant = false;
    Layout layout = Layout::kExpertContiguous;
    bool host_sync = true;
    int alignment = 1;
    bool weights = true;
    bool weighted = true;
    bool bias = false;
    bool zero_padding = false;
    bool mn_major = false;
    int tmode = 2;  // 0: T=0, 1: T=1, 2: T=C, 3: uneven per rank
    bool idx64 = false;
    bool hot = false;
    int hidden = 256;
    int experts = 16;
    int topk = 4;
    int capacity = 6;

    std::string describe() const {
        std::ostringstream os;
        os << "R=" << ranks << " gpus=" << gpus << " " << payload_name(payload);
        if (payload == Payload::kFP8) os << "/" << scale_format_name(format) << (prequant ? "/prequant" : "/quantize");
        os << " " << layout_name(layout) << (host_sync ? " host_sync" : " graph") << " A=" << alignment
           << " w=" << weights << " weighted=" << weighted << " bias=" << bias << " zpad=" << zero_padding
           << " mn=" << mn_major << " tmode=" << tmode << " idx64=" << idx64 << " hot=" << hot << " H=" << hidden
           << " E=" << experts << " K=" << topk << " C=" << capacity;
        return os.str();
    }
};

int64_t tokens_of(const Scenario& sc, int r) {
    switch (sc.tmode) {
        case 0: return 0;
        case 1: return 1;
        case 2: return sc.capacity;
        default: return (r * 3 + 1) % (sc.capacity + 1);
    }
}

template <class T>
int64_t first_diff(const std::vector<T>& a, const std::vector<T>& b) {
    if (a.size() != b.size()) return -2;
    for (size_t i = 0; i < a.size(); ++i)
        if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
    return -1;
}

// Number of elements a strided view spans.
int64_t span_of(const TensorRef& t) {
    int64_t s = 1;
    for (int d = 0; d < t.ndim(); ++d) {
        if (t.size(d) == 0) return 0;
        s += (t.size(d) - 1) * t.stride(d);
    }
    return s;
}

// Host view of a dispatch result (CPU: already host memory; GPU: downloaded).
struct HostDispatch {
    std::vector<int64_t> x_shape, sc_shape, sc_strides;
    std::vector<uint8_t> x;
    std::vector<uint32_t> scales;
    std::vector<float> w;
    std::vector<int32_t> src, mi, counts, offsets;
    int64_t num_rows = -1;
};

template <class T>
std::vector<T> fetch(const TensorRef& t, bool device, int64_t count) {
    if (count <= 0) return {};
    if (device) return download<T>(t.data, static_cast<size_t>(count));
    const T* p = static_cast<const T*>(t.data);
    return std::vector<T>(p, p + count);
}

HostDispatch to_host(const DispatchResult& r, bool device) {
    HostDispatch h;
    h.x_shape = r.recv_x.shape;
    h.x = fetch<uint8_t>(r.recv_x, device, r.recv_x.numel() * static_cast<int64_t>(dtype_size(r.recv_x.dtype)));
    if (r.recv_scales) {
        h.sc_shape = r.recv_scales->shape;
        for (int d = 0; d < r.recv_scales->ndim(); ++d) h.sc_strides.push_back(r.recv_scales->stride(d));
        h.scales = fetch<uint32_t>(*r.recv_scales, device, span_of(*r.recv_scales));
    }
    h.w = fetch<float>(r.recv_weights, device, r.recv_weights.numel());
    h.src = fetch<int32_t>(r.recv_src, device, r.recv_src.numel());
    if (r.layout == Layout::kExpertContiguous) {
        h.mi = fetch<int32_t>(r.m_indices, device, r.m_indices.numel());
        h.offsets = fetch<int32_t>(r.offsets, device, r.offsets.numel());
    }
    h.counts = fetch<int32_t>(r.counts, device, r.counts.numel());
    h.num_rows = r.num_rows;
    return h;
}

void compare_dispatch(const HostDispatch& c, const HostDispatch& g, bool zero_padding, int hidden, const std::string& tag) {
    ASSERT_EQ(c.x_shape, g.x_shape) << tag;
    EXPECT_EQ(c.num_rows, g.num_rows) << tag;
    EXPECT_EQ(first_diff(c.counts, g.counts), -1) << tag << " counts";
    EXPECT_EQ(first_diff(c.offsets, g.offsets), -1) << tag << " offsets";
    EXPECT_EQ(first_diff(c.w, g.w), -1) << tag << " recv_weights";
    EXPECT_EQ(first_diff(c.src, g.src), -1) << tag << " recv_src";
    EXPECT_EQ(first_diff(c.mi, g.mi), -1) << tag << " m_indices";
    ASSERT_EQ(c.x.size(), g.x.size()) << tag;
    const int64_t rows = static_cast<int64_t>(c.src.size());
    const size_t row_bytes = rows ? c.x.size() / static_cast<size_t>(rows) : 0;
    EXPECT_EQ(c.sc_shape, g.sc_shape) << tag;
    EXPECT_EQ(c.sc_strides, g.sc_strides) << tag;
    int64_t bad_rows = 0, first_bad = -1;
    for (int64_t r = 0; r < rows; ++r) {
        const bool real = c.src[static_cast<size_t>(r)] != -1;
        if (!real && !zero_padding) continue;
        bool same = std::memcmp(c.x.data() + r * row_bytes, g.x.data() + r * row_bytes, row_bytes) == 0;
        if (!c.sc_shape.empty()) {
            const int64_t cols = c.sc_shape.back();
            const bool masked = c.sc_shape.size() == 3;
            const int64_t rc = masked ? c.sc_shape[1] : 1;
            for (int64_t col = 0; col < cols; ++col) {
                const int64_t at = masked ? (r / rc) * c.sc_strides[0] + (r % rc) * c.sc_strides[1] + col * c.sc_strides[2]
                                          : r * c.sc_strides[0] + col * c.sc_strides[1];
                same = same && c.scales[static_cast<size_t>(at)] == g.scales[static_cast<size_t>(at)];
            }
        }
        if (!same) {
            ++bad_rows;
            if (first_bad < 0) first_bad = r;
        }
    }
    EXPECT_EQ(bad_rows, 0) << tag << " recv_x/recv_scales rows differ, first at row " << first_bad << " (hidden "
                           << hidden << ")";
}

struct RankRun {
    HostDispatch cpu, gpu;
    std::vector<uint16_t> cpu_out, gpu_out;
};

// Everything one rank does in one scenario. `cpu`/`gpu` are this rank's buffers.
// Device buffers of a round live in `keep` until every rank is done: with several ranks on one GPU,
// a cudaFree can wait for the device to go idle while a peer's kernel waits for this rank.
void run_round(const Scenario& sc, int r, Buffer& cpu, Buffer& gpu, cudaStream_t stream, const Inputs& in,
               uint64_t seed, const std::string& tag, std::vector<DevBuf>& keep) {
    const BufferConfig& cfg = cpu.config();
    const int h = cfg.hidden;
    const int64_t t = in.t;
    const Device dev{DeviceType::kCUDA, gpu.config().device};

    auto make_args = [&](const void* x, const void* xs, const void* idx, const void* w, Device d) {
        return dispatch_args(cfg, sc, sc.prequant, t, x, xs, idx, w, d);
    };
    const void* hx = sc.prequant ? static_cast<const void*>(in.x_fp8.data()) : in.x.data();
    const void* hidx = sc.idx64 ? static_cast<const void*>(in.idx64.data()) : in.idx32.data();
    // CPU backend first: dispatch, then combine with a random y in its row positions
    DispatchResult cres = cpu.dispatch(make_args(hx, in.scales.data(), hidx, in.w.data(), Device{}));
    const HostDispatch ch = to_host(cres, false);
    const std::vector<int64_t> y_shape = cres.recv_x.shape;
    std::mt19937_64 g(seed ^ 0x9e3779b97f4a7c15ull);
    std::vector<uint16_t> y(static_cast<size_t>(cres.recv_x.numel()));
    for (auto& v : y) v = random_bf16(g, false);
    CombineArgs cc;
    cc.y = TensorRef::contiguous(y.data(), DType::kBFloat16, y_shape);
    cc.weighted = sc.weighted;
    if (sc.bias) cc.bias = TensorRef::contiguous(const_cast<uint16_t*>(in.bias.data()), DType::kBFloat16, {t, h});
    CombineResult cout = cpu.combine(std::move(cres.handle), cc);
    std::vector<uint16_t> cpu_out = fetch<uint16_t>(cout.out, false, t * h);

    // every device allocation and upload before any rank starts the collective: with several
    // ranks on one GPU, cudaMalloc / pageable cudaMemcpy can wait for the device while a peer's
    // kernel waits for this rank
    keep.push_back(sc.prequant ? DevBuf::upload(in.x_fp8) : DevBuf::upload(in.x));
    keep.push_back(DevBuf::upload(in.scales));
    keep.push_back(sc.idx64 ? DevBuf::upload(in.idx64) : DevBuf::upload(in.idx32));
    keep.push_back(DevBuf::upload(in.w));
    keep.push_back(DevBuf::upload(y));
    keep.push_back(DevBuf::upload(in.bias));
    const size_t n0 = keep.size();
    DevBuf& dx = keep[n0 - 6];
    DevBuf& dsc = keep[n0 - 5];
    DevBuf& didx = keep[n0 - 4];
    DevBuf& dw = keep[n0 - 3];
    DevBuf& dy = keep[n0 - 2];
    DevBuf& dbias = keep[n0 - 1];
    gpu.group()->barrier();

    DispatchArgs ga = make_args(dx.ptr, dsc.ptr, didx.ptr, dw.ptr, dev);
    ga.stream = stream;
    DispatchResult gres = gpu.dispatch(ga);
    EXPECT_EQ(gres.handle.num_sms() > 0, true) << tag;
    CombineArgs gc;
    gc.y = TensorRef::contiguous(dy.ptr, DType::kBFloat16, gres.recv_x.shape, dev);
    gc.weighted = sc.weighted;
    if (sc.bias) gc.bias = TensorRef::contiguous(dbias.ptr, DType::kBFloat16, {t, h}, dev);
    gc.stream = stream;
    const std::vector<int64_t> g_shape = gres.recv_x.shape;
    // combine before reading anything back: the handle's outputs stay valid until the next dispatch
    const DispatchResult kept = roundgen::views_of(gres);
    ASSERT_EQ(g_shape, y_shape) << tag;
    CombineResult gout = gpu.combine(std::move(gres.handle), gc);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess) << tag;
    gpu.group()->barrier();  // every rank's device work is done: downloads may synchronise freely
    const HostDispatch gh = to_host(kept, true);
    compare_dispatch(ch, gh, sc.zero_padding, h, tag);
    std::vector<uint16_t> gpu_out = fetch<uint16_t>(gout.out, true, t * h);
    EXPECT_EQ(first_diff(cpu_out, gpu_out), -1) << tag << " combine out";
    gpu.check();  // surfaces a device timeout, if any
    (void)r;
}

void run_scenario(const Scenario& sc, uint64_t seed) {
    BufferConfig cfg;
    cfg.num_experts = sc.experts;
    cfg.num_topk = sc.topk;
    cfg.hidden = sc.hidden;
    cfg.max_tokens_per_rank = sc.capacity;
    cfg.payload = sc.payload;
    cfg.scale_format = sc.format;
    cfg.timeout = std::chrono::milliseconds(20000);
    auto cpu_groups = ThreadGroup::create(sc.ranks);
    auto gpu_groups = ThreadGroup::create(sc.ranks);
    const std::string tag = sc.describe();
    run_ranks(sc.ranks, [&](int r) {
        BufferConfig gc = cfg;
        gc.device = r % sc.gpus;
        if (cudaSetDevice(gc.device) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
        auto cpu = Buffer::create(cpu_groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        auto gpu = Buffer::create(gpu_groups[static_cast<size_t>(r)], gc, BackendKind::kCUDA);
        cudaStream_t stream;
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        const Inputs in = make_inputs(cfg, tokens_of(sc, r), seed * 131 + static_cast<uint64_t>(r), sc.prequant,
                                      sc.weights, sc.bias, sc.hot);
        std::vector<DevBuf> keep;
        keep.reserve(64);  // references into it must stay valid
        run_round(sc, r, *cpu, *gpu, stream, in, seed * 977 + static_cast<uint64_t>(r), tag + " rank " + std::to_string(r),
                  keep);
        // a second round on the same buffers (epoch 2, other parity, reused slots)
        const Inputs in2 = make_inputs(cfg, tokens_of(sc, r + 1), seed * 7 + static_cast<uint64_t>(r), sc.prequant,
                                       sc.weights, sc.bias, !sc.hot);
        run_round(sc, r, *cpu, *gpu, stream, in2, seed * 31 + static_cast<uint64_t>(r),
                  tag + " rank " + std::to_string(r) + " round 2", keep);
        gpu_groups[static_cast<size_t>(r)]->barrier();  // every rank done before any cudaFree
        cudaStreamDestroy(stream);
    });
}

std::vector<Scenario> matrix(int ranks, int gpus) {
    struct P {
        Payload p;
        ScaleFormat f;
        bool pre;
    };
    const std::vector<P> payloads = {{Payload::kBF16, ScaleFormat::kF32G128, false},
                                     {Payload::kFP8, ScaleFormat::kF32G128, false},
                                     {Payload::kFP8, ScaleFormat::kUE8M0G128, false},
                                     {Payload::kFP8, ScaleFormat::kUE8M0G32, false},
                                     {Payload::kFP8, ScaleFormat::kF32G128, true},
                                     {Payload::kFP8, ScaleFormat::kUE8M0G32, true}};
    std::vector<Scenario> out;
    int i = ranks;
    for (const P& p : payloads)
        for (int lay = 0; lay < 3; ++lay, ++i) {
            Scenario s;
            s.ranks = ranks;
            s.gpus = gpus;
            s.payload = p.p;
            s.format = p.f;
            s.prequant = p.pre;
            s.layout = lay == 2 ? Layout::kExpertMasked : Layout::kExpertContiguous;
            s.host_sync = lay == 0;
            s.alignment = i % 2 ? 128 : 1;
            s.weights = i % 3 != 0;
            s.weighted = s.weights && i % 2 == 0;
            s.bias = i % 2 == 1;
            s.zero_padding = i % 4 == 1;
            s.mn_major = p.p == Payload::kFP8 && i % 3 == 1;
            s.tmode = i % 4;
            s.idx64 = i % 2 == 0;
            s.hot = i % 5 == 0;
            s.hidden = (i % 3 == 2) ? 384 : 256;
            if (p.p == Payload::kBF16 && i % 2) s.hidden = 200;  // not a multiple of 16 channels' groups
            out.push_back(s);
        }
    return out;
}

void run_matrix(int ranks, int gpus) {
    uint64_t seed = 1000 + static_cast<uint64_t>(ranks) * 100 + static_cast<uint64_t>(gpus);
    for (const Scenario& s : matrix(ranks, gpus)) {
        run_scenario(s, seed++);
        if (::testing::Test::HasFailure()) {
            ADD_FAILURE() << "stopping the matrix after the failing scenario: " << s.describe();
            return;
        }
    }
}

#endif  // ELASTICEP_TEST_HAVE_CUDA

}  // namespace
}  // namespace elasticep::gputest

namespace elasticep::gputest {
namespace {

TEST(CudaBackendNumerics, HardwareE4M3EqualsReferenceForEveryFloat) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    uint32_t first = 0;
    const uint64_t bad = e4m3_mismatches(&first);
    EXPECT_EQ(bad, 0u) << "first differing fp32 pattern 0x" << std::hex << first;
}

TEST(CudaBackendMatrix, OneRank) {
    ELASTICEP_SKIP_WITHOUT_GPU();
#if ELASTICEP_TEST_HAVE_CUDA
    run_matrix(1, 1);
#endif
}

TEST(CudaBackendMatrix, TwoRanksOneGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
#if ELASTICEP_TEST_HAVE_CUDA
    run_matrix(2, 1);
#endif
}

TEST(CudaBackendMatrix, FourRanksOneGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
#if ELASTICEP_TEST_HAVE_CUDA
    run_matrix(4, 1);
#endif
}

TEST(CudaBackendMatrix, EightRanksOneGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
#if ELASTICEP_TEST_HAVE_CUDA
    run_matrix(8, 1);
#endif
}

TEST(CudaBackendMatrix, OneRankPerGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    if (gpu_count() < 2) GTEST_SKIP() << "needs 2 or more GPUs (found " << gpu_count() << ")";
#if ELASTICEP_TEST_HAVE_CUDA
    run_matrix(2, 2);
    if (!::testing::Test::HasFailure()) run_matrix(4, 2);  // two ranks per GPU on two GPUs
#endif
}

TEST(CudaBackendMatrix, LargeHiddenDeepSeekShape) {
    ELASTICEP_SKIP_WITHOUT_GPU();
#if ELASTICEP_TEST_HAVE_CUDA
    Scenario s;
    s.ranks = 4;
    s.payload = Payload::kFP8;
    s.hidden = 7168;
    s.experts = 32;
    s.topk = 8;
    s.capacity = 64;
    s.alignment = 128;
    s.bias = true;
    run_scenario(s, 77);
    s.layout = Layout::kExpertMasked;
    s.format = ScaleFormat::kUE8M0G128;
    s.mn_major = true;
    run_scenario(s, 78);
#endif
}

}  // namespace
}  // namespace elasticep::gputest
