// Run under mpirun (2 processes; any count >= 1 works, the timeout part needs >= 2): the CUDA backend
// with ranks as PROCESSES (receive regions mapped through CUDA IPC), compared byte for byte with the
// oracle and with the CPU backend over the same processes (its arena in a shared file mapping).
// Process r uses GPU r % device_count, so two processes may share one GPU (their kernels time-slice).
// Inputs, the rank runner and the comparisons are the shared test layer (tests/common): every
// process draws every rank's inputs from the scenario's seed and runs the oracle over all of them.
//
// Per payload setup (bf16; fp8 f32_g128 quantized inside dispatch; fp8 ue8m0_g32 pre-quantized) one
// CPU buffer and one CUDA buffer live through every scenario of the setup (contiguous host_sync,
// contiguous graph mode, masked), each run for two rounds with other token counts, so the buffers see
// six epochs and three layout switches. Every dispatch output (recv_x, recv_scales, recv_weights,
// recv_src, m_indices, counts, offsets / masked_m, num_rows, shapes and strides) and the combine
// output must be equal; padding rows are compared only where SEMANTICS.md defines them.
// Then the timeout contract across processes: rank 1 skips a dispatch (then, on a second buffer, a
// combine); every other rank must get Error(kTimeout) naming rank 1, the buffer stays unusable, and
// a freshly built buffer runs a normal round in the same processes.
//
// Exit codes: 0 pass, 1 mismatch (every rank), 77 skip (no GPU or no CUDA backend; every rank).
// An unexpected exception aborts the job (MPI_Abort) so no rank waits for a dead peer.
// Run: ctest -R mpi_cuda_dispatch (mpirun -np 2), or by hand with any -np, e.g. 4 processes on 2 GPUs:
//   mpirun -np 4 --oversubscribe -x CUDA_DEVICE_MAX_CONNECTIONS=32 build/tests/elasticep_mpi_cuda_test
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cuda_memory.hpp"
#include "common/rank_round.hpp"
#include "elasticep/elasticep.hpp"

using namespace eptest;

