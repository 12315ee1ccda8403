// Run under mpirun with 2 processes: the CUDA backend with ranks as PROCESSES (receive windows mapped
// through CUDA IPC), rank 1 forging what it announces to rank 0 through the test hook of
// src/core/testing.hpp (the cases of tests/common/peer_forgeries.hpp: message counts past the capacity
// or negative, per-expert counts above the message count, expert ids outside [-1, E), source tokens
// outside [0, C), route positions outside the sender's rows), with host sync and in graph mode.
// The device-side peer checks must hold across processes:
//   - rank 0 raises elasticep::Error(Internal) "dispatch: rank 0 received corrupt data from rank 1: ..."
//     from the dispatch or the check() right after it (a sticky peer fault);
//   - no CUDA error in either process (an illegal or misaligned address would be a sticky one);
//   - rank 0 writes nothing outside its caller-provided outputs (guard bytes in device memory), and
//     nothing into them when the dispatch itself failed; with rank 1 dropped as a whole (a bad count,
//     graph mode) rank 0's outputs are exactly the oracle's for its own tokens;
//   - rank 1 sees nothing wrong;
// and afterwards both processes build new CPU and CUDA buffers that run a round equal to the oracle
// and to each other. Process r uses GPU r % device_count (two processes may share one GPU).
//
// Exit codes: 0 pass, 1 failure (every rank), 77 skip (no GPU or no CUDA backend; every rank).
// An unexpected exception aborts the job (MPI_Abort) so no rank waits for a dead peer.
// Run: ctest -R mpi_cuda_forged_peer, or
//   mpirun -np 2 --oversubscribe -x CUDA_DEVICE_MAX_CONNECTIONS=32 build/tests/elasticep_mpi_cuda_forged_test
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "common/cuda_memory.hpp"
#include "common/device_guarded.hpp"
#include "common/peer_forgeries.hpp"
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
    int rank = 0, size = 1, device = 0;
    std::shared_ptr<Group> gpu_group, cpu_group;
};

class Failures {
 public:
    Failures(int rank, std::string tag) : rank_(rank), tag_(std::move(tag)) {}
    void add(const std::string& what) {
        ++count_;
        std::fprintf(stderr, "rank %d: FAILED [%s] %s\n", rank_, tag_.c_str(), what.c_str());
    }
    int count() const { return count_; }

 private:
    int rank_;
    std::string tag_;
    int count_ = 0;
};

BufferConfig on_device(BufferConfig c, int device) {
    c.device = device;
    return c;
}

// One forged dispatch on fresh CUDA buffers. Returns the failures this rank saw.
int run_case(const Ctx& cx, const PeerForgery& f, bool host_sync, const std::vector<RankData>& data) {
    const std::string tag = f.what + (host_sync ? " (host sync)" : " (graph mode)");
    Failures fails(cx.rank, tag);
    const BufferConfig cfg = forge_config();
    const Scenario sc = forge_scenario(host_sync);
    {
        auto buf = Buffer::create(cx.gpu_group, on_device(cfg, cx.device), BackendKind::kCUDA);
        if (cx.rank == 1)
            forge::set_dispatch_forger(*buf, [&](forge::OutgoingDispatch& o) {
                if (o.receiver == 0) f.forge(o);
            });
        CudaMemory mem(cx.device);
        DispatchArgs a = make_args(
            sc, data[static_cast<size_t>(cx.rank)], [&](const void* p, size_t n) { return mem.place(p, n); },
            Device{DeviceType::kCUDA, cx.device});
        std::unique_ptr<GuardedDispatchOutputs> outs;
        if (cx.rank == 0) {
            outs = guarded_dispatch_outputs(sc, cx.device);
            a.outputs = outs->refs;
        }
        cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize (uploads)");
        cx.gpu_group->barrier();
        std::optional<DispatchResult> res;
        std::string error;
        ErrorCode code = ErrorCode::kInternal;
        bool from_dispatch = false;
        try {
            res = buf->dispatch(a);
            buf->check();
        } catch (const Error& e) {
            error = e.message();
            code = e.code();
            from_dispatch = !res.has_value();
        }
        // no sticky CUDA error in this process (an illegal or misaligned address would be one)
        const cudaError_t ce = cudaDeviceSynchronize();
        if (ce != cudaSuccess) fails.add(std::string("the CUDA context holds an error: ") + cudaGetErrorString(ce));
        if (cx.rank == 0) {
            const std::string want = "dispatch: rank 0 received corrupt data from rank 1: " + f.needle;
            if (error.empty())
                fails.add("rank 0 raised nothing");
            else if (code != ErrorCode::kInternal || error.find(want) == std::string::npos)
                fails.add("expected Internal '" + want + "', got [" + error_code_name(code) + "] " + error);
            if (!outs->guards_intact()) fails.add("rank 0 wrote outside its caller-provided outputs");
            if (from_dispatch && !outs->bodies_untouched())
                fails.add("rank 0 wrote outputs for a dispatch that failed");
            if (!host_sync && f.drops_sender) {
                if (!res) {
                    fails.add("graph-mode dispatch returned no outputs");
                } else {
                    ref::DispatchOptions opt;
                    opt.host_sync = false;
                    const auto expect = ref::dispatch(cfg, 2, forge_inputs_without_rank1(data), opt);
                    const Observed got = observe_device(*res, cfg);
                    for (const std::string& m : dispatch_mismatches(expect[0], got, cfg, false))
                        fails.add("rank 0's outputs without rank 1's data: " + m);
                }
            }
        } else if (!error.empty() && error.find("a combine slot range") == std::string::npos) {
            // (the staged protocol hands a sender's announced count back to it as its combine slot range:
            // a forged count may trip the forger's own check, kPeerSlot; any other error is a failure)
            fails.add("rank 1 got an error: " + error);
        }
        cx.gpu_group->barrier();  // both processes are done with these buffers before either frees its part
    }
    cx.gpu_group->barrier();
    return fails.count();
}

