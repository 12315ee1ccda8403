// A case small enough to check by hand: R=2, E=4 (rank 0 holds experts 0, 1; rank 1 holds 2, 3),
// K=2, H=128, C=4, bf16. Token rows are constants; the "expert" e multiplies its rows by e+1, so
// every expected number below is worked out on paper.
//
//   rank 0: t0 = 1.0 -> experts [0, 2] weights [0.5, 0.25]
//           t1 = 2.0 -> experts [3, -1] weights [1.0, 0.0]
//           t2 = 3.0 -> experts [1, 0] weights [0.75, 0.125]
//   rank 1: t0 = 4.0 -> experts [2, 3] weights [0.5, 0.5]
//           t1 = 5.0 -> experts [0, 3] weights [2.0, 1.0]
#include "harness.hpp"

namespace eptest {
namespace {

constexpr int kH = 128;
constexpr int kC = 4;

struct HandRank {
    std::vector<float> values;
    std::vector<int32_t> idx;
    std::vector<float> w;
};

const HandRank kRanks[2] = {
    {{1.0f, 2.0f, 3.0f}, {0, 2, 3, -1, 1, 0}, {0.5f, 0.25f, 1.0f, 0.0f, 0.75f, 0.125f}},
    {{4.0f, 5.0f}, {2, 3, 0, 3}, {0.5f, 0.5f, 2.0f, 1.0f}},
};

struct HandResult {
    std::vector<float> row_values;  // recv_x rows (constant across channels; NaN marks a padding row)
    std::vector<int32_t> m_indices, recv_src, counts, offsets;
    std::vector<float> weights;
    int64_t num_rows = -1;
    std::vector<int64_t> x_shape;
    std::vector<float> out;  // per token (constant across channels)
    bool rows_constant = true, out_constant = true;
};

// Runs the hand case on both ranks. y = recv_x * (global expert + 1).
std::vector<HandResult> run_hand(Layout layout, int alignment, bool weighted, bool bias, bool zero_padding) {
    const BufferConfig cfg{.num_experts = 4, .num_topk = 2, .hidden = kH, .max_tokens_per_rank = kC};
    auto groups = ThreadGroup::create(2);
    std::vector<HandResult> res(2);
    auto errors = run_ranks(2, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        const HandRank& in = kRanks[r];
        const auto t = static_cast<int64_t>(in.values.size());
        std::vector<uint16_t> x;
        for (float v : in.values) x.insert(x.end(), kH, bf16(v));
        std::vector<int32_t> idx = in.idx;
        std::vector<float> w = in.w;
        DispatchArgs a;
        a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {t, kH});
        a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {t, 2});
        a.topk_weights = TensorRef::contiguous(w.data(), DType::kFloat32, {t, 2});
        a.layout = layout;
        a.expert_alignment = alignment;
        a.zero_padding = zero_padding;
        DispatchResult d = buf->dispatch(a);
        HandResult& o = res[static_cast<size_t>(r)];
        o.x_shape = d.recv_x.shape;
        o.num_rows = d.num_rows;
        const int64_t rows = d.recv_x.ndim() == 2 ? d.recv_x.size(0) : d.recv_x.size(0) * d.recv_x.size(1);
        const auto* rx = static_cast<const uint16_t*>(d.recv_x.data);
        const auto src = read_rows<int32_t>(d.recv_src);
        for (int64_t row = 0; row < rows; ++row) {
            const bool real = src[static_cast<size_t>(row)] >= 0;
            for (int h = 1; h < kH && real; ++h) o.rows_constant = o.rows_constant && rx[row * kH + h] == rx[row * kH];
            o.row_values.push_back(real || zero_padding ? from_bf16(rx[row * kH]) : NAN);
        }
        o.recv_src = src;
        o.weights = read_rows<float>(d.recv_weights);
        if (layout == Layout::kExpertContiguous) {
            o.m_indices = read_rows<int32_t>(d.m_indices);
            o.offsets = read_rows<int32_t>(d.offsets);
            o.counts = read_rows<int32_t>(d.counts);
        } else {
            o.counts = read_rows<int32_t>(d.masked_m);
        }
        // the expert: row of global expert e times (e + 1)
        std::vector<uint16_t> y(static_cast<size_t>(rows * kH), 0);
        const int64_t rc = 2 * kC;
        for (int64_t row = 0; row < rows; ++row) {
            const int64_t l = layout == Layout::kExpertContiguous ? o.m_indices[static_cast<size_t>(row)] : row / rc;
            if (src[static_cast<size_t>(row)] < 0) continue;
            const float mult = static_cast<float>(r * 2 + l + 1);
            for (int h = 0; h < kH; ++h)
                y[static_cast<size_t>(row * kH + h)] = bf16(from_bf16(rx[row * kH + h]) * mult);
        }
        std::vector<uint16_t> b(static_cast<size_t>(t * kH), bf16(0.5f));
        CombineArgs c{.y = TensorRef::contiguous(y.data(), DType::kBFloat16, d.recv_x.shape), .weighted = weighted};
        if (bias) c.bias = TensorRef::contiguous(b.data(), DType::kBFloat16, {t, kH});
        CombineResult cr = buf->combine(std::move(d.handle), c);
        const auto* out = static_cast<const uint16_t*>(cr.out.data);
        for (int64_t tt = 0; tt < t; ++tt) {
            for (int h = 1; h < kH; ++h) o.out_constant = o.out_constant && out[tt * kH + h] == out[tt * kH];
            o.out.push_back(from_bf16(out[tt * kH]));
        }
    });
    all_ok(errors, "hand case");
    return res;
}

