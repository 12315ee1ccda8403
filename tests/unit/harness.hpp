// Test harness: ranks as threads, generated inputs, canonical reads of outputs, guarded
// caller-provided memory, and one dispatch/combine round checked against the oracle.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "elasticep/elasticep.hpp"
#include "reference/oracle.hpp"

namespace eptest {

using namespace elasticep;
namespace ref = elasticep::reference;

// ---------------------------------------------------------------------------------------------
// Ranks as threads

// Runs fn(rank) on one thread per rank; returns each rank's exception (null when it returned).
template <class Fn>
std::vector<std::exception_ptr> run_ranks(int num_ranks, Fn fn) {
    std::vector<std::exception_ptr> errors(static_cast<size_t>(num_ranks));
    std::vector<std::thread> threads;
    for (int r = 0; r < num_ranks; ++r)
        threads.emplace_back([&, r] {
            try {
                fn(r);
            } catch (...) {
                errors[static_cast<size_t>(r)] = std::current_exception();
            }
        });
    for (auto& t : threads) t.join();
    return errors;
}

inline std::string describe(const std::exception_ptr& e) {
    if (!e) return "no exception";
    try {
        std::rethrow_exception(e);
    } catch (const std::exception& x) {
        return x.what();
    } catch (...) {
        return "unknown exception";
    }
}

// Fails the test for every rank that raised.
inline bool all_ok(const std::vector<std::exception_ptr>& errors, const std::string& context = "") {
    bool ok = true;
    for (size_t r = 0; r < errors.size(); ++r)
        if (errors[r]) {
            ADD_FAILURE() << context << " rank " << r << " raised: " << describe(errors[r]);
            ok = false;
        }
    return ok;
}

// The exception is an elasticep::Error with `code` whose message holds every needle.
inline testing::AssertionResult is_error(const std::exception_ptr& e, ErrorCode code,
                                         const std::vector<std::string>& needles = {}) {
    if (!e) return testing::AssertionFailure() << "expected " << error_code_name(code) << ", nothing was raised";
    try {
        std::rethrow_exception(e);
    } catch (const Error& err) {
        if (err.code() != code)
            return testing::AssertionFailure() << "expected " << error_code_name(code) << ", got " << err.what();
        for (const std::string& n : needles)
            if (err.message().find(n) == std::string::npos)
                return testing::AssertionFailure() << "message lacks '" << n << "': " << err.what();
        return testing::AssertionSuccess() << err.what();
    } catch (const std::exception& x) {
        return testing::AssertionFailure() << "expected elasticep::Error, got " << x.what();
    }
    return testing::AssertionFailure() << "unreachable";
}

template <class Fn>
testing::AssertionResult throws_error(Fn&& fn, ErrorCode code, const std::vector<std::string>& needles = {}) {
    try {
        fn();
    } catch (...) {
        return is_error(std::current_exception(), code, needles);
    }
    return testing::AssertionFailure() << "expected " << error_code_name(code) << ", nothing was raised";
}

// ---------------------------------------------------------------------------------------------
// Numbers

struct Rng {  // splitmix64: the same stream on every platform
    uint64_t state;
    explicit Rng(uint64_t seed) : state(seed) {}
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    int uniform(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }
    double unit() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
    bool chance(double p) { return unit() < p; }
    template <class T>
    const T& pick(const std::vector<T>& v) {
        return v[static_cast<size_t>(uniform(0, static_cast<int>(v.size()) - 1))];
    }
};

inline uint16_t bf16(float v) { return ref::bf16_from_float(v); }
inline float from_bf16(uint16_t b) { return ref::float_from_bf16(b); }

inline uint32_t bits(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}

// A bf16 value spread over many magnitudes, both signs, some exact zeros.
inline uint16_t random_bf16(Rng& rng) {
    const int kind = rng.uniform(0, 19);
    if (kind == 0) return 0;
    const float mag = static_cast<float>(std::ldexp(1.0 + rng.unit(), rng.uniform(-14, 10)));
    return bf16(rng.chance(0.5) ? -mag : mag);
}

// y of the combine tests: a bf16 per (rank, row, channel) that is cheap to recompute. Magnitudes
// span 2^-24..2^24 so that fp32 sums of partials round, and the reduction order shows in the bits.
inline uint16_t y_value(int rank, int64_t row, int64_t h) {
    uint64_t z = (static_cast<uint64_t>(rank) << 48) ^ (static_cast<uint64_t>(row) << 20) ^ static_cast<uint64_t>(h);
    z = (z ^ (z >> 31)) * 0x7fb5d329728ea185ull;
    z ^= z >> 27;
    z *= 0x81dadef4bc2dd44dull;
    z ^= z >> 33;
    if (z % 16 == 0) return 0;
    const auto mant = static_cast<uint16_t>((z >> 8) & 0x7f);
    const auto exp = static_cast<uint16_t>(127 - 24 + static_cast<int>((z >> 16) % 49));
    const auto sign = static_cast<uint16_t>(((z >> 24) & 1) << 15);
    return static_cast<uint16_t>(sign | (exp << 7) | mant);
}

// ---------------------------------------------------------------------------------------------
// Guarded caller memory: guard bytes on both sides of the region a tensor may touch.

struct Guarded {
    static constexpr size_t kGuard = 256;
    static constexpr uint8_t kGuardByte = 0xa5;
    static constexpr uint8_t kFillByte = 0x5a;
    std::vector<uint8_t> mem;
    size_t bytes = 0;

