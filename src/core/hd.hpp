// Host/device qualifiers so that reference arithmetic is one source for the CPU and CUDA backends.
#pragma once

#if defined(__CUDACC__)
#define ELASTICEP_HD __host__ __device__ __forceinline__
#else
#define ELASTICEP_HD inline
#endif
