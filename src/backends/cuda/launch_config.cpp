#include "backends/cuda/launch_config.hpp"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>

namespace elasticep::detail::cuda {

LaunchConfig LaunchConfig::choose(const BufferConfig& config, const transport::Placement& where, int device_sms) {
    LaunchConfig c;
    if (config.num_sms > 0)
        c.num_sms = std::min(config.num_sms, device_sms);
    else if (where.ranks_on_my_gpu > 1)
        c.num_sms = std::max(1, device_sms / where.ranks_on_my_gpu);  // HBM shared by the ranks of this GPU
    else if (where.remote_gpu)
        c.num_sms = std::min(24, device_sms);  // NVLink: ~24 SMs saturate the link
    else
        c.num_sms = device_sms;
    c.host_waits = where.shared_gpu_in_process;
    if (const char* v = std::getenv("ELASTICEP_SHARED_GPU_DEVICE_WAITS"); v && std::string(v) == "1")
        c.host_waits = false;
    return c;
}

uint64_t timeout_ns(std::chrono::milliseconds t) {
    const uint64_t ms = static_cast<uint64_t>(std::max<int64_t>(t.count(), 0));
    constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max() / 1000000ull;
    return ms > kMax ? std::numeric_limits<uint64_t>::max() : ms * 1000000ull;
}

}  // namespace elasticep::detail::cuda