    explicit Guarded(size_t n = 0) : mem(n + 2 * kGuard, kGuardByte), bytes(n) {
        std::memset(mem.data() + kGuard, kFillByte, n);
    }
    void* data() { return mem.data() + kGuard; }
    const void* data() const { return mem.data() + kGuard; }
    bool guards_intact() const {
        for (size_t i = 0; i < kGuard; ++i)
            if (mem[i] != kGuardByte || mem[kGuard + bytes + i] != kGuardByte) return false;
        return true;
    }
};

// ---------------------------------------------------------------------------------------------
// Canonical reads of tensors through their strides

template <class T>
std::vector<T> read_2d(const TensorRef& t, int64_t rows, int64_t cols) {
    std::vector<T> out(static_cast<size_t>(rows * cols));
    const auto* base = static_cast<const T*>(t.data);
    const int64_t s0 = t.stride(0), s1 = t.stride(1);
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) out[static_cast<size_t>(i * cols + j)] = base[i * s0 + j * s1];
    return out;
}

// A [rows] or [A, B] (canonically A*B rows) tensor as a flat vector.
template <class T>
std::vector<T> read_rows(const TensorRef& t) {
    if (t.ndim() == 1)
        return read_2d<T>(TensorRef{t.data, t.dtype, {t.size(0), 1}, {t.stride(0), 1}, t.device}, t.size(0), 1);
    std::vector<T> out;
    const auto* base = static_cast<const T*>(t.data);
    for (int64_t a = 0; a < t.size(0); ++a)
        for (int64_t b = 0; b < t.size(1); ++b) out.push_back(base[a * t.stride(0) + b * t.stride(1)]);
    return out;
}

// A [rows, C] or [A, B, C] tensor (rows = A*B) as row-major [rows, C].
template <class T>
std::vector<T> read_matrix(const TensorRef& t) {
    if (t.ndim() == 2) return read_2d<T>(t, t.size(0), t.size(1));
    std::vector<T> out;
    const auto* base = static_cast<const T*>(t.data);
    for (int64_t a = 0; a < t.size(0); ++a)
        for (int64_t b = 0; b < t.size(1); ++b)
            for (int64_t c = 0; c < t.size(2); ++c)
                out.push_back(base[a * t.stride(0) + b * t.stride(1) + c * t.stride(2)]);
    return out;
}

// One rank's observed dispatch output, canonical like ref::RankDispatch.
struct Observed {
    int64_t rows = 0;
    std::vector<uint8_t> recv_x;
    std::vector<uint32_t> recv_scales;
    std::vector<float> recv_weights;
    std::vector<int32_t> recv_src, m_indices, counts, offsets;
    int64_t num_rows = -1;
    std::vector<int64_t> x_shape, scale_strides;
};

inline Observed observe(const DispatchResult& r, const BufferConfig& cfg) {
    Observed o;
    const bool fp8 = cfg.payload == Payload::kFP8;
    o.x_shape = r.recv_x.shape;
    o.rows = r.recv_x.ndim() == 2 ? r.recv_x.size(0) : r.recv_x.size(0) * r.recv_x.size(1);
    if (fp8) {
        o.recv_x = read_matrix<uint8_t>(r.recv_x);
    } else {
        const auto v = read_matrix<uint16_t>(r.recv_x);
        o.recv_x.resize(v.size() * 2);
        if (!v.empty()) std::memcpy(o.recv_x.data(), v.data(), o.recv_x.size());
    }
    if (r.recv_scales) {
        o.recv_scales = read_matrix<uint32_t>(*r.recv_scales);
        for (int i = 0; i < r.recv_scales->ndim(); ++i) o.scale_strides.push_back(r.recv_scales->stride(i));
    }
    o.recv_weights = read_rows<float>(r.recv_weights);
    o.recv_src = read_rows<int32_t>(r.recv_src);
    if (r.layout == Layout::kExpertContiguous) {
        o.m_indices = read_rows<int32_t>(r.m_indices);
        o.offsets = read_rows<int32_t>(r.offsets);
        o.counts = read_rows<int32_t>(r.counts);
    } else {
        o.counts = read_rows<int32_t>(r.masked_m);
    }
    o.num_rows = r.num_rows;
    return o;
}

