// The CUDA backend's hybrid topology on one GPU with ranks as threads: the emulated scale-out (the only
// one that runs several "nodes" inside one process on one GPU), compared byte for byte with the CPU
// backend's hybrid on the same inputs and with the oracle: 2 nodes x 4 ranks and 4 nodes x 2 ranks
// (network delayed and reordered), both layouts, bf16 and fp8; CUDA-graph capture and replay of hybrid
// decode; a missing node is a timeout naming it; NCCL-based scale-outs refuse ranks that share a GPU
// inside one process (NCCL cannot hold them in one communicator). NCCL point-to-point and GIN across
// processes: tests/mpi/test_mpi_hybrid.cpp.
#include <cstdlib>

#include "gpu_harness.hpp"

namespace eptest {
namespace {

Scenario hybrid(int nodes, int per_node, int e_local, int k, int h, int c) {
    Scenario s;
    s.num_ranks = nodes * per_node;
    s.cfg.num_experts = s.num_ranks * e_local;
    s.cfg.num_topk = k;
    s.cfg.hidden = h;
    s.cfg.max_tokens_per_rank = c;
    s.cfg.topology = Topology::kHybrid;
    s.cfg.ranks_per_node = per_node;
    s.cfg.scaleout = ScaleOut::kEmulated;
    s.cfg.timeout = std::chrono::seconds(20);
    s.p_none = 1.0 / 8;
    s.p_token_none = 1.0 / 16;
    s.p_nan = 1.0 / 64;
    for (int r = 0; r < s.num_ranks; ++r) s.tokens.push_back((r * 5 + 3) % (c + 1));
    return s;
}

// Rounds on one buffer: contiguous host sync, masked graph mode, contiguous graph mode with bias.
std::vector<Scenario> rounds_of(const Scenario& base, uint64_t seed) {
    std::vector<Scenario> v;
    Scenario a = base;
    a.opt.expert_alignment = 4;
    a.seed = seed;
    v.push_back(a);
    Scenario m = base;
    m.opt.layout = Layout::kExpertMasked;
    m.opt.host_sync = false;
    m.opt.zero_padding = true;
    m.seed = seed + 1;
    for (auto& t : m.tokens) t = base.cfg.max_tokens_per_rank - t;
    v.push_back(m);
    Scenario g = base;
    g.opt.host_sync = false;
    g.bias = true;
    g.idx64 = true;
    g.seed = seed + 2;
    v.push_back(g);
    return v;
}

TEST(HybridGpu, EmulatedTwoNodesOfFourRanksEqualsCpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const Scenario bf16 = hybrid(2, 4, 2, 4, 256, 8);
    run_gpu_rounds(rounds_of(bf16, 10), 1, "hybrid 2x4 bf16");
    Scenario fp8 = hybrid(2, 4, 2, 4, 512, 8);
    fp8.cfg.payload = Payload::kFP8;
    fp8.cfg.scale_format = ScaleFormat::kUE8M0G128;
    run_gpu_rounds(rounds_of(fp8, 20), 1, "hybrid 2x4 fp8 quantized");
}

TEST(HybridGpu, EmulatedFourNodesOfTwoDelayedAndReordered) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    ::setenv("ELASTICEP_EMULATED_DELAY_US", "200", 1);
    ::setenv("ELASTICEP_EMULATED_REORDER", "1", 1);
    Scenario s = hybrid(4, 2, 1, 3, 256, 6);
    s.cfg.payload = Payload::kFP8;
    s.cfg.scale_format = ScaleFormat::kF32G128;
    s.prequantized = true;
    run_gpu_rounds(rounds_of(s, 30), 1, "hybrid 4x2 fp8 pre-quantized, delayed and reordered network");
    ::unsetenv("ELASTICEP_EMULATED_DELAY_US");
    ::unsetenv("ELASTICEP_EMULATED_REORDER");
}

// ---- CUDA graph: dispatch (masked, graph mode) -> identity expert op -> combine, captured once,
// replayed with new inputs; each replay against the CPU hybrid backend.

RankData inputs(const BufferConfig& c, int64_t t, uint64_t seed) {
    Scenario s;
    s.cfg = c;
    s.num_ranks = 1;
    s.tokens = {t};
    s.p_none = 1.0 / 8;
    s.idx64 = true;
    s.seed = seed;
    return make_inputs(s)[0];
}

std::vector<uint16_t> cpu_decode(Buffer& cpu, const RankData& in) {
    const BufferConfig& c = cpu.config();
    const int64_t t = in.in.num_tokens;
    DispatchArgs a;
    a.x = TensorRef::contiguous(const_cast<uint16_t*>(in.x.data()), DType::kBFloat16, {t, c.hidden});
    a.topk_idx = TensorRef::contiguous(const_cast<int64_t*>(in.idx64.data()), DType::kInt64, {t, c.num_topk});
    a.topk_weights = TensorRef::contiguous(const_cast<float*>(in.w.data()), DType::kFloat32, {t, c.num_topk});
    a.layout = Layout::kExpertMasked;
    a.host_sync = false;
    DispatchResult r = cpu.dispatch(a);
    std::vector<uint16_t> y(static_cast<const uint16_t*>(r.recv_x.data),
                            static_cast<const uint16_t*>(r.recv_x.data) + r.recv_x.numel());
    CombineArgs ca;
    ca.y = TensorRef::contiguous(y.data(), DType::kBFloat16, r.recv_x.shape);
    ca.weighted = true;
    CombineResult o = cpu.combine(std::move(r.handle), ca);
    const auto* p = o.out.data_as<uint16_t>();
    return std::vector<uint16_t>(p, p + t * c.hidden);
}

TEST(HybridGpu, EmulatedDecodeGraphCaptureReplay) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const Scenario sc = hybrid(2, 2, 2, 4, 256, 8);
    const BufferConfig cfg = sc.cfg;
    const int ranks = sc.num_ranks;
    auto cpu_groups = ThreadGroup::create(ranks);
    auto gpu_groups = ThreadGroup::create(ranks);
    all_ok(run_ranks(ranks, [&](int r) {
        BufferConfig gc = cfg;
        gc.device = 0;
        cudaSetDevice(0);
        const Device dev{DeviceType::kCUDA, 0};
        auto cpu = Buffer::create(cpu_groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        auto gpu = Buffer::create(gpu_groups[static_cast<size_t>(r)], gc, BackendKind::kCUDA);
        EXPECT_EQ(gpu->scaleout(), "emulated");
        cudaStream_t s;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        const int64_t t = cfg.max_tokens_per_rank - (r % 2);
        const RankData in = inputs(cfg, t, 600 + static_cast<uint64_t>(r));
        DevBuf dx = DevBuf::upload(in.x), didx = DevBuf::upload(in.idx64), dw = DevBuf::upload(in.w);
        DevBuf dout(static_cast<size_t>(t * cfg.hidden) * 2);
        const int64_t rows = int64_t{gpu->num_local_experts()} * ranks * cfg.max_tokens_per_rank;
        DevBuf dy(static_cast<size_t>(rows * cfg.hidden) * 2);
        DispatchArgs a;
        a.x = TensorRef::contiguous(dx.ptr, DType::kBFloat16, {t, cfg.hidden}, dev);
        a.topk_idx = TensorRef::contiguous(didx.ptr, DType::kInt64, {t, cfg.num_topk}, dev);
        a.topk_weights = TensorRef::contiguous(dw.ptr, DType::kFloat32, {t, cfg.num_topk}, dev);
        a.layout = Layout::kExpertMasked;
        a.host_sync = false;
        a.stream = s;
        CombineArgs ca;
        ca.y = TensorRef::contiguous(dy.ptr, DType::kBFloat16, {}, dev);
        ca.out = TensorRef::contiguous(dout.ptr, DType::kBFloat16, {t, cfg.hidden}, dev);
        ca.weighted = true;
        ca.stream = s;
        auto step = [&]() {
            DispatchResult res = gpu->dispatch(a);
            ASSERT_EQ(cudaMemcpyAsync(dy.ptr, res.recv_x.data, static_cast<size_t>(res.recv_x.numel()) * 2,
                                      cudaMemcpyDeviceToDevice, s),
                      cudaSuccess);
            ca.y.shape = res.recv_x.shape;
            gpu->combine(std::move(res.handle), ca);
        };
        gpu->group()->barrier();
        step();  // warm-up: buffer-owned outputs get their memory here
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        EXPECT_EQ(cpu_decode(*cpu, in), download<uint16_t>(dout.ptr, static_cast<size_t>(t * cfg.hidden)))
            << "rank " << r << " eager round";
        gpu->group()->barrier();
        cudaGraph_t graph;
        ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        step();
        ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
        cudaGraphExec_t exec;
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        for (int replay = 0; replay < 3; ++replay) {
            const RankData fresh = inputs(cfg, t, 900 + static_cast<uint64_t>(replay * 16 + r));
            cudaMemcpyAsync(dx.ptr, fresh.x.data(), fresh.x.size() * 2, cudaMemcpyHostToDevice, s);
            cudaMemcpyAsync(didx.ptr, fresh.idx64.data(), fresh.idx64.size() * 8, cudaMemcpyHostToDevice, s);
            cudaMemcpyAsync(dw.ptr, fresh.w.data(), fresh.w.size() * 4, cudaMemcpyHostToDevice, s);
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            gpu->group()->barrier();  // every rank's new inputs are in place before any replay reads a peer's
            ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            gpu->group()->barrier();
            EXPECT_EQ(cpu_decode(*cpu, fresh), download<uint16_t>(dout.ptr, static_cast<size_t>(t * cfg.hidden)))
                << "rank " << r << " replay " << replay << ": combine output differs from the CPU hybrid backend";
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        gpu->check();
        gpu->group()->barrier();
        cudaStreamDestroy(s);
    }));
}

// ---- faults ---------------------------------------------------------------------------------

TEST(HybridGpu, MissingNodeIsATimeoutNamingIt) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    Scenario s = hybrid(2, 2, 1, 2, 256, 4);
    s.cfg.timeout = std::chrono::milliseconds(500);
    s.seed = 40;
    const auto data = make_inputs(s);
    auto groups = ThreadGroup::create(4);
    std::vector<std::string> got(4);
    std::vector<std::unique_ptr<CudaMemory>> mem(4);
    std::vector<std::shared_ptr<Buffer>> bufs(4);
    const auto errors = run_ranks(4, [&](int r) {
        BufferConfig gc = s.cfg;
        gc.device = 0;
        mem[static_cast<size_t>(r)] = std::make_unique<CudaMemory>(0);
        CudaMemory& m = *mem[static_cast<size_t>(r)];
        DispatchArgs a = make_args(
            s, data[static_cast<size_t>(r)], [&](const void* p, size_t n) { return m.place(p, n); }, m.device());
        bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], gc, BackendKind::kCUDA);
        if (r < 2) (void)bufs[static_cast<size_t>(r)]->dispatch(a);  // node 1 never calls
    });
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kTimeout, {"dispatch (network hop)", "rank 0 (node 0)", "2 (node 1)"}))
        << describe(errors[0]);
    EXPECT_TRUE(is_error(errors[1], ErrorCode::kTimeout, {"network hop", "3 (node 1)"})) << describe(errors[1]);
    EXPECT_FALSE(errors[2]);
    EXPECT_FALSE(errors[3]);
    all_ok(run_ranks(4, [&](int r) { groups[static_cast<size_t>(r)]->barrier(); }));
}

