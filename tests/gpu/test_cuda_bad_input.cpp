// The bad-input suite (issue 10) on the CUDA backend: every case of tests/unit/test_bad_input*.cpp a
// backend can get wrong, with device tensors. Each case ends in a named elasticep::Error (or a
// documented behaviour), never a CUDA fault that kills the context (checked with
// cudaDeviceSynchronize after each group of cases), and afterwards the same buffer (or, where the
// contract says it is unusable, a rebuilt one) runs a correct round: compared byte for byte with the
// oracle and with the CPU backend on the same inputs.
//
// Every rank runs on GPU 0, so ranks of this process always wait for each other on the host (see
// src/backends/cuda/cuda_backend.cu): the cases also run under compute-sanitizer, which serialises
// kernels (tools/device-check, step sanitize). Without a GPU every test skips.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <map>
#include <optional>
#include <thread>

#include "common/device_guarded.hpp"
#include "common/peer_forgeries.hpp"
#include "common/scoped_env.hpp"
#include "gpu_harness.hpp"

namespace eptest {
namespace {

using namespace std::chrono_literals;

constexpr auto kGroupTimeout = 20s;
const Device kGpu0{DeviceType::kCUDA, 0};

BufferConfig small_config(int experts = 4, Payload payload = Payload::kBF16) {
    BufferConfig c{.num_experts = experts, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = 4};
    c.payload = payload;
    c.timeout = 20000ms;
    return c;
}

BufferConfig on_gpu0(BufferConfig c) {
    c.device = 0;
    return c;
}

Scenario scenario(const BufferConfig& cfg, int ranks, uint64_t seed) {
    Scenario s;
    s.cfg = cfg;
    s.num_ranks = ranks;
    s.tokens.assign(static_cast<size_t>(ranks), cfg.max_tokens_per_rank);
    s.p_none = 1.0 / 8;
    s.p_token_none = 1.0 / 16;
    s.seed = seed;
    return s;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// No sticky CUDA error in this process: a misaligned or illegal address would leave one.
void expect_context_ok(const std::string& ctx) {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const cudaError_t e = cudaDeviceSynchronize();
    EXPECT_EQ(e, cudaSuccess) << ctx << ": the CUDA context holds an error: " << cudaGetErrorString(e);
}

// One CUDA buffer (GPU 0) and one CPU buffer per rank, ranks as threads, on groups that outlive them.
struct Pair {
    int ranks = 0;
    BufferConfig cfg;
    std::vector<std::shared_ptr<Group>> gpu_groups, cpu_groups;
    std::vector<std::shared_ptr<Buffer>> gpu, cpu;
    bool ok = false;
};

// (Re)builds every rank's buffers of `cfg` on the pair's groups.
bool build(Pair& p, const BufferConfig& cfg) {
    const size_t n = static_cast<size_t>(p.ranks);
    p.cfg = cfg;
    p.gpu.assign(n, nullptr);
    p.cpu.assign(n, nullptr);
    p.ok = all_ok(run_ranks(p.ranks,
                            [&](int r) {
                                const size_t ri = static_cast<size_t>(r);
                                cuda_ok(cudaSetDevice(0), "cudaSetDevice");
                                p.gpu[ri] = Buffer::create(p.gpu_groups[ri], on_gpu0(cfg), BackendKind::kCUDA);
                                p.cpu[ri] = Buffer::create(p.cpu_groups[ri], cfg, BackendKind::kCPU);
                            }),
                  "building the buffers");
    return p.ok;
}

Pair pair_of(const BufferConfig& cfg, int ranks) {
    Pair p;
    p.ranks = ranks;
    p.gpu_groups = ThreadGroup::create(ranks, kGroupTimeout);
    p.cpu_groups = ThreadGroup::create(ranks, kGroupTimeout);
    build(p, cfg);
    return p;
}

struct BothOutcomes {
    std::vector<RankOutcome> cpu, gpu;
    bool ok = false;
};

// One round of `data` on every rank of `p`, on the CPU and on the CUDA buffers (the shared rank
// runner; device memory is allocated before and freed after every rank's collectives).
BothOutcomes run_both(const Scenario& sc, Pair& p, const std::vector<RankData>& data, const std::string& tag) {
    const size_t n = static_cast<size_t>(p.ranks);
    BothOutcomes o;
    o.cpu.resize(n);
    o.gpu.resize(n);
    o.ok = all_ok(run_ranks(p.ranks,
                            [&](int r) {
                                const size_t ri = static_cast<size_t>(r);
                                cuda_ok(cudaSetDevice(0), "cudaSetDevice");
                                HostMemory host;
                                o.cpu[ri] = run_rank_round(sc, r, *p.cpu[ri], data[ri], host);
                                CudaMemory dev(0);
                                Group& g = *p.gpu_groups[ri];
                                const RoundHooks hooks{[&] { g.barrier(); }, [&] { g.barrier(); }};
                                o.gpu[ri] = run_rank_round(sc, r, *p.gpu[ri], data[ri], dev, hooks);
                                g.barrier();  // every rank read back before any rank frees device memory
                            }),
                  tag);
    return o;
}

// A correct round: both backends equal the oracle and each other, and nothing is sticky afterwards.
void expect_good_round(const Scenario& sc, Pair& p, const std::string& tag) {
    ASSERT_TRUE(p.ok) << tag << ": the buffers were not built";
    const std::vector<RankData> data = make_inputs(sc);
    const BothOutcomes o = run_both(sc, p, data, tag);
    if (!o.ok) return;
    expect_rounds_equal({sc}, {data}, {o.cpu}, {o.gpu}, tag);
    for (int r = 0; r < p.ranks; ++r) EXPECT_NO_THROW(p.gpu[static_cast<size_t>(r)]->check()) << tag << " rank " << r;
    expect_context_ok(tag);
}

// The error of `fn` as (code, message); nullopt when it returned.
struct Raised {
    ErrorCode code = ErrorCode::kInternal;
    std::string message;
};
template <class Fn>
std::optional<Raised> raised_by(Fn&& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return Raised{e.code(), e.message()};
    }
    return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Shapes, dtypes, devices, strides, capacity, options and caller outputs that do not match the
// buffer: a named error before any communication. Only rank 0 makes the calls while rank 1 waits
// outside the buffer: a call that reached the protocol would wait for rank 1 and time out, and the
// round both ranks run afterwards would be out of step.

struct ArgCase {
    const char* name;
    bool fp8;  // on the fp8 buffers (else bf16)
    std::function<void(DispatchArgs&)> mutate;
    ErrorCode code;
    std::vector<std::string> needles;
};

TEST(CudaBadInput, ArgumentsAreRefusedBeforeAnyCommunication) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const BufferConfig bf = small_config();
    BufferConfig f8 = small_config();
    f8.payload = Payload::kFP8;  // f32_g128: one scale column at H = 128
    Pair pb = pair_of(bf, 2), p8 = pair_of(f8, 2);
    ASSERT_TRUE(pb.ok && p8.ok);
    const int64_t t = bf.max_tokens_per_rank, h = bf.hidden, k = bf.num_topk;
    const int64_t rows_cap = pb.gpu[0]->max_contiguous_rows(1);
    // rank 0's tensors: pieces of one device scratch area (valid ids; the rest is never read)
    DevBuf scratch(1 << 20);
    ASSERT_EQ(cudaMemset(scratch.ptr, 0, 1 << 20), cudaSuccess);
    auto* s = static_cast<uint8_t*>(scratch.ptr);
    const std::vector<int32_t> ids = {0, 1, 1, 0, 2, 3, 3, 2};
    ASSERT_EQ(cudaMemcpy(s + 65536, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);  // landed (the calls' streams are non-blocking)
    std::vector<uint8_t> host(1 << 16);
    void* x = s;
    void* idx = s + 65536;
    void* w = s + 131072;
    void* x8 = s + 196608;
    void* xs = s + 262144;
    void* out = s + 327680;  // room for rows_cap rows of every output
    auto base = [&](bool fp8) {
        DispatchArgs a;
        if (fp8) {
            a.x = TensorRef::contiguous(x8, DType::kFloat8E4M3, {t, h}, kGpu0);
            a.x_scales = TensorRef::contiguous(xs, DType::kFloat32, {t, 1}, kGpu0);
        } else {
            a.x = TensorRef::contiguous(x, DType::kBFloat16, {t, h}, kGpu0);
        }
        a.topk_idx = TensorRef::contiguous(idx, DType::kInt32, {t, k}, kGpu0);
        a.topk_weights = TensorRef::contiguous(w, DType::kFloat32, {t, k}, kGpu0);
        return a;
    };
    const auto invalid = ErrorCode::kInvalidArgument;
    const std::vector<ArgCase> cases = {
        {"x 1-D",
         false,
         [&](auto& a) { a.x = TensorRef::contiguous(x, DType::kBFloat16, {t * h}, kGpu0); },
         invalid,
         {"dispatch: x is bf16[512]", "must be 2-D"}},
        {"x negative rows",
         false,
         [&](auto& a) {
             a.x.shape = {-3, h};
         },
         invalid,
         {"cannot be negative"}},
        {"x wrong hidden",
         false,
         [&](auto& a) {
             a.x.shape = {t, 64};
         },
         invalid,
         {"dispatch: x is", "must be [4, 128]"}},
        {"x fp32", false, [&](auto& a) { a.x.dtype = DType::kFloat32; }, invalid, {"dispatch: x is fp32", "bf16"}},
        {"fp8 x into a bf16 buffer",
         false,
         [&](auto& a) { a.x.dtype = DType::kFloat8E4M3; },
         invalid,
         {"payload is bf16"}},
        {"x_scales with bf16 x",
         false,
         [&](auto& a) {
             a.x_scales = TensorRef::contiguous(xs, DType::kFloat32, {t, 1}, kGpu0);
         },
         invalid,
         {"x_scales given but x is bf16"}},
        {"x on the host",
         false,
         [&](auto& a) {
             a.x = TensorRef::contiguous(host.data(), DType::kBFloat16, {t, h});
         },
         invalid,
         {"dispatch: x is on cpu but this buffer's backend works on cuda:0"}},
        {"topk_idx on the host",
         false,
         [&](auto& a) {
             a.topk_idx = TensorRef::contiguous(host.data(), DType::kInt32, {t, k});
         },
         invalid,
         {"dispatch: topk_idx is on cpu"}},
        {"x on another device index",
         false,
         [&](auto& a) {
             a.x.device = Device{DeviceType::kCUDA, 7};
         },
         invalid,
         {"dispatch: x is on cuda:7"}},
        {"x null", false, [&](auto& a) { a.x.data = nullptr; }, invalid, {"dispatch: x has a null data pointer"}},
        {"x last dimension strided",
         false,
         [&](auto& a) {
             a.x.strides = {2 * h, 2};
         },
         invalid,
         {"last dimension must be contiguous"}},
        {"x row stride below the row",
         false,
         [&](auto& a) {
             a.x.strides = {h / 2, 1};
         },
         invalid,
         {"row stride must be at least its row length"}},
        {"x row stride 2^61",
         false,
         [&](auto& a) {
             a.x.strides = {int64_t{1} << 61, 1};
         },
         invalid,
         {"row stride", "spans more memory"}},
        {"more tokens than the capacity",
         false,
         [&](auto& a) {
             a.x.shape = {t + 1, h};
             a.topk_idx.shape = {t + 1, k};
             a.topk_weights->shape = {t + 1, k};
         },
         ErrorCode::kCapacityExceeded,
         {"rank 0 has 5 tokens", "max_tokens_per_rank=4", "raise max_tokens_per_rank to at least 5"}},
        {"topk_idx fp32",
         false,
         [&](auto& a) { a.topk_idx.dtype = DType::kFloat32; },
         invalid,
         {"topk_idx is fp32", "must be int32 or int64"}},
        {"topk_idx one column too many",
         false,
         [&](auto& a) {
             a.topk_idx.shape = {t, k + 1};
         },
         invalid,
         {"dispatch: topk_idx is", "must be [4, 2]"}},
        {"topk_weights int32",
         false,
         [&](auto& a) { a.topk_weights->dtype = DType::kInt32; },
         invalid,
         {"topk_weights is int32", "must be fp32"}},
        {"topk_weights one row short",
         false,
         [&](auto& a) {
             a.topk_weights->shape = {t - 1, k};
         },
         invalid,
         {"dispatch: topk_weights is", "must be [4, 2]"}},
        {"layout 7", false, [&](auto& a) { a.layout = static_cast<Layout>(7); }, invalid, {"layout=7", "not a Layout"}},
        {"expert_alignment 0",
         false,
         [&](auto& a) { a.expert_alignment = 0; },
         invalid,
         {"expert_alignment=0", "[1, 65536]"}},
        {"expert_alignment 65537",
         false,
         [&](auto& a) { a.expert_alignment = kMaxExpertAlignment + 1; },
         invalid,
         {"expert_alignment=65537"}},
        {"scales_mn_major with bf16",
         false,
         [&](auto& a) { a.scales_mn_major = true; },
         invalid,
         {"scales_mn_major needs an fp8 payload"}},
        {"recv_x one row short",
         false,
         [&](auto& a) {
             a.outputs.recv_x = TensorRef::contiguous(out, DType::kBFloat16, {rows_cap - 1, h}, kGpu0);
         },
         invalid,
         {"caller-provided output recv_x is bf16[15, 128]", "needs bf16[16, 128]"}},
        {"recv_weights int32",
         false,
         [&](auto& a) { a.outputs.recv_weights = TensorRef::contiguous(out, DType::kInt32, {rows_cap}, kGpu0); },
         invalid,
         {"caller-provided output recv_weights is int32[16]"}},
        {"recv_src on the host",
         false,
         [&](auto& a) { a.outputs.recv_src = TensorRef::contiguous(host.data(), DType::kInt32, {rows_cap}); },
         invalid,
         {"caller-provided output recv_src is int32[16] cpu"}},
        {"recv_src strided",
         false,
         [&](auto& a) {
             TensorRef r = TensorRef::contiguous(out, DType::kInt32, {rows_cap}, kGpu0);
             r.strides = {2};
             a.outputs.recv_src = r;
         },
         invalid,
         {"caller-provided output recv_src"}},
        {"m_indices for the masked layout",
         false,
         [&](auto& a) {
             a.layout = Layout::kExpertMasked;
             a.outputs.m_indices = TensorRef::contiguous(out, DType::kInt32, {rows_cap}, kGpu0);
         },
         invalid,
         {"caller-provided m_indices given for the masked layout"}},
        {"recv_scales for a bf16 payload",
         false,
         [&](auto& a) {
             a.outputs.recv_scales = TensorRef::contiguous(out, DType::kFloat32, {rows_cap, 1}, kGpu0);
         },
         invalid,
         {"caller-provided recv_scales given for a bf16 payload"}},
        {"recv_weights 2 bytes off",
         false,
         [&](auto& a) {
             a.outputs.recv_weights =
                 TensorRef::contiguous(static_cast<uint8_t*>(out) + 2, DType::kFloat32, {rows_cap}, kGpu0);
         },
         invalid,
         {"dispatch: caller-provided output", "not aligned to its 4-byte elements"}},
        // element-aligned, but the kernels store outputs 16 bytes at a time
        {"recv_weights 4 bytes off",
         false,
         [&](auto& a) {
             a.outputs.recv_weights =
                 TensorRef::contiguous(static_cast<uint8_t*>(out) + 4, DType::kFloat32, {rows_cap}, kGpu0);
         },
         invalid,
         {"caller-provided dispatch output at", "must be 16-byte aligned for the CUDA backend"}},
        {"recv_x 2 bytes off",
         false,
         [&](auto& a) {
             a.outputs.recv_x =
                 TensorRef::contiguous(static_cast<uint8_t*>(out) + 2, DType::kBFloat16, {rows_cap, h}, kGpu0);
         },
         invalid,
         {"must be 16-byte aligned for the CUDA backend"}},
        {"pre-quantized x without x_scales",
         true,
         [&](auto& a) { a.x_scales.reset(); },
         invalid,
         {"x_scales [4, 1] (f32_g128) is required"}},
        {"x_scales int32 for f32_g128",
         true,
         [&](auto& a) { a.x_scales->dtype = DType::kInt32; },
         invalid,
         {"x_scales is int32", "scale format f32_g128 needs fp32"}},
        {"x_scales two columns",
         true,
         [&](auto& a) {
             a.x_scales->shape = {t, 2};
         },
         invalid,
         {"dispatch: x_scales is", "must be [4, 1]"}},
        {"x_scales on the host",
         true,
         [&](auto& a) {
             a.x_scales = TensorRef::contiguous(host.data(), DType::kFloat32, {t, 1});
         },
         invalid,
         {"dispatch: x_scales is on cpu"}},
    };
    std::atomic<int> done{0};
    double seconds = 0;
    ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) {
        cuda_ok(cudaSetDevice(0), "cudaSetDevice");
        if (r == 0) {
            const auto t0 = std::chrono::steady_clock::now();
            for (const ArgCase& c : cases) {
                DispatchArgs a = base(c.fp8);
                c.mutate(a);
                EXPECT_TRUE(throws_error([&] { (c.fp8 ? p8 : pb).gpu[0]->dispatch(a); }, c.code, c.needles)) << c.name;
                ++done;
            }
            // graph capture: a host-sync dispatch, and the first call of a layout (it allocates the
            // outputs), are refused while the stream captures, and enqueue nothing
            cudaStream_t st = nullptr;
            ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
            ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
            DispatchArgs a = base(false);
            a.stream = st;
            EXPECT_TRUE(throws_error([&] { pb.gpu[0]->dispatch(a); }, invalid,
                                     {"host_sync=true cannot be captured in a CUDA graph", "pass host_sync=false"}));
            a.host_sync = false;
            a.expert_alignment = 64;  // more rows than any earlier call on this buffer allocated
            EXPECT_TRUE(throws_error([&] { pb.gpu[0]->dispatch(a); }, invalid,
                                     {"allocates the buffer-owned outputs and cannot be captured", "run it once"}));
            cudaGraph_t graph = nullptr;
            EXPECT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess) << "a refused call invalidated the capture";
            size_t nodes = 1;
            if (graph) {
                EXPECT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
                EXPECT_EQ(nodes, 0u) << "a refused call enqueued work into the captured graph";
                cudaGraphDestroy(graph);
            }
            cudaStreamDestroy(st);
            seconds = seconds_since(t0);
        }
        pb.gpu_groups[static_cast<size_t>(r)]->barrier();  // rank 1 waits here, outside its buffers
    })));
    EXPECT_EQ(done.load(), static_cast<int>(cases.size()));
    EXPECT_LT(seconds, 5.0) << "a refused call waited (for the peer, or the buffer's 20 s timeout)";
    expect_context_ok("after the refused calls");
    // the ranks are still in step: a correct round on every buffer
    expect_good_round(scenario(bf, 2, 11), pb, "bf16 after the refused calls");
    Scenario pre = scenario(f8, 2, 12);
    pre.prequantized = true;
    expect_good_round(pre, p8, "fp8 pre-quantized after the refused calls");
}