// First difference of two equal-length sequences, or -1.
template <class A, class B>
int64_t first_diff(const std::vector<A>& a, const std::vector<B>& b) {
    if (a.size() != b.size()) return static_cast<int64_t>(std::min(a.size(), b.size()));
    for (size_t i = 0; i < a.size(); ++i)
        if (std::memcmp(&a[i], &b[i], sizeof(A)) != 0) return static_cast<int64_t>(i);
    return -1;
}

inline void expect_dispatch_equal(const ref::RankDispatch& want, const Observed& got, const BufferConfig& cfg,
                                  bool zero_padding, const std::string& ctx) {
    const bool fp8 = cfg.payload == Payload::kFP8;
    const size_t row_bytes = static_cast<size_t>(cfg.hidden) * (fp8 ? 1 : 2);
    const size_t scols = fp8 ? static_cast<size_t>(scale_columns(cfg.scale_format, cfg.hidden)) : 0;
    ASSERT_EQ(got.rows, want.rows) << ctx;
    EXPECT_EQ(got.num_rows, want.num_rows) << ctx;
    EXPECT_EQ(got.counts, want.counts) << ctx;
    if (!want.offsets.empty()) {
        EXPECT_EQ(got.offsets, want.offsets) << ctx;
    }
    int64_t i = first_diff(got.recv_weights, want.recv_weights);
    EXPECT_EQ(i, -1) << ctx << " recv_weights differ at row " << i << ": got "
                     << (i >= 0 && i < static_cast<int64_t>(got.recv_weights.size())
                             ? got.recv_weights[static_cast<size_t>(i)]
                             : 0.0f)
                     << " want "
                     << (i >= 0 && i < static_cast<int64_t>(want.recv_weights.size())
                             ? want.recv_weights[static_cast<size_t>(i)]
                             : 0.0f);
    i = first_diff(got.recv_src, want.recv_src);
    EXPECT_EQ(i, -1) << ctx << " recv_src differ at row " << i;
    if (!want.m_indices.empty()) {
        i = first_diff(got.m_indices, want.m_indices);
        EXPECT_EQ(i, -1) << ctx << " m_indices differ at row " << i;
    }
    ASSERT_EQ(got.recv_x.size(), want.recv_x.size()) << ctx;
    ASSERT_EQ(got.recv_scales.size(), want.recv_scales.size()) << ctx;
    int64_t bad_rows = 0, first_bad = -1;
    for (int64_t r = 0; r < want.rows; ++r) {
        if (!want.row_is_real[static_cast<size_t>(r)] && !zero_padding) continue;
        const bool x_same = std::memcmp(&got.recv_x[static_cast<size_t>(r) * row_bytes],
                                        &want.recv_x[static_cast<size_t>(r) * row_bytes], row_bytes) == 0;
        const bool s_same =
            scols == 0 || std::memcmp(&got.recv_scales[static_cast<size_t>(r) * scols],
                                      &want.recv_scales[static_cast<size_t>(r) * scols], scols * 4) == 0;
        if (!x_same || !s_same) {
            if (first_bad < 0) first_bad = r;
            ++bad_rows;
        }
    }
    EXPECT_EQ(bad_rows, 0) << ctx << " recv_x/recv_scales rows differ, first at row " << first_bad
                           << (first_bad >= 0 && !want.row_is_real[static_cast<size_t>(first_bad)] ? " (padding)" : "");
}

// ---------------------------------------------------------------------------------------------
// One rank's inputs: the oracle's canonical copy and the (possibly strided) storage the call reads.

enum class Routing { kRandom, kHotExpert, kNone, kInvalid };

struct Scenario {
    BufferConfig cfg;
    int num_ranks = 2;
    std::vector<int64_t> tokens;  // T per rank
    Routing routing = Routing::kRandom;
    double p_none = 0.1;  // chance of a -1 slot (random routing)
    ref::DispatchOptions opt;
    bool mn_major = false;
    bool prequantized = false;
    bool has_weights = true;
    bool weighted = true;  // combine with route weights (needs has_weights)
    bool bias = false;
    bool idx64 = false;
    bool caller_outputs = false;
    bool strided = false;
    uint64_t seed = 1;