// Compares with NaN meaning "padding, not compared".
void expect_rows(const std::vector<float>& got, const std::vector<float>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i)
        if (!std::isnan(want[i])) {
            EXPECT_EQ(got[i], want[i]) << "row " << i;
        }
}

TEST(HandCase, ContiguousWeighted) {
    const auto res = run_hand(Layout::kExpertContiguous, 1, true, false, false);
    ASSERT_EQ(res.size(), 2u);
    // rank 0: expert 0 <- (0,t0,k0) (0,t2,k1) (1,t1,k0); expert 1 <- (0,t2,k0)
    EXPECT_EQ(res[0].num_rows, 4);
    EXPECT_EQ(res[0].x_shape, (std::vector<int64_t>{4, kH}));
    EXPECT_EQ(res[0].counts, (std::vector<int32_t>{3, 1}));
    EXPECT_EQ(res[0].offsets, (std::vector<int32_t>{0, 3, 4}));
    EXPECT_EQ(res[0].m_indices, (std::vector<int32_t>{0, 0, 0, 1}));
    EXPECT_EQ(res[0].recv_src, (std::vector<int32_t>{0, 2, 5, 2}));  // s*C + t with C = 4
    EXPECT_EQ(res[0].weights, (std::vector<float>{0.5f, 0.125f, 2.0f, 0.75f}));
    expect_rows(res[0].row_values, {1.0f, 3.0f, 5.0f, 3.0f});
    // rank 1: expert 2 <- (0,t0,k1) (1,t0,k0); expert 3 <- (0,t1,k0) (1,t0,k1) (1,t1,k1)
    EXPECT_EQ(res[1].num_rows, 5);
    EXPECT_EQ(res[1].counts, (std::vector<int32_t>{2, 3}));
    EXPECT_EQ(res[1].offsets, (std::vector<int32_t>{0, 2, 5}));
    EXPECT_EQ(res[1].m_indices, (std::vector<int32_t>{0, 0, 1, 1, 1}));
    EXPECT_EQ(res[1].recv_src, (std::vector<int32_t>{0, 4, 1, 4, 5}));
    EXPECT_EQ(res[1].weights, (std::vector<float>{0.25f, 0.5f, 1.0f, 0.5f, 1.0f}));
    expect_rows(res[1].row_values, {1.0f, 4.0f, 2.0f, 4.0f, 5.0f});
    // combine: sum_k w_k * (e_k + 1) * value
    //   r0 t0: 0.5*1*1 + 0.25*3*1 = 1.25; t1: 1*4*2 = 8; t2: 0.75*2*3 + 0.125*1*3 = 4.875
    //   r1 t0: 0.5*3*4 + 0.5*4*4 = 14;    t1: 2*1*5 + 1*4*5 = 30
    EXPECT_EQ(res[0].out, (std::vector<float>{1.25f, 8.0f, 4.875f}));
    EXPECT_EQ(res[1].out, (std::vector<float>{14.0f, 30.0f}));
    for (const auto& r : res) EXPECT_TRUE(r.rows_constant && r.out_constant);
}

