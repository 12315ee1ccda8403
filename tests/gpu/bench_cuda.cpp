// Benchmark of the CUDA backend at DeepSeek-V3 shapes (H=7168, E=256, K=8, fp8 f32_g128 dispatch
// with fused quantization, bf16 combine). Disabled by default; tools/device-check runs it with
//   elasticep_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='*DISABLED_Bench*'
// Environment: ELASTICEP_BENCH_RANKS (default 8 on one GPU, else one rank per GPU),
// ELASTICEP_BENCH_JSON (file to append one JSON line per phase), ELASTICEP_BENCH_ITERS (default 20).
// Timing: CUDA events on each rank's stream after warm-up. "isolated": ranks meet at a host barrier
// before every timed iteration (so the figure includes the ranks' skew in leaving the barrier); the
// figure per iteration is the slowest rank; we report the median. "back-to-back" (b2b_*): each rank
// enqueues all iterations without host synchronisation (the protocol alone keeps the ranks in step),
// events between the calls; per-iteration slowest rank, median; b2b_graph is the mean of
// back-to-back graph replays.
#include "gpu_harness.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>

namespace elasticep::gputest {
namespace {

#if ELASTICEP_TEST_HAVE_CUDA

int env_int(const char* name, int fallback) {
    const char* v = std::getenv(name);
    return v ? std::atoi(v) : fallback;
}

double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct PhaseResult {
    std::vector<std::vector<double>> dispatch_ms, combine_ms, graph_ms;  // [rank][iter]
    std::vector<std::vector<double>> b2b_dispatch_ms, b2b_combine_ms;     // [rank][iter]
    std::vector<double> b2b_graph_ms;                                     // [rank]
    std::vector<double> bytes_dispatch, bytes_combine;                   // per rank
};

void bench_phase(const char* phase, int ranks, int gpus, int tokens, Layout layout, bool host_sync, int alignment) {
    BufferConfig cfg;
    cfg.num_experts = 256;
    cfg.num_topk = 8;
    cfg.hidden = 7168;
    cfg.max_tokens_per_rank = tokens;
    const char* payload = std::getenv("ELASTICEP_BENCH_PAYLOAD");
    cfg.payload = payload ? parse_payload(payload) : Payload::kFP8;
    cfg.scale_format = ScaleFormat::kF32G128;
    cfg.timeout = std::chrono::milliseconds(60000);
    cfg.num_sms = env_int("ELASTICEP_BENCH_SMS", 0);
    const int iters = env_int("ELASTICEP_BENCH_ITERS", 20), warmup = 3;
    auto groups = ThreadGroup::create(ranks);
    PhaseResult res;
    res.dispatch_ms.resize(static_cast<size_t>(ranks));
    res.combine_ms.resize(static_cast<size_t>(ranks));
    res.graph_ms.resize(static_cast<size_t>(ranks));
    res.b2b_dispatch_ms.resize(static_cast<size_t>(ranks));
    res.b2b_combine_ms.resize(static_cast<size_t>(ranks));
    res.b2b_graph_ms.resize(static_cast<size_t>(ranks));
    res.bytes_dispatch.resize(static_cast<size_t>(ranks));
    res.bytes_combine.resize(static_cast<size_t>(ranks));
    int used_sms = 0;
    const int h = cfg.hidden, k = cfg.num_topk;
    run_ranks(ranks, [&](int r) {
        BufferConfig gc = cfg;
        gc.device = r % gpus;
        cudaSetDevice(gc.device);
        const Device dev{DeviceType::kCUDA, gc.device};
        auto gpu = Buffer::create(groups[static_cast<size_t>(r)], gc, BackendKind::kCUDA);
        auto& group = *groups[static_cast<size_t>(r)];
        cudaStream_t s;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        // inputs: random bf16 in [2^-7, 2^3), uniform distinct experts, random weights
        uint64_t st = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(r + 1);
        auto next = [&st] {
            st ^= st << 13, st ^= st >> 7, st ^= st << 17;
            return st;
        };
        std::vector<uint16_t> x(static_cast<size_t>(tokens) * h);
        for (auto& v : x) {
            const uint64_t b = next();
            v = static_cast<uint16_t>((b & 0x807f) | (((120 + (b >> 16) % 10)) << 7));
        }
        std::vector<int64_t> idx(static_cast<size_t>(tokens) * k);
        std::vector<float> w(idx.size());
        int64_t sent = 0;
        for (int t = 0; t < tokens; ++t) {
            uint64_t dests = 0;
            for (int j = 0; j < k; ++j) {
                int64_t e;
                bool dup;
                do {
                    e = static_cast<int64_t>(next() % 256);
                    dup = false;
                    for (int q = 0; q < j; ++q) dup = dup || idx[static_cast<size_t>(t * k + q)] == e;
                } while (dup);
                idx[static_cast<size_t>(t * k + j)] = e;
                w[static_cast<size_t>(t * k + j)] = static_cast<float>(next() % 1000) / 1000.0f;
                dests |= 1ull << (e / (256 / ranks));
            }
            sent += __builtin_popcountll(dests);
        }
        DevBuf dx = DevBuf::upload(x), didx = DevBuf::upload(idx), dw = DevBuf::upload(w);
        const int64_t rows_cap = layout == Layout::kExpertContiguous ? gpu->max_contiguous_rows(alignment)
                                                                     : int64_t{gpu->num_local_experts()} * ranks * tokens;
        DevBuf dy(static_cast<size_t>(rows_cap) * h * 2);
        cudaMemset(dy.ptr, 0x3c, dy.bytes);  // bf16 0x3c3c, not zero
        DevBuf dout(static_cast<size_t>(tokens) * h * 2);
        DispatchArgs a;
        a.x = TensorRef::contiguous(dx.ptr, DType::kBFloat16, {tokens, h}, dev);
        a.topk_idx = TensorRef::contiguous(didx.ptr, DType::kInt64, {tokens, k}, dev);
        a.topk_weights = TensorRef::contiguous(dw.ptr, DType::kFloat32, {tokens, k}, dev);
        a.layout = layout;
        a.expert_alignment = alignment;
        a.host_sync = host_sync;
        a.stream = s;
        CombineArgs ca;
        ca.y = TensorRef::contiguous(dy.ptr, DType::kBFloat16, {}, dev);
        ca.out = TensorRef::contiguous(dout.ptr, DType::kBFloat16, {tokens, h}, dev);
        ca.stream = s;
        cudaEvent_t e0, e1, e2;
        cudaEventCreate(&e0), cudaEventCreate(&e1), cudaEventCreate(&e2);
        int64_t routes = 0;
        for (int it = 0; it < warmup + iters; ++it) {
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            group.barrier();
            cudaEventRecord(e0, s);
            DispatchResult d = gpu->dispatch(a);
            cudaEventRecord(e1, s);
            ca.y.shape = d.recv_x.shape;
            if (r == 0) used_sms = d.handle.num_sms();
            gpu->combine(std::move(d.handle), ca);
            cudaEventRecord(e2, s);
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            if (it == 0) {
                const auto counts = download<int32_t>(d.counts.data, static_cast<size_t>(d.counts.numel()));
                for (int32_t c : counts) routes += c;
            }
            if (it >= warmup) {
                float ms1 = 0, ms2 = 0;
                cudaEventElapsedTime(&ms1, e0, e1);
                cudaEventElapsedTime(&ms2, e1, e2);
                res.dispatch_ms[static_cast<size_t>(r)].push_back(ms1);
                res.combine_ms[static_cast<size_t>(r)].push_back(ms2);
            }
        }
        gpu->check();
        // back to back: no host synchronisation between iterations
        {
            std::vector<cudaEvent_t> ev(static_cast<size_t>(3 * iters));
            for (auto& e : ev) cudaEventCreate(&e);
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            group.barrier();
            for (int it = 0; it < iters; ++it) {
                cudaEventRecord(ev[static_cast<size_t>(3 * it)], s);
                DispatchResult d = gpu->dispatch(a);
                cudaEventRecord(ev[static_cast<size_t>(3 * it + 1)], s);
                ca.y.shape = d.recv_x.shape;
                gpu->combine(std::move(d.handle), ca);
                cudaEventRecord(ev[static_cast<size_t>(3 * it + 2)], s);
            }
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            for (int it = 0; it < iters; ++it) {
                float ms1 = 0, ms2 = 0;
                cudaEventElapsedTime(&ms1, ev[static_cast<size_t>(3 * it)], ev[static_cast<size_t>(3 * it + 1)]);
                cudaEventElapsedTime(&ms2, ev[static_cast<size_t>(3 * it + 1)], ev[static_cast<size_t>(3 * it + 2)]);
                res.b2b_dispatch_ms[static_cast<size_t>(r)].push_back(ms1);
                res.b2b_combine_ms[static_cast<size_t>(r)].push_back(ms2);
            }
            for (auto& e : ev) cudaEventDestroy(e);
            gpu->check();
        }
        // graph replay of dispatch + combine (graph-mode layouts only)
        if (!host_sync) {
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
            DispatchResult d = gpu->dispatch(a);
            ca.y.shape = d.recv_x.shape;
            gpu->combine(std::move(d.handle), ca);
            ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
            ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
            for (int it = 0; it < warmup + iters; ++it) {
                ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
                group.barrier();
                cudaEventRecord(e0, s);
                cudaGraphLaunch(exec, s);
                cudaEventRecord(e1, s);
                ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
                float ms = 0;
                cudaEventElapsedTime(&ms, e0, e1);
                if (it >= warmup) res.graph_ms[static_cast<size_t>(r)].push_back(ms);
            }
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            group.barrier();
            cudaEventRecord(e0, s);
            for (int it = 0; it < iters; ++it) cudaGraphLaunch(exec, s);
            cudaEventRecord(e1, s);
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            res.b2b_graph_ms[static_cast<size_t>(r)] = ms / iters;
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
        }
        const double scols = cfg.payload == Payload::kFP8 ? h / 128.0 : 0.0;
        const double elem = cfg.payload == Payload::kFP8 ? 1.0 : 2.0;
        const double msg = h * elem + 4 * scols + 32 + 32 + 16;
        // dispatch: read x; write + read each message; write each received row (data + scales)
        res.bytes_dispatch[static_cast<size_t>(r)] =
            double(tokens) * h * 2 + double(sent) * msg * 2 + double(routes) * (h * elem + 4 * scols);
        // combine: read each real row of y; write + read each partial; write the output
        res.bytes_combine[static_cast<size_t>(r)] = double(routes) * h * 2 + double(sent) * h * 2 * 2 + double(tokens) * h * 2;
        cudaEventDestroy(e0), cudaEventDestroy(e1), cudaEventDestroy(e2);
        cudaStreamDestroy(s);
    });
    auto slowest = [&](const std::vector<std::vector<double>>& v) {
        std::vector<double> per_iter;
        for (size_t i = 0; i < v[0].size(); ++i) {
            double m = 0;
            for (const auto& rr : v) m = std::max(m, rr[i]);
            per_iter.push_back(m);
        }
        return median(per_iter);
    };
    double bd = 0, bc = 0;
    for (int r = 0; r < ranks; ++r) bd += res.bytes_dispatch[static_cast<size_t>(r)], bc += res.bytes_combine[static_cast<size_t>(r)];
    const double d_ms = slowest(res.dispatch_ms), c_ms = slowest(res.combine_ms);
    const double g_ms = host_sync ? 0.0 : slowest(res.graph_ms);
    const double bd_ms = slowest(res.b2b_dispatch_ms), bc_ms = slowest(res.b2b_combine_ms);
    const double bg_ms = host_sync ? 0.0 : *std::max_element(res.b2b_graph_ms.begin(), res.b2b_graph_ms.end());
    // HBM floor when all ranks share one GPU; NVLink-bound otherwise (reported, not modelled)
    const double hbm = 4.2e12 * gpus;
    char line[2048];
    std::snprintf(line, sizeof(line),
                  "{\"phase\":\"%s\",\"payload\":\"%s\",\"ranks\":%d,\"gpus\":%d,\"tokens_per_rank\":%d,\"layout\":\"%s\",\"host_sync\":%s,"
                  "\"alignment\":%d,\"num_sms\":%d,\"iters\":%zu,\"dispatch_ms\":%.4f,\"combine_ms\":%.4f,"
                  "\"graph_dispatch_combine_ms\":%.4f,\"dispatch_bytes\":%.0f,\"combine_bytes\":%.0f,"
                  "\"dispatch_floor_ms\":%.4f,\"combine_floor_ms\":%.4f,\"b2b_dispatch_ms\":%.4f,\"b2b_combine_ms\":%.4f,"
                  "\"b2b_graph_ms\":%.4f}",
                  phase, payload_name(cfg.payload), ranks, gpus, tokens, layout_name(layout), host_sync ? "true" : "false", alignment, used_sms,
                  res.dispatch_ms[0].size(), d_ms, c_ms, g_ms, bd, bc, bd / hbm * 1e3, bc / hbm * 1e3, bd_ms, bc_ms, bg_ms);
    std::printf("%s\n", line);
    if (const char* path = std::getenv("ELASTICEP_BENCH_JSON")) {
        std::ofstream f(path, std::ios::app);
        f << line << "\n";
    }
}

#endif

TEST(CudaBench, DISABLED_BenchDeepSeekV3) {
    ELASTICEP_SKIP_WITHOUT_GPU();
#if ELASTICEP_TEST_HAVE_CUDA
    const int n = gpu_count();
    const int ranks = env_int("ELASTICEP_BENCH_RANKS", n > 1 ? n : 8);
    const int gpus = std::min(n, ranks);
    const std::string only = std::getenv("ELASTICEP_BENCH_PHASE") ? std::getenv("ELASTICEP_BENCH_PHASE") : "";
    if (only.empty() || only == "decode") bench_phase("decode", ranks, gpus, 128, Layout::kExpertMasked, false, 1);
    if (only.empty() || only == "prefill")
        bench_phase("prefill", ranks, gpus, 4096, Layout::kExpertContiguous, true, 128);
#endif
}

}  // namespace
}  // namespace elasticep::gputest
