// The CUDA backend's reservation (src/core/protocol.hpp, cuda_reservation_of; docs/PERFORMANCE.md,
// "Memory"): the formula against numbers worked out here by hand, and the window and workspace the
// backend carves (src/kernels/common/buffer_layout.hpp, host-usable) against the formula. CPU only:
// the arithmetic needs no GPU.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/protocol.hpp"
#include "elasticep/config.hpp"
#include "kernels/common/buffer_layout.hpp"

namespace eptest {
namespace {

using elasticep::BufferConfig;
using elasticep::Payload;
using elasticep::ScaleFormat;
namespace detail = elasticep::detail;
namespace kernels = elasticep::kernels;

constexpr int64_t kGiB = int64_t{1} << 30;

BufferConfig deepseek(int capacity) {
    BufferConfig c;
    c.num_experts = 256;
    c.num_topk = 8;
    c.hidden = 7168;
    c.max_tokens_per_rank = capacity;
    c.payload = Payload::kFP8;
    c.scale_format = ScaleFormat::kF32G128;
    return c;
}

kernels::Shape shape_of(const BufferConfig& c, int ranks, int ring, bool direct) {
    kernels::Shape s{};
    s.num_ranks = ranks;
    s.num_experts = c.num_experts;
    s.num_local_experts = c.num_experts / ranks;
    s.num_topk = c.num_topk;
    s.hidden = c.hidden;
    s.capacity = c.max_tokens_per_rank;
    s.msg = detail::message_layout(c);
    s.ring = ring;
    s.direct = direct;
    return s;
}

// EP128, C = 8192, H = 7168, fp8: the target (<= 4 GiB per rank for host-sync prefill).
TEST(CudaReservation, Ep128PrefillIsBoundedIndependentlyOfRanksTimesCapacity) {
    const BufferConfig c = deepseek(8192);
    const int r = 128;
    // a message: 7168 fp8 + 56 fp32 scales (224) + 8 ids (32) + 8 weights (32) + source (16)
    const int64_t msg = 7168 + 224 + 32 + 32 + 16;
    ASSERT_EQ(detail::message_layout(c).bytes, msg);
    const int64_t slot = msg + 8 * 4;          // and its route-position row
    const int64_t ring = kGiB / (128 * slot);  // 1 GiB staging budget over 128 senders
    ASSERT_EQ(ring, 1117);
    const detail::CudaReservation got = detail::cuda_reservation(c, r);
    EXPECT_EQ(got.ring, ring);
    EXPECT_EQ(got.dispatch_ring, 128 * ring * slot);
    EXPECT_EQ(got.combine_slots, int64_t{8192} * 8 * 7168 * 2);  // C * min(K, R) partial rows
    EXPECT_EQ(got.route_tables, int64_t{128} * 8192 * 8 * 8 + int64_t{8192} * 8 * 12);
    EXPECT_EQ(got.combine_out, int64_t{8192} * 7168 * 2);
    EXPECT_EQ(got.graph_extension, int64_t{128} * (8192 - ring) * slot);
    EXPECT_EQ(got.staged(), got.dispatch_ring + got.combine_slots + got.route_tables + got.combine_out);
    EXPECT_LE(got.staged(), 4 * kGiB) << "host-sync prefill reservation " << got.staged() / double(kGiB) << " GiB";
    // the fixed graph-mode worst case is R * C message slots, as before, plus the compact combine slots
    EXPECT_EQ(got.staged_graph_mode(), got.staged() + got.graph_extension);
    // what the window used to hold: R * C messages and R * C partial rows (21.5 GiB)
    const detail::Reservation old = detail::reservation(c, r);
    EXPECT_GT(old.dispatch_slots + old.combine_slots, 21 * kGiB);
    EXPECT_LT(got.staged(), (old.dispatch_slots + old.combine_slots) / 8);
}

// The window and workspace the backend carves hold what the formula counts, plus flags, counts and
// 256-byte alignment (a few hundred KB here).
TEST(CudaReservation, CarvedWindowAndWorkspaceMatchTheFormula) {
    const BufferConfig c = deepseek(8192);
    const int r = 128;
    const detail::CudaReservation f = detail::cuda_reservation(c, r);
    const kernels::Shape staged = shape_of(c, r, f.ring, false);
    EXPECT_EQ(staged.ring_slots(), f.ring);
    const int64_t window = kernels::RegionLayout::make(staged).bytes;
    const int64_t ws = kernels::Workspace::carve(staged, nullptr).bytes;
    const int64_t carved = window + ws + f.combine_out;
    EXPECT_GE(carved, f.staged());
    EXPECT_LE(carved, f.staged() + (int64_t{1} << 20)) << "carved " << carved << ", formula " << f.staged();
    // the full ring (graph mode)
    const kernels::Shape full = shape_of(c, r, 0, false);
    const int64_t full_window = kernels::RegionLayout::make(full).bytes;
    EXPECT_GE(full_window - window, f.graph_extension - 4096);
    EXPECT_LE(full_window - window, f.graph_extension + 4096);
    // the direct path's window has no slots: flags, counts and published pointers only
    const kernels::Shape direct = shape_of(c, r, 0, true);
    const int64_t direct_window = kernels::RegionLayout::make(direct).bytes;
    EXPECT_LT(direct_window, int64_t{1} << 20);
    const int64_t direct_carved = direct_window + kernels::Workspace::carve(direct, nullptr).bytes + f.combine_out;
    EXPECT_GE(direct_carved, f.direct);
    EXPECT_LE(direct_carved, f.direct + (int64_t{1} << 20));
    EXPECT_EQ(f.direct, int64_t{8192} * 8 * 20 + int64_t{8192} * 7168 * 2);
}

TEST(CudaReservation, SmallBuffersKeepTheWholeRing) {
    // EP8, C = 4096: R * C slots fit the budget, so nothing streams and graph mode adds nothing
    const detail::CudaReservation f = detail::cuda_reservation(deepseek(4096), 8);
    EXPECT_EQ(f.ring, 4096);
    EXPECT_EQ(f.graph_extension, 0);
    EXPECT_EQ(f.combine_slots, int64_t{4096} * 8 * 7168 * 2);  // min(K, R) = 8 = R: as large as R * C rows
    // a ring never shrinks below kMinRingSlots (or C)
    EXPECT_EQ(detail::staging_ring_slots(1024, 100000, 8, 7472, 1 << 20), detail::kMinRingSlots);
    EXPECT_EQ(detail::staging_ring_slots(1024, 10, 8, 7472, 1 << 20), 10);
    // compact combine slots: one per message an origin sends, at most C * min(K, R)
    EXPECT_EQ(detail::combine_slot_rows(4, 6, 8), 24);
    EXPECT_EQ(detail::combine_slot_rows(64, 6, 8), 48);
}

TEST(CudaReservation, RingSlotsAddressTheRing) {
    const BufferConfig c = deepseek(10);
    const kernels::Shape s = shape_of(c, 4, 3, false);
    const kernels::RegionLayout g = kernels::RegionLayout::make(s);
    ASSERT_EQ(g.ring, 3);
    // sender 2's message j = 7 (round 2) goes to ring slot 2 * 3 + 7 % 3
    EXPECT_EQ(g.ring_slot(2, 7), 7);
    EXPECT_EQ(g.message(g.ring_slot(2, 7)), g.dispatch_slots + 7 * s.msg.bytes);
    EXPECT_EQ(g.route_pos - g.dispatch_slots, elasticep::round_up(int64_t{4} * 3 * s.msg.bytes, 256));
    EXPECT_EQ(g.combine_slot(5) - g.combine_slot(4), int64_t{c.hidden} * 2);
}

}  // namespace
}  // namespace eptest
