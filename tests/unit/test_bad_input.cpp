// The bad-input suite (issue 10): each probe a hostile or careless caller tried, as a test. Every
// case ends in a named elasticep::Error or a documented behaviour; none may crash, hang or write
// outside the buffer's reservation. Each TEST runs as its own CTest process (gtest discovery), so a
// case that used to crash fails that test instead of the whole suite. Peer data forged on the wire
// (item 6) is in test_bad_input_peer.cpp; the Python-only items (3, 12, 14's groups) are in
// tests/python/test_bad_input.py.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <thread>

#include "harness.hpp"

namespace eptest {
namespace {

using namespace std::chrono_literals;

// A Group that forwards to another but lies about what it is.
class LyingGroup final : public Group {
 public:
    LyingGroup(std::shared_ptr<Group> inner, std::optional<int> rank, std::optional<std::string> identity = {})
        : inner_(std::move(inner)), rank_(rank), identity_(std::move(identity)) {}
    int rank() const override { return rank_ ? *rank_ : inner_->rank(); }
    int size() const override { return inner_->size(); }
    void all_gather(const void* send, size_t bytes, void* recv) override { inner_->all_gather(send, bytes, recv); }
    void barrier() override { inner_->barrier(); }
    std::string identity() const override { return identity_ ? *identity_ : inner_->identity(); }

 private:
    std::shared_ptr<Group> inner_;
    std::optional<int> rank_;
    std::optional<std::string> identity_;
};

BufferConfig small(int experts = 4) {
    BufferConfig c{.num_experts = experts, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = 4};
    c.timeout = 5000ms;
    return c;
}

Scenario scenario(const BufferConfig& cfg, int ranks, uint64_t seed = 5) {
    Scenario s;
    s.cfg = cfg;
    s.num_ranks = ranks;
    s.tokens.assign(static_cast<size_t>(ranks), cfg.max_tokens_per_rank);
    s.seed = seed;
    return s;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---------------------------------------------------------------------------------------------
// 1. A ThreadGroup whose round failed is unusable for good, and says so at once (it used to keep
//    the half-finished round: the next collective read a peer's old bytes or an empty slot).

TEST(BadInput, Item01ThreadGroupAfterATimeoutFailsCleanly) {
    auto g = ThreadGroup::create(2, 200ms);
    EXPECT_TRUE(throws_error([&] { g[0]->barrier(); }, ErrorCode::kTimeout, {"rank(s) 1 never arrived"}));
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(throws_error([&] { g[0]->barrier(); }, ErrorCode::kTimeout, {"unusable", "create a new ThreadGroup"}));
    std::vector<int> v(2);
    EXPECT_TRUE(throws_error([&] { g[1]->all_gather(&t0, 4, v.data()); }, ErrorCode::kTimeout, {"unusable"}));
    EXPECT_LT(seconds_since(t0), 0.15) << "a broken group must fail at once, not wait again";
    // a peer waiting when another rank gives up is woken with the reason
    auto g3 = ThreadGroup::create(3, 300ms);
    auto errors = run_ranks(3, [&](int r) {
        if (r == 2) return;  // never arrives
        if (r == 1) std::this_thread::sleep_for(100ms);
        g3[static_cast<size_t>(r)]->barrier();
    });
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kTimeout, {"rank(s) 2 never arrived"}));
    EXPECT_TRUE(is_error(errors[1], ErrorCode::kTimeout, {"unusable", "rank(s) 2 never arrived"}));
    // ranks that call different collectives break the group too, on every rank
    auto gm = ThreadGroup::create(2, 2000ms);
    errors = run_ranks(2, [&](int r) {
        std::vector<char> out(2 * 8);
        const char in[8] = {};
        gm[static_cast<size_t>(r)]->all_gather(in, r == 0 ? 4 : 8, out.data());
    });
    for (auto& e : errors) EXPECT_TRUE(is_error(e, ErrorCode::kInvalidArgument, {"size mismatch"}));
    // a fresh group works
    auto ok = ThreadGroup::create(2, 2000ms);
    ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) { ok[static_cast<size_t>(r)]->barrier(); })));
}