// ---------------------------------------------------------------------------------------------
// Misaligned typed tensors. The kernels load ids, weights and scales as typed values: a pointer off
// its element size is refused by name (it would be a misaligned-address fault, which kills the CUDA
// context). A pointer that is element-aligned but not 16-byte aligned is legal and must give the
// right answer (the kernels fall back from 16-byte loads).

// Device memory placing chosen inputs (by their host storage) at a byte offset past a 256-byte aligned
// allocation: the odd-offset views an np.frombuffer(offset=1) or a byte slice gives through DLPack.
class OffsetMemory final : public TestMemory {
 public:
    explicit OffsetMemory(std::map<const void*, size_t> offsets) : dev_(0), offsets_(std::move(offsets)) {}
    Device device() const override { return dev_.device(); }
    void* place(const void* host, size_t bytes) override {
        const auto it = offsets_.find(host);
        const size_t off = it == offsets_.end() ? 0 : it->second;
        auto* base = static_cast<uint8_t*>(dev_.fresh(bytes + off, 0x5a));
        if (bytes) cuda_ok(cudaMemcpy(base + off, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
        cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize");  // the DMA and the fill landed
        return base + off;
    }
    void* fresh(size_t bytes, uint8_t fill) override { return dev_.fresh(bytes, fill); }
    void copy_to_host(void* dst, const void* src, size_t bytes) override { dev_.copy_to_host(dst, src, bytes); }
    void* stream() const override { return dev_.stream(); }
    void synchronize() override { dev_.synchronize(); }

 private:
    CudaMemory dev_;
    std::map<const void*, size_t> offsets_;
};

enum class Which { kX, kScales, kIdx, kWeights };

const void* storage_of(const Scenario& sc, const RankData& d, Which which) {
    switch (which) {
        case Which::kX:
            return sc.prequantized ? static_cast<const void*>(d.x8.data()) : d.x.data();
        case Which::kScales:
            return d.xs.data();
        case Which::kIdx:
            return sc.idx64 ? static_cast<const void*>(d.idx64.data()) : d.idx32.data();
        case Which::kWeights:
            return d.w.data();
    }
    return nullptr;
}

struct Placement {
    Which which;
    size_t offset;
};

struct AlignCase {
    const char* name;
    bool fp8, prequantized, idx64;
    std::vector<Placement> placements;
    std::vector<std::string> needles;  // empty: legal, the round must be right
};

TEST(CudaBadInput, MisalignedInputsAreNamedErrorsNeverFaults) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    BufferConfig f8 = small_config();
    f8.payload = Payload::kFP8;
    Pair pb = pair_of(small_config(), 1), p8 = pair_of(f8, 1);
    ASSERT_TRUE(pb.ok && p8.ok);
    const std::vector<std::string> named = {"has data pointer 0x", "copy it into a freshly allocated tensor"};
    const std::vector<AlignCase> cases = {
        // refused by name
        {"int64 topk_idx 4 bytes off",
         false,
         false,
         true,
         {{Which::kIdx, 4}},
         {"dispatch: topk_idx (", "not aligned to its 8-byte elements"}},
        {"int64 topk_idx 1 byte off",
         false,
         false,
         true,
         {{Which::kIdx, 1}},
         {"dispatch: topk_idx (", "not aligned to its 8-byte elements"}},
        {"int32 topk_idx 2 bytes off",
         false,
         false,
         false,
         {{Which::kIdx, 2}},
         {"dispatch: topk_idx (", "not aligned to its 4-byte elements"}},
        {"topk_weights 1 byte off",
         false,
         false,
         false,
         {{Which::kWeights, 1}},
         {"dispatch: topk_weights (", "not aligned to its 4-byte elements"}},
        {"topk_weights 2 bytes off",
         false,
         false,
         true,
         {{Which::kWeights, 2}},
         {"dispatch: topk_weights (", "not aligned to its 4-byte elements"}},
        {"bf16 x 1 byte off",
         false,
         false,
         false,
         {{Which::kX, 1}},
         {"dispatch: x (", "not aligned to its 2-byte elements"}},
        {"bf16 x 3 bytes off, quantized in dispatch",
         true,
         false,
         false,
         {{Which::kX, 3}},
         {"dispatch: x (", "not aligned to its 2-byte elements"}},
        {"fp32 x_scales 2 bytes off",
         true,
         true,
         false,
         {{Which::kScales, 2}},
         {"dispatch: x_scales (", "not aligned to its 4-byte elements"}},
        {"fp32 x_scales 3 bytes off",
         true,
         true,
         true,
         {{Which::kScales, 3}},
         {"dispatch: x_scales (", "not aligned to its 4-byte elements"}},
        // legal: element-aligned, not 16-byte aligned
        {"bf16 x +2, int64 ids +8, weights +4",
         false,
         false,
         true,
         {{Which::kX, 2}, {Which::kIdx, 8}, {Which::kWeights, 4}},
         {}},
        {"bf16 x +6 with strided rows, int32 ids +4, weights +12",
         false,
         false,
         false,
         {{Which::kX, 6}, {Which::kIdx, 4}, {Which::kWeights, 12}},
         {}},
        {"fp8 x +1, x_scales +4, int32 ids +4, weights +8",
         true,
         true,
         false,
         {{Which::kX, 1}, {Which::kScales, 4}, {Which::kIdx, 4}, {Which::kWeights, 8}},
         {}},
        {"bf16 x +2 quantized in dispatch, int64 ids +8", true, false, true, {{Which::kX, 2}, {Which::kIdx, 8}}, {}},
    };
    uint64_t seed = 20;
    for (const AlignCase& c : cases) {
        Pair& p = c.fp8 ? p8 : pb;
        Scenario sc = scenario(p.cfg, 1, seed++);
        sc.prequantized = c.prequantized;
        sc.idx64 = c.idx64;
        sc.strided = std::string(c.name).find("strided") != std::string::npos;
        sc.bias = c.needles.empty();  // (bias stays 16-byte aligned: the CUDA combine needs it)
        const std::vector<RankData> data = make_inputs(sc);
        std::map<const void*, size_t> offsets;
        for (const Placement& pl : c.placements) offsets[storage_of(sc, data[0], pl.which)] = pl.offset;
        if (!c.needles.empty()) {
            std::vector<std::string> needles = c.needles;
            needles.insert(needles.end(), named.begin(), named.end());
            OffsetMemory mem(offsets);
            EXPECT_TRUE(throws_error([&] { run_rank_round(sc, 0, *p.gpu[0], data[0], mem); },
                                     ErrorCode::kInvalidArgument, needles))
                << c.name;
            expect_context_ok(c.name);
            continue;
        }
        HostMemory host;
        OffsetMemory mem(offsets);
        std::vector<RankOutcome> cpu, gpu;
        ASSERT_NO_THROW(cpu.push_back(run_rank_round(sc, 0, *p.cpu[0], data[0], host))) << c.name;
        try {
            gpu.push_back(run_rank_round(sc, 0, *p.gpu[0], data[0], mem));
        } catch (const std::exception& e) {
            ADD_FAILURE() << c.name << ": a legal, element-aligned input was refused: " << e.what();
            continue;
        }
        expect_rounds_equal({sc}, {data}, {cpu}, {gpu}, c.name);
        expect_context_ok(c.name);
    }
    // the buffers took every refused call without harm
    expect_good_round(scenario(pb.cfg, 1, 40), pb, "bf16 after misaligned inputs");
    expect_good_round(scenario(p8.cfg, 1, 41), p8, "fp8 after misaligned inputs");
}

// ---------------------------------------------------------------------------------------------
// The handle rule (item 11): every failed combine consumes its handle, whatever rejected it (the
// front end or the CUDA backend's own 16-byte checks of y, bias and out), so the buffer that made it
// may dispatch again; a misaligned y, bias or out is a named error, not a fault.

TEST(CudaBadInput, EveryRejectedCombineConsumesItsHandle) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const BufferConfig cfg = small_config();
    Pair p = pair_of(cfg, 1);
    ASSERT_TRUE(p.ok);
    Buffer& buf = *p.gpu[0];
    auto other = Buffer::create(p.gpu_groups[0], on_gpu0(cfg), BackendKind::kCUDA);
    Scenario sc = scenario(cfg, 1, 50);
    sc.has_weights = false;
    sc.weighted = false;
    const std::vector<RankData> data = make_inputs(sc);
    CudaMemory mem(0);
    const DispatchArgs args = make_args(
        sc, data[0], [&](const void* ptr, size_t n) { return mem.place(ptr, n); }, kGpu0);
    const int64_t t = cfg.max_tokens_per_rank, h = cfg.hidden;
    DevBuf ybuf(static_cast<size_t>(buf.max_contiguous_rows(1) * h * 4 + 64)),
        tbuf(static_cast<size_t>(t * h * 4 + 64));
    auto* y = static_cast<uint8_t*>(ybuf.ptr);
    auto* tk = static_cast<uint8_t*>(tbuf.ptr);
    std::vector<uint16_t> host_y(static_cast<size_t>(buf.max_contiguous_rows(1) * h));
    auto combine = [&](Buffer& b, DispatchResult& d, CombineArgs c) { b.combine(std::move(d.handle), c); };
    auto y_of = [&](DispatchResult& d, size_t off, DType dt = DType::kBFloat16) {
        return TensorRef::contiguous(y + off, dt, d.recv_x.shape, kGpu0);
    };
    struct Failure {
        const char* name;
        std::function<void(DispatchResult&)> call;
        std::vector<std::string> needles;
    };
    const std::vector<Failure> failures = {
        {"y fp32",
         [&](auto& d) { combine(buf, d, {.y = y_of(d, 0, DType::kFloat32), .weighted = false}); },
         {"combine: y is fp32", "must be bf16"}},
        {"y shape",
         [&](auto& d) {
             combine(buf, d, {.y = TensorRef::contiguous(y, DType::kBFloat16, {1, h}, kGpu0), .weighted = false});
         },
         {"must have the shape of dispatch's recv_x"}},
        {"y on the host",
         [&](auto& d) {
             combine(buf, d,
                     {.y = TensorRef::contiguous(host_y.data(), DType::kBFloat16, d.recv_x.shape), .weighted = false});
         },
         {"combine: y is on cpu"}},
        {"y not contiguous",
         [&](auto& d) {
             TensorRef v = y_of(d, 0);
             v.strides = {2 * h, 1};
             combine(buf, d, {.y = v, .weighted = false});
         },
         {"must be contiguous"}},
        {"y 1 byte off",
         [&](auto& d) { combine(buf, d, {.y = y_of(d, 1), .weighted = false}); },
         {"combine: y (", "not aligned to its 2-byte elements"}},
        {"y 2 bytes off (the CUDA backend's check)",
         [&](auto& d) { combine(buf, d, {.y = y_of(d, 2), .weighted = false}); },
         {"combine: y must be 16-byte aligned for the CUDA backend"}},
        {"weighted without topk_weights",
         [&](auto& d) { combine(buf, d, {.y = y_of(d, 0), .weighted = true}); },
         {"weighted=true but the dispatch had no topk_weights"}},
        {"bias 1 byte off",
         [&](auto& d) {
             combine(buf, d,
                     {.y = y_of(d, 0),
                      .weighted = false,
                      .bias = TensorRef::contiguous(tk + 1, DType::kBFloat16, {t, h}, kGpu0)});
         },
         {"combine: bias (", "not aligned to its 2-byte elements"}},
        {"bias 2 bytes off (the CUDA backend's check)",
         [&](auto& d) {
             combine(buf, d,
                     {.y = y_of(d, 0),
                      .weighted = false,
                      .bias = TensorRef::contiguous(tk + 2, DType::kBFloat16, {t, h}, kGpu0)});
         },
         {"combine: bias rows must be 16-byte aligned for the CUDA backend"}},
        {"bias wrong hidden",
         [&](auto& d) {
             combine(buf, d,
                     {.y = y_of(d, 0),
                      .weighted = false,
                      .bias = TensorRef::contiguous(tk, DType::kBFloat16, {t, h / 2}, kGpu0)});
         },
         {"combine: bias is", "must be [4, 128]"}},
        {"out 1 byte off",
         [&](auto& d) {
             combine(buf, d,
                     {.y = y_of(d, 0),
                      .weighted = false,
                      .out = TensorRef::contiguous(tk + 1, DType::kBFloat16, {t, h}, kGpu0)});
         },
         {"combine: out (", "not aligned to its 2-byte elements"}},
        {"out 2 bytes off (the CUDA backend's check)",
         [&](auto& d) {
             combine(buf, d,
                     {.y = y_of(d, 0),
                      .weighted = false,
                      .out = TensorRef::contiguous(tk + 2, DType::kBFloat16, {t, h}, kGpu0)});
         },
         {"combine: out rows must be 16-byte aligned for the CUDA backend"}},
        {"out fp32",
         [&](auto& d) {
             combine(buf, d,
                     {.y = y_of(d, 0),
                      .weighted = false,
                      .out = TensorRef::contiguous(tk, DType::kFloat32, {t, h}, kGpu0)});
         },
         {"combine: out is fp32", "must be bf16"}},
        {"another buffer's handle",
         [&](auto& d) { combine(*other, d, {.y = y_of(d, 0), .weighted = false}); },
         {"the handle belongs to another buffer"}},
    };
    for (const Failure& f : failures) {
        std::optional<DispatchResult> d;
        ASSERT_NO_THROW(d = buf.dispatch(args)) << "after '" << f.name << "': the previous failure kept its handle";
        EXPECT_TRUE(throws_error([&] { f.call(*d); }, ErrorCode::kInvalidArgument, f.needles)) << f.name;
        EXPECT_FALSE(d->handle.valid()) << f.name;
        // the same Handle object again: it is empty now
        EXPECT_TRUE(throws_error([&] { combine(buf, *d, {.y = y_of(*d, 0), .weighted = false}); },
                                 ErrorCode::kInvalidArgument, {"the handle is empty"}))
            << f.name;
    }
    expect_context_ok("after the rejected combines");
    // strict alternation: a second dispatch before the combine is refused, the first handle still combines
    DispatchResult d = buf.dispatch(args);
    EXPECT_TRUE(throws_error([&] { buf.dispatch(args); }, ErrorCode::kInvalidArgument, {"was never combined"}));
    EXPECT_TRUE(d.handle.valid());
    EXPECT_NO_THROW(combine(buf, d, {.y = y_of(d, 0), .weighted = false}));
    EXPECT_TRUE(throws_error([&] { buf.combine(Handle{}, {.y = y_of(d, 0)}); }, ErrorCode::kInvalidArgument,
                             {"the handle is empty"}));
    mem.synchronize();
    Scenario good = scenario(cfg, 1, 51);
    good.bias = true;
    expect_good_round(good, p, "after the rejected combines");

