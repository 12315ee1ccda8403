// Every error path of SEMANTICS.md ("Capacity and bad input", "Handles") and config validation:
// the code, a message naming what to change, nothing written, and the buffer still usable after
// every error that is not a timeout.
#include <chrono>
#include <functional>
#include <stdexcept>

#include "harness.hpp"

namespace eptest {
namespace {

using namespace std::chrono_literals;

BufferConfig small_config() {
    BufferConfig c{.num_experts = 4, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = 4};
    c.timeout = 5000ms;
    return c;
}

Scenario scenario_for(const BufferConfig& cfg, int r) {
    Scenario s;
    s.cfg = cfg;
    s.num_ranks = r;
    s.tokens.assign(static_cast<size_t>(r), cfg.max_tokens_per_rank);
    s.seed = 77;
    return s;
}

// ---------------------------------------------------------------------------------------------
// Capacity

TEST(Errors, CapacityExceededNamesTheNumbersAndTheFix) {
    const BufferConfig cfg = small_config();
    auto groups = ThreadGroup::create(2);
    std::vector<std::shared_ptr<Buffer>> bufs(2);
    Scenario over = scenario_for(cfg, 2);
    over.tokens = {5, 6};
    over.cfg.max_tokens_per_rank = 6;  // only to generate the inputs
    const auto data = make_inputs(over);
    auto errors = run_ranks(2, [&](int r) {
        bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        bufs[static_cast<size_t>(r)]->dispatch(make_args(over, data[static_cast<size_t>(r)]));
    });
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kCapacityExceeded,
                         {"rank 0", "5 tokens", "max_tokens_per_rank=4", "raise max_tokens_per_rank to at least 5",
                          "chunked prefill", "CUDA-graph batch size"}));
    EXPECT_TRUE(is_error(errors[1], ErrorCode::kCapacityExceeded, {"rank 1", "6 tokens", "max_tokens_per_rank=4"}));
    // raised before any communication: the same buffers still run a good round
    run_round(scenario_for(cfg, 2), groups, bufs, "after capacity error");
}

// ---------------------------------------------------------------------------------------------
// Bad arguments on one rank (R=1: every check happens before communication)

struct BadCase {
    std::string what;
    std::function<void(DispatchArgs&)> mutate;
    std::vector<std::string> needles;
};

