// ThreadGroup: ranks as threads of one process, meeting at a generation-counted rendezvous.
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "core/check.hpp"
#include "elasticep/config.hpp"
#include "elasticep/group.hpp"

namespace elasticep {
namespace {

constexpr int kMaxThreadRanks = 1 << 16;

std::atomic<uint64_t> g_next_group_id{1};

// Shared by the rank handles of one ThreadGroup. Each collective: every rank deposits its bytes,
// the last to arrive bumps the generation, everyone copies the gathered result out.
//
// A round that cannot complete (a rank timed out, or the ranks called different collectives)
// leaves deposits that no later round may mix with its own: the rendezvous is then broken for
// good. Every rank waiting in it is woken, and every later collective on any rank of the group
// raises the first failure at once (the group is unusable; build a new one).
struct Rendezvous {
    explicit Rendezvous(int n, std::chrono::milliseconds t)
        : size(n), timeout(t), slots(static_cast<size_t>(n)), present(static_cast<size_t>(n), false) {}

    const int size;
    const std::chrono::milliseconds timeout;
    const uint64_t id = g_next_group_id.fetch_add(1);
    std::mutex mu;
    std::condition_variable cv;
    uint64_t generation = 0;
    int arrived = 0;
    size_t bytes = 0;
    std::vector<std::vector<char>> slots;
    std::vector<char> result;
    std::vector<bool> present;
    ErrorCode broken_code = ErrorCode::kTimeout;
    std::string broken;  // why the group is unusable; empty while it works

    [[noreturn]] void raise_broken(int rank) const {
        detail::raise(broken_code, detail::cat("ThreadGroup collective on rank ", rank,
                                               ": this group is unusable after an earlier failure (", broken,
                                               "); create a new ThreadGroup"));
    }

    // Marks the group broken (under `mu`), wakes every waiter and raises `message` on this rank.
    [[noreturn]] void fail(ErrorCode code, const std::string& message) {
        broken_code = code;
        broken = message;
        cv.notify_all();
        detail::raise(code, message);
    }

    void all_gather(int rank, const void* send, size_t n, void* recv) {
        std::unique_lock<std::mutex> lock(mu);
        if (!broken.empty()) raise_broken(rank);
        const uint64_t my_gen = generation;
        if (arrived == 0) bytes = n;
        if (present[static_cast<size_t>(rank)])
            fail(ErrorCode::kInvalidArgument, detail::cat("ThreadGroup collective: rank ", rank,
                                                          " entered a collective it is already waiting in; "
                                                          "each rank's Group belongs to one thread at a time"));
        if (n != bytes)
            fail(ErrorCode::kInvalidArgument,
                 detail::cat("ThreadGroup collective size mismatch: rank ", rank, " sent ", n, " bytes, others ", bytes,
                             " (ranks called different collectives)"));
        slots[static_cast<size_t>(rank)].assign(static_cast<const char*>(send), static_cast<const char*>(send) + n);
        present[static_cast<size_t>(rank)] = true;
        if (++arrived == size) {
            result.resize(n * static_cast<size_t>(size));
            for (int r = 0; r < size; ++r)
                if (n != 0)
                    std::memcpy(result.data() + n * static_cast<size_t>(r), slots[static_cast<size_t>(r)].data(), n);
            arrived = 0;
            present.assign(static_cast<size_t>(size), false);
            ++generation;
            cv.notify_all();
        } else if (!cv.wait_for(lock, timeout, [&] { return generation != my_gen || !broken.empty(); })) {
            std::string missing;
            for (int r = 0; r < size; ++r)
                if (!present[static_cast<size_t>(r)]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
            fail(ErrorCode::kTimeout, detail::cat("ThreadGroup collective: rank ", rank, " waited ", timeout.count(),
                                                  " ms; rank(s) ", missing, " never arrived"));
        } else if (generation == my_gen) {
            raise_broken(rank);  // another rank gave up on this round
        }
        if (n != 0) std::memcpy(recv, result.data(), n * static_cast<size_t>(size));
    }
};

class ThreadRankGroup final : public Group {
 public:
    ThreadRankGroup(std::shared_ptr<Rendezvous> rv, int rank) : rv_(std::move(rv)), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return rv_->size; }
    void all_gather(const void* send, size_t bytes, void* recv) override { rv_->all_gather(rank_, send, bytes, recv); }
    void barrier() override {
        std::vector<char> sink(static_cast<size_t>(rv_->size));
        char token = 0;
        rv_->all_gather(rank_, &token, 1, sink.data());
    }
    std::string identity() const override { return "thread-group-" + std::to_string(rv_->id); }

 private:
    std::shared_ptr<Rendezvous> rv_;
    int rank_;
};

}  // namespace

std::vector<std::shared_ptr<Group>> ThreadGroup::create(int num_ranks, std::chrono::milliseconds timeout) {
    ELASTICEP_CHECK_ARG(num_ranks >= 1 && num_ranks <= kMaxThreadRanks, "ThreadGroup::create: num_ranks=", num_ranks,
                        " must be in [1, ", kMaxThreadRanks, "] (one thread per rank)");
    validate_timeout(timeout, "ThreadGroup::create: timeout");
    auto rv = std::make_shared<Rendezvous>(num_ranks, timeout);
    std::vector<std::shared_ptr<Group>> out;
    for (int r = 0; r < num_ranks; ++r) out.push_back(std::make_shared<ThreadRankGroup>(rv, r));
    return out;
}

}  // namespace elasticep
