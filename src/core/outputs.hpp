// Canonical shapes and strides of dispatch outputs, shared by validation of caller-provided
// outputs and by the backends that allocate buffer-owned ones.
#pragma once

#include <optional>
#include <vector>

#include "elasticep/buffer.hpp"

namespace elasticep::detail {

struct OutputSpec {
    DType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
    std::vector<int64_t> strides;  // always explicit
    int64_t storage_elems = 0;     // elements the strided view spans
    TensorRef bind(void* data, Device device) const;
};

struct DispatchOutputSpecs {
    OutputSpec recv_x;
    std::optional<OutputSpec> recv_scales;
    OutputSpec recv_weights;
    OutputSpec recv_src;
    std::optional<OutputSpec> m_indices;  // contiguous only
};

// `rows`: contiguous layout rows (M or M_cap); ignored for masked.
DispatchOutputSpecs dispatch_output_specs(const BufferConfig& config, int num_ranks, Layout layout, int64_t rows,
                                          bool scales_mn_major);

// Throws InvalidArgument unless `t` has exactly the spec's dtype, shape, strides and device.
void check_output(const TensorRef& t, const OutputSpec& spec, Device device, const char* name);

}  // namespace elasticep::detail