TEST(Errors, DispatchArgumentMismatches) {
    BufferConfig cfg = small_config();
    cfg.num_experts = 2;
    auto groups = ThreadGroup::create(1);
    auto buf = Buffer::create(groups[0], cfg, BackendKind::kCPU);
    BufferConfig fp8cfg = cfg;
    fp8cfg.payload = Payload::kFP8;
    fp8cfg.hidden = 256;  // two scale columns: MN-major and row-major differ
    auto buf8 = Buffer::create(groups[0], fp8cfg, BackendKind::kCPU);

    const int64_t t = 3, h = 128;
    std::vector<uint16_t> x(static_cast<size_t>(t * h * 4), bf16(1.0f));
    std::vector<uint8_t> x8(static_cast<size_t>(t * h), 0x38);
    std::vector<float> f32(static_cast<size_t>(t * h), 1.0f);
    std::vector<int32_t> i32(static_cast<size_t>(t * h), 0);
    std::vector<int32_t> idx = {0, 1, 1, 0, 0, -1};
    std::vector<float> w(6, 0.5f);
    auto good = [&] {
        DispatchArgs a;
        a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {t, h});
        a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {t, 2});
        a.topk_weights = TensorRef::contiguous(w.data(), DType::kFloat32, {t, 2});
        return a;
    };
    const Device gpu{DeviceType::kCUDA, 0};
    // M_cap = R*C*min(K, E_local) + E_local*(A-1) = 1*4*2 + 0 = 8
    std::vector<BadCase> cases = {
        {"x 1-D", [&](DispatchArgs& a) { a.x.shape = {t * h}; }, {"must be 2-D"}},
        {"x hidden",
         [&](DispatchArgs& a) {
             a.x.shape = {t, 64};
         },
         {"dispatch: x", "[3, 64]", "must be [3, 128]"}},
        {"x dtype",
         [&](DispatchArgs& a) {
             a.x = TensorRef::contiguous(f32.data(), DType::kFloat32, {t, h});
         },
         {"must be bf16"}},
        {"x fp8 on a bf16 buffer",
         [&](DispatchArgs& a) {
             a.x = TensorRef::contiguous(x8.data(), DType::kFloat8E4M3, {t, h});
         },
         {"payload is bf16"}},
        {"x_scales with bf16 x",
         [&](DispatchArgs& a) {
             a.x_scales = TensorRef::contiguous(f32.data(), DType::kFloat32, {t, 1});
         },
         {"x_scales given"}},
        {"x last dim strided",
         [&](DispatchArgs& a) {
             a.x.strides = {2 * h, 2};
         },
         {"stride 1"}},
        {"x row stride too small",
         [&](DispatchArgs& a) {
             a.x.strides = {h / 2, 1};
         },
         {"row stride"}},
        {"x on cuda", [&](DispatchArgs& a) { a.x.device = gpu; }, {"cuda:0", "cpu"}},
        {"x null", [&](DispatchArgs& a) { a.x.data = nullptr; }, {"null"}},
        {"topk_idx dtype",
         [&](DispatchArgs& a) {
             a.topk_idx = TensorRef::contiguous(f32.data(), DType::kFloat32, {t, 2});
         },
         {"int32 or int64"}},
        {"topk_idx K",
         [&](DispatchArgs& a) {
             a.topk_idx.shape = {t, 1};
         },
         {"topk_idx", "must be [3, 2]"}},
        {"topk_idx rows",
         [&](DispatchArgs& a) {
             a.topk_idx.shape = {2, 2};
         },
         {"topk_idx", "must be [3, 2]"}},
        {"topk_idx on cuda", [&](DispatchArgs& a) { a.topk_idx.device = gpu; }, {"topk_idx", "cuda:0"}},
        {"topk_weights dtype",
         [&](DispatchArgs& a) {
             a.topk_weights = TensorRef::contiguous(i32.data(), DType::kInt32, {t, 2});
         },
         {"topk_weights", "fp32"}},
        {"topk_weights shape",
         [&](DispatchArgs& a) {
             a.topk_weights->shape = {t, 3};
         },
         {"topk_weights", "[3, 2]"}},
        {"alignment 0", [&](DispatchArgs& a) { a.expert_alignment = 0; }, {"expert_alignment=0"}},
        {"mn-major on bf16", [&](DispatchArgs& a) { a.scales_mn_major = true; }, {"scales_mn_major"}},
        {"recv_x rows != M_cap",
         [&](DispatchArgs& a) {
             a.outputs.recv_x = TensorRef::contiguous(x.data(), DType::kBFloat16, {3, h});
         },
         {"caller-provided output recv_x", "bf16[3, 128]", "bf16[8, 128]"}},
        {"recv_x dtype",
         [&](DispatchArgs& a) {
             a.outputs.recv_x = TensorRef::contiguous(x.data(), DType::kFloat32, {8, h});
         },
         {"recv_x"}},
        {"recv_scales on bf16",
         [&](DispatchArgs& a) {
             a.outputs.recv_scales = TensorRef::contiguous(f32.data(), DType::kFloat32, {8, 1});
         },
         {"recv_scales", "bf16 payload"}},
        {"m_indices for masked",
         [&](DispatchArgs& a) {
             a.layout = Layout::kExpertMasked;
             a.outputs.m_indices = TensorRef::contiguous(i32.data(), DType::kInt32, {2, 4});
         },
         {"m_indices", "masked"}},
        {"recv_weights masked shape",
         [&](DispatchArgs& a) {
             a.layout = Layout::kExpertMasked;
             a.outputs.recv_weights = TensorRef::contiguous(f32.data(), DType::kFloat32, {8});
         },
         {"recv_weights", "fp32[2, 4]"}},
        {"recv_src on cuda",
         [&](DispatchArgs& a) { a.outputs.recv_src = TensorRef::contiguous(i32.data(), DType::kInt32, {8}, gpu); },
         {"recv_src"}},
    };
    for (const BadCase& c : cases) {
        DispatchArgs a = good();
        c.mutate(a);
        EXPECT_TRUE(throws_error([&] { buf->dispatch(a); }, ErrorCode::kInvalidArgument, c.needles)) << c.what;
    }

    // FP8 buffer (H = 256): pre-quantized input needs scales of the format's dtype and shape, and a
    // caller's MN-major scales need the MN-major strides
    std::vector<uint16_t> x256(static_cast<size_t>(t * 256), bf16(1.0f));
    std::vector<uint8_t> q256(static_cast<size_t>(t * 256), 0x38);
    auto good8 = [&] {
        DispatchArgs a = good();
        a.x = TensorRef::contiguous(x256.data(), DType::kBFloat16, {t, 256});
        return a;
    };
    std::vector<BadCase> fp8_cases = {
        {"no scales",
         [&](DispatchArgs& a) {
             a.x = TensorRef::contiguous(q256.data(), DType::kFloat8E4M3, {t, 256});
         },
         {"x_scales [3, 2]", "required"}},
        {"scales dtype",
         [&](DispatchArgs& a) {
             a.x = TensorRef::contiguous(q256.data(), DType::kFloat8E4M3, {t, 256});
             a.x_scales = TensorRef::contiguous(i32.data(), DType::kInt32, {t, 2});
         },
         {"x_scales", "fp32"}},
        {"scales columns",
         [&](DispatchArgs& a) {
             a.x = TensorRef::contiguous(q256.data(), DType::kFloat8E4M3, {t, 256});
             a.x_scales = TensorRef::contiguous(f32.data(), DType::kFloat32, {t, 1});
         },
         {"x_scales", "must be [3, 2]"}},
        {"recv_scales row-major where MN-major was asked",
         [&](DispatchArgs& a) {
             a.scales_mn_major = true;  // needs strides {1, 8}
             a.outputs.recv_scales = TensorRef::contiguous(f32.data(), DType::kFloat32, {8, 2});
         },
         {"recv_scales", "MN-major"}},
        {"recv_scales MN-major stride not rounded to 4",
         [&](DispatchArgs& a) {
             a.scales_mn_major = true;
             a.layout = Layout::kExpertMasked;  // [E_local=2, R*C=4, 2]: strides {8, 1, 4} needed
             a.outputs.recv_scales = TensorRef::contiguous(f32.data(), DType::kFloat32, {2, 4, 2});
             a.outputs.recv_scales->strides = {10, 1, 5};
         },
         {"recv_scales", "MN-major"}},
    };
    for (const BadCase& c : fp8_cases) {
        DispatchArgs a = good8();
        c.mutate(a);
        EXPECT_TRUE(throws_error([&] { buf8->dispatch(a); }, ErrorCode::kInvalidArgument, c.needles)) << c.what;
    }
    // nothing broke: both buffers still work, with the right outputs
    std::vector<std::shared_ptr<Group>> g = groups;
    std::vector<std::shared_ptr<Buffer>> b{buf};
    run_round(scenario_for(cfg, 1), g, b, "bf16 after errors");
    Scenario s8 = scenario_for(fp8cfg, 1);
    std::vector<std::shared_ptr<Buffer>> b8{buf8};
    run_round(s8, g, b8, "fp8 after errors");
}

