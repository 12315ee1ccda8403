// The bad-input suite, item 6: data written by a peer is not trusted as a bound. A test hook
// (core/testing.hpp) lets rank 1 rewrite what it announces to rank 0 after writing its messages:
// counts past the capacity, zero-filled slots, out-of-range or repeated expert ids, source tokens
// out of order or past the capacity. Rank 0 must turn each into a named error (host sync) or a
// sticky fault (graph mode) naming the sender, and never write outside its outputs: they live in
// guarded memory here. (The same with ranks as processes: tests/mpi/test_mpi_forged.cpp.)
#include <cstring>

#include "core/testing.hpp"
#include "harness.hpp"

namespace eptest {
namespace {

using namespace std::chrono_literals;
namespace tst = elasticep::detail::testing;

constexpr int kC = 8;

BufferConfig peer_config() {
    BufferConfig c{.num_experts = 4, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = kC};
    c.timeout = 5000ms;
    return c;
}

int32_t& field(uint8_t* msg, int32_t offset, int i = 0) { return reinterpret_cast<int32_t*>(msg + offset)[i]; }

struct Forgery {
    std::string what;
    std::function<void(tst::OutgoingDispatch&)> forge;  // applied to what rank 1 announces to rank 0
    std::vector<std::string> needles;
    int first_bad_message;   // graph mode: messages from this one on are dropped (-1: every message)
    bool only_that_message;  // graph mode: only first_bad_message is dropped
};

std::vector<Forgery> forgeries() {
    auto msg = [](tst::OutgoingDispatch& o, int j) { return o.slots + static_cast<size_t>(j) * o.layout.bytes; };
    return {
        {"count C+1", [](auto& o) { o.count = kC + 1; }, {"announced 9 messages", "max_tokens_per_rank=8"}, -1, false},
        {"count 50", [](auto& o) { o.count = 50; }, {"announced 50 messages"}, -1, false},
        {"count 10^6", [](auto& o) { o.count = 1000000; }, {"announced 1000000 messages"}, -1, false},
        {"count -1", [](auto& o) { o.count = -1; }, {"announced -1 messages"}, -1, false},
        {"zero-filled slot",
         [msg](auto& o) { std::memset(msg(o, 0), 0, static_cast<size_t>(o.layout.bytes)); },
         {"message 0 of 4", "expert id 0 repeated at k=0 and k=1"},
         0,
         true},
        {"expert id past E",
         [msg](auto& o) { field(msg(o, 1), o.layout.idx_offset, 1) = 99; },
         {"message 1 of 4", "expert id 99 at k=1 outside [-1, 4)"},
         1,
         true},
        {"expert id below -1",
         [msg](auto& o) { field(msg(o, 2), o.layout.idx_offset, 0) = -7; },
         {"message 2 of 4", "expert id -7"},
         2,
         true},
        {"no route held here",
         [msg](auto& o) {
             field(msg(o, 3), o.layout.idx_offset, 0) = 2;
             field(msg(o, 3), o.layout.idx_offset, 1) = 3;
         },
         {"message 3 of 4", "no route to an expert of this rank"},
         3,
         true},
        {"source token past C",
         [msg](auto& o) { field(msg(o, 0), o.layout.src_offset) = kC; },
         {"message 0 of 4", "source token 8 outside [0, 8)"},
         0,
         true},
        {"source token negative",
         [msg](auto& o) { field(msg(o, 2), o.layout.src_offset) = -1; },
         {"source token -1"},
         2,
         true},
        {"source tokens out of order",
         [msg](auto& o) { field(msg(o, 2), o.layout.src_offset) = field(msg(o, 1), o.layout.src_offset); },
         {"message 2 of 4", "after token 1"},
         2,
         true},
    };
}

// Rank 0: three tokens to both ranks; rank 1: four tokens, each to rank 0's experts 0 and 1 only.
std::vector<ref::RankInput> peer_inputs() {
    std::vector<ref::RankInput> in(2);
    in[0].num_tokens = 3;
    in[0].topk_idx = {0, 2, 3, 1, -1, 2};
    in[1].num_tokens = 4;
    in[1].topk_idx = {0, 1, 1, 0, 0, 1, 1, 0};
    for (int s = 0; s < 2; ++s) {
        for (int64_t i = 0; i < in[static_cast<size_t>(s)].num_tokens * 2; ++i)
            in[static_cast<size_t>(s)].topk_weights.push_back(0.25f * static_cast<float>(i + 1 + 10 * s));
        for (int64_t i = 0; i < in[static_cast<size_t>(s)].num_tokens * 128; ++i)
            in[static_cast<size_t>(s)].x.push_back(y_value(s, i / 128, i % 128));
    }
    return in;
}

struct RankRun {
    std::exception_ptr dispatch_error, check_error;
    std::optional<Observed> got;
    bool outputs_untouched = true, guards_intact = true;
};

// One dispatch on two fresh buffers with rank 1 forging; rank 0 writes into guarded caller outputs.
std::vector<RankRun> run_forged(const Forgery& f, bool host_sync) {
    const BufferConfig cfg = peer_config();
    auto in = peer_inputs();
    auto groups = ThreadGroup::create(2, 10000ms);
    std::vector<RankRun> runs(2);
    auto errors = run_ranks(2, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        if (r == 1)
            tst::set_dispatch_forger(*buf, [&](tst::OutgoingDispatch& o) {
                if (o.receiver == 0) f.forge(o);
            });
        auto& d = in[static_cast<size_t>(r)];
        std::vector<int32_t> idx(d.topk_idx.begin(), d.topk_idx.end());
        DispatchArgs a;
        a.x = TensorRef::contiguous(d.x.data(), DType::kBFloat16, {d.num_tokens, 128});
        a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {d.num_tokens, 2});
        a.topk_weights = TensorRef::contiguous(d.topk_weights.data(), DType::kFloat32, {d.num_tokens, 2});
        a.host_sync = host_sync;
        Scenario sc;
        sc.cfg = cfg;
        sc.num_ranks = 2;
        sc.opt.host_sync = host_sync;
        auto outs = make_caller_outputs(sc);
        a.outputs = outs->refs;
        RankRun& run = runs[static_cast<size_t>(r)];
        try {
            DispatchResult res = buf->dispatch(a);
            run.got = observe(res, cfg);
            try {
                buf->check();
            } catch (...) {
                run.check_error = std::current_exception();
            }
        } catch (...) {
            run.dispatch_error = std::current_exception();
            const auto* p = static_cast<const uint8_t*>(outs->x.data());
            for (size_t i = 0; i < outs->x.bytes; ++i) run.outputs_untouched &= p[i] == Guarded::kFillByte;
        }
        run.guards_intact = outs->intact();
        // no combine: rank 0's buffer is unusable after the fault, rank 1's stays with its handle
    });
    EXPECT_TRUE(all_ok(errors, f.what));
    return runs;
}