// ---------------------------------------------------------------------------------------------
// 2. hidden is bounded so every message size and offset fits its 32-bit field (hidden = 2^31 - 8
//    used to build a buffer with a 32-byte wire message and crash in the first dispatch).

TEST(BadInput, Item02HiddenHasAnUpperBound) {
    for (int h : {1 << 30, 2147483640, kMaxHidden + 8}) {
        BufferConfig c = small();
        c.hidden = h;
        EXPECT_TRUE(throws_error([&] { c.validate(1); }, ErrorCode::kInvalidArgument,
                                 {"hidden=" + std::to_string(h), "limit of 65536"}))
            << h;
        auto g = ThreadGroup::create(1);
        EXPECT_TRUE(throws_error([&] { Buffer::create(g[0], c, BackendKind::kCPU); }, ErrorCode::kInvalidArgument,
                                 {"hidden="}));
    }
    // the largest hidden works end to end, checked against the oracle
    BufferConfig c{.num_experts = 2, .num_topk = 2, .hidden = kMaxHidden, .max_tokens_per_rank = 2};
    run_scenario(scenario(c, 1));
}

// ---------------------------------------------------------------------------------------------
// 4. Group.rank() is checked: outside [0, size()), or two ranks claiming one number, fail on every
//    rank at create (they used to build a buffer whose first dispatch crashed).

TEST(BadInput, Item04GroupRankIsRangeChecked) {
    const BufferConfig cfg = small();
    for (int lie : {-1, 2, 1000}) {
        auto inner = ThreadGroup::create(2, 5000ms);
        std::vector<std::shared_ptr<Group>> g = {inner[0], std::make_shared<LyingGroup>(inner[1], lie)};
        auto errors = run_ranks(2, [&](int r) { Buffer::create(g[static_cast<size_t>(r)], cfg, BackendKind::kCPU); });
        EXPECT_TRUE(is_error(errors[1], ErrorCode::kInvalidArgument,
                             {"rank() is " + std::to_string(lie), "outside [0, size() = 2)"}))
            << lie;
        EXPECT_TRUE(is_error(errors[0], ErrorCode::kInvalidArgument, {"rank 1 rejected its config", "rank()"})) << lie;
    }
    // both ranks say 0: the gather shows it on every rank
    auto inner = ThreadGroup::create(2, 5000ms);
    std::vector<std::shared_ptr<Group>> g = {inner[0], std::make_shared<LyingGroup>(inner[1], 0)};
    auto errors = run_ranks(2, [&](int r) { Buffer::create(g[static_cast<size_t>(r)], cfg, BackendKind::kCPU); });
    for (int r = 0; r < 2; ++r)
        EXPECT_TRUE(is_error(errors[static_cast<size_t>(r)], ErrorCode::kInvalidArgument,
                             {"rank() is 0", "at position 1", "each once"}))
            << r;
    // the groups' identity must agree as well
    inner = ThreadGroup::create(2, 5000ms);
    g = {inner[0], std::make_shared<LyingGroup>(inner[1], std::nullopt, "something else")};
    errors = run_ranks(2, [&](int r) { Buffer::create(g[static_cast<size_t>(r)], cfg, BackendKind::kCPU); });
    for (int r = 0; r < 2; ++r)
        EXPECT_TRUE(is_error(errors[static_cast<size_t>(r)], ErrorCode::kInvalidArgument, {"identity()"})) << r;
}

// ---------------------------------------------------------------------------------------------
// 5. Buffer-owned outputs are never freed or moved while the buffer lives: a view kept from one
//    layout stays readable after rounds of the other layout (storage used to be reallocated when
//    a masked round needed more than the contiguous one had, freeing what the view pointed to).

