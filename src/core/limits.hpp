// The library's size limits, in one place: host checks (config validation, backend construction)
// name these constants in their errors, and the kernels size their per-warp and per-block tables
// from them (with static_asserts where the bound is a compile-time fact of the code).
//
// Why each bound exists:
//   kMaxRanks         per-peer tables are sized from the config, not from this constant; the bound
//                     keeps every rank set addressable by the int32 slot arithmetic and matches what
//                     DeepEP v2's ElasticBuffer supports (1024 ranks).
//   kMaxTopk          a token's top-k row is handled by one warp, lane k holding route k.
//   kMaxLocalExperts  the count exchange scans per-expert segment sizes in one block's shared memory.
//   kMaxRouteSlots    R * C * K row indices and offsets are int32 (SEMANTICS.md, "Index limits").
//   kMaxNamedPeers    a timeout names at most this many missing peers, then "and N more".
// The public bounds (kMaxRanks, kMaxTopk, kMaxRouteSlots and the other value ranges of
// docs/SEMANTICS.md) are include/elasticep/limits.hpp, for callers that validate options up front;
// this header adds the internal ones.
#pragma once

#include <cstdint>

#include "elasticep/limits.hpp"

namespace elasticep {

inline constexpr int kMaxLocalExperts = 1024;
inline constexpr int kMaxNamedPeers = 16;

inline constexpr int kWarpSize = 32;
static_assert(kMaxTopk <= kWarpSize, "a top-k row must fit one warp: lane k holds route k");

}  // namespace elasticep
