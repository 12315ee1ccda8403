// Groups far beyond the old 64-rank ceiling on the CPU backend (ranks as threads): rank sets and
// per-peer tables are sized from the config, so 256 ranks run exact against the oracle, in both
// layouts. Small H and C keep it a few seconds on two cores.
#include "harness.hpp"

namespace eptest {
namespace {

Scenario many_ranks(int ranks, Layout layout, bool host_sync, uint64_t seed) {
    Scenario s;
    s.num_ranks = ranks;
    s.cfg.num_experts = 2 * ranks;
    s.cfg.num_topk = 4;
    s.cfg.hidden = 32;
    s.cfg.max_tokens_per_rank = 2;
    s.cfg.timeout = std::chrono::seconds(120);
    for (int r = 0; r < ranks; ++r) s.tokens.push_back(r % 3);  // 0, 1, 2 tokens: empty ranks too
    s.opt.layout = layout;
    s.opt.host_sync = host_sync;
    s.opt.expert_alignment = layout == Layout::kExpertContiguous ? 4 : 1;
    s.bias = true;
    s.seed = seed;
    return s;
}

TEST(ManyRanks, TwoHundredFiftySixRanksContiguousHostSync) {
    Scenario s = many_ranks(256, Layout::kExpertContiguous, true, 256);
    std::vector<std::shared_ptr<Group>> groups = ThreadGroup::create(256, std::chrono::seconds(120));
    std::vector<std::shared_ptr<Buffer>> buffers;
    run_round(s, groups, buffers, "R256 contiguous host_sync");
    // a second round on the same buffers: the other parity of every flag
    s.seed = 257;
    s.tokens.assign(256, 2);
    run_round(s, groups, buffers, "R256 contiguous host_sync round 2");
}

TEST(ManyRanks, TwoHundredFiftySixRanksMaskedGraphModeFp8) {
    Scenario s = many_ranks(256, Layout::kExpertMasked, false, 258);
    s.cfg.payload = Payload::kFP8;
    s.cfg.scale_format = ScaleFormat::kUE8M0G32;
    std::vector<std::shared_ptr<Group>> groups = ThreadGroup::create(256, std::chrono::seconds(120));
    std::vector<std::shared_ptr<Buffer>> buffers;
    run_round(s, groups, buffers, "R256 masked graph fp8");
}

// A timeout names the first kMaxNamedPeers missing peers and counts the rest (the scan covers every
// peer's flag, whatever the group size).
TEST(ManyRanks, TimeoutNamesTheFirstMissingPeersAndCountsTheRest) {
    const int ranks = 40;
    Scenario s = many_ranks(ranks, Layout::kExpertContiguous, true, 259);
    s.cfg.timeout = std::chrono::milliseconds(300);
    const auto data = make_inputs(s);
    auto groups = ThreadGroup::create(ranks, std::chrono::seconds(60));
    std::vector<std::shared_ptr<Buffer>> bufs(static_cast<size_t>(ranks));
    const auto errors = run_ranks(ranks, [&](int r) {
        bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], s.cfg, BackendKind::kCPU);
        if (r < 2) bufs[static_cast<size_t>(r)]->dispatch(make_args(s, data[static_cast<size_t>(r)]));  // the rest skip
    });
    std::string named;
    for (int q = 2; q < 2 + 16; ++q) named += (q > 2 ? ", " : "") + std::to_string(q);
    for (int r = 0; r < 2; ++r)
        EXPECT_TRUE(
            is_error(errors[static_cast<size_t>(r)], ErrorCode::kTimeout,
                     {"dispatch: rank " + std::to_string(r), "rank(s) " + named + " and 22 more (expected call #1"}));
    for (int r = 2; r < ranks; ++r)
        EXPECT_FALSE(errors[static_cast<size_t>(r)]) << describe(errors[static_cast<size_t>(r)]);
}

}  // namespace
}  // namespace eptest
