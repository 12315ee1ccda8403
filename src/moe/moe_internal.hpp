// What the host code of src/moe shares with its CUDA launch units (adapters_cuda.cu,
// moe_layer_cuda.cu), or with their stand-ins in a build without CUDA (no_cuda.cpp).
#pragma once

#include <memory>

#include "elasticep/serving.hpp"
#include "kernels/moe/adapter_params.hpp"

namespace elasticep::detail {

bool moe_cuda_compiled();
int moe_cuda_current_device();  // -1 when no CUDA runtime is compiled in

// Adapters on CUDA tensors (device `device`, stream `stream`); the host code validated everything.
void cuda_masked_to_contiguous(const kernels::moe::MaskedToContiguousParams& p, int device, void* stream);
void cuda_contiguous_to_masked(const kernels::moe::ContiguousToMaskedParams& p, int device, void* stream);
void cuda_m_indices(const kernels::moe::MIndicesParams& p, int device, void* stream);
void cuda_route_weights(const kernels::moe::RouteWeightParams& p, int device, void* stream);
void cuda_scale_convert(const kernels::moe::ScaleConvertParams& p, int device, void* stream);
int32_t cuda_read_and_clear_status(int32_t* status, int device, void* stream);

// The CUDA half of ReferenceMoeLayer (cuBLASLt). The CPU half lives in moe_layer.cpp.
class MoeLayerBackend {
 public:
    virtual ~MoeLayerBackend() = default;
    virtual void forward(const MoeDispatchOutput& in, const TensorRef& y, void* stream) = 0;
    virtual void forward_dense(int local_expert, const TensorRef& x, const TensorRef& y, void* stream) = 0;
    virtual GemmPath path() const = 0;
    virtual const std::string& note() const = 0;
};
std::unique_ptr<MoeLayerBackend> make_cuda_moe_layer(const ExpertWeights& weights, Device device,
                                                     const MoeLayerOptions& options);

}  // namespace elasticep::detail
