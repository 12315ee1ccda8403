// EmulatedRail (rail.hpp): the network hop as the library's own peer copies over symmetric memory
// mapped across the rail (src/transport/symmetric_memory.hpp: same-process pool or CUDA IPC).
//
// copy_kernel    grid kCopyBlocks, block 256. Work: for every other node q, the first send_bytes[q]
//                bytes of send slab q, in 16-byte chunks split over the blocks, into rail peer q's
//                receive slab [this node]. Reordering: peers in reverse order, chunks back to front.
//                Each block ends with a system fence.
// signal_kernel  one warp, after the copy (kernel boundary: every block's stores and fences are done).
//                Optional delay (ELASTICEP_EMULATED_DELAY_US), then rail peer q's signal word [phase][this
//                node] = epoch, released (GIN's ordering: nothing of the slab is read before it).
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/common/cuda_check.hpp"
#include "transport/nvlink_team.cuh"
#include "transport/scaleout/emulation.hpp"
#include "transport/scaleout/rail.hpp"
#include "transport/symmetric_memory.hpp"

namespace elasticep::transport::scaleout {
namespace {

constexpr int kCopyBlocks = 64;
constexpr int kCopyThreads = 256;

__global__ void __launch_bounds__(kCopyThreads) copy_kernel(RailCall c, NvlinkWindows rail, bool reorder) {
    if (c.state->timed_out != 0) return;
    const NvlinkTeam team{rail};
    const int peers = c.num_nodes - 1;
    if (peers <= 0) return;
    const int per_peer = max(1, static_cast<int>(gridDim.x) / peers);
    for (int b = blockIdx.x; b < peers * per_peer; b += gridDim.x) {
        const int pi = b / per_peer, part = b % per_peer;
        const int order = reorder ? peers - 1 - pi : pi;
        const int q = order < c.node ? order : order + 1;  // every node but this one
        const int64_t chunks = c.send_bytes[q] / 16;
        const int64_t c0 = chunks * part / per_peer, c1 = chunks * (part + 1) / per_peer;
        const auto* src = reinterpret_cast<const uint4*>(c.base + c.region.send_slab(c.phase, q));
        auto* dst = reinterpret_cast<uint4*>(team.window(q) + c.region.recv_slab(c.phase, c.node));
        const int64_t n = c1 - c0;
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            const int64_t at = reorder ? c1 - 1 - i : c0 + i;
            dst[at] = __ldcg(src + at);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
}

__global__ void __launch_bounds__(32) signal_kernel(RailCall c, NvlinkWindows rail, bool reorder, uint64_t delay_ns) {
    if (threadIdx.x != 0 || c.state->timed_out != 0) return;
    const NvlinkTeam team{rail};
    if (delay_ns > 0) {
        const uint64_t start = global_timer_ns();
        while (global_timer_ns() - start < delay_ns) __nanosleep(1000);
    }
    __threadfence_system();
    const uint64_t epoch = *c.epoch;
    for (int i = 0; i < c.num_nodes; ++i) {
        const int q = reorder ? c.num_nodes - 1 - i : i;
        if (q == c.node) continue;
        team.signal(q, c.region.signal(c.phase, c.node), epoch);
    }
}

class EmulatedRail final : public Rail {
 public:
    EmulatedRail(Group& rail, const kernels::hybrid::RailRegion& region, int device, cudaStream_t stream) {
        std::exception_ptr failure;  // a bad knob fails this rank; the gather below tells its rail peers
        try {
            knobs_ = EmulationKnobs::from_env();
        } catch (...) {
            failure = std::current_exception();
        }
        const Placement where = Placement::gather(rail, rail.rank(), device, failure);
        mem_ = std::make_unique<SymmetricMemory>(rail, where, static_cast<size_t>(region.bytes), stream);
        ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr_, copy_kernel));
        ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr_, signal_kernel));
    }
    ~EmulatedRail() override {
        if (mem_ && keep_) mem_->keep_local_window();
    }

    ScaleOut kind() const override { return ScaleOut::kEmulated; }
    uint8_t* base() const override { return mem_->local(); }

    void send(const RailCall& call, cudaStream_t stream, const HostSizes*, bool) override {
        if (call.num_nodes <= 1) return;
        const NvlinkWindows w = mem_->nvlink_windows();
        copy_kernel<<<kCopyBlocks, kCopyThreads, 0, stream>>>(call, w, knobs_.reorder);
        ELASTICEP_CUDA_CHECK_LAUNCH();
        signal_kernel<<<1, 32, 0, stream>>>(call, w, knobs_.reorder, static_cast<uint64_t>(knobs_.delay_us) * 1000);
        ELASTICEP_CUDA_CHECK_LAUNCH();
    }
    bool device_wait(const RailCall&, cudaStream_t) override { return false; }
    void keep_memory() override { keep_ = true; }

 private:
    EmulationKnobs knobs_;
    std::unique_ptr<SymmetricMemory> mem_;
    cudaFuncAttributes attr_{};
    bool keep_ = false;
};

}  // namespace

std::unique_ptr<Rail> make_emulated_rail(Group& rail, const kernels::hybrid::RailRegion& region, int device,
                                         cudaStream_t stream, int, int, int) {
    return std::make_unique<EmulatedRail>(rail, region, device, stream);
}

}  // namespace elasticep::transport::scaleout
