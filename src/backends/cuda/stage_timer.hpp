// Per-kernel stage times of a CUDA buffer's calls, for finding where a call's latency goes
// (docs/PERFORMANCE.md, "Where staged decode goes"). Off unless ELASTICEP_STAGE_TIMES=1 is set when
// the buffer is built; then every call outside a graph capture records a CUDA event after each of its
// kernels, waits for the last one at the end of the call (a host synchronisation the call otherwise
// would not make: use it with the bench's isolated rounds, not for back-to-back figures), and the
// buffer prints one line per stage on stderr when it is destroyed: the median and the minimum of
// the event-to-event times, in microseconds. A stage includes the time its kernel waited for peers.
// The direct path's kernels also stamp points of each call on the device clock (DevicePoint,
// src/kernels/common/buffer_layout.hpp) into points(); the timer adds the time between every two
// consecutive points that both ran as a stage named "<phase> [device] <interval>".
// Host points (host_point): the host's clock at named steps of a call, reported as "<phase> [host] to
// <point>" (the time since the previous point). ELASTICEP_STAGE_TIMES=host records the host points
// alone (no events, no device points: the call's host time undisturbed by the timer's own calls).
// ELASTICEP_STAGE_TIMES=points records the device points alone: no event between a call's kernels
// (an event there breaks the programmatic launch of the direct path's second kernel and adds work
// between them), one stream synchronisation at the end of the call to read them.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace elasticep::detail::cuda {

class StageTimer {
 public:
    explicit StageTimer(int rank);
    ~StageTimer();
    StageTimer(const StageTimer&) = delete;
    StageTimer& operator=(const StageTimer&) = delete;

    bool on() const { return on_; }
    // The host's clock at step `name` of the call about to begin or running (ELASTICEP_STAGE_TIMES=1
    // or host); the first point of a call is its entry.
    void host_point(const char* name) {
        if (host_on_) host_points_.emplace_back(name, std::chrono::steady_clock::now());
    }
    // Device memory for a call's DevicePoint stamps (zeroed after every call), or nullptr when off.
    // Call with the buffer's device current.
    uint64_t* points();
    // The start of a call of `phase` ("dispatch", "combine") on `stream`; nothing while capturing.
    void begin(const char* phase, cudaStream_t stream, bool capturing);
    // After the launch of the stage named `stage` (the kernel just enqueued on the call's stream).
    void mark(const char* stage);
    // The end of the call: waits for its last event and adds every stage's time.
    void end();

 private:
    struct Stage {
        std::string name;
        std::vector<float> us;
    };
    Stage& stage(const std::string& name);

    bool on_ = false;         // events after every kernel, and device points
    bool points_on_ = false;  // device points (on_ or ELASTICEP_STAGE_TIMES=points)
    bool host_on_ = false;
    bool host_skip_ = false;  // a captured call: its host points are dropped
    bool active_ = false;
    std::vector<std::pair<const char*, std::chrono::steady_clock::time_point>> host_points_;
    int rank_ = 0;
    std::string phase_;
    cudaStream_t stream_ = nullptr;
    std::vector<cudaEvent_t> events_;  // pool; events_[0] is the call's start
    std::vector<std::string> names_;   // names_[i]: the stage that ends at events_[i + 1]
    std::vector<Stage> stages_;        // in first-seen order
    uint64_t* points_ = nullptr;       // device [kNumDevicePoints]
};

}  // namespace elasticep::detail::cuda