    // Two ranks that both reject their combine (the CUDA backend's own check): neither publishes, both
    // handles are consumed, and after a barrier (every rank's dispatch has finished reading its
    // window) the buffers run a correct round.
    Pair p2 = pair_of(cfg, 2);
    ASSERT_TRUE(p2.ok);
    const Scenario sc2 = scenario(cfg, 2, 52);
    const std::vector<RankData> data2 = make_inputs(sc2);
    ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) {
        const size_t ri = static_cast<size_t>(r);
        cuda_ok(cudaSetDevice(0), "cudaSetDevice");
        CudaMemory m(0);
        const DispatchArgs a = make_args(
            sc2, data2[ri], [&](const void* ptr, size_t n) { return m.place(ptr, n); }, kGpu0);
        DevBuf yb(static_cast<size_t>(p2.gpu[ri]->max_contiguous_rows(1) * h * 2 + 64));
        Group& g = *p2.gpu_groups[ri];
        g.barrier();
        DispatchResult res = p2.gpu[ri]->dispatch(a);
        g.barrier();
        CombineArgs c;
        c.y = TensorRef::contiguous(static_cast<uint8_t*>(yb.ptr) + 2, DType::kBFloat16, res.recv_x.shape, kGpu0);
        EXPECT_TRUE(throws_error([&] { p2.gpu[ri]->combine(std::move(res.handle), c); }, ErrorCode::kInvalidArgument,
                                 {"16-byte aligned"}))
            << "rank " << r;
        EXPECT_FALSE(res.handle.valid()) << "rank " << r;
        g.barrier();
    })));
    expect_good_round(scenario(cfg, 2, 53), p2, "two ranks after a combine every rank rejected");
}