namespace {

constexpr int kSkip = 77;
constexpr auto kGroupTimeout = std::chrono::seconds(120);  // longer than any buffer timeout below
constexpr auto kBufferTimeout = std::chrono::seconds(20);

[[noreturn]] void abort_job(int rank, const std::string& what) {
    std::fprintf(stderr, "rank %d: FATAL: %s\n", rank, what.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::abort();
}

// Device memory of one round's inputs (cudaMalloc'd, so 256-byte aligned).
class DevMem {
 public:
    DevMem() = default;
    template <class T>
    explicit DevMem(const std::vector<T>& v) {
        const size_t bytes = v.size() * sizeof(T);
        cuda_ok(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)), "cudaMalloc");
        if (bytes) cuda_ok(cudaMemcpy(ptr_, v.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
        // the DMA has landed: the calls' streams are non-blocking, and a pageable cudaMemcpy may return first
        cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize");
    }
    DevMem(const DevMem&) = delete;
    DevMem& operator=(const DevMem&) = delete;
    ~DevMem() {
        if (ptr_) cudaFree(ptr_);
    }
    void* get() const { return ptr_; }

 private:
    void* ptr_ = nullptr;
};

// ---- scenarios ------------------------------------------------------------------------------

// A setup: one config (one CPU and one CUDA buffer), its scenarios (the options of each call: layout,
// sync, weights, bias, ...), each run for two rounds with other token counts and seeds.
struct Setup {
    std::string name;
    std::vector<Scenario> scenarios;
};

// Token counts: the full capacity, empty ranks and uneven counts all occur.
int64_t tokens_of(int capacity, int rank, int scenario, int round) {
    if (round == 0 && rank == 0) return capacity;
    if (round == 1 && rank == 1) return 0;
    return (rank * 13 + scenario * 7 + round * 11 + 5) % (capacity + 1);
}

uint64_t seed_of(int setup, int scenario, int round, uint64_t salt) {
    return (((static_cast<uint64_t>(setup) * 131 + static_cast<uint64_t>(scenario)) * 131 +
             static_cast<uint64_t>(round)) *
            0x9e3779b97f4a7c15ull) ^
           salt;
}

// Round `round` of scenario `scenario` of a setup, for `num_ranks` processes.
Scenario round_of(const Scenario& proto, int setup, int scenario, int round, int num_ranks) {
    Scenario s = proto;
    s.num_ranks = num_ranks;
    s.tokens.clear();
    for (int q = 0; q < num_ranks; ++q) s.tokens.push_back(tokens_of(s.cfg.max_tokens_per_rank, q, scenario, round));
    s.seed = seed_of(setup, scenario, round, 1);
    return s;
}

// ---- comparison -----------------------------------------------------------------------------

class Mismatches {
 public:
    Mismatches(int rank, std::string tag) : rank_(rank), tag_(std::move(tag)) {}
    void add(const std::string& what) {
        ++count_;
        if (count_ <= 12) std::fprintf(stderr, "rank %d: MISMATCH [%s] %s\n", rank_, tag_.c_str(), what.c_str());
    }
    int count() const { return count_; }

 private:
    int rank_;
    std::string tag_;
    int count_ = 0;
};

// ---- one round ------------------------------------------------------------------------------

struct Ctx {
    int rank = 0, size = 1, device = 0;
    std::shared_ptr<Group> cpu_group, gpu_group;
};

// One dispatch -> combine on the CPU buffer and on the CUDA buffer with the same inputs (the shared
// rank runner: on the GPU every allocation and upload happens before a barrier that precedes the
// first GPU dispatch, every download after a barrier that follows the last combine); both compared
// with the oracle and with each other. Returns the number of mismatches this rank saw.
int run_round(const Ctx& cx, Buffer& cpu, Buffer& gpu, const Scenario& sc, const std::string& tag) {
    Mismatches mm(cx.rank, tag);
    const std::vector<RankData> data = make_inputs(sc);
    const RankData& d = data[static_cast<size_t>(cx.rank)];
    HostMemory host;
    const RankOutcome co = run_rank_round(sc, cx.rank, cpu, d, host);
    RankOutcome go;
    {
        CudaMemory dev(cx.device);
        const RoundHooks hooks{[&] { cx.gpu_group->barrier(); }, [&] { cx.gpu_group->barrier(); }};
        go = run_rank_round(sc, cx.rank, gpu, d, dev, hooks);
        gpu.check();  // a device-side timeout or fault of this round, if any
    }
    const ExpectedRound want = expected_round(sc, data);
    const size_t r = static_cast<size_t>(cx.rank);
    for (const std::string& m : outcome_mismatches(sc, co, want.dispatch[r], want.combine[r])) mm.add("cpu: " + m);
    for (const std::string& m : outcome_mismatches(sc, go, want.dispatch[r], want.combine[r])) mm.add("cuda: " + m);
    for (const std::string& m : backend_mismatches(co.got, go.got, want.dispatch[r], sc.cfg, sc.opt.zero_padding))
        mm.add("cuda vs cpu: " + m);
    const std::string c = combine_mismatch(go.out, co.out, sc.cfg.hidden);
    if (!c.empty()) mm.add("cuda vs cpu: " + c);
    if (go.handle_num_sms <= 0) mm.add("handle.num_sms() = " + std::to_string(go.handle_num_sms));
    return mm.count();
}

// Every rank learns whether any rank failed; returns the number of failing ranks.
int failing_ranks(const Ctx& cx, int my_failures) {
    const auto all = cx.cpu_group->all_gather_value<int32_t>(my_failures > 0 ? 1 : 0);
    int n = 0;
    for (int32_t v : all) n += v;
    return n;
}

// Expert counts scale with the number of processes (E_local fixed), so any -np works.
std::vector<Setup> setups(int num_ranks) {
    std::vector<Setup> out;
    auto base = [](int e, int k, int h, int c) {
        Scenario s;
        s.cfg.num_experts = e;
        s.cfg.num_topk = k;
        s.cfg.hidden = h;
        s.cfg.max_tokens_per_rank = c;
        s.cfg.timeout = kBufferTimeout;
        s.p_none = 1.0 / 8;
        s.p_token_none = 1.0 / 16;
        s.p_nan = 1.0 / 64;
        return s;
    };
    auto contiguous = [](Scenario s, bool host_sync, int a) {
        s.opt.host_sync = host_sync;
        s.opt.expert_alignment = a;
        return s;
    };
    auto masked = [](Scenario s) {
        s.opt.layout = Layout::kExpertMasked;
        return s;
    };
    {
        const Scenario b0 = base(8 * num_ranks, 4, 256, 32);
        Scenario a = contiguous(b0, true, 1);  // weighted, no bias
        Scenario b = contiguous(b0, false, 128);
        b.weighted = false;  // weights carried, combine unweighted
        b.bias = true;
        b.idx64 = true;
        Scenario m = masked(b0);
        m.has_weights = m.weighted = false;
        m.bias = true;
        m.opt.zero_padding = true;
        out.push_back({"bf16", {a, b, m}});
    }
    {
        Scenario b0 = base(4 * num_ranks, 2, 512, 48);
        b0.cfg.payload = Payload::kFP8;
        b0.cfg.scale_format = ScaleFormat::kF32G128;
        Scenario a = contiguous(b0, true, 64);
        a.bias = true;
        a.idx64 = true;
        Scenario b = contiguous(b0, false, 1);
        b.weighted = false;
        b.mn_major = true;
        b.opt.zero_padding = true;
        Scenario m = masked(b0);  // weighted, no bias
        out.push_back({"fp8/f32_g128/quantize", {a, b, m}});
    }
    {
        Scenario b0 = base(8 * num_ranks, 3, 256, 64);
        b0.cfg.payload = Payload::kFP8;
        b0.cfg.scale_format = ScaleFormat::kUE8M0G32;
        b0.prequantized = true;
        Scenario a = contiguous(b0, true, 1);
        a.has_weights = a.weighted = false;
        a.bias = true;
        a.mn_major = true;
        Scenario b = contiguous(b0, false, 32);  // weighted
        b.bias = true;
        b.opt.zero_padding = true;
        b.idx64 = true;
        Scenario m = masked(b0);
        m.weighted = false;
        m.mn_major = true;
        out.push_back({"fp8/ue8m0_g32/prequantized", {a, b, m}});
    }
    return out;
}

// Builds a CPU buffer and a CUDA buffer of one config and runs every scenario twice on them.
int run_setup(const Ctx& cx, int setup_index, const Setup& su) {
    cuda_ok(cudaSetDevice(cx.device), "cudaSetDevice");
    const BufferConfig& cfg = su.scenarios.front().cfg;
    auto cpu = Buffer::create(cx.cpu_group, cfg, BackendKind::kCPU);
    BufferConfig gpu_cfg = cfg;
    gpu_cfg.device = cx.device;  // per rank: not part of what the ranks must agree on
    auto gpu = Buffer::create(cx.gpu_group, gpu_cfg, BackendKind::kCUDA);
    int failures = 0;
    for (int s = 0; s < static_cast<int>(su.scenarios.size()); ++s)
        for (int round = 0; round < 2; ++round) {
            const Scenario sc = round_of(su.scenarios[static_cast<size_t>(s)], setup_index, s, round, cx.size);
            const std::string tag = su.name + " " + sc.name() + " round " + std::to_string(round + 1);
            const int mine = run_round(cx, *cpu, *gpu, sc, tag);
            const int bad = failing_ranks(cx, mine);
            if (cx.rank == 0) std::printf("%-110s %s\n", tag.c_str(), bad ? "FAILED" : "ok");
            if (bad) failures += 1;
            if (bad) return failures;  // the remaining scenarios would only repeat the noise
        }
    std::fflush(stdout);
    cx.gpu_group->barrier();  // every rank is done with these buffers before any rank frees its part
    return failures;
}

// One process's inputs of the timeout cases: the shared generator, T tokens, int32 ids, weights.
RankData timeout_inputs(const BufferConfig& cfg, int64_t t, uint64_t seed) {
    Scenario s;
    s.cfg = cfg;
    s.num_ranks = 1;
    s.tokens = {t};
    s.seed = seed;
    return make_inputs(s)[0];
}

// ---- timeouts -------------------------------------------------------------------------------

// Whether `msg` names exactly rank 1 among the peers, once the waiting rank's own number is set aside.
bool names_only_rank_1(const std::string& msg, int me) {
    static const std::regex re(R"(\brank(?:s|\(s\))? ([0-9]+(?:, [0-9]+)*))");
    std::set<int> named;
    for (auto it = std::sregex_iterator(msg.begin(), msg.end(), re); it != std::sregex_iterator(); ++it) {
        std::stringstream ss((*it)[1].str());
        std::string num;
        while (std::getline(ss, num, ',')) named.insert(std::stoi(num));
    }
    named.erase(me);
    return named == std::set<int>{1};
}

// Expects `fn` to throw Error(kTimeout) whose message names `phase` and rank 1 (only).
int expect_timeout(const Ctx& cx, const char* what, const char* phase, bool check_names,
                   const std::function<void()>& fn) {
    try {
        fn();
    } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout) {
            std::fprintf(stderr, "rank %d: %s: expected a timeout error, got %s\n", cx.rank, what, e.what());
            return 1;
        }
        if (check_names && (e.message().find(phase) == std::string::npos || !names_only_rank_1(e.message(), cx.rank))) {
            std::fprintf(stderr, "rank %d: %s: the timeout error must name the phase '%s' and rank 1 (only): %s\n",
                         cx.rank, what, phase, e.what());
            return 1;
        }
        std::printf("rank %d: %s: got the expected timeout: %s\n", cx.rank, what, e.message().c_str());
        return 0;
    }
    std::fprintf(stderr, "rank %d: %s: returned normally although rank 1 never called it\n", cx.rank, what);
    return 1;
}

