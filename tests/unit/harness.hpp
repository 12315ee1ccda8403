// The unit suite's harness: the shared test layer (tests/common: one Scenario, one input generator,
// one rank runner, the comparisons) plus rounds of ranks as threads on the CPU backend, checked
// against the oracle. Public names (Scenario, make_inputs, make_args, run_ranks, all_ok, is_error,
// throws_error, run_round, run_round_with, run_scenario, observe, expect_dispatch_equal, ...) are the
// ones every test file uses; they live in namespace eptest.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/checks.hpp"
#include "common/rank_round.hpp"
#include "common/ranks.hpp"
#include "common/scenario.hpp"
#include "elasticep/elasticep.hpp"
#include "reference/oracle.hpp"

namespace eptest {

// Runs one round of `data` on `buffers` (created collectively on `groups` when empty), checks it
// against the oracle and returns the oracle's expected dispatch outputs.
inline std::vector<ref::RankDispatch> run_round_with(const Scenario& sc, const std::vector<RankData>& data,
                                                     std::vector<std::shared_ptr<Group>>& groups,
                                                     std::vector<std::shared_ptr<Buffer>>& buffers,
                                                     const std::string& ctx_in = "") {
    const std::string ctx = ctx_in.empty() ? sc.name() : ctx_in;
    const int r_count = sc.num_ranks;
    if (groups.empty()) groups = ThreadGroup::create(r_count);
    if (buffers.empty()) buffers.resize(static_cast<size_t>(r_count));
    std::vector<RankOutcome> outcome(static_cast<size_t>(r_count));
    const auto errors = run_ranks(r_count, [&](int r) {
        auto& buf = buffers[static_cast<size_t>(r)];
        if (!buf) buf = Buffer::create(groups[static_cast<size_t>(r)], sc.cfg, BackendKind::kCPU);
        HostMemory mem;
        outcome[static_cast<size_t>(r)] = run_rank_round(sc, r, *buf, data[static_cast<size_t>(r)], mem);
    });
    const ExpectedRound want = expected_round(sc, data);
    if (!all_ok(errors, ctx)) return want.dispatch;
    for (int r = 0; r < r_count; ++r)
        expect_outcome(sc, outcome[static_cast<size_t>(r)], want.dispatch[static_cast<size_t>(r)],
                       want.combine[static_cast<size_t>(r)], ctx + " rank " + std::to_string(r));
    return want.dispatch;
}

inline std::vector<ref::RankDispatch> run_round(const Scenario& sc, std::vector<std::shared_ptr<Group>>& groups,
                                                std::vector<std::shared_ptr<Buffer>>& buffers,
                                                const std::string& ctx = "") {
    return run_round_with(sc, make_inputs(sc), groups, buffers, ctx);
}

inline void run_scenario(const Scenario& sc) {
    std::vector<std::shared_ptr<Group>> groups;
    std::vector<std::shared_ptr<Buffer>> buffers;
    run_round(sc, groups, buffers);
}

}  // namespace eptest
