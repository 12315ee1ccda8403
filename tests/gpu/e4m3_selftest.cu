#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "core/numerics.hpp"
#include "e4m3_selftest.hpp"
#include "kernels/common/primitives.cuh"

namespace eptest {
namespace {

__global__ void e4m3_check_kernel(unsigned long long* count, uint32_t* first) {
    const uint64_t n = uint64_t{1} << 32;
    for (uint64_t i = (uint64_t{blockIdx.x} * blockDim.x + threadIdx.x) * 2; i < n;
         i += uint64_t{gridDim.x} * blockDim.x * 2) {
        const float a = __uint_as_float(static_cast<uint32_t>(i)), b = __uint_as_float(static_cast<uint32_t>(i + 1));
        const uint16_t hw = elasticep::kernels::e4m3x2(a, b);
        const uint16_t ref =
            static_cast<uint16_t>(elasticep::num::float_to_e4m3(a) | (elasticep::num::float_to_e4m3(b) << 8));
        if (hw != ref) {
            const uint32_t bad = (hw & 0xff) != (ref & 0xff) ? static_cast<uint32_t>(i) : static_cast<uint32_t>(i + 1);
            atomicMin(first, bad);
            atomicAdd(count, ((hw & 0xff) != (ref & 0xff)) + ((hw >> 8) != (ref >> 8)));
        }
    }
}

void ok(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

uint64_t e4m3_mismatches(uint32_t* first) {
    unsigned long long* count = nullptr;
    uint32_t* f = nullptr;
    ok(cudaMalloc(&count, 8), "cudaMalloc");
    ok(cudaMalloc(&f, 4), "cudaMalloc");
    ok(cudaMemset(count, 0, 8), "cudaMemset");
    ok(cudaMemset(f, 0xff, 4), "cudaMemset");
    e4m3_check_kernel<<<1024, 256>>>(count, f);
    ok(cudaGetLastError(), "e4m3_check_kernel launch");
    unsigned long long c = 0;
    ok(cudaMemcpy(&c, count, 8, cudaMemcpyDeviceToHost), "cudaMemcpy");
    ok(cudaMemcpy(first, f, 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
    cudaFree(count);
    cudaFree(f);
    return c;
}

}  // namespace eptest
