// GinRail (rail.hpp): the network hop as NCCL's device API, GPU-initiated puts with signals on the rail
// communicator's world team (one rank per node), from and into one window registered with
// ncclCommWindowRegister over memory from ncclMemAlloc. Compiled whenever the build has NCCL 2.28+
// (its headers under nccl_device/); at buffer build, a rail without GIN (no RDMA NIC, or NCCL's Socket
// network) makes ncclDevCommCreate fail, and scaleout=gin raises Unsupported with NCCL's own words.
//
// put_kernel   one thread. For every other node q: one put of send_bytes[q] bytes of send slab q into
//              q's receive slab [this node], with SignalInc of signal (phase, this node) at q: NCCL makes
//              the signal visible only after the put's payload (and earlier puts to q) settled. Zero
//              bytes: the signal alone. Then a flush (the send slabs may be rewritten by the next call).
// wait_kernel  one thread. Until signal (phase, p) reached the call's epoch for every other node p
//              (one increment per call and phase), bounded; a timeout names the missing rail peers.
#include "core/check.hpp"
#include "transport/scaleout/rail.hpp"

#if defined(ELASTICEP_HAVE_NCCL) && defined(ELASTICEP_HAVE_NCCL_DEVICE)  // CMake: nccl_device.h of NCCL 2.28+
#include <nccl.h>
#define ELASTICEP_GIN 1
#endif

#if defined(ELASTICEP_GIN)
#include <nccl_device.h>

#include <cstring>

#include "kernels/common/cuda_check.hpp"
#include "kernels/hybrid/params.cuh"
#include "transport/scaleout/nccl_api.hpp"
#include "transport/scaleout/nccl_comm.hpp"
#endif

namespace elasticep::transport::scaleout {

#if defined(ELASTICEP_GIN)
namespace {

__device__ __forceinline__ ncclGinSignal_t signal_id(int phase, int node, int num_nodes) {
    return static_cast<ncclGinSignal_t>((phase == detail::kPhaseDispatch ? 0 : 1) * num_nodes + node);
}

__global__ void __launch_bounds__(32) put_kernel(RailCall c, ncclDevComm dev, ncclWindow_t win) {
    if (threadIdx.x != 0 || c.state->timed_out != 0) return;
    ncclGin gin(dev, 0);
    const ncclTeam world = ncclTeamWorld(dev);
    const ncclGinSignal_t sig = signal_id(c.phase, c.node, c.num_nodes);
    for (int q = 0; q < c.num_nodes; ++q) {
        if (q == c.node) continue;
        const int64_t bytes = c.send_bytes[q];
        if (bytes > 0)
            gin.put(world, q, win, static_cast<size_t>(c.region.recv_slab(c.phase, c.node)), win,
                    static_cast<size_t>(c.region.send_slab(c.phase, q)), static_cast<size_t>(bytes),
                    ncclGin_SignalInc{sig});
        else
            gin.signal(world, q, ncclGin_SignalInc{sig});
    }
    gin.flush(ncclCoopThread{});
}

__global__ void __launch_bounds__(32) wait_kernel(RailCall c, ncclDevComm dev) {
    if (threadIdx.x != 0 || c.state->timed_out != 0) return;
    ncclGin gin(dev, 0);
    const uint64_t epoch = *c.epoch;
    const Deadline deadline = Deadline::from_now(c.timeout_ns);
    for (int p = 0; p < c.num_nodes; ++p) {
        if (p == c.node) continue;
        while (gin.readSignal(signal_id(c.phase, p, c.num_nodes)) < epoch) {
            if (!deadline.expired()) {
                __nanosleep(128);
                continue;
            }
            detail::MissingPeers m{};
            m.observed = epoch;
            for (int q = 0; q < c.num_nodes; ++q) {
                if (q == c.node) continue;
                const uint64_t seen = gin.readSignal(signal_id(c.phase, q, c.num_nodes));
                if (seen >= epoch) continue;
                if (m.count < kMaxNamedPeers) m.named[m.count] = q * c.node_size + c.local;
                ++m.count;
                m.observed = seen < m.observed ? seen : m.observed;
            }
            if (m.count == 0) break;
            kernels::hybrid::record_timeout(c.record, c.phase, detail::kHopNetwork, epoch, m);
            c.state->timed_out = 1;
            return;
        }
    }
}

class GinRail final : public Rail {
 public:
    GinRail(std::shared_ptr<NcclComm> comm, const kernels::hybrid::RailRegion& region, int device, cudaStream_t stream,
            int node)
        : comm_(std::move(comm)), bytes_(static_cast<size_t>(region.bytes)), node_(node) {
        try {
            build(region, device, stream);
        } catch (const Error& e) {
            release();
            // an NCCL call of the GIN set-up that fails (ncclMemAlloc, the window) means no GIN here either
            if (e.code() == ErrorCode::kNccl)
                detail::raise(ErrorCode::kUnsupported, "scaleout=gin: setting up GIN on the rail failed: " +
                                                           e.message() + "; use scaleout=nccl");
            throw;
        } catch (...) {
            release();
            throw;
        }
    }
    ~GinRail() override { release(); }

