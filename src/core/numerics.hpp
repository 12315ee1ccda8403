// Bit-exact scalar arithmetic of SEMANTICS.md: bf16 rounding, E4M3 conversion, FP8 scales.
// Written with integer bit operations only (no libm, no rounding-mode dependence), so host and
// device produce the same bytes. Device code may use faster intrinsics only where the gpu tests
// prove them equal to these functions.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/hd.hpp"

namespace elasticep::num {

ELASTICEP_HD uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(v);
#else
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    return u;
#endif
}

ELASTICEP_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float v;
    std::memcpy(&v, &u, sizeof(v));
    return v;
#endif
}

ELASTICEP_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline constexpr uint16_t kBf16NaN = 0x7fc0;  // canonical quiet NaN (torch's host c10::BFloat16 rounding gives it too)

// Round to nearest even; every NaN (any sign, any payload, quiet or signalling) becomes kBf16NaN,
// so CPU and GPU give the same bytes whichever NaN their fp32 arithmetic carried (x86 fmaf keeps an
// operand's payload and makes 0xffc00000 for 0 * Inf; the GPU makes 0x7fffffff).
ELASTICEP_HD uint16_t float_to_bf16(float v) {
    uint32_t u = float_bits(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return kBf16NaN;
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// Round-to-nearest-even of `mant >> shift` (shift in [1, 31]).
ELASTICEP_HD uint32_t shift_rne(uint32_t mant, uint32_t shift) {
    const uint32_t keep = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    return keep + ((rem > half || (rem == half && (keep & 1u))) ? 1u : 0u);
}

inline constexpr uint8_t kE4M3NaN = 0x7f;      // canonical NaN, what CUDA's satfinite cvt returns
inline constexpr uint8_t kE4M3MaxCode = 0x7e;  // 448
inline constexpr float kE4M3Max = 448.0f;

// OCP E4M3 (bias 7, max 448, subnormals down to 2^-9), round to nearest even, saturating to
// +-448 (infinities too); NaN -> 0x7f.
ELASTICEP_HD uint8_t float_to_e4m3(float v) {
    const uint32_t u = float_bits(v);
    const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return kE4M3NaN;
    if (a >= 0x43e00000u) return sign | kE4M3MaxCode;  // |v| >= 448
    const int exp = static_cast<int>(a >> 23) - 127;
    const uint32_t mant = a & 0x7fffffu;
    if (exp >= -6) {  // E4M3 normal range; a carry out of the mantissa bumps the exponent
        const uint32_t code = (static_cast<uint32_t>(exp + 7) << 3) + shift_rne(mant, 20);
        return sign | static_cast<uint8_t>(code);
    }
    if (exp < -126) return sign;  // fp32 subnormal: far below 2^-10
    // value * 2^9 = (mant | 1<<23) * 2^(exp - 14); shift >= 21
    const uint32_t shift = static_cast<uint32_t>(14 - exp);
    if (shift > 25) return sign;  // below a quarter of 2^-9
    return sign | static_cast<uint8_t>(shift_rne(mant | 0x800000u, shift));
}

ELASTICEP_HD float e4m3_to_float(uint8_t c) {
    const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
    const uint32_t e = (c >> 3) & 0xfu;
    const uint32_t m = c & 0x7u;
    if (e == 0xf && m == 0x7) return bits_float(sign | 0x7fc00000u);
    if (e == 0) {  // subnormal: m * 2^-9
        if (m == 0) return bits_float(sign);
        // normalise: m = 1.xx * 2^p
        uint32_t p = 2;
        while (!(m & (1u << p))) --p;
        const uint32_t frac = (m & ((1u << p) - 1u)) << (23 - p);
        const uint32_t fexp = static_cast<uint32_t>(static_cast<int>(p) - 9 + 127);
        return bits_float(sign | (fexp << 23) | frac);
    }
    return bits_float(sign | ((e - 7 + 127) << 23) | (m << 20));
}

// |x| maximum as fmaxf does it (a NaN element is ignored), floored at 1e-4.
inline constexpr float kAmaxFloor = 1e-4f;

ELASTICEP_HD float fmax_ignore_nan(float a, float b) {
    if (b != b) return a;
    if (a != a) return b;
    return a > b ? a : b;
}

ELASTICEP_HD float abs_bits(float v) { return bits_float(float_bits(v) & 0x7fffffffu); }

// UE8M0 exponent byte of 2^ceil(log2(q)) for q = amax / 448 (> 0): the biased exponent of q,
// plus one when any mantissa bit is set.
ELASTICEP_HD uint8_t ue8m0_exponent_byte(float quotient) {
    const uint32_t u = float_bits(quotient);
    uint32_t e = (u >> 23) & 0xffu;
    if (u & 0x7fffffu) e += 1;
    return static_cast<uint8_t>(e > 255u ? 255u : e);
}

// 2^-(byte-127) as fp32 (exact; subnormal for byte >= 254).
ELASTICEP_HD float ue8m0_inverse(uint8_t byte) {
    const int biased = 254 - static_cast<int>(byte);
    if (biased >= 1) return bits_float(static_cast<uint32_t>(biased) << 23);
    if (biased >= -22) return bits_float(1u << (22 + biased));
    return 0.0f;
}

ELASTICEP_HD float ue8m0_value(uint8_t byte) {
    // 2^(byte-127); byte 0 is 2^-127 (subnormal), 255 is NaN by the UE8M0 convention.
    if (byte == 255) return bits_float(0x7fc00000u);
    if (byte == 0) return bits_float(0x00400000u);
    return bits_float(static_cast<uint32_t>(byte) << 23);
}

}  // namespace elasticep::num
