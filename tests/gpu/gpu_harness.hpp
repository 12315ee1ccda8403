// The gpu suite's harness: the shared test layer (tests/common) plus GPU detection, device memory
// (CudaMemory for the rank runner, DevBuf for tests that drive the calls themselves), and rounds of
// ranks as threads on the CUDA backend checked against the oracle and against the CPU backend run on
// the same inputs.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/checks.hpp"
#include "common/cuda_memory.hpp"
#include "common/rank_round.hpp"
#include "common/ranks.hpp"
#include "common/scenario.hpp"
#include "elasticep/elasticep.hpp"

namespace eptest {

// Several ranks share one GPU here: give every stream its own hardware queue (before CUDA starts),
// so no rank's launch queues behind a peer's waiting kernel (see src/backends/cuda/cuda_backend.cu).
inline const bool kConnectionsSet = ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0;

inline int gpu_count() {
    if (!Buffer::backend_available(BackendKind::kCUDA)) return 0;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

#define ELASTICEP_SKIP_WITHOUT_GPU()                                                                         \
    do {                                                                                                     \
        if (::eptest::gpu_count() == 0)                                                                      \
            GTEST_SKIP() << "no usable CUDA GPU (or the CUDA backend is not compiled in): the CUDA backend " \
                            "tests need one";                                                                \
    } while (0)

struct DevBuf {
    void* ptr = nullptr;
    size_t bytes = 0;
    DevBuf() = default;
    explicit DevBuf(size_t n) : bytes(n) {
        if (cudaMalloc(&ptr, std::max<size_t>(n, 16)) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    }
    DevBuf(const DevBuf&) = delete;
    DevBuf& operator=(const DevBuf&) = delete;
    DevBuf(DevBuf&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = nullptr; }
    ~DevBuf() {
        if (ptr) cudaFree(ptr);
    }
    template <class T>
    static DevBuf upload(const std::vector<T>& v) {
        DevBuf b(v.size() * sizeof(T));
        if (!v.empty()) cudaMemcpy(b.ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
        cudaStreamSynchronize(cudaStreamLegacy);  // the DMA has landed (the calls' streams are non-blocking)
        return b;
    }
};

template <class T>
std::vector<T> download(const void* p, size_t count) {
    std::vector<T> v(count);
    if (count) {
        const cudaError_t e = cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) throw std::runtime_error(std::string("download: ") + cudaGetErrorString(e));
    }
    return v;
}

// One round per scenario on a CPU buffer and a CUDA buffer of every rank (rank r on GPU r % gpus),
// both checked against the oracle and the CUDA outcome against the CPU outcome.
struct BackendPair {
    std::shared_ptr<Buffer> cpu, gpu;
};

inline void expect_rounds_equal(const std::vector<Scenario>& rounds, const std::vector<std::vector<RankData>>& data,
                                const std::vector<std::vector<RankOutcome>>& cpu,
                                const std::vector<std::vector<RankOutcome>>& gpu, const std::string& tag) {
    for (size_t i = 0; i < rounds.size(); ++i) {
        const Scenario& sc = rounds[i];
        const ExpectedRound want = expected_round(sc, data[i]);
        for (int r = 0; r < sc.num_ranks; ++r) {
            const size_t ri = static_cast<size_t>(r);
            const std::string ctx = tag + " round " + std::to_string(i + 1) + " rank " + std::to_string(r);
            expect_outcome(sc, cpu[i][ri], want.dispatch[ri], want.combine[ri], ctx + " cpu");
            expect_outcome(sc, gpu[i][ri], want.dispatch[ri], want.combine[ri], ctx + " cuda");
            for (const std::string& m :
                 backend_mismatches(cpu[i][ri].got, gpu[i][ri].got, want.dispatch[ri], sc.cfg, sc.opt.zero_padding))
                ADD_FAILURE() << ctx << " cuda vs cpu: " << m;
            const std::string c = combine_mismatch(gpu[i][ri].out, cpu[i][ri].out, sc.cfg.hidden);
            if (!c.empty()) ADD_FAILURE() << ctx << " cuda vs cpu: " << c;
            EXPECT_GT(gpu[i][ri].handle_num_sms, 0) << ctx;
        }
    }
}

// Runs `rounds` (the same config and rank count; options may differ) on one CPU and one CUDA buffer
// per rank, in order, and checks every round (expect_rounds_equal).
inline void run_gpu_rounds(const std::vector<Scenario>& rounds, int gpus, const std::string& tag) {
    const Scenario& first = rounds.front();
    const int ranks = first.num_ranks;
    std::vector<std::vector<RankData>> data;
    for (const Scenario& sc : rounds) data.push_back(make_inputs(sc));
    std::vector<std::vector<RankOutcome>> cpu(rounds.size(), std::vector<RankOutcome>(static_cast<size_t>(ranks)));
    std::vector<std::vector<RankOutcome>> gpu = cpu;
    auto cpu_groups = ThreadGroup::create(ranks);
    auto gpu_groups = ThreadGroup::create(ranks);
    const auto errors = run_ranks(ranks, [&](int r) {
        const size_t ri = static_cast<size_t>(r);
        BufferConfig gc = first.cfg;
        gc.device = r % gpus;
        cuda_ok(cudaSetDevice(gc.device), "cudaSetDevice");
        auto cpu_buf = Buffer::create(cpu_groups[ri], first.cfg, BackendKind::kCPU);
        auto gpu_buf = Buffer::create(gpu_groups[ri], gc, BackendKind::kCUDA);
        Group& g = *gpu_groups[ri];
        const RoundHooks hooks{[&] { g.barrier(); }, [&] { g.barrier(); }};
        // device memory of every round lives until every rank is done: with several ranks on one GPU,
        // a cudaFree can wait for the device while a peer's kernel waits for this rank
        std::vector<std::unique_ptr<CudaMemory>> keep;
        for (size_t i = 0; i < rounds.size(); ++i) {
            HostMemory host;
            cpu[i][ri] = run_rank_round(rounds[i], r, *cpu_buf, data[i][ri], host);
            keep.push_back(std::make_unique<CudaMemory>(gc.device));
            gpu[i][ri] = run_rank_round(rounds[i], r, *gpu_buf, data[i][ri], *keep.back(), hooks);
            gpu_buf->check();  // surfaces a device timeout or a peer fault, if any
        }
        g.barrier();  // every rank done before any cudaFree
    });
    if (!all_ok(errors, tag)) return;
    expect_rounds_equal(rounds, data, cpu, gpu, tag);
}

}  // namespace eptest
