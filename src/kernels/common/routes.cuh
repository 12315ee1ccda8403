// The route-status pieces both dispatch paths share (intranode staged and direct, hybrid): reading
// the top-k table, the first invalid route of a call, the device copy of the sticky word and the
// call's route status (protocol.hpp, decide_route_status). Templates over the path's parameter
// struct: it has shape (num_experts, num_topk), num_tokens, topk_idx / topk_idx_row_stride,
// host_sync, record (HostRecord*) and ws (first_bad_route, state->sticky_seen).
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/protocol.hpp"
#include "kernels/common/buffer_layout.hpp"
#include "kernels/common/primitives.cuh"

namespace elasticep::kernels {

using detail::RouteStatus;

// topk_idx[t][k] of this rank's input, int32 or int64 (kIdx64)
template <bool kIdx64, class Params>
__device__ __forceinline__ int64_t topk_at(const Params& p, int t, int k) {
    using Index = std::conditional_t<kIdx64, int64_t, int32_t>;
    return static_cast<const Index*>(p.topk_idx)[t * p.topk_idx_row_stride + k];
}

// The first invalid route (t, k) of the call in token-major order, as a global minimum
// (ws.first_bad_route): warp w of `warps` takes tokens w, w + warps, ...
template <bool kIdx64, class Params>
__device__ __forceinline__ void scan_route_status(const Params& p, int first_warp, int warps) {
    const auto& sh = p.shape;
    const int lane = lane_id();
    for (int t = first_warp; t < p.num_tokens; t += warps) {
        const bool active = lane < sh.num_topk;
        const int64_t v = active ? topk_at<kIdx64>(p, t, lane) : -1;
        int fault, dup;
        clean_route(v, active, sh.num_experts, fault, dup);
        const unsigned bad = __ballot_sync(kFullMask, fault != detail::kRouteOk);
        if (bad && lane == 0) atomicMin(p.ws.first_bad_route, detail::route_key(t, __ffs(bad) - 1));
    }
}

// One thread copies the sticky word from host-mapped memory into the workspace (sticky_seen), for
// the send kernel and the exchange: reads of mapped memory cross PCIe one at a time, so no wide
// kernel may read it.
template <class Params>
__device__ __forceinline__ void copy_sticky_word(const Params& p) {
    p.ws.state->sticky_seen = reinterpret_cast<volatile int32_t*>(&p.record->sticky.kind)[0];
}

// The call's route status, resolved once by the exchange (one thread): this call's first invalid
// route and the sticky word go through decide_route_status (protocol.hpp); graph mode records the
// first invalid route as the sticky fault.
// `key`: the route_key of the call's first invalid route (kNoRouteKey: none).
template <bool kIdx64, class Params>
__device__ RouteStatus resolve_route_status_of(const Params& p, unsigned long long key) {
    const auto& sh = p.shape;
    RouteStatus bad{};
    if (key != detail::kNoRouteKey) {
        const int t = static_cast<int>(detail::route_key_token(key)), k = detail::route_key_k(key);
        const int64_t v = topk_at<kIdx64>(p, t, k);
        bad.token = t;
        bad.k = k;
        bad.value = v;
        bad.dup_of = -1;
        if (v < -1 || v >= sh.num_experts) {
            bad.kind = detail::kRouteOutOfRange;
        } else {
            bad.kind = detail::kRouteRepeated;
            for (int j = 0; j < k; ++j)
                if (topk_at<kIdx64>(p, t, j) == v) {
                    bad.dup_of = j;
                    break;
                }
        }
    }
    volatile RouteStatus* sticky = &p.record->sticky;
    RouteStatus now{};
    now.kind = sticky->kind;
    now.token = sticky->token;
    now.k = sticky->k;
    now.dup_of = sticky->dup_of;
    now.value = sticky->value;
    const detail::RouteDecision d = detail::decide_route_status(p.host_sync, now, bad);
    if (d.clear_sticky) sticky->kind = detail::kRouteOk;
    if (d.record_sticky) {
        sticky->token = bad.token;
        sticky->k = bad.k;
        sticky->dup_of = bad.dup_of;
        sticky->value = bad.value;
        __threadfence_system();
        sticky->kind = bad.kind;
    }
    return d.publish;
}

// The plan kernel's first invalid route (ws.first_bad_route, reset here for the next call). With
// no invalid route and no sticky fault (the plan kernel's copy of the sticky word, sticky_seen) the
// status is OK whatever the mode, and the host-mapped record is not read: each of its words is a
// PCIe round trip on the critical path of every call.
template <bool kIdx64, class Params>
__device__ RouteStatus resolve_route_status(const Params& p) {
    const unsigned long long key = *p.ws.first_bad_route;
    *p.ws.first_bad_route = detail::kNoRouteKey;
    if (key == detail::kNoRouteKey && p.ws.state->sticky_seen == detail::kRouteOk) return RouteStatus{};
    return resolve_route_status_of<kIdx64>(p, key);
}

}  // namespace elasticep::kernels
