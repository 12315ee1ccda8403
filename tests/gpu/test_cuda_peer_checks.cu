// Peer data checked on receipt by the CUDA kernels (protocol.hpp, "Peer data"; issue 10): a forged
// message count, per-expert count, row position, expert id or source token in a receiver's window is
// dropped and recorded as a peer fault naming the sender, and nothing is written outside the outputs
// or the windows. The test writes rank 0's window by hand, as two senders would have, then runs the
// exchange (wait-only: the flags are already there), expand and partial kernels of the library on it.
// Run compute-sanitizer over it as well (tools/device-check sanitize).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "backends/cuda/kernel_launch.hpp"
#include "core/protocol.hpp"
#include "gpu_harness.hpp"
#include "kernels/common/buffer_layout.hpp"

namespace eptest {
namespace {

using detail::cuda::CombineParams;
using detail::cuda::DispatchModes;
using detail::cuda::DispatchParams;
using detail::cuda::Team;
using kernels::DispatchFlag;
using kernels::HostRecord;
using kernels::RegionLayout;
using kernels::Shape;
using kernels::Workspace;

constexpr int kRanks = 2, kExperts = 6, kLocal = 3, kTopk = 2, kHidden = 64, kCapacity = 4;
constexpr size_t kGuard = 4096;
constexpr uint8_t kGuardByte = 0xa5, kFillByte = 0x5a;

#define CUDA_EXPECT(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Device memory with guard bytes on both sides.
struct GuardedDev {
    uint8_t* base = nullptr;
    size_t bytes = 0;
    explicit GuardedDev(size_t n) : bytes(n) {
        if (cudaMalloc(&base, n + 2 * kGuard) != cudaSuccess) throw std::runtime_error("cudaMalloc");
        cudaMemset(base, kGuardByte, n + 2 * kGuard);
        cudaMemset(base + kGuard, kFillByte, n);
    }
    ~GuardedDev() { cudaFree(base); }
    uint8_t* data() const { return base + kGuard; }
    bool guards_intact() const {
        std::vector<uint8_t> h(bytes + 2 * kGuard);
        if (cudaMemcpy(h.data(), base, h.size(), cudaMemcpyDeviceToHost) != cudaSuccess) return false;
        for (size_t i = 0; i < kGuard; ++i)
            if (h[i] != kGuardByte || h[kGuard + bytes + i] != kGuardByte) return false;
        return true;
    }
};

Shape make_shape() {
    BufferConfig c;
    c.num_experts = kExperts;
    c.num_topk = kTopk;
    c.hidden = kHidden;
    c.max_tokens_per_rank = kCapacity;
    Shape s{};
    s.num_ranks = kRanks;
    s.num_experts = kExperts;
    s.num_local_experts = kLocal;
    s.num_topk = kTopk;
    s.hidden = kHidden;
    s.capacity = kCapacity;
    s.msg = detail::message_layout(c);
    return s;
}

// What two senders put into rank 0's window (epoch 1, parity 1): sender 0 one message, sender 1 two.
struct Message {
    int32_t idx[kTopk];
    int32_t route_pos[kTopk];
    int32_t src;
};
struct Sent {
    int64_t count;
    int32_t expert_counts[kLocal];
    std::vector<Message> msgs;
};

// Local experts of rank 0 are 0, 1, 2 (E_local = 3); expert 3 lives on rank 1.
std::vector<Sent> honest() {
    return {
        {1, {1, 0, 0}, {{{0, 3}, {0, -1}, 2}}},
        {2, {1, 2, 0}, {{{1, 0}, {0, 0}, 0}, {{1, -1}, {1, -1}, 3}}},
    };
}

struct Outcome {
    detail::PeerFault fault{};
    std::vector<int32_t> counts, offsets, recv_src;
    bool guards_ok = false;
    std::string message;
};

void run_receiver(const std::vector<Sent>& sent, bool run_partial, Outcome& out) {
    const Shape sh = make_shape();
    const RegionLayout region = RegionLayout::make(sh);
    const int64_t ws_bytes = Workspace::carve(sh, nullptr).bytes;
    const int64_t rows_cap = contiguous_rows_cap(kRanks, kCapacity, kTopk, kLocal, 1);
    GuardedDev win0(static_cast<size_t>(region.bytes)), win1(static_cast<size_t>(region.bytes));
    GuardedDev ws_mem(static_cast<size_t>(ws_bytes));
    GuardedDev recv_x(static_cast<size_t>(rows_cap * kHidden * 2)), recv_w(static_cast<size_t>(rows_cap * 4)),
        recv_src(static_cast<size_t>(rows_cap * 4)), m_idx(static_cast<size_t>(rows_cap * 4)),
        y(static_cast<size_t>(rows_cap * kHidden * 2));

    // rank 0's window as the senders left it
    std::vector<uint8_t> w(static_cast<size_t>(region.bytes), 0);
    for (int s = 0; s < kRanks; ++s) {
        const Sent& snd = sent[static_cast<size_t>(s)];
        DispatchFlag f{};
        f.epoch = 1;
        f.count = snd.count;
        std::memcpy(w.data() + region.dispatch_flag(s, 1), &f, sizeof(f));
        std::memcpy(w.data() + region.expert_counts_row(s, 1), snd.expert_counts, sizeof(snd.expert_counts));
        for (size_t j = 0; j < snd.msgs.size(); ++j) {
            const Message& m = snd.msgs[j];
            const int64_t slot = int64_t{s} * kCapacity + static_cast<int64_t>(j);
            if (slot >= int64_t{kRanks} * kCapacity) continue;
            uint8_t* msg = w.data() + region.message(slot);
            for (int b = 0; b < sh.msg.payload_bytes; ++b) msg[b] = static_cast<uint8_t>(16 * s + j);
            std::memcpy(msg + sh.msg.idx_offset, m.idx, sizeof(m.idx));
            std::memcpy(msg + sh.msg.src_offset, &m.src, 4);
            std::memcpy(w.data() + region.route_pos_row(slot), m.route_pos, sizeof(m.route_pos));
        }
    }
    CUDA_EXPECT(cudaMemcpy(win0.data(), w.data(), w.size(), cudaMemcpyHostToDevice));
    CUDA_EXPECT(cudaMemset(ws_mem.data(), 0, static_cast<size_t>(ws_bytes)));
    const Workspace ws = Workspace::carve(sh, ws_mem.data());
    CUDA_EXPECT(cudaMemset(ws.first_bad_route, 0xff, sizeof(*ws.first_bad_route)));
    CUDA_EXPECT(cudaMemset(y.data(), 0, y.bytes));
    uint8_t** windows = nullptr;
    CUDA_EXPECT(cudaMalloc(&windows, 2 * sizeof(uint8_t*)));
    uint8_t* host_windows[2] = {win0.data(), win1.data()};
    CUDA_EXPECT(cudaMemcpy(windows, host_windows, sizeof(host_windows), cudaMemcpyHostToDevice));
    HostRecord* rec = nullptr;
    CUDA_EXPECT(cudaHostAlloc(reinterpret_cast<void**>(&rec), sizeof(HostRecord), cudaHostAllocMapped));
    std::memset(static_cast<void*>(rec), 0, sizeof(HostRecord));
    HostRecord* rec_dev = nullptr;
    CUDA_EXPECT(cudaHostGetDevicePointer(reinterpret_cast<void**>(&rec_dev), rec, 0));

    auto fill = [&](kernels::CallParams<Team>& p) {
        p.team = Team{transport::NvlinkWindows{0, kRanks, windows, win0.data()}};
        p.shape = sh;
        p.region = region;
        p.ws = ws;
        p.record = rec_dev;
        p.timeout_ns = 2000000000ull;
        p.sync_mode = kernels::kWaitOnly;  // the flags are already in the window
        p.num_tokens = 0;
    };
    DispatchParams p{};
    fill(p);
    p.host_sync = false;
    p.expert_alignment = 1;
    p.num_rows_out = rows_cap;
    p.recv_x = recv_x.data();
    p.recv_weights = reinterpret_cast<float*>(recv_w.data());
    p.recv_src = reinterpret_cast<int32_t*>(recv_src.data());
    p.m_indices = reinterpret_cast<int32_t*>(m_idx.data());
    const DispatchModes modes{kernels::SendPayload::kBF16, false, true};
    detail::cuda::launch_exchange(p, modes, nullptr);
    detail::cuda::launch_expand(p, modes, 2, nullptr);
    if (run_partial) {
        CombineParams c{};
        fill(c);
        c.y = reinterpret_cast<const uint16_t*>(y.data());
        detail::cuda::launch_partial(c, false, 2, nullptr);
    }
    CUDA_EXPECT(cudaDeviceSynchronize());

    out.fault = rec->peer_fault;
    if (out.fault.kind != detail::kPeerOk) out.message = detail::peer_fault_message(out.fault, 0);
    out.counts = download<int32_t>(ws.counts, kLocal);
    out.offsets = download<int32_t>(ws.offsets, kLocal + 1);
    out.recv_src = download<int32_t>(recv_src.data(), static_cast<size_t>(rows_cap));
    out.guards_ok = win0.guards_intact() && win1.guards_intact() && ws_mem.guards_intact() && recv_x.guards_intact() &&
                    recv_w.guards_intact() && recv_src.guards_intact() && m_idx.guards_intact() && y.guards_intact();
    cudaFree(windows);
    cudaFreeHost(rec);
}

constexpr int32_t kUnwritten = 0x5a5a5a5a;

TEST(CudaPeerChecks, HonestSendersPassUnchanged) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    Outcome o;
    run_receiver(honest(), true, o);
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_EQ(o.fault.kind, detail::kPeerOk) << o.message;
    EXPECT_EQ(o.counts, (std::vector<int32_t>{2, 2, 0}));
    EXPECT_EQ(o.offsets, (std::vector<int32_t>{0, 2, 4, 4}));
    // l0: sender 0 token 2, sender 1 token 0; l1: sender 1 tokens 0 and 3 (src = s * C + t)
    EXPECT_EQ(std::vector<int32_t>(o.recv_src.begin(), o.recv_src.begin() + 4), (std::vector<int32_t>{2, 4, 4, 7}));
    EXPECT_TRUE(o.guards_ok);
}

struct Forgery {
    const char* name;
    void (*forge)(std::vector<Sent>&);
    int32_t kind;
    int64_t value, limit;
    std::vector<int32_t> counts;  // what the receiver keeps
};

TEST(CudaPeerChecks, ForgedPeerDataIsDroppedAndNamesTheSender) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const std::vector<int32_t> without_sender1 = {1, 0, 0}, all = {2, 2, 0};
    const std::vector<Forgery> cases = {
        {"count above C", [](std::vector<Sent>& s) { s[1].count = 9; }, detail::kPeerCount, 9, kCapacity,
         without_sender1},
        {"huge count", [](std::vector<Sent>& s) { s[1].count = 1000000; }, detail::kPeerCount, 1000000, kCapacity,
         without_sender1},
        {"negative count", [](std::vector<Sent>& s) { s[1].count = -3; }, detail::kPeerCount, -3, kCapacity,
         without_sender1},
        {"expert count above the message count", [](std::vector<Sent>& s) { s[1].expert_counts[1] = 3; },
         detail::kPeerExpertCount, 3, 2, without_sender1},
        {"negative expert count", [](std::vector<Sent>& s) { s[1].expert_counts[2] = -1; }, detail::kPeerExpertCount,
         -1, 2, without_sender1},
        {"route position outside the sender's share", [](std::vector<Sent>& s) { s[1].msgs[1].route_pos[0] = 100; },
         detail::kPeerPosition, 100, 2, all},
        {"negative route position", [](std::vector<Sent>& s) { s[1].msgs[1].route_pos[0] = -5; }, detail::kPeerPosition,
         -5, 2, all},
        {"expert id out of range", [](std::vector<Sent>& s) { s[1].msgs[1].idx[0] = 99; }, detail::kPeerExpertId, 99,
         kExperts, all},
        {"source token beyond C", [](std::vector<Sent>& s) { s[1].msgs[0].src = 1000; }, detail::kPeerToken, 1000,
         kCapacity, all},
    };
    for (const Forgery& f : cases) {
        std::vector<Sent> sent = honest();
        f.forge(sent);
        Outcome o;
        run_receiver(sent, true, o);
        ASSERT_FALSE(HasFatalFailure()) << f.name;
        EXPECT_TRUE(o.guards_ok) << f.name << ": a write outside the outputs or windows";
        EXPECT_EQ(o.fault.kind, f.kind) << f.name << ": " << o.message;
        EXPECT_EQ(o.counts, f.counts) << f.name;
        EXPECT_EQ(o.fault.sender, 1) << f.name;
        EXPECT_EQ(o.fault.value, f.value) << f.name;
        EXPECT_EQ(o.fault.limit, f.limit) << f.name;
        EXPECT_NE(o.message.find("received corrupt data from rank 1"), std::string::npos) << o.message;
        // sender 0's row survives every forgery of sender 1
        EXPECT_EQ(o.recv_src[0], 2) << f.name;
        if (f.kind == detail::kPeerPosition || f.kind == detail::kPeerExpertId) {
            // only the forged route is gone: l1's second row was never written
            EXPECT_EQ(o.recv_src[3], kUnwritten) << f.name;
            EXPECT_EQ(o.recv_src[2], 4) << f.name;
        }
        if (f.kind == detail::kPeerToken) {
            EXPECT_EQ(o.recv_src[1], kUnwritten) << f.name;  // the whole message is gone
            EXPECT_EQ(o.recv_src[3], 7) << f.name;
        }
    }
}

