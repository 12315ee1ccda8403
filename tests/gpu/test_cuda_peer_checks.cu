// Peer data checked on receipt by the CUDA kernels (protocol.hpp, "Peer data"; issue 10): a forged
// message count, per-expert count, row position, expert id or source token in a receiver's window is
// dropped and recorded as a peer fault naming the sender, and nothing is written outside the outputs
// or the windows. The test writes rank 0's window by hand, as two senders would have, then runs the
// exchange (wait-only: the flags are already there), expand and partial kernels of the library on it.
// The direct path's tables likewise (below): what three senders published, read by a receiver's
// direct dispatch kernel in both launches that read them. Run compute-sanitizer over it as well (tools/device-check
// sanitize).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/kernel_launch.hpp"
#include "core/protocol.hpp"
#include "gpu_harness.hpp"
#include "kernels/common/buffer_layout.hpp"
#include "kernels/intranode/direct.cuh"

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

// A zeroed HostRecord in host-mapped memory, as the library's kernels report into.
struct MappedRecord {
    HostRecord* host = nullptr;
    HostRecord* dev = nullptr;
    MappedRecord() {
        if (cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(HostRecord), cudaHostAllocMapped) != cudaSuccess ||
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0) != cudaSuccess)
            throw std::runtime_error("cudaHostAlloc (mapped)");
        std::memset(static_cast<void*>(host), 0, sizeof(HostRecord));
    }
    ~MappedRecord() { cudaFreeHost(host); }
};

// The device array of every rank's window that a team addresses.
struct WindowTable {
    uint8_t** dev = nullptr;
    explicit WindowTable(const std::vector<uint8_t*>& windows) {
        const size_t bytes = windows.size() * sizeof(uint8_t*);
        if (cudaMalloc(&dev, bytes) != cudaSuccess ||
            cudaMemcpy(dev, windows.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess)
            throw std::runtime_error("the window table");
    }
    ~WindowTable() { cudaFree(dev); }
};

// A buffer's shape (its message layout from the same sizes); `direct`: the direct path's window.
Shape shape_of(int ranks, int experts, int topk, int hidden, int capacity, bool direct) {
    BufferConfig c;
    c.num_experts = experts;
    c.num_topk = topk;
    c.hidden = hidden;
    c.max_tokens_per_rank = capacity;
    Shape s{};
    s.num_ranks = ranks;
    s.num_experts = experts;
    s.num_local_experts = experts / ranks;
    s.num_topk = topk;
    s.hidden = hidden;
    s.capacity = capacity;
    s.msg = detail::message_layout(c);
    s.direct = direct;
    return s;
}

Shape make_shape() { return shape_of(kRanks, kExperts, kTopk, kHidden, kCapacity, false); }

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
    const WindowTable windows({win0.data(), win1.data()});
    const MappedRecord record;
    HostRecord* rec = record.host;

