// Host time inside the CUDA calls that one direct dispatch makes, from one thread and from 8 threads
// sharing one context (as the bench's 8 ranks on one GPU do), each thread on its own non-blocking
// stream. Kernel parameters of 664 bytes, the size of DispatchParams. Prints microseconds per call
// (the slowest thread's mean for 8 threads); docs/PERFORMANCE.md, "Sixteenth session".
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

namespace {

struct Params {
    char bytes[664];
};

__global__ void empty_kernel(Params p) {
    if (p.bytes[0] == 42 && threadIdx.x == 1000) printf("unreachable\n");
}

using Clock = std::chrono::steady_clock;

enum Mode { kSetDevice, kIsCapturing, kEventRecord, kLaunch, kDispatchCalls, kLaunchesOnly, kNumModes };
const char* const kNames[] = {"cudaSetDevice",
                              "cudaStreamIsCapturing",
                              "cudaEventRecord",
                              "cudaLaunchKernelEx",
                              "a dispatch's calls (the five above, two launches)",
                              "its two launches alone"};

// mean host time per iteration of `mode`, over n iterations (the stream drained every 16)
double time_calls(int mode, cudaStream_t s, cudaEvent_t ev, int n) {
    Params p{};
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(16);
    cfg.blockDim = dim3(512);
    cfg.stream = s;
    cudaLaunchAttribute pdl{};
    pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    pdl.val.programmaticStreamSerializationAllowed = 1;
    double total = 0;
    for (int i = 0; i < n; ++i) {
        cudaStreamCaptureStatus status;
        const auto t0 = Clock::now();
        switch (mode) {
            case kSetDevice:
                cudaSetDevice(0);
                break;
            case kIsCapturing:
                cudaStreamIsCapturing(s, &status);
                break;
            case kEventRecord:
                cudaEventRecord(ev, s);
                break;
            case kLaunch:
                cfg.numAttrs = 0;
                cudaLaunchKernelEx(&cfg, empty_kernel, p);
                break;
            default:
                if (mode == kDispatchCalls) {
                    cudaSetDevice(0);
                    cudaStreamIsCapturing(s, &status);
                }
                cfg.numAttrs = 0;
                cudaLaunchKernelEx(&cfg, empty_kernel, p);
                cfg.attrs = &pdl;
                cfg.numAttrs = 1;
                cudaLaunchKernelEx(&cfg, empty_kernel, p);
                if (mode == kDispatchCalls) cudaEventRecord(ev, s);
        }
        total += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (i % 16 == 15) cudaStreamSynchronize(s);
    }
    cudaStreamSynchronize(s);
    return total / n;
}

}  // namespace

int main() {
    constexpr int kThreads = 8, kIters = 2048;
    for (int mode = 0; mode < kNumModes; ++mode) {
        std::vector<cudaStream_t> streams(kThreads);
        std::vector<cudaEvent_t> events(kThreads);
        for (int t = 0; t < kThreads; ++t) {
            cudaStreamCreateWithFlags(&streams[t], cudaStreamNonBlocking);
            cudaEventCreateWithFlags(&events[t], cudaEventDisableTiming);
        }
        time_calls(mode, streams[0], events[0], 256);  // warm-up
        const double one = time_calls(mode, streams[0], events[0], kIters);
        std::vector<double> per_thread(kThreads);
        std::vector<std::thread> threads;
        for (int t = 0; t < kThreads; ++t)
            threads.emplace_back([&, t] {
                cudaSetDevice(0);
                per_thread[t] = time_calls(mode, streams[t], events[t], kIters);
            });
        for (auto& th : threads) th.join();
        double slowest = 0;
        for (double v : per_thread) slowest = v > slowest ? v : slowest;
        std::printf("%-52s 1 thread %6.2f us, %d threads %6.2f us per call\n", kNames[mode], one, kThreads, slowest);
        for (int t = 0; t < kThreads; ++t) {
            cudaStreamDestroy(streams[t]);
            cudaEventDestroy(events[t]);
        }
    }
    if (cudaGetLastError() != cudaSuccess) return 1;
    return 0;
}
