// Generated scenarios compared with exact equality against the oracle: a fixed list of edge cases
// plus a sample (fixed seed) of the cross product of ranks, tokens, top-k, hidden sizes,
// alignment, layouts, sync modes, payloads, scale formats, options and nodes (ranks_per_node, direct
// topology; hybrid has its own matrix in test_hybrid.cpp).
#include "harness.hpp"

namespace eptest {
namespace {

Scenario fp8(Scenario s, ScaleFormat f, bool prequantized = false) {
    s.cfg.payload = Payload::kFP8;
    s.cfg.scale_format = f;
    s.prequantized = prequantized;
    return s;
}

std::vector<Scenario> edge_cases() {
    std::vector<Scenario> v;
    uint64_t seed = 1000;
    auto add = [&](Scenario s) {
        s.seed = seed++;
        v.push_back(s);
    };
    // every rank empty, contiguous and masked, host sync and graph mode
    for (Layout l : {Layout::kExpertContiguous, Layout::kExpertMasked})
        for (bool sync : {true, false}) {
            Scenario s = base_scenario(3, 6, 2, 128, 4);
            s.tokens = {0, 0, 0};
            s.opt.layout = l;
            s.opt.host_sync = sync;
            s.opt.zero_padding = true;
            add(s);
        }
    // all routes -1: every token combines to bf16(bias or 0)
    for (bool with_bias : {false, true}) {
        Scenario s = base_scenario(2, 4, 2, 128, 3);
        s.routing = Routing::kNone;
        s.bias = with_bias;
        s.opt.expert_alignment = 128;
        add(s);
    }
    // one hot expert at full capacity, aligned, graph mode, caller outputs
    {
        Scenario s = base_scenario(4, 8, 2, 384, 5);
        s.routing = Routing::kHotExpert;
        s.opt.expert_alignment = 128;
        s.opt.host_sync = false;
        s.opt.zero_padding = true;
        s.caller_outputs = true;
        add(s);
    }
    // R=1 and R=8 with uneven T (one rank empty)
    {
        Scenario s = base_scenario(1, 3, 2, 128, 6);
        s.tokens = {5};
        add(s);
        Scenario m = base_scenario(8, 16, 8, 128, 4);
        m.tokens = {0, 4, 1, 3, 4, 2, 0, 1};
        m.opt.layout = Layout::kExpertMasked;
        add(m);
        Scenario g = m;
        g.opt.layout = Layout::kExpertContiguous;
        g.opt.expert_alignment = 128;
        g.opt.host_sync = false;
        g.idx64 = true;
        add(g);
    }
    // combine stress: K = 8 routes over 2 ranks (several routes per partial), weighted, bias
    for (bool masked : {false, true}) {
        Scenario s = base_scenario(2, 16, 8, 256, 16);
        s.p_none = 0.0;
        s.bias = true;
        s.opt.layout = masked ? Layout::kExpertMasked : Layout::kExpertContiguous;
        add(s);
    }
    // K larger than E_local (a token sends one message per rank carrying several routes)
    {
        Scenario s = base_scenario(2, 4, 2, 128, 5);
        s.p_none = 0.0;
        s.routing = Routing::kRandom;
        s.weighted = false;
        add(s);
    }
    // H = 7168 (DeepSeek), few small-T cases: bf16, each scale format quantized in dispatch, and
    // pre-quantized input moved as is
    {
        Scenario s = base_scenario(2, 8, 8, 7168, 2);
        s.tokens = {2, 1};
        add(s);
        add(fp8(s, ScaleFormat::kF32G128));
        Scenario u = fp8(s, ScaleFormat::kUE8M0G128);
        u.mn_major = true;
        u.opt.layout = Layout::kExpertMasked;
        add(u);
        Scenario x = fp8(s, ScaleFormat::kUE8M0G32);
        x.tokens = {1, 2};
        x.opt.expert_alignment = 128;
        x.opt.host_sync = false;
        x.caller_outputs = true;
        x.mn_major = true;
        add(x);
        Scenario p = fp8(s, ScaleFormat::kUE8M0G32, true);
        p.tokens = {1, 0};
        add(p);
    }
    // every FP8 format x layout x MN-major x pre-quantized, small
    for (ScaleFormat f : {ScaleFormat::kF32G128, ScaleFormat::kUE8M0G128, ScaleFormat::kUE8M0G32})
        for (Layout l : {Layout::kExpertContiguous, Layout::kExpertMasked})
            for (bool mn : {false, true})
                for (bool pre : {false, true}) {
                    Scenario s = fp8(base_scenario(3, 6, 2, 384, 3), f, pre);
                    s.tokens = {3, 1, 2};
                    s.opt.layout = l;
                    s.mn_major = mn;
                    s.opt.zero_padding = mn;
                    s.caller_outputs = pre;
                    s.strided = !pre;
                    add(s);
                }
    // graph mode with invalid routes: dropped, outputs equal the oracle's
    for (Layout l : {Layout::kExpertContiguous, Layout::kExpertMasked})
        for (bool i64 : {false, true}) {
            Scenario s = base_scenario(3, 9, 3, 128, 6);
            s.routing = Routing::kInvalid;
            s.opt.layout = l;
            s.opt.host_sync = false;
            s.idx64 = i64;
            add(s);
        }
    return v;
}

std::vector<Scenario> sampled_cases(int count) {
    Rng rng(20240611);
    std::vector<Scenario> v;
    for (int i = 0; i < count; ++i) {
        const int r = rng.pick(std::vector<int>{1, 2, 3, 4, 8});
        const int k = rng.pick(std::vector<int>{1, 2, 8});
        int e_local = rng.uniform(1, 4);
        while (r * e_local < k) ++e_local;
        const bool big = rng.chance(0.06) && r <= 2;
        const int h = big ? 7168 : rng.pick(std::vector<int>{128, 384, 384, 128, 256});
        const int c = big ? rng.uniform(1, 2) : rng.uniform(1, r >= 8 ? 8 : 16);
        Scenario s = base_scenario(r, r * e_local, k, h, c);
        for (auto& t : s.tokens) {
            const int kind = rng.uniform(0, 3);
            t = kind == 0 ? 0 : kind == 1 ? 1 : kind == 2 ? c : rng.uniform(0, c);
        }
        const int route = rng.uniform(0, 19);
        s.routing = route < 15 ? Routing::kRandom : route < 18 ? Routing::kHotExpert : Routing::kNone;
        s.p_none = rng.pick(std::vector<double>{0.0, 0.1, 0.5});
        if (rng.chance(0.6)) {
            s.cfg.payload = Payload::kFP8;
            s.cfg.scale_format = rng.pick(
                std::vector<ScaleFormat>{ScaleFormat::kF32G128, ScaleFormat::kUE8M0G128, ScaleFormat::kUE8M0G32});
            s.prequantized = rng.chance(0.3);
            s.mn_major = rng.chance(0.5);
        }
        s.opt.layout = rng.chance(0.6) ? Layout::kExpertContiguous : Layout::kExpertMasked;
        s.opt.expert_alignment = rng.chance(0.5) ? 1 : 128;
        s.opt.host_sync = rng.chance(0.5);
        if (!s.opt.host_sync && rng.chance(0.2)) s.routing = Routing::kInvalid;
        s.opt.zero_padding = rng.chance(0.5);
        s.has_weights = rng.chance(0.8);
        s.weighted = s.has_weights && rng.chance(0.75);
        s.bias = rng.chance(0.4);
        s.idx64 = rng.chance(0.5);
        s.caller_outputs = rng.chance(0.4);
        s.strided = rng.chance(0.3);
        s.seed = static_cast<uint64_t>(i) + 1;
        // every third case with several nodes (the hierarchical combine order; no draw, so the other
        // fields keep their values): one rank per node, or two nodes
        if (i % 3 == 1 && r > 1) s.cfg.ranks_per_node = (i / 3) % 2 == 0 || r % 2 != 0 ? 1 : r / 2;
        v.push_back(s);
    }
    return v;
}

struct NamedScenario {
    Scenario s;
    std::string name;
};

std::vector<NamedScenario> all_cases() {
    std::vector<NamedScenario> out;
    int i = 0;
    for (const Scenario& s : edge_cases()) out.push_back({s, "edge" + std::to_string(i++) + "_" + s.name()});
    i = 0;
    for (const Scenario& s : sampled_cases(480)) out.push_back({s, "sample" + std::to_string(i++) + "_" + s.name()});
    return out;
}

class Matrix : public testing::TestWithParam<NamedScenario> {};

TEST_P(Matrix, EqualsOracle) { run_scenario(GetParam().s); }

INSTANTIATE_TEST_SUITE_P(Cpu, Matrix, testing::ValuesIn(all_cases()),
                         [](const testing::TestParamInfo<NamedScenario>& info) { return info.param.name; });

}  // namespace
}  // namespace eptest
