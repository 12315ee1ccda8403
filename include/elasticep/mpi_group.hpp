// MpiGroup: the bootstrap Group for C++ programs started with mpirun (one process per rank).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "elasticep/group.hpp"

namespace elasticep {

class MpiGroup {
 public:
    // True when this build was compiled with MPI.
    static bool available();
    // MPI_COMM_WORLD (MPI_Init is called if nobody called it yet). Collectives poll non-blocking
    // MPI requests and throw Error(kTimeout) after `timeout` instead of hanging.
    static std::shared_ptr<Group> world(std::chrono::milliseconds timeout = std::chrono::seconds(60));
    // Any communicator, passed as its Fortran handle (MPI_Comm_c2f), portable across MPI libraries.
    static std::shared_ptr<Group> from_fortran_handle(int64_t comm,
                                                      std::chrono::milliseconds timeout = std::chrono::seconds(60));
};

}  // namespace elasticep
