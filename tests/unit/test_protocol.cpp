// The shared protocol description (src/core/protocol.hpp) on its own: the route-status state
// machine, the missing-peer scan and the texts every backend raises.
#include "core/protocol.hpp"
#include "harness.hpp"

namespace eptest {
namespace {

using detail::decide_route_status;
using detail::RouteStatus;

RouteStatus route(int32_t kind, int32_t token, int32_t k, int64_t value) {
    return RouteStatus{kind, token, k, -1, value, 0, 0};
}

TEST(Protocol, RouteStatusStateMachine) {
    const RouteStatus none{}, sticky = route(detail::kRouteOutOfRange, 3, 1, 99),
                              bad = route(detail::kRouteRepeated, 0, 2, 5);
    // host sync: a sticky fault is published (marked sticky) and cleared, before this call's own
    auto d = decide_route_status(true, sticky, bad);
    EXPECT_EQ(d.publish.kind, detail::kRouteOutOfRange);
    EXPECT_EQ(d.publish.token, 3);
    EXPECT_EQ(d.publish.sticky, 1);
    EXPECT_TRUE(d.clear_sticky);
    EXPECT_FALSE(d.record_sticky);
    // host sync, nothing sticky: this call's first bad route
    d = decide_route_status(true, none, bad);
    EXPECT_EQ(d.publish.kind, detail::kRouteRepeated);
    EXPECT_EQ(d.publish.sticky, 0);
    EXPECT_FALSE(d.clear_sticky);
    EXPECT_FALSE(d.record_sticky);
    d = decide_route_status(true, none, none);
    EXPECT_FALSE(d.publish.any());
    // graph mode: nothing is published; the first bad route becomes sticky unless one is already
    d = decide_route_status(false, none, bad);
    EXPECT_FALSE(d.publish.any());
    EXPECT_TRUE(d.record_sticky);
    d = decide_route_status(false, sticky, bad);
    EXPECT_FALSE(d.publish.any());
    EXPECT_FALSE(d.record_sticky);
    EXPECT_FALSE(d.clear_sticky);
}

TEST(Protocol, MissingPeersAndTheTimeoutText) {
    std::vector<uint64_t> seen(40, 7);
    for (int q : {3, 5, 6}) seen[static_cast<size_t>(q)] = 6;
    auto m = detail::scan_missing([&](int q) { return seen[static_cast<size_t>(q)]; }, 40, 7);
    EXPECT_EQ(m.count, 3);
    EXPECT_EQ(m.observed, 6u);
    EXPECT_EQ(detail::timeout_message(detail::kPhaseCombine, 1, 250, m, 7),
              "combine: rank 1 waited 250 ms for rank(s) 3, 5, 6 (expected call #7, last seen #6); a peer did not "
              "call combine or is stuck. This buffer is unusable now: rebuild it");
    for (int q = 10; q < 40; ++q) seen[static_cast<size_t>(q)] = 2;  // 33 missing: 16 named, 17 counted
    m = detail::scan_missing([&](int q) { return seen[static_cast<size_t>(q)]; }, 40, 7);
    EXPECT_EQ(m.count, 33);
    EXPECT_EQ(m.observed, 2u);
    const std::string text = detail::timeout_message(detail::kPhaseDispatch, 0, 100, m, 7);
    EXPECT_NE(text.find("rank(s) 3, 5, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22 and 17 more"),
              std::string::npos)
        << text;
}

TEST(Protocol, PeerFaultTextsNameTheSenderTheValueAndTheBound) {
    const struct {
        int32_t kind;
        std::string needle;
    } cases[] = {
        {detail::kPeerCount, "a message count of 9 (max_tokens_per_rank is 8)"},
        {detail::kPeerExpertCount, "a per-expert route count of 9 where at most 8 fit its messages"},
        {detail::kPeerPosition, "a row position 9 outside its expert's 8 rows"},
        {detail::kPeerExpertId, "an expert id 9 outside [-1, 8)"},
        {detail::kPeerToken, "a source token 9 outside [0, 8)"},
    };
    for (const auto& c : cases) {
        const detail::PeerFault f{c.kind, 3, detail::kPhaseDispatch, 0, 9, 8};
        const std::string text = detail::peer_fault_message(f, 1);
        EXPECT_NE(text.find("dispatch: rank 1 received corrupt data from rank 3: " + c.needle), std::string::npos)
            << text;
        EXPECT_NE(text.find("rebuild it"), std::string::npos) << text;
    }
}

TEST(Protocol, ReservationArithmetic) {
    BufferConfig c{.num_experts = 16, .num_topk = 4, .hidden = 256, .max_tokens_per_rank = 6};
    const detail::Reservation r = detail::reservation(c, 4);
    const int64_t msg = 256 * 2 + 16 + 16 + 16;  // bf16 payload, ids, weights, source token (16-byte fields)
    EXPECT_EQ(detail::message_layout(c).bytes, msg);
    EXPECT_EQ(r.dispatch_slots, 4 * 6 * msg);
    EXPECT_EQ(r.combine_slots, 4 * 6 * 256 * 2);
    EXPECT_EQ(r.combine_out, 6 * 256 * 2);
    EXPECT_EQ(Buffer::reservation_bytes(c, 4, BackendKind::kCPU),
              static_cast<size_t>(r.dispatch_slots + r.combine_slots + r.combine_out));
}

}  // namespace
}  // namespace eptest