TEST(BadInputPeer, Item06ForgedPeerDataIsANamedErrorWithHostSync) {
    for (const Forgery& f : forgeries()) {
        const auto runs = run_forged(f, true);
        std::vector<std::string> needles = {"dispatch: rank 0 received malformed data from rank 1",
                                            "no outputs were returned"};
        needles.insert(needles.end(), f.needles.begin(), f.needles.end());
        EXPECT_TRUE(is_error(runs[0].dispatch_error, ErrorCode::kInternal, needles)) << f.what;
        EXPECT_TRUE(runs[0].outputs_untouched) << f.what << ": rank 0 wrote outputs for a failed call";
        EXPECT_TRUE(runs[0].guards_intact) << f.what << ": rank 0 wrote outside its outputs";
        // rank 1 received well-formed data from rank 0
        EXPECT_FALSE(runs[1].dispatch_error) << f.what << ": " << describe(runs[1].dispatch_error);
        EXPECT_TRUE(runs[1].guards_intact) << f.what;
    }
}

TEST(BadInputPeer, Item06ForgedPeerDataIsDroppedAndStickyInGraphMode) {
    const BufferConfig cfg = peer_config();
    for (const Forgery& f : forgeries()) {
        const auto runs = run_forged(f, false);
        ASSERT_FALSE(runs[0].dispatch_error) << f.what << ": " << describe(runs[0].dispatch_error);
        EXPECT_TRUE(runs[0].guards_intact) << f.what << ": rank 0 wrote outside its outputs";
        std::vector<std::string> needles = {"fault from an earlier graph-mode dispatch",
                                            "received malformed data from rank 1"};
        needles.insert(needles.end(), f.needles.begin(), f.needles.end());
        EXPECT_TRUE(is_error(runs[0].check_error, ErrorCode::kInternal, needles)) << f.what;
        // rank 0 holds exactly its own tokens' rows and rank 1's well-formed messages: the oracle
        // over inputs where rank 1's dropped tokens route nowhere
        auto in = peer_inputs();
        for (int64_t t = 0; t < in[1].num_tokens; ++t) {
            const bool dropped = f.first_bad_message < 0 || (f.only_that_message && t == f.first_bad_message);
            if (dropped)
                in[1].topk_idx[static_cast<size_t>(2 * t)] = in[1].topk_idx[static_cast<size_t>(2 * t + 1)] = -1;
        }
        ref::DispatchOptions opt;
        opt.host_sync = false;
        const auto want = ref::dispatch(cfg, 2, in, opt);
        ASSERT_TRUE(runs[0].got.has_value()) << f.what;
        expect_dispatch_equal(want[0], *runs[0].got, cfg, false, f.what + " rank 0");
        EXPECT_FALSE(runs[1].dispatch_error) << f.what;
        EXPECT_FALSE(runs[1].check_error) << f.what;
    }
}

}  // namespace
}  // namespace eptest
