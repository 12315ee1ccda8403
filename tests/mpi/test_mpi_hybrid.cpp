// Run under mpirun with an even number of processes (2: 2 nodes x 1 rank; 4: 2 nodes x 2 ranks): the
// CUDA backend's hybrid topology across processes, every process on GPU (rank % device_count), the two
// halves of the job playing two hosts to NCCL (NCCL_HOSTID=elasticep-nodeA / -nodeB, set here;
// NCCL_NET=Socket and NCCL_SOCKET_IFNAME=lo unless the environment says otherwise), so the rail
// (one rank per node) goes over NCCL's network even on one machine, and two processes may share a GPU.
// For scaleout nccl, gin, emulated and auto (GIN or NCCL here, never emulated): a CPU buffer (hybrid, its emulated
// network between processes) and a CUDA buffer, compared byte for byte with each other and with the oracle over bf16
// and fp8, both layouts, host sync and graph mode, two rounds each; then hybrid decode (masked, graph mode) captured in
// a CUDA graph once and replayed with new inputs. scaleout=gin without a GIN-capable network (no RDMA NIC) is skipped
// with NCCL's own reason, and that reason is checked to name GIN.
//   --timeout  instead: the ranks of node 1 skip a dispatch; node 0's ranks must get Timeout naming the
//              network hop and node 1, for emulated, nccl and auto (nccl: the rail communicator is aborted).
// Exit codes: 0 pass, 1 mismatch (every rank), 77 skip (no GPU, no CUDA backend, or an odd -np).
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/cuda_memory.hpp"
#include "common/rank_round.hpp"
#include "elasticep/elasticep.hpp"

using namespace eptest;