// ---------------------------------------------------------------------------------------------
// Expert ids outside [-1, E) or repeated. Host sync: every rank fails with the same InvalidArgument as
// the CPU backend, naming the first bad route (rank, token, k, value), and the buffer stays usable.
// Graph mode: the bad routes are dropped exactly as the CPU backend drops them, and check() reports
// the same sticky fault on the same ranks (the oracle's first invalid route of each rank).

struct IdCase {
    bool idx64;
    int rank;                  // the rank whose input holds the bad route
    int64_t token;             // its token
    std::vector<int64_t> row;  // that token's whole top-k row (K = 4)
    int bad_k;                 // the first bad column in it
    std::string what;          // what the message says about it
};

TEST(CudaBadInput, InvalidExpertIdsHostSyncAndGraphMode) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    BufferConfig cfg{.num_experts = 8, .num_topk = 4, .hidden = 128, .max_tokens_per_rank = 8};
    cfg.timeout = 20000ms;
    Pair p = pair_of(cfg, 2);
    ASSERT_TRUE(p.ok);
    const int64_t i32max = std::numeric_limits<int32_t>::max(), i32min = std::numeric_limits<int32_t>::min();
    const std::vector<IdCase> cases = {
        {false, 1, 2, {0, 8, 1, -1}, 1, "value 8 is outside [-1, 8)"},
        {false, 0, 3, {2, 3, -2, 4}, 2, "value -2 is outside [-1, 8)"},
        {false, 1, 0, {5, 6, 7, i32max}, 3, "value 2147483647 is outside [-1, 8)"},
        {false, 0, 7, {i32min, 1, 2, 3}, 0, "value -2147483648 is outside [-1, 8)"},
        {false, 1, 4, {3, 5, 3, -1}, 2, "expert id 3 repeats k=0"},
        {true, 0, 1, {0, int64_t{1} << 40, 2, 3}, 1, "value 1099511627776 is outside [-1, 8)"},
        {true, 1, 6, {1, 2, 4, -(int64_t{1} << 40)}, 3, "value -1099511627776 is outside [-1, 8)"},
        {true, 0, 5, {-1, -1, 6, 6}, 3, "expert id 6 repeats k=2"},
    };
    uint64_t seed = 60;
    for (const IdCase& c : cases) {
        Scenario sc = scenario(cfg, 2, seed++);
        sc.idx64 = c.idx64;
        std::vector<RankData> data = make_inputs(sc);
        for (int k = 0; k < cfg.num_topk; ++k)
            set_route(sc, data[static_cast<size_t>(c.rank)], c.token, k, c.row[static_cast<size_t>(k)]);
        std::vector<std::optional<Raised>> cpu_err(2), gpu_err(2);
        ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) {
            const size_t ri = static_cast<size_t>(r);
            cuda_ok(cudaSetDevice(0), "cudaSetDevice");
            CudaMemory m(0);
            const DispatchArgs ga = make_args(
                sc, data[ri], [&](const void* ptr, size_t n) { return m.place(ptr, n); }, kGpu0);
            const DispatchArgs ca = make_args(sc, data[ri]);
            p.gpu_groups[ri]->barrier();
            cpu_err[ri] = raised_by([&] { p.cpu[ri]->dispatch(ca); });
            gpu_err[ri] = raised_by([&] { p.gpu[ri]->dispatch(ga); });
            p.gpu_groups[ri]->barrier();
        })));
        const std::string where =
            "rank " + std::to_string(c.rank) + ", token " + std::to_string(c.token) + ", k=" + std::to_string(c.bad_k);
        for (int r = 0; r < 2; ++r) {
            const size_t ri = static_cast<size_t>(r);
            ASSERT_TRUE(gpu_err[ri].has_value()) << where << ": rank " << r << "'s CUDA dispatch returned";
            ASSERT_TRUE(cpu_err[ri].has_value()) << where << ": rank " << r << "'s CPU dispatch returned";
            EXPECT_EQ(gpu_err[ri]->code, ErrorCode::kInvalidArgument) << gpu_err[ri]->message;
            EXPECT_EQ(gpu_err[ri]->message, cpu_err[ri]->message) << where << ", rank " << r;
            EXPECT_NE(gpu_err[ri]->message.find(where), std::string::npos) << gpu_err[ri]->message;
            EXPECT_NE(gpu_err[ri]->message.find(c.what), std::string::npos) << gpu_err[ri]->message;
        }
    }
    expect_context_ok("after the rejected host-sync dispatches");
    expect_good_round(scenario(cfg, 2, 70), p, "after the rejected host-sync dispatches");

    // graph mode, both layouts: random invalid ids on every rank, plus a known first one on rank 1
    for (int round = 0; round < 2; ++round) {
        Scenario sc = scenario(cfg, 2, 71 + static_cast<uint64_t>(round));
        sc.routing = Routing::kInvalid;
        sc.opt.host_sync = false;
        sc.idx64 = round == 0;
        if (round == 0) sc.opt.expert_alignment = 4;
        if (round == 1) sc.opt.layout = Layout::kExpertMasked;
        std::vector<RankData> data = make_inputs(sc);
        const std::vector<int64_t> row = {1, round == 0 ? int64_t{1} << 40 : 99, 5, 5};
        for (int k = 0; k < cfg.num_topk; ++k) set_route(sc, data[1], 0, k, row[static_cast<size_t>(k)]);
        const std::string tag = std::string("graph mode ") + layout_name(sc.opt.layout);
        const BothOutcomes o = run_both(sc, p, data, tag);
        if (!o.ok) return;
        expect_rounds_equal({sc}, {data}, {o.cpu}, {o.gpu}, tag);
        for (int r = 0; r < 2; ++r) {
            const size_t ri = static_cast<size_t>(r);
            const std::optional<Raised> gpu = raised_by([&] { p.gpu[ri]->check(); });
            const std::optional<Raised> cpu = raised_by([&] { p.cpu[ri]->check(); });
            const ref::InvalidRoute first = ref::first_invalid_route(cfg, data[ri].in);
            if (first.token < 0) {
                EXPECT_FALSE(gpu.has_value()) << tag << " rank " << r << ": " << gpu->message;
                EXPECT_FALSE(cpu.has_value()) << tag << " rank " << r;
                continue;
            }
            ASSERT_TRUE(gpu.has_value()) << tag << " rank " << r << ": no sticky fault";
            ASSERT_TRUE(cpu.has_value()) << tag << " rank " << r;
            EXPECT_EQ(gpu->code, ErrorCode::kInvalidArgument);
            EXPECT_EQ(gpu->message, cpu->message) << tag << " rank " << r;
            const std::string at = "rank " + std::to_string(r) + ", token " + std::to_string(first.token) +
                                   ", k=" + std::to_string(first.k);
            EXPECT_NE(gpu->message.find(at), std::string::npos) << gpu->message;
            EXPECT_NE(gpu->message.find("sticky fault"), std::string::npos) << gpu->message;
            if (r == 1) EXPECT_NE(gpu->message.find("rank 1, token 0, k=1"), std::string::npos) << gpu->message;
            EXPECT_FALSE(raised_by([&] { p.gpu[ri]->check(); }).has_value()) << "check() clears what it reported";
        }
    }
    expect_good_round(scenario(cfg, 2, 73), p, "after graph-mode invalid ids");
}

