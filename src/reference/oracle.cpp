// The oracle: SEMANTICS.md computed directly from every rank's inputs at once. Written without
// any of the library's internals (no arena, no slots, no src/core numerics), so a backend bug and
// an oracle bug have to coincide to go unnoticed.
//
// Index contract: inputs[s] is rank s's call; results are indexed by rank as well. Every route is
// (s, t, k) with a cleaned expert id; the rows of (d, l) are the routes to it in (s, t) order.
// Combine reads config.ranks_per_node for its order (one node: flat; several: node partials first);
// config.topology and config.scaleout change nothing here.
#include "reference/oracle.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/parallel.hpp"  // threads only: no numerics of the library

namespace elasticep::reference {
namespace {

uint32_t bits_of(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}

float from_bits(uint32_t u) {
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

int64_t up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

void require(bool cond, const std::string& what) {
    if (!cond) throw std::invalid_argument("reference oracle: " + what);
}

std::atomic<int> g_threads{0};

// the oracle's loops over tokens and destinations (disjoint outputs: the serial loop's results)
template <class Fn>
void for_each_index(int64_t n, Fn&& fn) {
    detail::parallel_for(n, threads(), std::forward<Fn>(fn));
}

// Value of each E4M3 code by the OCP definition: (-1)^s * 2^(e-7) * (1 + m/8), subnormals
// 2^-6 * m/8, code S.1111.111 is NaN.
const std::array<float, 256>& e4m3_table() {
    static const std::array<float, 256> table = [] {
        std::array<float, 256> t{};
        for (int c = 0; c < 256; ++c) {
            const int e = (c >> 3) & 15, m = c & 7;
            const double mag = e == 0 ? std::ldexp(static_cast<double>(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
            t[static_cast<size_t>(c)] = (e == 15 && m == 7) ? NAN : static_cast<float>((c & 0x80) ? -mag : mag);
        }
        return t;
    }();
    return table;
}

int scale_group(ScaleFormat f) { return f == ScaleFormat::kUE8M0G32 ? 32 : 128; }

int scale_words(ScaleFormat f, int hidden) {
    const int groups = (hidden + scale_group(f) - 1) / scale_group(f);
    return f == ScaleFormat::kF32G128 ? groups : (groups + 3) / 4;
}

// Cleaned routes of one rank: [T, K] ids with invalid ones set to -1 (first occurrence kept).
std::vector<int64_t> clean_routes(const BufferConfig& cfg, const RankInput& in) {
    const int k_count = cfg.num_topk;
    std::vector<int64_t> out(in.topk_idx.size(), -1);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
        for (int k = 0; k < k_count; ++k) {
            const int64_t e = in.topk_idx[static_cast<size_t>(t * k_count + k)];
            if (e < 0 || e >= cfg.num_experts) continue;
            bool repeat = false;
            for (int j = 0; j < k; ++j) repeat = repeat || out[static_cast<size_t>(t * k_count + j)] == e;
            if (!repeat) out[static_cast<size_t>(t * k_count + k)] = e;
        }
    }
    return out;
}

struct Plan {
    std::vector<std::vector<int64_t>> routes;  // per source rank: cleaned [T, K]
    // per source rank: row in the destination's output of each (t, k) route, -1 when none
    std::vector<std::vector<int64_t>> row_of;
    std::vector<RankDispatch> out;
};

void check_inputs(const BufferConfig& cfg, int num_ranks, const std::vector<RankInput>& inputs) {
    require(num_ranks >= 1 && static_cast<int>(inputs.size()) == num_ranks, "one input per rank");
    require(cfg.num_experts % num_ranks == 0, "num_experts must be a multiple of the ranks");
    const bool fp8 = cfg.payload == Payload::kFP8;
    for (const RankInput& in : inputs) {
        const auto t = static_cast<size_t>(in.num_tokens);
        const auto h = static_cast<size_t>(cfg.hidden);
        require(in.num_tokens <= cfg.max_tokens_per_rank, "num_tokens above max_tokens_per_rank");
        require(in.topk_idx.size() == t * static_cast<size_t>(cfg.num_topk), "topk_idx size");
        require(in.topk_weights.empty() || in.topk_weights.size() == in.topk_idx.size(), "topk_weights size");
        const bool prequant = fp8 && in.x.empty() && t > 0;
        if (prequant) {
            require(in.x_fp8.size() == t * h, "x_fp8 size");
            require(in.x_scales.size() == t * static_cast<size_t>(scale_words(cfg.scale_format, cfg.hidden)),
                    "x_scales size");
        } else {
            require(in.x.size() == t * h, "x size");
        }
    }
}

Plan plan_dispatch(const BufferConfig& cfg, int num_ranks, const std::vector<RankInput>& inputs, bool with_payload,
                   const DispatchOptions& opt) {
    check_inputs(cfg, num_ranks, inputs);
    require(opt.expert_alignment >= 1, "expert_alignment >= 1");
    const int e_local = cfg.num_experts / num_ranks;
    const int k_count = cfg.num_topk;
    const int h_count = cfg.hidden;
    const int64_t cap = cfg.max_tokens_per_rank;
    const int64_t rc = num_ranks * cap;
    const bool fp8 = cfg.payload == Payload::kFP8;
    const size_t elem = fp8 ? 1 : 2;
    const size_t row_bytes = static_cast<size_t>(h_count) * elem;
    const int scols = fp8 ? scale_words(cfg.scale_format, h_count) : 0;
    const bool contiguous = opt.layout == Layout::kExpertContiguous;

    Plan p;
    for (const RankInput& in : inputs) {
        p.routes.push_back(clean_routes(cfg, in));
        p.row_of.emplace_back(in.topk_idx.size(), -1);
    }

    // Each source token's payload row (bytes) and scales as they arrive: moved or quantized.
    std::vector<std::vector<uint8_t>> payload(static_cast<size_t>(num_ranks));
    std::vector<std::vector<uint32_t>> scales(static_cast<size_t>(num_ranks));
    for (int s = 0; s < num_ranks; ++s) {
        const RankInput& in = inputs[static_cast<size_t>(s)];
        const auto t_count = static_cast<size_t>(in.num_tokens);
        auto& pl = payload[static_cast<size_t>(s)];
        auto& sc = scales[static_cast<size_t>(s)];
        pl.resize(t_count * row_bytes);
        sc.resize(t_count * static_cast<size_t>(scols));
        if (!with_payload || t_count == 0) {
            // combine needs only the row positions
        } else if (!fp8) {
            std::memcpy(pl.data(), in.x.data(), pl.size());
        } else if (in.x.empty()) {
            std::memcpy(pl.data(), in.x_fp8.data(), pl.size());
            std::memcpy(sc.data(), in.x_scales.data(), sc.size() * 4);
        } else {
            for_each_index(static_cast<int64_t>(t_count), [&](int64_t ti) {
                const auto t = static_cast<size_t>(ti);
                quantize_row(&in.x[t * static_cast<size_t>(h_count)], h_count, cfg.scale_format, &pl[t * row_bytes],
                             &sc[t * static_cast<size_t>(scols)]);
            });
        }
    }

    // each destination's outputs apart (a route has one destination: row_of entries are disjoint)
    p.out.resize(static_cast<size_t>(num_ranks));
    for_each_index(num_ranks, [&](int64_t d) {
        RankDispatch& r = p.out[static_cast<size_t>(d)];
        r.counts.assign(static_cast<size_t>(e_local), 0);
        // rows of each local expert, in (s, t) order: (s, t, k)
        std::vector<std::vector<std::array<int64_t, 3>>> lists(static_cast<size_t>(e_local));
        for (int s = 0; s < num_ranks; ++s) {
            const auto& routes = p.routes[static_cast<size_t>(s)];
            for (int64_t t = 0; t < inputs[static_cast<size_t>(s)].num_tokens; ++t)
                for (int k = 0; k < k_count; ++k) {
                    const int64_t e = routes[static_cast<size_t>(t * k_count + k)];
                    if (e >= 0 && e / e_local == d) lists[static_cast<size_t>(e % e_local)].push_back({s, t, k});
                }
        }
        std::vector<int64_t> start(static_cast<size_t>(e_local) + 1, 0);
        for (int l = 0; l < e_local; ++l) {
            const auto n = static_cast<int64_t>(lists[static_cast<size_t>(l)].size());
            r.counts[static_cast<size_t>(l)] = static_cast<int32_t>(n);
            start[static_cast<size_t>(l) + 1] =
                start[static_cast<size_t>(l)] + (contiguous ? up(n, opt.expert_alignment) : 0);
        }
        if (contiguous) {
            const int64_t m = start[static_cast<size_t>(e_local)];
            const int64_t m_cap = rc * std::min(k_count, e_local) + int64_t{e_local} * (opt.expert_alignment - 1);
            r.rows = opt.host_sync ? m : m_cap;
            r.num_rows = opt.host_sync ? m : -1;
            for (int64_t v : start) r.offsets.push_back(static_cast<int32_t>(v));
        } else {
            r.rows = int64_t{e_local} * rc;
        }
        const auto rows = static_cast<size_t>(r.rows);
        // padding everywhere first; zero data doubles as "unspecified" for callers that only
        // compare padding data when zero_padding was asked for
        r.recv_x.assign(rows * row_bytes, 0);
        r.recv_scales.assign(rows * static_cast<size_t>(scols), 0);
        r.recv_weights.assign(rows, 0.0f);
        r.recv_src.assign(rows, -1);
        if (contiguous) r.m_indices.assign(rows, -1);
        r.row_is_real.assign(rows, 0);
        for (int l = 0; l < e_local; ++l) {
            const auto& list = lists[static_cast<size_t>(l)];
            for (size_t i = 0; i < list.size(); ++i) {
                const auto [s, t, k] = list[i];
                const int64_t row = contiguous ? start[static_cast<size_t>(l)] + static_cast<int64_t>(i)
                                               : l * rc + static_cast<int64_t>(i);
                const auto ur = static_cast<size_t>(row);
                const RankInput& in = inputs[static_cast<size_t>(s)];
                std::memcpy(&r.recv_x[ur * row_bytes],
                            &payload[static_cast<size_t>(s)][static_cast<size_t>(t) * row_bytes], row_bytes);
                for (int c = 0; c < scols; ++c)
                    r.recv_scales[ur * static_cast<size_t>(scols) + static_cast<size_t>(c)] =
                        scales[static_cast<size_t>(s)][static_cast<size_t>(t * scols + c)];
                r.recv_weights[ur] =
                    in.topk_weights.empty() ? 0.0f : in.topk_weights[static_cast<size_t>(t * k_count + k)];
                r.recv_src[ur] = static_cast<int32_t>(s * cap + t);
                if (contiguous) r.m_indices[ur] = l;
                r.row_is_real[ur] = 1;
                p.row_of[static_cast<size_t>(s)][static_cast<size_t>(t * k_count + k)] = row;
            }
        }
    });
    return p;
}

}  // namespace

void set_threads(int n) { g_threads.store(std::max(n, 0)); }

int threads() {
    const int n = g_threads.load();
    return n > 0 ? n : detail::hardware_threads();
}

float float_from_bf16(uint16_t b) { return from_bits(static_cast<uint32_t>(b) << 16); }

uint16_t bf16_from_float(float v) {
    const uint32_t u = bits_of(v);
    if (std::isnan(v)) return 0x7fc0;  // every NaN: the canonical quiet NaN, sign and payload dropped
    const uint32_t upper = u >> 16, lower = u & 0xffffu;
    // nearest; on an exact half, the even one (a carry into the exponent is the right answer)
    const bool round_up = lower > 0x8000u || (lower == 0x8000u && (upper & 1u));
    return static_cast<uint16_t>(upper + (round_up ? 1u : 0u));
}

uint8_t e4m3_from_float(float v) {
    if (std::isnan(v)) return 0x7f;
    const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
    // saturating: everything beyond the largest finite code (infinities too) becomes +-448
    const double mag = std::min(std::fabs(static_cast<double>(v)), 448.0);
    const auto& table = e4m3_table();
    int best = 0;
    double best_dist = INFINITY;
    for (int c = 0; c < 0x7f; ++c) {  // every non-negative finite code
        const double dist = std::fabs(static_cast<double>(table[static_cast<size_t>(c)]) - mag);
        // strictly nearer wins; an exact tie goes to the even mantissa (lowest code bit 0)
        if (dist < best_dist || (dist == best_dist && (c & 1) == 0)) {
            best = c;
            best_dist = dist;
        }
    }
    return static_cast<uint8_t>(sign | best);
}

float float_from_e4m3(uint8_t code) { return e4m3_table()[code]; }

void quantize_row(const uint16_t* x, int hidden, ScaleFormat format, uint8_t* q, uint32_t* scales) {
    const int g = scale_group(format);
    const int groups = hidden / g;
    const int words = scale_words(format, hidden);
    for (int w = 0; w < words; ++w) scales[w] = 0;
    for (int gi = 0; gi < groups; ++gi) {
        float amax = 0.0f;
        for (int i = 0; i < g; ++i) amax = std::fmax(amax, std::fabs(float_from_bf16(x[gi * g + i])));
        amax = std::fmax(amax, 1e-4f);
        float mul;
        if (format == ScaleFormat::kF32G128) {
            const float scale = amax / 448.0f;
            scales[gi] = bits_of(scale);
            mul = 448.0f / amax;
        } else {
            const uint32_t qb = bits_of(amax / 448.0f);
            int biased = static_cast<int>((qb >> 23) & 0xffu) + ((qb & 0x7fffffu) != 0 ? 1 : 0);
            if (biased > 255) biased = 255;
            scales[gi / 4] |= static_cast<uint32_t>(biased) << (8 * (gi % 4));
            mul = std::ldexp(1.0f, 127 - biased);  // exact (a subnormal for the largest exponents)
        }
        for (int i = 0; i < g; ++i) q[gi * g + i] = e4m3_from_float(float_from_bf16(x[gi * g + i]) * mul);
    }
}

InvalidRoute first_invalid_route(const BufferConfig& config, const RankInput& input) {
    const int k_count = config.num_topk;
    for (int64_t t = 0; t < input.num_tokens; ++t)
        for (int k = 0; k < k_count; ++k) {
            const int64_t e = input.topk_idx[static_cast<size_t>(t * k_count + k)];
            bool bad = e < -1 || e >= config.num_experts;
            for (int j = 0; j < k && !bad && e >= 0; ++j)
                bad = input.topk_idx[static_cast<size_t>(t * k_count + j)] == e;
            if (bad) return InvalidRoute{t, k, e};
        }
    return InvalidRoute{};
}

std::vector<RankDispatch> dispatch(const BufferConfig& config, int num_ranks, const std::vector<RankInput>& inputs,
                                   const DispatchOptions& options) {
    return plan_dispatch(config, num_ranks, inputs, true, options).out;
}

std::vector<std::vector<uint16_t>> combine(const BufferConfig& config, int num_ranks,
                                           const std::vector<RankInput>& inputs, const DispatchOptions& options,
                                           const std::vector<std::vector<uint16_t>>& y, bool weighted,
                                           const std::vector<std::vector<uint16_t>>& bias) {
    const Plan p = plan_dispatch(config, num_ranks, inputs, false, options);
    const int e_local = config.num_experts / num_ranks;
    const int k_count = config.num_topk;
    const auto h_count = static_cast<size_t>(config.hidden);
    require(static_cast<int>(y.size()) == num_ranks, "one y per rank");
    for (int d = 0; d < num_ranks; ++d)
        require(y[static_cast<size_t>(d)].size() == static_cast<size_t>(p.out[static_cast<size_t>(d)].rows) * h_count,
                "y[" + std::to_string(d) + "] must have the expected rows x hidden");
    require(bias.empty() || static_cast<int>(bias.size()) == num_ranks, "bias: none or one per rank");

    std::vector<std::vector<uint16_t>> out(static_cast<size_t>(num_ranks));
    for (int s = 0; s < num_ranks; ++s) {
        const RankInput& in = inputs[static_cast<size_t>(s)];
        require(!weighted || in.topk_weights.size() == in.topk_idx.size(), "weighted combine needs topk_weights");
        const auto t_count = static_cast<size_t>(in.num_tokens);
        const std::vector<uint16_t>* b =
            bias.empty() || bias[static_cast<size_t>(s)].empty() ? nullptr : &bias[static_cast<size_t>(s)];
        require(b == nullptr || b->size() == t_count * h_count, "bias size");
        const auto& routes = p.routes[static_cast<size_t>(s)];
        const auto& row_of = p.row_of[static_cast<size_t>(s)];
        auto& o = out[static_cast<size_t>(s)];
        o.resize(t_count * h_count);
        for_each_index(static_cast<int64_t>(t_count), [&](int64_t ti) {
            const auto t = static_cast<size_t>(ti);
            // destination ranks in order of the first k naming each
            std::vector<int64_t> dests;
            for (int k = 0; k < k_count; ++k) {
                const int64_t e = routes[t * static_cast<size_t>(k_count) + static_cast<size_t>(k)];
                if (e < 0) continue;
                const int64_t d = e / e_local;
                bool seen = false;
                for (int64_t x : dests) seen = seen || x == d;
                if (!seen) dests.push_back(d);
            }
            // nodes in order of their first rank in that list (SEMANTICS.md, "Combine" step 4)
            const int64_t p_size = config.ranks_per_node == 0 ? num_ranks : config.ranks_per_node;
            const bool hierarchical = p_size < num_ranks;
            std::vector<int64_t> nodes;
            for (int64_t d : dests) {
                bool seen = false;
                for (int64_t n : nodes) seen = seen || n == d / p_size;
                if (!seen) nodes.push_back(d / p_size);
            }
            std::vector<float> partial(dests.size());
            for (size_t h = 0; h < h_count; ++h) {
                for (size_t j = 0; j < dests.size(); ++j) {
                    const int64_t d = dests[j];
                    float part = 0.0f;
                    for (int k = 0; k < k_count; ++k) {
                        const size_t at = t * static_cast<size_t>(k_count) + static_cast<size_t>(k);
                        if (routes[at] < 0 || routes[at] / e_local != d) continue;
                        const float w = weighted ? in.topk_weights[at] : 1.0f;
                        const uint16_t yv = y[static_cast<size_t>(d)][static_cast<size_t>(row_of[at]) * h_count + h];
                        part = std::fmaf(w, float_from_bf16(yv), part);
                    }
                    partial[j] = float_from_bf16(bf16_from_float(part));
                }
                float acc = b ? float_from_bf16((*b)[t * h_count + h]) : 0.0f;
                if (!hierarchical) {
                    for (float part : partial) acc = acc + part;
                } else {
                    for (int64_t n : nodes) {
                        float q = 0.0f;
                        for (size_t j = 0; j < dests.size(); ++j)
                            if (dests[j] / p_size == n) q = q + partial[j];
                        acc = acc + float_from_bf16(bf16_from_float(q));
                    }
                }
                o[t * h_count + h] = bf16_from_float(acc);
            }
        });
    }
    return out;
}

}  // namespace elasticep::reference