TEST(CudaPeerChecks, ExpertCountsAboveTheRoutesTheMessagesCanCarry) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    // one message carries at most min(K, E_local) = 2 routes to this rank
    std::vector<Sent> sent = honest();
    sent[1].count = 1;
    sent[1].msgs.resize(1);  // routes to local experts 1 and 0
    sent[1].expert_counts[0] = 1;
    sent[1].expert_counts[1] = 1;
    sent[1].expert_counts[2] = 0;
    Outcome fine;
    run_receiver(sent, false, fine);
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_EQ(fine.fault.kind, detail::kPeerOk) << fine.message;
    EXPECT_EQ(fine.counts, (std::vector<int32_t>{2, 1, 0}));
    sent[1].expert_counts[2] = 1;  // each count <= 1 message, but 3 routes > 1 * 2
    Outcome bad;
    run_receiver(sent, false, bad);
    ASSERT_FALSE(HasFatalFailure());
    EXPECT_EQ(bad.fault.kind, detail::kPeerExpertCount) << bad.message;
    EXPECT_EQ(bad.fault.value, 3);
    EXPECT_EQ(bad.fault.limit, 2);
    EXPECT_EQ(bad.counts, (std::vector<int32_t>{1, 0, 0}));
    EXPECT_TRUE(bad.guards_ok);
}

}  // namespace
}  // namespace eptest