TEST(HandCase, ContiguousAlignedUnweightedWithBias) {
    const auto res = run_hand(Layout::kExpertContiguous, 4, false, true, true);
    ASSERT_EQ(res.size(), 2u);
    // segments start at multiples of 4; padding rows: m_indices -1, src -1, weight 0, data zero
    EXPECT_EQ(res[0].num_rows, 8);
    EXPECT_EQ(res[0].offsets, (std::vector<int32_t>{0, 4, 8}));
    EXPECT_EQ(res[0].m_indices, (std::vector<int32_t>{0, 0, 0, -1, 1, -1, -1, -1}));
    EXPECT_EQ(res[0].recv_src, (std::vector<int32_t>{0, 2, 5, -1, 2, -1, -1, -1}));
    EXPECT_EQ(res[0].weights, (std::vector<float>{0.5f, 0.125f, 2.0f, 0, 0.75f, 0, 0, 0}));
    expect_rows(res[0].row_values, {1.0f, 3.0f, 5.0f, 0.0f, 3.0f, 0.0f, 0.0f, 0.0f});
    EXPECT_EQ(res[1].num_rows, 8);
    EXPECT_EQ(res[1].offsets, (std::vector<int32_t>{0, 4, 8}));
    EXPECT_EQ(res[1].m_indices, (std::vector<int32_t>{0, 0, -1, -1, 1, 1, 1, -1}));
    EXPECT_EQ(res[1].recv_src, (std::vector<int32_t>{0, 4, -1, -1, 1, 4, 5, -1}));
    expect_rows(res[1].row_values, {1.0f, 4.0f, 0.0f, 0.0f, 2.0f, 4.0f, 5.0f, 0.0f});
    // unweighted: sum_k (e_k + 1) * value, plus bias 0.5
    //   r0 t0: 1 + 3 = 4; t1: 8; t2: 2*3 + 1*3 = 9.   r1 t0: 3*4 + 4*4 = 28; t1: 1*5 + 4*5 = 25
    EXPECT_EQ(res[0].out, (std::vector<float>{4.5f, 8.5f, 9.5f}));
    EXPECT_EQ(res[1].out, (std::vector<float>{28.5f, 25.5f}));
}

TEST(HandCase, Masked) {
    const auto res = run_hand(Layout::kExpertMasked, 1, true, false, true);
    ASSERT_EQ(res.size(), 2u);
    // [E_local = 2, R*C = 8] slabs
    EXPECT_EQ(res[0].x_shape, (std::vector<int64_t>{2, 8, kH}));
    EXPECT_EQ(res[0].num_rows, -1);
    EXPECT_EQ(res[0].counts, (std::vector<int32_t>{3, 1}));
    EXPECT_EQ(res[0].recv_src, (std::vector<int32_t>{0, 2, 5, -1, -1, -1, -1, -1, 2, -1, -1, -1, -1, -1, -1, -1}));
    EXPECT_EQ(res[0].weights, (std::vector<float>{0.5f, 0.125f, 2.0f, 0, 0, 0, 0, 0, 0.75f, 0, 0, 0, 0, 0, 0, 0}));
    expect_rows(res[0].row_values, {1, 3, 5, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0});
    EXPECT_EQ(res[1].counts, (std::vector<int32_t>{2, 3}));
    EXPECT_EQ(res[1].recv_src, (std::vector<int32_t>{0, 4, -1, -1, -1, -1, -1, -1, 1, 4, 5, -1, -1, -1, -1, -1}));
    EXPECT_EQ(res[1].weights, (std::vector<float>{0.25f, 0.5f, 0, 0, 0, 0, 0, 0, 1.0f, 0.5f, 1.0f, 0, 0, 0, 0, 0}));
    expect_rows(res[1].row_values, {1, 4, 0, 0, 0, 0, 0, 0, 2, 4, 5, 0, 0, 0, 0, 0});
    EXPECT_EQ(res[0].out, (std::vector<float>{1.25f, 8.0f, 4.875f}));
    EXPECT_EQ(res[1].out, (std::vector<float>{14.0f, 30.0f}));
}