TEST(HybridGpu, NcclScaleOutsRefuseRanksSharingAGpuInOneProcess) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    for (ScaleOut so : {ScaleOut::kNccl, ScaleOut::kGin}) {
        Scenario s = hybrid(2, 1, 1, 1, 256, 2);
        s.cfg.scaleout = so;
        auto groups = ThreadGroup::create(2);
        const auto errors = run_ranks(2, [&](int r) {
            BufferConfig gc = s.cfg;
            gc.device = 0;
            Buffer::create(groups[static_cast<size_t>(r)], gc, BackendKind::kCUDA);
        });
        for (const auto& e : errors)
            EXPECT_TRUE(is_error(
                e, ErrorCode::kUnsupported,
                {std::string("scaleout=") + scaleout_name(so), "share a GPU inside one process", "scaleout=emulated"}))
                << describe(e);
    }
    // auto picks the emulated network there, and says so
    Scenario s = hybrid(2, 1, 1, 1, 256, 2);
    s.cfg.scaleout = ScaleOut::kAuto;
    auto groups = ThreadGroup::create(2);
    std::vector<std::string> used(2);
    all_ok(run_ranks(2, [&](int r) {
        BufferConfig gc = s.cfg;
        gc.device = 0;
        used[static_cast<size_t>(r)] =
            Buffer::create(groups[static_cast<size_t>(r)], gc, BackendKind::kCUDA)->scaleout();
    }));
    EXPECT_EQ(used, (std::vector<std::string>{"emulated", "emulated"}));
}

}  // namespace
}  // namespace eptest
