// count_traffic / message_bytes (include/elasticep/traffic.hpp): a hand-checked case, then random
// routings against a direct count (a set of destination ranks per token) and against what a CPU
// dispatch actually delivers.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "elasticep/elasticep.hpp"

namespace {

using namespace elasticep;

BufferConfig config(int experts, int topk, int hidden, Payload payload = Payload::kBF16,
                    ScaleFormat f = ScaleFormat::kF32G128) {
    BufferConfig c;
    c.num_experts = experts;
    c.num_topk = topk;
    c.hidden = hidden;
    c.max_tokens_per_rank = 16;
    c.payload = payload;
    c.scale_format = f;
    return c;
}

TEST(Traffic, HandCheckedCase) {
    // R=2, E=4 (2 per rank), K=2, H=128 bf16. Rank 0's tokens: {0,1} both local; {2,-1} one peer;
    // {3,0} one peer + one local.
    const BufferConfig c = config(4, 2, 128);
    std::vector<int64_t> idx = {0, 1, 2, -1, 3, 0};
    const Traffic t = count_traffic(c, 2, 0, TensorRef::contiguous(idx.data(), DType::kInt64, {3, 2}));
    EXPECT_EQ(t.tokens, 3);
    EXPECT_EQ(t.routes, 5);
    EXPECT_EQ(t.local_messages, 2);
    EXPECT_EQ(t.peer_messages, 2);
    // payload 128*2 = 256, no scales, ids 2*4 -> 16, weights 2*4 -> 16, source 16
    EXPECT_EQ(t.message_bytes, 304);
    EXPECT_EQ(t.partial_bytes, 256);
    EXPECT_EQ(t.dispatch_peer_bytes(), 608);
    EXPECT_EQ(t.combine_local_bytes(), 512);
    // x 3*256 + 2 * 4 messages * 304 + 5 rows * 256
    EXPECT_EQ(t.dispatch_hbm_bytes, 768 + 2432 + 1280);
    // y 5 rows * 256 + 2 * 4 partials * 256 + out 3*256
    EXPECT_EQ(t.combine_hbm_bytes, 1280 + 2048 + 768);
    // rows written once: x 3*256 + 5 rows * 256; y 5 rows * 256 + out 3*256
    EXPECT_EQ(t.dispatch_min_hbm_bytes, 768 + 1280);
    EXPECT_EQ(t.combine_min_hbm_bytes, 1280 + 768);
    // fp8 with fp32 1x128 scales: a row is 128 B + one 4-byte scale; x is read as bf16 (3*256), or as
    // fp8 rows (3*132) when pre-quantized
    const BufferConfig c8 = config(4, 2, 128, Payload::kFP8);
    const TensorRef ids = TensorRef::contiguous(idx.data(), DType::kInt64, {3, 2});
    EXPECT_EQ(count_traffic(c8, 2, 0, ids).dispatch_min_hbm_bytes, 768 + 5 * 132);
    EXPECT_EQ(count_traffic(c8, 2, 0, ids, true).dispatch_min_hbm_bytes, 3 * 132 + 5 * 132);
    EXPECT_EQ(count_traffic(c8, 2, 0, ids).combine_min_hbm_bytes, 1280 + 768);
    // The same ids as rank 1: the local and peer roles swap.
    const Traffic t1 = count_traffic(c, 2, 1, TensorRef::contiguous(idx.data(), DType::kInt64, {3, 2}));
    EXPECT_EQ(t1.local_messages, 2);
    EXPECT_EQ(t1.peer_messages, 2);
}

TEST(Traffic, MessageBytesOfEveryScaleFormat) {
    // DeepSeek-V3: H=7168 fp8 + 56 fp32 scales (224 B), K=8 ids and weights (32 B each), source 16.
    EXPECT_EQ(message_bytes(config(256, 8, 7168, Payload::kFP8)), 7168 + 224 + 32 + 32 + 16);
    // ue8m0_g128: 56 exponent bytes packed into 14 int32 words = 56 B -> 64
    EXPECT_EQ(message_bytes(config(256, 8, 7168, Payload::kFP8, ScaleFormat::kUE8M0G128)), 7168 + 64 + 32 + 32 + 16);
    // ue8m0_g32 with H=96: 3 exponent bytes -> 1 word -> 16; payload 96; K=3 ids 12 -> 16
    EXPECT_EQ(message_bytes(config(6, 3, 96, Payload::kFP8, ScaleFormat::kUE8M0G32)), 96 + 16 + 16 + 16 + 16);
    EXPECT_EQ(message_bytes(config(4, 1, 8)), 16 + 16 + 16 + 16);
}

TEST(Traffic, RandomRoutingsAgainstADirectCount) {
    std::mt19937 rng(7);
    for (int trial = 0; trial < 40; ++trial) {
        const int ranks = 1 + trial % 5, e_local = 1 + trial % 3, experts = ranks * e_local;
        const int topk = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(experts, 8)));
        const int tokens = static_cast<int>(rng() % 20);
        const BufferConfig c = config(experts, topk, 64);
        for (int rank = 0; rank < ranks; ++rank) {
            std::vector<int32_t> idx(static_cast<size_t>(tokens) * static_cast<size_t>(topk));
            for (auto& v : idx) v = static_cast<int32_t>(rng() % static_cast<unsigned>(experts + 1)) - 1;
            int64_t routes = 0, peer = 0, local = 0;
            for (int t = 0; t < tokens; ++t) {
                std::set<int> dest;
                for (int j = 0; j < topk; ++j) {
                    const int x = idx[static_cast<size_t>(t * topk + j)];
                    if (x >= 0) ++routes, dest.insert(x / e_local);
                }
                local += dest.count(rank);
                peer += static_cast<int64_t>(dest.size() - dest.count(rank));
            }
            const Traffic tr =
                count_traffic(c, ranks, rank, TensorRef::contiguous(idx.data(), DType::kInt32, {tokens, topk}));
            EXPECT_EQ(tr.routes, routes) << "trial " << trial << " rank " << rank;
            EXPECT_EQ(tr.peer_messages, peer) << "trial " << trial << " rank " << rank;
            EXPECT_EQ(tr.local_messages, local) << "trial " << trial << " rank " << rank;
        }
    }
}

