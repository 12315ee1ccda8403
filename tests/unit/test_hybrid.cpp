// Topology on the CPU backend (docs/SEMANTICS.md, "Combine" and "Topology"): with ranks_per_node
// P < R combine reduces per node first, in direct and hybrid alike, and hybrid (emulated network hop
// plus forwarding) gives the same bytes as direct. First a hand-checkable case where the node-level
// rounding changes the result against the flat order, then hybrid == direct == the oracle over a
// scenario matrix for 2x4, 4x2, 8x1 and 16x4 (nodes x ranks per node), the edge cases (a whole node
// with T = 0, all routes into one node), consecutive rounds, injected network delay and reordering,
// bad routes, forged rail data and a missing node.
#include <cstdlib>
#include <tuple>

#include "core/testing.hpp"
#include "harness.hpp"

namespace eptest {
namespace {

namespace tst = elasticep::detail::testing;

// ---------------------------------------------------------------------------------------------
// Hand case: R = 4 ranks, E = 4 (one expert per rank), one token on rank 0 routed to experts 0, 2, 1
// (ranks 0, 2, 1: nodes 0, 1, 0 with P = 2), unweighted; each holder's y row is one value:
// rank 0: 1, rank 1: 2^-8, rank 2: 2^-8. Partials are those values exactly (bf16).
//   flat (P = R):    acc = ((0 + 1) + 2^-8) + 2^-8 = 1 + 2^-7 (exact in fp32)   -> bf16 0x3f81
//   nodes (P = 2):   node 0 = bf16(1 + 2^-8)  = 1 (tie, to even) ; node 1 = 2^-8
//                    acc = (0 + 1) + 2^-8 = 1 + 2^-8                            -> bf16 0x3f80 (tie, to even)
constexpr uint16_t kOne = 0x3f80, kEighth = 0x3b80;  // 1.0 and 2^-8 in bf16

// One token on rank 0 with routes `idx` (K = 3, -1 allowed), holder r's y rows all `y_of[r]`, an
// optional bias row of `bias`; returns rank 0's combine output row.
std::vector<uint16_t> hand_combine(Topology topology, int ranks_per_node, std::vector<int32_t> idx,
                                   std::vector<uint16_t> y_of, uint16_t bias = 0, bool with_bias = false) {
    const int ranks = 4, h = 8;
    BufferConfig cfg{.num_experts = 4, .num_topk = 3, .hidden = h, .max_tokens_per_rank = 1};
    cfg.topology = topology;
    cfg.ranks_per_node = ranks_per_node;
    auto groups = ThreadGroup::create(ranks, std::chrono::seconds(20));
    std::vector<uint16_t> out0;
    const auto errors = run_ranks(ranks, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        std::vector<uint16_t> x(h, kOne), b(h, bias);
        DispatchArgs a;
        const int64_t t = r == 0 ? 1 : 0;
        a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {t, h});
        a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {t, 3});
        a.layout = Layout::kExpertMasked;
        DispatchResult res = buf->dispatch(a);
        const int64_t rows = res.recv_x.size(0) * res.recv_x.size(1);
        std::vector<uint16_t> y(static_cast<size_t>(rows * h), y_of[static_cast<size_t>(r)]);
        CombineArgs c;
        c.y = TensorRef::contiguous(y.data(), DType::kBFloat16, res.recv_x.shape);
        c.weighted = false;
        if (with_bias) c.bias = TensorRef::contiguous(b.data(), DType::kBFloat16, {t, h});
        const CombineResult cr = buf->combine(std::move(res.handle), c);
        if (r == 0) out0 = read_2d<uint16_t>(cr.out, 1, h);
    });
    EXPECT_TRUE(all_ok(errors, "hand case"));
    return out0;
}

std::vector<uint16_t> hand_combine(Topology topology, int ranks_per_node) {
    return hand_combine(topology, ranks_per_node, {0, 2, 1}, {kOne, kEighth, kEighth, 0});
}

