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

// One rank's inputs, host-resident.
struct Inputs {
    int64_t t = 0;
    std::vector<uint16_t> x;       // bf16 [T, H]
    std::vector<uint8_t> x_fp8;    // pre-quantized [T, H]
    std::vector<uint32_t> scales;  // pre-quantized [T, cols]
    std::vector<int64_t> idx64;    // [T, K]
    std::vector<int32_t> idx32;
    std::vector<float> w;          // [T, K] or empty
    std::vector<uint16_t> bias;    // [T, H] or empty
};

inline uint16_t random_bf16(std::mt19937_64& g) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    float v = n(g);
    const int mode = static_cast<int>(g() % 64);
    if (mode == 0) v *= 1000.0f;
    if (mode == 1) v *= 1e-6f;
    if (mode == 2) v = 0.0f;
    return num::float_to_bf16(v);
}

// Random top-k rows: distinct experts, some -1; `hot` routes most tokens to expert 0 first.
inline Inputs make_inputs(const BufferConfig& c, int64_t t, uint64_t seed, bool prequant, bool weights, bool bias,
                          bool hot = false) {
    std::mt19937_64 g(seed);
    Inputs in;
    in.t = t;
    const int h = c.hidden, k = c.num_topk;
    if (prequant) {
        in.x_fp8.resize(static_cast<size_t>(t * h));
        for (auto& b : in.x_fp8) b = static_cast<uint8_t>(g());
        in.scales.resize(static_cast<size_t>(t * scale_columns(c.scale_format, h)));
        for (auto& s : in.scales) s = static_cast<uint32_t>(g());
    } else {
        in.x.resize(static_cast<size_t>(t * h));
        for (auto& v : in.x) v = random_bf16(g);
        if (t > 0 && g() % 4 == 0) in.x[g() % in.x.size()] = 0x7fc0;  // a NaN: ignored by amax, stays NaN
    }
    in.idx64.assign(static_cast<size_t>(t * k), -1);
    for (int64_t i = 0; i < t; ++i) {
        std::vector<int64_t> row;
        while (static_cast<int>(row.size()) < k) {
            int64_t e = (hot && row.empty() && g() % 4 != 0) ? 0 : static_cast<int64_t>(g() % c.num_experts);
            bool dup = false;
            for (auto v : row) dup = dup || v == e;
            if (!dup) row.push_back(e);
        }
        for (int j = 0; j < k; ++j) in.idx64[static_cast<size_t>(i * k + j)] = (g() % 8 == 0) ? -1 : row[static_cast<size_t>(j)];
    }
    in.idx32.assign(in.idx64.begin(), in.idx64.end());
    if (weights) {
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        in.w.resize(static_cast<size_t>(t * k));
        for (auto& v : in.w) v = u(g);
    }
    if (bias) {
        in.bias.resize(static_cast<size_t>(t * h));
        for (auto& v : in.bias) v = random_bf16(g);
    }
    return in;
}

}  // namespace elasticep::gputest
