// Group: the bootstrap channel between the ranks of one expert-parallel group.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace elasticep {

// A collective channel for small control messages (buffer setup, registry keys, IPC handles).
// Every rank calls each collective in the same order. Implementations bound their waits and
// throw Error(kTimeout) instead of hanging.
class Group {
 public:
    virtual ~Group() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    // Gathers `bytes` from every rank into `recv` (size() * bytes, rank-major).
    virtual void all_gather(const void* send, size_t bytes, void* recv) = 0;
    virtual void barrier() = 0;
    // The same on every rank of this group and different from every other live group.
    virtual std::string identity() const = 0;

    // Convenience over all_gather for trivially copyable values.
    template <class T>
    std::vector<T> all_gather_value(const T& value) {
        std::vector<T> out(static_cast<size_t>(size()));
        all_gather(&value, sizeof(T), out.data());
        return out;
    }
};

// Ranks as threads of one process: create(n) returns one Group per rank; hand group[i] to the
// thread that plays rank i. Collectives wait at most `timeout` for the other threads.
class ThreadGroup {
 public:
    static std::vector<std::shared_ptr<Group>> create(int num_ranks,
                                                      std::chrono::milliseconds timeout = std::chrono::seconds(60));
};

}  // namespace elasticep