TEST(Errors, CombineArgumentMismatches) {
    BufferConfig cfg = small_config();
    cfg.num_experts = 2;
    auto groups = ThreadGroup::create(1);
    auto buf = Buffer::create(groups[0], cfg, BackendKind::kCPU);
    const int64_t t = 3, h = 128;
    std::vector<uint16_t> x(static_cast<size_t>(t * h), bf16(1.0f));
    std::vector<int32_t> idx = {0, 1, 1, 0, 0, -1};
    std::vector<float> w(6, 0.5f);
    std::vector<uint16_t> big(static_cast<size_t>(64 * h), 0);
    std::vector<float> f32(static_cast<size_t>(64 * h), 0.0f);
    const Device gpu{DeviceType::kCUDA, 0};
    DispatchArgs a;
    a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {t, h});
    a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {t, 2});
    a.topk_weights = TensorRef::contiguous(w.data(), DType::kFloat32, {t, 2});
    struct CombineCase {
        std::string what;
        std::function<void(CombineArgs&, const DispatchResult&)> mutate;
        std::vector<std::string> needles;
    };
    const std::vector<CombineCase> cases = {
        {"y dtype",
         [&](CombineArgs& c, const DispatchResult& d) {
             c.y = TensorRef::contiguous(f32.data(), DType::kFloat32, d.recv_x.shape);
         },
         {"y is", "bf16"}},
        {"y rows",
         [&](CombineArgs& c, const DispatchResult&) {
             c.y = TensorRef::contiguous(big.data(), DType::kBFloat16, {4, h});
         },
         {"shape of dispatch's recv_x", "[5, 128]"}},
        {"y strided",
         [&](CombineArgs& c, const DispatchResult& d) {
             c.y = TensorRef::contiguous(big.data(), DType::kBFloat16, d.recv_x.shape);
             c.y.strides = {2 * h, 1};
         },
         {"contiguous"}},
        {"y on cuda",
         [&](CombineArgs& c, const DispatchResult& d) {
             c.y = TensorRef::contiguous(big.data(), DType::kBFloat16, d.recv_x.shape, gpu);
         },
         {"cuda:0"}},
        {"bias shape",
         [&](CombineArgs& c, const DispatchResult&) {
             c.bias = TensorRef::contiguous(big.data(), DType::kBFloat16, {t + 1, h});
         },
         {"bias", "[3, 128]"}},
        {"bias dtype",
         [&](CombineArgs& c, const DispatchResult&) {
             c.bias = TensorRef::contiguous(f32.data(), DType::kFloat32, {t, h});
         },
         {"bias", "bf16"}},
        {"out shape",
         [&](CombineArgs& c, const DispatchResult&) {
             c.out = TensorRef::contiguous(big.data(), DType::kBFloat16, {t, h / 2});
         },
         {"out", "[3, 128]"}},
        {"out dtype",
         [&](CombineArgs& c, const DispatchResult&) {
             c.out = TensorRef::contiguous(f32.data(), DType::kFloat32, {t, h});
         },
         {"out", "bf16"}},
    };
    for (const CombineCase& cc : cases) {
        DispatchResult d = buf->dispatch(a);
        ASSERT_EQ(d.recv_x.size(0), 5) << "M = 3 routes to expert 0 + 2 to expert 1";
        CombineArgs c{.y = TensorRef::contiguous(big.data(), DType::kBFloat16, d.recv_x.shape)};
        cc.mutate(c, d);
        EXPECT_TRUE(
            throws_error([&] { buf->combine(std::move(d.handle), c); }, ErrorCode::kInvalidArgument, cc.needles))
            << cc.what;
        EXPECT_FALSE(d.handle.valid()) << cc.what << ": a failed combine releases its handle";
    }
    std::vector<std::shared_ptr<Group>> g = groups;
    std::vector<std::shared_ptr<Buffer>> b{buf};
    run_round(scenario_for(cfg, 1), g, b, "after combine errors");
}

// ---------------------------------------------------------------------------------------------
// Invalid expert ids

// Host sync: every rank fails naming the first bad (rank, token, k, value); nothing is published.
void expect_host_sync_rejection(Layout layout, bool idx64, const std::vector<std::vector<int64_t>>& idx,
                                const std::vector<std::string>& needles) {
    BufferConfig cfg{.num_experts = 6, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = 4};
    cfg.timeout = 5000ms;
    const int r_count = 3;
    Scenario sc = scenario_for(cfg, r_count);
    sc.opt.layout = layout;
    sc.idx64 = idx64;
    sc.caller_outputs = true;
    std::vector<RankData> data = make_inputs(sc);
    for (int r = 0; r < r_count; ++r) {
        auto& d = data[static_cast<size_t>(r)];
        d.in.num_tokens = static_cast<int64_t>(idx[static_cast<size_t>(r)].size() / 2);
        d.in.topk_idx = idx[static_cast<size_t>(r)];
        d.in.x.resize(static_cast<size_t>(d.in.num_tokens * 128));
        d.in.topk_weights.resize(static_cast<size_t>(d.in.num_tokens * 2));
        fill_storage(sc, d);
    }
    auto groups = ThreadGroup::create(r_count);
    std::vector<std::shared_ptr<Buffer>> bufs(static_cast<size_t>(r_count));
    std::vector<char> untouched(static_cast<size_t>(r_count), 0);  // not vector<bool>: written from several threads
    auto errors = run_ranks(r_count, [&](int r) {
        bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        auto outs = make_caller_outputs(sc);
        DispatchArgs a = make_args(sc, data[static_cast<size_t>(r)]);
        a.outputs = outs->refs;
        try {
            bufs[static_cast<size_t>(r)]->dispatch(a);
        } catch (...) {
            // nothing published: every byte of the caller's outputs is as the caller left it
            bool same = outs->intact();
            for (const Guarded* g : {&outs->x, &outs->weights, &outs->src, &outs->m_indices})
                for (size_t i = 0; i < g->bytes; ++i)
                    same = same && static_cast<const uint8_t*>(g->data())[i] == Guarded::kFillByte;
            untouched[static_cast<size_t>(r)] = same;
            throw;
        }
    });
    for (int r = 0; r < r_count; ++r) {
        EXPECT_TRUE(is_error(errors[static_cast<size_t>(r)], ErrorCode::kInvalidArgument, needles)) << "rank " << r;
        EXPECT_TRUE(untouched[static_cast<size_t>(r)]) << "rank " << r << " wrote outputs of a rejected call";
    }
    // rejected on every rank alike: the buffers go on with a good round
    Scenario good = sc;
    good.caller_outputs = false;
    run_round(good, groups, bufs, "after rejection");
}