    auto fill = [&](kernels::CallParams<Team>& p) {
        p.team = Team{transport::NvlinkWindows{0, kRanks, windows.dev, win0.data()}};
        p.shape = sh;
        p.region = region;
        p.ws = ws;
        p.record = record.dev;
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

// ---- the direct path's tables (direct.cuh): the senders' published counts read and checked by a
// receiver, in both launches that read them (kStepPublishMeet's waiting block, which leaves them in ws.direct_tables;
// kStepMove, every block of the host-wait move). The test writes what three senders published into their own windows,
// as their publish would have (counts, DirectOutputs, the plan flags in the receiver's window), and runs the receiver,
// rank 1, with no tokens of its own. Expected tables: a serial reading of the rule (protocol.hpp, "Peer data";
// SEMANTICS order), written here.

constexpr int kDRanks = 3, kDExperts = 6, kDLocal = 2, kDTopk = 1, kDHidden = 64, kDCap = 4, kDRank = 1;
constexpr int kDRows = kDLocal * kDRanks * kDCap;  // the masked slab's rows; more than contiguous needs

Shape direct_shape() { return shape_of(kDRanks, kDExperts, kDTopk, kDHidden, kDCap, true); }

// What each sender published: its route count per global expert (receiver d's local experts at
// [d * E_local, (d + 1) * E_local)) and its route status. The receiver's own row is its plan of no
// tokens: zeros.
struct Published {
    std::vector<std::vector<int32_t>> counts;
    std::vector<int32_t> status;  // RouteStatus::kind
};

Published honest_published() { return {{{1, 0, 2, 1, 0, 1}, {0, 0, 0, 0, 0, 0}, {0, 2, 1, 1, 3, 0}}, {0, 0, 0}}; }

struct DirectTables {
    std::vector<int32_t> base, seg, total, m_of;
    uint64_t dropped = 0;
    int bad_sender = kDRanks;
};

// The rule, one sender at a time: a count outside [0, C], or more than C * min(K, E_local) to one
// receiver, drops the sender; any bad status rejects the call (every total 0); segments are each
// receiver's local experts' totals (contiguous: rounded up to `align`, scanned; masked: R * C rows
// each); base = the kept senders' counts below this rank, plus the segment start.
DirectTables expected_tables(const Published& pub, int align) {
    DirectTables t;
    const int64_t per_receiver = int64_t{kDCap} * std::min(kDTopk, kDLocal);
    for (int s = 0; s < kDRanks; ++s) {
        for (int d = 0; d < kDRanks; ++d) {
            int64_t sum = 0;
            bool each_ok = true;
            for (int l = 0; l < kDLocal; ++l) {
                const int32_t v = pub.counts[static_cast<size_t>(s)][static_cast<size_t>(d * kDLocal + l)];
                each_ok = each_ok && v >= 0 && v <= kDCap;
                sum += v;
            }
            if (!each_ok || sum > per_receiver) t.dropped |= 1ull << s;
        }
        if (pub.status[static_cast<size_t>(s)] != 0 && t.bad_sender == kDRanks) t.bad_sender = s;
    }
    const bool rejected = t.bad_sender < kDRanks;
    t.total.assign(kDExperts, 0);
    t.base.assign(kDExperts, 0);
    for (int s = 0; s < kDRanks && !rejected; ++s) {
        if ((t.dropped >> s) & 1ull) continue;
        for (int e = 0; e < kDExperts; ++e) {
            t.total[static_cast<size_t>(e)] += pub.counts[static_cast<size_t>(s)][static_cast<size_t>(e)];
            if (s < kDRank)
                t.base[static_cast<size_t>(e)] += pub.counts[static_cast<size_t>(s)][static_cast<size_t>(e)];
        }
    }
    t.seg.assign(kDExperts, 0);
    for (int d = 0; d < kDRanks; ++d) {
        int32_t at = 0;
        for (int l = 0; l < kDLocal; ++l) {
            const size_t e = static_cast<size_t>(d * kDLocal + l);
            t.seg[e] = align > 0 ? at : l * kDRanks * kDCap;
            at += align > 0 ? (t.total[e] + align - 1) / align * align : 0;
        }
        t.m_of.push_back(align > 0 ? at : kDLocal * kDRanks * kDCap);
    }
    for (int e = 0; e < kDExperts; ++e) t.base[static_cast<size_t>(e)] += t.seg[static_cast<size_t>(e)];
    return t;
}

struct DirectRun {
    int align = 0;              // 0: masked layout; else contiguous with this alignment (host sync)
    bool publish_meet = false;  // kStepPublishMeet (the waiting block); else kStepMove
    bool late_flag = false;     // sender 2's plan flag written after the launch (publish_meet only)
};

struct DirectOutcome {
    detail::PeerFault fault{};
    std::string message;
    std::vector<int32_t> tables;  // ws.direct_tables (publish_meet)
    std::vector<int32_t> counts, offsets, recv_src;
    int64_t num_rows = 0;
    int32_t bad_sender = 0;
    bool guards_ok = false;
};

void run_direct_receiver(const Published& pub, const DirectRun& run, DirectOutcome& out) {
    const Shape sh = direct_shape();
    const RegionLayout region = RegionLayout::make(sh);
    const int64_t ws_bytes = Workspace::carve(sh, nullptr).bytes;
    constexpr int kParity = 1;  // epoch 1
    std::vector<std::unique_ptr<GuardedDev>> win;
    for (int q = 0; q < kDRanks; ++q) win.push_back(std::make_unique<GuardedDev>(static_cast<size_t>(region.bytes)));
    GuardedDev ws_mem(static_cast<size_t>(ws_bytes));
    GuardedDev recv_x(static_cast<size_t>(kDRows * kDHidden * 2)), recv_w(static_cast<size_t>(kDRows * 4)),
        recv_src(static_cast<size_t>(kDRows * 4)), m_idx(static_cast<size_t>(kDRows * 4));
    for (int q = 0; q < kDRanks; ++q) {
        std::vector<uint8_t> w(static_cast<size_t>(region.bytes), 0);
        const bool own = q == kDRank;
        if (!own || !run.publish_meet) {  // what q's publish left in its own window
            kernels::DirectOutputs o{};
            o.recv_x = recv_x.data();
            o.recv_weights = reinterpret_cast<float*>(recv_w.data());
            o.recv_src = reinterpret_cast<int32_t*>(recv_src.data());
            o.m_indices = reinterpret_cast<int32_t*>(m_idx.data());
            o.status.kind = pub.status[static_cast<size_t>(q)];
            std::memcpy(w.data() + region.published_outputs(kParity), &o, sizeof(o));
            std::memcpy(w.data() + region.published_count_row(kParity), pub.counts[static_cast<size_t>(q)].data(),
                        kDExperts * 4);
        }
        if (own)  // every sender's plan flag in the receiver's window (its own: kStepMove only)
            for (int s = 0; s < kDRanks; ++s) {
                if ((s == kDRank && run.publish_meet) || (s == 2 && run.late_flag)) continue;
                const uint64_t epoch = 1;
                std::memcpy(w.data() + region.plan_flag(s), &epoch, 8);
            }
        CUDA_EXPECT(cudaMemcpy(win[static_cast<size_t>(q)]->data(), w.data(), w.size(), cudaMemcpyHostToDevice));
    }
    CUDA_EXPECT(cudaMemset(ws_mem.data(), 0, static_cast<size_t>(ws_bytes)));
    const Workspace ws = Workspace::carve(sh, ws_mem.data());
    std::vector<uint8_t*> host_windows;
    for (const auto& w : win) host_windows.push_back(w->data());
    const WindowTable windows(host_windows);
    const MappedRecord record;
    HostRecord* rec = record.host;
    uint64_t* late = nullptr;  // pinned: the late flag's value, copied while the kernel waits
    CUDA_EXPECT(cudaHostAlloc(reinterpret_cast<void**>(&late), sizeof(uint64_t), cudaHostAllocDefault));
    *late = 1;
    cudaStream_t kernel_stream = nullptr, copy_stream = nullptr;
    CUDA_EXPECT(cudaStreamCreateWithFlags(&kernel_stream, cudaStreamNonBlocking));
    CUDA_EXPECT(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));

    DispatchParams p{};
    p.team = Team{transport::NvlinkWindows{kDRank, kDRanks, windows.dev, host_windows[kDRank]}};
    p.shape = sh;
    p.region = region;
    p.ws = ws;
    p.record = record.dev;
    p.timeout_ns = 2000000000ull;
    p.sync_mode = kernels::kDevice;
    p.num_tokens = 0;
    p.step = run.publish_meet ? kernels::kStepPublishMeet : kernels::kStepMove;
    p.host_sync = run.align > 0;
    p.expert_alignment = run.align;
    p.num_rows_out = kDRows;
    p.recv_x = recv_x.data();
    p.recv_weights = reinterpret_cast<float*>(recv_w.data());
    p.recv_src = reinterpret_cast<int32_t*>(recv_src.data());
    p.m_indices = reinterpret_cast<int32_t*>(m_idx.data());
    const DispatchModes modes{kernels::SendPayload::kBF16, false, run.align > 0};
    CUDA_EXPECT(cudaDeviceSynchronize());  // the windows' and workspace's fills (legacy stream) have landed
    detail::cuda::launch_direct_dispatch(p, modes, 2, false, kernel_stream);
    if (run.late_flag) {  // sender 2's flag after the waiting block has had time to read the others
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        CUDA_EXPECT(
            cudaMemcpyAsync(host_windows[kDRank] + region.plan_flag(2), late, 8, cudaMemcpyHostToDevice, copy_stream));
        CUDA_EXPECT(cudaStreamSynchronize(copy_stream));
    }
    CUDA_EXPECT(cudaStreamSynchronize(kernel_stream));

    out.fault = rec->peer_fault;
    if (out.fault.kind != detail::kPeerOk) out.message = detail::peer_fault_message(out.fault, kDRank);
    if (run.publish_meet) out.tables = download<int32_t>(ws.direct_tables, 3 * kDExperts + kDRanks + 3);
    out.counts = download<int32_t>(ws.counts, kDLocal);
    out.offsets = download<int32_t>(ws.offsets, kDLocal + 1);
    out.recv_src = download<int32_t>(recv_src.data(), kDRows);
    out.num_rows = rec->num_rows;
    out.bad_sender = rec->bad_sender;
    out.guards_ok = ws_mem.guards_intact() && recv_x.guards_intact() && recv_w.guards_intact() &&
                    recv_src.guards_intact() && m_idx.guards_intact();
    for (const auto& w : win) out.guards_ok = out.guards_ok && w->guards_intact();
    cudaStreamDestroy(kernel_stream);
    cudaStreamDestroy(copy_stream);
    cudaFreeHost(late);
}

// Checks one run against the rule's tables `t`: the waiting block's tables in the workspace, or the
// move's receiver summary and its own padding rows (the rows no sender fills: source -1).
void expect_direct(const DirectRun& run, const DirectTables& t, const DirectOutcome& o, const std::string& what) {
    EXPECT_TRUE(o.guards_ok) << what << ": a write outside the outputs, windows or workspace";
    const bool rejected = t.bad_sender < kDRanks;
    if (run.publish_meet) {
        ASSERT_EQ(o.tables.size(), static_cast<size_t>(3 * kDExperts + kDRanks + 3)) << what;
        auto part = [&](int at, int n) {
            return std::vector<int32_t>(o.tables.begin() + at, o.tables.begin() + at + n);
        };
        EXPECT_EQ(part(0, kDExperts), t.base) << what << ": base";
        EXPECT_EQ(part(kDExperts, kDExperts), t.seg) << what << ": seg";
        EXPECT_EQ(part(2 * kDExperts, kDExperts), t.total) << what << ": total";
        EXPECT_EQ(part(3 * kDExperts, kDRanks), t.m_of) << what << ": m_of";
        const uint64_t dropped = static_cast<uint32_t>(o.tables[3 * kDExperts + kDRanks]) |
                                 (uint64_t{static_cast<uint32_t>(o.tables[3 * kDExperts + kDRanks + 1])} << 32);
        EXPECT_EQ(dropped, t.dropped) << what << ": dropped senders";
        EXPECT_EQ(o.tables[3 * kDExperts + kDRanks + 2], t.bad_sender) << what << ": first bad sender";
        return;
    }
    const int32_t m_rows = run.align > 0 ? t.m_of[kDRank] : 0;
    std::vector<int32_t> counts, offsets;
    for (int l = 0; l < kDLocal; ++l) {
        counts.push_back(t.total[static_cast<size_t>(kDRank * kDLocal + l)]);
        offsets.push_back(run.align > 0 ? t.seg[static_cast<size_t>(kDRank * kDLocal + l)] : 0);
    }
    offsets.push_back(m_rows);
    EXPECT_EQ(o.counts, counts) << what << ": counts";
    EXPECT_EQ(o.offsets, offsets) << what << ": offsets";
    EXPECT_EQ(o.num_rows, m_rows) << what << ": M";
    EXPECT_EQ(o.bad_sender, rejected ? t.bad_sender : -1) << what << ": the host summary's bad sender";
    for (int r = 0; r < kDRows; ++r) {
        bool pad = false;
        if (!rejected && run.align > 0 && r < m_rows) {
            int l = 0;
            while (l + 1 < kDLocal && t.seg[static_cast<size_t>(kDRank * kDLocal + l + 1)] <= r) ++l;
            pad = r - t.seg[static_cast<size_t>(kDRank * kDLocal + l)] >= counts[static_cast<size_t>(l)];
        } else if (!rejected && run.align == 0) {
            pad = r % (kDRanks * kDCap) >= counts[static_cast<size_t>(r / (kDRanks * kDCap))];
        }
        EXPECT_EQ(o.recv_src[static_cast<size_t>(r)], pad ? -1 : kUnwritten) << what << ": row " << r;
    }
}

std::vector<DirectRun> direct_runs() {
    std::vector<DirectRun> runs;
    for (int align : {0, 2})
        for (bool meet : {false, true}) runs.push_back({align, meet, false});
    return runs;
}

std::string direct_name(const DirectRun& r) {
    return std::string(r.align ? "contiguous" : "masked") + (r.publish_meet ? " publish-meet" : " move") +
           (r.late_flag ? " late flag" : "");
}

TEST(CudaPeerChecks, DirectTablesOfHonestSenders) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    const Published pub = honest_published();
    for (const DirectRun& run : direct_runs()) {
        DirectOutcome o;
        run_direct_receiver(pub, run, o);
        ASSERT_FALSE(HasFatalFailure()) << direct_name(run);
        EXPECT_EQ(o.fault.kind, detail::kPeerOk) << direct_name(run) << ": " << o.message;
        const DirectTables t = expected_tables(pub, run.align);
        EXPECT_EQ(t.dropped, 0u);
        expect_direct(run, t, o, direct_name(run));
    }
}