// ---------------------------------------------------------------------------------------------
// Item 8: a Buffer takes one call at a time. Two threads dispatch on rank 0's buffer while rank 1 is
// late: one gets in and waits for rank 1, the other (and a check() from a third) is refused at once
// naming the call in progress; rank 1 then completes the round of the one inside, which is right.

TEST(CudaBadInput, SecondThreadOnOneBufferIsToldWhichCallHoldsIt) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const BufferConfig cfg = small_config();
    Pair p = pair_of(cfg, 2);
    ASSERT_TRUE(p.ok);
    const Scenario sc = scenario(cfg, 2, 80);
    const std::vector<RankData> data = make_inputs(sc);
    std::vector<RankOutcome> cpu(2);
    ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) {
        HostMemory host;
        cpu[static_cast<size_t>(r)] =
            run_rank_round(sc, r, *p.cpu[static_cast<size_t>(r)], data[static_cast<size_t>(r)], host);
    })));
    cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    CudaMemory m0(0), m1(0);
    const DispatchArgs a0 = make_args(
        sc, data[0], [&](const void* ptr, size_t n) { return m0.place(ptr, n); }, kGpu0);
    const DispatchArgs a1 = make_args(
        sc, data[1], [&](const void* ptr, size_t n) { return m1.place(ptr, n); }, kGpu0);
    std::vector<std::exception_ptr> errs(2);
    std::vector<std::optional<DispatchResult>> res(2);
    std::atomic<int> refused{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < 2; ++i)
        threads.emplace_back([&, i] {
            cudaSetDevice(0);
            try {
                res[static_cast<size_t>(i)] = p.gpu[0]->dispatch(a0);
            } catch (...) {
                errs[static_cast<size_t>(i)] = std::current_exception();
                ++refused;
            }
        });
    const auto t0 = std::chrono::steady_clock::now();
    while (refused.load() == 0 && seconds_since(t0) < 5.0) std::this_thread::sleep_for(1ms);
    const std::optional<Raised> check_err = raised_by([&] { p.gpu[0]->check(); });
    std::optional<DispatchResult> d1;
    EXPECT_NO_THROW(d1 = p.gpu[1]->dispatch(a1));
    for (auto& th : threads) th.join();
    ASSERT_EQ(refused.load(), 1) << describe(errs[0]) << " / " << describe(errs[1]);
    ASSERT_TRUE(d1.has_value());
    const size_t inside = errs[0] ? 1 : 0;
    EXPECT_TRUE(is_error(errs[1 - inside], ErrorCode::kInvalidArgument,
                         {"Buffer::dispatch called from thread", "is inside Buffer::dispatch on this buffer (rank 0)",
                          "one call at a time"}));
    ASSERT_TRUE(check_err.has_value()) << "check() entered while a dispatch held the buffer";
    EXPECT_EQ(check_err->code, ErrorCode::kInvalidArgument);
    EXPECT_NE(check_err->message.find("Buffer::check called from thread"), std::string::npos) << check_err->message;
    EXPECT_NE(check_err->message.find("inside Buffer::dispatch"), std::string::npos) << check_err->message;
    ASSERT_TRUE(res[inside].has_value());
    // the round of the call that got in: right, and equal to the CPU backend's
    const ExpectedRound want = expected_round(sc, data);
    std::vector<DispatchResult*> got = {&*res[inside], &*d1};
    std::vector<Observed> seen;
    for (int r = 0; r < 2; ++r) {
        const size_t ri = static_cast<size_t>(r);
        seen.push_back(observe_device(*got[ri], cfg));
        expect_dispatch_equal(want.dispatch[ri], seen[ri], cfg, false, "rank " + std::to_string(r));
        for (const std::string& m : backend_mismatches(cpu[ri].got, seen[ri], want.dispatch[ri], cfg, false))
            ADD_FAILURE() << "rank " << r << " cuda vs cpu: " << m;
    }
    std::vector<std::vector<uint16_t>> y = {make_y(sc, 0, seen[0].rows), make_y(sc, 1, seen[1].rows)};
    std::vector<void*> dy = {m0.place(y[0].data(), y[0].size() * 2), m1.place(y[1].data(), y[1].size() * 2)};
    std::vector<TensorRef> out(2);
    ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) {
        const size_t ri = static_cast<size_t>(r);
        cuda_ok(cudaSetDevice(0), "cudaSetDevice");
        CombineArgs c;
        c.y = TensorRef::contiguous(dy[ri], DType::kBFloat16, got[ri]->recv_x.shape, kGpu0);
        c.weighted = sc.weighted;
        out[ri] = p.gpu[ri]->combine(std::move(got[ri]->handle), c).out;
    })));
    for (int r = 0; r < 2; ++r) {
        const size_t ri = static_cast<size_t>(r);
        const auto o = download<uint16_t>(out[ri].data, static_cast<size_t>(data[ri].in.num_tokens * cfg.hidden));
        EXPECT_EQ(combine_mismatch(o, want.combine[ri], cfg.hidden), "") << "rank " << r;
        EXPECT_EQ(combine_mismatch(o, cpu[ri].out, cfg.hidden), "") << "rank " << r << " cuda vs cpu";
    }
    expect_good_round(scenario(cfg, 2, 81), p, "after the refused calls");
}

