#include "elasticep/tensor.hpp"

#include <sstream>

#include "core/check.hpp"

namespace elasticep {

size_t dtype_size(DType dtype) {
    switch (dtype) {
        case DType::kBFloat16:
            return 2;
        case DType::kFloat8E4M3:
            return 1;
        case DType::kFloat32:
            return 4;
        case DType::kInt32:
            return 4;
        case DType::kInt64:
            return 8;
        case DType::kUInt8:
            return 1;
    }
    return 0;
}

const char* dtype_name(DType dtype) {
    switch (dtype) {
        case DType::kBFloat16:
            return "bf16";
        case DType::kFloat8E4M3:
            return "fp8_e4m3";
        case DType::kFloat32:
            return "fp32";
        case DType::kInt32:
            return "int32";
        case DType::kInt64:
            return "int64";
        case DType::kUInt8:
            return "uint8";
    }
    return "?";
}

std::string device_name(const Device& device) {
    if (device.type == DeviceType::kCPU) return "cpu";
    return "cuda:" + std::to_string(device.index);
}

TensorRef TensorRef::contiguous(void* data, DType dtype, std::vector<int64_t> shape, Device device) {
    TensorRef t;
    t.data = data;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.device = device;
    return t;
}

int64_t TensorRef::numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
}

int64_t TensorRef::stride(int dim) const {
    const auto d = static_cast<size_t>(dim);
    if (d >= shape.size())
        detail::raise(ErrorCode::kInternal, detail::cat("stride(", dim, ") of a ", ndim(), "-d tensor"));
    if (!strides.empty()) return strides[d];
    int64_t s = 1;
    for (size_t i = d + 1; i < shape.size(); ++i) s *= shape[i];
    return s;
}

bool TensorRef::is_contiguous() const {
    if (strides.empty()) return true;
    if (strides.size() != shape.size()) return false;
    int64_t expect = 1;
    for (size_t i = shape.size(); i-- > 0;) {
        if (shape[i] != 1 && strides[i] != expect) return false;
        expect *= shape[i];
    }
    return true;
}

std::string TensorRef::describe() const {
    std::ostringstream os;
    os << dtype_name(dtype) << "[";
    for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
    os << "]";
    if (!is_contiguous()) {
        os << " strides(";
        for (size_t i = 0; i < strides.size(); ++i) os << (i ? ", " : "") << strides[i];
        os << ")";
    }
    os << " " << device_name(device);
    return os.str();
}

}  // namespace elasticep