TEST(Errors, HostSyncInvalidExpertIdNamesFirstBadRoute) {
    // rank 1 token 2 k=1 is out of range; rank 2 token 0 k=0 too (later rank: not named)
    expect_host_sync_rejection(Layout::kExpertContiguous, false, {{0, 1, 2, 3}, {0, 5, 1, 2, 3, 99, 4, 4}, {-5, 1}},
                               {"rank 1", "token 2", "k=1", "99", "outside [-1, 6)"});
    expect_host_sync_rejection(Layout::kExpertMasked, true, {{0, 1}, {}, {2, 3, -1, int64_t{1} << 40}},
                               {"rank 2", "token 1", "k=1", "1099511627776"});
    expect_host_sync_rejection(Layout::kExpertContiguous, true, {{0, 1}, {-2, 0}, {}},
                               {"rank 1", "token 0", "k=0", "value -2"});
}

TEST(Errors, HostSyncDuplicateExpertId) {
    expect_host_sync_rejection(Layout::kExpertContiguous, false, {{0, 1, 3, 3}, {0, 1}, {2, 2}},
                               {"rank 0", "token 1", "k=1", "expert id 3", "repeats k=0"});
    expect_host_sync_rejection(Layout::kExpertMasked, false, {{}, {5, -1, 4, 4}, {}},
                               {"rank 1", "token 1", "k=1", "expert id 4"});
}

// Graph mode: bad routes dropped (outputs equal the oracle's), the sticky fault raised later by
// check() on the rank that had them, and by the next host-sync dispatch on every rank.
TEST(Errors, GraphModeInvalidRoutesAreDroppedAndSticky) {
    BufferConfig cfg{.num_experts = 4, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = 3};
    cfg.timeout = 5000ms;
    Scenario sc = scenario_for(cfg, 2);
    sc.opt.host_sync = false;
    sc.opt.expert_alignment = 8;
    auto with_bad = [&](Layout layout) {
        Scenario s = sc;
        s.opt.layout = layout;
        std::vector<RankData> data = make_inputs(s);
        auto& d = data[1];
        d.in.topk_idx[1] = 8;                                             // rank 1 token 0 k=1: out of range
        d.in.topk_idx[5] = d.in.topk_idx[4] >= 0 ? d.in.topk_idx[4] : 2;  // token 2: a repeat (or valid)
        fill_storage(s, d);
        return std::make_pair(s, data);
    };
    auto groups = ThreadGroup::create(2);
    std::vector<std::shared_ptr<Buffer>> bufs;
    {
        auto [s, data] = with_bad(Layout::kExpertContiguous);
        run_round_with(s, data, groups, bufs, "graph contiguous with bad routes");
    }
    auto errors = run_ranks(2, [&](int r) {
        if (r == 0) {
            bufs[0]->check();  // rank 0 had no bad route
            return;
        }
        EXPECT_TRUE(throws_error([&] { bufs[1]->check(); }, ErrorCode::kInvalidArgument,
                                 {"sticky", "rank 1", "token 0", "k=1", "value 8", "dropped"}));
        bufs[1]->check();  // raised once, then cleared
    });
    ASSERT_TRUE(all_ok(errors));
    {
        auto [s, data] = with_bad(Layout::kExpertMasked);
        run_round_with(s, data, groups, bufs, "graph masked with bad routes");
    }
    // the next host-sync dispatch raises the fault on every rank, even with good inputs
    Scenario good = sc;
    good.opt.host_sync = true;
    const auto data = make_inputs(good);
    errors = run_ranks(
        2, [&](int r) { bufs[static_cast<size_t>(r)]->dispatch(make_args(good, data[static_cast<size_t>(r)])); });
    for (int r = 0; r < 2; ++r)
        EXPECT_TRUE(
            is_error(errors[static_cast<size_t>(r)], ErrorCode::kInvalidArgument, {"sticky", "rank 1", "token 0"}))
            << "rank " << r;
    run_round(good, groups, bufs, "good round after the sticky fault");
}

// ---------------------------------------------------------------------------------------------
// Handles

struct TwoRanks {
    BufferConfig cfg = small_config();
    Scenario sc = scenario_for(cfg, 2);
    std::vector<RankData> data = make_inputs(sc);
    std::vector<std::shared_ptr<Group>> groups = ThreadGroup::create(2);
    std::vector<std::shared_ptr<Buffer>> bufs = std::vector<std::shared_ptr<Buffer>>(2);
    void build() {
        auto e = run_ranks(2, [&](int r) {
            bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        });
        ASSERT_TRUE(all_ok(e));
    }
    CombineArgs combine_args(const DispatchResult& d, std::vector<uint16_t>& y, bool weighted = true) {
        y.assign(static_cast<size_t>(d.recv_x.numel()), bf16(1.0f));
        return CombineArgs{.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape),
                           .weighted = weighted};
    }
};

TEST(Errors, CombineWithEmptyOrConsumedHandle) {
    TwoRanks t;
    t.build();
    auto errors = run_ranks(2, [&](int r) {
        auto& buf = *t.bufs[static_cast<size_t>(r)];
        std::vector<uint16_t> y;
        EXPECT_TRUE(
            throws_error([&] { buf.combine(Handle{}, CombineArgs{}); }, ErrorCode::kInvalidArgument, {"empty"}));
        DispatchResult d = buf.dispatch(make_args(t.sc, t.data[static_cast<size_t>(r)]));
        EXPECT_TRUE(d.handle.valid());
        const CombineArgs c = t.combine_args(d, y);
        buf.combine(std::move(d.handle), c);
        EXPECT_FALSE(d.handle.valid());
        // the same handle again: raised before any communication
        EXPECT_TRUE(throws_error([&] { buf.combine(std::move(d.handle), c); }, ErrorCode::kInvalidArgument));
    });
    ASSERT_TRUE(all_ok(errors));
    run_round(t.sc, t.groups, t.bufs, "after handle misuse");
}

