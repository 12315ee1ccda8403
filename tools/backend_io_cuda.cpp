// RankDevice for the CUDA backend (built when the library is built with CUDA). Each rank thread
// owns one non-blocking stream on GPU `rank % num_gpus` (several ranks may share a GPU). Inputs
// are copied to the device once; outputs are copied back only for verification, between the
// timed calls; CUDA events on the rank's stream are the marks. Everything a rank allocates is
// allocated before its first timed call (cudaFree waits for kernels of other streams, so it runs
// only when the rank is done).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "backend_io.hpp"
#include "elasticep/error.hpp"

namespace elasticep::cli {
namespace {

void cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess)
        throw Error(ErrorCode::kCuda, std::string("elasticep bench: ") + what + ": " + cudaGetErrorName(e) + " (" +
                                          cudaGetErrorString(e) + ")");
}

class CudaGraphReplay final : public Replay {
 public:
    CudaGraphReplay(cudaGraph_t graph, cudaStream_t stream) : graph_(graph), stream_(stream) {
        cuda_check(cudaGraphInstantiate(&exec_, graph_, 0), "cudaGraphInstantiate");
    }
    ~CudaGraphReplay() override {
        cudaGraphExecDestroy(exec_);
        cudaGraphDestroy(graph_);
    }
    void launch() override { cuda_check(cudaGraphLaunch(exec_, stream_), "cudaGraphLaunch"); }

 private:
    cudaGraph_t graph_{};
    cudaGraphExec_t exec_{};
    cudaStream_t stream_{};
};

class CudaRankDevice final : public RankDevice {
 public:
    CudaRankDevice(int rank, int num_gpus) {
        const int count = visible_gpus();
        if (count < 1)
            throw Error(ErrorCode::kUnsupported,
                        "elasticep bench: no usable GPU for --backend cuda: " + gpu_unavailable_reason());
        if (num_gpus > count)
            throw Error(ErrorCode::kInvalidArgument, "--gpus " + std::to_string(num_gpus) + " but this process sees " +
                                                         std::to_string(count) +
                                                         " GPU(s) (CUDA_VISIBLE_DEVICES); lower --gpus");
        device_ = rank % std::max(num_gpus, 1);
        cuda_check(cudaSetDevice(device_), "cudaSetDevice");  // the rank thread's current device
        cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    }
    ~CudaRankDevice() override {
        cudaSetDevice(device_);
        cudaStreamSynchronize(stream_);
        for (cudaEvent_t e : events_) cudaEventDestroy(e);
        for (void* p : allocations_) cudaFree(p);
        cudaStreamDestroy(stream_);
    }
    int device() const override { return device_; }
    void* stream() override { return stream_; }
    TensorRef upload(const void* host, DType dtype, std::vector<int64_t> shape) override {
        TensorRef t = scratch(dtype, std::move(shape));
        // on the bench's stream and finished here: a pageable cudaMemcpy may return before its DMA
        // lands, and the calls' streams are not ordered after the legacy stream
        if (t.nbytes()) {
            cuda_check(cudaMemcpyAsync(t.data, host, t.nbytes(), cudaMemcpyHostToDevice, stream_),
                       "cudaMemcpyAsync to device");
            cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
        }
        return t;
    }
    TensorRef scratch(DType dtype, std::vector<int64_t> shape) override {
        TensorRef t = TensorRef::contiguous(nullptr, dtype, std::move(shape), Device{DeviceType::kCUDA, device_});
        void* p = nullptr;
        cuda_check(cudaMalloc(&p, t.nbytes() + 16), "cudaMalloc");
        allocations_.push_back(p);
        cuda_check(cudaMemsetAsync(p, 0, t.nbytes() + 16, stream_), "cudaMemsetAsync");
        cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
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
    void synchronize() override { cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
    void reserve_marks(int n) override {
        while (events_.size() < static_cast<size_t>(n)) {
            cudaEvent_t e{};
            cuda_check(cudaEventCreate(&e), "cudaEventCreate");
            events_.push_back(e);
        }
    }
    void mark(int i) override {
        reserve_marks(i + 1);
        cuda_check(cudaEventRecord(events_[static_cast<size_t>(i)], stream_), "cudaEventRecord");
    }
    double elapsed_us(int from, int to) override {
        float ms = 0;
        cuda_check(
            cudaEventElapsedTime(&ms, events_.at(static_cast<size_t>(from)), events_.at(static_cast<size_t>(to))),
            "cudaEventElapsedTime");
        return static_cast<double>(ms) * 1e3;
    }
    // Events of one device share its clock. cudaEventElapsedTime's sign when `to` precedes `from`
    // is not documented, so a zero is read the other way round as well.
    double since_us(RankDevice& ref, int ref_mark, int my_mark) override {
        auto* other = dynamic_cast<CudaRankDevice*>(&ref);
        if (other == nullptr || other->device_ != device_) return std::numeric_limits<double>::quiet_NaN();
        cudaEvent_t from = other->events_.at(static_cast<size_t>(ref_mark));
        cudaEvent_t to = events_.at(static_cast<size_t>(my_mark));
        float ms = 0;
        cuda_check(cudaEventElapsedTime(&ms, from, to), "cudaEventElapsedTime");
        if (ms == 0.0f) {
            float back = 0;
            cuda_check(cudaEventElapsedTime(&back, to, from), "cudaEventElapsedTime");
            ms = -back;
        }
        return static_cast<double>(ms) * 1e3;
    }
    std::unique_ptr<Replay> capture(const std::function<void()>& body) override {
        cuda_check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
        try {
            body();
        } catch (...) {
            cudaGraph_t broken{};
            cudaStreamEndCapture(stream_, &broken);
            if (broken) cudaGraphDestroy(broken);
            cudaGetLastError();
            throw;
        }
        cudaGraph_t graph{};
        cuda_check(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture");
        return std::make_unique<CudaGraphReplay>(graph, stream_);
    }

 private:
    int device_ = 0;
    cudaStream_t stream_{};
    std::vector<void*> allocations_;
    std::vector<cudaEvent_t> events_;
    std::map<int, std::vector<uint8_t>> host_;
};

}  // namespace

std::unique_ptr<RankDevice> make_cuda_rank_device(int rank, int num_gpus) {
    return std::make_unique<CudaRankDevice>(rank, num_gpus);
}

int visible_gpus() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the "no device" error
        return 0;
    }
    return n;
}