TEST(Hybrid, HandCaseNodeRoundingChangesTheResult) {
    const std::vector<uint16_t> flat(8, 0x3f81), nodes(8, 0x3f80);
    EXPECT_EQ(hand_combine(Topology::kDirect, 0), flat);
    EXPECT_EQ(hand_combine(Topology::kDirect, 4), flat);  // P = R: one node, the flat order
    EXPECT_EQ(hand_combine(Topology::kDirect, 2), nodes);
    EXPECT_EQ(hand_combine(Topology::kHybrid, 2), nodes);
    EXPECT_EQ(hand_combine(Topology::kHybrid, 4), flat);
    // P = 1: every rank its own node; node partials are the rank partials: the flat sum again
    EXPECT_EQ(hand_combine(Topology::kDirect, 1), flat);
    EXPECT_EQ(hand_combine(Topology::kHybrid, 1), flat);
}

// Nodes are reduced in the order of their first rank in the token's list, not ascending: routes to
// rank 2 (node 1) then rank 0 (node 0), bias 1, y: rank 2 -1, rank 0 2^-30.
//   node order [1, 0]:  (1 + -1) + 2^-30 = 2^-30 -> 0x3080;  ascending [0, 1]: (1 + 2^-30) + -1 = 0.
TEST(Hybrid, HandCaseNodesInFirstRankOrder) {
    const std::vector<uint16_t> want(8, 0x3080);
    for (Topology t : {Topology::kDirect, Topology::kHybrid})
        EXPECT_EQ(hand_combine(t, 2, {2, 0, -1}, {0x3080, 0, 0xbf80, 0}, kOne, true), want) << topology_name(t);
}

// The oracle agrees with the hand computation (it is the reference every other test uses).
TEST(Hybrid, OracleFollowsRanksPerNode) {
    BufferConfig cfg{.num_experts = 4, .num_topk = 3, .hidden = 8, .max_tokens_per_rank = 1};
    std::vector<ref::RankInput> in(4);
    in[0].num_tokens = 1;
    in[0].x.assign(8, kOne);
    in[0].topk_idx = {0, 2, 1};
    ref::DispatchOptions opt;
    opt.layout = Layout::kExpertMasked;
    const auto expected = ref::dispatch(cfg, 4, in, opt);
    std::vector<std::vector<uint16_t>> y;
    for (int r = 0; r < 4; ++r)
        y.emplace_back(static_cast<size_t>(expected[static_cast<size_t>(r)].rows) * 8, r == 0   ? kOne
                                                                                       : r <= 2 ? kEighth
                                                                                                : 0);
    EXPECT_EQ(ref::combine(cfg, 4, in, opt, y, false, {})[0], std::vector<uint16_t>(8, 0x3f81));
    cfg.ranks_per_node = 2;
    EXPECT_EQ(ref::combine(cfg, 4, in, opt, y, false, {})[0], std::vector<uint16_t>(8, 0x3f80));
}

// ---------------------------------------------------------------------------------------------
// Hybrid == direct == oracle

struct Outcomes {
    std::vector<RankOutcome> rank;
    bool ok = false;
};

Outcomes run_cpu(const Scenario& sc, const std::vector<RankData>& data, const std::string& ctx) {
    Outcomes o;
    o.rank.resize(static_cast<size_t>(sc.num_ranks));
    auto groups = ThreadGroup::create(sc.num_ranks, std::chrono::seconds(120));
    const auto errors = run_ranks(sc.num_ranks, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], sc.cfg, BackendKind::kCPU);
        HostMemory mem;
        o.rank[static_cast<size_t>(r)] = run_rank_round(sc, r, *buf, data[static_cast<size_t>(r)], mem);
    });
    o.ok = all_ok(errors, ctx);
    return o;
}