struct DirectForgery {
    const char* name;
    void (*forge)(Published&);
    int sender;  // the one named (-1: no peer fault; a bad status rejects the call instead)
    int64_t value, limit;
};

TEST(CudaPeerChecks, DirectTablesDropForgedSendersAndNameThem) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    // C = 4; C * min(K, E_local) = 4 routes to one receiver
    const std::vector<DirectForgery> cases = {
        {"count above C", [](Published& p) { p.counts[2][4] = 5; }, 2, 5, kDCap},
        {"negative count below this rank", [](Published& p) { p.counts[0][1] = -1; }, 0, -1, kDCap},
        {"more routes to a receiver than C * min(K, E_local)",
         [](Published& p) {
             p.counts[2][2] = 3;
             p.counts[2][3] = 2;
         },
         2, 5, 4},
        {"a bad route status", [](Published& p) { p.status[2] = detail::kRouteOutOfRange; }, -1, 0, 0},
    };
    for (const DirectForgery& f : cases) {
        Published pub = honest_published();
        f.forge(pub);
        const std::vector<DirectRun> runs = direct_runs();
        for (const DirectRun& run : runs) {
            const std::string what = std::string(f.name) + ", " + direct_name(run);
            DirectOutcome o;
            run_direct_receiver(pub, run, o);
            ASSERT_FALSE(HasFatalFailure()) << what;
            const DirectTables t = expected_tables(pub, run.align);
            if (f.sender >= 0) {
                EXPECT_EQ(t.dropped, 1ull << f.sender) << what;
                EXPECT_EQ(o.fault.kind, detail::kPeerExpertCount) << what << ": " << o.message;
                EXPECT_EQ(o.fault.sender, f.sender) << what;
                EXPECT_EQ(o.fault.value, f.value) << what;
                EXPECT_EQ(o.fault.limit, f.limit) << what;
                EXPECT_NE(o.message.find("received corrupt data from rank " + std::to_string(f.sender)),
                          std::string::npos)
                    << o.message;
            } else {
                EXPECT_EQ(o.fault.kind, detail::kPeerOk) << what << ": " << o.message;
                EXPECT_EQ(t.bad_sender, 2) << what;
            }
            expect_direct(run, t, o, what);
        }
    }
}

