// MpiGroup over MPI non-blocking collectives, polled against a deadline.
#include "elasticep/mpi_group.hpp"

#include "core/check.hpp"
#include "elasticep/config.hpp"

#if defined(ELASTICEP_WITH_MPI)
#include <mpi.h>

#include <cstdlib>
#include <random>
#include <thread>
#include <vector>
#endif

namespace elasticep {

#if defined(ELASTICEP_WITH_MPI)
namespace {

void mpi_check(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    detail::raise(ErrorCode::kInternal,
                  detail::cat("MPI ", what, " failed: ", std::string(msg, static_cast<size_t>(len))));
}

class MpiRankGroup final : public Group {
 public:
    MpiRankGroup(MPI_Comm comm, std::chrono::milliseconds timeout) : timeout_(timeout) {
        mpi_check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
        mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
        mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
        // identity: a random tag drawn on rank 0, the same everywhere
        uint64_t tag = 0;
        if (rank_ == 0) tag = std::random_device{}() ^ (static_cast<uint64_t>(std::random_device{}()) << 32);
        std::vector<uint64_t> all(static_cast<size_t>(size_));
        all_gather(&tag, sizeof(tag), all.data());
        identity_ = "mpi-" + std::to_string(all[0]);
    }
    ~MpiRankGroup() override {
        int finalized = 0;
        MPI_Finalized(&finalized);
        // A timed-out collective is still pending on this communicator and MPI cannot cancel it,
        // so a broken group leaks its communicator rather than free it under a live request.
        if (!finalized && !broken_) MPI_Comm_free(&comm_);
    }
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    std::string identity() const override { return identity_; }

    void all_gather(const void* send, size_t bytes, void* recv) override {
        MPI_Request req;
        mpi_check(MPI_Iallgather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE,
                                 comm_, &req),
                  "MPI_Iallgather");
        wait(req, "all_gather");
    }
    void barrier() override {
        MPI_Request req;
        mpi_check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
        wait(req, "barrier");
    }

 private:
    void wait(MPI_Request& req, const char* what) {
        ELASTICEP_CHECK(!broken_, ErrorCode::kTimeout, "MpiGroup ", what,
                        ": this group timed out earlier and MPI "
                        "cannot cancel the pending collective; create a new group (or restart the job)");
        const auto deadline = std::chrono::steady_clock::now() + timeout_;
        for (;;) {
            int done = 0;
            mpi_check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
            if (done) return;
            if (std::chrono::steady_clock::now() > deadline) {
                broken_ = true;
                detail::raise(ErrorCode::kTimeout,
                              detail::cat("MpiGroup ", what, ": rank ", rank_, " waited ", timeout_.count(),
                                          " ms; not every rank of ", size_, " joined the collective"));
            }
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }

    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0, size_ = 1;
    std::chrono::milliseconds timeout_;
    std::string identity_;
    bool broken_ = false;
};

void ensure_init() {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) {
        int provided = 0;
        mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
        // We started MPI, so we end it at exit (after every group of ours is gone or inert).
        std::atexit([] {
            int finalized = 0;
            MPI_Finalized(&finalized);
            if (!finalized) MPI_Finalize();
        });
    }
}

}  // namespace

bool MpiGroup::available() { return true; }

std::shared_ptr<Group> MpiGroup::world(std::chrono::milliseconds timeout) {
    validate_timeout(timeout, "MpiGroup: timeout");
    ensure_init();
    return std::make_shared<MpiRankGroup>(MPI_COMM_WORLD, timeout);
}

std::shared_ptr<Group> MpiGroup::from_fortran_handle(int64_t comm, std::chrono::milliseconds timeout) {
    validate_timeout(timeout, "MpiGroup: timeout");
    ensure_init();
    return std::make_shared<MpiRankGroup>(MPI_Comm_f2c(static_cast<MPI_Fint>(comm)), timeout);
}

#else

bool MpiGroup::available() { return false; }

std::shared_ptr<Group> MpiGroup::world(std::chrono::milliseconds) {
    detail::raise(ErrorCode::kUnsupported,
                  "this build has no MPI support (no MPI found at configure time; "
                  "install libopenmpi-dev and rebuild)");
}

std::shared_ptr<Group> MpiGroup::from_fortran_handle(int64_t, std::chrono::milliseconds) { return world({}); }

#endif

}  // namespace elasticep
