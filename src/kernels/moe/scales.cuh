// Scale-layout kernels: copy 4-byte scale elements between any two strided layouts (row-major <->
// MN-major TMA-aligned), optionally packing fp32 groups into UE8M0 words on the way.
//
// Index map: destination element (b, r, g) for b < batch, r < rows, g < groups:
//   copy:     dst(b, r, g) = src(b, r, g)
//   to UE8M0: dst(b, r, g) = ue8m0_word(src, b, r, g, src_groups)   (adapter_params.hpp)
// plus, when dst is MN-major (dst_pad_rows > rows), dst(b, r, g) = 0 for rows <= r < dst_pad_rows:
// the padding lanes a TMA load of a 16-byte-aligned column reads.
// One thread per destination lane, lanes ordered (b, g, r) so MN-major stores are coalesced.
// Memory owned: none. Launch contract: scale_convert_kernel<<<grid, kThreads>>>, any grid >= 1
// (grid-stride loop; the host derives it from the shape only), src and dst must not overlap.
#pragma once

#include <cstdint>

#include "kernels/moe/adapter_params.hpp"

namespace elasticep::kernels::moe {

__global__ void __launch_bounds__(256) scale_convert_kernel(ScaleConvertParams p) {
    const int64_t lanes = p.dst_pad_rows > p.rows ? p.dst_pad_rows : p.rows;
    const int64_t total = p.batch * p.groups * lanes;
    for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
        const int64_t r = i % lanes;
        const int64_t g = (i / lanes) % p.groups;
        const int64_t b = i / (lanes * p.groups);
        uint32_t v = 0;
        if (r < p.rows)
            v = p.to_ue8m0 ? ue8m0_word(p.src, b, r, g, p.src_groups)
                           : p.src.data[b * p.src.sb + r * p.src.sr + g * p.src.sg];
        p.dst.data[b * p.dst.sb + r * p.dst.sr + g * p.dst.sg] = v;
    }
}

}  // namespace elasticep::kernels::moe
