// CUDA backend against the oracle and the CPU backend: the same inputs on every rank, outputs compared
// with exact equality (real rows, counts, offsets, weights, src, m_indices, scales, shapes and strides,
// combine outputs). Ranks are threads; several ranks share one GPU, or one rank per GPU when two or
// more are present. Every scenario runs two rounds on the same buffers (epoch 2, the other parity,
// reused slots).
#include <algorithm>
#include <string>

#include "e4m3_selftest.hpp"
#include "elasticep/error.hpp"
#include "gpu_harness.hpp"
#include "kernels/common/device_scope.hpp"

namespace eptest {
namespace {

// A scenario of the GPU matrix: E experts, top-k, hidden and capacity; bf16 payload, contiguous host
// sync, weighted; inputs with NaNs, -1 slots and route-less tokens.
Scenario gpu_scenario(int ranks, int experts = 16, int topk = 4, int hidden = 256, int capacity = 6) {
    Scenario s;
    s.cfg.num_experts = experts;
    s.cfg.num_topk = topk;
    s.cfg.hidden = hidden;
    s.cfg.max_tokens_per_rank = capacity;
    s.cfg.timeout = std::chrono::milliseconds(20000);
    s.num_ranks = ranks;
    s.tokens.assign(static_cast<size_t>(ranks), capacity);
    s.p_none = 1.0 / 8;
    s.p_token_none = 1.0 / 16;
    s.p_nan = 1.0 / 64;
    return s;
}

// Token counts of the matrix: 0 none, 1 one, 2 C, 3 uneven across ranks.
std::vector<int64_t> token_pattern(int mode, int ranks, int capacity) {
    std::vector<int64_t> t;
    for (int r = 0; r < ranks; ++r)
        t.push_back(mode == 0 ? 0 : mode == 1 ? 1 : mode == 2 ? capacity : (r * 3 + 1) % (capacity + 1));
    return t;
}

// Two rounds on the same buffers (epoch 2, the other parity, reused slots): the second with every
// rank's token count moved one rank down, the other routing and another seed.
std::vector<Scenario> two_rounds(const Scenario& s, uint64_t seed) {
    Scenario first = s, second = s;
    first.seed = seed * 131;
    std::rotate(second.tokens.begin(), second.tokens.begin() + 1, second.tokens.end());
    second.routing = s.routing == Routing::kHotExpert ? Routing::kRandom : Routing::kHotExpert;
    second.seed = seed * 7;
    return {first, second};
}

void run_two_rounds(const Scenario& s, int gpus, uint64_t seed) {
    run_gpu_rounds(two_rounds(s, seed), gpus, "gpus=" + std::to_string(gpus) + " " + s.name());
}

std::vector<Scenario> matrix(int ranks) {
    struct P {
        Payload p;
        ScaleFormat f;
        bool pre;
    };
    const std::vector<P> payloads = {
        {Payload::kBF16, ScaleFormat::kF32G128, false},  {Payload::kFP8, ScaleFormat::kF32G128, false},
        {Payload::kFP8, ScaleFormat::kUE8M0G128, false}, {Payload::kFP8, ScaleFormat::kUE8M0G32, false},
        {Payload::kFP8, ScaleFormat::kF32G128, true},    {Payload::kFP8, ScaleFormat::kUE8M0G32, true}};
    std::vector<Scenario> out;
    int i = ranks;
    for (const P& p : payloads)
        for (int lay = 0; lay < 3; ++lay, ++i) {
            int hidden = (i % 3 == 2) ? 384 : 256;
            if (p.p == Payload::kBF16 && i % 2) hidden = 200;  // not a multiple of 16 channels' groups
            Scenario s = gpu_scenario(ranks, 16, 4, hidden, 6);
            s.cfg.payload = p.p;
            s.cfg.scale_format = p.f;
            s.prequantized = p.pre;
            s.opt.layout = lay == 2 ? Layout::kExpertMasked : Layout::kExpertContiguous;
            s.opt.host_sync = lay == 0;
            s.opt.expert_alignment = i % 2 ? 128 : 1;
            s.has_weights = i % 3 != 0;
            s.weighted = s.has_weights && i % 2 == 0;
            s.bias = i % 2 == 1;
            s.opt.zero_padding = i % 4 == 1;
            s.mn_major = p.p == Payload::kFP8 && i % 3 == 1;
            s.tokens = token_pattern(i % 4, ranks, 6);
            s.idx64 = i % 2 == 0;
            s.routing = i % 5 == 0 ? Routing::kHotExpert : Routing::kRandom;
            out.push_back(s);
        }
    return out;
}

void run_matrix(int ranks, int gpus) {
    uint64_t seed = 1000 + static_cast<uint64_t>(ranks) * 100 + static_cast<uint64_t>(gpus);
    for (const Scenario& s : matrix(ranks)) {
        run_two_rounds(s, gpus, seed++);
        if (::testing::Test::HasFailure()) {
            ADD_FAILURE() << "stopping the matrix after the failing scenario: " << s.name();
            return;
        }
    }
}

TEST(CudaBackendNumerics, HardwareE4M3EqualsReferenceForEveryFloat) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    uint32_t first = 0;
    const uint64_t bad = e4m3_mismatches(&first);
    EXPECT_EQ(bad, 0u) << "first differing fp32 pattern 0x" << std::hex << first;
}

TEST(CudaBackendMatrix, OneRank) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    run_matrix(1, 1);
}

