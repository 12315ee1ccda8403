// Device self-checks the gpu tests call (declared weak there, so CPU-only builds still link).
#pragma once

#include <cstdint>

namespace elasticep::detail {

// Runs the dispatch kernels' E4M3 conversion and num::float_to_e4m3 on every fp32 bit pattern of
// the current device; returns the number of patterns where they differ (first one in *first).
uint64_t cuda_e4m3_mismatches(uint32_t* first);

}  // namespace elasticep::detail