    ScaleOut kind() const override { return ScaleOut::kGin; }
    uint8_t* base() const override { return static_cast<uint8_t*>(buf_); }
    void keep_memory() override { keep_ = true; }

    void send(const RailCall& call, cudaStream_t stream, const HostSizes*, bool) override {
        if (call.num_nodes <= 1) return;
        put_kernel<<<1, 32, 0, stream>>>(call, dev_, win_);
        ELASTICEP_CUDA_CHECK_LAUNCH();
    }
    bool device_wait(const RailCall& call, cudaStream_t stream) override {
        if (call.num_nodes <= 1) return true;
        wait_kernel<<<1, 32, 0, stream>>>(call, dev_);
        ELASTICEP_CUDA_CHECK_LAUNCH();
        return true;
    }

 private:
    void build(const kernels::hybrid::RailRegion& region, int device, cudaStream_t stream) {
        const NcclApi& api = nccl_api();
        ncclComm_t c = comm_->get();
        ELASTICEP_CHECK(api.version / 100 == NCCL_VERSION_CODE / 100, ErrorCode::kUnsupported,
                        "scaleout=gin: ElasticEP was built against NCCL ", NCCL_VERSION_CODE, " but loaded ",
                        api.version, " (", api.path,
                        "); GIN's device structures must match: load the NCCL of the build (ELASTICEP_NCCL_LIBRARY) "
                        "or use scaleout=nccl");
        ELASTICEP_CHECK(api.mem_alloc && api.mem_free && api.window_register && api.window_deregister &&
                            api.dev_comm_create && api.dev_comm_destroy,
                        ErrorCode::kUnsupported, "scaleout=gin: the loaded NCCL (", api.path,
                        ") lacks the device API (NCCL 2.28 or later); use scaleout=nccl");
        ELASTICEP_CUDA_CALL(cudaSetDevice(device));
        ELASTICEP_NCCL_CALL(c, api.mem_alloc(&buf_, bytes_));
        ELASTICEP_CUDA_CALL(cudaMemsetAsync(buf_, 0, bytes_, stream));
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
        ELASTICEP_NCCL_CALL(c, api.window_register(c, buf_, bytes_, &win_, NCCL_WIN_COLL_SYMMETRIC));
        registered_ = true;
        ncclDevCommRequirements reqs;
        std::memset(&reqs, 0, sizeof(reqs));
        reqs.ginForceEnable = true;
        reqs.ginContextCount = 1;
        reqs.ginSignalCount = 2 * region.num_nodes;
        const auto create = reinterpret_cast<decltype(&::ncclDevCommCreate)>(api.dev_comm_create);
        const ncclResult_t r = create(c, &reqs, &dev_);
        ELASTICEP_CHECK(r == ncclSuccess, ErrorCode::kUnsupported,
                        "scaleout=gin: NCCL has no GPU-initiated networking (GIN) on the rail: ",
                        nccl_error("ncclDevCommCreate", r, c),
                        ". GIN needs an RDMA NIC with GPUDirect (NCCL's GDAKI or IB proxy backend; its Socket "
                        "network has none); use scaleout=nccl (NCCL point-to-point over any network)");
        created_ = true;
        ELASTICEP_CHECK(dev_.ginContextCount > 0, ErrorCode::kUnsupported,
                        "scaleout=gin: NCCL created the rail's device communicator without a GIN context (no "
                        "GIN-capable network here); use scaleout=nccl");
        cudaFuncAttributes attr{};
        ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, put_kernel));
        ELASTICEP_CUDA_CALL(cudaFuncGetAttributes(&attr, wait_kernel));
    }

    void release() noexcept {
        if (comm_ == nullptr || comm_->aborted()) return;
        const NcclApi& api = nccl_api();
        ncclComm_t c = comm_->get();
        if (created_) reinterpret_cast<decltype(&::ncclDevCommDestroy)>(api.dev_comm_destroy)(c, &dev_);
        created_ = false;
        if (registered_) api.window_deregister(c, win_);
        registered_ = false;
        if (buf_ != nullptr && !keep_) api.mem_free(buf_);
        buf_ = nullptr;
    }

    std::shared_ptr<NcclComm> comm_;
    size_t bytes_;
    int node_;
    void* buf_ = nullptr;
    ncclWindow_t win_{};
    ncclDevComm dev_{};
    bool registered_ = false, created_ = false, keep_ = false;
};

}  // namespace

std::unique_ptr<Rail> make_gin_rail(std::shared_ptr<NcclComm> comm, const kernels::hybrid::RailRegion& region,
                                    int device, cudaStream_t stream, int node) {
    return std::make_unique<GinRail>(std::move(comm), region, device, stream, node);
}

#else

std::unique_ptr<Rail> make_gin_rail(std::shared_ptr<NcclComm>, const kernels::hybrid::RailRegion&, int, cudaStream_t,
                                    int) {
    detail::raise(ErrorCode::kUnsupported,
                  "scaleout=gin: GIN (NCCL's device API: NCCL 2.28 or later with its nccl_device.h headers at build "
                  "time) is not compiled into this build; use scaleout=nccl or emulated");
}

#endif

}  // namespace elasticep::transport::scaleout
