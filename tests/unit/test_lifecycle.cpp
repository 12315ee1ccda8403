// Buffer lifecycle: the registry (get_buffer caches per group and config, rebuilds on a change),
// expert_load accounting, and one buffer reused for many rounds with changing inputs and options.
#include "harness.hpp"

namespace eptest {
namespace {

BufferConfig config(int hidden = 128) {
    BufferConfig c{.num_experts = 6, .num_topk = 2, .hidden = hidden, .max_tokens_per_rank = 5};
    c.timeout = std::chrono::milliseconds(5000);
    return c;
}

TEST(Lifecycle, GetBufferCachesPerGroupAndConfig) {
    reset_buffers();
    const int r_count = 2;
    auto groups = ThreadGroup::create(r_count);
    auto other_groups = ThreadGroup::create(r_count);
    const BufferConfig a = config(), b = config(256);
    struct Seen {
        std::shared_ptr<Buffer> a1, a2, b1, b2, a3, other, after_reset;
    };
    std::vector<Seen> seen(static_cast<size_t>(r_count));
    auto errors = run_ranks(r_count, [&](int r) {
        auto g = groups[static_cast<size_t>(r)];
        Seen& s = seen[static_cast<size_t>(r)];
        s.a1 = get_buffer(g, a, BackendKind::kCPU);
        s.a2 = get_buffer(g, a, BackendKind::kCPU);  // cached: no collective, same object
        s.b1 = get_buffer(g, b, BackendKind::kCPU);  // key changed: rebuilt collectively
        s.b2 = get_buffer(g, b, BackendKind::kCPU);
        s.a3 = get_buffer(g, a, BackendKind::kCPU);  // changed back: rebuilt again
        s.other = get_buffer(other_groups[static_cast<size_t>(r)], a, BackendKind::kCPU);  // another group
    });
    ASSERT_TRUE(all_ok(errors));
    for (const Seen& s : seen) {
        EXPECT_EQ(s.a1, s.a2);
        EXPECT_EQ(s.b1, s.b2);
        EXPECT_NE(s.a1, s.b1);
        EXPECT_NE(s.a3, s.a1);
        EXPECT_NE(s.a3, s.b1);
        EXPECT_NE(s.other, s.a3);
        EXPECT_EQ(s.a3->config().hidden, 128);
        EXPECT_EQ(s.b1->config().hidden, 256);
        EXPECT_EQ(s.a3->group(), groups[static_cast<size_t>(&s - seen.data())]);
    }
    EXPECT_NE(seen[0].a3, seen[1].a3);  // one buffer per rank
    EXPECT_EQ(seen[1].a3->rank(), 1);
    EXPECT_EQ(seen[1].a3->num_ranks(), 2);
    EXPECT_EQ(seen[1].a3->num_local_experts(), 3);
    EXPECT_EQ(seen[1].a3->backend(), BackendKind::kCPU);
    // the buffers the registry returned work (the replaced ones too, while still referenced)
    Scenario sc;
    sc.cfg = a;
    sc.num_ranks = r_count;
    sc.tokens = {5, 2};
    std::vector<std::shared_ptr<Buffer>> cached{seen[0].a3, seen[1].a3};
    run_round(sc, groups, cached, "registry buffer");
    Scenario sb = sc;
    sb.cfg = b;
    std::vector<std::shared_ptr<Buffer>> old_b{seen[0].b1, seen[1].b1};
    run_round(sb, groups, old_b, "replaced buffer still referenced");
    // reset drops the cache: the next get_buffer builds anew
    reset_buffers();
    errors = run_ranks(r_count, [&](int r) {
        seen[static_cast<size_t>(r)].after_reset = get_buffer(groups[static_cast<size_t>(r)], a, BackendKind::kCPU);
    });
    ASSERT_TRUE(all_ok(errors));
    for (const Seen& s : seen) EXPECT_NE(s.after_reset, s.a3);
    reset_buffers();
}

TEST(Lifecycle, ExpertLoadAccumulates) {
    const int r_count = 3;
    std::vector<std::shared_ptr<Group>> groups;
    std::vector<std::shared_ptr<Buffer>> bufs;
    Scenario sc;
    sc.cfg = config();
    sc.num_ranks = r_count;
    std::vector<std::vector<int64_t>> want(r_count, std::vector<int64_t>(2, 0));
    const Layout layouts[] = {Layout::kExpertContiguous, Layout::kExpertMasked, Layout::kExpertContiguous};
    for (int round = 0; round < 3; ++round) {
        sc.seed = 500 + static_cast<uint64_t>(round);
        sc.tokens = {round, 5, 5 - round};
        sc.opt.layout = layouts[round];
        sc.opt.host_sync = round != 2;
        sc.opt.expert_alignment = round == 2 ? 4 : 1;
        sc.routing = round == 1 ? Routing::kHotExpert : Routing::kRandom;
        const auto expected = run_round(sc, groups, bufs, "load round " + std::to_string(round));
        for (int r = 0; r < r_count; ++r)
            for (int l = 0; l < 2; ++l)
                want[static_cast<size_t>(r)][static_cast<size_t>(l)] +=
                    expected[static_cast<size_t>(r)].counts[static_cast<size_t>(l)];
        for (int r = 0; r < r_count; ++r)
            EXPECT_EQ(bufs[static_cast<size_t>(r)]->expert_load(), want[static_cast<size_t>(r)]) << "round " << round;
    }
    int64_t total = 0;
    for (const auto& w : want)
        for (int64_t v : w) total += v;
    EXPECT_GT(total, 0);
    for (auto& b : bufs) b->reset_expert_load();
    for (auto& b : bufs) EXPECT_EQ(b->expert_load(), (std::vector<int64_t>{0, 0}));
    sc.seed = 900;
    const auto expected = run_round(sc, groups, bufs, "after reset");
    for (int r = 0; r < r_count; ++r)
        EXPECT_EQ(bufs[static_cast<size_t>(r)]->expert_load(),
                  (std::vector<int64_t>{expected[static_cast<size_t>(r)].counts[0],
                                        expected[static_cast<size_t>(r)].counts[1]}));
}

// One fp8 buffer, many rounds: T changes (0 and C included), layouts, sync modes, alignment,
// quantized and pre-quantized input, caller and buffer-owned outputs, weights and bias alternate.
TEST(Lifecycle, BufferReusedForManyRounds) {
    const int r_count = 4;
    BufferConfig cfg = config(256);
    cfg.num_experts = 8;
    cfg.num_topk = 3;
    cfg.payload = Payload::kFP8;
    cfg.scale_format = ScaleFormat::kUE8M0G128;
    cfg.max_tokens_per_rank = 7;
    std::vector<std::shared_ptr<Group>> groups;
    std::vector<std::shared_ptr<Buffer>> bufs;
    Rng rng(4242);
    std::vector<Buffer*> first;
    for (int round = 0; round < 24; ++round) {
        Scenario sc;
        sc.cfg = cfg;
        sc.num_ranks = r_count;
        sc.seed = 7000 + static_cast<uint64_t>(round);
        sc.tokens.clear();
        for (int r = 0; r < r_count; ++r)
            sc.tokens.push_back(round % 6 == 0 ? 0 : round % 6 == 1 ? 7 : rng.uniform(0, 7));
        sc.opt.layout = rng.chance(0.5) ? Layout::kExpertContiguous : Layout::kExpertMasked;
        sc.opt.host_sync = rng.chance(0.5);
        sc.opt.expert_alignment = rng.pick(std::vector<int>{1, 2, 64});
        sc.opt.zero_padding = rng.chance(0.5);
        sc.prequantized = rng.chance(0.3);
        sc.mn_major = rng.chance(0.5);
        sc.caller_outputs = rng.chance(0.5);
        sc.has_weights = rng.chance(0.7);
        sc.weighted = sc.has_weights && rng.chance(0.7);
        sc.bias = rng.chance(0.5);
        sc.idx64 = rng.chance(0.5);
        sc.strided = rng.chance(0.3);
        run_round(sc, groups, bufs, "round " + std::to_string(round) + " " + sc.name());
        if (HasFailure()) break;
        if (round == 0)
            for (auto& b : bufs) first.push_back(b.get());
    }
    // the same buffer objects throughout, still healthy
    ASSERT_EQ(bufs.size(), static_cast<size_t>(r_count));
    ASSERT_EQ(first.size(), static_cast<size_t>(r_count));
    for (int r = 0; r < r_count; ++r) EXPECT_EQ(bufs[static_cast<size_t>(r)].get(), first[static_cast<size_t>(r)]);
    for (auto& b : bufs) EXPECT_NO_THROW(b->check());
}

// Buffer-owned outputs keep their pointers across calls of the same shape (a captured CUDA graph
// replays them): graph-mode and masked dispatches return the same memory every time.
TEST(Lifecycle, BufferOwnedPointersAreStable) {
    BufferConfig cfg = config();
    cfg.payload = Payload::kFP8;
    auto groups = ThreadGroup::create(1);
    cfg.num_experts = 2;
    auto buf = Buffer::create(groups[0], cfg, BackendKind::kCPU);
    Scenario sc;
    sc.cfg = cfg;
    sc.num_ranks = 1;
    for (Layout l : {Layout::kExpertMasked, Layout::kExpertContiguous}) {
        std::vector<const void*> first;
        for (int round = 0; round < 4; ++round) {
            sc.tokens = {round + 1};
            sc.seed = static_cast<uint64_t>(round);
            sc.opt.layout = l;
            sc.opt.host_sync = false;
            const auto data = make_inputs(sc);
            DispatchResult d = buf->dispatch(make_args(sc, data[0]));
            const std::vector<const void*> ptrs = {d.recv_x.data, d.recv_scales->data, d.recv_weights.data,
                                                   d.recv_src.data, d.counts.data};
            if (round == 0) first = ptrs;
            EXPECT_EQ(ptrs, first) << layout_name(l) << " round " << round;
            std::vector<uint16_t> y(static_cast<size_t>(d.recv_x.numel()), 0);
            CombineResult c = buf->combine(std::move(d.handle),
                                           {.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape)});
            EXPECT_EQ(c.out.shape, (std::vector<int64_t>{round + 1, 128}));
        }
    }
}

}  // namespace
}  // namespace eptest
