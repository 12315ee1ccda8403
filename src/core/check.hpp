// Always-on checks for user input and internal invariants (never assert(), never exit()).
#pragma once

#include <sstream>
#include <string>

#include "elasticep/error.hpp"

namespace elasticep::detail {

template <class... Args>
std::string cat(const Args&... args) {
    std::ostringstream os;
    (os << ... << args);
    return os.str();
}

[[noreturn]] inline void raise(ErrorCode code, const std::string& msg) { throw Error(code, msg); }

}  // namespace elasticep::detail

#define ELASTICEP_CHECK(cond, code, ...)                                                        \
    do {                                                                                        \
        if (!(cond)) ::elasticep::detail::raise((code), ::elasticep::detail::cat(__VA_ARGS__)); \
    } while (0)

#define ELASTICEP_CHECK_ARG(cond, ...) ELASTICEP_CHECK(cond, ::elasticep::ErrorCode::kInvalidArgument, __VA_ARGS__)
#define ELASTICEP_INTERNAL(cond, ...) \
    ELASTICEP_CHECK(cond, ::elasticep::ErrorCode::kInternal, "internal: ", __VA_ARGS__)
