// CUDA backend against the oracle and the CPU backend: the same inputs on every rank, outputs compared
// with exact equality (real rows, counts, offsets, weights, src, m_indices, scales, shapes and strides,
// combine outputs). Ranks are threads; several ranks share one GPU, or one rank per GPU when two or
// more are present. Every scenario runs two rounds on the same buffers (epoch 2, the other parity,
// reused slots).
#include <sstream>

#include "e4m3_selftest.hpp"
#include "gpu_harness.hpp"

namespace eptest {
namespace {

// The matrix's knobs of one scenario; `tmode` picks the token counts: 0 none, 1 one, 2 C, 3 uneven.
struct Knobs {
    int ranks = 2;
    Payload payload = Payload::kBF16;
    ScaleFormat format = ScaleFormat::kF32G128;
    bool prequant = false;
    Layout layout = Layout::kExpertContiguous;
    bool host_sync = true;
    int alignment = 1;
    bool weights = true, weighted = true, bias = false, zero_padding = false, mn_major = false;
    int tmode = 2;
    bool idx64 = false, hot = false;
    int hidden = 256, experts = 16, topk = 4, capacity = 6;
};

int64_t tokens_of(const Knobs& k, int r) {
    switch (k.tmode) {
        case 0:
            return 0;
        case 1:
            return 1;
        case 2:
            return k.capacity;
        default:
            return (r * 3 + 1) % (k.capacity + 1);
    }
}

// Round 1 of the knobs, and round 2: other token counts (rank r takes rank r + 1's), the other
// routing, another seed.
std::vector<Scenario> rounds_of(const Knobs& k, uint64_t seed) {
    Scenario s;
    s.cfg.num_experts = k.experts;
    s.cfg.num_topk = k.topk;
    s.cfg.hidden = k.hidden;
    s.cfg.max_tokens_per_rank = k.capacity;
    s.cfg.payload = k.payload;
    s.cfg.scale_format = k.format;
    s.cfg.timeout = std::chrono::milliseconds(20000);
    s.num_ranks = k.ranks;
    for (int r = 0; r < k.ranks; ++r) s.tokens.push_back(tokens_of(k, r));
    s.routing = k.hot ? Routing::kHotExpert : Routing::kRandom;
    s.p_none = 1.0 / 8;
    s.p_token_none = 1.0 / 16;
    s.p_nan = 1.0 / 64;
    s.opt.layout = k.layout;
    s.opt.expert_alignment = k.alignment;
    s.opt.host_sync = k.host_sync;
    s.opt.zero_padding = k.zero_padding;
    s.mn_major = k.mn_major;
    s.prequantized = k.prequant;
    s.has_weights = k.weights;
    s.weighted = k.weighted;
    s.bias = k.bias;
    s.idx64 = k.idx64;
    s.seed = seed * 131;
    Scenario s2 = s;
    for (int r = 0; r < k.ranks; ++r) s2.tokens[static_cast<size_t>(r)] = tokens_of(k, r + 1);
    s2.routing = k.hot ? Routing::kRandom : Routing::kHotExpert;
    s2.seed = seed * 7;
    return {s, s2};
}

std::string describe_knobs(const Knobs& k, int gpus) {
    std::ostringstream os;
    os << "R=" << k.ranks << " gpus=" << gpus << " " << payload_name(k.payload);
    if (k.payload == Payload::kFP8)
        os << "/" << scale_format_name(k.format) << (k.prequant ? "/prequant" : "/quantize");
    os << " " << layout_name(k.layout) << (k.host_sync ? " host_sync" : " graph") << " A=" << k.alignment
       << " w=" << k.weights << " weighted=" << k.weighted << " bias=" << k.bias << " zpad=" << k.zero_padding
       << " mn=" << k.mn_major << " tmode=" << k.tmode << " idx64=" << k.idx64 << " hot=" << k.hot << " H=" << k.hidden
       << " E=" << k.experts << " K=" << k.topk << " C=" << k.capacity;
    return os.str();
}

void run_knobs(const Knobs& k, int gpus, uint64_t seed) {
    run_gpu_rounds(rounds_of(k, seed), gpus, describe_knobs(k, gpus));
}

std::vector<Knobs> matrix(int ranks) {
    struct P {
        Payload p;
        ScaleFormat f;
        bool pre;
    };
    const std::vector<P> payloads = {
        {Payload::kBF16, ScaleFormat::kF32G128, false},  {Payload::kFP8, ScaleFormat::kF32G128, false},
        {Payload::kFP8, ScaleFormat::kUE8M0G128, false}, {Payload::kFP8, ScaleFormat::kUE8M0G32, false},
        {Payload::kFP8, ScaleFormat::kF32G128, true},    {Payload::kFP8, ScaleFormat::kUE8M0G32, true}};
    std::vector<Knobs> out;
    int i = ranks;
    for (const P& p : payloads)
        for (int lay = 0; lay < 3; ++lay, ++i) {
            Knobs s;
            s.ranks = ranks;
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
    for (const Knobs& k : matrix(ranks)) {
        run_knobs(k, gpus, seed++);
        if (::testing::Test::HasFailure()) {
            ADD_FAILURE() << "stopping the matrix after the failing scenario: " << describe_knobs(k, gpus);
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
    Knobs s;
    s.ranks = 4;
    s.payload = Payload::kFP8;
    s.hidden = 7168;
    s.experts = 32;
    s.topk = 8;
    s.capacity = 64;
    s.alignment = 128;
    s.bias = true;
    run_knobs(s, 1, 77);
    s.layout = Layout::kExpertMasked;
    s.format = ScaleFormat::kUE8M0G128;
    s.mn_major = true;
    run_knobs(s, 1, 78);
}

// Beyond the old 64-rank ceiling: 96 ranks on one GPU (host waits), small H and C, both layouts,
// exact against the oracle and the CPU backend.
TEST(CudaBackendMatrix, NinetySixRanksOneGpu) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    Knobs k;
    k.ranks = 96;
    k.experts = 192;
    k.topk = 4;
    k.hidden = 64;
    k.capacity = 2;
    k.tmode = 3;
    k.payload = Payload::kFP8;
    k.format = ScaleFormat::kUE8M0G32;
    k.hidden = 128;
    run_knobs(k, 1, 96);
    if (::testing::Test::HasFailure()) return;
    k.payload = Payload::kBF16;
    k.hidden = 64;
    k.layout = Layout::kExpertMasked;
    k.host_sync = false;
    k.bias = true;
    k.idx64 = true;
    run_knobs(k, 1, 97);
}

}  // namespace
}  // namespace eptest