    std::string name() const {
        std::ostringstream os;
        os << "R" << num_ranks << "_E" << cfg.num_experts << "_K" << cfg.num_topk << "_H" << cfg.hidden << "_C"
           << cfg.max_tokens_per_rank << "_T";
        for (size_t i = 0; i < tokens.size(); ++i) os << (i ? "x" : "") << tokens[i];
        os << "_" << (cfg.payload == Payload::kBF16 ? "bf16" : scale_format_name(cfg.scale_format))
           << (prequantized ? "_preq" : "") << "_" << layout_name(opt.layout);
        if (opt.layout == Layout::kExpertContiguous)
            os << "_A" << opt.expert_alignment << (opt.host_sync ? "_sync" : "_graph");
        const char* routing_names[] = {"rand", "hot", "none", "invalid"};
        os << "_" << routing_names[static_cast<int>(routing)];
        if (mn_major) os << "_mn";
        if (opt.zero_padding) os << "_zp";
        if (!has_weights) os << "_now";
        if (!weighted) os << "_unw";
        if (bias) os << "_bias";
        if (idx64) os << "_i64";
        if (caller_outputs) os << "_out";
        if (strided) os << "_str";
        os << "_s" << seed;
        return os.str();
    }
};

struct RankData {
    ref::RankInput in;
    int64_t x_stride = 0, s_stride = 0, idx_stride = 0, w_stride = 0;
    std::vector<uint16_t> x;
    std::vector<uint8_t> x8;
    std::vector<uint32_t> xs;
    std::vector<int32_t> idx32;
    std::vector<int64_t> idx64;
    std::vector<float> w;
    std::vector<uint16_t> bias;  // canonical [T, H]
    std::vector<uint16_t> bias_storage;
    int64_t bias_stride = 0;
};

inline std::vector<int64_t> random_top_k(Rng& rng, const Scenario& sc, int64_t t) {
    const int e = sc.cfg.num_experts, k_count = sc.cfg.num_topk;
    std::vector<int64_t> row(static_cast<size_t>(k_count), -1);
    if (sc.routing == Routing::kNone) return row;
    // distinct experts by partial Fisher-Yates
    std::vector<int64_t> pool(static_cast<size_t>(e));
    for (int i = 0; i < e; ++i) pool[static_cast<size_t>(i)] = i;
    for (int k = 0; k < k_count; ++k) {
        const int j = rng.uniform(k, e - 1);
        std::swap(pool[static_cast<size_t>(k)], pool[static_cast<size_t>(j)]);
        row[static_cast<size_t>(k)] = rng.chance(sc.p_none) ? -1 : pool[static_cast<size_t>(k)];
    }
    if (sc.routing == Routing::kHotExpert) {
        const int64_t hot = e - 1;
        bool has = false;
        for (int64_t v : row) has = has || v == hot;
        if (!has) row[static_cast<size_t>(rng.uniform(0, k_count - 1))] = hot;
    }
    if (sc.routing == Routing::kInvalid && rng.chance(0.3)) {
        const int k = rng.uniform(0, k_count - 1);
        const int what = rng.uniform(0, 3);
        if (what == 0)
            row[static_cast<size_t>(k)] = e + rng.uniform(0, 5);
        else if (what == 1)
            row[static_cast<size_t>(k)] = -2 - rng.uniform(0, 100);
        else if (what == 2 && k > 0)
            row[static_cast<size_t>(k)] = row[0] >= 0 ? row[0] : 0;  // repeat (or valid)
        else
            row[static_cast<size_t>(k)] = int64_t{1} << 40;  // survives int64 only; int32 tests wrap it below
        (void)t;
    }
    return row;
}