// Two senders forged at once: both dropped everywhere alike; the record names one of them (the
// first to claim it).
TEST(CudaPeerChecks, DirectTablesDropEveryForgedSender) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    Published pub = honest_published();
    pub.counts[0][0] = 9;
    pub.counts[2][5] = -7;
    for (const DirectRun& run : direct_runs()) {
        DirectOutcome o;
        run_direct_receiver(pub, run, o);
        ASSERT_FALSE(HasFatalFailure()) << direct_name(run);
        const DirectTables t = expected_tables(pub, run.align);
        EXPECT_EQ(t.dropped, 0b101u);
        EXPECT_EQ(o.fault.kind, detail::kPeerExpertCount) << direct_name(run) << ": " << o.message;
        EXPECT_TRUE(o.fault.sender == 0 || o.fault.sender == 2) << direct_name(run) << ": " << o.message;
        expect_direct(run, t, o, direct_name(run));
    }
}

// The waiting block reads senders as their flags arrive: sender 2's comes about 5 ms
// after the launch, once the others have been read (a copy on another stream while the kernel
// waits; not under compute-sanitizer, which runs one kernel or copy at a time). Same tables.
TEST(CudaDirectTables, TablesWithALateSender) {
    ELASTICEP_SKIP_WITHOUT_GPU();
    for (bool forged : {false, true}) {
        Published pub = honest_published();
        if (forged) pub.counts[2][4] = 5;
        for (int align : {0, 2}) {
            const DirectRun run{align, true, true};
            const std::string what = direct_name(run) + (forged ? ", sender 2 forged" : "");
            DirectOutcome o;
            run_direct_receiver(pub, run, o);
            ASSERT_FALSE(HasFatalFailure()) << what;
            EXPECT_EQ(o.fault.kind, forged ? detail::kPeerExpertCount : detail::kPeerOk) << what << ": " << o.message;
            expect_direct(run, expected_tables(pub, align), o, what);
        }
    }
}

}  // namespace
}  // namespace eptest
