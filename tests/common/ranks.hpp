// Ranks as threads: the one runner every in-process test uses (MPI tests run one rank per process).
#pragma once

#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace eptest {

// Runs fn(rank) on one thread per rank; returns each rank's exception (null when it returned).
template <class Fn>
std::vector<std::exception_ptr> run_ranks(int num_ranks, Fn fn) {
    std::vector<std::exception_ptr> errors(static_cast<size_t>(num_ranks));
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(num_ranks));
    for (int r = 0; r < num_ranks; ++r)
        threads.emplace_back([&, r] {
            try {
                fn(r);
            } catch (...) {
                errors[static_cast<size_t>(r)] = std::current_exception();
            }
        });
    for (auto& t : threads) t.join();
    return errors;
}

inline std::string describe(const std::exception_ptr& e) {
    if (!e) return "no exception";
    try {
        std::rethrow_exception(e);
    } catch (const std::exception& x) {
        return x.what();
    } catch (...) {
        return "unknown exception";
    }
}

}  // namespace eptest