// Runs `sc` as hybrid and as direct (same ranks_per_node) on the same inputs; both must equal the
// oracle and each other.
void expect_hybrid_equals_direct(Scenario sc, const std::vector<RankData>& data) {
    sc.cfg.topology = Topology::kDirect;
    sc.cfg.scaleout = ScaleOut::kAuto;
    const std::string dname = sc.name();
    const Outcomes direct = run_cpu(sc, data, dname);
    sc.cfg.topology = Topology::kHybrid;
    const std::string hname = sc.name();
    const Outcomes hybrid = run_cpu(sc, data, hname);
    if (!direct.ok || !hybrid.ok) return;
    const ExpectedRound want = expected_round(sc, data);
    for (int r = 0; r < sc.num_ranks; ++r) {
        const size_t ri = static_cast<size_t>(r);
        const std::string ctx = " rank " + std::to_string(r);
        expect_outcome(sc, direct.rank[ri], want.dispatch[ri], want.combine[ri], dname + ctx);
        expect_outcome(sc, hybrid.rank[ri], want.dispatch[ri], want.combine[ri], hname + ctx);
        for (const std::string& m : backend_mismatches(direct.rank[ri].got, hybrid.rank[ri].got, want.dispatch[ri],
                                                       sc.cfg, sc.opt.zero_padding))
            ADD_FAILURE() << hname << ctx << " hybrid vs direct: " << m;
        const std::string c = combine_mismatch(hybrid.rank[ri].out, direct.rank[ri].out, sc.cfg.hidden);
        if (!c.empty()) ADD_FAILURE() << hname << ctx << " hybrid vs direct: " << c;
    }
}

Scenario shape(int nodes, int per_node, int e_local, int k, int h, int c) {
    Scenario s;
    s.num_ranks = nodes * per_node;
    s.cfg.num_experts = s.num_ranks * e_local;
    s.cfg.num_topk = k;
    s.cfg.hidden = h;
    s.cfg.max_tokens_per_rank = c;
    s.cfg.ranks_per_node = per_node;
    s.cfg.topology = Topology::kHybrid;
    s.cfg.timeout = std::chrono::seconds(60);
    s.tokens.assign(static_cast<size_t>(s.num_ranks), c);
    return s;
}

// A few scenarios per shape, drawn from a fixed seed: layouts, sync modes, payloads, options.
std::vector<Scenario> shape_cases(int nodes, int per_node, int count, uint64_t seed) {
    Rng rng(seed);
    std::vector<Scenario> v;
    for (int i = 0; i < count; ++i) {
        const int r = nodes * per_node;
        const int k = rng.pick(std::vector<int>{1, 2, 8});
        int e_local = rng.uniform(1, 3);
        while (r * e_local < k) ++e_local;
        const int c = r >= 32 ? rng.uniform(1, 3) : rng.uniform(1, 6);
        Scenario s = shape(nodes, per_node, e_local, k, rng.pick(std::vector<int>{128, 256}), c);
        for (auto& t : s.tokens) t = rng.uniform(0, c);
        s.p_none = rng.pick(std::vector<double>{0.0, 0.2});
        s.p_token_none = rng.chance(0.3) ? 0.2 : 0.0;
        if (rng.chance(0.5)) {
            s.cfg.payload = Payload::kFP8;
            s.cfg.scale_format = rng.pick(
                std::vector<ScaleFormat>{ScaleFormat::kF32G128, ScaleFormat::kUE8M0G128, ScaleFormat::kUE8M0G32});
            s.prequantized = rng.chance(0.3);
            s.mn_major = rng.chance(0.3);
        }
        s.opt.layout = rng.chance(0.5) ? Layout::kExpertContiguous : Layout::kExpertMasked;
        s.opt.expert_alignment = rng.chance(0.5) ? 1 : 4;
        s.opt.host_sync = rng.chance(0.5);
        if (!s.opt.host_sync && rng.chance(0.2)) s.routing = Routing::kInvalid;
        if (rng.chance(0.15)) s.routing = Routing::kHotExpert;
        s.opt.zero_padding = rng.chance(0.5);
        s.has_weights = rng.chance(0.8);
        s.weighted = s.has_weights && rng.chance(0.8);
        s.bias = rng.chance(0.5);
        s.idx64 = rng.chance(0.3);
        s.caller_outputs = rng.chance(0.3);
        s.strided = rng.chance(0.3);
        s.seed = seed * 1000 + static_cast<uint64_t>(i);
        v.push_back(s);
    }
    return v;
}

struct ShapeCase {
    Scenario s;
    std::string name;
};
void PrintTo(const ShapeCase& c, std::ostream* os) { *os << c.name; }