TEST(BadInput, Item05ViewsOfBufferOwnedOutputsNeverDangle) {
    BufferConfig cfg{.num_experts = 4, .num_topk = 2, .hidden = 4096, .max_tokens_per_rank = 64};
    Scenario sc = scenario(cfg, 1);
    const auto data = make_inputs(sc);
    auto g = ThreadGroup::create(1);
    auto buf = Buffer::create(g[0], cfg, BackendKind::kCPU);
    auto round = [&](Layout layout, int alignment) {
        Scenario s = sc;
        s.opt.layout = layout;
        s.opt.expert_alignment = alignment;
        DispatchResult d = buf->dispatch(make_args(s, data[0]));
        std::vector<uint16_t> y(static_cast<size_t>(d.recv_x.numel()), bf16(1.0f));
        TensorRef x = d.recv_x;
        CombineResult c =
            buf->combine(std::move(d.handle), {.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape)});
        return std::make_pair(x, c.out);
    };
    auto read_all = [](const TensorRef& t) {  // touches every byte the view spans
        uint64_t sum = 0;
        const auto* p = static_cast<const uint8_t*>(t.data);
        for (size_t i = 0; i < t.nbytes(); ++i) sum += p[i];
        return sum;
    };
    const auto [first_x, first_out] = round(Layout::kExpertContiguous, 1);
    const auto [masked_x, masked_out] = round(Layout::kExpertMasked, 1);  // larger than the contiguous storage
    EXPECT_GT(masked_x.nbytes(), first_x.nbytes());
    read_all(first_x);
    read_all(first_out);
    const auto [again_x, again_out] = round(Layout::kExpertContiguous, 1);
    EXPECT_EQ(again_x.data, first_x.data) << "a layout's storage stays put while its alignment does";
    EXPECT_EQ(again_out.data, first_out.data) << "the combine output is sized for the worst case once";
    const auto [masked2_x, masked2_out] = round(Layout::kExpertMasked, 1);
    EXPECT_EQ(masked2_x.data, masked_x.data);
    // a larger alignment needs more rows: new storage, the old view still readable
    const auto [aligned_x, aligned_out] = round(Layout::kExpertContiguous, 64);
    EXPECT_NE(aligned_x.data, first_x.data);
    read_all(first_x);
    read_all(masked_x);
    // and the results are still right
    std::vector<std::shared_ptr<Buffer>> bufs{buf};
    run_round(sc, g, bufs, "after layout switches");
}

// ---------------------------------------------------------------------------------------------
// 7. Timeouts have a range: huge ones are refused with the limit (1e10 s used to wrap the steady
//    clock and time out at once; inf printed a negative millisecond count).

TEST(BadInput, Item07HugeTimeoutsAreRefusedWithTheRange) {
    BufferConfig c = small();
    for (int64_t ms : {int64_t{10000000000000}, kMaxTimeout.count() + 1, std::numeric_limits<int64_t>::max()}) {
        c.timeout = std::chrono::milliseconds(ms);
        EXPECT_TRUE(throws_error([&] { c.validate(1); }, ErrorCode::kInvalidArgument,
                                 {"timeout=" + std::to_string(ms), "limit of 604800000 ms (7 days)"}))
            << ms;
        EXPECT_TRUE(throws_error([&] { ThreadGroup::create(2, std::chrono::milliseconds(ms)); },
                                 ErrorCode::kInvalidArgument, {"ThreadGroup::create: timeout", "7 days"}));
    }
    c.timeout = std::chrono::milliseconds(-5);
    EXPECT_TRUE(throws_error([&] { c.validate(1); }, ErrorCode::kInvalidArgument, {"timeout=-5", "positive"}));
    EXPECT_TRUE(throws_error([&] { ThreadGroup::create(2, 0ms); }, ErrorCode::kInvalidArgument, {"positive"}));
    // the largest timeout is a real bound, not an instant one: a round completes under it
    c.timeout = kMaxTimeout;
    auto g = ThreadGroup::create(2, kMaxTimeout);
    std::vector<std::shared_ptr<Buffer>> bufs;
    run_round(scenario(c, 2), g, bufs, "7-day timeout");
}

// ---------------------------------------------------------------------------------------------
// 8. A Buffer takes one call at a time: a second thread entering while a call runs gets an error
//    naming the call in progress (two threads on one buffer used to mix their rounds silently).

