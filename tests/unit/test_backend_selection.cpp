// Backend selection by (backend, topology, scaleout): the CPU backend runs topology=hybrid with its
// emulated scale-out only, so an explicit gin or nccl is refused with Unsupported on every rank (never a
// silent fallback), before anything is allocated. The rank limit names kMaxRanks (BufferConfig::validate
// and Buffer::create alike).
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

TEST(BackendSelection, CpuHybridRefusesNetworkScaleOutsOnEveryRank) {
    for (ScaleOut so : {ScaleOut::kGin, ScaleOut::kNccl}) {
        BufferConfig cfg = small_config();
        cfg.topology = Topology::kHybrid;
        cfg.ranks_per_node = 1;
        cfg.scaleout = so;
        ASSERT_NO_THROW(cfg.validate(2));  // a valid config: the refusal is the CPU backend's
        auto groups = ThreadGroup::create(2, std::chrono::seconds(20));
        const auto errors =
            run_ranks(2, [&](int r) { Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU); });
        for (const auto& e : errors)
            EXPECT_TRUE(is_error(e, ErrorCode::kUnsupported,
                                 {std::string("scaleout=") + scaleout_name(so), "CUDA backend", "scaleout=emulated"}))
                << describe(e);
        // the same groups build the emulated hybrid buffer afterwards, and it works
        std::vector<std::shared_ptr<Buffer>> bufs;
        Scenario sc;
        sc.cfg = small_config();
        sc.cfg.topology = Topology::kHybrid;
        sc.cfg.ranks_per_node = 1;
        sc.cfg.scaleout = ScaleOut::kEmulated;
        sc.num_ranks = 2;
        sc.tokens = {3, 4};
        run_round(sc, groups, bufs, "emulated hybrid after the refusal");
    }
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
