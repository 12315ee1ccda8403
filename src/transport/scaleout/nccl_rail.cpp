// NcclRail (rail.hpp): the network hop as NCCL host point-to-point, grouped ncclSend/ncclRecv between
// rail peers on the call's stream (graph-capturable). The rail communicator holds one rank per node
// (the ranks with one local index), so no two of its ranks share a GPU inside one process, which NCCL
// 2.28 cannot do. Sizes are the host's: whole slabs in graph mode, exact bytes after the count
// exchange with host sync (hybrid_backend.cu). Visibility is stream order; an eager move is bounded by
// the watchdog `settle` (the next call, or a host sync, waits for it at most the buffer's timeout from
// the move, then aborts the communicator and raises Timeout naming the rail peers).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "core/check.hpp"
#include "core/protocol.hpp"
#include "kernels/common/cuda_check.hpp"
#include "transport/device_pool.hpp"
#include "transport/scaleout/nccl_api.hpp"
#include "transport/scaleout/nccl_comm.hpp"
#include "transport/scaleout/rail.hpp"

namespace elasticep::transport::scaleout {

#if defined(ELASTICEP_HAVE_NCCL)

bool nccl_compiled() { return true; }

std::string nccl_build_version() { return detail::cat(NCCL_MAJOR, ".", NCCL_MINOR, ".", NCCL_PATCH); }

NcclComm::NcclComm(Group& rail, int device, bool blocking, std::chrono::milliseconds timeout)
    : rank_(rail.rank()), size_(rail.size()), device_(device) {
    ::setenv("NCCL_CUMEM_ENABLE", "1", 0);  // an explicit setting wins
    struct Hello {
        int32_t ok;
        ncclUniqueId id;
        char why[256];
    };
    Hello me{};
    me.ok = 1;
    try {
        const NcclApi& api = nccl_api();
        if (rank_ == 0) {
            const ncclResult_t r = api.get_unique_id(&me.id);
            if (r != ncclSuccess) detail::raise(ErrorCode::kNccl, nccl_error("ncclGetUniqueId", r, nullptr));
        }
    } catch (const Error& e) {
        me.ok = 0;
        std::snprintf(me.why, sizeof(me.why), "%s", e.message().c_str());
    }
    const auto all = rail.all_gather_value(me);
    for (int q = 0; q < size_; ++q)
        ELASTICEP_CHECK(all[static_cast<size_t>(q)].ok, ErrorCode::kUnsupported, "scaleout: rail rank ", q,
                        " could not start NCCL: ",
                        std::string(all[static_cast<size_t>(q)].why, strnlen(all[static_cast<size_t>(q)].why, 256)));
    ELASTICEP_CUDA_CALL(cudaSetDevice(device));
    const NcclApi& api = nccl_api();
    blocking_ = blocking || api.comm_init_rank_config == nullptr;
    if (blocking_) {
        const ncclResult_t r = api.comm_init_rank(&comm_, size_, all[0].id, rank_);
        if (r != ncclSuccess) detail::raise(ErrorCode::kNccl, nccl_error("ncclCommInitRank (rail)", r, nullptr));
        return;
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    ncclResult_t r = api.comm_init_rank_config(&comm_, size_, all[0].id, rank_, &config);
    if (r == ncclInProgress) r = settle_call(deadline);
    if (r == ncclSuccess) return;
    const bool late = r == ncclInProgress;
    abort();
    ELASTICEP_CHECK(!late, ErrorCode::kTimeout, "scaleout=nccl: rail rank ", rank_, " waited ", timeout.count(),
                    " ms for the rail's NCCL communicator to form (", size_,
                    " rail ranks); a rail peer did not join, or the network between the nodes is down");
    detail::raise(ErrorCode::kNccl, nccl_error("ncclCommInitRankConfig (rail)", r, nullptr));
}

ncclResult_t NcclComm::settle_call(std::chrono::steady_clock::time_point deadline) const {
    if (blocking_) return ncclSuccess;
    const NcclApi& api = nccl_api();
    for (int spins = 0;; ++spins) {
        ncclResult_t state = ncclSuccess;
        const ncclResult_t q = api.comm_get_async_error(comm_, &state);
        if (q != ncclSuccess) return q;
        if (state != ncclInProgress) return state;
        if (std::chrono::steady_clock::now() > deadline) return ncclInProgress;
        if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
}

NcclComm::~NcclComm() {
    if (comm_ == nullptr) return;
    const NcclApi& api = nccl_api();
    if (aborted_) return;
    api.comm_destroy(comm_);
}

void NcclComm::abort() {
    if (aborted_ || comm_ == nullptr) return;
    aborted_ = true;
    nccl_api().comm_abort(comm_);
}

namespace {

class NcclRail final : public Rail {
 public:
    NcclRail(std::shared_ptr<NcclComm> comm, const kernels::hybrid::RailRegion& region, int device, int node, int local,
             int node_size, std::chrono::milliseconds timeout)
        : comm_(std::move(comm)),
          region_(region),
          device_(device),
          node_(node),
          local_(local),
          node_size_(node_size),
          timeout_(timeout) {
        ELASTICEP_CUDA_CALL(cudaSetDevice(device));
        ELASTICEP_CUDA_CALL(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        base_ = static_cast<uint8_t*>(pool_alloc(static_cast<size_t>(region.bytes), device, stream_));
        ELASTICEP_CUDA_CALL(cudaMemsetAsync(base_, 0, static_cast<size_t>(region.bytes), stream_));
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream_));
        ELASTICEP_CUDA_CALL(cudaEventCreateWithFlags(&moved_, cudaEventDisableTiming));
    }
    ~NcclRail() override {
        cudaSetDevice(device_);
        if (base_ && !keep_) cudaFreeAsync(base_, stream_);
        if (moved_) cudaEventDestroy(moved_);
        if (stream_) cudaStreamDestroy(stream_);
        cudaGetLastError();
    }

    ScaleOut kind() const override { return ScaleOut::kNccl; }
    uint8_t* base() const override { return base_; }
    void keep_memory() override { keep_ = true; }
    bool device_wait(const RailCall&, cudaStream_t) override { return false; }

    void send(const RailCall& call, cudaStream_t stream, const HostSizes* sizes, bool capturing) override {
        ELASTICEP_INTERNAL(sizes != nullptr, "NcclRail::send needs host sizes");
        if (call.num_nodes <= 1) return;
        ELASTICEP_CHECK(
            !comm_->aborted(), ErrorCode::kTimeout,
            "scaleout=nccl: the rail communicator was aborted after an earlier timeout; rebuild the buffer");
        const NcclApi& api = nccl_api();
        ncclComm_t c = comm_->get();
        const auto since = std::chrono::steady_clock::now();
        ELASTICEP_NCCL_CALL(c, api.group_start());
        for (int q = 0; q < call.num_nodes; ++q) {
            if (q == node_) continue;
            const size_t out = static_cast<size_t>(sizes->send[static_cast<size_t>(q)]);
            const size_t in = static_cast<size_t>(sizes->recv[static_cast<size_t>(q)]);
            ELASTICEP_NCCL_CALL(
                c, api.send(base_ + region_.send_slab(call.phase, q) + sizes->offset, out, ncclUint8, q, c, stream));
            ELASTICEP_NCCL_CALL(
                c, api.recv(base_ + region_.recv_slab(call.phase, q) + sizes->offset, in, ncclUint8, q, c, stream));
        }
        ELASTICEP_NCCL_CALL(c, api.group_end());
        // non-blocking communicator: the group is enqueued on `stream` (the connections to a peer made at
        // its first transfer, which waits for that peer) once NCCL leaves ncclInProgress; nothing else is
        // enqueued before that, and a peer that never comes ends in Timeout, not in a blocked host
        const ncclResult_t r = comm_->settle_call(since + timeout_);
        if (r == ncclInProgress) {
            pending_phase_ = call.phase;
            give_up(call.expected);
        }
        if (r != ncclSuccess) detail::raise(ErrorCode::kNccl, nccl_error("scaleout=nccl: ncclGroupEnd", r, c));
        if (capturing) return;  // a replay is the caller's to synchronise; no watchdog inside a graph
        ELASTICEP_CUDA_CALL(cudaEventRecord(moved_, stream));
        pending_ = true;
        pending_phase_ = call.phase;
        pending_since_ = since;
    }

    void settle(uint64_t expected) override {
        if (!pending_) return;
        const NcclApi& api = nccl_api();
        for (int spins = 0;; ++spins) {
            const cudaError_t q = cudaEventQuery(moved_);
            if (q == cudaSuccess) {
                pending_ = false;
                return;
            }
            if (q != cudaErrorNotReady) ELASTICEP_CUDA_CALL(q);
            ncclResult_t async = ncclSuccess;
            api.comm_get_async_error(comm_->get(), &async);
            if (async != ncclSuccess && async != ncclInProgress) {
                pending_ = false;
                detail::raise(ErrorCode::kNccl, nccl_error("scaleout=nccl: the rail transfer", async, comm_->get()));
            }
            if (std::chrono::steady_clock::now() - pending_since_ > timeout_) break;
            if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        pending_ = false;
        give_up(expected);
    }

 private:
    // A rail peer never posted its side: end the transfer (NCCL has no deadline of its own) and name
    // the peers; NCCL cannot say which one is missing, so every other node of the rail is named.
    [[noreturn]] void give_up(uint64_t expected) {
        comm_->abort();
        detail::MissingPeers m{};
        m.observed = expected > 0 ? expected - 1 : 0;
        for (int q = 0; q < region_.num_nodes; ++q) {
            if (q == node_) continue;
            if (m.count < kMaxNamedPeers) m.named[m.count] = q * node_size_ + local_;
            ++m.count;
        }
        const int rank = node_ * node_size_ + local_;
        detail::raise(ErrorCode::kTimeout,
                      detail::hybrid_timeout_message(pending_phase_, detail::kHopNetwork, rank, timeout_.count(), m,
                                                     expected, node_size_) +
                          " (NCCL point-to-point: one of the rail peers named did not post its transfer; the rail "
                          "communicator was aborted)");
    }

    std::shared_ptr<NcclComm> comm_;
    kernels::hybrid::RailRegion region_;
    int device_, node_, local_, node_size_;
    std::chrono::milliseconds timeout_;
    cudaStream_t stream_ = nullptr;
    cudaEvent_t moved_ = nullptr;
    uint8_t* base_ = nullptr;
    bool keep_ = false;
    bool pending_ = false;
    int32_t pending_phase_ = detail::kPhaseDispatch;
    std::chrono::steady_clock::time_point pending_since_;
};

}  // namespace

std::shared_ptr<NcclComm> make_nccl_comm(Group& rail, int device, bool blocking, std::chrono::milliseconds timeout) {
    return std::make_shared<NcclComm>(rail, device, blocking, timeout);
}

std::unique_ptr<Rail> make_nccl_rail(std::shared_ptr<NcclComm> comm, const kernels::hybrid::RailRegion& region,
                                     int device, int node, int local, int node_size,
                                     std::chrono::milliseconds timeout) {
    return std::make_unique<NcclRail>(std::move(comm), region, device, node, local, node_size, timeout);
}

std::shared_ptr<NcclComm> nonblocking_nccl_comm(std::shared_ptr<NcclComm> comm, Group& rail, int device,
                                                std::chrono::milliseconds timeout) {
    if (!comm->blocking() || nccl_api().comm_init_rank_config == nullptr) return comm;
    comm.reset();
    return std::make_shared<NcclComm>(rail, device, false, timeout);
}

#else  // built without NCCL

class NcclComm {};

bool nccl_compiled() { return false; }
std::string nccl_build_version() { return ""; }

std::shared_ptr<NcclComm> make_nccl_comm(Group&, int, bool, std::chrono::milliseconds) {
    detail::raise(ErrorCode::kUnsupported,
                  "this ElasticEP was built without NCCL (cmake/ElasticepNccl.cmake found none): scaleout=nccl and "
                  "scaleout=gin need it; rebuild with NCCL (set NCCL_ROOT), or use scaleout=emulated on one host");
}
std::unique_ptr<Rail> make_nccl_rail(std::shared_ptr<NcclComm>, const kernels::hybrid::RailRegion&, int, int, int, int,
                                     std::chrono::milliseconds) {
    detail::raise(ErrorCode::kUnsupported, "this ElasticEP was built without NCCL: scaleout=nccl needs it");
}
std::shared_ptr<NcclComm> nonblocking_nccl_comm(std::shared_ptr<NcclComm>, Group&, int, std::chrono::milliseconds) {
    detail::raise(ErrorCode::kUnsupported, "this ElasticEP was built without NCCL: scaleout=nccl needs it");
}

#endif

}  // namespace elasticep::transport::scaleout
