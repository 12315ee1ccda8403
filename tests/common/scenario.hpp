// The one scenario type, input generator and caller-output helper of every test program (unit, gpu,
// MPI; ranks as threads or as processes). No test framework here: programs without GoogleTest use it.
//
// A Scenario is one dispatch -> combine round of an R-rank group: the config, each rank's token
// count, how routes are drawn, the call's options. make_inputs(sc) draws every rank's inputs from
// sc.seed alone, so every process of an MPI job builds the same data and takes its own rank's.
// RankData holds the oracle's canonical copy (`in`) and the possibly strided storage the call reads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "elasticep/elasticep.hpp"
#include "reference/oracle.hpp"

namespace eptest {

using namespace elasticep;
namespace ref = elasticep::reference;

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
// One rank's inputs: the oracle's canonical copy and the (possibly strided) storage the call reads.

enum class Routing { kRandom, kHotExpert, kNone, kInvalid };

struct Scenario {
    BufferConfig cfg;
    int num_ranks = 2;
    std::vector<int64_t> tokens;  // T per rank
    Routing routing = Routing::kRandom;
    double p_none = 0.1;  // chance of a -1 slot (random routing)
    // Off by default (they draw from the stream only when set, so other scenarios keep their inputs):
    double p_token_none = 0.0;  // chance that a token has no route at all
    double p_nan = 0.0;         // chance that a bf16 input element is NaN (0x7fc0)
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
        os << "R" << num_ranks;
        if (cfg.ranks_per_node != 0) os << "_P" << cfg.ranks_per_node;
        if (cfg.topology == Topology::kHybrid)
            os << "_hyb" << (cfg.scaleout == ScaleOut::kAuto ? "" : scaleout_name(cfg.scaleout));
        os << "_E" << cfg.num_experts << "_K" << cfg.num_topk << "_H" << cfg.hidden << "_C" << cfg.max_tokens_per_rank
           << "_T";
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
        if (p_token_none > 0) os << "_tn";
        if (p_nan > 0) os << "_nan";
        os << "_s" << seed;
        return os.str();
    }
};

// A scenario of R ranks with E experts, top-K, hidden H and capacity C, every rank at C tokens
// (the rest as Scenario's defaults).
inline Scenario base_scenario(int r, int e, int k, int h, int c) {
    Scenario s;
    s.num_ranks = r;
    s.cfg.num_experts = e;
    s.cfg.num_topk = k;
    s.cfg.hidden = h;
    s.cfg.max_tokens_per_rank = c;
    s.tokens.assign(static_cast<size_t>(r), c);
    return s;
}

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
    if (sc.p_token_none > 0 && rng.chance(sc.p_token_none)) return row;
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
                for (int i = 0; i < h; ++i) {
                    const bool nan = sc.p_nan > 0 && rng.chance(sc.p_nan);
                    d.in.x.push_back(zero_group ? uint16_t{0} : nan ? uint16_t{0x7fc0} : random_bf16(rng));
                }
            }
            if (sc.bias)
                for (int i = 0; i < h; ++i) d.bias.push_back(y_value(1000 + s, t, i));
        }
        fill_storage(sc, d);
    }
    return out;
}

inline TensorRef strided_2d(const void* data, DType dtype, int64_t rows, int64_t cols, int64_t stride,
                            Device device = Device{}) {
    TensorRef t = TensorRef::contiguous(const_cast<void*>(data), dtype, {rows, cols}, device);
    if (stride != cols) t.strides = {stride, 1};
    return t;
}

// DispatchArgs over one rank's storage. `place(host_ptr, bytes)` gives the address the call reads on
// `device`: the storage itself (host), or a copy of it (device memory, tests/common/rank_round.hpp).
template <class Place>
DispatchArgs make_args(const Scenario& sc, const RankData& d, Place&& place, Device device) {
    DispatchArgs a;
    const int64_t t = d.in.num_tokens;
    const int h = sc.cfg.hidden, k_count = sc.cfg.num_topk;
    const bool fp8 = sc.cfg.payload == Payload::kFP8;
    auto at = [&](const auto& v) { return place(static_cast<const void*>(v.data()), v.size() * sizeof(v[0])); };
    if (fp8 && sc.prequantized) {
        a.x = strided_2d(at(d.x8), DType::kFloat8E4M3, t, h, d.x_stride, device);
        const DType sdt = sc.cfg.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32;
        a.x_scales = strided_2d(at(d.xs), sdt, t, scale_columns(sc.cfg.scale_format, h), d.s_stride, device);
    } else {
        a.x = strided_2d(at(d.x), DType::kBFloat16, t, h, d.x_stride, device);
    }
    a.topk_idx = sc.idx64 ? strided_2d(at(d.idx64), DType::kInt64, t, k_count, d.idx_stride, device)
                          : strided_2d(at(d.idx32), DType::kInt32, t, k_count, d.idx_stride, device);
    if (sc.has_weights) a.topk_weights = strided_2d(at(d.w), DType::kFloat32, t, k_count, d.w_stride, device);
    a.layout = sc.opt.layout;
    a.expert_alignment = sc.opt.expert_alignment;
    a.host_sync = sc.opt.host_sync;
    a.zero_padding = sc.opt.zero_padding;
    a.scales_mn_major = sc.mn_major;
    return a;
}

inline DispatchArgs make_args(const Scenario& sc, const RankData& d) {
    return make_args(
        sc, d, [](const void* p, size_t) { return const_cast<void*>(p); }, Device{});
}

// Sets route (t, k) of one rank's input to `value`, in the canonical copy and in the storage.
inline void set_route(const Scenario& sc, RankData& d, int64_t t, int k, int64_t value) {
    d.in.topk_idx[static_cast<size_t>(t * sc.cfg.num_topk + k)] = value;
    const size_t at = static_cast<size_t>(t * d.idx_stride + k);
    if (sc.idx64)
        d.idx64[at] = value;
    else
        d.idx32[at] = static_cast<int32_t>(value);
}

// Rows of the fixed worst-case shape of the scenario's layout: M_cap (contiguous) or E_local * R * C.
inline int64_t worst_case_rows(const Scenario& sc) {
    const int64_t e_local = sc.cfg.num_experts / sc.num_ranks;
    const int64_t rc = int64_t{sc.num_ranks} * sc.cfg.max_tokens_per_rank;
    if (sc.opt.layout == Layout::kExpertMasked) return e_local * rc;
    return rc * std::min<int64_t>(sc.cfg.num_topk, e_local) + e_local * (sc.opt.expert_alignment - 1);
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

}  // namespace eptest
