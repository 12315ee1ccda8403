// The NCCL communicator of one rail (rail.hpp), shared by NcclRail and GinRail.
#pragma once

#if defined(ELASTICEP_HAVE_NCCL)
#include <nccl.h>

#include "elasticep/group.hpp"

namespace elasticep::transport::scaleout {

class NcclComm {
 public:
    // Collective over `rail`: rail rank 0 makes the unique id, all_gather hands it out, every member
    // joins with ncclCommInitRank on `device`. NCCL_CUMEM_ENABLE=1 unless the environment sets it.
    NcclComm(Group& rail, int device);
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

 private:
    ncclComm_t comm_ = nullptr;
    int rank_ = 0, size_ = 1, device_ = 0;
    bool aborted_ = false;
};

}  // namespace elasticep::transport::scaleout
#endif
