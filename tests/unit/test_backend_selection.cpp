// Backend selection by (backend, topology): topology=hybrid is validated and keyed but no backend
// implements it yet, so every rank gets Unsupported saying so, before anything is allocated, and no
// message steers users towards it. The rank limit names kMaxRanks.
#include "core/limits.hpp"
#include "harness.hpp"

namespace eptest {
namespace {

BufferConfig small_config() {
    BufferConfig c;
    c.num_experts = 8;
    c.num_topk = 2;
    c.hidden = 128;
    c.max_tokens_per_rank = 4;
    return c;
}

bool recommends_hybrid(const std::exception_ptr& e) {
    return describe(e).find("use topology=hybrid") != std::string::npos;
}

TEST(BackendSelection, HybridTopologyIsRejectedOnEveryRank) {
    BufferConfig cfg = small_config();
    cfg.topology = Topology::kHybrid;
    cfg.ranks_per_node = 1;
    ASSERT_NO_THROW(cfg.validate(2));  // a valid config: the refusal is the backend table's
    auto groups = ThreadGroup::create(2, std::chrono::seconds(20));
    const auto errors =
        run_ranks(2, [&](int r) { Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU); });
    for (const auto& e : errors) {
        EXPECT_TRUE(is_error(e, ErrorCode::kUnsupported, {"topology=hybrid", "not implemented", "topology=direct"}));
        EXPECT_FALSE(recommends_hybrid(e));
    }
    EXPECT_TRUE(throws_error([&] { Buffer::reservation_bytes(cfg, 2, BackendKind::kCPU); }, ErrorCode::kUnsupported,
                             {"topology=hybrid", "not implemented"}));
    // the same groups build a direct buffer afterwards, and it works
    std::vector<std::shared_ptr<Buffer>> bufs;
    Scenario sc;
    sc.cfg = small_config();
    sc.num_ranks = 2;
    sc.tokens = {3, 4};
    run_round(sc, groups, bufs, "direct after the hybrid refusal");
}

TEST(BackendSelection, RankLimitNamesKMaxRanks) {
    const BufferConfig cfg{.num_experts = 2 * kMaxRanks, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = 1};
    EXPECT_NO_THROW(cfg.validate(kMaxRanks));
    const auto e = [&] {
        try {
            cfg.validate(2 * kMaxRanks);
        } catch (...) {
            return std::current_exception();
        }
        return std::exception_ptr{};
    }();
    EXPECT_TRUE(is_error(e, ErrorCode::kUnsupported, {std::to_string(2 * kMaxRanks), "kMaxRanks=1024"}));
    EXPECT_EQ(describe(e).find("hybrid"), std::string::npos) << describe(e);
}

}  // namespace
}  // namespace eptest
