#include "elasticep/error.hpp"

namespace elasticep {

const char* error_code_name(ErrorCode code) {
    switch (code) {
        case ErrorCode::kInvalidArgument:
            return "InvalidArgument";
        case ErrorCode::kUnsupported:
            return "Unsupported";
        case ErrorCode::kCapacityExceeded:
            return "CapacityExceeded";
        case ErrorCode::kTimeout:
            return "Timeout";
        case ErrorCode::kCuda:
            return "Cuda";
        case ErrorCode::kNccl:
            return "Nccl";
        case ErrorCode::kInternal:
            return "Internal";
    }
    return "Unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(std::string("[") + error_code_name(code) + "] " + message), code_(code), message_(message) {}

}  // namespace elasticep
