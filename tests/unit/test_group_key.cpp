// The config agreement of Buffer::create: every field must match across ranks except `device`,
// which is per rank (one rank per GPU passes device = its GPU).
#include "harness.hpp"

namespace eptest {
namespace {

BufferConfig small_config() {
    BufferConfig c;
    c.num_experts = 4;
    c.num_topk = 2;
    c.hidden = 64;
    c.max_tokens_per_rank = 4;
    return c;
}

TEST(GroupKey, DeviceIsPerRankEverythingElseIsShared) {
    BufferConfig a = small_config(), b = small_config();
    b.device = 1;
    EXPECT_EQ(a.group_key(), b.group_key());
    EXPECT_NE(a.key(), b.key());  // the per-process registry still tells them apart
    b = small_config();
    b.num_sms = 8;
    EXPECT_NE(a.group_key(), b.group_key());
    b = small_config();
    b.timeout = std::chrono::milliseconds(1234);
    EXPECT_NE(a.group_key(), b.group_key());
}

TEST(GroupKey, RanksWithDifferentDevicesBuildOneBuffer) {
    auto groups = ThreadGroup::create(2, std::chrono::seconds(20));
    const auto errors = run_ranks(2, [&](int r) {
        BufferConfig c = small_config();
        c.device = r;  // ignored by the CPU backend, agreed on by nobody
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], c, BackendKind::kCPU);
        EXPECT_EQ(buf->num_ranks(), 2);
    });
    all_ok(errors, "different devices");
}

TEST(GroupKey, RanksWithDifferentCapacityAreRejected) {
    auto groups = ThreadGroup::create(2, std::chrono::seconds(20));
    const auto errors = run_ranks(2, [&](int r) {
        BufferConfig c = small_config();
        c.max_tokens_per_rank = 4 + r;
        Buffer::create(groups[static_cast<size_t>(r)], c, BackendKind::kCPU);
    });
    for (const auto& e : errors) EXPECT_TRUE(is_error(e, ErrorCode::kInvalidArgument, {"different config"}));
}

}  // namespace
}  // namespace eptest