TEST(Errors, DispatchWhilePreviousHandleUnconsumed) {
    TwoRanks t;
    t.build();
    auto errors = run_ranks(2, [&](int r) {
        auto& buf = *t.bufs[static_cast<size_t>(r)];
        const DispatchArgs a = make_args(t.sc, t.data[static_cast<size_t>(r)]);
        DispatchResult d = buf.dispatch(a);
        EXPECT_TRUE(throws_error([&] { buf.dispatch(a); }, ErrorCode::kInvalidArgument, {"never combined"}));
        std::vector<uint16_t> y;
        buf.combine(std::move(d.handle), t.combine_args(d, y));
    });
    ASSERT_TRUE(all_ok(errors));
    run_round(t.sc, t.groups, t.bufs, "after unconsumed-handle error");
}

TEST(Errors, HandleOfAnotherBuffer) {
    TwoRanks t;
    t.build();
    std::vector<std::shared_ptr<Buffer>> other(2);
    auto errors = run_ranks(2, [&](int r) {
        other[static_cast<size_t>(r)] = Buffer::create(t.groups[static_cast<size_t>(r)], t.cfg, BackendKind::kCPU);
        DispatchResult d = t.bufs[static_cast<size_t>(r)]->dispatch(make_args(t.sc, t.data[static_cast<size_t>(r)]));
        std::vector<uint16_t> y;
        const CombineArgs c = t.combine_args(d, y);
        EXPECT_TRUE(throws_error([&] { other[static_cast<size_t>(r)]->combine(std::move(d.handle), c); },
                                 ErrorCode::kInvalidArgument, {"another buffer"}));
    });
    ASSERT_TRUE(all_ok(errors));
    // the failed combine released the handle: both buffers go on
    run_round(t.sc, t.groups, t.bufs, "buffer whose handle went elsewhere");
    run_round(t.sc, t.groups, other, "the other buffer");
}

TEST(Errors, WeightedCombineWithoutWeights) {
    TwoRanks t;
    t.sc.has_weights = false;
    t.sc.weighted = false;
    t.data = make_inputs(t.sc);
    t.build();
    auto errors = run_ranks(2, [&](int r) {
        auto& buf = *t.bufs[static_cast<size_t>(r)];
        DispatchResult d = buf.dispatch(make_args(t.sc, t.data[static_cast<size_t>(r)]));
        std::vector<uint16_t> y;
        EXPECT_TRUE(throws_error([&] { buf.combine(std::move(d.handle), t.combine_args(d, y, true)); },
                                 ErrorCode::kInvalidArgument, {"weighted=true", "no topk_weights"}));
        EXPECT_FALSE(d.handle.valid());
    });
    ASSERT_TRUE(all_ok(errors));
    run_round(t.sc, t.groups, t.bufs, "unweighted after the error");
}

// Combines that fail their argument checks on every rank release the handles, so the next
// dispatch may start at once, while a slower peer may still be reading the previous messages.
// Every dispatch must still equal the oracle.
TEST(Errors, FailedCombinesThenDispatchAgain) {
    BufferConfig cfg{.num_experts = 8, .num_topk = 2, .hidden = 2048, .max_tokens_per_rank = 16};
    cfg.timeout = 10000ms;
    const int r_count = 4;
    auto groups = ThreadGroup::create(r_count);
    std::vector<std::shared_ptr<Buffer>> bufs(static_cast<size_t>(r_count));
    const int rounds = 12;
    std::vector<Scenario> scs;
    std::vector<std::vector<RankData>> datas;
    for (int i = 0; i < rounds; ++i) {
        Scenario sc = scenario_for(cfg, r_count);
        sc.seed = 300 + static_cast<uint64_t>(i);
        sc.tokens = {16, i % 2 ? 16 : 3, 16, 9};
        scs.push_back(sc);
        datas.push_back(make_inputs(sc));
    }
    std::vector<std::vector<Observed>> got(static_cast<size_t>(rounds),
                                           std::vector<Observed>(static_cast<size_t>(r_count)));
    auto errors = run_ranks(r_count, [&](int r) {
        bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        for (int i = 0; i < rounds; ++i) {
            DispatchResult d = bufs[static_cast<size_t>(r)]->dispatch(
                make_args(scs[static_cast<size_t>(i)], datas[static_cast<size_t>(i)][static_cast<size_t>(r)]));
            got[static_cast<size_t>(i)][static_cast<size_t>(r)] = observe(d, cfg);
            std::vector<float> wrong(static_cast<size_t>(d.recv_x.numel()));
            CombineArgs c{.y = TensorRef::contiguous(wrong.data(), DType::kFloat32, d.recv_x.shape)};
            EXPECT_TRUE(throws_error([&] { bufs[static_cast<size_t>(r)]->combine(std::move(d.handle), c); },
                                     ErrorCode::kInvalidArgument, {"bf16"}));
        }
    });
    ASSERT_TRUE(all_ok(errors));
    for (int i = 0; i < rounds; ++i) {
        std::vector<ref::RankInput> inputs;
        for (const RankData& d : datas[static_cast<size_t>(i)]) inputs.push_back(d.in);
        const auto want = ref::dispatch(cfg, r_count, inputs, scs[static_cast<size_t>(i)].opt);
        for (int r = 0; r < r_count; ++r)
            expect_dispatch_equal(want[static_cast<size_t>(r)], got[static_cast<size_t>(i)][static_cast<size_t>(r)],
                                  cfg, false, "round " + std::to_string(i) + " rank " + std::to_string(r));
    }
    run_round(scs[0], groups, bufs, "a complete round afterwards");
}

// ---------------------------------------------------------------------------------------------
// Timeouts