std::vector<ShapeCase> matrix_cases() {
    std::vector<ShapeCase> out;
    const struct { int nodes, per_node, count; } shapes[] = {{2, 4, 12}, {4, 2, 12}, {8, 1, 10}, {16, 4, 3}};
    for (const auto& sh : shapes) {
        int i = 0;
        for (const Scenario& s :
             shape_cases(sh.nodes, sh.per_node, sh.count, static_cast<uint64_t>(sh.nodes * 100 + sh.per_node)))
            out.push_back({s, std::to_string(sh.nodes) + "x" + std::to_string(sh.per_node) + "_" + std::to_string(i++) +
                                  "_" + s.name()});
    }
    return out;
}

class HybridMatrix : public testing::TestWithParam<ShapeCase> {};

TEST_P(HybridMatrix, EqualsDirectAndOracle) {
    const Scenario& s = GetParam().s;
    expect_hybrid_equals_direct(s, make_inputs(s));
}

INSTANTIATE_TEST_SUITE_P(Cpu, HybridMatrix, testing::ValuesIn(matrix_cases()),
                         [](const testing::TestParamInfo<ShapeCase>& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// Edge cases

TEST(Hybrid, WholeNodeWithoutTokens) {
    for (Layout l : {Layout::kExpertContiguous, Layout::kExpertMasked})
        for (bool sync : {true, false}) {
            Scenario s = shape(2, 4, 2, 4, 128, 3);
            s.tokens = {3, 1, 0, 2, 0, 0, 0, 0};  // node 1 sends nothing (and still receives)
            s.opt.layout = l;
            s.opt.host_sync = sync;
            s.bias = true;
            s.seed = 71;
            expect_hybrid_equals_direct(s, make_inputs(s));
            s.tokens = {0, 0, 0, 0, 0, 0, 0, 0};  // nobody sends
            expect_hybrid_equals_direct(s, make_inputs(s));
        }
}

// Every route of every token into node `target` (K distinct experts among that node's).
std::vector<RankData> routes_into_node(const Scenario& s, int target) {
    std::vector<RankData> data = make_inputs(s);
    const int p = s.cfg.ranks_per_node, e_local = s.cfg.num_experts / s.num_ranks, k_count = s.cfg.num_topk;
    const int first = target * p * e_local, span = p * e_local;
    Rng rng(s.seed + 5);
    for (RankData& d : data) {
        for (int64_t t = 0; t < d.in.num_tokens; ++t) {
            std::vector<int64_t> pool(static_cast<size_t>(span));
            for (int i = 0; i < span; ++i) pool[static_cast<size_t>(i)] = first + i;
            for (int k = 0; k < k_count; ++k) {
                std::swap(pool[static_cast<size_t>(k)], pool[static_cast<size_t>(rng.uniform(k, span - 1))]);
                d.in.topk_idx[static_cast<size_t>(t * k_count + k)] = pool[static_cast<size_t>(k)];
            }
        }
        fill_storage(s, d);
    }
    return data;
}

TEST(Hybrid, AllRoutesIntoOneNode) {
    for (int target : {0, 3}) {
        Scenario s = shape(4, 2, 2, 3, 128, 4);
        s.opt.layout = target == 0 ? Layout::kExpertContiguous : Layout::kExpertMasked;
        s.bias = true;
        s.seed = 80 + static_cast<uint64_t>(target);
        expect_hybrid_equals_direct(s, routes_into_node(s, target));
    }
}

// ---------------------------------------------------------------------------------------------
// Consecutive rounds on the same buffers (both flag parities, slot reuse on every hop), with the
// emulated network delayed and reordered.

class ScopedEnv {
 public:
    ScopedEnv(const char* name, const char* value) : name_(name) {
        if (const char* old = std::getenv(name)) old_ = old;
        ::setenv(name, value, 1);
    }
    ~ScopedEnv() {
        if (old_.empty())
            ::unsetenv(name_);
        else
            ::setenv(name_, old_.c_str(), 1);
    }

 private:
    const char* name_;
    std::string old_;
};

void rounds_on_one_buffer(const std::string& tag) {
    std::vector<std::shared_ptr<Group>> groups;
    std::vector<std::shared_ptr<Buffer>> buffers;
    Scenario s = shape(2, 2, 2, 4, 256, 5);
    for (int round = 0; round < 4; ++round) {
        s.seed = 90 + static_cast<uint64_t>(round);
        s.opt.layout = round % 2 ? Layout::kExpertMasked : Layout::kExpertContiguous;
        s.opt.host_sync = round != 2;
        s.bias = round == 3;
        for (int r = 0; r < s.num_ranks; ++r) s.tokens[static_cast<size_t>(r)] = (r + round) % 6;
        run_round(s, groups, buffers, tag + " round " + std::to_string(round));
    }
}

TEST(Hybrid, ConsecutiveRounds) { rounds_on_one_buffer("hybrid 2x2"); }

TEST(Hybrid, DelayedAndReorderedNetwork) {
    ScopedEnv delay("ELASTICEP_EMULATED_DELAY_US", "300");
    ScopedEnv reorder("ELASTICEP_EMULATED_REORDER", "1");
    rounds_on_one_buffer("hybrid 2x2 delayed+reordered");
    Scenario s = shape(4, 2, 1, 2, 128, 3);
    s.seed = 99;
    expect_hybrid_equals_direct(s, make_inputs(s));
}

TEST(Hybrid, MalformedEmulationKnobsAreRefused) {
    for (const auto& [name, value] :
         std::vector<std::pair<const char*, const char*>>{{"ELASTICEP_EMULATED_DELAY_US", "abc"},
                                                          {"ELASTICEP_EMULATED_DELAY_US", "-5"},
                                                          {"ELASTICEP_EMULATED_REORDER", "yes"}}) {
        ScopedEnv env(name, value);
        Scenario s = shape(2, 1, 1, 1, 128, 1);
        auto groups = ThreadGroup::create(2, std::chrono::seconds(20));
        const auto errors =
            run_ranks(2, [&](int r) { Buffer::create(groups[static_cast<size_t>(r)], s.cfg, BackendKind::kCPU); });
        for (const auto& e : errors)
            EXPECT_TRUE(is_error(e, ErrorCode::kInvalidArgument, {name, value})) << describe(e);
    }
}

// ---------------------------------------------------------------------------------------------
// Bad routes, forged network data, a missing node

TEST(Hybrid, HostSyncBadRouteFailsEveryRankAlike) {
    Scenario s = shape(2, 2, 2, 2, 128, 4);
    s.seed = 123;
    std::vector<RankData> data = make_inputs(s);
    data[3].in.topk_idx[1] = 99;  // rank 3 (node 1), token 0, k = 1
    fill_storage(s, data[3]);
    auto groups = ThreadGroup::create(4, std::chrono::seconds(20));
    std::vector<std::shared_ptr<Buffer>> bufs(4);
    const auto errors = run_ranks(4, [&](int r) {
        bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], s.cfg, BackendKind::kCPU);
        bufs[static_cast<size_t>(r)]->dispatch(make_args(s, data[static_cast<size_t>(r)]));
    });
    for (const auto& e : errors)
        EXPECT_TRUE(is_error(e, ErrorCode::kInvalidArgument, {"rank 3, token 0, k=1", "value 99"})) << describe(e);
    // the buffers go on: the next round (valid data) equals the oracle on every rank
    data[3] = make_inputs(s)[3];
    std::vector<std::shared_ptr<Group>> g(groups.begin(), groups.end());
    run_round_with(s, data, g, bufs, "after the rejected call");
}

