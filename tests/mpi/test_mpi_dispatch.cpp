// Run under mpirun (3 processes; any count works): the CPU backend with ranks as processes (arena in
// a shared file mapping), dispatch + combine compared byte for byte with the oracle, for bf16 and fp8
// payloads, uneven token counts and a rank with no tokens; with one node per process, in direct and
// hybrid topology. Inputs, the rank runner and the
// comparisons are the shared test layer (tests/common): every process draws every rank's inputs from
// the scenario's seed and runs the oracle over all of them.
#include <cstdio>
#include <string>
#include <vector>

#include "common/rank_round.hpp"
#include "elasticep/elasticep.hpp"

using namespace eptest;

namespace {

int run_case(const std::shared_ptr<Group>& group, Payload payload, const std::vector<int64_t>& pattern, uint64_t seed,
             Topology topology = Topology::kDirect, int ranks_per_node = 0) {
    const int r = group->rank(), n = group->size();
    Scenario sc;
    sc.cfg.num_experts = 3 * n;
    sc.cfg.num_topk = 3;
    sc.cfg.hidden = 256;
    sc.cfg.max_tokens_per_rank = 6;
    sc.cfg.payload = payload;
    sc.cfg.timeout = std::chrono::seconds(20);
    sc.cfg.topology = topology;
    sc.cfg.ranks_per_node = ranks_per_node;
    sc.num_ranks = n;
    for (int s = 0; s < n; ++s) sc.tokens.push_back(pattern[static_cast<size_t>(s) % pattern.size()]);
    sc.seed = seed;
    const std::vector<RankData> data = make_inputs(sc);
    auto buf = Buffer::create(group, sc.cfg, BackendKind::kCPU);
    HostMemory mem;
    const RankOutcome got = run_rank_round(sc, r, *buf, data[static_cast<size_t>(r)], mem);
    const ExpectedRound want = expected_round(sc, data);
    const auto bad =
        outcome_mismatches(sc, got, want.dispatch[static_cast<size_t>(r)], want.combine[static_cast<size_t>(r)]);
    for (const std::string& m : bad)
        std::fprintf(stderr, "rank %d (%s): mismatch: %s\n", r, sc.name().c_str(), m.c_str());
    return bad.empty() ? 0 : 1;
}

}  // namespace

int main() {
    auto g = MpiGroup::world(std::chrono::seconds(30));
    int rc = 0;
    rc |= run_case(g, Payload::kBF16, {5, 0, 6}, 1);
    rc |= run_case(g, Payload::kFP8, {6, 3, 1}, 2);
    // every process its own node: the hierarchical combine order (direct), and hybrid's emulated
    // network hop between processes
    rc |= run_case(g, Payload::kBF16, {4, 6, 0}, 3, Topology::kDirect, 1);
    rc |= run_case(g, Payload::kFP8, {6, 2, 5}, 4, Topology::kHybrid, 1);
    std::printf("rank %d: cpu backend across processes %s\n", g->rank(), rc ? "FAILED" : "ok");
    return rc;
}