TEST(BadInput, Item08SecondThreadOnOneBufferIsToldWhichCallHoldsIt) {
    const BufferConfig cfg = small();
    Scenario sc = scenario(cfg, 2);
    const auto data = make_inputs(sc);
    auto g = ThreadGroup::create(2, 10000ms);
    std::vector<std::shared_ptr<Buffer>> bufs(2);
    ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) {
        bufs[static_cast<size_t>(r)] = Buffer::create(g[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
    })));
    // Two threads dispatch on rank 0's buffer while rank 1 is late: one gets in (and waits for
    // rank 1), the other is refused at once; rank 1 then completes the round of the one inside.
    std::vector<std::exception_ptr> errs(2);
    std::vector<std::optional<DispatchResult>> res(2);
    std::atomic<int> refused{0};
    std::vector<std::thread> th;
    for (int i = 0; i < 2; ++i)
        th.emplace_back([&, i] {
            try {
                res[static_cast<size_t>(i)] = bufs[0]->dispatch(make_args(sc, data[0]));
            } catch (...) {
                errs[static_cast<size_t>(i)] = std::current_exception();
                ++refused;
            }
        });
    const auto t0 = std::chrono::steady_clock::now();
    while (refused.load() == 0 && seconds_since(t0) < 5.0) std::this_thread::sleep_for(1ms);
    std::exception_ptr check_err;
    try {
        bufs[0]->check();  // a third caller, while the dispatch still waits for rank 1
    } catch (...) {
        check_err = std::current_exception();
    }
    DispatchResult d1 = bufs[1]->dispatch(make_args(sc, data[1]));
    for (auto& t : th) t.join();
    ASSERT_EQ(refused.load(), 1) << describe(errs[0]) << " / " << describe(errs[1]);
    const int inside = errs[0] ? 1 : 0;
    EXPECT_TRUE(is_error(errs[static_cast<size_t>(1 - inside)], ErrorCode::kInvalidArgument,
                         {"Buffer::dispatch called from thread", "is inside Buffer::dispatch", "one call at a time"}));
    EXPECT_TRUE(is_error(check_err, ErrorCode::kInvalidArgument, {"Buffer::check", "inside Buffer::dispatch"}));
    // the refused call changed nothing: the round of the call that got in completes, and is right
    ASSERT_TRUE(res[static_cast<size_t>(inside)].has_value());
    std::vector<ref::RankInput> inputs = {data[0].in, data[1].in};
    const auto want = ref::dispatch(cfg, 2, inputs, sc.opt);
    expect_dispatch_equal(want[0], observe(*res[static_cast<size_t>(inside)], cfg), cfg, false, "rank 0");
    expect_dispatch_equal(want[1], observe(d1, cfg), cfg, false, "rank 1");
    std::vector<uint16_t> y0(static_cast<size_t>(res[static_cast<size_t>(inside)]->recv_x.numel()));
    std::vector<uint16_t> y1(static_cast<size_t>(d1.recv_x.numel()));
    ASSERT_TRUE(all_ok(run_ranks(2, [&](int r) {
        auto& d = r == 0 ? *res[static_cast<size_t>(inside)] : d1;
        auto& y = r == 0 ? y0 : y1;
        bufs[static_cast<size_t>(r)]->combine(std::move(d.handle),
                                              {.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape)});
    })));
    run_round(sc, g, bufs, "after the refused call");
}

// A rank's Group used from two threads at once is refused as well (ThreadGroup): the second entry
// into a collective the rank already waits in breaks the group with that reason, on every thread.
TEST(BadInput, Item08OneRanksGroupFromTwoThreadsIsRefused) {
    auto g = ThreadGroup::create(2, 5000ms);
    std::vector<std::exception_ptr> errs(2);
    std::vector<std::thread> th;
    for (int i = 0; i < 2; ++i)
        th.emplace_back([&, i] {
            try {
                g[0]->barrier();  // both threads play rank 0; rank 1 never comes
            } catch (...) {
                errs[static_cast<size_t>(i)] = std::current_exception();
            }
        });
    for (auto& t : th) t.join();
    for (int i = 0; i < 2; ++i)
        EXPECT_TRUE(is_error(errs[static_cast<size_t>(i)], ErrorCode::kInvalidArgument,
                             {"rank 0 entered a collective it is already waiting in"}))
            << describe(errs[static_cast<size_t>(i)]);
}

