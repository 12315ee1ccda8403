#include "transport/scaleout/nccl_api.hpp"

#if defined(ELASTICEP_HAVE_NCCL)
#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "core/check.hpp"

namespace elasticep::transport::scaleout {
namespace {

template <class F>
void bind(void* lib, F& fn, const char* name) {
    fn = reinterpret_cast<F>(::dlsym(lib, name));
}

NcclApi load() {
    std::vector<std::string> tries;
    if (const char* e = std::getenv("ELASTICEP_NCCL_LIBRARY"); e != nullptr && *e != '\0') tries.emplace_back(e);
    tries.emplace_back("libnccl.so.2");
#if defined(ELASTICEP_NCCL_LIBRARY_PATH)
    tries.emplace_back(ELASTICEP_NCCL_LIBRARY_PATH);
#endif
    std::string failures;
    for (const std::string& path : tries) {
        void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
        if (lib == nullptr) {
            const char* why = ::dlerror();
            failures += detail::cat(failures.empty() ? "" : "; ", path, ": ", why ? why : "not found");
            continue;
        }
        NcclApi a{};
        a.path = path;
        bind(lib, a.get_version, "ncclGetVersion");
        bind(lib, a.get_unique_id, "ncclGetUniqueId");
        bind(lib, a.comm_init_rank, "ncclCommInitRank");
        bind(lib, a.comm_init_rank_config, "ncclCommInitRankConfig");
        bind(lib, a.comm_destroy, "ncclCommDestroy");
        bind(lib, a.comm_abort, "ncclCommAbort");
        bind(lib, a.get_error_string, "ncclGetErrorString");
        bind(lib, a.get_last_error, "ncclGetLastError");
        bind(lib, a.comm_get_async_error, "ncclCommGetAsyncError");
        bind(lib, a.group_start, "ncclGroupStart");
        bind(lib, a.group_end, "ncclGroupEnd");
        bind(lib, a.send, "ncclSend");
        bind(lib, a.recv, "ncclRecv");
        bind(lib, a.mem_alloc, "ncclMemAlloc");
        bind(lib, a.mem_free, "ncclMemFree");
        bind(lib, a.window_register, "ncclCommWindowRegister");
        bind(lib, a.window_deregister, "ncclCommWindowDeregister");
        a.dev_comm_create = ::dlsym(lib, "ncclDevCommCreate");
        a.dev_comm_destroy = ::dlsym(lib, "ncclDevCommDestroy");
        const bool core = a.get_version && a.get_unique_id && a.comm_init_rank && a.comm_destroy && a.comm_abort &&
                          a.get_error_string && a.get_last_error && a.comm_get_async_error && a.group_start &&
                          a.group_end && a.send && a.recv;
        if (!core) {
            failures += detail::cat(failures.empty() ? "" : "; ", path, ": lacks NCCL's point-to-point API");
            continue;
        }
        a.get_version(&a.version);
        return a;
    }
    detail::raise(ErrorCode::kUnsupported,
                  detail::cat("NCCL could not be loaded (", failures,
                              "); install NCCL (the CUDA toolkit's, or pip's nvidia-nccl-cu*) or point "
                              "ELASTICEP_NCCL_LIBRARY at libnccl.so.2; or use scaleout=emulated on one host"));
}

}  // namespace

const NcclApi& nccl_api() {
    static std::mutex mu;
    static std::unique_ptr<NcclApi> api;
    std::lock_guard<std::mutex> lock(mu);
    if (!api) api = std::make_unique<NcclApi>(load());
    return *api;
}

std::string nccl_error(const char* what, ncclResult_t r, ncclComm_t comm) {
    const NcclApi& a = nccl_api();
    const char* last = a.get_last_error(comm);
    return detail::cat(what, " failed: ", a.get_error_string(r),
                       last && *last ? detail::cat(" (NCCL: ", last, ")") : "");
}

}  // namespace elasticep::transport::scaleout
#endif
