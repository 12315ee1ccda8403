#include "backend_io.hpp"

#include <chrono>
#include <cstring>

#include "elasticep/error.hpp"

namespace elasticep::cli {
namespace {

class SteadyTimer final : public PhaseTimer {
 public:
    void start(void*) override { t0_ = std::chrono::steady_clock::now(); }
    double stop_us(void*) override {
        const auto t1 = std::chrono::steady_clock::now();
        return std::chrono::duration<double, std::micro>(t1 - t0_).count();
    }

 private:
    std::chrono::steady_clock::time_point t0_;
};

class HostMemory final : public BenchMemory {
 public:
    TensorRef upload(const void* host, DType dtype, std::vector<int64_t> shape) override {
        // The CPU backend reads its inputs where they are; bench keeps them alive.
        return TensorRef::contiguous(const_cast<void*>(host), dtype, std::move(shape));
    }
    TensorRef scratch(DType dtype, std::vector<int64_t> shape) override {
        TensorRef t = TensorRef::contiguous(nullptr, dtype, std::move(shape));
        buffers_.emplace_back(t.nbytes() + 1);
        t.data = buffers_.back().data();
        return t;
    }
    void refresh(const TensorRef& device, const void* host) override {
        if (device.data != host && device.nbytes() != 0) std::memcpy(device.data, host, device.nbytes());
    }
    const void* fetch(const TensorRef& t, size_t, int) override { return t.data; }
    void* stream() override { return nullptr; }

 private:
    std::vector<std::vector<uint8_t>> buffers_;
};

#if !defined(ELASTICEP_CLI_WITH_CUDA)
[[noreturn]] void no_device_io() {
    throw Error(ErrorCode::kUnsupported, "this elasticep CLI was built without CUDA; use --backend cpu");
}
#endif

}  // namespace

#if defined(ELASTICEP_CLI_WITH_CUDA)
std::unique_ptr<PhaseTimer> make_cuda_phase_timer();            // backend_io_cuda.cpp
std::unique_ptr<BenchMemory> make_cuda_bench_memory(int rank);  // backend_io_cuda.cpp
#endif

std::unique_ptr<PhaseTimer> make_phase_timer(BackendKind resolved) {
    if (resolved == BackendKind::kCUDA) {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        return make_cuda_phase_timer();
#else
        no_device_io();
#endif
    }
    return std::make_unique<SteadyTimer>();
}

std::unique_ptr<BenchMemory> make_bench_memory(BackendKind resolved, int rank) {
    if (resolved == BackendKind::kCUDA) {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        return make_cuda_bench_memory(rank);
#else
        (void)rank;
        no_device_io();
#endif
    }
    return std::make_unique<HostMemory>();
}

}  // namespace elasticep::cli
