// Host time inside the CUDA calls that one direct dispatch makes, from one thread and from 8 threads
// sharing one context (as the bench's 8 ranks on one GPU do), each thread on its own non-blocking
// stream. The launches are the backend's own (launch_maybe_programmatic) of a kernel that takes the
// direct dispatch's parameters and does nothing. Prints microseconds per call (the slowest thread's
// mean for 8 threads); docs/PERFORMANCE.md, "Sixteenth session".
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "backends/cuda/programmatic_launch.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/intranode/params.cuh"

namespace {

using Params = elasticep::kernels::DispatchParams<elasticep::transport::NvlinkTeam>;
using elasticep::detail::cuda::launch_maybe_programmatic;

__global__ void empty_kernel(Params p) {
    if (p.num_tokens == -42 && threadIdx.x == 1000) printf("unreachable\n");
}

using Clock = std::chrono::steady_clock;

enum Mode { kSetDevice, kIsCapturing, kEventRecord, kLaunch, kDispatchCalls, kLaunchesOnly, kNumModes };
const char* const kNames[] = {"cudaSetDevice",
                              "cudaStreamIsCapturing",
                              "cudaEventRecord",
                              "cudaLaunchKernelEx",
                              "a dispatch's five calls (two launches)",
                              "its two launches alone"};

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
            default:  // the direct dispatch's order (cuda_backend.cu): the second launch is programmatic
                if (mode == kDispatchCalls) {
                    ELASTICEP_CUDA_CALL(cudaSetDevice(0));
                    ELASTICEP_CUDA_CALL(cudaStreamIsCapturing(s, &status));
                }
                launch(false);
                launch(true);
                if (mode == kDispatchCalls) ELASTICEP_CUDA_CALL(cudaEventRecord(ev, s));
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