// Builds the storage the call reads from the canonical input: the scenario's row strides, junk in
// the gaps (which a correct library never reads).
inline void fill_storage(const Scenario& sc, RankData& d) {
    const int h = sc.cfg.hidden, k_count = sc.cfg.num_topk;
    const bool fp8 = sc.cfg.payload == Payload::kFP8;
    const int scols = fp8 ? scale_columns(sc.cfg.scale_format, h) : 0;
    const int64_t t_count = d.in.num_tokens;
    const int pad = sc.strided ? 1 : 0;
    d.x_stride = h + pad * 16;
    d.s_stride = scols + pad * 3;
    d.idx_stride = k_count + pad * 3;
    d.w_stride = k_count + pad * 1;
    d.bias_stride = h + pad * 8;
    // storage with the chosen row strides, junk in the gaps
    const auto tt = static_cast<size_t>(t_count);
    auto strided_copy = [&](auto& dst, const auto& src, int64_t cols, int64_t stride, auto junk) {
        dst.assign(tt * static_cast<size_t>(stride), junk);
        for (size_t t = 0; t < tt; ++t)
            for (int64_t c = 0; c < cols; ++c)
                dst[t * static_cast<size_t>(stride) + static_cast<size_t>(c)] =
                    src[t * static_cast<size_t>(cols) + static_cast<size_t>(c)];
    };
    if (!d.in.x.empty() || !(fp8 && sc.prequantized)) strided_copy(d.x, d.in.x, h, d.x_stride, uint16_t{0x7fc1});
    if (fp8 && sc.prequantized) {
        strided_copy(d.x8, d.in.x_fp8, h, d.x_stride, uint8_t{0x7f});
        strided_copy(d.xs, d.in.x_scales, scols, d.s_stride, uint32_t{0xdeadbeef});
    }
    if (sc.idx64) {
        strided_copy(d.idx64, d.in.topk_idx, k_count, d.idx_stride, int64_t{7});
    } else {
        std::vector<int32_t> narrow(d.in.topk_idx.begin(), d.in.topk_idx.end());
        strided_copy(d.idx32, narrow, k_count, d.idx_stride, int32_t{7});
    }
    if (sc.has_weights) strided_copy(d.w, d.in.topk_weights, k_count, d.w_stride, 1e30f);
    if (sc.bias) strided_copy(d.bias_storage, d.bias, h, d.bias_stride, uint16_t{0x7f80});
}

inline std::vector<RankData> make_inputs(const Scenario& sc) {
    Rng rng(sc.seed * 0x100000001b3ull + 17);
    const int h = sc.cfg.hidden, k_count = sc.cfg.num_topk;
    const bool fp8 = sc.cfg.payload == Payload::kFP8;
    const int scols = fp8 ? scale_columns(sc.cfg.scale_format, h) : 0;
    std::vector<RankData> out(static_cast<size_t>(sc.num_ranks));
    for (int s = 0; s < sc.num_ranks; ++s) {
        RankData& d = out[static_cast<size_t>(s)];
        const int64_t t_count = sc.tokens[static_cast<size_t>(s)];
        d.in.num_tokens = t_count;
        for (int64_t t = 0; t < t_count; ++t) {
            // routes
            std::vector<int64_t> row = random_top_k(rng, sc, t);
            if (!sc.idx64)
                for (int64_t& v : row) v = static_cast<int32_t>(v);  // what an int32 tensor can hold
            for (int64_t v : row) d.in.topk_idx.push_back(v);
            if (sc.has_weights)
                for (int k = 0; k < k_count; ++k) {
                    // a few exact specials: 0, negative, -0
                    const int kind = rng.uniform(0, 15);
                    const float w = kind == 0 ? 0.0f : kind == 1 ? -0.0f : static_cast<float>(rng.unit() * 2.0 - 0.5);
                    d.in.topk_weights.push_back(w);
                }
            // payload
            if (fp8 && sc.prequantized) {
                for (int i = 0; i < h; ++i) d.in.x_fp8.push_back(static_cast<uint8_t>(rng.next()));
                for (int c = 0; c < scols; ++c) d.in.x_scales.push_back(static_cast<uint32_t>(rng.next()));
            } else {
                const bool zero_group = rng.chance(0.05);  // a whole row of zeros: the amax floor
                for (int i = 0; i < h; ++i) d.in.x.push_back(zero_group ? uint16_t{0} : random_bf16(rng));
            }
            if (sc.bias)
                for (int i = 0; i < h; ++i) d.bias.push_back(y_value(1000 + s, t, i));
        }
        fill_storage(sc, d);
    }
    return out;
}

inline TensorRef strided_2d(const void* data, DType dtype, int64_t rows, int64_t cols, int64_t stride) {
    TensorRef t = TensorRef::contiguous(const_cast<void*>(data), dtype, {rows, cols});
    if (stride != cols) t.strides = {stride, 1};
    return t;
}

