// CUDA graph capture of dispatch -> stand-in expert op -> combine, replayed with new inputs;
// bounded waits (a rank that skips dispatch); invalid routes with and without host sync.
// Every result is compared with the CPU backend run on the same inputs.
#include "gpu_harness.hpp"

namespace eptest {
namespace {

BufferConfig small_config(Payload payload = Payload::kBF16) {
    BufferConfig c;
    c.num_experts = 16;
    c.num_topk = 4;
    c.hidden = 256;
    c.max_tokens_per_rank = 8;
    c.payload = payload;
    c.timeout = std::chrono::milliseconds(20000);
    return c;
}

// One rank's inputs from the shared generator (tests/common/scenario.hpp): T tokens of bf16 x (NaNs
// included), int64 top-k ids with -1 slots and route-less tokens, weights; contiguous storage.
RankData inputs(const BufferConfig& c, int64_t t, uint64_t seed, bool hot = false) {
    Scenario s;
    s.cfg = c;
    s.num_ranks = 1;
    s.tokens = {t};
    s.routing = hot ? Routing::kHotExpert : Routing::kRandom;
    s.p_none = 1.0 / 8;
    s.p_token_none = 1.0 / 16;
    s.p_nan = 1.0 / 64;
    s.idx64 = true;
    s.seed = seed;
    return make_inputs(s)[0];
}

DispatchArgs args_for(const BufferConfig& c, const RankData& in, const void* x, const void* idx, const void* w,
                      Device d) {
    const int64_t t = in.in.num_tokens;
    DispatchArgs a;
    a.x = TensorRef::contiguous(const_cast<void*>(x), DType::kBFloat16, {t, c.hidden}, d);
    a.topk_idx = TensorRef::contiguous(const_cast<void*>(idx), DType::kInt64, {t, c.num_topk}, d);
    a.topk_weights = TensorRef::contiguous(const_cast<void*>(w), DType::kFloat32, {t, c.num_topk}, d);
    return a;
}

// CPU reference of dispatch -> identity expert op -> weighted combine.
std::vector<uint16_t> cpu_round(Buffer& cpu, const RankData& in, Layout layout, int alignment, bool host_sync,
                                std::vector<int32_t>* counts = nullptr) {
    const BufferConfig& c = cpu.config();
    DispatchArgs a = args_for(c, in, in.x.data(), in.idx64.data(), in.w.data(), Device{});
    a.layout = layout;
    a.expert_alignment = alignment;
    a.host_sync = host_sync;
    DispatchResult r = cpu.dispatch(a);
    if (counts) {
        const auto* p = r.counts.data_as<int32_t>();
        counts->assign(p, p + r.counts.numel());
    }
    std::vector<uint16_t> y(static_cast<const uint16_t*>(r.recv_x.data),
                            static_cast<const uint16_t*>(r.recv_x.data) + r.recv_x.numel());
    CombineArgs ca;
    ca.y = TensorRef::contiguous(y.data(), DType::kBFloat16, r.recv_x.shape);
    ca.weighted = true;
    CombineResult o = cpu.combine(std::move(r.handle), ca);
    const auto* p = o.out.data_as<uint16_t>();
    return std::vector<uint16_t>(p, p + in.in.num_tokens * c.hidden);
}

void graph_test(int ranks, int gpus, Layout layout) {
    const BufferConfig cfg = small_config();
    auto cpu_groups = ThreadGroup::create(ranks);
    auto gpu_groups = ThreadGroup::create(ranks);
    const int alignment = layout == Layout::kExpertContiguous ? 4 : 1;
    all_ok(run_ranks(ranks, [&](int r) {
        BufferConfig gc = cfg;
        gc.device = r % gpus;
        cudaSetDevice(gc.device);
        const Device dev{DeviceType::kCUDA, gc.device};
        auto cpu = Buffer::create(cpu_groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        auto gpu = Buffer::create(gpu_groups[static_cast<size_t>(r)], gc, BackendKind::kCUDA);
        cudaStream_t s;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        const int64_t t = cfg.max_tokens_per_rank - (r % 2);  // fixed per rank across replays, uneven across ranks
        RankData in = inputs(cfg, t, 500 + static_cast<uint64_t>(r));
        DevBuf dx = DevBuf::upload(in.x), didx = DevBuf::upload(in.idx64), dw = DevBuf::upload(in.w);
        DevBuf dout(static_cast<size_t>(t * cfg.hidden) * 2);
        const int64_t rows = layout == Layout::kExpertContiguous
                                 ? gpu->max_contiguous_rows(alignment)
                                 : int64_t{gpu->num_local_experts()} * ranks * cfg.max_tokens_per_rank;
        DevBuf dy(static_cast<size_t>(rows * cfg.hidden) * 2);
        DispatchArgs a = args_for(cfg, in, dx.ptr, didx.ptr, dw.ptr, dev);
        a.layout = layout;
        a.expert_alignment = alignment;
        a.host_sync = false;
        a.stream = s;
        CombineArgs ca;
        ca.y = TensorRef::contiguous(dy.ptr, DType::kBFloat16, {}, dev);
        ca.out = TensorRef::contiguous(dout.ptr, DType::kBFloat16, {t, cfg.hidden}, dev);
        ca.weighted = true;
        ca.stream = s;
        auto step = [&]() {
            DispatchResult res = gpu->dispatch(a);
            // the stand-in expert op: the identity, as a device-to-device copy inside the graph
            ASSERT_EQ(cudaMemcpyAsync(dy.ptr, res.recv_x.data, static_cast<size_t>(res.recv_x.numel()) * 2,
                                      cudaMemcpyDeviceToDevice, s),
                      cudaSuccess);
            ca.y.shape = res.recv_x.shape;
            gpu->combine(std::move(res.handle), ca);
        };
        gpu->group()->barrier();  // every rank's allocations done before the first collective
        step();                   // warm-up outside the graph: buffer-owned outputs get their memory here
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        cpu_round(*cpu, in, layout, alignment, false);  // keep the CPU group's call count in step

        cudaGraph_t graph;
        ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        step();
        ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
        cudaGraphExec_t exec;
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        for (int replay = 0; replay < 3; ++replay) {
            RankData fresh = inputs(cfg, t, 900 + static_cast<uint64_t>(replay * 16 + r), replay == 1);
            cudaMemcpyAsync(dx.ptr, fresh.x.data(), fresh.x.size() * 2, cudaMemcpyHostToDevice, s);
            cudaMemcpyAsync(didx.ptr, fresh.idx64.data(), fresh.idx64.size() * 8, cudaMemcpyHostToDevice, s);
            cudaMemcpyAsync(dw.ptr, fresh.w.data(), fresh.w.size() * 4, cudaMemcpyHostToDevice, s);
            ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            std::vector<int32_t> counts;
            const auto expect = cpu_round(*cpu, fresh, layout, alignment, false, &counts);
            const auto got = download<uint16_t>(dout.ptr, static_cast<size_t>(t * cfg.hidden));
            EXPECT_TRUE(expect == got) << "rank " << r << " replay " << replay << " (" << layout_name(layout)
                                       << "): combine output differs from the CPU backend";
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        gpu->check();  // nothing sticky
        cudaStreamDestroy(s);
    }));
}

TEST(CudaBackendGraph, MaskedCaptureReplay) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    graph_test(4, 1, Layout::kExpertMasked);
}

TEST(CudaBackendGraph, ContiguousGraphModeCaptureReplay) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    graph_test(4, 1, Layout::kExpertContiguous);
}

TEST(CudaBackendGraph, OneRankPerGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    if (gpu_count() < 2) GTEST_SKIP() << "needs 2 or more GPUs (found " << gpu_count() << ")";
    graph_test(2, 2, Layout::kExpertMasked);
    graph_test(2, 2, Layout::kExpertContiguous);
}

TEST(CudaBackendFaults, TimeoutNamesTheMissingRankAndANewBufferWorks) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const int ranks = 4;
    BufferConfig cfg = small_config();
    cfg.timeout = std::chrono::milliseconds(300);
    auto groups = ThreadGroup::create(ranks);
    auto cpu_groups = ThreadGroup::create(ranks);
    all_ok(run_ranks(ranks, [&](int r) {
        cudaSetDevice(0);
        const Device dev{DeviceType::kCUDA, 0};
        RankData in = inputs(cfg, 4, 40 + static_cast<uint64_t>(r));
        DevBuf dx = DevBuf::upload(in.x), didx = DevBuf::upload(in.idx64), dw = DevBuf::upload(in.w);
        {
            auto gpu = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCUDA);
            if (r != 2) {  // rank 2 skips the call
                try {
                    gpu->dispatch(args_for(cfg, in, dx.ptr, didx.ptr, dw.ptr, dev));
                    ADD_FAILURE() << "rank " << r << ": dispatch returned although rank 2 never called it";
                } catch (const Error& e) {
                    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
                    EXPECT_NE(e.message().find("rank(s) 2"), std::string::npos) << e.what();
                    EXPECT_EQ(e.message().find("rank(s) 2,"), std::string::npos) << e.what();
                }
                // the buffer is unusable now
                try {
                    gpu->check();
                    ADD_FAILURE() << "check() after a timeout must raise";
                } catch (const Error& e) {
                    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
                }
            }
            groups[static_cast<size_t>(r)]->barrier();
        }
        // a new buffer works
        BufferConfig fresh = cfg;
        fresh.timeout = std::chrono::milliseconds(20000);
        auto gpu = Buffer::create(groups[static_cast<size_t>(r)], fresh, BackendKind::kCUDA);
        auto cpu = Buffer::create(cpu_groups[static_cast<size_t>(r)], fresh, BackendKind::kCPU);
        DispatchArgs a = args_for(cfg, in, dx.ptr, didx.ptr, dw.ptr, dev);
        DispatchResult res = gpu->dispatch(a);
        CombineArgs ca;
        ca.y = res.recv_x;
        CombineResult o = gpu->combine(std::move(res.handle), ca);
        const auto got = download<uint16_t>(o.out.data, static_cast<size_t>(in.in.num_tokens * cfg.hidden));
        EXPECT_TRUE(got == cpu_round(*cpu, in, Layout::kExpertContiguous, 1, true)) << "rank " << r;
    }));
}

