#include "backend_io.hpp"

#include <chrono>
#include <cstring>
#include <limits>

#include "elasticep/error.hpp"

namespace elasticep::cli {
namespace {

class HostDevice final : public RankDevice {
 public:
    int device() const override { return -1; }
    void* stream() override { return nullptr; }
    TensorRef upload(const void* host, DType dtype, std::vector<int64_t> shape) override {
        // The CPU backend reads its inputs where they are; bench keeps them alive.
        return TensorRef::contiguous(const_cast<void*>(host), dtype, std::move(shape));
    }
    TensorRef scratch(DType dtype, std::vector<int64_t> shape) override {
        TensorRef t = TensorRef::contiguous(nullptr, dtype, std::move(shape));
        buffers_.emplace_back(t.nbytes() + 1, uint8_t{0});
        t.data = buffers_.back().data();
        return t;
    }
    void refresh(const TensorRef& device, const void* host) override {
        if (device.data != host && device.nbytes() != 0) std::memcpy(device.data, host, device.nbytes());
    }
    const void* fetch(const TensorRef& t, size_t, int) override { return t.data; }
    void synchronize() override {}
    void mark(int i) override {
        if (marks_.size() <= static_cast<size_t>(i)) marks_.resize(static_cast<size_t>(i) + 1);
        marks_[static_cast<size_t>(i)] = std::chrono::steady_clock::now();
    }
    double elapsed_us(int from, int to) override {
        return std::chrono::duration<double, std::micro>(marks_.at(static_cast<size_t>(to)) -
                                                         marks_.at(static_cast<size_t>(from)))
            .count();
    }
    void reserve_marks(int n) override {
        if (marks_.size() < static_cast<size_t>(n)) marks_.resize(static_cast<size_t>(n));
    }
    double since_us(RankDevice& ref, int ref_mark, int my_mark) override {
        auto* host = dynamic_cast<HostDevice*>(&ref);
        if (host == nullptr) return std::numeric_limits<double>::quiet_NaN();
        return std::chrono::duration<double, std::micro>(marks_.at(static_cast<size_t>(my_mark)) -
                                                         host->marks_.at(static_cast<size_t>(ref_mark)))
            .count();
    }
    std::unique_ptr<Replay> capture(const std::function<void()>&) override {
        throw Error(ErrorCode::kUnsupported, "--graph captures a CUDA graph: it needs --backend cuda");
    }

 private:
    std::vector<std::vector<uint8_t>> buffers_;
    std::vector<std::chrono::steady_clock::time_point> marks_;
};

}  // namespace

#if defined(ELASTICEP_CLI_WITH_CUDA)
std::unique_ptr<RankDevice> make_cuda_rank_device(int rank, int num_gpus);  // backend_io_cuda.cpp
#else
int visible_gpus() { return 0; }
std::string gpu_name(int) { return ""; }
double measure_copy_gbps(int) {
    throw Error(ErrorCode::kUnsupported, "this elasticep CLI was built without CUDA: no device to measure");
}
std::string gpu_unavailable_reason() { return "this build has no CUDA backend (nvcc was not found at configure time)"; }
#endif

std::unique_ptr<RankDevice> make_rank_device(BackendKind resolved, int rank, int num_gpus) {
    if (resolved == BackendKind::kCUDA) {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        return make_cuda_rank_device(rank, num_gpus);
#else
        (void)rank;
        (void)num_gpus;
        throw Error(ErrorCode::kUnsupported, "this elasticep CLI was built without CUDA; use --backend cpu");
#endif
    }
    return std::make_unique<HostDevice>();
}

}  // namespace elasticep::cli
