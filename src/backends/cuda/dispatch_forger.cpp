#include "backends/cuda/dispatch_forger.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/testing.hpp"
#include "kernels/common/cuda_check.hpp"

namespace elasticep::detail::cuda {
namespace {

// Copies `bytes` between the host and device memory on `stream` and waits for it.
void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    if (bytes == 0) return;
    ELASTICEP_CUDA_CALL(cudaMemcpyAsync(dst, src, bytes, kind, stream));
    ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
}

int32_t saturate(int64_t v) {
    return static_cast<int32_t>(
        std::clamp<int64_t>(v, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()));
}

}  // namespace

void forge_outgoing(const testing::DispatchForger& forger, int rank, const kernels::Shape& sh,
                    const kernels::RegionLayout& region, const std::vector<uint8_t*>& windows,
                    const kernels::Workspace& ws, cudaStream_t stream) {
    const size_t ranks = static_cast<size_t>(sh.num_ranks), local = static_cast<size_t>(sh.num_local_experts);
    const size_t slot_bytes = static_cast<size_t>(sh.capacity) * static_cast<size_t>(sh.msg.bytes);
    const size_t pos_count = static_cast<size_t>(sh.capacity) * static_cast<size_t>(sh.num_topk);
    ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));  // the plan and send kernels are done
    std::vector<int32_t> dest(ranks), experts(ranks * local);
    copy(dest.data(), ws.dest_count, ranks * 4, cudaMemcpyDeviceToHost, stream);
    copy(experts.data(), ws.expert_count, ranks * local * 4, cudaMemcpyDeviceToHost, stream);
    const std::vector<int32_t> dest_sent = dest, experts_sent = experts;
    const int64_t first_slot = int64_t{rank} * sh.capacity;
    for (int d = 0; d < sh.num_ranks; ++d) {
        uint8_t* msgs = windows[static_cast<size_t>(d)] + region.message(first_slot);
        uint8_t* pos = windows[static_cast<size_t>(d)] + region.route_pos_row(first_slot);
        std::vector<uint8_t> slots(slot_bytes);
        std::vector<int32_t> route_pos(pos_count);
        copy(slots.data(), msgs, slot_bytes, cudaMemcpyDeviceToHost, stream);
        copy(route_pos.data(), pos, pos_count * 4, cudaMemcpyDeviceToHost, stream);
        const std::vector<uint8_t> slots_sent = slots;
        const std::vector<int32_t> route_pos_sent = route_pos;
        testing::OutgoingDispatch o{rank, d, dest[static_cast<size_t>(d)], slots.data(), sh.capacity, sh.msg};
        o.expert_counts = experts.data() + static_cast<size_t>(d) * local;
        o.route_pos = route_pos.data();
        o.num_local_experts = sh.num_local_experts;
        forger(o);
        dest[static_cast<size_t>(d)] = saturate(o.count);
        if (slots != slots_sent) copy(msgs, slots.data(), slot_bytes, cudaMemcpyHostToDevice, stream);
        if (route_pos != route_pos_sent) copy(pos, route_pos.data(), pos_count * 4, cudaMemcpyHostToDevice, stream);
    }
    if (dest != dest_sent) copy(ws.dest_count, dest.data(), ranks * 4, cudaMemcpyHostToDevice, stream);
    if (experts != experts_sent)
        copy(ws.expert_count, experts.data(), ranks * local * 4, cudaMemcpyHostToDevice, stream);
}

}  // namespace elasticep::detail::cuda