inline DispatchArgs make_args(const Scenario& sc, const RankData& d) {
    DispatchArgs a;
    const int64_t t = d.in.num_tokens;
    const int h = sc.cfg.hidden, k_count = sc.cfg.num_topk;
    const bool fp8 = sc.cfg.payload == Payload::kFP8;
    if (fp8 && sc.prequantized) {
        a.x = strided_2d(d.x8.data(), DType::kFloat8E4M3, t, h, d.x_stride);
        const DType sdt = sc.cfg.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32;
        a.x_scales = strided_2d(d.xs.data(), sdt, t, scale_columns(sc.cfg.scale_format, h), d.s_stride);
    } else {
        a.x = strided_2d(d.x.data(), DType::kBFloat16, t, h, d.x_stride);
    }
    a.topk_idx = sc.idx64 ? strided_2d(d.idx64.data(), DType::kInt64, t, k_count, d.idx_stride)
                          : strided_2d(d.idx32.data(), DType::kInt32, t, k_count, d.idx_stride);
    if (sc.has_weights) a.topk_weights = strided_2d(d.w.data(), DType::kFloat32, t, k_count, d.w_stride);
    a.layout = sc.opt.layout;
    a.expert_alignment = sc.opt.expert_alignment;
    a.host_sync = sc.opt.host_sync;
    a.zero_padding = sc.opt.zero_padding;
    a.scales_mn_major = sc.mn_major;
    return a;
}

// Caller-provided dispatch outputs in guarded memory, with the fixed worst-case shapes.
struct CallerOutputs {
    Guarded x, scales, weights, src, m_indices;
    DispatchOutputs refs;
    bool intact() const {
        return x.guards_intact() && scales.guards_intact() && weights.guards_intact() && src.guards_intact() &&
               m_indices.guards_intact();
    }
};

inline int64_t round_up4(int64_t v) { return (v + 3) / 4 * 4; }

inline std::unique_ptr<CallerOutputs> make_caller_outputs(const Scenario& sc) {
    auto o = std::make_unique<CallerOutputs>();
    const BufferConfig& c = sc.cfg;
    const int64_t e_local = c.num_experts / sc.num_ranks;
    const int64_t rc = int64_t{sc.num_ranks} * c.max_tokens_per_rank;
    const bool fp8 = c.payload == Payload::kFP8;
    const DType xdt = fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
    const int64_t xe = fp8 ? 1 : 2;
    const DType sdt = c.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32;
    const int64_t cols = fp8 ? scale_columns(c.scale_format, c.hidden) : 0;
    if (sc.opt.layout == Layout::kExpertContiguous) {
        const int64_t rows = rc * std::min<int64_t>(c.num_topk, e_local) + e_local * (sc.opt.expert_alignment - 1);
        o->x = Guarded(static_cast<size_t>(rows * c.hidden * xe));
        o->refs.recv_x = TensorRef::contiguous(o->x.data(), xdt, {rows, c.hidden});
        o->weights = Guarded(static_cast<size_t>(rows * 4));
        o->refs.recv_weights = TensorRef::contiguous(o->weights.data(), DType::kFloat32, {rows});
        o->src = Guarded(static_cast<size_t>(rows * 4));
        o->refs.recv_src = TensorRef::contiguous(o->src.data(), DType::kInt32, {rows});
        o->m_indices = Guarded(static_cast<size_t>(rows * 4));
        o->refs.m_indices = TensorRef::contiguous(o->m_indices.data(), DType::kInt32, {rows});
        if (fp8) {
            const int64_t elems = sc.mn_major ? cols * round_up4(rows) : rows * cols;
            o->scales = Guarded(static_cast<size_t>(elems * 4));
            TensorRef s = TensorRef::contiguous(o->scales.data(), sdt, {rows, cols});
            if (sc.mn_major) s.strides = {1, round_up4(rows)};
            o->refs.recv_scales = s;
        }
    } else {
        o->x = Guarded(static_cast<size_t>(e_local * rc * c.hidden * xe));
        o->refs.recv_x = TensorRef::contiguous(o->x.data(), xdt, {e_local, rc, c.hidden});
        o->weights = Guarded(static_cast<size_t>(e_local * rc * 4));
        o->refs.recv_weights = TensorRef::contiguous(o->weights.data(), DType::kFloat32, {e_local, rc});
        o->src = Guarded(static_cast<size_t>(e_local * rc * 4));
        o->refs.recv_src = TensorRef::contiguous(o->src.data(), DType::kInt32, {e_local, rc});
        if (fp8) {
            const int64_t elems = sc.mn_major ? e_local * cols * round_up4(rc) : e_local * rc * cols;
            o->scales = Guarded(static_cast<size_t>(elems * 4));
            TensorRef s = TensorRef::contiguous(o->scales.data(), sdt, {e_local, rc, cols});
            if (sc.mn_major) s.strides = {cols * round_up4(rc), 1, round_up4(rc)};
            o->refs.recv_scales = s;
        }
    }
    return o;
}

// ---------------------------------------------------------------------------------------------
// A full round: every rank dispatches and combines; results checked against the oracle.

