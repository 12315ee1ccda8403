// Backend selection by (backend, topology): topology=hybrid is validated and keyed but no backend
// implements it yet, so every rank gets Unsupported saying so, before anything is allocated, and no
// message steers users towards it. The rank limit names kMaxRanks (BufferConfig::validate and
// Buffer::create alike).
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

// A group that claims `size` ranks and counts the collectives anyone tries on it.
class ClaimedSizeGroup final : public Group {
 public:
    explicit ClaimedSizeGroup(int size) : size_(size) {}
    int rank() const override { return 0; }
    int size() const override { return size_; }
    void all_gather(const void*, size_t, void*) override {
        ++collectives;
        throw Error(ErrorCode::kInternal, "test: no collective expected");
    }
    void barrier() override {
        ++collectives;
        throw Error(ErrorCode::kInternal, "test: no collective expected");
    }
    std::string identity() const override { return "claimed-size"; }
    int collectives = 0;

 private:
    int size_;
};

// Buffer::create refuses a group above the limit before any collective (every rank of such a group
// does so alone, at once), with validate's code and the constant's name.
TEST(BackendSelection, CreateRefusesAGroupAboveKMaxRanksBeforeAnyCollective) {
    const BufferConfig cfg{.num_experts = 2 * kMaxRanks, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = 1};
    for (int size : {kMaxRanks + 1, 2 * kMaxRanks}) {
        auto g = std::make_shared<ClaimedSizeGroup>(size);
        EXPECT_TRUE(throws_error([&] { Buffer::create(g, cfg, BackendKind::kCPU); }, ErrorCode::kUnsupported,
                                 {"group has " + std::to_string(size) + " ranks", "kMaxRanks=1024"}));
        EXPECT_EQ(g->collectives, 0) << size;
    }
    auto empty = std::make_shared<ClaimedSizeGroup>(0);
    EXPECT_TRUE(throws_error([&] { Buffer::create(empty, cfg, BackendKind::kCPU); }, ErrorCode::kInvalidArgument,
                             {"size() is 0", "fix the Group implementation"}));
    EXPECT_EQ(empty->collectives, 0);
}

}  // namespace
}  // namespace eptest
