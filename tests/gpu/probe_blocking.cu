// Which CUDA runtime calls wait for a kernel that is still running on another stream?
//
// Several ranks on one GPU (threads of one process) deadlock until the timeout when one rank makes
// such a call while a peer's kernel waits for this rank. This probe measures it instead of
// guessing: a one-block kernel spins on another stream until the host releases it 0.7 s later; each
// call is timed while the kernel runs. A call that took about as long as the release delay waited
// for the kernel. Not a test (nothing to assert: the answer depends on the driver); run with
//   elasticep_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='*DISABLED_Probe*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "gpu_harness.hpp"

namespace eptest {
namespace {

__global__ void spin_until(volatile int* flag, unsigned long long limit_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (*flag == 0 && now - start < limit_ns);
}

__global__ void never_launched_before(int* p) {
    if (p) *p = 1;
}

struct Probe {
    volatile int* host_flag = nullptr;
    int* dev_flag = nullptr;
    cudaStream_t spin_stream = nullptr, other = nullptr;

    Probe() {
        cudaHostAlloc(const_cast<int**>(&host_flag), sizeof(int), cudaHostAllocMapped);
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_flag), const_cast<int*>(host_flag), 0);
        cudaStreamCreateWithFlags(&spin_stream, cudaStreamNonBlocking);
        cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking);
    }

    // Runs `call` while the spinning kernel runs; returns the call's wall time in ms.
    double time_call(const std::function<void()>& call) {
        *host_flag = 0;
        spin_until<<<1, 32, 0, spin_stream>>>(dev_flag, 5'000'000'000ull);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the kernel is running now
        std::thread release([&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(700));
            *host_flag = 1;
        });
        const auto t0 = std::chrono::steady_clock::now();
        call();
        const auto t1 = std::chrono::steady_clock::now();
        release.join();
        cudaStreamSynchronize(spin_stream);
        cudaStreamSynchronize(other);
        return std::chrono::duration<double, std::milli>(t1 - t0).count();
    }
};

TEST(CudaProbe, DISABLED_ProbeBlockingCalls) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    Probe pr;
    struct Row {
        std::string name;
        double ms;
        std::string err;
    };
    std::vector<Row> rows;
    auto run = [&](const std::string& name, const std::function<cudaError_t()>& fn) {
        cudaError_t e = cudaSuccess;
        const double ms = pr.time_call([&] { e = fn(); });
        rows.push_back({name, ms, e == cudaSuccess ? "" : cudaGetErrorString(e)});
        cudaGetLastError();
    };
    void* a = nullptr;
    void* b = nullptr;
    void* c = nullptr;
    void* h = nullptr;
    std::vector<char> pageable(1 << 20);
    run("cudaMalloc 64 MiB", [&] { return cudaMalloc(&a, 64 << 20); });
    run("cudaMalloc 4 GiB", [&] { return cudaMalloc(&b, size_t{4} << 30); });
    run("cudaFree 64 MiB", [&] { return cudaFree(a); });
    run("cudaFree 4 GiB", [&] { return cudaFree(b); });
    run("cudaMallocAsync 2 GiB (pool grows)", [&] { return cudaMallocAsync(&c, size_t{2} << 30, pr.other); });
    run("cudaFreeAsync 2 GiB", [&] { return cudaFreeAsync(c, pr.other); });
    run("cudaStreamSynchronize(other) after free (pool trims)", [&] { return cudaStreamSynchronize(pr.other); });
    run("cudaMallocAsync 2 GiB again", [&] { return cudaMallocAsync(&c, size_t{2} << 30, pr.other); });
    run("cudaFreeAsync 2 GiB again", [&] { return cudaFreeAsync(c, pr.other); });
    cudaMemPool_t pool = nullptr;
    {
        cudaMemPoolProps props{};
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        int dev = 0;
        cudaGetDevice(&dev);
        props.location.id = dev;
        cudaMemPoolCreate(&pool, &props);
        uint64_t keep = ~0ull;
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    }
    run("cudaMallocFromPoolAsync 2 GiB (own pool grows)",
        [&] { return cudaMallocFromPoolAsync(&c, size_t{2} << 30, pool, pr.other); });
    run("cudaFreeAsync own pool", [&] { return cudaFreeAsync(c, pr.other); });
    run("cudaMallocFromPoolAsync 2 GiB (own pool reuse)",
        [&] { return cudaMallocFromPoolAsync(&c, size_t{2} << 30, pool, pr.other); });
    run("cudaFreeAsync own pool again", [&] { return cudaFreeAsync(c, pr.other); });
    run("cudaHostAlloc mapped 4 KiB", [&] { return cudaHostAlloc(&h, 4096, cudaHostAllocMapped); });
    run("cudaFreeHost 4 KiB", [&] { return cudaFreeHost(h); });
    run("cudaMemcpy H2D pageable 1 MiB (legacy stream)", [&] {
        cudaMalloc(&a, 1 << 20);
        return cudaMemcpy(a, pageable.data(), 1 << 20, cudaMemcpyHostToDevice);
    });
    run("cudaMemcpyAsync H2D pageable on a non-blocking stream",
        [&] { return cudaMemcpyAsync(a, pageable.data(), 1 << 20, cudaMemcpyHostToDevice, pr.other); });
    run("cudaMemsetAsync on a non-blocking stream", [&] { return cudaMemsetAsync(a, 0, 1 << 20, pr.other); });
    cudaStream_t s2 = nullptr;
    run("cudaStreamCreateWithFlags", [&] { return cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking); });
    run("cudaStreamDestroy", [&] { return cudaStreamDestroy(s2); });
    cudaEvent_t ev = nullptr;
    run("cudaEventCreate", [&] { return cudaEventCreate(&ev); });
    run("cudaEventDestroy", [&] { return cudaEventDestroy(ev); });
    cudaIpcMemHandle_t ipc{};
    run("cudaIpcGetMemHandle", [&] { return cudaIpcGetMemHandle(&ipc, a); });
    run("first launch of a kernel (lazy loading when CUDA_MODULE_LOADING=LAZY)", [&] {
        never_launched_before<<<1, 1, 0, pr.other>>>(nullptr);
        return cudaGetLastError();
    });
    int n = 0;
    cudaGetDeviceCount(&n);
    if (n > 1) {
        run("cudaDeviceEnablePeerAccess(1)", [&] { return cudaDeviceEnablePeerAccess(1, 0); });
        run("cudaMemPoolSetAccess(own pool, device 1)", [&] {
            cudaMemAccessDesc d{};
            d.location.type = cudaMemLocationTypeDevice;
            d.location.id = 1;
            d.flags = cudaMemAccessFlagsProtReadWrite;
            return cudaMemPoolSetAccess(pool, &d, 1);
        });
    }
    run("cudaFree 1 MiB", [&] { return cudaFree(a); });
    cudaMemPoolDestroy(pool);
    std::printf("%-72s %10s  %s\n", "call made while a kernel spins on another stream", "wall ms", "waited?");
    for (const Row& r : rows)
        std::printf("%-72s %10.1f  %s%s\n", r.name.c_str(), r.ms, r.ms > 500.0 ? "WAITED for the kernel" : "no",
                    r.err.empty() ? "" : ("  error: " + r.err).c_str());
    std::printf("(CUDA_MODULE_LOADING=%s)\n",
                std::getenv("CUDA_MODULE_LOADING") ? std::getenv("CUDA_MODULE_LOADING") : "default");
}

}  // namespace
}  // namespace eptest
