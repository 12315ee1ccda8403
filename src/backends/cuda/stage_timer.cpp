#include "backends/cuda/stage_timer.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "kernels/common/cuda_check.hpp"

namespace elasticep::detail::cuda {

StageTimer::StageTimer(int rank) : rank_(rank) {
    const char* v = std::getenv("ELASTICEP_STAGE_TIMES");
    on_ = v && std::string(v) == "1";
}

StageTimer::~StageTimer() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (!on_) return;
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
    active_ = on_ && !capturing;
    if (!active_) return;
    phase_ = phase;
    stream_ = stream;
    names_.clear();
    if (events_.empty()) {
        cudaEvent_t e = nullptr;
        ELASTICEP_CUDA_CALL(cudaEventCreate(&e));
        events_.push_back(e);
    }
    ELASTICEP_CUDA_CALL(cudaEventRecord(events_[0], stream_));
}

void StageTimer::mark(const char* stage) {
    if (!active_) return;
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
    if (!active_) return;
    active_ = false;
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

StageTimer::Stage& StageTimer::stage(const std::string& name) {
    for (Stage& s : stages_)
        if (s.name == name) return s;
    stages_.push_back(Stage{name, {}});
    return stages_.back();
}

}  // namespace elasticep::detail::cuda
