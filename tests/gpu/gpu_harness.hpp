// Shared helpers of the GPU tests: GPU detection, device buffers, rank threads, and one
// dispatch -> combine round run on the CUDA backend and on the CPU backend with the same inputs.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/round_inputs.hpp"
#include "core/numerics.hpp"
#include "elasticep/elasticep.hpp"

#if __has_include(<cuda_runtime.h>)
#include <cuda_runtime.h>
#define ELASTICEP_TEST_HAVE_CUDA 1
#else
#define ELASTICEP_TEST_HAVE_CUDA 0
#endif

namespace elasticep::gputest {

// Several ranks share one GPU here: give every stream its own hardware queue (before CUDA starts),
// so no rank's launch queues behind a peer's waiting kernel (see src/backends/cuda/cuda_backend.cu).
inline const bool kConnectionsSet = ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0;

inline int gpu_count() {
#if ELASTICEP_TEST_HAVE_CUDA
    if (!Buffer::backend_available(BackendKind::kCUDA)) return 0;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
#else
    return 0;
#endif
}

#define ELASTICEP_SKIP_WITHOUT_GPU()                                                                     \
    do {                                                                                                 \
        if (::elasticep::gputest::gpu_count() == 0)                                                      \
            GTEST_SKIP() << "no usable CUDA GPU (or the CUDA backend is not compiled in): "                \
                            "the CUDA backend tests need one";                                           \
    } while (0)

#if ELASTICEP_TEST_HAVE_CUDA
#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

struct DevBuf {
    void* ptr = nullptr;
    size_t bytes = 0;
    DevBuf() = default;
    explicit DevBuf(size_t n) : bytes(n) {
        if (cudaMalloc(&ptr, std::max<size_t>(n, 16)) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    }
    DevBuf(const DevBuf&) = delete;
    DevBuf& operator=(const DevBuf&) = delete;
    DevBuf(DevBuf&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = nullptr; }
    ~DevBuf() {
        if (ptr) cudaFree(ptr);
    }
    template <class T>
    static DevBuf upload(const std::vector<T>& v) {
        DevBuf b(v.size() * sizeof(T));
        if (!v.empty()) cudaMemcpy(b.ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
        return b;
    }
};

template <class T>
std::vector<T> download(const void* p, size_t count) {
    std::vector<T> v(count);
    if (count) {
        const cudaError_t e = cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) throw std::runtime_error(std::string("download: ") + cudaGetErrorString(e));
    }
    return v;
}
#endif

// Runs fn(rank) on `n` threads; exceptions escaping fn become test failures naming the rank.
inline void run_ranks(int n, const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    std::vector<std::string> errors(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
        threads.emplace_back([&, r] {
            try {
                fn(r);
            } catch (const std::exception& e) {
                errors[static_cast<size_t>(r)] = e.what();
            }
        });
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) EXPECT_TRUE(errors[static_cast<size_t>(r)].empty()) << "rank " << r << ": " << errors[static_cast<size_t>(r)];
}

using roundgen::dispatch_args;
using roundgen::Inputs;
using roundgen::make_inputs;
using roundgen::random_bf16;

}  // namespace elasticep::gputest
