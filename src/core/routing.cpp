#include "core/routing.hpp"

#include "core/check.hpp"

namespace elasticep::detail {

RoutePlan plan_routes(const TensorRef& topk_idx, int num_experts, int num_local_experts) {
    RoutePlan p;
    const int64_t t_count = topk_idx.size(0);
    const int k_count = static_cast<int>(topk_idx.size(1));
    p.num_tokens = t_count;
    p.num_topk = k_count;
    p.idx.assign(static_cast<size_t>(t_count * k_count), -1);
    p.dest_offsets.assign(static_cast<size_t>(t_count + 1), 0);
    p.dests.reserve(static_cast<size_t>(t_count * k_count));
    const int64_t row_stride = t_count > 1 ? topk_idx.stride(0) : k_count;
    const bool wide = topk_idx.dtype == DType::kInt64;
    std::vector<int32_t> seen_dest;
    for (int64_t t = 0; t < t_count; ++t) {
        int32_t* row = &p.idx[static_cast<size_t>(t * k_count)];
        for (int k = 0; k < k_count; ++k) {
            const int64_t e = wide ? static_cast<const int64_t*>(topk_idx.data)[t * row_stride + k]
                                   : static_cast<const int32_t*>(topk_idx.data)[t * row_stride + k];
            BadRoute bad{};
            if (e < -1 || e >= num_experts) {
                bad = BadRoute{kRouteOutOfRange, static_cast<int32_t>(t), k, -1, e, 0, 0};
            } else if (e >= 0) {
                for (int j = 0; j < k; ++j)
                    if (row[j] == e) {
                        bad = BadRoute{kRouteRepeated, static_cast<int32_t>(t), k, j, e, 0, 0};
                        break;
                    }
            }
            if (bad.any()) {
                if (!p.first_bad.any()) p.first_bad = bad;
                continue;  // dropped: stays -1
            }
            row[k] = static_cast<int32_t>(e);
        }
        const size_t begin = p.dests.size();
        for (int k = 0; k < k_count; ++k) {
            if (row[k] < 0) continue;
            const int32_t d = row[k] / num_local_experts;
            bool present = false;
            for (size_t i = begin; i < p.dests.size(); ++i) present = present || p.dests[i] == d;
            if (!present) p.dests.push_back(d);
        }
        p.dest_offsets[static_cast<size_t>(t + 1)] = static_cast<int32_t>(p.dests.size());
    }
    return p;
}

}  // namespace elasticep::detail
