// The NCCL communicator of one rail (rail.hpp), shared by NcclRail and GinRail.
#pragma once

#if defined(ELASTICEP_HAVE_NCCL)
#include <nccl.h>

#include <chrono>

#include "elasticep/group.hpp"

namespace elasticep::transport::scaleout {

class NcclComm {
 public:
    // Collective over `rail`: rail rank 0 makes the unique id, all_gather hands it out, every member
    // joins with ncclCommInitRank on `device`. NCCL_CUMEM_ENABLE=1 unless the environment sets it.
    // Non-blocking (`blocking` false, NCCL's config.blocking = 0): no NCCL call of this communicator
    // blocks the host, also not the connection set-up of a first send to a peer that never comes;
    // every call is followed by settle_call(), which waits for it at most `timeout`. The join itself
    // waits at most `timeout` too (Timeout naming the rail ranks).
    NcclComm(Group& rail, int device, bool blocking, std::chrono::milliseconds timeout);
    ~NcclComm();
    NcclComm(const NcclComm&) = delete;
    NcclComm& operator=(const NcclComm&) = delete;

    ncclComm_t get() const { return comm_; }
    int rank() const { return rank_; }
    int size() const { return size_; }
    int device() const { return device_; }
    // Ends every operation in flight (a peer is gone); the communicator is unusable afterwards.
    void abort();
    bool aborted() const { return aborted_; }
    bool blocking() const { return blocking_; }
    // Non-blocking: waits until the last call left ncclInProgress, at most until `deadline`. Returns
    // ncclSuccess, NCCL's error, or ncclInProgress when the deadline passed first. Blocking: ncclSuccess.
    ncclResult_t settle_call(std::chrono::steady_clock::time_point deadline) const;

 private:
    ncclComm_t comm_ = nullptr;
    int rank_ = 0, size_ = 1, device_ = 0;
    bool aborted_ = false;
    bool blocking_ = true;
};

}  // namespace elasticep::transport::scaleout
#endif