// Rank 1 skips a dispatch (phase 0) or a combine (phase 1) on a fresh buffer with a 1.5 s timeout;
// every other rank must fail with a timeout naming rank 1, and the buffer must stay unusable.
int run_timeout_case(const Ctx& cx, bool skip_combine) {
    BufferConfig cfg;
    cfg.num_experts = 4 * cx.size;
    cfg.num_topk = 2;
    cfg.hidden = 256;
    cfg.max_tokens_per_rank = 16;
    cfg.timeout = std::chrono::milliseconds(1500);
    cfg.device = cx.device;
    cuda_ok(cudaSetDevice(cx.device), "cudaSetDevice");
    const Device dev{DeviceType::kCUDA, cx.device};
    const RankData in = timeout_inputs(cfg, cfg.max_tokens_per_rank, seed_of(9, skip_combine, cx.rank, 3));
    std::vector<uint16_t> y(static_cast<size_t>(cx.size * cfg.max_tokens_per_rank * cfg.num_topk * cfg.hidden), 0x3f80);
    int failures = 0;
    {
        auto gpu = Buffer::create(cx.gpu_group, cfg, BackendKind::kCUDA);
        const DevMem dx(in.x), didx(in.idx32), dw(in.w), dy(y);
        cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize (uploads)");
        cx.gpu_group->barrier();
        DispatchArgs a;
        const int64_t t = in.in.num_tokens;
        a.x = TensorRef::contiguous(dx.get(), DType::kBFloat16, {t, cfg.hidden}, dev);
        a.topk_idx = TensorRef::contiguous(didx.get(), DType::kInt32, {t, cfg.num_topk}, dev);
        a.topk_weights = TensorRef::contiguous(dw.get(), DType::kFloat32, {t, cfg.num_topk}, dev);
        const char* phase = skip_combine ? "combine" : "dispatch";
        const std::string what = std::string("rank 1 skips ") + phase;
        if (!skip_combine) {
            if (cx.rank != 1)
                failures += expect_timeout(cx, what.c_str(), phase, true, [&] { (void)gpu->dispatch(a); });
        } else {
            DispatchResult r = gpu->dispatch(a);  // every rank takes part (own stream: synchronous)
            if (cx.rank != 1) {
                CombineArgs c;
                c.y = TensorRef::contiguous(dy.get(), DType::kBFloat16, r.recv_x.shape, dev);
                failures +=
                    expect_timeout(cx, what.c_str(), phase, true, [&] { (void)gpu->combine(std::move(r.handle), c); });
            }
        }
        if (cx.rank != 1) {
            // the buffer is unusable until rebuilt: the next call fails at once, without communicating
            const auto t0 = std::chrono::steady_clock::now();
            failures += expect_timeout(cx, (what + ", then dispatch again on the broken buffer").c_str(), phase, false,
                                       [&] { (void)gpu->dispatch(a); });
            if (std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(1000)) {
                std::fprintf(stderr, "rank %d: the broken buffer's dispatch waited instead of failing at once\n",
                             cx.rank);
                ++failures;
            }
        }
        cx.gpu_group->barrier();  // the waiting ranks' kernels have ended; rank 1 never launched any
    }
    cx.gpu_group->barrier();  // every rank dropped the broken buffer
    return failures;
}