namespace {

constexpr int kSkip = 77;

[[noreturn]] void abort_job(int rank, const std::string& what) {
    std::fprintf(stderr, "rank %d: FATAL: %s\n", rank, what.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::abort();
}

struct Ctx {
    int rank = 0, size = 2, device = 0, per_node = 1;
    std::shared_ptr<Group> cpu_group, gpu_group;
};

Scenario base(const Ctx& cx, ScaleOut so) {
    Scenario s;
    s.num_ranks = cx.size;
    s.cfg.num_experts = 4 * cx.size;
    s.cfg.num_topk = 4;
    s.cfg.hidden = 256;
    s.cfg.max_tokens_per_rank = 16;
    s.cfg.topology = Topology::kHybrid;
    s.cfg.ranks_per_node = cx.per_node;
    s.cfg.scaleout = so;
    s.cfg.timeout = std::chrono::seconds(30);
    s.p_none = 1.0 / 8;
    s.p_token_none = 1.0 / 16;
    return s;
}

std::vector<Scenario> scenarios(const Ctx& cx, ScaleOut so, Payload payload) {
    Scenario b = base(cx, so);
    if (payload == Payload::kFP8) {
        b.cfg.payload = Payload::kFP8;
        b.cfg.scale_format = ScaleFormat::kF32G128;
        b.cfg.hidden = 512;
    }
    std::vector<Scenario> v;
    Scenario a = b;  // contiguous, host sync (exact NCCL sizes after the count exchange)
    a.opt.expert_alignment = 8;
    v.push_back(a);
    Scenario m = b;  // masked, graph mode (whole slabs)
    m.opt.layout = Layout::kExpertMasked;
    m.opt.host_sync = false;
    m.bias = true;
    v.push_back(m);
    Scenario g = b;  // contiguous, graph mode
    g.opt.host_sync = false;
    g.weighted = false;
    g.idx64 = true;
    v.push_back(g);
    return v;
}

int run_round(const Ctx& cx, Buffer& cpu, Buffer& gpu, Scenario sc, int round, const std::string& tag) {
    sc.tokens.clear();
    for (int q = 0; q < sc.num_ranks; ++q)
        sc.tokens.push_back(round == 0 && q == 0 ? sc.cfg.max_tokens_per_rank
                                                 : (q * 7 + round * 5 + 3) % (sc.cfg.max_tokens_per_rank + 1));
    sc.seed = 1000 + static_cast<uint64_t>(round) * 31 + std::hash<std::string>{}(tag) % 1000;
    const std::vector<RankData> data = make_inputs(sc);
    const RankData& d = data[static_cast<size_t>(cx.rank)];
    HostMemory host;
    const RankOutcome co = run_rank_round(sc, cx.rank, cpu, d, host);
    RankOutcome go;
    {
        CudaMemory dev(cx.device);
        const RoundHooks hooks{[&] { cx.gpu_group->barrier(); }, [&] { cx.gpu_group->barrier(); }};
        go = run_rank_round(sc, cx.rank, gpu, d, dev, hooks);
        gpu.check();
    }
    const ExpectedRound want = expected_round(sc, data);
    const size_t r = static_cast<size_t>(cx.rank);
    int bad = 0;
    auto note = [&](const std::string& m) {
        if (++bad <= 8) std::fprintf(stderr, "rank %d: MISMATCH [%s] %s\n", cx.rank, tag.c_str(), m.c_str());
    };
    for (const std::string& m : outcome_mismatches(sc, co, want.dispatch[r], want.combine[r])) note("cpu: " + m);
    for (const std::string& m : outcome_mismatches(sc, go, want.dispatch[r], want.combine[r])) note("cuda: " + m);
    for (const std::string& m : backend_mismatches(co.got, go.got, want.dispatch[r], sc.cfg, sc.opt.zero_padding))
        note("cuda vs cpu: " + m);
    const std::string c = combine_mismatch(go.out, co.out, sc.cfg.hidden);
    if (!c.empty()) note("cuda vs cpu: " + c);
    return bad;
}

int failing_ranks(const Ctx& cx, int mine) {
    int n = 0;
    for (int32_t v : cx.cpu_group->all_gather_value<int32_t>(mine > 0 ? 1 : 0)) n += v;
    return n;
}

// The CUDA buffer of `so`, or null with `skip_reason` when scaleout=gin has no GIN here (every rank).
std::shared_ptr<Buffer> make_gpu(const Ctx& cx, BufferConfig cfg, std::string& skip_reason) {
    cfg.device = cx.device;
    try {
        return Buffer::create(cx.gpu_group, cfg, BackendKind::kCUDA);
    } catch (const Error& e) {
        if (cfg.scaleout != ScaleOut::kGin || e.code() != ErrorCode::kUnsupported) throw;
        skip_reason = e.message();
        return nullptr;
    }
}

// Decode captured once, replayed with new inputs; each replay against the CPU buffer.
int graph_replays(const Ctx& cx, Buffer& cpu, Buffer& gpu, const BufferConfig& cfg, const std::string& tag) {
    const Device dev{DeviceType::kCUDA, cx.device};
    const int64_t t = cfg.max_tokens_per_rank - cx.rank % 2;
    auto draw = [&](uint64_t seed) {
        Scenario s;
        s.cfg = cfg;
        s.num_ranks = 1;
        s.tokens = {t};
        s.idx64 = true;
        s.p_none = 1.0 / 8;
        s.seed = seed;
        return make_inputs(s)[0];
    };
    RankData in = draw(70 + static_cast<uint64_t>(cx.rank));
    cudaStream_t s;
    cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    void *dx, *didx, *dw, *dy, *dout;
    const int64_t rows = int64_t{gpu.num_local_experts()} * cx.size * cfg.max_tokens_per_rank;
    cuda_ok(cudaMalloc(&dx, in.x.size() * 2 + 16), "malloc");
    cuda_ok(cudaMalloc(&didx, in.idx64.size() * 8 + 16), "malloc");
    cuda_ok(cudaMalloc(&dw, in.w.size() * 4 + 16), "malloc");
    cuda_ok(cudaMalloc(&dy, static_cast<size_t>(rows * cfg.hidden) * 2), "malloc");
    cuda_ok(cudaMalloc(&dout, static_cast<size_t>(t * cfg.hidden) * 2 + 16), "malloc");
    auto upload = [&](const RankData& r) {
        cuda_ok(cudaMemcpy(dx, r.x.data(), r.x.size() * 2, cudaMemcpyHostToDevice), "h2d");
        cuda_ok(cudaMemcpy(didx, r.idx64.data(), r.idx64.size() * 8, cudaMemcpyHostToDevice), "h2d");
        cuda_ok(cudaMemcpy(dw, r.w.data(), r.w.size() * 4, cudaMemcpyHostToDevice), "h2d");
        cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), "sync");  // landed before the non-blocking streams read
    };
    DispatchArgs a;
    a.x = TensorRef::contiguous(dx, DType::kBFloat16, {t, cfg.hidden}, dev);
    a.topk_idx = TensorRef::contiguous(didx, DType::kInt64, {t, cfg.num_topk}, dev);
    a.topk_weights = TensorRef::contiguous(dw, DType::kFloat32, {t, cfg.num_topk}, dev);
    a.layout = Layout::kExpertMasked;
    a.host_sync = false;
    a.stream = s;
    CombineArgs ca;
    ca.y = TensorRef::contiguous(dy, DType::kBFloat16, {}, dev);
    ca.out = TensorRef::contiguous(dout, DType::kBFloat16, {t, cfg.hidden}, dev);
    ca.weighted = true;
    ca.stream = s;
    auto step = [&] {
        DispatchResult res = gpu.dispatch(a);
        cuda_ok(cudaMemcpyAsync(dy, res.recv_x.data, static_cast<size_t>(res.recv_x.numel()) * 2,
                                cudaMemcpyDeviceToDevice, s),
                "d2d");
        ca.y.shape = res.recv_x.shape;
        gpu.combine(std::move(res.handle), ca);
    };
    auto cpu_decode = [&](const RankData& r) {
        DispatchArgs c;
        c.x = TensorRef::contiguous(const_cast<uint16_t*>(r.x.data()), DType::kBFloat16, {t, cfg.hidden});
        c.topk_idx = TensorRef::contiguous(const_cast<int64_t*>(r.idx64.data()), DType::kInt64, {t, cfg.num_topk});
        c.topk_weights = TensorRef::contiguous(const_cast<float*>(r.w.data()), DType::kFloat32, {t, cfg.num_topk});
        c.layout = Layout::kExpertMasked;
        c.host_sync = false;
        DispatchResult res = cpu.dispatch(c);
        std::vector<uint16_t> y(static_cast<const uint16_t*>(res.recv_x.data),
                                static_cast<const uint16_t*>(res.recv_x.data) + res.recv_x.numel());
        CombineArgs cc;
        cc.y = TensorRef::contiguous(y.data(), DType::kBFloat16, res.recv_x.shape);
        cc.weighted = true;
        const CombineResult o = cpu.combine(std::move(res.handle), cc);
        return std::vector<uint16_t>(o.out.data_as<uint16_t>(), o.out.data_as<uint16_t>() + t * cfg.hidden);
    };
    auto got = [&] {
        std::vector<uint16_t> v(static_cast<size_t>(t * cfg.hidden));
        cuda_ok(cudaMemcpy(v.data(), dout, v.size() * 2, cudaMemcpyDeviceToHost), "d2h");
        return v;
    };
    int bad = 0;
    upload(in);
    cx.gpu_group->barrier();
    step();  // warm-up: buffer-owned outputs
    cuda_ok(cudaStreamSynchronize(s), "sync");
    cx.gpu_group->barrier();
    bad += cpu_decode(in) != got();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
    step();
    cuda_ok(cudaStreamEndCapture(s, &graph), "end capture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    for (int replay = 0; replay < 3; ++replay) {
        const RankData fresh = draw(300 + static_cast<uint64_t>(replay * 16 + cx.rank));
        upload(fresh);
        cx.gpu_group->barrier();
        cuda_ok(cudaGraphLaunch(exec, s), "graph launch");
        cuda_ok(cudaStreamSynchronize(s), "sync");
        cx.gpu_group->barrier();
        const bool differs = cpu_decode(fresh) != got();
        if (differs) std::fprintf(stderr, "rank %d: MISMATCH [%s] graph replay %d\n", cx.rank, tag.c_str(), replay);
        bad += differs;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    gpu.check();
    cx.gpu_group->barrier();
    for (void* p : {dx, didx, dw, dy, dout}) cudaFree(p);
    cudaStreamDestroy(s);
    return bad;
}

int run_scaleout(const Ctx& cx, ScaleOut so) {
    int failures = 0;
    for (Payload payload : {Payload::kBF16, Payload::kFP8}) {
        const auto list = scenarios(cx, so, payload);
        BufferConfig cpu_cfg = list.front().cfg;
        cpu_cfg.scaleout = ScaleOut::kAuto;  // the CPU backend's network is the emulated one
        auto cpu = Buffer::create(cx.cpu_group, cpu_cfg, BackendKind::kCPU);
        std::string skip;
        auto gpu = make_gpu(cx, list.front().cfg, skip);
        if (!gpu) {
            const bool names_gin =
                skip.find("GIN") != std::string::npos && skip.find("scaleout=nccl") != std::string::npos;
            if (cx.rank == 0) std::printf("scaleout=gin: SKIP (NCCL: %s)\n", skip.c_str());
            if (!names_gin) {
                std::fprintf(stderr, "rank %d: the gin refusal must name GIN and suggest scaleout=nccl: %s\n", cx.rank,
                             skip.c_str());
                ++failures;
            }
            return failing_ranks(cx, failures);
        }
        if (cx.rank == 0) std::printf("scaleout=%s: buffer uses '%s'\n", scaleout_name(so), gpu->scaleout().c_str());
        // auto between processes with NCCL: GIN where the network has it, else NCCL point-to-point (a
        // non-blocking communicator built after the GIN attempt), never the emulated network
        const bool as_asked = so == ScaleOut::kAuto ? (gpu->scaleout() == "gin" || gpu->scaleout() == "nccl")
                                                    : gpu->scaleout() == scaleout_name(so);
        if (!as_asked) ++failures;
        for (size_t i = 0; i < list.size(); ++i)
            for (int round = 0; round < 2; ++round) {
                Scenario sc = list[i];
                sc.cfg = list.front().cfg;
                const std::string tag =
                    std::string(scaleout_name(so)) + " " + sc.name() + " round " + std::to_string(round + 1);
                const int mine = run_round(cx, *cpu, *gpu, sc, round, tag);
                const int bad = failing_ranks(cx, mine);
                if (cx.rank == 0) std::printf("%-100s %s\n", tag.c_str(), bad ? "FAILED" : "ok");
                std::fflush(stdout);
                if (bad) return 1;
            }
        if (payload == Payload::kBF16) {
            const std::string tag = std::string(scaleout_name(so)) + " decode graph capture + 3 replays";
            const int bad = failing_ranks(cx, graph_replays(cx, *cpu, *gpu, list.front().cfg, tag));
            if (cx.rank == 0) std::printf("%-100s %s\n", tag.c_str(), bad ? "FAILED" : "ok");
            if (bad) return 1;
        }
        cx.gpu_group->barrier();
    }
    return failing_ranks(cx, failures);
}

// Buffers of the timeout cases are never destroyed: tearing down a rail whose peer aborted its NCCL
// communicator is not what is tested, and the job ends with MPI_Finalize + _Exit instead.
std::vector<std::shared_ptr<Buffer>> g_kept;
std::vector<std::unique_ptr<CudaMemory>> g_kept_memory;

int run_timeout(const Ctx& cx, ScaleOut so) {
    Scenario s = base(cx, so);
    s.cfg.timeout = std::chrono::milliseconds(2000);
    s.cfg.device = cx.device;
    for (int q = 0; q < cx.size; ++q) s.tokens.push_back(4);
    s.seed = 5;
    const auto data = make_inputs(s);
    int failures = 0;
    {
        g_kept_memory.push_back(std::make_unique<CudaMemory>(cx.device));
        CudaMemory& mem = *g_kept_memory.back();
        const DispatchArgs a0 = make_args(
            s, data[static_cast<size_t>(cx.rank)], [&](const void* p, size_t n) { return mem.place(p, n); },
            mem.device());
        auto gpu = Buffer::create(cx.gpu_group, s.cfg, BackendKind::kCUDA);
        g_kept.push_back(gpu);
        cx.gpu_group->barrier();
        const bool node0 = cx.rank < cx.per_node;
        if (node0) {
            try {
                (void)gpu->dispatch(a0);
                std::fprintf(stderr, "rank %d: dispatch returned although node 1 never called it\n", cx.rank);
                ++failures;
            } catch (const Error& e) {
                const std::string m = e.message();
                const bool ok = e.code() == ErrorCode::kTimeout && m.find("network hop") != std::string::npos &&
                                m.find("(node 1)") != std::string::npos;
                std::printf("rank %d: scaleout=%s, node 1 skips dispatch: %s %s\n", cx.rank, scaleout_name(so),
                            ok ? "ok:" : "WRONG ERROR:", e.what());
                failures += ok ? 0 : 1;
            }
        }
        cx.gpu_group->barrier();
    }
    return failing_ranks(cx, failures);
}

}  // namespace