// The reduction order of SEMANTICS.md, visible in the output bits. R=3, E=6 (rank d holds experts
// 2d, 2d+1), K=3, y = 1 on every row, so each route contributes exactly its weight and each
// rank's partial is the sum of its routes' weights rounded to bf16. All tokens are on rank 0.
//   t0: experts [4, 2, 0] weights [1, 2^16, 2^24], bias 1. Destinations in first-k order: ranks
//       2, 1, 0. acc = 1 + 1 = 2; + 65536 = 65538; + 2^24 = 16842754 (exact) -> bf16 above the
//       midpoint 2^24 + 2^16 -> 2^24 + 2^17 = 16908288.
//   t1: the same routes reversed [0, 2, 4] with weights [2^24, 2^16, 1], bias 1: acc = 1 + 2^24
//       -> 16777216 (fp32 tie to even); + 65536 = 16842752; + 1 -> 16842752 (tie to even)
//       -> bf16 tie at 2^24 + 2^16 -> even -> 16777216.
//   t2: experts [2, 3, 0] weights [256, 1.5, -0.59375], bias 0: rank 1's partial
//       fma(1.5, 1, fma(256, 1, 0)) = 257.5 -> bf16 258; rank 0's -0.59375. acc = 258 - 0.59375
//       = 257.40625 -> 258. (Unrounded partials would give bf16(256.90625) = 256.)
TEST(HandCase, ReductionOrderAndRounding) {
    const BufferConfig cfg{.num_experts = 6, .num_topk = 3, .hidden = 8, .max_tokens_per_rank = 3};
    auto groups = ThreadGroup::create(3);
    std::vector<float> out;
    auto errors = run_ranks(3, [&](int r) {
        auto buf = Buffer::create(groups[static_cast<size_t>(r)], cfg, BackendKind::kCPU);
        const int64_t t = r == 0 ? 3 : 0;
        std::vector<uint16_t> x(static_cast<size_t>(t * 8), bf16(1.0f));
        std::vector<int64_t> idx = {4, 2, 0, 0, 2, 4, 2, 3, 0};
        std::vector<float> w = {1.0f, 65536.0f, 16777216.0f, 16777216.0f, 65536.0f, 1.0f, 256.0f, 1.5f, -0.59375f};
        std::vector<uint16_t> b;
        for (float v : {1.0f, 1.0f, 0.0f}) b.insert(b.end(), 8, bf16(v));
        idx.resize(static_cast<size_t>(t * 3));
        w.resize(static_cast<size_t>(t * 3));
        b.resize(static_cast<size_t>(t * 8));
        DispatchArgs a;
        a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {t, 8});
        a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt64, {t, 3});
        a.topk_weights = TensorRef::contiguous(w.data(), DType::kFloat32, {t, 3});
        DispatchResult d = buf->dispatch(a);
        const int64_t rows = d.recv_x.size(0);
        std::vector<uint16_t> y(static_cast<size_t>(rows * 8), bf16(1.0f));
        CombineArgs c{.y = TensorRef::contiguous(y.data(), DType::kBFloat16, {rows, 8})};
        c.bias = TensorRef::contiguous(b.data(), DType::kBFloat16, {t, 8});
        CombineResult cr = buf->combine(std::move(d.handle), c);
        if (r == 0)
            for (int64_t i = 0; i < t; ++i) out.push_back(from_bf16(static_cast<const uint16_t*>(cr.out.data)[i * 8]));
    });
    ASSERT_TRUE(all_ok(errors));
    EXPECT_EQ(out, (std::vector<float>{16908288.0f, 16777216.0f, 258.0f}));
}

}  // namespace
}  // namespace eptest
