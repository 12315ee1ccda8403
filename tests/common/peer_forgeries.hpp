// Forged peer data for the CUDA backend's receipt checks (protocol.hpp, "Peer data"; issue 10 item 6),
// shared by the gpu suite (ranks as threads) and the MPI test (ranks as processes). Rank 1 rewrites,
// through the test hook of src/core/testing.hpp, what it announces to rank 0 after writing its
// messages: counts past the capacity or negative, per-expert counts above the message count, expert
// ids outside [-1, E), source tokens outside [0, C), route positions outside the sender's rows. Rank 0
// must record a sticky peer fault naming rank 1 (an elasticep::Error, Internal) and write nothing
// outside its outputs. No test framework here.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/scenario.hpp"
#include "core/testing.hpp"

namespace eptest {

namespace forge = elasticep::detail::testing;

// The config of the forged rounds: 2 ranks, rank 0 holds experts 0 and 1.
constexpr int kForgeCapacity = 8;

inline BufferConfig forge_config() {
    BufferConfig c{.num_experts = 4, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = kForgeCapacity};
    c.timeout = std::chrono::milliseconds(20000);
    return c;
}

// Rank 0: three tokens to both ranks; rank 1: four tokens, each to rank 0's experts 0 and 1 only, so
// rank 1 announces 4 messages to rank 0 with 4 routes to each of its experts.
inline std::vector<RankData> forge_inputs() {
    Scenario sc;
    sc.cfg = forge_config();
    sc.num_ranks = 2;
    sc.tokens = {3, 4};
    sc.seed = 606;
    std::vector<RankData> d = make_inputs(sc);
    const std::vector<std::vector<int64_t>> idx = {{0, 2, 3, 1, -1, 2}, {0, 1, 1, 0, 0, 1, 1, 0}};
    for (int r = 0; r < 2; ++r)
        for (size_t i = 0; i < idx[static_cast<size_t>(r)].size(); ++i)
            set_route(sc, d[static_cast<size_t>(r)], static_cast<int64_t>(i / 2), static_cast<int>(i % 2),
                      idx[static_cast<size_t>(r)][i]);
    return d;
}

// The scenario forge_inputs() belongs to (int32 ids, weights, contiguous, the given sync mode).
inline Scenario forge_scenario(bool host_sync) {
    Scenario sc;
    sc.cfg = forge_config();
    sc.num_ranks = 2;
    sc.tokens = {3, 4};
    sc.seed = 606;
    sc.opt.host_sync = host_sync;
    return sc;
}

struct PeerForgery {
    std::string what;
    std::function<void(forge::OutgoingDispatch&)> forge;  // applied to what rank 1 announces to rank 0
    std::string needle;  // what rank 0's error says after "received corrupt data from rank 1: "
    bool drops_sender;   // the whole sender is dropped (a bad count): rank 0 keeps exactly its own rows
};

inline int32_t& message_field(forge::OutgoingDispatch& o, int message, int32_t offset, int i = 0) {
    return reinterpret_cast<int32_t*>(o.slots + static_cast<size_t>(message) * o.layout.bytes + offset)[i];
}

inline std::vector<PeerForgery> peer_forgeries() {
    constexpr int k = 2;  // num_topk: route_pos rows are [C][K]
    return {
        {"count C+1", [](auto& o) { o.count = kForgeCapacity + 1; }, "a message count of 9 (max_tokens_per_rank is 8)",
         true},
        {"count 10^6", [](auto& o) { o.count = 1000000; }, "a message count of 1000000 (max_tokens_per_rank is 8)",
         true},
        {"count -1", [](auto& o) { o.count = -1; }, "a message count of -1 (max_tokens_per_rank is 8)", true},
        {"per-expert count above the message count", [](auto& o) { o.expert_counts[0] = 5; },
         "a per-expert route count of 5 where at most 4 fit its messages", true},
        {"negative per-expert count", [](auto& o) { o.expert_counts[1] = -1; },
         "a per-expert route count of -1 where at most 4 fit its messages", true},
        {"per-expert count 10^6", [](auto& o) { o.expert_counts[1] = 1000000; },
         "a per-expert route count of 1000000 where at most 4 fit its messages", true},
        {"expert id past E", [](auto& o) { message_field(o, 1, o.layout.idx_offset, 1) = 99; },
         "an expert id 99 outside [-1, 4)", false},
        {"expert id below -1", [](auto& o) { message_field(o, 2, o.layout.idx_offset, 0) = -7; },
         "an expert id -7 outside [-1, 4)", false},
        {"source token past C", [](auto& o) { message_field(o, 0, o.layout.src_offset) = kForgeCapacity; },
         "a source token 8 outside [0, 8)", false},
        {"negative source token", [](auto& o) { message_field(o, 3, o.layout.src_offset) = -1; },
         "a source token -1 outside [0, 8)", false},
        {"route position past the sender's rows", [k](auto& o) { o.route_pos[1 * k + 0] = 1000; },
         "a row position 1000 outside its expert's 4 rows", false},
        {"negative route position", [k](auto& o) { o.route_pos[2 * k + 1] = -5; },
         "a row position -5 outside its expert's 4 rows", false},
    };
}

// The oracle's inputs for rank 0's view when rank 1 was dropped as a whole: rank 1 routes nowhere.
inline std::vector<ref::RankInput> forge_inputs_without_rank1(const std::vector<RankData>& data) {
    std::vector<ref::RankInput> in = {data[0].in, data[1].in};
    for (int64_t& v : in[1].topk_idx) v = -1;
    return in;
}

}  // namespace eptest
