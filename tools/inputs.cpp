#include "inputs.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>

#include "core/numerics.hpp"
#include "core/parallel.hpp"

namespace elasticep::cli {
namespace {

// splitmix64: small, fast and the same everywhere (std distributions are not portable).
struct Rng {
    uint64_t state;
    explicit Rng(uint64_t seed, uint64_t stream)
        : state(seed * 0x9e3779b97f4a7c15ull ^ (stream + 1) * 0xd1b54a32d192ed03ull) {}
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }                       // [0, 1)
    double uniform_open() { return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }  // (0, 1)
    uint32_t below(uint32_t n) { return static_cast<uint32_t>((next() >> 32) * n >> 32); }
};

enum Stream : uint64_t { kExperts = 1, kX = 2, kRoutes = 3, kWeights = 4, kBias = 5, kScales = 6 };

uint64_t stream_of(int rank, Stream s) { return static_cast<uint64_t>(rank) * 16 + s; }

// Roughly normal activations with a few outlier channels, as real hidden states have.
float activation(Rng& rng, int channel) {
    const float v = rng.uniform() + rng.uniform() + rng.uniform() + rng.uniform() - 2.0f;
    return (channel * 2654435761u >> 26) == 0 ? v * 16.0f : v;  // about 1 channel in 64
}

}  // namespace

void parallel_for(int n, const std::function<void(int)>& fn) {
    detail::parallel_for(n, detail::hardware_threads(), [&](int64_t i) { fn(static_cast<int>(i)); });
}