// ---------------------------------------------------------------------------------------------
// 9. A rank that rejects its own config is heard by every rank at once (it used to skip the first
//    collective, and its peers waited the group's timeout to learn only "never arrived").

TEST(BadInput, Item09ConfigRejectedOnOneRankFailsEveryRankPromptly) {
    auto g = ThreadGroup::create(3, 20000ms);  // a long group timeout: the test must not come near it
    const auto t0 = std::chrono::steady_clock::now();
    auto errors = run_ranks(3, [&](int r) {
        BufferConfig c = small(6);
        if (r == 1) c.hidden = 100;
        Buffer::create(g[static_cast<size_t>(r)], c, BackendKind::kCPU);
    });
    EXPECT_LT(seconds_since(t0), 2.0);
    EXPECT_TRUE(is_error(errors[1], ErrorCode::kInvalidArgument, {"hidden=100", "multiple of 8"}));
    for (int r : {0, 2})
        EXPECT_TRUE(is_error(errors[static_cast<size_t>(r)], ErrorCode::kInvalidArgument,
                             {"rank 1 rejected its config", "hidden=100", "multiple of 8"}))
            << r;
    // the group is still in step: the same ranks build a good buffer on it and run a checked round
    std::vector<std::shared_ptr<Buffer>> bufs;
    run_round(scenario(small(6), 3), g, bufs, "after a rejected config");
    // a backend this build cannot serve is a rejection too, with its own code
    if (!Buffer::backend_available(BackendKind::kCUDA)) {
        auto g2 = ThreadGroup::create(2, 20000ms);
        errors = run_ranks(2, [&](int r) {
            Buffer::create(g2[static_cast<size_t>(r)], small(), r == 0 ? BackendKind::kCPU : BackendKind::kCUDA);
        });
        EXPECT_TRUE(is_error(errors[1], ErrorCode::kUnsupported, {"CUDA"}));
        EXPECT_TRUE(is_error(errors[0], ErrorCode::kUnsupported, {"rank 1 rejected its config"}));
    }
}

// ---------------------------------------------------------------------------------------------
// 10. Two live groups with one identity() do not share a cached buffer silently.

TEST(BadInput, Item10TwoGroupsWithOneIdentityAreRefused) {
    reset_buffers();
    auto a = std::make_shared<LyingGroup>(ThreadGroup::create(1)[0], std::nullopt, "same-identity");
    auto b = std::make_shared<LyingGroup>(ThreadGroup::create(1)[0], std::nullopt, "same-identity");
    auto ba = get_buffer(a, small(2), BackendKind::kCPU);
    EXPECT_EQ(get_buffer(a, small(2), BackendKind::kCPU), ba);
    EXPECT_TRUE(throws_error([&] { get_buffer(b, small(2), BackendKind::kCPU); }, ErrorCode::kInvalidArgument,
                             {"same-identity", "another Group object with the same identity()", "reset_buffers"}));
    reset_buffers();
    auto bb = get_buffer(b, small(2), BackendKind::kCPU);
    EXPECT_EQ(bb->group(), b);
    reset_buffers();
}

// ---------------------------------------------------------------------------------------------
// 11. One handle rule in C++: every failed combine consumes its handle, so the next dispatch on
//     the buffer that made it may go (the Python layer follows the same rule: test_bad_input.py).