// A normal round on new CPU and CUDA buffers: both equal the oracle and each other.
int run_good_round(const Ctx& cx) {
    Failures fails(cx.rank, "a new buffer after the forged rounds");
    Scenario sc;
    sc.cfg = forge_config();
    sc.num_ranks = cx.size;
    sc.tokens = {kForgeCapacity, 5};
    sc.p_none = 1.0 / 8;
    sc.bias = true;
    sc.seed = 707;
    const std::vector<RankData> data = make_inputs(sc);
    const size_t r = static_cast<size_t>(cx.rank);
    auto cpu = Buffer::create(cx.cpu_group, sc.cfg, BackendKind::kCPU);
    auto gpu = Buffer::create(cx.gpu_group, on_device(sc.cfg, cx.device), BackendKind::kCUDA);
    HostMemory host;
    const RankOutcome co = run_rank_round(sc, cx.rank, *cpu, data[r], host);
    RankOutcome go;
    {
        CudaMemory dev(cx.device);
        const RoundHooks hooks{[&] { cx.gpu_group->barrier(); }, [&] { cx.gpu_group->barrier(); }};
        go = run_rank_round(sc, cx.rank, *gpu, data[r], dev, hooks);
        gpu->check();
    }
    const ExpectedRound want = expected_round(sc, data);
    for (const std::string& m : outcome_mismatches(sc, co, want.dispatch[r], want.combine[r])) fails.add("cpu: " + m);
    for (const std::string& m : outcome_mismatches(sc, go, want.dispatch[r], want.combine[r])) fails.add("cuda: " + m);
    for (const std::string& m : backend_mismatches(co.got, go.got, want.dispatch[r], sc.cfg, false))
        fails.add("cuda vs cpu: " + m);
    const std::string c = combine_mismatch(go.out, co.out, sc.cfg.hidden);
    if (!c.empty()) fails.add("cuda vs cpu: " + c);
    cx.gpu_group->barrier();
    return fails.count();
}

// Every rank learns whether any rank failed.
bool any_failed(const Ctx& cx, int mine) {
    const auto all = cx.cpu_group->all_gather_value<int32_t>(mine > 0 ? 1 : 0);
    return std::find(all.begin(), all.end(), 1) != all.end();
}

}  // namespace

int main() {
    ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    auto cpu_group = MpiGroup::world(std::chrono::seconds(120));
    auto gpu_group = MpiGroup::world(std::chrono::seconds(120));
    Ctx cx;
    cx.rank = gpu_group->rank();
    cx.size = gpu_group->size();
    cx.cpu_group = cpu_group;
    cx.gpu_group = gpu_group;
    if (cx.size != 2) {
        if (cx.rank == 0) std::fprintf(stderr, "this test needs exactly 2 processes (mpirun -np 2), got %d\n", cx.size);
        return 1;
    }
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
    int failed_cases = 0;
    try {
        cuda_ok(cudaSetDevice(cx.device), "cudaSetDevice");
        const std::vector<RankData> data = forge_inputs();
        for (const bool host_sync : {true, false})
            for (const PeerForgery& f : peer_forgeries()) {
                const bool bad = any_failed(cx, run_case(cx, f, host_sync, data));
                if (cx.rank == 0)
                    std::printf("%-50s %-12s %s\n", f.what.c_str(), host_sync ? "host sync" : "graph mode",
                                bad ? "FAILED" : "ok");
                failed_cases += bad ? 1 : 0;
            }
        const bool bad = any_failed(cx, run_good_round(cx));
        if (cx.rank == 0) std::printf("%-63s %s\n", "new buffers after the forged rounds", bad ? "FAILED" : "ok");
        failed_cases += bad ? 1 : 0;
        cx.gpu_group->barrier();
    } catch (const std::exception& e) {
        abort_job(cx.rank, e.what());
    }
    std::printf("rank %d: forged peer data on the CUDA backend across processes: %s\n", cx.rank,
                failed_cases ? "FAILED" : "ok");
    return failed_cases ? 1 : 0;
}
