// Test support: the dispatch kernels' hardware E4M3 conversion (kernels::e4m3x2) against the
// reference arithmetic (num::float_to_e4m3) for every fp32 bit pattern, on the current device.
#pragma once

#include <cstdint>

namespace eptest {

// The number of fp32 patterns where the two differ; the first one in *first.
uint64_t e4m3_mismatches(uint32_t* first);

}  // namespace eptest
