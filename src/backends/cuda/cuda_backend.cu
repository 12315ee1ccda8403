// CUDA intranode backend entry points. The kernels arrive with the CUDA backend issue; until then
// asking for backend=cuda explicitly fails with a clear Unsupported error, and backend=auto uses
// the CPU backend (see Buffer::resolve_backend).
#include "core/backend.hpp"
#include "core/check.hpp"

namespace elasticep::detail {

bool cuda_backend_ready() { return false; }

std::unique_ptr<BackendBuffer> make_cuda_backend(const BackendContext&) {
    raise(ErrorCode::kUnsupported, "the CUDA dispatch/combine kernels are not part of this build yet; use backend=cpu");
}

size_t cuda_reservation_bytes(const BufferConfig&, int) {
    raise(ErrorCode::kUnsupported, "the CUDA dispatch/combine kernels are not part of this build yet; use backend=cpu");
}

}  // namespace elasticep::detail