TEST(BadInput, Item11EveryFailedCombineConsumesItsHandle) {
    BufferConfig cfg = small(2);
    Scenario sc = scenario(cfg, 1);
    sc.has_weights = false;
    sc.weighted = false;
    const auto data = make_inputs(sc);
    auto g = ThreadGroup::create(1);
    auto buf = Buffer::create(g[0], cfg, BackendKind::kCPU);
    auto other = Buffer::create(g[0], cfg, BackendKind::kCPU);
    std::vector<float> f32(4096);
    std::vector<uint16_t> y(4096);
    const std::vector<std::pair<std::string, std::function<void(DispatchResult&)>>> failures = {
        {"y dtype",
         [&](DispatchResult& d) {
             buf->combine(std::move(d.handle),
                          {.y = TensorRef::contiguous(f32.data(), DType::kFloat32, d.recv_x.shape)});
         }},
        {"y shape",
         [&](DispatchResult& d) {
             buf->combine(std::move(d.handle), {.y = TensorRef::contiguous(y.data(), DType::kBFloat16, {1, 128})});
         }},
        {"weighted without weights",
         [&](DispatchResult& d) {
             buf->combine(std::move(d.handle),
                          {.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape), .weighted = true});
         }},
        {"misaligned y",
         [&](DispatchResult& d) {
             buf->combine(std::move(d.handle), {.y = TensorRef::contiguous(reinterpret_cast<uint8_t*>(y.data()) + 1,
                                                                           DType::kBFloat16, d.recv_x.shape),
                                                .weighted = false});
         }},
        {"another buffer",
         [&](DispatchResult& d) {
             other->combine(
                 std::move(d.handle),
                 {.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape), .weighted = false});
         }},
    };
    for (const auto& failure : failures) {
        DispatchResult d = buf->dispatch(make_args(sc, data[0]));
        EXPECT_TRUE(throws_error([&] { failure.second(d); }, ErrorCode::kInvalidArgument)) << failure.first;
        EXPECT_FALSE(d.handle.valid()) << failure.first;
    }
    std::vector<std::shared_ptr<Buffer>> bufs{buf};
    run_round(sc, g, bufs, "after failed combines");
}

// ---------------------------------------------------------------------------------------------
// 12 (C++ side). scale_columns checks hidden (it returned -6 for hidden = -1000).

TEST(BadInput, Item12ScaleColumnsChecksHidden) {
    for (int h : {-1000, 0, kMaxHidden + 1})
        EXPECT_TRUE(throws_error([&] { scale_columns(ScaleFormat::kF32G128, h); }, ErrorCode::kInvalidArgument,
                                 {"hidden=" + std::to_string(h), "[1, 65536]"}))
            << h;
    EXPECT_EQ(scale_columns(ScaleFormat::kUE8M0G128, 7168), 14);
    EXPECT_TRUE(throws_error([] { scale_columns(static_cast<ScaleFormat>(9), 128); }, ErrorCode::kInvalidArgument,
                             {"not a ScaleFormat"}));
}

// ---------------------------------------------------------------------------------------------
// 13. A reservation the host cannot hold is CapacityExceeded with the fix, on every rank (it was
//     "[Internal] mmap of N bytes failed" on rank 0 and a bare "failed on rank 0" elsewhere).

TEST(BadInput, Item13OutOfMemoryAtCreateIsCapacityExceededOnEveryRank) {
    const double host = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
    BufferConfig c{.num_experts = 2, .num_topk = 1, .hidden = kMaxHidden, .max_tokens_per_rank = 1};
    // two ranks: the arena is about 4 * C * 4 * hidden bytes; ask for twice the host's memory
    const double per_token = 4.0 * 4.0 * kMaxHidden;
    c.max_tokens_per_rank = static_cast<int>(std::min(2.0 * host / per_token + 1.0, double(1 << 28)));
    ASSERT_NO_THROW(c.validate(2));
    auto g = ThreadGroup::create(2, 20000ms);
    auto errors = run_ranks(2, [&](int r) { Buffer::create(g[static_cast<size_t>(r)], c, BackendKind::kCPU); });
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kCapacityExceeded,
                         {"failed on this rank", "lower max_tokens_per_rank", "memory"}));
    EXPECT_TRUE(is_error(errors[1], ErrorCode::kCapacityExceeded, {"rank 0", "lower max_tokens_per_rank"}));
    // nothing leaked into the group: a small buffer builds on it
    std::vector<std::shared_ptr<Buffer>> bufs;
    run_round(scenario(small(), 2), g, bufs, "after a failed reservation");
}

// ---------------------------------------------------------------------------------------------
// 14 (C++ side). Ranks whose configs differ are told which field differs, with both values (two
// bf16 configs differing only in scale_format used to print two identical descriptions).