int main(int argc, char** argv) {
    const bool timeout_case = argc > 1 && std::string(argv[1]) == "--timeout";
    ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    auto cpu_group = MpiGroup::world(std::chrono::seconds(180));
    auto gpu_group = MpiGroup::world(std::chrono::seconds(180));
    Ctx cx;
    cx.rank = gpu_group->rank();
    cx.size = gpu_group->size();
    cx.cpu_group = cpu_group;
    cx.gpu_group = gpu_group;
    if (cx.size % 2 != 0) {
        std::printf("rank %d: SKIP: run with an even number of processes (two nodes)\n", cx.rank);
        return kSkip;
    }
    cx.per_node = cx.size / 2;
    // two "hosts" to NCCL; the rail runs over its Socket network on loopback
    ::setenv("NCCL_HOSTID", cx.rank < cx.per_node ? "elasticep-nodeA" : "elasticep-nodeB", 1);
    ::setenv("NCCL_NET", "Socket", 0);
    ::setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    int gpus = 0;
    std::string why;
    if (!Buffer::backend_available(BackendKind::kCUDA)) {
        why = "the CUDA backend is not compiled in or no CUDA GPU is visible";
    } else if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus <= 0) {
        cudaGetLastError();
        gpus = 0;
        why = "cudaGetDeviceCount found no GPU";
    }
    const auto counts = cpu_group->all_gather_value<int32_t>(gpus);
    if (std::find(counts.begin(), counts.end(), 0) != counts.end()) {
        std::printf("rank %d: SKIP: this test needs a CUDA GPU on every rank (%s)\n", cx.rank,
                    why.empty() ? "another rank has none" : why.c_str());
        return kSkip;
    }
    cx.device = cx.rank % gpus;
    int failures = 0;
    try {
        cuda_ok(cudaSetDevice(cx.device), "cudaSetDevice");
        if (timeout_case) {
            for (ScaleOut so : {ScaleOut::kEmulated, ScaleOut::kNccl, ScaleOut::kAuto}) failures += run_timeout(cx, so);
        } else {
            for (ScaleOut so : {ScaleOut::kNccl, ScaleOut::kGin, ScaleOut::kEmulated, ScaleOut::kAuto}) {
                failures += run_scaleout(cx, so);
                if (failures) break;
            }
        }
        cx.gpu_group->barrier();
    } catch (const std::exception& e) {
        abort_job(cx.rank, e.what());
    }
    std::printf("rank %d: hybrid across processes (%d nodes x %d ranks)%s: %s\n", cx.rank, 2, cx.per_node,
                timeout_case ? ", timeouts" : "", failures ? "FAILED" : "ok");
    if (timeout_case) {
        std::fflush(stdout);
        std::fflush(stderr);
        MPI_Finalize();
        std::_Exit(failures ? 1 : 0);
    }
    return failures ? 1 : 0;
}
