// Stand-ins for the CUDA launch units of src/moe in a build without CUDA: CUDA tensors cannot
// exist there, so reaching any of these is a caller error reported as Unsupported.
#include "core/check.hpp"
#include "moe/moe_internal.hpp"

namespace elasticep::detail {
namespace {
[[noreturn]] void no_cuda(const char* what) {
    raise(ErrorCode::kUnsupported, cat(what,
                                       ": the tensors are on a CUDA device but this build has no CUDA; rebuild "
                                       "with nvcc available, or pass host tensors"));
}
}  // namespace

bool moe_cuda_compiled() { return false; }
int moe_cuda_current_device() { return -1; }
void cuda_masked_to_contiguous(const kernels::moe::MaskedToContiguousParams&, int, void*) {
    no_cuda("masked_to_contiguous");
}
void cuda_contiguous_to_masked(const kernels::moe::ContiguousToMaskedParams&, int, void*) {
    no_cuda("contiguous_to_masked");
}
void cuda_m_indices(const kernels::moe::MIndicesParams&, int, void*) { no_cuda("m_indices_from_offsets"); }
void cuda_route_weights(const kernels::moe::RouteWeightParams&, int, void*) { no_cuda("apply_route_weights"); }
void cuda_scale_convert(const kernels::moe::ScaleConvertParams&, int, void*) { no_cuda("scale layout conversion"); }
int32_t cuda_read_and_clear_status(int32_t*, int, void*) { no_cuda("check_adapter_status"); }
std::unique_ptr<MoeLayerBackend> make_cuda_moe_layer(const ExpertWeights&, Device, const MoeLayerOptions&) {
    no_cuda("ReferenceMoeLayer");
}

}  // namespace elasticep::detail
