#include "core/quantize.hpp"

#include "core/numerics.hpp"

namespace elasticep::detail {

void quantize_row(const uint16_t* x, int hidden, ScaleFormat format, uint8_t* q, void* scales) {
    const int g = scale_group_size(format);
    const int groups = hidden / g;
    if (format != ScaleFormat::kF32G128) {
        auto* words = static_cast<uint32_t*>(scales);
        for (int w = 0; w < (groups + 3) / 4; ++w) words[w] = 0;
    }
    for (int gi = 0; gi < groups; ++gi) {
        const uint16_t* xs = x + gi * g;
        float amax = 0.0f;
        for (int i = 0; i < g; ++i) amax = num::fmax_ignore_nan(amax, num::abs_bits(num::bf16_to_float(xs[i])));
        amax = num::fmax_ignore_nan(amax, num::kAmaxFloor);
        float mul;
        if (format == ScaleFormat::kF32G128) {
            static_cast<float*>(scales)[gi] = amax / num::kE4M3Max;
            mul = num::kE4M3Max / amax;
        } else {
            const uint8_t byte = num::ue8m0_exponent_byte(amax / num::kE4M3Max);
            static_cast<uint32_t*>(scales)[gi / 4] |= static_cast<uint32_t>(byte) << (8 * (gi % 4));
            mul = num::ue8m0_inverse(byte);
        }
        for (int i = 0; i < g; ++i) q[gi * g + i] = num::float_to_e4m3(num::bf16_to_float(xs[i]) * mul);
    }
}

float dequantize_element(const uint8_t* q, const void* scales, ScaleFormat format, int i) {
    const int gi = i / scale_group_size(format);
    float scale;
    if (format == ScaleFormat::kF32G128) {
        scale = static_cast<const float*>(scales)[gi];
    } else {
        const uint32_t word = static_cast<const uint32_t*>(scales)[gi / 4];
        scale = num::ue8m0_value(static_cast<uint8_t>(word >> (8 * (gi % 4))));
    }
    return num::e4m3_to_float(q[i]) * scale;
}

}  // namespace elasticep::detail