TEST(BadInput, Item14ConfigMismatchNamesTheField) {
    auto g = ThreadGroup::create(2, 5000ms);
    auto errors = run_ranks(2, [&](int r) {
        BufferConfig c = small();
        if (r == 1) c.scale_format = ScaleFormat::kUE8M0G128;
        Buffer::create(g[static_cast<size_t>(r)], c, BackendKind::kCPU);
    });
    for (int r = 0; r < 2; ++r)
        EXPECT_TRUE(is_error(
            errors[static_cast<size_t>(r)], ErrorCode::kInvalidArgument,
            {"rank 1 passed a different config", "scale_format", "ue8m0_g128 on rank 1", "f32_g128 on rank 0"}))
            << r;
    errors = run_ranks(2, [&](int r) {
        BufferConfig c = small();
        c.max_tokens_per_rank = 4 + r;
        c.timeout = std::chrono::milliseconds(5000 + r);
        Buffer::create(g[static_cast<size_t>(r)], c, BackendKind::kCPU);
    });
    EXPECT_TRUE(is_error(errors[0], ErrorCode::kInvalidArgument,
                         {"max_tokens_per_rank: 5 on rank 1, 4 on rank 0", "timeout_ms: 5001 on rank 1"}));
}

// ---------------------------------------------------------------------------------------------
// CUDA-relevant checks in the shared front end: every typed tensor must be aligned to its element
// size (the kernels load ids, weights and scales as typed values; a misaligned one is a fault that
// kills a CUDA context), and the masked slab's row indices must fit int32.

TEST(BadInput, MisalignedTensorsAreRejectedNamingTheTensorAndAddress) {
    BufferConfig cfg = small(2);
    BufferConfig fp8 = cfg;
    fp8.payload = Payload::kFP8;
    auto g = ThreadGroup::create(1);
    auto buf = Buffer::create(g[0], cfg, BackendKind::kCPU);
    auto buf8 = Buffer::create(g[0], fp8, BackendKind::kCPU);
    const int64_t t = 2, h = 128;
    std::vector<uint64_t> mem(8192);  // 8-byte aligned storage, sliced at odd byte offsets below
    auto at = [&](size_t byte) { return reinterpret_cast<uint8_t*>(mem.data()) + byte; };
    std::vector<uint16_t> x(t * h, bf16(1.0f));
    std::vector<uint8_t> x8(t * h, 0x38);
    std::vector<float> sc(t, 1.0f);
    std::vector<int64_t> idx = {0, 1, 1, 0};
    std::vector<float> w(4, 0.5f);
    auto good = [&] {
        DispatchArgs a;
        a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {t, h});
        a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt64, {t, 2});
        a.topk_weights = TensorRef::contiguous(w.data(), DType::kFloat32, {t, 2});
        return a;
    };
    struct Case {
        const char* name;
        std::function<void(DispatchArgs&)> mutate;
        bool fp8;
    };
    const std::vector<Case> cases = {
        {"dispatch: topk_idx", [&](DispatchArgs& a) { a.topk_idx.data = at(4); }, false},  // int64 at 4 bytes
        {"dispatch: topk_idx",
         [&](DispatchArgs& a) {
             a.topk_idx.dtype = DType::kInt32;
             a.topk_idx.data = at(2);
         },
         false},
        {"dispatch: topk_weights", [&](DispatchArgs& a) { a.topk_weights->data = at(1); }, false},
        {"dispatch: x", [&](DispatchArgs& a) { a.x.data = at(1); }, false},
        {"dispatch: x_scales",
         [&](DispatchArgs& a) {
             a.x = TensorRef::contiguous(x8.data(), DType::kFloat8E4M3, {t, h});
             a.x_scales = TensorRef::contiguous(at(3), DType::kFloat32, {t, 1});
         },
         true},
        {"dispatch: caller-provided output",
         [&](DispatchArgs& a) {
             a.outputs.recv_weights = TensorRef::contiguous(at(2), DType::kFloat32, {buf->max_contiguous_rows(1)});
         },
         false},
    };
    for (const Case& c : cases) {
        DispatchArgs a = good();
        c.mutate(a);
        EXPECT_TRUE(throws_error([&] { (c.fp8 ? buf8 : buf)->dispatch(a); }, ErrorCode::kInvalidArgument,
                                 {c.name, "has data pointer 0x", "not aligned to its", "copy it"}))
            << c.name;
    }
    // combine: bias and out too
    DispatchResult d = buf->dispatch(good());
    std::vector<uint16_t> y(static_cast<size_t>(d.recv_x.numel()));
    CombineArgs c{.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape)};
    c.bias = TensorRef::contiguous(at(1), DType::kBFloat16, {t, h});
    EXPECT_TRUE(throws_error([&] { buf->combine(std::move(d.handle), c); }, ErrorCode::kInvalidArgument,
                             {"combine: bias", "not aligned to its 2-byte elements"}));
    d = buf->dispatch(good());
    c.bias.reset();
    c.out = TensorRef::contiguous(at(3), DType::kBFloat16, {t, h});
    EXPECT_TRUE(throws_error([&] { buf->combine(std::move(d.handle), c); }, ErrorCode::kInvalidArgument,
                             {"combine: out", "not aligned"}));
    std::vector<std::shared_ptr<Buffer>> bufs{buf};
    std::vector<std::shared_ptr<Group>> gs = g;
    run_round(scenario(cfg, 1), gs, bufs, "after misaligned tensors");
}

