// Bounds of the parameters the library checks, for callers that validate options up front (the
// CLI names them in its errors before anything runs).
#pragma once

namespace elasticep {

inline constexpr int kMaxRanks = 1024;             // ranks of one group (Group::size)
inline constexpr int kMaxTopk = 32;                // BufferConfig::num_topk in [1, 32]
inline constexpr int kMaxExpertAlignment = 65536;  // DispatchArgs::expert_alignment in [1, 65536]

}  // namespace elasticep