TEST(CudaBackendFaults, HostSyncInvalidRouteFailsOnEveryRank) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const int ranks = 2;
    const BufferConfig cfg = small_config(Payload::kFP8);
    auto groups = ThreadGroup::create(ranks);
    auto cpu_groups = ThreadGroup::create(ranks);
    all_ok(run_ranks(ranks, [&](int r) {
        cudaSetDevice(0);
        const Device dev{DeviceType::kCUDA, 0};
        auto gpu = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCUDA);
        auto cpu = Buffer::create(cpu_groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        RankData in = inputs(cfg, 6, 60 + static_cast<uint64_t>(r));
        if (r == 1) {
            in.idx64[3 * 4 + 1] = in.idx64[3 * 4 + 0] = 5;  // token 3: k=1 repeats k=0
            in.idx64[4 * 4 + 2] = 99;                       // later, out of range
        }
        DevBuf dx = DevBuf::upload(in.x), didx = DevBuf::upload(in.idx64), dw = DevBuf::upload(in.w);
        groups[static_cast<size_t>(r)]->barrier();
        std::string cpu_msg, gpu_msg;
        try {
            cpu->dispatch(args_for(cfg, in, in.x.data(), in.idx64.data(), in.w.data(), Device{}));
        } catch (const Error& e) {
            cpu_msg = e.message();
        }
        try {
            gpu->dispatch(args_for(cfg, in, dx.ptr, didx.ptr, dw.ptr, dev));
        } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
            gpu_msg = e.message();
        }
        EXPECT_NE(gpu_msg.find("rank 1, token 3, k=1"), std::string::npos) << "rank " << r << ": " << gpu_msg;
        EXPECT_EQ(gpu_msg, cpu_msg) << "rank " << r;
        // the buffer stays usable; valid input goes through
        RankData ok = inputs(cfg, 6, 70 + static_cast<uint64_t>(r));
        DevBuf ox = DevBuf::upload(ok.x), oidx = DevBuf::upload(ok.idx64), ow = DevBuf::upload(ok.w);
        std::vector<uint16_t> y(static_cast<size_t>(gpu->max_contiguous_rows(1) * cfg.hidden), 0x3f80);  // 1.0
        DevBuf dy = DevBuf::upload(y);
        groups[static_cast<size_t>(r)]->barrier();
        DispatchResult res = gpu->dispatch(args_for(cfg, ok, ox.ptr, oidx.ptr, ow.ptr, dev));
        EXPECT_GE(res.num_rows, 0);
        CombineArgs ca;
        ca.y = TensorRef::contiguous(dy.ptr, DType::kBFloat16, res.recv_x.shape, dev);
        gpu->combine(std::move(res.handle), ca);
        gpu->check();
    }));
}

