// fn(i) for every i in [0, n) on up to `threads` threads: contiguous chunks, one per thread, each i
// run once; the first exception (in thread order) is rethrown after every thread joined. For loops
// whose iterations write disjoint outputs (the references' rows and ranks), so the results are those
// of the serial loop whatever the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace elasticep::detail {

inline int hardware_threads() {
    const unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : static_cast<int>(n);
}

template <class Fn>
void parallel_for(int64_t n, int threads, Fn&& fn) {
    const int nt = static_cast<int>(std::min<int64_t>(std::max(threads, 1), std::max<int64_t>(n, 1)));
    if (nt == 1) {
        for (int64_t i = 0; i < n; ++i) fn(i);
        return;
    }
    std::vector<std::exception_ptr> errors(static_cast<size_t>(nt));
    std::vector<std::thread> pool;
    for (int w = 0; w < nt; ++w)
        pool.emplace_back([&, w] {
            try {
                for (int64_t i = n * w / nt; i < n * (w + 1) / nt; ++i) fn(i);
            } catch (...) {
                errors[static_cast<size_t>(w)] = std::current_exception();
            }
        });
    for (std::thread& t : pool) t.join();
    for (const std::exception_ptr& e : errors)
        if (e) std::rethrow_exception(e);
}

}  // namespace elasticep::detail