std::vector<RankData> make_inputs(const Scenario& s) {
    const BufferConfig cfg = s.buffer_config();
    const int h = cfg.hidden, k = cfg.num_topk, e = cfg.num_experts;
    const std::vector<int64_t> tokens = s.tokens_per_rank();

    // Expert popularity, shared by every rank.
    std::vector<double> popularity(static_cast<size_t>(e));
    {
        std::vector<int> perm(static_cast<size_t>(e));
        std::iota(perm.begin(), perm.end(), 0);
        Rng rng(s.seed, stream_of(0, kExperts));
        for (int i = e - 1; i > 0; --i)
            std::swap(perm[static_cast<size_t>(i)], perm[rng.below(static_cast<uint32_t>(i + 1))]);
        for (int i = 0; i < e; ++i)
            popularity[static_cast<size_t>(perm[static_cast<size_t>(i)])] = std::pow(i + 1.0, -s.skew);
    }

    std::vector<RankData> out(static_cast<size_t>(s.num_ranks));
    parallel_for(s.num_ranks, [&](int r) {
        RankData& d = out[static_cast<size_t>(r)];
        reference::RankInput& in = d.input;
        const int64_t t_count = tokens[static_cast<size_t>(r)];
        in.num_tokens = t_count;
        const size_t n = static_cast<size_t>(t_count) * static_cast<size_t>(h);

        Rng xr(s.seed, stream_of(r, kX));
        if (s.payload == Payload::kFP8 && s.prequantized) {
            const int cols = scale_columns(cfg.scale_format, h);
            in.x_fp8.resize(n);
            for (auto& q : in.x_fp8) {
                auto c = static_cast<uint8_t>(xr.next() >> 56);
                if ((c & 0x7f) == 0x7f) c ^= 0x01;  // keep clear of the NaN codes
                q = c;
            }
            in.x_scales.assign(static_cast<size_t>(t_count) * static_cast<size_t>(cols), 0u);
            Rng sr(s.seed, stream_of(r, kScales));
            const int groups =
                static_cast<int>((h + scale_group_size(cfg.scale_format) - 1) / scale_group_size(cfg.scale_format));
            for (int64_t t = 0; t < t_count; ++t) {
                uint32_t* row = &in.x_scales[static_cast<size_t>(t) * static_cast<size_t>(cols)];
                for (int g = 0; g < groups; ++g) {
                    if (cfg.scale_format == ScaleFormat::kF32G128) {
                        row[g] = num::float_bits(std::ldexp(1.0f + sr.uniform(), -10 + static_cast<int>(sr.below(6))));
                    } else {
                        const uint32_t byte = 115 + sr.below(16);  // 2^-12 .. 2^3
                        row[g / 4] |= byte << (8 * (g % 4));
                    }
                }
            }
        } else {
            in.x.resize(n);
            for (size_t i = 0; i < n; ++i)
                in.x[i] = num::float_to_bf16(activation(xr, static_cast<int>(i % static_cast<size_t>(h))));
        }

        // K distinct experts per token: Efraimidis-Spirakis keys -log(u)/w, the K smallest win.
        Rng rr(s.seed, stream_of(r, kRoutes));
        Rng wr(s.seed, stream_of(r, kWeights));
        in.topk_idx.assign(static_cast<size_t>(t_count) * static_cast<size_t>(k), -1);
        if (s.weighted) in.topk_weights.assign(static_cast<size_t>(t_count) * static_cast<size_t>(k), 0.0f);
        std::vector<std::pair<double, int>> keys(static_cast<size_t>(e));
        for (int64_t t = 0; t < t_count; ++t) {
            for (int x = 0; x < e; ++x)
                keys[static_cast<size_t>(x)] = {-std::log(rr.uniform_open()) / popularity[static_cast<size_t>(x)], x};
            std::partial_sort(keys.begin(), keys.begin() + k, keys.end());
            float sum = 0.0f;
            for (int j = 0; j < k; ++j) {
                const bool dropped = s.drop > 0.0 && rr.uniform_open() < s.drop;
                const size_t at = static_cast<size_t>(t) * static_cast<size_t>(k) + static_cast<size_t>(j);
                in.topk_idx[at] = dropped ? -1 : keys[static_cast<size_t>(j)].second;
                if (s.weighted) {
                    const float w = dropped ? 0.0f : 0.05f + wr.uniform();
                    in.topk_weights[at] = w;
                    sum += w;
                }
            }
            if (s.weighted && sum > 0.0f)
                for (int j = 0; j < k; ++j)
                    in.topk_weights[static_cast<size_t>(t) * static_cast<size_t>(k) + static_cast<size_t>(j)] /= sum;
        }
        if (!s.idx_int64) d.idx32.assign(in.topk_idx.begin(), in.topk_idx.end());

        if (s.bias) {
            Rng br(s.seed, stream_of(r, kBias));
            d.bias.resize(n);
            for (auto& b : d.bias) b = num::float_to_bf16(br.uniform() - 0.5f);
        }
    });
    return out;
}

float expert_factor(int global_expert) { return 0.5f + 0.125f * static_cast<float>(global_expert % 8); }

void expert_output_row(const BufferConfig& cfg, const uint8_t* x_row, const uint32_t* scales, int global_expert,
                       uint16_t* y_row) {
    const float f = expert_factor(global_expert);
    const int h = cfg.hidden;
    if (cfg.payload == Payload::kBF16) {
        const auto* x = reinterpret_cast<const uint16_t*>(x_row);
        for (int i = 0; i < h; ++i) {
            uint16_t b;
            std::memcpy(&b, x + i, 2);
            y_row[i] = num::float_to_bf16(num::bf16_to_float(b) * f);
        }
        return;
    }
    const int group = scale_group_size(cfg.scale_format);
    for (int g = 0; g * group < h; ++g) {
        float scale;
        if (cfg.scale_format == ScaleFormat::kF32G128) {
            scale = num::bits_float(scales[g]);
        } else {
            scale = num::ue8m0_value(static_cast<uint8_t>(scales[g / 4] >> (8 * (g % 4))));
        }
        const int end = std::min(h, (g + 1) * group);
        for (int i = g * group; i < end; ++i) y_row[i] = num::float_to_bf16(num::e4m3_to_float(x_row[i]) * scale * f);
    }
}

}  // namespace elasticep::cli