// ---------------------------------------------------------------------------------------------
// Timeouts: a rank that skips a dispatch, or a combine. Its peer gets Timeout naming the phase and
// rank 1, the buffer then refuses every call at once, and buffers rebuilt on the same groups work.

TEST(CudaBadInput, SkippedCallTimesOutNamingTheRankAndANewBufferWorks) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    BufferConfig cfg = small_config();
    cfg.timeout = 1500ms;  // far above a round's time, also under compute-sanitizer
    Pair p = pair_of(cfg, 2);
    ASSERT_TRUE(p.ok);
    const Scenario sc = scenario(cfg, 2, 90);
    const std::vector<RankData> data = make_inputs(sc);
    for (const bool skip_combine : {false, true}) {
        if (skip_combine) ASSERT_TRUE(build(p, cfg));
        const char* phase = skip_combine ? "combine" : "dispatch";
        ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) {
            const size_t ri = static_cast<size_t>(r);
            cuda_ok(cudaSetDevice(0), "cudaSetDevice");
            CudaMemory m(0);
            const DispatchArgs a = make_args(
                sc, data[ri], [&](const void* ptr, size_t n) { return m.place(ptr, n); }, kGpu0);
            DevBuf yb(static_cast<size_t>(p.gpu[ri]->max_contiguous_rows(1) * cfg.hidden * 2));
            Buffer& buf = *p.gpu[ri];
            Group& g = *p.gpu_groups[ri];
            g.barrier();
            std::optional<DispatchResult> d;
            if (skip_combine) d = buf.dispatch(a);  // both ranks
            if (r == 0) {
                const std::string expect =
                    std::string(phase) + ": rank 0 waited 1500 ms for rank(s) 1 (expected call #1, last seen #0)";
                if (skip_combine) {
                    CombineArgs c;
                    c.y = TensorRef::contiguous(yb.ptr, DType::kBFloat16, d->recv_x.shape, kGpu0);
                    EXPECT_TRUE(throws_error([&] { buf.combine(std::move(d->handle), c); }, ErrorCode::kTimeout,
                                             {expect, "rebuild it"}));
                } else {
                    EXPECT_TRUE(throws_error([&] { buf.dispatch(a); }, ErrorCode::kTimeout, {expect, "rebuild it"}));
                }
                // unusable now: every call fails at once, without waiting again
                const auto t0 = std::chrono::steady_clock::now();
                EXPECT_TRUE(throws_error([&] { buf.dispatch(a); }, ErrorCode::kTimeout,
                                         {"unusable after an earlier failure", "build a new one"}));
                EXPECT_TRUE(throws_error([&] { buf.check(); }, ErrorCode::kTimeout, {"unusable"}));
                EXPECT_LT(seconds_since(t0), 0.25) << "the broken buffer waited instead of failing at once";
            } else if (skip_combine) {
                // rank 1 never combined: its next dispatch is refused (strict alternation), without waiting
                EXPECT_TRUE(throws_error([&] { buf.dispatch(a); }, ErrorCode::kInvalidArgument, {"never combined"}));
            }
            g.barrier();
        })));
        expect_context_ok(std::string("after rank 1 skipped ") + phase);
    }
    BufferConfig fine = cfg;
    fine.timeout = 20000ms;
    ASSERT_TRUE(build(p, fine));
    expect_good_round(scenario(fine, 2, 91), p, "new buffers after the timeouts");
}

