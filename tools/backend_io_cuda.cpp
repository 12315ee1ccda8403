// BenchMemory and PhaseTimer for the CUDA backend (built when the library is built with CUDA).
// Each rank thread owns one non-blocking stream on GPU `rank % device_count` (several ranks may
// share a GPU). Inputs are copied to the device once; outputs are copied back only for
// verification, between the timed calls; CUDA events on the rank's stream time each call.
#include <cuda_runtime_api.h>

#include <map>
#include <string>

#include "backend_io.hpp"
#include "elasticep/error.hpp"

namespace elasticep::cli {
namespace {

void cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess)
        throw Error(ErrorCode::kCuda, std::string("elasticep bench: ") + what + ": " + cudaGetErrorString(e));
}

class CudaEventTimer final : public PhaseTimer {
 public:
    CudaEventTimer() {
        cuda_check(cudaEventCreate(&begin_), "cudaEventCreate");
        cuda_check(cudaEventCreate(&end_), "cudaEventCreate");
    }
    ~CudaEventTimer() override {
        cudaEventDestroy(begin_);
        cudaEventDestroy(end_);
    }
    void start(void* stream) override {
        cuda_check(cudaEventRecord(begin_, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
    }
    double stop_us(void* stream) override {
        cuda_check(cudaEventRecord(end_, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
        cuda_check(cudaEventSynchronize(end_), "cudaEventSynchronize");
        float ms = 0;
        cuda_check(cudaEventElapsedTime(&ms, begin_, end_), "cudaEventElapsedTime");
        return static_cast<double>(ms) * 1e3;
    }

 private:
    cudaEvent_t begin_{}, end_{};
};

class DeviceMemory final : public BenchMemory {
 public:
    explicit DeviceMemory(int rank) {
        int count = 0;
        cuda_check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
        if (count < 1) throw Error(ErrorCode::kUnsupported, "elasticep bench: no CUDA device for the cuda backend");
        device_ = rank % count;
        cuda_check(cudaSetDevice(device_),
                   "cudaSetDevice");  // the rank thread's current device: BufferConfig.device = -1
        cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    }
    ~DeviceMemory() override {
        cudaSetDevice(device_);
        cudaStreamSynchronize(stream_);
        for (void* p : allocations_) cudaFree(p);
        cudaStreamDestroy(stream_);
    }
    TensorRef upload(const void* host, DType dtype, std::vector<int64_t> shape) override {
        TensorRef t = scratch(dtype, std::move(shape));
        if (t.nbytes())
            cuda_check(cudaMemcpy(t.data, host, t.nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy to device");
        return t;
    }
    TensorRef scratch(DType dtype, std::vector<int64_t> shape) override {
        TensorRef t = TensorRef::contiguous(nullptr, dtype, std::move(shape), Device{DeviceType::kCUDA, device_});
        void* p = nullptr;
        cuda_check(cudaMalloc(&p, t.nbytes() + 16), "cudaMalloc");
        cuda_check(cudaMemset(p, 0, t.nbytes() + 16), "cudaMemset");
        allocations_.push_back(p);
        t.data = p;
        return t;
    }
    void refresh(const TensorRef& device, const void* host) override {
        if (!device.nbytes()) return;
        cuda_check(cudaMemcpyAsync(device.data, host, device.nbytes(), cudaMemcpyHostToDevice, stream_),
                   "cudaMemcpyAsync");
        cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    }
    const void* fetch(const TensorRef& t, size_t bytes, int slot) override {
        auto& host = host_[slot];
        host.resize(bytes + 1);
        if (bytes == 0) return host.data();
        if (t.device.type != DeviceType::kCUDA) return t.data;  // host-resident result (e.g. counts)
        cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
        cuda_check(cudaMemcpy(host.data(), t.data, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
        return host.data();
    }
    void* stream() override { return stream_; }

 private:
    int device_ = 0;
    cudaStream_t stream_{};
    std::vector<void*> allocations_;
    std::map<int, std::vector<uint8_t>> host_;
};

}  // namespace

std::unique_ptr<PhaseTimer> make_cuda_phase_timer() { return std::make_unique<CudaEventTimer>(); }
std::unique_ptr<BenchMemory> make_cuda_bench_memory(int rank) { return std::make_unique<DeviceMemory>(rank); }

}  // namespace elasticep::cli
