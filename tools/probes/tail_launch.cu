// Which CUDA features let a tail launch (cudaStreamTailLaunch, CUDA dynamic parallelism) complete.
// `elasticep_probe_tail_launch MODE` runs one case; a case that hangs never returns, so run each under
// a timeout (docs/PERFORMANCE.md, "Sixteenth session", has the command and the result on an H100).
// MODE bits:
//   1: the parent runs griddepcontrol.launch_dependents before the tail launch
//   2: the child runs griddepcontrol.wait
//   4: the parent is launched with cudaLaunchKernelEx (no attributes)
//   8: the child has 64 KiB of dynamic shared memory
//  16: the parent has 264 blocks (block 0 launches, the others exit at once)
#include <cstdio>
#include <cstdlib>

namespace {

__device__ int g_children;

__global__ void child(int mode) {
#if __CUDA_ARCH__ >= 900
    if (mode & 2) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(&g_children, 1);
}

__global__ void parent(int mode) {
    if (blockIdx.x != 0) return;
#if __CUDA_ARCH__ >= 900
    if (mode & 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    if (threadIdx.x == 0) {
        child<<<132, 512, (mode & 8) ? 65536 : 0, cudaStreamTailLaunch>>>(mode);
        if (cudaGetLastError() != cudaSuccess) printf("the device-side launch failed\n");
    }
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s MODE (0-31; see the source)\n", argv[0]);
        return 2;
    }
    const int mode = std::atoi(argv[1]);
    constexpr int kParents = 3;
    cudaFuncSetAttribute(child, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    const int grid = (mode & 16) ? 264 : 1;
    for (int i = 0; i < kParents; ++i) {
        if (mode & 4) {
            cudaLaunchConfig_t cfg{};
            cfg.gridDim = dim3(grid);
            cfg.blockDim = dim3(512);
            cfg.stream = s;
            cudaLaunchKernelEx(&cfg, parent, mode);
        } else {
            parent<<<grid, 512, 0, s>>>(mode);
        }
    }
    const cudaError_t e = cudaStreamSynchronize(s);
    int children = 0;
    cudaMemcpyFromSymbol(&children, g_children, sizeof(int));
    std::printf("mode %d: %s, %d of %d children ran\n", mode, cudaGetErrorString(e), children, kParents);
    return e == cudaSuccess && children == kParents ? 0 : 1;
}
