// Errors raised by every public ElasticEP call.
#pragma once

#include <stdexcept>
#include <string>

namespace elasticep {

enum class ErrorCode {
    kInvalidArgument,   // bad shape, dtype, stride, device, expert id or option
    kUnsupported,       // valid request that this build or backend cannot serve
    kCapacityExceeded,  // more tokens than max_tokens_per_rank, or an output too small
    kTimeout,           // a peer did not arrive within the buffer's timeout
    kCuda,              // a CUDA runtime/driver failure
    kNccl,              // an NCCL failure
    kInternal,          // a broken invariant inside the library (a bug: please report)
};

const char* error_code_name(ErrorCode code);

// Every public call throws this (never exits, never asserts on user input).
// what() is "[Code] message"; message() is the text without the code.
class Error : public std::runtime_error {
 public:
    Error(ErrorCode code, const std::string& message);
    ErrorCode code() const noexcept { return code_; }
    const std::string& message() const noexcept { return message_; }

 private:
    ErrorCode code_;
    std::string message_;
};

}  // namespace elasticep