TEST(CudaBackendFaults, GraphModeInvalidRoutesAreDroppedAndSticky) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const int ranks = 2;
    const BufferConfig cfg = small_config();
    auto groups = ThreadGroup::create(ranks);
    auto cpu_groups = ThreadGroup::create(ranks);
    all_ok(run_ranks(ranks, [&](int r) {
        cudaSetDevice(0);
        const Device dev{DeviceType::kCUDA, 0};
        auto gpu = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCUDA);
        auto cpu = Buffer::create(cpu_groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        cudaStream_t s;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        std::vector<DevBuf> keep;  // freed at the end: cudaFree may wait for peers' spinning kernels
        for (int round = 0; round < 2; ++round) {
            RankData in = inputs(cfg, 5, 80 + static_cast<uint64_t>(r + 10 * round));
            if (r == 0) {
                in.idx64[1 * 4 + 2] = cfg.num_experts + 5;  // token 1, k=2: out of range
                in.idx64[2 * 4 + 3] = -7;                   // later: also out of range
            }
            keep.push_back(DevBuf::upload(in.x));
            keep.push_back(DevBuf::upload(in.idx64));
            keep.push_back(DevBuf::upload(in.w));
            const size_t n = keep.size();
            groups[static_cast<size_t>(r)]->barrier();  // uploads done everywhere before the collective
            DispatchArgs a = args_for(cfg, in, keep[n - 3].ptr, keep[n - 2].ptr, keep[n - 1].ptr, dev);
            a.layout = Layout::kExpertMasked;
            a.host_sync = false;
            a.stream = s;
            DispatchResult res = gpu->dispatch(a);  // graph mode: no error here
            CombineArgs ca;
            ca.y = res.recv_x;
            ca.stream = s;
            CombineResult o = gpu->combine(std::move(res.handle), ca);
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            const auto got = download<uint16_t>(o.out.data, static_cast<size_t>(in.in.num_tokens * cfg.hidden));
            EXPECT_TRUE(got == cpu_round(*cpu, in, Layout::kExpertMasked, 1, false)) << "rank " << r;
            if (round == 0) {
                if (r == 0) {
                    try {
                        gpu->check();
                        ADD_FAILURE() << "check() must report the sticky fault";
                    } catch (const Error& e) {
                        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
                        EXPECT_NE(e.message().find("rank 0, token 1, k=2"), std::string::npos) << e.what();
                        EXPECT_NE(e.message().find(std::to_string(cfg.num_experts + 5)), std::string::npos) << e.what();
                    }
                }
                gpu->check();  // reported once, then clear (and never set on rank 1)
                try {
                    cpu->check();
                } catch (const Error&) {
                }
            } else {
                try {
                    cpu->check();
                } catch (const Error&) {
                }
                // the next host-sync dispatch reports the sticky fault on every rank
                groups[static_cast<size_t>(r)]->barrier();
                RankData ok = inputs(cfg, 3, 90 + static_cast<uint64_t>(r));
                DevBuf ox = DevBuf::upload(ok.x), oidx = DevBuf::upload(ok.idx64), ow = DevBuf::upload(ok.w);
                groups[static_cast<size_t>(r)]->barrier();
                DispatchArgs b = args_for(cfg, ok, ox.ptr, oidx.ptr, ow.ptr, dev);
                b.stream = s;
                try {
                    gpu->dispatch(b);
                    ADD_FAILURE() << "rank " << r << ": host-sync dispatch after a sticky fault must fail";
                } catch (const Error& e) {
                    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
                    EXPECT_NE(e.message().find("sticky"), std::string::npos) << e.what();
                    EXPECT_NE(e.message().find("rank 0, token 1, k=2"), std::string::npos) << e.what();
                }
            }
        }
        cudaStreamDestroy(s);
    }));
}

// A rank whose CUDA backend fails before the peer exchange (here: a device that does not exist) still
// takes part in it, so every rank raises at once instead of waiting for the group's timeout.
TEST(CudaBackendFaults, ARankThatFailsToStartFailsEveryRankPromptly) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const BufferConfig cfg = small_config();
    auto groups = ThreadGroup::create(2, std::chrono::seconds(30));
    const auto t0 = std::chrono::steady_clock::now();
    const auto errors = run_ranks(2, [&](int r) {
        BufferConfig c = cfg;
        c.device = r == 1 ? gpu_count() + 7 : 0;
        Buffer::create(groups[static_cast<size_t>(r)], c, BackendKind::kCUDA);
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(is_error(errors[1], ErrorCode::kCuda, {"failed on this rank"}));
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kInternal, {"rank(s) 1"}));
    EXPECT_LT(seconds, 10.0) << "the ranks waited for the group's timeout";
    // the group is still in step: both ranks build a working buffer next
    all_ok(run_ranks(2, [&](int r) { Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCUDA); }));
}

}  // namespace
}  // namespace eptest