TEST(Errors, PeerThatNeverDispatchesTimesOut) {
    BufferConfig cfg = small_config();
    cfg.num_experts = 6;
    cfg.timeout = 300ms;
    Scenario sc = scenario_for(cfg, 3);
    const auto data = make_inputs(sc);
    auto groups = ThreadGroup::create(3);
    std::vector<std::shared_ptr<Buffer>> bufs(3);
    std::vector<double> waited(3, 0.0);
    std::vector<std::exception_ptr> again(3);
    auto errors = run_ranks(3, [&](int r) {
        bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        if (r == 2) return;  // never calls dispatch
        const auto t0 = std::chrono::steady_clock::now();
        try {
            bufs[static_cast<size_t>(r)]->dispatch(make_args(sc, data[static_cast<size_t>(r)]));
        } catch (...) {
            waited[static_cast<size_t>(r)] =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            // the buffer is unusable now, and says so
            try {
                bufs[static_cast<size_t>(r)]->dispatch(make_args(sc, data[static_cast<size_t>(r)]));
            } catch (...) {
                again[static_cast<size_t>(r)] = std::current_exception();
            }
            throw;
        }
    });
    for (int r = 0; r < 2; ++r) {
        EXPECT_TRUE(is_error(errors[static_cast<size_t>(r)], ErrorCode::kTimeout, {"dispatch", "rank(s) 2", "300 ms"}))
            << "rank " << r;
        EXPECT_GE(waited[static_cast<size_t>(r)], 0.29);
        EXPECT_LT(waited[static_cast<size_t>(r)], 3.0);
        EXPECT_TRUE(is_error(again[static_cast<size_t>(r)], ErrorCode::kTimeout, {"unusable", "build a new one"}));
    }
    EXPECT_FALSE(errors[2]);
    // the process stays usable: a new group and buffer run a good round
    std::vector<std::shared_ptr<Group>> fresh;
    std::vector<std::shared_ptr<Buffer>> fresh_bufs;
    run_round(sc, fresh, fresh_bufs, "fresh buffer after a timeout");
}

TEST(Errors, PeerThatNeverCombinesTimesOut) {
    BufferConfig cfg = small_config();
    cfg.timeout = 300ms;
    Scenario sc = scenario_for(cfg, 2);
    const auto data = make_inputs(sc);
    auto groups = ThreadGroup::create(2);
    std::vector<std::shared_ptr<Buffer>> bufs(2);
    auto errors = run_ranks(2, [&](int r) {
        bufs[static_cast<size_t>(r)] = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        DispatchResult d = bufs[static_cast<size_t>(r)]->dispatch(make_args(sc, data[static_cast<size_t>(r)]));
        if (r == 1) return;  // dispatches, never combines
        std::vector<uint16_t> y(static_cast<size_t>(d.recv_x.numel()), 0);
        bufs[0]->combine(std::move(d.handle), {.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape)});
    });
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kTimeout, {"combine", "rank(s) 1"}));
    EXPECT_FALSE(errors[1]);
    EXPECT_TRUE(throws_error([&] { bufs[0]->check(); }, ErrorCode::kTimeout, {"unusable"}));
    std::vector<std::shared_ptr<Group>> fresh;
    std::vector<std::shared_ptr<Buffer>> fresh_bufs;
    run_round(sc, fresh, fresh_bufs, "fresh buffer after a combine timeout");
}

// ---------------------------------------------------------------------------------------------
// Config validation

TEST(Errors, ConfigValidationMessages) {
    struct ConfigCase {
        std::function<void(BufferConfig&)> mutate;
        int ranks;
        std::vector<std::string> needles;
    };
    const std::vector<ConfigCase> cases = {
        {[](BufferConfig& c) { c.num_experts = 0; }, 1, {"num_experts=0"}},
        {[](BufferConfig& c) { c.num_experts = 6; }, 4, {"num_experts=6", "multiple of the number of ranks (4)"}},
        {[](BufferConfig& c) { c.num_topk = 0; }, 1, {"num_topk=0", "[1, 32]"}},
        {[](BufferConfig& c) {
             c.num_topk = 33;
             c.num_experts = 64;
         },
         1,
         {"num_topk=33"}},
        {[](BufferConfig& c) { c.num_topk = 9; }, 1, {"num_topk=9", "num_experts=8"}},
        {[](BufferConfig& c) { c.hidden = 0; }, 1, {"hidden=0"}},
        {[](BufferConfig& c) { c.hidden = 100; }, 1, {"hidden=100", "multiple of 8"}},
        {[](BufferConfig& c) {
             c.payload = Payload::kFP8;
             c.hidden = 96;
         },
         1,
         {"hidden=96", "(128)", "f32_g128"}},
        {[](BufferConfig& c) {
             c.payload = Payload::kFP8;
             c.scale_format = ScaleFormat::kUE8M0G32;
             c.hidden = 48;
         },
         1,
         {"hidden=48", "(32)", "ue8m0_g32"}},
        {[](BufferConfig& c) { c.max_tokens_per_rank = 0; }, 1, {"max_tokens_per_rank=0"}},
        {[](BufferConfig& c) { c.max_tokens_per_rank = 1 << 28; }, 8, {"too large", "max_tokens_per_rank"}},
        {[](BufferConfig& c) { c.num_sms = -1; }, 1, {"num_sms=-1"}},
        {[](BufferConfig& c) { c.timeout = std::chrono::milliseconds(0); }, 1, {"timeout=0"}},
        {[](BufferConfig& c) { c.ranks_per_node = 3; }, 4, {"ranks_per_node=3", "divide", "0 for all ranks"}},
        {[](BufferConfig& c) { c.ranks_per_node = -2; }, 4, {"ranks_per_node=-2", "divide"}},
        {[](BufferConfig& c) { c.ranks_per_node = 8; }, 4, {"ranks_per_node=8", "divide"}},
        {[](BufferConfig& c) { c.scaleout = ScaleOut::kNccl; }, 4, {"scaleout=nccl", "topology=hybrid", "auto"}},
        {[](BufferConfig& c) {
             c.topology = Topology::kHybrid;
             c.scaleout = static_cast<ScaleOut>(7);
         },
         4,
         {"scaleout=7", "not a ScaleOut"}},
        {[](BufferConfig& c) {
             c.topology = Topology::kHybrid;
             c.ranks_per_node = 3;
         },
         4,
         {"ranks_per_node=3", "divide"}},
        {[](BufferConfig&) {}, 0, {"at least 1"}},
    };
    for (size_t i = 0; i < cases.size(); ++i) {
        BufferConfig c{.num_experts = 8, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = 4};
        cases[i].mutate(c);
        EXPECT_TRUE(throws_error([&] { c.validate(cases[i].ranks); }, ErrorCode::kInvalidArgument, cases[i].needles))
            << "case " << i;
    }
    // valid configs pass
    BufferConfig ok{.num_experts = 8, .num_topk = 8, .hidden = 7168, .max_tokens_per_rank = 128};
    EXPECT_NO_THROW(ok.validate(8));
    ok.payload = Payload::kFP8;
    ok.scale_format = ScaleFormat::kUE8M0G32;
    EXPECT_NO_THROW(ok.validate(4));
    // Buffer::create validates too, and a null group is refused
    auto groups = ThreadGroup::create(1);
    BufferConfig bad{.num_experts = 8, .num_topk = 2, .hidden = 100, .max_tokens_per_rank = 4};
    EXPECT_TRUE(throws_error([&] { Buffer::create(groups[0], bad, BackendKind::kCPU); }, ErrorCode::kInvalidArgument,
                             {"hidden=100"}));
    EXPECT_TRUE(
        throws_error([&] { Buffer::create(nullptr, ok, BackendKind::kCPU); }, ErrorCode::kInvalidArgument, {"null"}));
    // the name parsers list the choices
    EXPECT_TRUE(throws_error([] { parse_scale_format("e5m2"); }, ErrorCode::kInvalidArgument, {"e5m2", "ue8m0_g32"}));
    EXPECT_EQ(parse_layout("masked"), Layout::kExpertMasked);
}

