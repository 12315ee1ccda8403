#include "backends/cuda/stage_timer.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>

#include "kernels/common/buffer_layout.hpp"
#include "kernels/common/cuda_check.hpp"

namespace elasticep::detail::cuda {

StageTimer::StageTimer(int rank) : rank_(rank) {
    const char* v = std::getenv("ELASTICEP_STAGE_TIMES");
    on_ = v && std::string(v) == "1";
    points_on_ = on_ || (v && std::string(v) == "points");
    host_on_ = on_ || (v && std::string(v) == "host");
}

namespace {

// The intervals between consecutive DevicePoints of each phase: (from, to, name).
struct Interval {
    int from, to;
    const char* name;
};
constexpr Interval kDispatchIntervals[] = {
    {kernels::kPtDispatchEntry, kernels::kPtPlanned, "[device] plan (entry to the publisher)"},
    {kernels::kPtPlanned, kernels::kPtPublished, "[device] publish"},
    {kernels::kPtPublished, kernels::kPtPlansSeen, "[device] wait for plans"},
    {kernels::kPtPlansSeen, kernels::kPtTablesMade, "[device] tables (the waiting block)"},
    {kernels::kPtPlansSeen, kernels::kPtMoveResident, "[device] second launch resident"},
    {kernels::kPtPlansSeen, kernels::kPtMoveEntry, "[device] second launch's start"},
    {kernels::kPtMoveEntry, kernels::kPtTablesRead, "[device] tables (block 0)"},
    {kernels::kPtTablesRead, kernels::kPtMoved, "[device] move (to last block)"},
    {kernels::kPtMoved, kernels::kPtRowsSeen, "[device] wait for rows"},
    {kernels::kPtDispatchEntry, kernels::kPtRowsSeen, "[device] entry to end"},
};
constexpr Interval kCombineIntervals[] = {
    {kernels::kPtCombineEntry, kernels::kPtReadySeen, "[device] publish, wait for ready"},
    {kernels::kPtReadySeen, kernels::kPtReduceResident, "[device] second launch resident"},
    {kernels::kPtReadySeen, kernels::kPtReduceEntry, "[device] second launch's start"},
    {kernels::kPtReduceEntry, kernels::kPtReduceReady, "[device] meet, y pointers (block 0)"},
    {kernels::kPtReduceReady, kernels::kPtReduced, "[device] reduce (to last block)"},
    {kernels::kPtReduced, kernels::kPtDoneSeen, "[device] wait for done"},
    {kernels::kPtCombineEntry, kernels::kPtDoneSeen, "[device] entry to end"},
};

}  // namespace

uint64_t* StageTimer::points() {
    if (!points_on_) return nullptr;
    if (points_ == nullptr) {
        ELASTICEP_CUDA_CALL(cudaMalloc(&points_, kernels::kNumDevicePoints * sizeof(uint64_t)));
        ELASTICEP_CUDA_CALL(cudaMemset(points_, 0, kernels::kNumDevicePoints * sizeof(uint64_t)));
    }
    return points_;
}

StageTimer::~StageTimer() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (points_) cudaFree(points_);
    if (!points_on_ && !host_on_) return;
    for (Stage& s : stages_) {
        if (s.us.empty()) continue;
        std::vector<float> v = s.us;
        std::sort(v.begin(), v.end());
        std::fprintf(stderr, "[elasticep] stage times rank %d %-22s median %9.1f us  min %9.1f us  (%zu calls)\n",
                     rank_, s.name.c_str(), static_cast<double>(v[v.size() / 2]), static_cast<double>(v.front()),
                     v.size());
    }
}

void StageTimer::begin(const char* phase, cudaStream_t stream, bool capturing) {
    phase_ = phase;
    host_skip_ = capturing;
    active_ = points_on_ && !capturing;
    if (!active_) return;
    stream_ = stream;
    names_.clear();
    if (!on_) return;  // points alone
    if (events_.empty()) {
        cudaEvent_t e = nullptr;
        ELASTICEP_CUDA_CALL(cudaEventCreate(&e));
        events_.push_back(e);
    }
    ELASTICEP_CUDA_CALL(cudaEventRecord(events_[0], stream_));
}

void StageTimer::mark(const char* stage) {
    if (!active_ || !on_) return;
    const size_t i = names_.size() + 1;
    if (i >= events_.size()) {
        cudaEvent_t e = nullptr;
        ELASTICEP_CUDA_CALL(cudaEventCreate(&e));
        events_.push_back(e);
    }
    ELASTICEP_CUDA_CALL(cudaEventRecord(events_[i], stream_));
    names_.push_back(stage);
}

void StageTimer::end() {
    for (size_t i = 1; !host_skip_ && i < host_points_.size(); ++i)
        stage(phase_ + " [host] to " + host_points_[i].first)
            .us.push_back(
                std::chrono::duration<float, std::micro>(host_points_[i].second - host_points_[i - 1].second).count());
    host_points_.clear();
    if (!active_) return;
    active_ = false;
    if (on_) {
        if (names_.empty()) return;
        ELASTICEP_CUDA_CALL(cudaEventSynchronize(events_[names_.size()]));
        float total = 0.0f;
        for (size_t i = 0; i < names_.size(); ++i) {
            float ms = 0.0f;
            ELASTICEP_CUDA_CALL(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
            stage(phase_ + " " + names_[i]).us.push_back(1000.0f * ms);
            total += 1000.0f * ms;
        }
        stage(phase_ + " total").us.push_back(total);
    }
    if (points_ == nullptr) return;
    uint64_t at[kernels::kNumDevicePoints] = {};
    ELASTICEP_CUDA_CALL(cudaMemcpyAsync(at, points_, sizeof at, cudaMemcpyDeviceToHost, stream_));
    ELASTICEP_CUDA_CALL(cudaMemsetAsync(points_, 0, sizeof at, stream_));
    ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream_));
    const bool dispatch = phase_ == "dispatch";
    for (const Interval& i : dispatch
                                 ? std::vector<Interval>(std::begin(kDispatchIntervals), std::end(kDispatchIntervals))
                                 : std::vector<Interval>(std::begin(kCombineIntervals), std::end(kCombineIntervals)))
        if (at[i.from] != 0 && at[i.to] != 0 && at[i.to] >= at[i.from])
            stage(phase_ + " " + i.name).us.push_back(static_cast<float>(at[i.to] - at[i.from]) / 1000.0f);
}

StageTimer::Stage& StageTimer::stage(const std::string& name) {
    for (Stage& s : stages_)
        if (s.name == name) return s;
    stages_.push_back(Stage{name, {}});
    return stages_.back();
}

}  // namespace elasticep::detail::cuda