TEST(CudaBackendMatrix, TwoRanksOneGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    run_matrix(2, 1);
}

TEST(CudaBackendMatrix, FourRanksOneGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    run_matrix(4, 1);
}

TEST(CudaBackendMatrix, EightRanksOneGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    run_matrix(8, 1);
}

TEST(CudaBackendMatrix, OneRankPerGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    if (gpu_count() < 2) GTEST_SKIP() << "needs 2 or more GPUs (found " << gpu_count() << ")";
    run_matrix(2, 2);
    if (!::testing::Test::HasFailure()) run_matrix(4, 2);  // two ranks per GPU on two GPUs
}

TEST(CudaBackendMatrix, LargeHiddenDeepSeekShape) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    Scenario s = gpu_scenario(4, 32, 8, 7168, 64);
    s.cfg.payload = Payload::kFP8;
    s.opt.expert_alignment = 128;
    s.bias = true;
    run_two_rounds(s, 1, 77);
    s.opt.layout = Layout::kExpertMasked;
    s.cfg.scale_format = ScaleFormat::kUE8M0G128;
    s.mn_major = true;
    run_two_rounds(s, 1, 78);
}

// Beyond the old 64-rank ceiling: 96 ranks on one GPU (host waits), small H and C, both layouts,
// exact against the oracle and the CPU backend.
TEST(CudaBackendMatrix, NinetySixRanksOneGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    Scenario s = gpu_scenario(96, 192, 4, 128, 2);
    s.tokens = token_pattern(3, 96, 2);
    s.cfg.payload = Payload::kFP8;
    s.cfg.scale_format = ScaleFormat::kUE8M0G32;
    run_two_rounds(s, 1, 96);
    if (::testing::Test::HasFailure()) return;
    s.cfg.payload = Payload::kBF16;
    s.cfg.hidden = 64;
    s.opt.layout = Layout::kExpertMasked;
    s.opt.host_sync = false;
    s.bias = true;
    s.idx64 = true;
    run_two_rounds(s, 1, 97);
}

// The device a buffer's calls make current for their duration (kernels/common/device_scope.hpp): the
// caller's current device, as the CUDA runtime reports it, is the same after the scope as before;
// a device that does not exist is a kCuda error that changes nothing; with two GPUs the scope
// switches and switches back.
TEST(CudaDeviceScope, GivesTheCallersDeviceBack) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    using elasticep::detail::cuda::DeviceScope;
    auto current = [] {
        int d = -1;
        EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
        return d;
    };
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    {
        const DeviceScope scope(0);
        EXPECT_EQ(current(), 0);
    }
    EXPECT_EQ(current(), 0);
    try {
        const DeviceScope scope(gpu_count());
        ADD_FAILURE() << "DeviceScope(" << gpu_count() << ") did not throw with " << gpu_count() << " GPUs";
    } catch (const elasticep::Error& e) {
        EXPECT_EQ(e.code(), elasticep::ErrorCode::kCuda) << e.what();
    }
    cudaGetLastError();
    EXPECT_EQ(current(), 0);
    if (gpu_count() < 2) GTEST_SKIP() << "the switch needs 2 or more GPUs (found " << gpu_count() << ")";
    {
        const DeviceScope scope(1);
        EXPECT_EQ(current(), 1);
    }
    EXPECT_EQ(current(), 0);
}

}  // namespace
}  // namespace eptest