// ---------------------------------------------------------------------------------------------
// Items 9 and 13: a rank whose config is rejected, and a reservation the GPU cannot hold, fail every
// rank at once with the reason; the group stays in step and builds a working CUDA buffer next.

TEST(CudaBadInput, CreateFailuresAreHeardOnEveryRank) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    Pair p;
    p.ranks = 2;
    p.gpu_groups = ThreadGroup::create(2, 30s);
    p.cpu_groups = ThreadGroup::create(2, 30s);
    const auto t0 = std::chrono::steady_clock::now();
    auto errors = run_ranks(2, [&](int r) {
        cuda_ok(cudaSetDevice(0), "cudaSetDevice");
        BufferConfig c = on_gpu0(small_config());
        if (r == 1) c.hidden = 100;
        Buffer::create(p.gpu_groups[static_cast<size_t>(r)], c, BackendKind::kCUDA);
    });
    EXPECT_LT(seconds_since(t0), 2.0) << "the ranks waited for the group's timeout";
    EXPECT_TRUE(is_error(errors[1], ErrorCode::kInvalidArgument, {"hidden=100", "multiple of 8"}));
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kInvalidArgument, {"rank 1 rejected its config", "hidden=100"}));
    // hidden above its limit
    BufferConfig over = on_gpu0(small_config());
    over.hidden = kMaxHidden + 8;
    auto one = ThreadGroup::create(1);
    EXPECT_TRUE(throws_error([&] { Buffer::create(one[0], over, BackendKind::kCUDA); }, ErrorCode::kInvalidArgument,
                             {"hidden=65544", "limit of 65536"}));
    // a valid config whose combine output alone (C * H * 2 bytes = 256 GiB) no GPU holds
    BufferConfig huge{.num_experts = 2, .num_topk = 1, .hidden = kMaxHidden, .max_tokens_per_rank = 1 << 21};
    huge = on_gpu0(huge);
    ASSERT_NO_THROW(huge.validate(2));
    errors = run_ranks(2, [&](int r) {
        cuda_ok(cudaSetDevice(0), "cudaSetDevice");
        Buffer::create(p.gpu_groups[static_cast<size_t>(r)], huge, BackendKind::kCUDA);
    });
    for (int r = 0; r < 2; ++r) {
        const std::exception_ptr& e = errors[static_cast<size_t>(r)];
        const bool named = is_error(e, ErrorCode::kCapacityExceeded) || is_error(e, ErrorCode::kCuda);
        EXPECT_TRUE(named) << "rank " << r << ": " << describe(e);
        EXPECT_NE(describe(e).find("failed on this rank"), std::string::npos) << describe(e);
        EXPECT_NE(describe(e).find("memory"), std::string::npos) << describe(e);
    }
    expect_context_ok("after a reservation the GPU cannot hold");
    ASSERT_TRUE(build(p, small_config()));
    expect_good_round(scenario(small_config(), 2, 100), p, "a buffer on the same groups after failed creates");
}

// ---------------------------------------------------------------------------------------------
// Items 2 and 7 at their limits on the CUDA backend: the largest hidden (every message size and
// offset still fits its field) and the longest timeout (7 days: the deadline must not wrap and expire
// at once) run correct rounds, both layouts.

TEST(CudaBadInput, LargestHiddenAndLongestTimeoutWork) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    BufferConfig cfg{.num_experts = 2, .num_topk = 2, .hidden = kMaxHidden, .max_tokens_per_rank = 2};
    cfg.timeout = kMaxTimeout;
    Pair p = pair_of(cfg, 2);
    ASSERT_TRUE(p.ok);
    expect_good_round(scenario(cfg, 2, 110), p, "H=65536, 7-day timeout, contiguous");
    Scenario masked = scenario(cfg, 2, 111);
    masked.opt.layout = Layout::kExpertMasked;
    masked.bias = true;
    expect_good_round(masked, p, "H=65536, 7-day timeout, masked");
}

// The same shapes with the hidden size and the timeout apart: hidden from 4096 up to the limit with
// the default timeout, and the longest timeout at a small hidden (a failure above names which one).
TEST(CudaBadInput, HiddenSizesUpToTheLimitAndTheLongestTimeoutApart) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    for (const int h : {4096, 8192, 16384, 32768, kMaxHidden}) {
        BufferConfig cfg{.num_experts = 2, .num_topk = 2, .hidden = h, .max_tokens_per_rank = 2};
        Pair p = pair_of(cfg, 2);
        ASSERT_TRUE(p.ok);
        const std::string tag = "H=" + std::to_string(h);
        expect_good_round(scenario(cfg, 2, 110), p, tag + ", contiguous");
        expect_good_round(scenario(cfg, 2, 112), p, tag + ", contiguous, second call");
        Scenario masked = scenario(cfg, 2, 111);
        masked.opt.layout = Layout::kExpertMasked;
        expect_good_round(masked, p, tag + ", masked");
    }
    BufferConfig cfg{.num_experts = 2, .num_topk = 2, .hidden = 4096, .max_tokens_per_rank = 2};
    cfg.timeout = kMaxTimeout;
    Pair p = pair_of(cfg, 2);
    ASSERT_TRUE(p.ok);
    expect_good_round(scenario(cfg, 2, 110), p, "H=4096, 7-day timeout, contiguous");
    expect_good_round(scenario(cfg, 2, 112), p, "H=4096, 7-day timeout, contiguous, second call");
}

// ---------------------------------------------------------------------------------------------
// Item 5 on the CUDA backend: buffer-owned outputs are never freed or moved while the buffer lives.
// Calls of one layout and alignment reuse the same storage; a call that needs more gets new storage
// and the old views stay readable memory (compute-sanitizer checks these copies too); the combine
// output never moves; and the results stay right after every switch.

