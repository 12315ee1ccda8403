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

}  // namespace
}  // namespace eptest
