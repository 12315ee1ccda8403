// Route validation and per-token destination lists, shared by the host-side backends.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/protocol.hpp"
#include "elasticep/tensor.hpp"

namespace elasticep::detail {

// The first invalid route of a call (SEMANTICS.md: ids outside [-1, E), or a repeated id): the
// protocol's RouteStatus (plain data: value-initialise it, `BadRoute b{}`).
using BadRoute = RouteStatus;

// Routes of one rank's tokens after validation. Invalid routes become -1 (dropped).
struct RoutePlan {
    int64_t num_tokens = 0;
    int num_topk = 0;
    std::vector<int32_t> idx;           // [T, K] cleaned expert ids
    std::vector<int32_t> dest_offsets;  // [T + 1] into dests
    std::vector<int32_t> dests;         // each token's distinct destination ranks in first-k order
    BadRoute first_bad{};
};

// Reads topk_idx (int32 or int64, rows may be strided; host memory) and builds the plan.
RoutePlan plan_routes(const TensorRef& topk_idx, int num_experts, int num_local_experts);

}  // namespace elasticep::detail
