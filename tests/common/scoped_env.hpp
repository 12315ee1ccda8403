// ScopedEnv: sets an environment variable for the buffers built inside its scope (the CUDA backend
// reads ELASTICEP_KERNEL_VARIANT and ELASTICEP_STAGING_BYTES when a buffer is built). Set it before
// the rank threads start; not thread-safe against concurrent getenv.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace eptest {

class ScopedEnv {
 public:
    ScopedEnv(const char* name, const char* value) : name_(name) {
        if (const char* old = std::getenv(name)) old_ = old;
        ::setenv(name, value, 1);
    }
    ~ScopedEnv() {
        if (old_)
            ::setenv(name_.c_str(), old_->c_str(), 1);
        else
            ::unsetenv(name_.c_str());
    }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
    std::string name_;
    std::optional<std::string> old_;
};

}  // namespace eptest