struct RankOutcome {
    Observed got;
    std::vector<uint16_t> y;    // canonical [rows, H] as passed to combine
    std::vector<uint16_t> out;  // canonical [T, H]
    bool handle_valid_after = true;
    bool canaries_ok = true;
    bool inputs_untouched = true;
    bool out_gaps_untouched = true;
    std::vector<int64_t> scale_strides;
    std::vector<int64_t> scale_shape;
    bool scales_present = false;
};

// Checks the expected MN-major / row-major scale strides of one rank's result.
inline void expect_scale_layout(const Scenario& sc, const RankOutcome& o, const std::string& ctx) {
    const bool fp8 = sc.cfg.payload == Payload::kFP8;
    EXPECT_EQ(o.scales_present, fp8) << ctx;
    if (!fp8 || !o.scales_present) return;
    const int64_t cols = scale_columns(sc.cfg.scale_format, sc.cfg.hidden);
    const int64_t e_local = sc.cfg.num_experts / sc.num_ranks;
    const int64_t rc = int64_t{sc.num_ranks} * sc.cfg.max_tokens_per_rank;
    std::vector<int64_t> want;
    if (sc.opt.layout == Layout::kExpertContiguous) {
        const int64_t rows = o.scale_shape[0];
        const int64_t rows_cap =
            rc * std::min<int64_t>(sc.cfg.num_topk, e_local) + e_local * (sc.opt.expert_alignment - 1);
        // caller-provided storage keeps the stride of its worst-case shape
        const int64_t storage_rows = sc.caller_outputs ? rows_cap : rows;
        want = sc.mn_major ? std::vector<int64_t>{1, round_up4(storage_rows)} : std::vector<int64_t>{cols, 1};
        EXPECT_EQ(o.scale_shape, (std::vector<int64_t>{rows, cols})) << ctx;
    } else {
        want = sc.mn_major ? std::vector<int64_t>{cols * round_up4(rc), 1, round_up4(rc)}
                           : std::vector<int64_t>{rc * cols, cols, 1};
        EXPECT_EQ(o.scale_shape, (std::vector<int64_t>{e_local, rc, cols})) << ctx;
    }
    EXPECT_EQ(o.scale_strides, want) << ctx << (sc.mn_major ? " (MN-major)" : " (row-major)");
}