TEST(Traffic, StridedIdsAndSums) {
    const BufferConfig c = config(4, 2, 128);
    // a [3, 2] view with row stride 3 over a wider int64 array (the third column is ignored)
    std::vector<int64_t> wide = {0, 1, 99, 2, -1, 99, 3, 0, 99};
    TensorRef v = TensorRef::contiguous(wide.data(), DType::kInt64, {3, 2});
    v.strides = {3, 1};
    Traffic sum;
    sum += count_traffic(c, 2, 0, v);
    sum += count_traffic(c, 2, 1, v);
    EXPECT_EQ(sum.tokens, 6);
    EXPECT_EQ(sum.routes, 10);
    EXPECT_EQ(sum.messages(), 8);
    EXPECT_EQ(sum.message_bytes, 304);
    EXPECT_EQ(sum.dispatch_min_hbm_bytes, 6 * 256 + 10 * 256);
    EXPECT_EQ(sum.combine_min_hbm_bytes, 10 * 256 + 6 * 256);
    Traffic other;
    other += count_traffic(config(4, 2, 256), 2, 0, v);
    EXPECT_THROW(sum += other, Error);
}

TEST(Traffic, BadInputsAreNamed) {
    const BufferConfig c = config(4, 2, 128);
    std::vector<int64_t> idx = {0, 1, 4, 0};
    const TensorRef t = TensorRef::contiguous(idx.data(), DType::kInt64, {2, 2});
    try {
        count_traffic(c, 2, 0, t);
        FAIL() << "an id of 4 with 4 experts was accepted";
    } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
        EXPECT_NE(e.message().find("topk_idx[1, 0] = 4"), std::string::npos) << e.message();
    }
    idx[2] = 1;
    EXPECT_THROW(count_traffic(c, 2, 2, t), Error);                                                         // rank
    EXPECT_THROW(count_traffic(c, 3, 0, t), Error);                                                         // E % R
    EXPECT_THROW(count_traffic(c, 2, 0, TensorRef::contiguous(idx.data(), DType::kInt64, {1, 4})), Error);  // K
    EXPECT_THROW(count_traffic(c, 2, 0, TensorRef::contiguous(idx.data(), DType::kFloat32, {2, 2})), Error);
    EXPECT_THROW(
        count_traffic(c, 2, 0, TensorRef::contiguous(idx.data(), DType::kInt64, {2, 2}, Device{DeviceType::kCUDA, 0})),
        Error);
}

TEST(Traffic, RoutesEqualTheRowsADispatchDelivers) {
    // 3 ranks as threads, random routes with drops: the rows every rank receives (sum of counts)
    // equal the routes the accounting counts.
    const int ranks = 3, tokens = 9;
    const BufferConfig c = config(6, 3, 64);
    auto groups = ThreadGroup::create(ranks);
    std::vector<std::vector<int64_t>> idx(ranks);
    std::mt19937 rng(3);
    for (auto& v : idx) {
        v.resize(static_cast<size_t>(tokens) * 3);
        for (int t = 0; t < tokens; ++t) {
            std::vector<int64_t> e = {0, 1, 2, 3, 4, 5};
            std::shuffle(e.begin(), e.end(), rng);
            for (int j = 0; j < 3; ++j) v[static_cast<size_t>(t * 3 + j)] = rng() % 4 == 0 ? -1 : e[j];
        }
    }
    std::vector<int64_t> received(ranks, 0);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
        threads.emplace_back([&, r] {
            auto buf = Buffer::create(groups[r], c, BackendKind::kCPU);
            std::vector<uint16_t> x(static_cast<size_t>(tokens) * 64, 0x3f80);
            DispatchArgs a;
            a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {tokens, 64});
            a.topk_idx = TensorRef::contiguous(idx[r].data(), DType::kInt64, {tokens, 3});
            DispatchResult res = buf->dispatch(a);
            for (int l = 0; l < res.counts.numel(); ++l) received[r] += res.counts.data_as<int32_t>()[l];
        });
    for (auto& t : threads) t.join();
    Traffic total;
    for (int r = 0; r < ranks; ++r)
        total += count_traffic(c, ranks, r, TensorRef::contiguous(idx[r].data(), DType::kInt64, {tokens, 3}));
    EXPECT_EQ(total.routes, received[0] + received[1] + received[2]);
}

}  // namespace
