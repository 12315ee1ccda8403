// TensorRef: a non-owning view of a tensor, field for field what DLPack describes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace elasticep {

// Element types the library reads or writes. kFloat8E4M3 is OCP E4M3 (DLPack's float8_e4m3fn).
enum class DType : uint8_t { kBFloat16, kFloat8E4M3, kFloat32, kInt32, kInt64, kUInt8 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
    DeviceType type = DeviceType::kCPU;
    int index = 0;
    bool operator==(const Device&) const = default;
};

std::string device_name(const Device& device);

// Strides are in elements, as in DLPack. Empty strides mean contiguous row-major.
struct TensorRef {
    void* data = nullptr;
    DType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
    std::vector<int64_t> strides;
    Device device;

    static TensorRef contiguous(void* data, DType dtype, std::vector<int64_t> shape, Device device = {});

    int ndim() const { return static_cast<int>(shape.size()); }
    int64_t numel() const;
    int64_t size(int dim) const { return shape.at(static_cast<size_t>(dim)); }
    int64_t stride(int dim) const;  // honours empty strides
    bool is_contiguous() const;
    size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
    std::string describe() const;  // "bf16[4, 128] cpu" for error messages

    template <class T>
    T* data_as() const {
        return static_cast<T*>(data);
    }
};

}  // namespace elasticep