TEST(Errors, RanksWithDifferentConfigs) {
    auto groups = ThreadGroup::create(2, 5000ms);
    auto errors = run_ranks(2, [&](int r) {
        BufferConfig c{.num_experts = 4, .num_topk = 2, .hidden = r == 0 ? 128 : 256, .max_tokens_per_rank = 4};
        Buffer::create(groups[static_cast<size_t>(r)], c, BackendKind::kCPU);
    });
    for (int r = 0; r < 2; ++r)
        EXPECT_TRUE(is_error(errors[static_cast<size_t>(r)], ErrorCode::kInvalidArgument, {"different config"})) << r;
}

// ---------------------------------------------------------------------------------------------
// Zero-row tensors: a rank with no tokens (or no received rows) may pass any strides, since an
// empty tensor addresses no element (numpy reports strides (0, 0) for some empty arrays).

TEST(Errors, ZeroRowTensorsWithAnyStridesAreAccepted) {
    constexpr int kH = 128, kC = 4;
    BufferConfig cfg{.num_experts = 4, .num_topk = 2, .hidden = kH, .max_tokens_per_rank = kC};
    cfg.timeout = 5000ms;
    auto groups = ThreadGroup::create(2, 5000ms);
    std::vector<std::shared_ptr<Buffer>> bufs(2);
    uint16_t dummy[8] = {};
    // Rank 1's tokens; round 0 routes only to rank 1's own experts (rank 0 receives no rows, so its
    // y is empty too), round 1 to both ranks.
    const std::vector<int32_t> idx_rounds[2] = {{2, 3, 3, -1, 2, 3}, {0, 3, 1, 2, 3, 0}};
    const std::vector<float> w1 = {0.5f, 0.25f, 1.0f, 0.0f, -0.75f, 2.0f};
    std::vector<uint16_t> x1(3 * kH);
    for (int i = 0; i < 3 * kH; ++i) x1[static_cast<size_t>(i)] = y_value(7, i / kH, i % kH);
    for (int round = 0; round < 2; ++round) {
        const std::string ctx = "round " + std::to_string(round);
        std::vector<Observed> got(2);
        std::vector<std::vector<uint16_t>> ys(2), outs(2);
        auto errors = run_ranks(2, [&](int r) {
            auto& buf = bufs[static_cast<size_t>(r)];
            if (!buf) buf = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
            DispatchArgs a;
            std::vector<int32_t> idx = idx_rounds[round];
            std::vector<float> w = w1;
            if (r == 0) {  // no tokens, odd strides everywhere
                a.x = TensorRef{nullptr, DType::kBFloat16, {0, kH}, {0, 0}, Device{}};
                a.topk_idx = TensorRef{dummy, DType::kInt32, {0, 2}, {0, 0}, Device{}};
                a.topk_weights = TensorRef{dummy, DType::kFloat32, {0, 2}, {1, 7}, Device{}};
            } else {
                a.x = TensorRef::contiguous(x1.data(), DType::kBFloat16, {3, kH});
                a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {3, 2});
                a.topk_weights = TensorRef::contiguous(w.data(), DType::kFloat32, {3, 2});
            }
            DispatchResult d = buf->dispatch(a);
            Observed o = observe(d, cfg);
            auto& y = ys[static_cast<size_t>(r)];
            for (int64_t row = 0; row < o.rows; ++row)
                for (int h = 0; h < kH; ++h) y.push_back(y_value(r, row, h));
            CombineArgs c;
            if (o.rows == 0) {
                c.y = TensorRef{dummy, DType::kBFloat16, d.recv_x.shape, {0, 0}, Device{}};
            } else {
                c.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape);
            }
            if (r == 0) {
                c.bias = TensorRef{dummy, DType::kBFloat16, {0, kH}, {0, 0}, Device{}};
                c.out = TensorRef{dummy, DType::kBFloat16, {0, kH}, {3, 5}, Device{}};
            }
            CombineResult cr = buf->combine(std::move(d.handle), c);
            EXPECT_EQ(cr.out.shape, (std::vector<int64_t>{r == 0 ? 0 : 3, kH})) << ctx << " rank " << r;
            outs[static_cast<size_t>(r)] = read_2d<uint16_t>(cr.out, r == 0 ? 0 : 3, kH);
            got[static_cast<size_t>(r)] = std::move(o);
        });
        ASSERT_TRUE(all_ok(errors, ctx));
        EXPECT_EQ(got[0].rows, round == 0 ? 0 : 3) << ctx;  // round 1: t0 -> 0, t1 -> 1, t2 -> 0
        std::vector<ref::RankInput> inputs(2);
        inputs[1].num_tokens = 3;
        inputs[1].x = x1;
        inputs[1].topk_idx.assign(idx_rounds[round].begin(), idx_rounds[round].end());
        inputs[1].topk_weights = w1;
        const ref::DispatchOptions opt;
        const auto want = ref::dispatch(cfg, 2, inputs, opt);
        for (int r = 0; r < 2; ++r)
            expect_dispatch_equal(want[static_cast<size_t>(r)], got[static_cast<size_t>(r)], cfg, false,
                                  ctx + " rank " + std::to_string(r));
        const auto want_out = ref::combine(cfg, 2, inputs, opt, ys, true, {});
        EXPECT_TRUE(outs[0].empty()) << ctx;
        EXPECT_EQ(first_diff(outs[1], want_out[1]), -1) << ctx << " rank 1 combine differs from the oracle";
    }
    // Strides still matter as soon as there is a row.
    auto one = ThreadGroup::create(1);
    const BufferConfig one_cfg{.num_experts = 2, .num_topk = 2, .hidden = kH, .max_tokens_per_rank = kC};
    auto buf = Buffer::create(one[0], one_cfg, BackendKind::kCPU);
    std::vector<uint16_t> x(2 * kH, 0);
    std::vector<int32_t> idx = {0, 1, 1, 0};
    DispatchArgs a;
    a.x = TensorRef{x.data(), DType::kBFloat16, {1, kH}, {0, 0}, Device{}};
    a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {1, 2});
    EXPECT_TRUE(throws_error([&] { buf->dispatch(a); }, ErrorCode::kInvalidArgument,
                             {"dispatch: x", "last dimension must be contiguous"}));
    a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {2, kH});
    a.topk_idx = TensorRef{idx.data(), DType::kInt32, {2, 2}, {1, 1}, Device{}};
    EXPECT_TRUE(throws_error([&] { buf->dispatch(a); }, ErrorCode::kInvalidArgument,
                             {"dispatch: topk_idx", "row stride must be at least its row length"}));
}