// Runs one round of `data` on `buffers` (created collectively on `groups` when empty), checks it
// against the oracle and returns the oracle's expected dispatch outputs.
inline std::vector<ref::RankDispatch> run_round_with(const Scenario& sc, const std::vector<RankData>& data,
                                                     std::vector<std::shared_ptr<Group>>& groups,
                                                     std::vector<std::shared_ptr<Buffer>>& buffers,
                                                     const std::string& ctx_in = "") {
    const std::string ctx = ctx_in.empty() ? sc.name() : ctx_in;
    const int r_count = sc.num_ranks;
    if (groups.empty()) groups = ThreadGroup::create(r_count);
    if (buffers.empty()) buffers.resize(static_cast<size_t>(r_count));
    const int h = sc.cfg.hidden;
    std::vector<RankOutcome> outcome(static_cast<size_t>(r_count));

    auto errors = run_ranks(r_count, [&](int r) {
        auto& buf = buffers[static_cast<size_t>(r)];
        if (!buf) buf = Buffer::create(groups[static_cast<size_t>(r)], sc.cfg, BackendKind::kCPU);
        const RankData& d = data[static_cast<size_t>(r)];
        RankOutcome& o = outcome[static_cast<size_t>(r)];
        const RankData before = d;
        DispatchArgs args = make_args(sc, d);
        std::unique_ptr<CallerOutputs> outs;
        if (sc.caller_outputs) {
            outs = make_caller_outputs(sc);
            args.outputs = outs->refs;
        }
        DispatchResult res = buf->dispatch(args);
        o.got = observe(res, sc.cfg);
        o.scales_present = res.recv_scales.has_value();
        if (res.recv_scales) {
            o.scale_shape = res.recv_scales->shape;
            for (int i = 0; i < res.recv_scales->ndim(); ++i) o.scale_strides.push_back(res.recv_scales->stride(i));
        }
        // y: a fixed function of (rank, row, channel), in the row positions of recv_x
        o.y.resize(static_cast<size_t>(o.got.rows * h));
        for (int64_t row = 0; row < o.got.rows; ++row)
            for (int64_t c = 0; c < h; ++c) o.y[static_cast<size_t>(row * h + c)] = y_value(r, row, c);
        CombineArgs c;
        c.y = TensorRef::contiguous(o.y.data(), DType::kBFloat16, res.recv_x.shape);
        c.weighted = sc.weighted;
        const int64_t t = d.in.num_tokens;
        if (sc.bias) c.bias = strided_2d(d.bias_storage.data(), DType::kBFloat16, t, h, d.bias_stride);
        std::unique_ptr<Guarded> out_mem;
        const int64_t out_stride = h + (sc.strided ? 8 : 0);
        if (sc.caller_outputs) {
            out_mem = std::make_unique<Guarded>(static_cast<size_t>(t * out_stride * 2));
            c.out = strided_2d(out_mem->data(), DType::kBFloat16, t, h, out_stride);
        }
        CombineResult cr = buf->combine(std::move(res.handle), c);
        o.handle_valid_after = res.handle.valid();
        o.out = read_2d<uint16_t>(cr.out, t, h);
        if (sc.caller_outputs) {
            o.canaries_ok = outs->intact() && out_mem->guards_intact();
            EXPECT_EQ(cr.out.data, out_mem->data()) << ctx << " combine must write the caller's out";
            EXPECT_EQ(res.recv_x.data, outs->x.data()) << ctx << " dispatch must write the caller's recv_x";
            const auto* ob = static_cast<const uint8_t*>(out_mem->data());
            for (int64_t tt = 0; tt < t; ++tt)
                for (int64_t b = h * 2; b < out_stride * 2; ++b)
                    if (ob[tt * out_stride * 2 + b] != Guarded::kFillByte) o.out_gaps_untouched = false;
        }
        o.inputs_untouched = before.x == d.x && before.x8 == d.x8 && before.xs == d.xs && before.idx32 == d.idx32 &&
                             before.idx64 == d.idx64 && before.w == d.w && before.bias_storage == d.bias_storage;
    });
    std::vector<ref::RankInput> inputs;
    for (const RankData& d : data) inputs.push_back(d.in);
    const auto want = ref::dispatch(sc.cfg, r_count, inputs, sc.opt);
    if (!all_ok(errors, ctx)) return want;

    std::vector<std::vector<uint16_t>> ys, biases;
    for (int r = 0; r < r_count; ++r) {
        ys.push_back(outcome[static_cast<size_t>(r)].y);
        biases.push_back(data[static_cast<size_t>(r)].bias);
    }
    for (int r = 0; r < r_count; ++r) {
        const RankOutcome& o = outcome[static_cast<size_t>(r)];
        const std::string rctx = ctx + " rank " + std::to_string(r);
        expect_dispatch_equal(want[static_cast<size_t>(r)], o.got, sc.cfg, sc.opt.zero_padding, rctx + " dispatch");
        expect_scale_layout(sc, o, rctx);
        EXPECT_FALSE(o.handle_valid_after) << rctx;
        EXPECT_TRUE(o.canaries_ok) << rctx << " wrote outside a caller-provided output";
        EXPECT_TRUE(o.out_gaps_untouched) << rctx << " wrote into the row gaps of a strided combine output";
        EXPECT_TRUE(o.inputs_untouched) << rctx << " modified an input";
    }
    if (testing::Test::HasFatalFailure()) return want;
    const auto want_out = ref::combine(sc.cfg, r_count, inputs, sc.opt, ys, sc.weighted,
                                       sc.bias ? biases : std::vector<std::vector<uint16_t>>{});
    for (int r = 0; r < r_count; ++r) {
        const auto& got = outcome[static_cast<size_t>(r)].out;
        const auto& w = want_out[static_cast<size_t>(r)];
        const int64_t i = first_diff(got, w);
        EXPECT_EQ(i, -1) << ctx << " rank " << r << " combine differs at token " << (i >= 0 ? i / h : -1) << " channel "
                         << (i >= 0 ? i % h : -1) << ": got 0x" << std::hex
                         << (i >= 0 && i < static_cast<int64_t>(got.size()) ? got[static_cast<size_t>(i)] : 0)
                         << " want 0x" << (i >= 0 && i < static_cast<int64_t>(w.size()) ? w[static_cast<size_t>(i)] : 0)
                         << std::dec;
    }
    return want;
}

inline std::vector<ref::RankDispatch> run_round(const Scenario& sc, std::vector<std::shared_ptr<Group>>& groups,
                                                std::vector<std::shared_ptr<Buffer>>& buffers,
                                                const std::string& ctx = "") {
    return run_round_with(sc, make_inputs(sc), groups, buffers, ctx);
}

inline void run_scenario(const Scenario& sc) {
    std::vector<std::shared_ptr<Group>> groups;
    std::vector<std::shared_ptr<Buffer>> buffers;
    run_round(sc, groups, buffers);
}

}  // namespace eptest
