// NCCL's host API, loaded at run time (dlopen) the first time a hybrid buffer asks for scaleout=nccl,
// gin or auto with several nodes. Why not a link-time dependency: libelasticep is a static library
// that the CLI, the Python extension and the users' programs link; a libnccl.so on their link line
// (and at load time) for a transport most of them never use would break every wheel or binary that
// runs where the toolkit's NCCL is not on the loader path. The headers (nccl.h and the device API of
// nccl_device/, whose GIN code is compiled into the kernels) are the build's; the library is looked up
// as $ELASTICEP_NCCL_LIBRARY, then libnccl.so.2 (the one already loaded by torch, if any), then the
// file CMake found (cmake/FindNCCL.cmake). Only with ELASTICEP_HAVE_NCCL (cmake/ElasticepNccl.cmake).
#pragma once

#if defined(ELASTICEP_HAVE_NCCL)
#include <nccl.h>

#include <string>

namespace elasticep::transport::scaleout {

struct NcclApi {
    decltype(&::ncclGetVersion) get_version;
    decltype(&::ncclGetUniqueId) get_unique_id;
    decltype(&::ncclCommInitRank) comm_init_rank;
    decltype(&::ncclCommInitRankConfig) comm_init_rank_config;  // non-blocking communicators (NCCL 2.14+)
    decltype(&::ncclCommDestroy) comm_destroy;
    decltype(&::ncclCommAbort) comm_abort;
    decltype(&::ncclGetErrorString) get_error_string;
    decltype(&::ncclGetLastError) get_last_error;
    decltype(&::ncclCommGetAsyncError) comm_get_async_error;
    decltype(&::ncclGroupStart) group_start;
    decltype(&::ncclGroupEnd) group_end;
    decltype(&::ncclSend) send;
    decltype(&::ncclRecv) recv;
    // NCCL 2.27+ (windows) and 2.28+ (the device API); null when the library is older
    decltype(&::ncclMemAlloc) mem_alloc;
    decltype(&::ncclMemFree) mem_free;
    decltype(&::ncclCommWindowRegister) window_register;
    decltype(&::ncclCommWindowDeregister) window_deregister;
    void* dev_comm_create;   // ncclDevCommCreate (declared in nccl_device/core.h)
    void* dev_comm_destroy;  // ncclDevCommDestroy
    int version;             // ncclGetVersion of the loaded library
    std::string path;        // where it was loaded from
};

// The loaded API (loaded once per process); throws Unsupported naming the places searched.
const NcclApi& nccl_api();

// "ncclSend failed: unhandled system error (NCCL: <last error>)".
std::string nccl_error(const char* what, ncclResult_t r, ncclComm_t comm);

}  // namespace elasticep::transport::scaleout

#define ELASTICEP_NCCL_CALL(comm, expr)                                                                             \
    do {                                                                                                            \
        const ncclResult_t elasticep_nccl_ = (expr);                                                                \
        if (elasticep_nccl_ != ncclSuccess && elasticep_nccl_ != ncclInProgress)                                    \
            ::elasticep::detail::raise(::elasticep::ErrorCode::kNccl,                                               \
                                       ::elasticep::transport::scaleout::nccl_error(#expr, elasticep_nccl_, comm)); \
    } while (0)
#endif
