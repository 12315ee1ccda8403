// Host time inside the CUDA calls that one direct dispatch makes, from one thread and from 8 threads
// sharing one context (as the bench's 8 ranks on one GPU do), each thread on its own non-blocking
// stream. The launches are the backend's own (launch_maybe_programmatic) of a kernel that takes the
// direct dispatch's parameters and does nothing. Prints microseconds per call (the slowest thread's
// mean for 8 threads); docs/PERFORMANCE.md, "Sixteenth session". Beside them, the alternatives a
// launch could take: the classic cudaLaunchKernel, and the driver's cuLaunchKernelEx on a CUfunction
// looked up once (cudaGetFuncBySymbol; the entry point through cudaGetDriverEntryPointByVersion, so
// nothing links libcuda), with and without the programmatic attribute; and cudaGetDevice, which a
// call could make instead of setting a device that is already current.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "backends/cuda/programmatic_launch.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/common/device_scope.hpp"
#include "kernels/intranode/params.cuh"

namespace {

using Params = elasticep::kernels::DispatchParams<elasticep::transport::NvlinkTeam>;
using elasticep::detail::cuda::DeviceScope;
using elasticep::detail::cuda::launch_maybe_programmatic;

__global__ void empty_kernel(Params p) {
    if (p.num_tokens == -42 && threadIdx.x == 1000) printf("unreachable\n");
}

using Clock = std::chrono::steady_clock;

enum Mode {
    kSetDevice,
    kIsCapturing,
    kEventRecord,
    kLaunch,
    kDispatchCalls,
    kLaunchesOnly,
    kGetDevice,
    kClassicLaunch,
    kDriverLaunch,
    kDriverLaunches,
    kNumModes
};
const char* const kNames[] = {"cudaSetDevice",
                              "cudaStreamIsCapturing",
                              "cudaEventRecord",
                              "cudaLaunchKernelEx",
                              "a dispatch's calls (device scope, capture check, two launches, event)",
                              "its two launches alone",
                              "cudaGetDevice",
                              "cudaLaunchKernel (classic)",
                              "cuLaunchKernelEx (driver, CUfunction cached)",
                              "two driver launches (the second programmatic)"};

// the driver's launch and the empty kernel's CUfunction, looked up once
PFN_cuLaunchKernelEx_v11060 driver_launch = nullptr;
CUfunction empty_function = nullptr;

void driver_launch_once(cudaStream_t s, const Params& p, bool programmatic) {
    CUlaunchConfig cfg{};
    cfg.gridDimX = 16;
    cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = 512;
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.hStream = s;
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = programmatic ? 1 : 0;
    void* args[] = {const_cast<Params*>(&p)};
    const CUresult r = driver_launch(&cfg, empty_function, args, nullptr);
    if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "cuLaunchKernelEx failed: %d\n", static_cast<int>(r));
        std::exit(1);
    }
}

// mean host time per iteration of `mode`, over n iterations (the stream drained every 16)
double time_calls(int mode, cudaStream_t s, cudaEvent_t ev, int n) {
    const Params p{};
    auto launch = [&](bool programmatic) { launch_maybe_programmatic(empty_kernel, 16, 512, 0, programmatic, s, p); };
    double total = 0;
    for (int i = 0; i < n; ++i) {
        cudaStreamCaptureStatus status;
        const auto t0 = Clock::now();
        switch (mode) {
            case kSetDevice:
                ELASTICEP_CUDA_CALL(cudaSetDevice(0));
                break;
            case kIsCapturing:
                ELASTICEP_CUDA_CALL(cudaStreamIsCapturing(s, &status));
                break;
            case kEventRecord:
                ELASTICEP_CUDA_CALL(cudaEventRecord(ev, s));
                break;
            case kLaunch:
                launch(false);
                break;
            case kGetDevice: {
                int device = -1;
                ELASTICEP_CUDA_CALL(cudaGetDevice(&device));
                break;
            }
            case kClassicLaunch:
                empty_kernel<<<16, 512, 0, s>>>(p);
                ELASTICEP_CUDA_CALL(cudaGetLastError());
                break;
            case kDriverLaunch:
                driver_launch_once(s, p, false);
                break;
            case kDriverLaunches:
                driver_launch_once(s, p, false);
                driver_launch_once(s, p, true);
                break;
            default: {  // the direct dispatch's order (cuda_backend.cu): the second launch is programmatic
                // (runs 56 and 58 timed cudaSetDevice here, which the calls made before DeviceScope)
                const bool calls = mode == kDispatchCalls;
                if (calls) {
                    const DeviceScope scope(0);
                    ELASTICEP_CUDA_CALL(cudaStreamIsCapturing(s, &status));
                }
                launch(false);
                launch(true);
                if (calls) ELASTICEP_CUDA_CALL(cudaEventRecord(ev, s));
            }
        }
        total += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (i % 16 == 15) ELASTICEP_CUDA_CALL(cudaStreamSynchronize(s));
    }
    ELASTICEP_CUDA_CALL(cudaStreamSynchronize(s));
    return total / n;
}

}  // namespace

int main() {
    constexpr int kThreads = 8, kIters = 2048;
    ELASTICEP_CUDA_CALL(cudaSetDevice(0));
    cudaDriverEntryPointQueryResult found{};
    ELASTICEP_CUDA_CALL(cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", reinterpret_cast<void**>(&driver_launch),
                                                         12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || driver_launch == nullptr) {
        std::fprintf(stderr, "cuLaunchKernelEx: no driver entry point\n");
        return 1;
    }
    cudaFunction_t f = nullptr;
    ELASTICEP_CUDA_CALL(cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(empty_kernel)));
    empty_function = reinterpret_cast<CUfunction>(f);
    for (int mode = 0; mode < kNumModes; ++mode) {
        std::vector<cudaStream_t> streams(kThreads);
        std::vector<cudaEvent_t> events(kThreads);
        for (int t = 0; t < kThreads; ++t) {
            ELASTICEP_CUDA_CALL(cudaStreamCreateWithFlags(&streams[t], cudaStreamNonBlocking));
            ELASTICEP_CUDA_CALL(cudaEventCreateWithFlags(&events[t], cudaEventDisableTiming));
        }
        time_calls(mode, streams[0], events[0], 256);  // warm-up
        const double one = time_calls(mode, streams[0], events[0], kIters);
        std::vector<double> per_thread(kThreads);
        std::vector<std::thread> threads;
        for (int t = 0; t < kThreads; ++t)
            threads.emplace_back([&, t] {
                ELASTICEP_CUDA_CALL(cudaSetDevice(0));
                per_thread[t] = time_calls(mode, streams[t], events[t], kIters);
            });
        for (auto& th : threads) th.join();
        double slowest = 0;
        for (double v : per_thread) slowest = v > slowest ? v : slowest;
        std::printf("%-52s 1 thread %6.2f us, %d threads %6.2f us per call\n", kNames[mode], one, kThreads, slowest);
        for (int t = 0; t < kThreads; ++t) {
            ELASTICEP_CUDA_CALL(cudaStreamDestroy(streams[t]));
            ELASTICEP_CUDA_CALL(cudaEventDestroy(events[t]));
        }
    }
    return 0;
}