std::string gpu_name(int device) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
        cudaGetLastError();
        return "";
    }
    return p.name;
}

std::string gpu_unavailable_reason() {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess) return n > 0 ? "" : "no CUDA GPU found";
    cudaGetLastError();
    const std::string name = cudaGetErrorName(e);
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    auto ver = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
    if (e == cudaErrorInsufficientDriver && driver == 0) return "no NVIDIA driver/GPU found (" + name + ")";
    if (e == cudaErrorInsufficientDriver)
        return "the NVIDIA driver supports CUDA " + ver(driver) + ", older than this build's CUDA runtime " +
               ver(runtime) + " (" + name + "): update the driver";
    if (e == cudaErrorNoDevice) return "no CUDA GPU found (" + name + "; check CUDA_VISIBLE_DEVICES)";
    return "CUDA cannot start: " + std::string(cudaGetErrorString(e)) + " (" + name + ")";
}

double measure_copy_gbps(int device) {
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    cudaStream_t s{};
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    size_t bytes = size_t{512} << 20;
    void *src = nullptr, *dst = nullptr;
    while (bytes >= (size_t{16} << 20) &&
           (cudaMalloc(&src, bytes) != cudaSuccess || cudaMalloc(&dst, bytes) != cudaSuccess)) {
        cudaGetLastError();
        if (src) cudaFree(src);
        src = dst = nullptr;
        bytes /= 2;
    }
    if (!src || !dst) throw Error(ErrorCode::kCuda, "elasticep bench: no memory for the HBM copy measurement");
    cudaEvent_t a{}, b{};
    cuda_check(cudaEventCreate(&a), "cudaEventCreate");
    cuda_check(cudaEventCreate(&b), "cudaEventCreate");
    std::vector<double> ms;
    for (int i = 0; i < 13; ++i) {
        cuda_check(cudaEventRecord(a, s), "cudaEventRecord");
        cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
        cuda_check(cudaEventRecord(b, s), "cudaEventRecord");
        cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
        float t = 0;
        cuda_check(cudaEventElapsedTime(&t, a, b), "cudaEventElapsedTime");
        if (i >= 3) ms.push_back(t);  // 3 warm-up copies
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaFree(src);
    cudaFree(dst);
    cudaStreamDestroy(s);
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    return 2.0 * static_cast<double>(bytes) / (med * 1e-3) / 1e9;
}

}  // namespace elasticep::cli