TEST(CudaBadInput, ViewsOfBufferOwnedOutputsStayValid) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    BufferConfig cfg{.num_experts = 4, .num_topk = 2, .hidden = 4096, .max_tokens_per_rank = 64};
    cfg.timeout = 20000ms;
    {
        // the last round below on a buffer that ran nothing before it
        Pair fresh = pair_of(cfg, 1);
        ASSERT_TRUE(fresh.ok);
        Scenario masked = scenario(cfg, 1, 122);
        masked.opt.layout = Layout::kExpertMasked;
        expect_good_round(masked, fresh, "masked on a fresh buffer");
        expect_good_round(masked, fresh, "masked on a fresh buffer, second call");
    }
    Pair p = pair_of(cfg, 1);
    ASSERT_TRUE(p.ok);
    Buffer& buf = *p.gpu[0];
    const Scenario sc = scenario(cfg, 1, 120);
    const std::vector<RankData> data = make_inputs(sc);
    CudaMemory mem(0);
    const DispatchArgs base = make_args(
        sc, data[0], [&](const void* ptr, size_t n) { return mem.place(ptr, n); }, kGpu0);
    auto round = [&](Layout layout, int alignment) {
        DispatchArgs a = base;
        a.layout = layout;
        a.expert_alignment = alignment;
        DispatchResult d = buf.dispatch(a);
        const TensorRef x = d.recv_x;
        CombineArgs c;
        c.y = d.recv_x;
        return std::make_pair(x, buf.combine(std::move(d.handle), c).out);
    };
    auto readable = [](const TensorRef& t) {
        std::vector<uint8_t> h(t.nbytes());
        return cudaMemcpy(h.data(), t.data, h.size(), cudaMemcpyDeviceToHost) == cudaSuccess;
    };
    const auto [c1_x, c1_out] = round(Layout::kExpertContiguous, 1);
    const auto [c1b_x, c1b_out] = round(Layout::kExpertContiguous, 1);
    EXPECT_EQ(c1b_x.data, c1_x.data) << "the same layout and alignment reuse their storage";
    const auto [m_x, m_out] = round(Layout::kExpertMasked, 1);
    const auto [mb_x, mb_out] = round(Layout::kExpertMasked, 1);
    EXPECT_EQ(mb_x.data, m_x.data);
    const auto [a_x, a_out] = round(Layout::kExpertContiguous, 64);  // more rows than any call before
    const auto [ab_x, ab_out] = round(Layout::kExpertContiguous, 64);
    EXPECT_EQ(ab_x.data, a_x.data);
    EXPECT_NE(a_x.data, c1_x.data) << "a call that needs more rows gets new storage";
    for (const TensorRef* v : {&c1_x, &m_x, &a_x}) EXPECT_TRUE(readable(*v)) << "an old view is not readable memory";
    for (const TensorRef* o : {&c1b_out, &m_out, &mb_out, &a_out, &ab_out})
        EXPECT_EQ(o->data, c1_out.data) << "the combine output is sized for its worst case once";
    mem.synchronize();
    Scenario aligned = sc;
    aligned.opt.expert_alignment = 64;
    aligned.seed = 121;
    expect_good_round(aligned, p, "contiguous A=64 after layout switches");
    Scenario masked = sc;
    masked.opt.layout = Layout::kExpertMasked;
    masked.seed = 122;
    expect_good_round(masked, p, "masked after layout switches");
}

// ---------------------------------------------------------------------------------------------
// Item 6 through the whole CUDA path, ranks as threads (as processes: tests/mpi/test_mpi_cuda_forged.cpp):
// rank 1 forges what it announces to rank 0 (tests/common/peer_forgeries.hpp). Rank 0 raises Internal
// naming rank 1 (from dispatch, or from the check() right after it), writes nothing outside its
// guarded caller outputs (and nothing at all for a dispatch that failed), keeps exactly its own rows
// when rank 1 was dropped as a whole (graph mode), and rank 1 sees nothing wrong. Then new buffers on
// the same groups run a correct round.

TEST(CudaBadInput, ForgedPeerDataIsAStickyFaultNamingTheSender) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    // the forger plays a sender of the staged protocol (ranks sharing a GPU in one process take the
    // direct path by default, which has no published messages to forge)
    const ScopedEnv staged("ELASTICEP_KERNEL_VARIANT", "staged");
    const BufferConfig cfg = forge_config();
    const std::vector<RankData> data = forge_inputs();
    Pair p;
    p.ranks = 2;
    p.gpu_groups = ThreadGroup::create(2, kGroupTimeout);
    p.cpu_groups = ThreadGroup::create(2, kGroupTimeout);
    for (const bool host_sync : {true, false})
        for (const PeerForgery& f : peer_forgeries()) {
            const std::string tag = f.what + (host_sync ? " (host sync)" : " (graph mode)");
            const Scenario sc = forge_scenario(host_sync);
            std::vector<std::optional<Raised>> err(2);
            bool from_dispatch = false, guards = false, untouched = false;
            std::optional<Observed> got;
            ASSERT_TRUE(all_ok(
                run_ranks(2,
                          [&](int r) {
                              const size_t ri = static_cast<size_t>(r);
                              cuda_ok(cudaSetDevice(0), "cudaSetDevice");
                              Group& g = *p.gpu_groups[ri];
                              auto buf = Buffer::create(p.gpu_groups[ri], on_gpu0(cfg), BackendKind::kCUDA);
                              if (r == 1)
                                  forge::set_dispatch_forger(*buf, [&](forge::OutgoingDispatch& o) {
                                      if (o.receiver == 0) f.forge(o);
                                  });
                              CudaMemory m(0);
                              DispatchArgs a = make_args(
                                  sc, data[ri], [&](const void* ptr, size_t n) { return m.place(ptr, n); }, kGpu0);
                              std::unique_ptr<GuardedDispatchOutputs> outs;
                              if (r == 0) {
                                  outs = guarded_dispatch_outputs(sc, 0);
                                  a.outputs = outs->refs;
                              }
                              g.barrier();
                              std::optional<DispatchResult> res;
                              err[ri] = raised_by([&] { res = buf->dispatch(a); });
                              if (r == 0) from_dispatch = err[0].has_value();
                              if (res) err[ri] = raised_by([&] { buf->check(); });
                              g.barrier();
                              if (r == 0) {
                                  guards = outs->guards_intact();
                                  untouched = outs->bodies_untouched();
                                  if (res) got = observe_device(*res, cfg);
                              }
                              g.barrier();  // both done before either buffer goes
                          }),
                tag));
            expect_context_ok(tag);
            // the forger may trip its own rank's check too: the staged protocol hands a sender's announced
            // count back to it as its combine slot range (kPeerSlot), which a forged count overflows
            EXPECT_TRUE(!err[1].has_value() || err[1]->message.find("a combine slot range") != std::string::npos)
                << tag << ": rank 1 got " << err[1]->message;
            ASSERT_TRUE(err[0].has_value()) << tag << ": rank 0 raised nothing";
            EXPECT_EQ(err[0]->code, ErrorCode::kInternal) << tag << ": " << err[0]->message;
            EXPECT_NE(err[0]->message.find("dispatch: rank 0 received corrupt data from rank 1: " + f.needle),
                      std::string::npos)
                << tag << ": " << err[0]->message;
            EXPECT_NE(err[0]->message.find("rebuild it"), std::string::npos) << err[0]->message;
            EXPECT_TRUE(guards) << tag << ": rank 0 wrote outside its outputs";
            if (from_dispatch) EXPECT_TRUE(untouched) << tag << ": rank 0 wrote outputs for a dispatch that failed";
            if (!host_sync && f.drops_sender) {
                ASSERT_TRUE(got.has_value()) << tag;
                ref::DispatchOptions opt;
                opt.host_sync = false;
                const auto want = ref::dispatch(cfg, 2, forge_inputs_without_rank1(data), opt);
                expect_dispatch_equal(want[0], *got, cfg, false, tag + ": rank 0 without rank 1's data");
            }
        }
    ASSERT_TRUE(build(p, cfg));
    expect_good_round(forge_scenario(true), p, "new buffers after forged peer data");
}

}  // namespace
}  // namespace eptest
