// What this build and machine offer: backends, GPUs, library versions.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace elasticep {

struct GpuInfo {
    int index = 0;
    std::string name;
    int major = 0, minor = 0;  // compute capability
    size_t memory_bytes = 0;
    int num_sms = 0;
};

struct SystemInfo {
    std::string version;
    std::string backends_compiled;  // "cpu" or "cpu,cuda"
    int cuda_runtime_version = 0;   // e.g. 13000; 0 when not compiled with CUDA
    int cuda_driver_version = 0;    // 0 when no driver is loaded
    int nccl_version = 0;           // NCCL_VERSION_CODE compiled against; 0 when absent
    std::vector<GpuInfo> gpus;
    std::string note;  // why no GPU is usable, if none is
};

SystemInfo system_info();

}  // namespace elasticep
