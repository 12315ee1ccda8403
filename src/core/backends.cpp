// Backend selection: one table keyed by (backend, topology). A backend implements a topology by
// adding a row here; a pair without a row is refused with Unsupported before anything is allocated.
// Hybrid: the CPU backend with its emulated scale-out (src/backends/cpu), the CUDA backend with the
// emulated, NCCL point-to-point or GIN rail (src/backends/cuda/hybrid_backend.cu).
#include "core/backend.hpp"
#include "core/check.hpp"

namespace elasticep::detail {
namespace {

struct BackendEntry {
    BackendKind kind;
    Topology topology;
    std::unique_ptr<BackendBuffer> (*make)(const BackendContext&);
    size_t (*reservation_bytes)(const BufferConfig&, int);
};

constexpr BackendEntry kBackends[] = {
    {BackendKind::kCPU, Topology::kDirect, make_cpu_backend, cpu_reservation_bytes},
    {BackendKind::kCUDA, Topology::kDirect, make_cuda_backend, cuda_reservation_bytes},
    {BackendKind::kCPU, Topology::kHybrid, make_cpu_backend, cpu_reservation_bytes},
    {BackendKind::kCUDA, Topology::kHybrid, make_cuda_hybrid_backend, cuda_hybrid_reservation_bytes},
};

const BackendEntry& find_backend(BackendKind kind, Topology topology) {
    for (const BackendEntry& e : kBackends)
        if (e.kind == kind && e.topology == topology) return e;
    raise(ErrorCode::kUnsupported,
          cat("the ", backend_name(kind), " backend does not implement topology=", topology_name(topology)));
}

}  // namespace

std::unique_ptr<BackendBuffer> make_backend(BackendKind kind, Topology topology, const BackendContext& ctx) {
    return find_backend(kind, topology).make(ctx);
}

size_t backend_reservation_bytes(BackendKind kind, Topology topology, const BufferConfig& config, int num_ranks) {
    return find_backend(kind, topology).reservation_bytes(config, num_ranks);
}

}  // namespace elasticep::detail