TEST(Hybrid, ForgedRailCountIsNamedNotFollowed) {
    Scenario s = shape(2, 1, 1, 1, 128, 2);
    s.seed = 7;
    const auto data = make_inputs(s);
    auto groups = ThreadGroup::create(2, std::chrono::seconds(20));
    const auto errors = run_ranks(2, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], s.cfg, BackendKind::kCPU);
        if (r == 1)
            tst::set_dispatch_forger(*buf, [](tst::OutgoingDispatch& o) {
                if (o.receiver == 0) o.count = 1000;
            });
        buf->dispatch(make_args(s, data[static_cast<size_t>(r)]));
    });
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kInternal,
                         {"rank 0 (forwarding for node 0)", "from rank 1 over the network", "announced 1000 messages"}))
        << describe(errors[0]);
    EXPECT_FALSE(errors[1]) << describe(errors[1]);
}

TEST(Hybrid, MissingNodeIsATimeoutNamingIt) {
    Scenario s = shape(2, 2, 1, 2, 128, 2);
    s.cfg.timeout = std::chrono::milliseconds(300);
    s.seed = 8;
    const auto data = make_inputs(s);
    auto groups = ThreadGroup::create(4, std::chrono::seconds(20));
    std::vector<std::shared_ptr<Buffer>> bufs(4);
    const auto errors = run_ranks(4, [&](int r) {
        bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], s.cfg, BackendKind::kCPU);
        if (r < 2) bufs[static_cast<size_t>(r)]->dispatch(make_args(s, data[static_cast<size_t>(r)]));  // node 1 skips
    });
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kTimeout,
                         {"dispatch (network hop): rank 0 (node 0) waited 300 ms for rank(s) 2 (node 1)"}))
        << describe(errors[0]);
    EXPECT_TRUE(is_error(errors[1], ErrorCode::kTimeout, {"rank 1 (node 0)", "rank(s) 3 (node 1)", "network hop"}))
        << describe(errors[1]);
    EXPECT_FALSE(errors[2]);
    EXPECT_FALSE(errors[3]);
}

