// Run under mpirun with 2 processes: the CPU backend with ranks as processes (arena in a shared
// file mapping), rank 1 forging what it announces to rank 0 through the test hook of
// core/testing.hpp. Rank 0 must raise a named error naming rank 1 (host sync) or record a sticky
// fault (graph mode), and never write outside its caller-provided outputs (guard bytes checked).
// The forged counts are the ones that used to corrupt the heap (50) or crash (10^6).
#include <cstdio>
#include <cstring>
#include <elasticep/elasticep.hpp>
#include <functional>
#include <string>
#include <vector>

#include "core/testing.hpp"

using namespace elasticep;
namespace tst = elasticep::detail::testing;

namespace {

constexpr int kH = 128, kC = 8, kGuard = 4096;
constexpr uint8_t kFill = 0x5a;

struct Case {
    const char* what;
    std::function<void(tst::OutgoingDispatch&)> forge;
    const char* needle;
};

int check_case(const std::shared_ptr<Group>& g, const Case& c, bool host_sync) {
    const int rank = g->rank();
    BufferConfig cfg{.num_experts = 4, .num_topk = 2, .hidden = kH, .max_tokens_per_rank = kC};
    cfg.timeout = std::chrono::seconds(20);
    auto buf = Buffer::create(g, cfg, BackendKind::kCPU);
    if (rank == 1)
        tst::set_dispatch_forger(*buf, [&](tst::OutgoingDispatch& o) {
            if (o.receiver == 0) c.forge(o);
        });
    std::vector<uint16_t> x(4 * kH, 0x3f80);
    std::vector<int32_t> idx = {0, 1, 1, 0, 0, 1, 1, 0};  // every token to rank 0's experts
    DispatchArgs a;
    a.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {4, kH});
    a.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {4, 2});
    a.host_sync = host_sync;
    const int64_t rows = buf->max_contiguous_rows(1);
    std::vector<uint8_t> mem(static_cast<size_t>(rows * kH * 2 + 2 * kGuard), kFill);
    a.outputs.recv_x = TensorRef::contiguous(mem.data() + kGuard, DType::kBFloat16, {rows, kH});
    std::string error;
    try {
        DispatchResult r = buf->dispatch(a);
        buf->check();
    } catch (const Error& e) {
        error = e.what();
    }
    bool guards = true;
    for (int i = 0; i < kGuard; ++i)
        guards &= mem[static_cast<size_t>(i)] == kFill && mem[mem.size() - 1 - static_cast<size_t>(i)] == kFill;
    int rc = 0;
    if (!guards) {
        std::fprintf(stderr, "rank %d, %s: wrote outside its output\n", rank, c.what);
        rc = 1;
    }
    if (rank == 0 && (error.find("[Internal]") == std::string::npos ||
                      error.find("received malformed data from rank 1") == std::string::npos ||
                      error.find(c.needle) == std::string::npos)) {
        std::fprintf(stderr, "rank 0, %s (%s): expected a named error, got '%s'\n", c.what,
                     host_sync ? "host sync" : "graph mode", error.c_str());
        rc = 1;
    }
    if (rank == 1 && !error.empty()) {
        std::fprintf(stderr, "rank 1, %s: unexpected error %s\n", c.what, error.c_str());
        rc = 1;
    }
    g->barrier();  // rank 1's handle stays outstanding; both drop their buffers
    return rc;
}

}  // namespace

int main() {
    auto g = MpiGroup::world(std::chrono::seconds(30));
    const std::vector<Case> cases = {
        {"count C+1", [](tst::OutgoingDispatch& o) { o.count = kC + 1; }, "announced 9 messages"},
        {"count 50", [](tst::OutgoingDispatch& o) { o.count = 50; }, "announced 50 messages"},
        {"count 10^6", [](tst::OutgoingDispatch& o) { o.count = 1000000; }, "announced 1000000 messages"},
        {"zero-filled slot",
         [](tst::OutgoingDispatch& o) { std::memset(o.slots, 0, static_cast<size_t>(o.layout.bytes)); },
         "expert id 0 repeated"},
        {"source token past C", [](tst::OutgoingDispatch& o) { std::memcpy(o.slots + o.layout.src_offset, &kC, 4); },
         "source token 8"},
    };
    int rc = 0;
    for (bool host_sync : {true, false})
        for (const Case& c : cases) rc |= check_case(g, c, host_sync);
    std::printf("rank %d: forged peer data across processes %s\n", g->rank(), rc ? "FAILED" : "ok");
    return rc;
}