// ---------------------------------------------------------------------------------------------
// Buffer::create when the backend fails on one rank: that rank raises the backend's own error
// code, the others raise the same code naming it and its reason, and nobody hangs or publishes a buffer.

// Delegates to a ThreadGroup; on `fail_rank` its first barrier (the CPU backend's last step of
// construction) completes and then throws, so the ranks stay in step and only that rank's backend
// construction fails.
class FailingBarrierGroup final : public Group {
 public:
    FailingBarrierGroup(std::shared_ptr<Group> inner, int fail_rank, std::function<void()> fail)
        : inner_(std::move(inner)), fail_rank_(fail_rank), fail_(std::move(fail)) {}
    int rank() const override { return inner_->rank(); }
    int size() const override { return inner_->size(); }
    void all_gather(const void* send, size_t bytes, void* recv) override { inner_->all_gather(send, bytes, recv); }
    void barrier() override {
        inner_->barrier();
        if (armed_ && rank() == fail_rank_) {
            armed_ = false;
            fail_();
        }
    }
    std::string identity() const override { return inner_->identity(); }

 private:
    std::shared_ptr<Group> inner_;
    int fail_rank_;
    std::function<void()> fail_;
    bool armed_ = true;
};

TEST(Errors, CreateFailureOnOneRankKeepsTheBackendsCode) {
    BufferConfig cfg = small_config();
    cfg.num_experts = 6;  // three ranks
    for (ErrorCode code : {ErrorCode::kUnsupported, ErrorCode::kCuda, ErrorCode::kInvalidArgument, ErrorCode::kNccl}) {
        const std::string name = error_code_name(code);
        auto inner = ThreadGroup::create(3, 5000ms);
        std::vector<std::shared_ptr<Group>> groups;
        for (auto& g : inner)
            groups.push_back(
                std::make_shared<FailingBarrierGroup>(g, 1, [code] { throw Error(code, "injected failure"); }));
        auto errors =
            run_ranks(3, [&](int r) { Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU); });
        EXPECT_TRUE(is_error(errors[1], code, {"Buffer::create failed on this rank", "injected failure"})) << name;
        for (int r : {0, 2})  // the peers raise the failed rank's code and reason (issue 10, items 9 and 13)
            EXPECT_TRUE(is_error(errors[static_cast<size_t>(r)], code,
                                 {"Buffer::create failed on rank 1", "injected failure", "nothing was published"}))
                << name << " rank " << r;
        // the groups are still in step: a buffer builds on them and runs a checked round
        std::vector<std::shared_ptr<Buffer>> bufs;
        run_round(scenario_for(cfg, 3), groups, bufs, "after a failed create (" + name + ")");
    }
    // An exception that is not an elasticep::Error: Internal on that rank, no hang on the others.
    auto inner = ThreadGroup::create(2, 5000ms);
    std::vector<std::shared_ptr<Group>> groups;
    for (auto& g : inner)
        groups.push_back(std::make_shared<FailingBarrierGroup>(g, 0, [] { throw std::runtime_error("not ours"); }));
    auto errors = run_ranks(2, [&](int r) { Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU); });
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kInternal, {"failed on this rank", "not ours"}));
    EXPECT_TRUE(is_error(errors[1], ErrorCode::kInternal, {"failed on rank 0"}));
}

}  // namespace
}  // namespace eptest