TEST(Hybrid, ConfigNamesTheScaleOut) {
    Scenario s = shape(2, 2, 1, 2, 128, 2);
    s.cfg.scaleout = ScaleOut::kEmulated;
    EXPECT_NE(s.cfg.describe().find("topology=hybrid ranks_per_node=2 scaleout=emulated"), std::string::npos)
        << s.cfg.describe();
    BufferConfig other = s.cfg;
    other.scaleout = ScaleOut::kAuto;
    EXPECT_NE(s.cfg.group_key(), other.group_key());
    for (ScaleOut so : {ScaleOut::kAuto, ScaleOut::kGin, ScaleOut::kNccl, ScaleOut::kEmulated})
        EXPECT_EQ(parse_scaleout(scaleout_name(so)), so);
    EXPECT_TRUE(throws_error([] { parse_scaleout("rdma"); }, ErrorCode::kInvalidArgument,
                             {"unknown scaleout 'rdma'", "auto, gin, nccl, emulated"}));
    // the network hop a buffer uses: the CPU backend's emulated one with several nodes, none otherwise
    for (const auto& [topology, rpn, want] : std::vector<std::tuple<Topology, int, std::string>>{
             {Topology::kHybrid, 2, "emulated"}, {Topology::kHybrid, 4, "none"}, {Topology::kDirect, 2, "none"}}) {
        BufferConfig c = s.cfg;
        c.topology = topology;
        c.ranks_per_node = rpn;
        c.scaleout = ScaleOut::kAuto;
        auto g = ThreadGroup::create(4, std::chrono::seconds(20));
        std::vector<std::string> used(4), path(4);
        all_ok(run_ranks(4, [&](int r) {
            auto b = Buffer::create(g[static_cast<size_t>(r)], c, BackendKind::kCPU);
            used[static_cast<size_t>(r)] = b->scaleout();
            path[static_cast<size_t>(r)] = b->kernel_path();
        }));
        EXPECT_EQ(used, std::vector<std::string>(4, want)) << topology_name(topology) << " P=" << rpn;
        EXPECT_EQ(path, std::vector<std::string>(4, "reference")) << "the CPU backend's kernel path";
    }
    // every rank must agree on it: a differing scaleout is named by Buffer::create
    auto groups = ThreadGroup::create(4, std::chrono::seconds(20));
    const auto errors = run_ranks(4, [&](int r) {
        BufferConfig c = s.cfg;
        if (r == 2) c.scaleout = ScaleOut::kAuto;
        Buffer::create(groups[static_cast<size_t>(r)], c, BackendKind::kCPU);
    });
    for (const auto& e : errors) EXPECT_TRUE(is_error(e, ErrorCode::kInvalidArgument, {"scaleout"})) << describe(e);
}

}  // namespace
}  // namespace eptest
