// Bounds of every parameter the library checks: BufferConfig::validate, the dispatch checks, the
// CLI (which names them in its errors before anything runs) and the backends read these constants
// (docs/SEMANTICS.md, "Value ranges"). Each bound keeps every size, offset and row index inside the
// integer type that holds it, on every backend.
#pragma once

#include <chrono>
#include <cstdint>

namespace elasticep {

inline constexpr int kMaxRanks = 1024;                       // ranks in one group (Group::size)
inline constexpr int kMaxExperts = 1 << 16;                  // num_experts
inline constexpr int kMaxTopk = 32;                          // num_topk
inline constexpr int kMaxHidden = 1 << 16;                   // hidden
inline constexpr int64_t kMaxRouteSlots = int64_t{1} << 30;  // ranks * max_tokens_per_rank * num_topk (exclusive)
inline constexpr int64_t kMaxRows = int64_t{1} << 31;  // masked slab rows E_local*R*C, contiguous M_cap (exclusive)
inline constexpr int kMaxExpertAlignment = 1 << 16;    // DispatchArgs::expert_alignment
inline constexpr int kMaxSms = 1024;                   // num_sms (the CUDA backend caps it at the device's count)
inline constexpr std::chrono::milliseconds kMaxTimeout{int64_t{7} * 24 * 3600 * 1000};  // 7 days

}  // namespace elasticep
