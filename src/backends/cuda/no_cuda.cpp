// Built when nvcc was not found: the CUDA backend is absent and says so.
#include "core/backend.hpp"
#include "core/check.hpp"
#include "elasticep/info.hpp"
#include "elasticep/version.hpp"

namespace elasticep {
namespace detail {
bool cuda_backend_compiled() { return false; }
bool cuda_backend_available() { return false; }
std::unique_ptr<BackendBuffer> make_cuda_backend(const BackendContext&) {
    raise(ErrorCode::kUnsupported, "this build has no CUDA backend (nvcc was not found at configure time)");
}
size_t cuda_reservation_bytes(const BufferConfig&, int) {
    raise(ErrorCode::kUnsupported, "this build has no CUDA backend (nvcc was not found at configure time)");
}
std::unique_ptr<BackendBuffer> make_cuda_hybrid_backend(const BackendContext&) {
    raise(ErrorCode::kUnsupported, "this build has no CUDA backend (nvcc was not found at configure time)");
}
size_t cuda_hybrid_reservation_bytes(const BufferConfig&, int) {
    raise(ErrorCode::kUnsupported, "this build has no CUDA backend (nvcc was not found at configure time)");
}
}  // namespace detail

SystemInfo system_info() {
    SystemInfo s;
    s.version = version_string();
    s.backends_compiled = build_backends();
    s.note = "built without CUDA";
    return s;
}
}  // namespace elasticep