int run(const Ctx& cx) {
    int failures = 0;
    const auto list = setups(cx.size);
    for (int i = 0; i < static_cast<int>(list.size()); ++i) {
        failures += run_setup(cx, i, list[static_cast<size_t>(i)]);
        if (failures) return failures;
    }
    if (cx.size < 2) {
        std::printf("rank 0: one process only: the timeout part needs 2 or more (run under mpirun -np 2)\n");
        return failures;
    }
    for (bool skip_combine : {false, true}) {
        const int mine = run_timeout_case(cx, skip_combine);
        const int bad = failing_ranks(cx, mine);
        if (cx.rank == 0)
            std::printf("timeout: rank 1 skips %-10s %s\n", skip_combine ? "combine" : "dispatch",
                        bad ? "FAILED" : "ok");
        if (bad) return failures + 1;
    }
    // the processes stay usable: fresh buffers, a normal round
    Setup su = list[1];
    su.name += " after timeouts";
    const int bad = run_setup(cx, 7, su);
    return failures + bad;
}

}  // namespace

int main() {
    // Ranks of one process sharing a GPU need a hardware queue per stream; harmless otherwise.
    ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    auto cpu_group = MpiGroup::world(kGroupTimeout);
    auto gpu_group = MpiGroup::world(kGroupTimeout);
    Ctx cx;
    cx.rank = gpu_group->rank();
    cx.size = gpu_group->size();
    cx.cpu_group = cpu_group;
    cx.gpu_group = gpu_group;

    // skip on every rank alike when any rank has no usable GPU or no CUDA backend
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
        std::printf("rank %d of %d: GPU %d of %d\n", cx.rank, cx.size, cx.device, gpus);
        std::fflush(stdout);
        cx.gpu_group->barrier();
        failures = run(cx);
        cx.gpu_group->barrier();
    } catch (const std::exception& e) {
        abort_job(cx.rank, e.what());
    }
    std::printf("rank %d: cuda backend across processes vs cpu backend: %s\n", cx.rank, failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