TEST(BadInput, MaskedRowIndicesFitInt32) {
    BufferConfig c{.num_experts = 1 << 16, .num_topk = 1, .hidden = 128, .max_tokens_per_rank = 1 << 15};
    EXPECT_TRUE(throws_error([&] { c.validate(1); }, ErrorCode::kInvalidArgument,
                             {"num_experts * max_tokens_per_rank = 2147483648", "int32", "lower max_tokens_per_rank"}));
    c.max_tokens_per_rank = (1 << 15) - 1;
    EXPECT_NO_THROW(c.validate(1));
    c.num_experts = kMaxExperts + 1;
    c.max_tokens_per_rank = 1;
    EXPECT_TRUE(throws_error([&] { c.validate(1); }, ErrorCode::kInvalidArgument, {"num_experts=65537", "limit"}));
}

// Shapes, strides and enum values no real tensor has: refused before anything reads them.
TEST(BadInput, ImpossibleShapesStridesAndEnumsAreRefused) {
    BufferConfig cfg = small(2);
    auto g = ThreadGroup::create(1);
    auto buf = Buffer::create(g[0], cfg, BackendKind::kCPU);
    std::vector<uint16_t> x(2 * 128);
    std::vector<int32_t> idx = {0, 1, 1, 0};
    DispatchArgs a;
    a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {-3, 128});
    a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {-3, 2});
    EXPECT_TRUE(throws_error([&] { buf->dispatch(a); }, ErrorCode::kInvalidArgument, {"negative"}));
    a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {2, 128});
    a.x.strides = {int64_t{1} << 61, 1};
    a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {2, 2});
    EXPECT_TRUE(throws_error([&] { buf->dispatch(a); }, ErrorCode::kInvalidArgument, {"row stride", "spans more"}));
    a.x.strides.clear();
    a.layout = static_cast<Layout>(7);
    EXPECT_TRUE(throws_error([&] { buf->dispatch(a); }, ErrorCode::kInvalidArgument, {"layout=7", "not a Layout"}));
    BufferConfig bad = cfg;
    bad.payload = static_cast<Payload>(5);
    EXPECT_TRUE(throws_error([&] { bad.validate(1); }, ErrorCode::kInvalidArgument, {"payload=5"}));
    bad = cfg;
    bad.device = -2;
    EXPECT_TRUE(throws_error([&] { bad.validate(1); }, ErrorCode::kInvalidArgument, {"device=-2"}));
    bad = cfg;
    bad.num_sms = kMaxSms + 1;
    EXPECT_TRUE(throws_error([&] { bad.validate(1); }, ErrorCode::kInvalidArgument, {"num_sms=1025", "[0, 1024]"}));
    EXPECT_TRUE(throws_error([&] { buf->max_contiguous_rows(kMaxExpertAlignment + 1); }, ErrorCode::kInvalidArgument,
                             {"expert_alignment=65537"}));
    EXPECT_TRUE(throws_error([] { ThreadGroup::create(0); }, ErrorCode::kInvalidArgument, {"num_ranks=0"}));
}

}  // namespace
}  // namespace eptest
