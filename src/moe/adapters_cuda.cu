// Launches of the grouped-GEMM adapter kernels (src/kernels/moe/repack.cuh, scales.cuh) for CUDA
// tensors. Grids come from shapes only, so every launch here can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/cuda_check.hpp"
#include "kernels/common/device_scope.hpp"
#include "kernels/moe/repack.cuh"
#include "kernels/moe/scales.cuh"
#include "moe/moe_internal.hpp"

namespace elasticep::detail {
namespace {

namespace km = kernels::moe;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

using cuda::DeviceScope;  // (ranks sharing a process may differ)

unsigned grid_for(int64_t items, int64_t per_block) {
    const int64_t b = (items + per_block - 1) / per_block;
    return static_cast<unsigned>(std::clamp<int64_t>(b, 1, 4096));
}

// The widest copy (16, 8, 4, 2, 1 bytes) that divides every address and stride involved.
int vec_width(std::initializer_list<uint64_t> values) {
    uint64_t all = 0;
    for (uint64_t v : values) all |= v;
    for (int w = 16; w > 1; w /= 2)
        if (all % static_cast<uint64_t>(w) == 0) return w;
    return 1;
}

template <class Launch>
void by_width(int w, Launch&& launch) {
    switch (w) {
        case 16:
            launch(std::integral_constant<int, 16>{});
            break;
        case 8:
            launch(std::integral_constant<int, 8>{});
            break;
        case 4:
            launch(std::integral_constant<int, 4>{});
            break;
        case 2:
            launch(std::integral_constant<int, 2>{});
            break;
        default:
            launch(std::integral_constant<int, 1>{});
            break;
    }
}

uint64_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }
uint64_t mag(int64_t v) { return static_cast<uint64_t>(v < 0 ? -v : v); }

}  // namespace

bool moe_cuda_compiled() { return true; }

int moe_cuda_current_device() {
    int d = -1;
    if (cudaGetDevice(&d) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return d;
}

void cuda_masked_to_contiguous(const km::MaskedToContiguousParams& p, int device, void* stream) {
    DeviceScope scope(device);
    km::offsets_kernel<<<1, 1024, 0, as_stream(stream)>>>(p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
    const int w = vec_width({addr(p.x.data), addr(p.out_x.data), mag(p.x.batch_stride), mag(p.x.row_stride),
                             mag(p.out_x.row_stride), static_cast<uint64_t>(p.row_bytes)});
    by_width(w, [&](auto v) {
        km::masked_to_contiguous_kernel<decltype(v)::value>
            <<<grid_for(p.out_rows, km::kWarps), km::kThreads, 0, as_stream(stream)>>>(p);
    });
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void cuda_contiguous_to_masked(const km::ContiguousToMaskedParams& p, int device, void* stream) {
    DeviceScope scope(device);
    const int w = vec_width({addr(p.x.data), addr(p.out_x.data), mag(p.x.row_stride), mag(p.out_x.batch_stride),
                             mag(p.out_x.row_stride), static_cast<uint64_t>(p.row_bytes)});
    const dim3 grid(static_cast<unsigned>(p.num_experts),
                    grid_for(p.slab_rows, km::kWarps) > 64 ? 64 : grid_for(p.slab_rows, km::kWarps));
    by_width(w, [&](auto v) {
        km::contiguous_to_masked_kernel<decltype(v)::value><<<grid, km::kThreads, 0, as_stream(stream)>>>(p);
    });
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void cuda_m_indices(const km::MIndicesParams& p, int device, void* stream) {
    DeviceScope scope(device);
    km::m_indices_kernel<<<grid_for(p.rows, km::kThreads), km::kThreads, 0, as_stream(stream)>>>(p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void cuda_route_weights(const km::RouteWeightParams& p, int device, void* stream) {
    DeviceScope scope(device);
    const int64_t rows = p.masked ? int64_t{p.num_experts} * p.slab_rows : p.slab_rows;
    km::route_weights_kernel<<<grid_for(rows, km::kWarps), km::kThreads, 0, as_stream(stream)>>>(p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

void cuda_scale_convert(const km::ScaleConvertParams& p, int device, void* stream) {
    DeviceScope scope(device);
    const int64_t lanes = std::max(p.rows, p.dst_pad_rows);
    km::scale_convert_kernel<<<grid_for(p.batch * p.groups * lanes, 256), 256, 0, as_stream(stream)>>>(p);
    ELASTICEP_CUDA_CHECK_LAUNCH();
}

int32_t cuda_read_and_clear_status(int32_t* status, int device, void* stream) {
    DeviceScope scope(device);
    int32_t v = 0;
    ELASTICEP_CUDA_CALL(cudaMemcpyAsync(&v, status, sizeof(v), cudaMemcpyDeviceToHost, as_stream(stream)));
    ELASTICEP_CUDA_CALL(cudaMemsetAsync(status, 0, sizeof(v), as_stream(stream)));
    ELASTICEP_CUDA_CALL(cudaStreamSynchronize(as_stream(stream)));
    return v;
}

}  // namespace elasticep::detail
