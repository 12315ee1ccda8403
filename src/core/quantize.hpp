// Reference FP8 quantizer (SEMANTICS.md "Payloads and scales"), one token row at a time.
#pragma once

#include <cstdint>

#include "elasticep/config.hpp"

namespace elasticep::detail {

// x: `hidden` bf16 values. q: `hidden` E4M3 bytes. scales: scale_columns(format, hidden) words,
// fp32 for f32_g128, packed UE8M0 int32 words otherwise (unused bytes zero).
void quantize_row(const uint16_t* x, int hidden, ScaleFormat format, uint8_t* q, void* scales);

// The inverse, for tests and the reference expert: value of element i of a quantized row.
float dequantize_element(const uint8_t* q, const void* scales, ScaleFormat format, int i);

}  // namespace elasticep::detail
