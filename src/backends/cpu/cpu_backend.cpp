// CPU reference backend: ranks are threads of one process, or processes of one host, sharing a
// host arena.
//
// The protocol (flags, epochs, route status, slot reuse, error texts) is src/core/protocol.hpp; this
// file is how its bytes move on a host: memcpy into an arena every rank maps, flags as atomics.
//   dispatch: disp_slots[d][s][j] messages, disp_flag[d][s][n % 2] = {count, status, epoch last};
//   combine:  comb_slots[s][d][t] partials, comb_flag[s][d] = n;
//   slot reuse: recv_done[d] = the last epoch whose messages d has read (protocol.hpp, "Slot reuse").
//
// Nothing a peer wrote is trusted as a bound: the receiver checks every count, expert id and source
// token against the config before it uses one to address memory (`check_messages`). A message that
// breaks the protocol is dropped and reported naming its sender (an error with host sync, a sticky
// fault in graph mode), never followed into a write outside the layout.
//
// Buffer-owned outputs are allocated before any communication and never moved or freed while the
// buffer lives (`OutputStore`), so every view handed out stays valid memory.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "core/backend.hpp"
#include "core/check.hpp"
#include "core/layout.hpp"
#include "core/numerics.hpp"
#include "core/outputs.hpp"
#include "core/protocol.hpp"
#include "core/quantize.hpp"
#include "core/routing.hpp"
#include "core/testing.hpp"
#include "transport/scaleout/emulation.hpp"

namespace elasticep::detail {
namespace {

struct DispatchFlag {
    std::atomic<uint64_t> epoch{0};
    int64_t count = 0;
    RouteStatus status{};  // the sender's published route status (protocol.hpp); plain ints, so any bytes a
                           // peer left there are a valid value
};

// The arena lives in one shared mapping: anonymous memory when every rank is a thread of this
// process, a file mapping (in /dev/shm, or $TMPDIR when /dev/shm is too small) when the ranks are
// processes on one host. Everything inside is plain data and lock-free atomics, valid across both.
//
// Hybrid topology (nodes of P ranks, N = R / P nodes) adds the emulated network's regions, written
// only through EmulatedNetwork (puts, then a release signal):
//   rail_flags[f][p][n % 2]  a DispatchFlag from the rail sender of node p to its rail peer f
//   rail_done[f]             the last epoch whose rail messages f has forwarded
//   rail_slots[f][p][j]      rail messages (the direct message format) from node p's sender to f
//   np_flags[s][q]           node q's combine epoch at origin s
//   np_slots[s][q][t][H]     node q's bf16 node partial of origin s's token t
// and reuses the direct regions inside a node: disp_slots/disp_flag[d][s] are written by d's
// forwarder for sender s; comb_slots[f][p * P + i][t] holds the partial that rank i of f's node made
// for token t of origin p * P + f % P, and comb_flag[f][d] is holder d's signal to forwarder f.
struct ArenaShape {
    int num_ranks, capacity, hidden;
    MessageLayout msg;
    int nodes;  // 0: direct topology (no network regions)

    // The pieces, in order; every size computed wide (thousands of ranks overflow size_t long before
    // mmap could refuse).
    using Wide = unsigned __int128;
    struct Pieces {
        Wide disp_flags, comb_flags, recv_done, rail_flags, rail_done, np_flags, flags_end;
        Wide disp, comb, rail, np, total;
    };
    Pieces pieces() const {
        const Wide r = static_cast<Wide>(num_ranks), n = static_cast<Wide>(nodes);
        const Wide c = static_cast<Wide>(capacity), h = static_cast<Wide>(hidden), m = static_cast<Wide>(msg.bytes);
        Pieces p{};
        p.disp_flags = 0;
        p.comb_flags = p.disp_flags + r * r * 2 * sizeof(DispatchFlag);
        p.recv_done = p.comb_flags + r * r * sizeof(uint64_t);
        p.rail_flags = p.recv_done + r * sizeof(uint64_t);
        p.rail_done = p.rail_flags + r * n * 2 * sizeof(DispatchFlag);
        p.np_flags = p.rail_done + (n > 0 ? r : 0) * sizeof(uint64_t);
        p.flags_end = (p.np_flags + r * n * sizeof(uint64_t) + 4095) / 4096 * 4096;
        p.disp = p.flags_end;
        p.comb = p.disp + r * r * c * m;
        p.rail = p.comb + r * r * c * h * 2;
        p.np = p.rail + r * n * c * m;
        p.total = p.np + r * n * c * h * 2;
        return p;
    }
};

struct Arena {
    explicit Arena(const ArenaShape& s)
        : num_ranks(s.num_ranks), capacity(s.capacity), hidden(s.hidden), nodes(s.nodes), msg(s.msg), shape(s) {}
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    ~Arena() {
        if (base != nullptr) ::munmap(base, bytes);
    }

    const int num_ranks, capacity, hidden, nodes;
    const MessageLayout msg;
    const ArenaShape shape;
    void* base = nullptr;
    size_t bytes = 0;
    DispatchFlag* disp_flags = nullptr;           // [receiver][sender][parity]
    std::atomic<uint64_t>* comb_flags = nullptr;  // [origin][holder]
    std::atomic<uint64_t>* recv_done = nullptr;   // [receiver]: last epoch whose messages it has read
    DispatchFlag* rail_flags = nullptr;           // [forwarder][source node][parity]
    std::atomic<uint64_t>* rail_done = nullptr;   // [forwarder]
    std::atomic<uint64_t>* np_flags = nullptr;    // [origin][node]
    uint8_t* disp_base = nullptr;                 // [receiver][sender * C + j] messages
    uint16_t* comb_base = nullptr;                // [origin][holder * C + t][H] bf16 partials
    uint8_t* rail_base = nullptr;                 // [forwarder][node * C + j] messages
    uint16_t* np_base = nullptr;                  // [origin][node * C + t][H] bf16 node partials

    size_t slots() const { return static_cast<size_t>(num_ranks) * static_cast<size_t>(capacity); }
    size_t total_bytes() const { return static_cast<size_t>(shape.pieces().total); }
    // Points the fields into a mapping of total_bytes(); `init` constructs the flags (creator only).
    void attach(void* mapping, bool init) {
        base = mapping;
        bytes = total_bytes();
        const ArenaShape::Pieces pc = shape.pieces();
        auto* p = static_cast<uint8_t*>(mapping);
        auto at = [&](ArenaShape::Wide off) { return p + static_cast<size_t>(off); };
        disp_flags = reinterpret_cast<DispatchFlag*>(at(pc.disp_flags));
        comb_flags = reinterpret_cast<std::atomic<uint64_t>*>(at(pc.comb_flags));
        recv_done = reinterpret_cast<std::atomic<uint64_t>*>(at(pc.recv_done));
        rail_flags = reinterpret_cast<DispatchFlag*>(at(pc.rail_flags));
        rail_done = reinterpret_cast<std::atomic<uint64_t>*>(at(pc.rail_done));
        np_flags = reinterpret_cast<std::atomic<uint64_t>*>(at(pc.np_flags));
        if (init) {
            const size_t r = static_cast<size_t>(num_ranks), n = static_cast<size_t>(nodes);
            for (size_t i = 0; i < r * r * 2; ++i) new (&disp_flags[i]) DispatchFlag();
            for (size_t i = 0; i < r * r + r; ++i) new (&comb_flags[i]) std::atomic<uint64_t>(0);  // + recv_done
            for (size_t i = 0; i < r * n * 2; ++i) new (&rail_flags[i]) DispatchFlag();
            for (size_t i = 0; i < (n > 0 ? r : 0) + r * n; ++i) new (&rail_done[i]) std::atomic<uint64_t>(0);  // + np
        }
        disp_base = at(pc.disp);
        comb_base = reinterpret_cast<uint16_t*>(at(pc.comb));
        rail_base = at(pc.rail);
        np_base = reinterpret_cast<uint16_t*>(at(pc.np));
    }

    uint8_t* slot(int d, int s, int64_t j) {
        return disp_base +
               ((static_cast<size_t>(d) * num_ranks + static_cast<size_t>(s)) * capacity + static_cast<size_t>(j)) *
                   static_cast<size_t>(msg.bytes);
    }
    uint16_t* comb(int origin) {
        return comb_base + static_cast<size_t>(origin) * slots() * static_cast<size_t>(hidden);
    }
    DispatchFlag& dflag(int d, int s, uint64_t epoch) {
        return disp_flags[(static_cast<size_t>(d) * num_ranks + static_cast<size_t>(s)) * 2 + (epoch & 1)];
    }
    std::atomic<uint64_t>& cflag(int s, int d) {
        return comb_flags[static_cast<size_t>(s) * num_ranks + static_cast<size_t>(d)];
    }
    // hybrid
    uint8_t* rail_slot(int f, int p, int64_t j) {
        return rail_base +
               ((static_cast<size_t>(f) * nodes + static_cast<size_t>(p)) * capacity + static_cast<size_t>(j)) *
                   static_cast<size_t>(msg.bytes);
    }
    DispatchFlag& rflag(int f, int p, uint64_t epoch) {
        return rail_flags[(static_cast<size_t>(f) * nodes + static_cast<size_t>(p)) * 2 + (epoch & 1)];
    }
    uint16_t* node_partial(int s, int q, int64_t t) {
        return np_base +
               ((static_cast<size_t>(s) * nodes + static_cast<size_t>(q)) * capacity + static_cast<size_t>(t)) *
                   static_cast<size_t>(hidden);
    }
    std::atomic<uint64_t>& npflag(int s, int q) {
        return np_flags[static_cast<size_t>(s) * nodes + static_cast<size_t>(q)];
    }
};

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the arena's flags must be lock-free to work across processes");

// Out of memory is the caller's capacity, not a bug: the fix is a smaller reservation.
void* checked_map(void* p, const std::string& what) {
    if (p != MAP_FAILED) return p;
    const int err = errno;
    ELASTICEP_CHECK(err != ENOMEM && err != ENOSPC, ErrorCode::kCapacityExceeded, "CPU backend: ", what, " failed (",
                    std::strerror(err),
                    "): not enough memory for this reservation; lower "
                    "max_tokens_per_rank (or hidden, or the number of ranks)");
    raise(ErrorCode::kInternal, cat("CPU backend: ", what, " failed: ", std::strerror(err)));
}

size_t host_memory_bytes() {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : SIZE_MAX;
}

// Anonymous memory, zero-filled lazily by the kernel, unmapped when the block dies.
class Block {
 public:
    Block(size_t bytes, const std::string& what) : bytes_(std::max<size_t>(bytes, 64)) {
        ELASTICEP_CHECK(bytes_ <= host_memory_bytes(), ErrorCode::kCapacityExceeded, "CPU backend: ", what, " needs ",
                        bytes_, " bytes, more than this host's ", host_memory_bytes(),
                        " bytes of memory; lower max_tokens_per_rank (or pass caller-provided outputs)");
        data_ = checked_map(::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0),
                            cat(what, " (mmap of ", bytes_, " bytes)"));
    }
    ~Block() { ::munmap(data_, bytes_); }
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;
    void* data() const { return data_; }
    size_t bytes() const { return bytes_; }

 private:
    size_t bytes_;
    void* data_ = nullptr;
};

// Buffer-owned output storage, one slot per (output, layout). A slot only grows (a larger
// expert_alignment needs more contiguous rows): the grown slot gets a new block and the old block
// stays mapped until the buffer dies, so a view handed out by an earlier call never dangles.
class OutputStore {
 public:
    void* get(int slot, size_t bytes, const char* what) {
        Block*& cur = current_[slot];
        if (cur == nullptr || cur->bytes() < bytes) {
            blocks_.push_back(std::make_unique<Block>(bytes, cat("the buffer-owned ", what)));
            cur = blocks_.back().get();
        }
        return cur->data();
    }

 private:
    std::vector<std::unique_ptr<Block>> blocks_;
    std::map<int, Block*> current_;
};

// A file every process maps; /dev/shm when it has room (containers often give it only 64 MiB).
std::string arena_path(const std::string& tag, size_t bytes) {
    struct statvfs st {};
    if (::statvfs("/dev/shm", &st) == 0 && static_cast<size_t>(st.f_bavail) * st.f_frsize > bytes + (size_t{64} << 20))
        return "/dev/shm/elasticep-" + tag;
    const char* tmp = std::getenv("TMPDIR");
    return std::string(tmp && *tmp ? tmp : "/tmp") + "/elasticep-" + tag;
}

// Arenas under construction, keyed by an id rank 0 broadcasts; ranks take a reference, then
// rank 0 drops the entry after a barrier.
std::mutex g_arena_mu;
std::map<uint64_t, std::shared_ptr<Arena>> g_arenas;
std::atomic<uint64_t> g_next_arena{1};

struct CpuHandleData {
    uint64_t epoch = 0;
    RoutePlan plan;  // this rank's own tokens (origin side of combine)
    // receiver side: one entry per received token, in (sender, slot) order
    struct Msg {
        int32_t src_rank, src_token, route_begin, route_end;
    };
    std::vector<Msg> msgs;
    std::vector<int64_t> route_rows;  // row in y of each route, k ascending within a message
    std::vector<float> route_weights;
    // hybrid, forwarder side: every token this rank forwarded (source node, token, its destination
    // ranks in this node in first-k order), source nodes ascending, t ascending within each
    struct Forwarded {
        int32_t src_node, src_token, dests_begin, dests_end;
    };
    std::vector<Forwarded> forwarded;
    std::vector<int32_t> fwd_dests;
};

// Where this call's dispatch outputs live: the caller's tensors or buffer-owned storage, known
// before any communication.
struct OutputPtrs {
    void* recv_x = nullptr;
    void* recv_scales = nullptr;
    void* recv_weights = nullptr;
    void* recv_src = nullptr;
    void* m_indices = nullptr;
};

// The arena's size, or CapacityExceeded when it cannot exist on this host. Computed wide: with
// thousands of ranks R * R * C * message bytes is past size_t long before mmap could refuse it.
size_t checked_arena_bytes(const BufferConfig& c, int num_ranks, const ArenaShape& shape) {
    using Wide = ArenaShape::Wide;
    const Wide total = shape.pieces().total;
    const size_t host = host_memory_bytes();
    if (total > static_cast<Wide>(host)) {
        const long double gib = static_cast<long double>(total) / (1 << 30);
        raise(
            ErrorCode::kCapacityExceeded,
            cat("CPU backend: the shared arena for ", num_ranks, " ranks x max_tokens_per_rank=", c.max_tokens_per_rank,
                " x hidden=", c.hidden, " needs ", static_cast<double>(gib), " GiB, more than this host's ", host >> 20,
                " MiB of memory; lower max_tokens_per_rank (or hidden, or the number of ranks)"));
    }
    return static_cast<size_t>(total);
}

class CpuBackend final : public BackendBuffer {
 public:
    explicit CpuBackend(const BackendContext& ctx)
        : cfg_(ctx.config),
          rank_(ctx.rank),
          num_ranks_(ctx.num_ranks),
          e_local_(cfg_.num_experts / ctx.num_ranks),
          node_size_(cfg_.node_size(ctx.num_ranks)),
          nodes_(ctx.num_ranks / node_size_),
          node_(rank_ / node_size_),
          local_(rank_ % node_size_),
          hybrid_(cfg_.topology == Topology::kHybrid),
          hierarchical_(nodes_ > 1),
          net_(hybrid_ ? transport::scaleout::EmulationKnobs::from_env() : transport::scaleout::EmulationKnobs{}),
          load_(static_cast<size_t>(e_local_), 0) {
        ELASTICEP_CHECK(!hybrid_ || cfg_.scaleout == ScaleOut::kAuto || cfg_.scaleout == ScaleOut::kEmulated,
                        ErrorCode::kUnsupported, "the CPU backend's scale-out is emulated (host copies): scaleout=",
                        scaleout_name(cfg_.scaleout),
                        " needs the CUDA backend; use scaleout=emulated (or auto) with backend=cpu");
        for (int r = 0; r < num_ranks_; ++r) {
            all_ranks_.push_back(r);
            if (r / node_size_ == node_) node_ranks_.push_back(r);
            if (r % node_size_ == local_) rail_ranks_.push_back(r);
        }
        auto arena = std::make_shared<Arena>(
            ArenaShape{num_ranks_, cfg_.max_tokens_per_rank, cfg_.hidden, message_layout(cfg_), hybrid_ ? nodes_ : 0});
        const int64_t pid = ::getpid();
        const auto pids = ctx.group->all_gather_value(pid);
        const bool one_process = std::all_of(pids.begin(), pids.end(), [&](int64_t p) { return p == pid; });
        // Rank 0 creates the arena: threads share its object through g_arenas, processes map its file.
        // When it cannot, every rank raises rank 0's code and reason.
        struct Hello {
            uint64_t arena_id;
            int32_t code;
            char path[200];
            char failure[400];
        };
        Hello me{};
        std::string failure;
        ErrorCode failure_code = ErrorCode::kInternal;
        if (rank_ == 0) {
            try {
                const size_t bytes = checked_arena_bytes(cfg_, num_ranks_, arena->shape);
                ELASTICEP_INTERNAL(bytes >= arena->total_bytes(), "arena size");
                if (one_process) {
                    arena->attach(checked_map(::mmap(nullptr, arena->total_bytes(), PROT_READ | PROT_WRITE,
                                                     MAP_SHARED | MAP_ANONYMOUS, -1, 0),
                                              cat("mmap of ", arena->total_bytes(), " bytes for the shared arena")),
                                  true);
                    me.arena_id = g_next_arena.fetch_add(1);
                    std::lock_guard<std::mutex> lock(g_arena_mu);
                    g_arenas[me.arena_id] = arena;
                } else {
                    const size_t n = arena->total_bytes();
                    const std::string path = arena_path(cat(pid, "-", g_next_arena.fetch_add(1)), n);
                    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
                    ELASTICEP_CHECK(fd >= 0, ErrorCode::kInternal, "CPU backend: cannot create ", path, ": ",
                                    std::strerror(errno));
                    // Reserve the file's blocks now: a sparse file on a full disk would fault (SIGBUS) on first touch.
                    const int fa = ::posix_fallocate(fd, 0, static_cast<off_t>(n));
                    void* p = fa == 0 ? ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
                    if (fa != 0) errno = fa;
                    ::close(fd);
                    if (p == MAP_FAILED) ::unlink(path.c_str());
                    arena->attach(checked_map(p, cat("mapping ", n, " bytes of ", path)), true);
                    std::snprintf(me.path, sizeof(me.path), "%s", path.c_str());
                }
            } catch (const Error& e) {
                failure = e.message();
                failure_code = e.code();
                me.code = static_cast<int32_t>(e.code());
                std::snprintf(me.failure, sizeof(me.failure), "%s", e.message().c_str());
            }
        }
        const Hello root = ctx.group->all_gather_value(me)[0];
        if (rank_ == 0) {
            if (failure.empty()) arena_ = arena;
        } else if (root.path[0] != '\0') {
            const int fd = ::open(root.path, O_RDWR);
            void* p =
                fd >= 0 ? ::mmap(nullptr, arena->total_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
            if (fd >= 0) ::close(fd);
            if (p == MAP_FAILED) {
                failure = cat("CPU backend: cannot map the arena file ", root.path, ": ", std::strerror(errno));
            } else {
                arena->attach(p, false);
                arena_ = arena;
            }
        } else if (root.arena_id != 0) {
            std::lock_guard<std::mutex> lock(g_arena_mu);
            arena_ = g_arenas.at(root.arena_id);
        } else {
            failure_code = static_cast<ErrorCode>(root.code);
            failure = cat("CPU backend: rank 0 could not create the shared arena: ",
                          std::string(root.failure, strnlen(root.failure, sizeof(root.failure))));
        }
        ctx.group->barrier();  // every rank holds the arena now: drop the rendezvous entries
        if (rank_ == 0 && root.path[0] != '\0') ::unlink(root.path);
        if (rank_ == 0 && root.arena_id != 0) {
            std::lock_guard<std::mutex> lock(g_arena_mu);
            g_arenas.erase(root.arena_id);
        }
        if (arena_ == nullptr && failure.empty()) failure = "CPU backend: rank 0 could not create the shared arena";
        ELASTICEP_CHECK(failure.empty(), failure_code, failure);
        // The combine output and the count/offset metadata have fixed sizes: allocated once, here.
        out_block_ =
            std::make_unique<Block>(static_cast<size_t>(cfg_.max_tokens_per_rank) * cfg_.hidden * 2, "combine output");
        meta_block_ = std::make_unique<Block>(static_cast<size_t>(2 * e_local_ + 1) * 4, "dispatch counts");
    }

    Device device() const override { return Device{}; }

    size_t reserved_bytes() const override { return cpu_reservation_bytes(cfg_, num_ranks_); }

    std::vector<int64_t> expert_load() override { return load_; }
    std::string scaleout() const override { return hybrid_ && nodes_ > 1 ? "emulated" : "none"; }
    void reset_expert_load() override { std::fill(load_.begin(), load_.end(), 0); }

    void check() override {
        if (!peer_fault_.empty()) {
            const std::string f = peer_fault_;
            peer_fault_.clear();
            raise(ErrorCode::kInternal, "fault from an earlier graph-mode dispatch: " + f);
        }
        if (fault_.any()) {
            const BadRoute f = fault_;
            fault_ = BadRoute{};
            raise(ErrorCode::kInvalidArgument, sticky_fault_message(f, rank_, cfg_.num_experts));
        }
    }

    void set_dispatch_forger(testing::DispatchForger forger) override { forger_ = std::move(forger); }

    void dispatch(const DispatchRequest& req, HandleState& handle, DispatchResult& result) override {
        const DispatchArgs& a = *req.args;
        if (!peer_fault_.empty()) {  // a graph-mode call received malformed data: report it before going on
            const std::string f = peer_fault_;
            peer_fault_.clear();
            raise(ErrorCode::kInternal, "fault from an earlier graph-mode dispatch: " + f);
        }
        // Everything that may fail on this rank alone happens before the epoch advances and before
        // any communication: the peers then see a rank that never came, not a half-finished round.
        const OutputPtrs outs = prepare_outputs(req);
        auto data = std::make_shared<CpuHandleData>();
        data->plan = plan_routes(a.topk_idx, cfg_.num_experts, e_local_);
        const uint64_t epoch = ++epoch_;
        data->epoch = epoch;
        const RoutePlan& plan = data->plan;
        // A host-synchronising call fails on every rank alike, through the count exchange, for
        // this call's bad routes or for a sticky fault an earlier graph-mode call left here.
        const RouteDecision decision = decide_route_status(a.host_sync, fault_, plan.first_bad);
        if (decision.clear_sticky) fault_ = BadRoute{};
        if (decision.record_sticky) fault_ = plan.first_bad;
        const RouteStatus& rejected = decision.publish;

        // 1. send (direct: into every destination rank; hybrid: over the network once per node, then
        //    forwarded inside the node), once the slots' previous readers are done
        std::string forward_fault;
        if (hybrid_)
            send_hybrid(req, plan, rejected, epoch, *data, forward_fault);
        else
            send_direct(req, plan, rejected, epoch);
        // 2. wait for every sender's flag (written by the sender, or by its forwarder in this node)
        wait_peers(kPhaseDispatch, kHopNvlink, epoch, all_ranks_,
                   [&](int s) { return arena_->dflag(rank_, s, epoch).epoch.load(std::memory_order_acquire); });
        for (int s = 0; s < num_ranks_; ++s) {
            const DispatchFlag& f = arena_->dflag(rank_, s, epoch);
            if (f.status.any()) {
                arena_->recv_done[rank_].store(epoch, std::memory_order_release);
                raise(ErrorCode::kInvalidArgument, rejected_dispatch_message(f.status, s, cfg_.num_experts));
            }
        }
        // 3. check what the peers wrote, then receive into the layout
        const std::vector<std::vector<uint8_t>> ok = check_messages(epoch, a.host_sync, forward_fault);
        receive(req, outs, ok, *data, result);
        arena_->recv_done[rank_].store(epoch, std::memory_order_release);
        handle.num_sms = 0;
        handle.backend_data = data;
    }

    TensorRef combine(HandleState& handle, const CombineArgs& args) override {
        auto& data = *static_cast<CpuHandleData*>(handle.backend_data.get());
        const uint64_t epoch = data.epoch;
        const int h_count = cfg_.hidden;
        const auto* y = static_cast<const uint16_t*>(args.y.data);
        const size_t cap = static_cast<size_t>(cfg_.max_tokens_per_rank);
        // 1. partials on the expert-holding rank: direct, straight into the origin's slots [holder][t];
        //    hybrid, into the origin's rail peer in this node, slots [origin's node * P + my local index][t]
        for (const auto& m : data.msgs) {
            const int target = hybrid_ ? node_ * node_size_ + m.src_rank % node_size_ : m.src_rank;
            const int holder = hybrid_ ? (m.src_rank / node_size_) * node_size_ + local_ : rank_;
            uint16_t* dst =
                arena_->comb(target) +
                (static_cast<size_t>(holder) * cap + static_cast<size_t>(m.src_token)) * static_cast<size_t>(h_count);
            for (int h = 0; h < h_count; ++h) {
                float p = 0.0f;
                for (int32_t r = m.route_begin; r < m.route_end; ++r) {
                    const float w = args.weighted ? data.route_weights[static_cast<size_t>(r)] : 1.0f;
                    p = std::fmaf(w, num::bf16_to_float(y[data.route_rows[static_cast<size_t>(r)] * h_count + h]), p);
                }
                dst[h] = num::float_to_bf16(p);
            }
        }
        if (hybrid_) {
            for (int f : node_ranks_) arena_->cflag(f, rank_).store(epoch, std::memory_order_release);
            forward_node_partials(data, epoch);
            wait_peers(kPhaseCombine, kHopNetwork, epoch, rail_ranks_,
                       [&](int f) { return arena_->npflag(rank_, f / node_size_).load(std::memory_order_acquire); });
        } else {
            for (int s = 0; s < num_ranks_; ++s) arena_->cflag(s, rank_).store(epoch, std::memory_order_release);
            wait_peers(kPhaseCombine, kHopNvlink, epoch, all_ranks_,
                       [&](int d) { return arena_->cflag(rank_, d).load(std::memory_order_acquire); });
        }
        // 2. reduce at the origin (SEMANTICS.md, "Combine"): one node, flat in first-k destination order;
        //    several, node partials in first-rank order (hybrid: made by the nodes; direct: made here)
        const RoutePlan& plan = data.plan;
        const int64_t t_count = plan.num_tokens;
        TensorRef out =
            args.out ? *args.out : TensorRef::contiguous(out_block_->data(), DType::kBFloat16, {t_count, h_count});
        const int64_t out_stride = t_count > 1 ? out.stride(0) : h_count;
        const int64_t bias_stride = args.bias && t_count > 1 ? args.bias->stride(0) : h_count;
        auto* o = static_cast<uint16_t*>(out.data);
        const uint16_t* own = arena_->comb(rank_);
        std::vector<int32_t> nodes;
        for (int64_t t = 0; t < t_count; ++t) {
            const int32_t* d0 = plan.dests.data() + plan.dest_offsets[static_cast<size_t>(t)];
            const int32_t* d1 = plan.dests.data() + plan.dest_offsets[static_cast<size_t>(t + 1)];
            nodes_in_order(d0, d1, nodes);
            auto partial = [&](int32_t d, int h) {
                return num::bf16_to_float(own[(static_cast<size_t>(d) * cap + static_cast<size_t>(t)) * h_count + h]);
            };
            for (int h = 0; h < h_count; ++h) {
                float acc = args.bias
                                ? num::bf16_to_float(static_cast<const uint16_t*>(args.bias->data)[t * bias_stride + h])
                                : 0.0f;
                if (!hierarchical_) {
                    for (const int32_t* d = d0; d != d1; ++d) acc = acc + partial(*d, h);
                } else if (hybrid_) {
                    for (int32_t q : nodes) acc = acc + num::bf16_to_float(arena_->node_partial(rank_, q, t)[h]);
                } else {
                    for (int32_t q : nodes) {
                        float qv = 0.0f;
                        for (const int32_t* d = d0; d != d1; ++d)
                            if (*d / node_size_ == q) qv = qv + partial(*d, h);
                        acc = acc + num::bf16_to_float(num::float_to_bf16(qv));
                    }
                }
                o[t * out_stride + h] = num::float_to_bf16(acc);
            }
        }
        return out;
    }

 private:
    // The distinct nodes of destination ranks [d0, d1), in order of their first rank.
    void nodes_in_order(const int32_t* d0, const int32_t* d1, std::vector<int32_t>& nodes) const {
        nodes.clear();
        for (const int32_t* d = d0; d != d1; ++d) {
            const int32_t q = *d / node_size_;
            if (std::find(nodes.begin(), nodes.end(), q) == nodes.end()) nodes.push_back(q);
        }
    }

    // Waits (bounded) until epoch_of(p) >= epoch for every rank p of `peers`; the timeout names the
    // ranks not heard from (hybrid: with their nodes and the hop).
    template <class EpochOf>
    void wait_peers(int32_t phase, int32_t hop, uint64_t epoch, const std::vector<int>& peers, EpochOf epoch_of) {
        const auto deadline = std::chrono::steady_clock::now() + cfg_.timeout;
        for (int spins = 0;; ++spins) {
            bool all = true;
            for (size_t i = 0; i < peers.size() && all; ++i) all = epoch_of(peers[i]) >= epoch;
            if (all) return;
            if (std::chrono::steady_clock::now() > deadline) break;
            if (spins < 64)
                std::this_thread::yield();
            else
                std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        MissingPeers missing{};
        missing.observed = epoch;
        for (int p : peers) {
            const uint64_t seen = epoch_of(p);
            if (seen >= epoch) continue;
            if (missing.count < kMaxNamedPeers) missing.named[missing.count] = p;
            ++missing.count;
            missing.observed = std::min(missing.observed, seen);
        }
        raise(ErrorCode::kTimeout,
              hybrid_ ? hybrid_timeout_message(phase, hop, rank_, cfg_.timeout.count(), missing, epoch, node_size_)
                      : timeout_message(phase, rank_, cfg_.timeout.count(), missing, epoch));
    }

    void send_direct(const DispatchRequest& req, const RoutePlan& plan, const RouteStatus& rejected, uint64_t epoch) {
        wait_peers(kPhaseDispatch, kHopNvlink, epoch - 1, all_ranks_,
                   [&](int d) { return arena_->recv_done[d].load(std::memory_order_acquire); });
        std::vector<int64_t> sent(static_cast<size_t>(num_ranks_), 0);
        if (!rejected.any())
            build_messages(req, plan, [&](int64_t t, const uint8_t* row) {
                for (int32_t i = plan.dest_offsets[static_cast<size_t>(t)];
                     i < plan.dest_offsets[static_cast<size_t>(t + 1)]; ++i) {
                    const int d = plan.dests[static_cast<size_t>(i)];
                    std::memcpy(arena_->slot(d, rank_, sent[static_cast<size_t>(d)]++), row,
                                static_cast<size_t>(arena_->msg.bytes));
                }
            });
        if (forger_)
            for (int d = 0; d < num_ranks_; ++d) {
                testing::OutgoingDispatch o{
                    rank_,      d, sent[static_cast<size_t>(d)], arena_->slot(d, rank_, 0), cfg_.max_tokens_per_rank,
                    arena_->msg};
                forger_(o);
                sent[static_cast<size_t>(d)] = o.count;
            }
        for (int d = 0; d < num_ranks_; ++d) {
            DispatchFlag& f = arena_->dflag(d, rank_, epoch);
            f.count = sent[static_cast<size_t>(d)];
            f.status = rejected;
            f.epoch.store(epoch, std::memory_order_release);
        }
    }

    // Hybrid dispatch, steps H1-H2 of protocol.hpp: the network hop (emulated) to the rail peer of
    // every destination node, then this rank's forwarding of what its rail senders put here.
    void send_hybrid(const DispatchRequest& req, const RoutePlan& plan, const RouteStatus& rejected, uint64_t epoch,
                     CpuHandleData& data, std::string& fault) {
        const size_t msg_bytes = static_cast<size_t>(arena_->msg.bytes);
        // H1: one message per (token, destination node), staged per node, then put and signalled
        wait_peers(kPhaseDispatch, kHopNetwork, epoch - 1, rail_ranks_,
                   [&](int f) { return arena_->rail_done[f].load(std::memory_order_acquire); });
        std::vector<std::vector<uint8_t>> stage(static_cast<size_t>(nodes_));
        std::vector<int32_t> nodes;
        if (!rejected.any())
            build_messages(req, plan, [&](int64_t t, const uint8_t* row) {
                nodes_in_order(plan.dests.data() + plan.dest_offsets[static_cast<size_t>(t)],
                               plan.dests.data() + plan.dest_offsets[static_cast<size_t>(t + 1)], nodes);
                for (int32_t q : nodes) {
                    auto& st = stage[static_cast<size_t>(q)];
                    st.insert(st.end(), row, row + msg_bytes);
                }
            });
        for (int i = 0; i < nodes_; ++i) {
            const int q = net_.peer_at(i, nodes_);
            const int f = q * node_size_ + local_;
            const auto& st = stage[static_cast<size_t>(q)];
            int64_t count = static_cast<int64_t>(st.size() / msg_bytes);
            if (!st.empty()) net_.put(arena_->rail_slot(f, node_, 0), st.data(), st.size());
            if (forger_) {
                testing::OutgoingDispatch o{
                    rank_, f, count, arena_->rail_slot(f, node_, 0), cfg_.max_tokens_per_rank, arena_->msg};
                forger_(o);
                count = o.count;
            }
            DispatchFlag& flag = arena_->rflag(f, node_, epoch);
            flag.count = count;
            flag.status = rejected;
            net_.before_signal();
            flag.epoch.store(epoch, std::memory_order_release);
        }
        // H2: forward what every rail sender put here to the destination ranks of this node
        wait_peers(kPhaseDispatch, kHopNetwork, epoch, rail_ranks_, [&](int s) {
            return arena_->rflag(rank_, s / node_size_, epoch).epoch.load(std::memory_order_acquire);
        });
        wait_peers(kPhaseDispatch, kHopNvlink, epoch - 1, node_ranks_,
                   [&](int d) { return arena_->recv_done[d].load(std::memory_order_acquire); });
        const MessageLayout& m = arena_->msg;
        const int64_t cap = cfg_.max_tokens_per_rank;
        auto note = [&](int s, const std::string& what) {
            if (fault.empty())
                fault = cat("dispatch: rank ", rank_, " (forwarding for node ", node_,
                            ") received malformed data from rank ", s, " over the network: ", what,
                            "; that data was dropped, nothing was forwarded for it (a peer broke the protocol: "
                            "memory corruption or a library bug, please report it)");
        };
        std::vector<int64_t> sent(static_cast<size_t>(node_size_));
        for (int p = 0; p < nodes_; ++p) {
            const int s = p * node_size_ + local_;
            const DispatchFlag& rf = arena_->rflag(rank_, p, epoch);
            const RouteStatus status = rf.status;
            std::fill(sent.begin(), sent.end(), 0);
            const int64_t n = rf.count;
            if (status.any()) {
                // a rejected call forwards only its status
            } else if (n < 0 || n > cap) {
                note(s, cat("it announced ", n, " messages, outside [0, max_tokens_per_rank=", cap, "]"));
            } else {
                int64_t prev = -1;
                for (int64_t j = 0; j < n; ++j) {
                    const uint8_t* msg = arena_->rail_slot(rank_, p, j);
                    int32_t src_t, idx[kMaxTopk];
                    std::memcpy(&src_t, msg + m.src_offset, 4);
                    std::memcpy(idx, msg + m.idx_offset, static_cast<size_t>(cfg_.num_topk) * 4);
                    std::string bad = check_routes(src_t, prev, idx);
                    int local_routes = 0;
                    for (int k = 0; k < cfg_.num_topk && bad.empty(); ++k)
                        local_routes += idx[k] >= 0 && idx[k] / e_local_ / node_size_ == node_;
                    if (bad.empty() && local_routes == 0) bad = cat("no route to a rank of node ", node_);
                    if (!bad.empty()) {
                        note(s, cat("message ", j, " of ", n, ": ", bad));
                        continue;
                    }
                    prev = src_t;
                    // the token's destination ranks in this node, first-k order: forwarded to each once
                    CpuHandleData::Forwarded fw{p, src_t, static_cast<int32_t>(data.fwd_dests.size()), 0};
                    for (int k = 0; k < cfg_.num_topk; ++k) {
                        if (idx[k] < 0) continue;
                        const int d = idx[k] / e_local_;
                        if (d / node_size_ != node_) continue;
                        if (std::find(data.fwd_dests.begin() + fw.dests_begin, data.fwd_dests.end(), d) !=
                            data.fwd_dests.end())
                            continue;
                        data.fwd_dests.push_back(d);
                        std::memcpy(arena_->slot(d, s, sent[static_cast<size_t>(d % node_size_)]++), msg, msg_bytes);
                    }
                    fw.dests_end = static_cast<int32_t>(data.fwd_dests.size());
                    data.forwarded.push_back(fw);
                }
            }
            for (int i = 0; i < node_size_; ++i) {
                DispatchFlag& f = arena_->dflag(node_ * node_size_ + i, s, epoch);
                f.count = sent[static_cast<size_t>(i)];
                f.status = status;
                f.epoch.store(epoch, std::memory_order_release);
            }
        }
        arena_->rail_done[rank_].store(epoch, std::memory_order_release);
    }

    // Combine step H5 on this rank as forwarder: node partials of every rail origin's tokens that it
    // forwarded, put into the origin's node slots, then the origin signalled.
    void forward_node_partials(const CpuHandleData& data, uint64_t epoch) {
        wait_peers(kPhaseCombine, kHopNvlink, epoch, node_ranks_,
                   [&](int d) { return arena_->cflag(rank_, d).load(std::memory_order_acquire); });
        const int h_count = cfg_.hidden;
        const size_t cap = static_cast<size_t>(cfg_.max_tokens_per_rank);
        const uint16_t* own = arena_->comb(rank_);
        std::vector<uint16_t> row(static_cast<size_t>(h_count));
        // forwarded tokens grouped by source node (they were recorded node by node, t ascending)
        std::vector<std::pair<size_t, size_t>> range(static_cast<size_t>(nodes_), {0, 0});
        for (size_t i = 0; i < data.forwarded.size();) {
            size_t e = i;
            while (e < data.forwarded.size() && data.forwarded[e].src_node == data.forwarded[i].src_node) ++e;
            range[static_cast<size_t>(data.forwarded[i].src_node)] = {i, e};
            i = e;
        }
        for (int i = 0; i < nodes_; ++i) {
            const int p = net_.peer_at(i, nodes_);
            const int s = p * node_size_ + local_;
            const auto [b, e] = range[static_cast<size_t>(p)];
            for (size_t x = 0; x < e - b; ++x) {
                const auto& fw = data.forwarded[net_.reorder ? e - 1 - x : b + x];
                for (int h = 0; h < h_count; ++h) {
                    float q = 0.0f;
                    for (int32_t j = fw.dests_begin; j < fw.dests_end; ++j) {
                        const int holder = p * node_size_ + data.fwd_dests[static_cast<size_t>(j)] % node_size_;
                        q = q +
                            num::bf16_to_float(
                                own[(static_cast<size_t>(holder) * cap + static_cast<size_t>(fw.src_token)) * h_count +
                                    h]);
                    }
                    row[static_cast<size_t>(h)] = num::float_to_bf16(q);
                }
                net_.put(arena_->node_partial(s, node_, fw.src_token), row.data(), row.size() * 2);
            }
            net_.before_signal();
            arena_->npflag(s, node_).store(epoch, std::memory_order_release);
        }
    }

    // Source token and expert ids of a message, checked against the config: "" when they are fine.
    std::string check_routes(int32_t src_t, int64_t prev, const int32_t* idx) const {
        const int64_t cap = cfg_.max_tokens_per_rank;
        if (src_t < 0 || src_t >= cap) return cat("source token ", src_t, " outside [0, ", cap, ")");
        if (src_t <= prev)
            return cat("source token ", src_t, " after token ", prev, " (tokens arrive once each, ascending)");
        for (int k = 0; k < cfg_.num_topk; ++k) {
            const int32_t e = idx[k];
            if (e < -1 || e >= cfg_.num_experts)
                return cat("expert id ", e, " at k=", k, " outside [-1, ", cfg_.num_experts, ")");
            for (int q = 0; q < k && e >= 0; ++q)
                if (idx[q] == e) return cat("expert id ", e, " repeated at k=", q, " and k=", k);
        }
        return "";
    }

    // Builds each routed token's message once (t ascending) and hands it to emit(t, bytes).
    template <class Emit>
    void build_messages(const DispatchRequest& req, const RoutePlan& plan, Emit&& emit) {
        const DispatchArgs& a = *req.args;
        const MessageLayout& m = arena_->msg;
        const int k_count = cfg_.num_topk;
        const int h_count = cfg_.hidden;
        const int scols = cfg_.payload == Payload::kFP8 ? scale_columns(cfg_.scale_format, h_count) : 0;
        const int64_t x_stride = plan.num_tokens > 1 ? a.x.stride(0) : h_count;
        const int64_t s_stride = a.x_scales && plan.num_tokens > 1 ? a.x_scales->stride(0) : scols;
        const int64_t w_stride = a.topk_weights && plan.num_tokens > 1 ? a.topk_weights->stride(0) : k_count;
        std::vector<uint8_t> row(static_cast<size_t>(m.bytes), 0);
        for (int64_t t = 0; t < plan.num_tokens; ++t) {
            if (plan.dest_offsets[static_cast<size_t>(t)] == plan.dest_offsets[static_cast<size_t>(t + 1)]) continue;
            if (req.quantize) {
                quantize_row(static_cast<const uint16_t*>(a.x.data) + t * x_stride, h_count, cfg_.scale_format,
                             row.data(), row.data() + m.payload_bytes);
            } else if (req.prequantized) {
                std::memcpy(row.data(), static_cast<const uint8_t*>(a.x.data) + t * x_stride,
                            static_cast<size_t>(h_count));
                std::memcpy(row.data() + m.payload_bytes,
                            static_cast<const uint8_t*>(a.x_scales->data) + t * s_stride * 4,
                            static_cast<size_t>(scols) * 4);
            } else {
                std::memcpy(row.data(), static_cast<const uint16_t*>(a.x.data) + t * x_stride,
                            static_cast<size_t>(h_count) * 2);
            }
            std::memcpy(row.data() + m.idx_offset, &plan.idx[static_cast<size_t>(t * k_count)],
                        static_cast<size_t>(k_count) * 4);
            auto* w = reinterpret_cast<float*>(row.data() + m.weight_offset);
            for (int k = 0; k < k_count; ++k)
                w[k] = a.topk_weights ? static_cast<const float*>(a.topk_weights->data)[t * w_stride + k] : 0.0f;
            const auto src = static_cast<int32_t>(t);
            std::memcpy(row.data() + m.src_offset, &src, 4);
            emit(t, row.data());
        }
    }

    // Slots of OutputStore: one per (output, layout).
    static int store_slot(int output, Layout layout) { return output * 2 + (layout == Layout::kExpertMasked ? 1 : 0); }

    OutputPtrs prepare_outputs(const DispatchRequest& req) {
        const DispatchArgs& a = *req.args;
        const auto cap = dispatch_output_specs(cfg_, num_ranks_, a.layout, req.rows_cap, a.scales_mn_major);
        auto ptr = [&](const std::optional<TensorRef>& given, const OutputSpec& spec, int output, const char* what) {
            if (given) return given->data;
            return outputs_.get(store_slot(output, a.layout),
                                static_cast<size_t>(spec.storage_elems) * dtype_size(spec.dtype), what);
        };
        OutputPtrs p;
        p.recv_x = ptr(a.outputs.recv_x, cap.recv_x, 0, "recv_x");
        if (cap.recv_scales) p.recv_scales = ptr(a.outputs.recv_scales, *cap.recv_scales, 1, "recv_scales");
        p.recv_weights = ptr(a.outputs.recv_weights, cap.recv_weights, 2, "recv_weights");
        p.recv_src = ptr(a.outputs.recv_src, cap.recv_src, 3, "recv_src");
        if (cap.m_indices) p.m_indices = ptr(a.outputs.m_indices, *cap.m_indices, 4, "m_indices");
        return p;
    }

    // Checks every count and message the peers published for this epoch against the protocol:
    // counts in [0, C]; per message a source token in [0, C), ascending per sender; expert ids in
    // [-1, E), none repeated, at least one held here. Returns a mask of the messages to use. The
    // first violation names its sender: raised at once with host sync (after this rank has read its
    // round, so no peer waits on it), recorded as a sticky fault in graph mode.
    // `earlier`: a fault this rank found forwarding (hybrid), reported the same way.
    std::vector<std::vector<uint8_t>> check_messages(uint64_t epoch, bool host_sync, const std::string& earlier) {
        const MessageLayout& m = arena_->msg;
        const int64_t cap = cfg_.max_tokens_per_rank;
        std::string fault = earlier;
        auto note = [&](int s, const std::string& what) {
            if (fault.empty())
                fault = cat("dispatch: rank ", rank_, " received malformed data from rank ", s, ": ", what,
                            "; that data was dropped, nothing was written for it (a peer broke the protocol: "
                            "memory corruption or a library bug, please report it)");
        };
        std::vector<std::vector<uint8_t>> ok(static_cast<size_t>(num_ranks_));
        for (int s = 0; s < num_ranks_; ++s) {
            const int64_t n = arena_->dflag(rank_, s, epoch).count;
            if (n < 0 || n > cap) {
                note(s, cat("it announced ", n, " messages, outside [0, max_tokens_per_rank=", cap, "]"));
                continue;
            }
            auto& mask = ok[static_cast<size_t>(s)];
            mask.assign(static_cast<size_t>(n), 1);
            int64_t prev = -1;
            for (int64_t j = 0; j < n; ++j) {
                const uint8_t* msg = arena_->slot(rank_, s, j);
                int32_t src_t;
                std::memcpy(&src_t, msg + m.src_offset, 4);
                std::string bad;
                if (src_t < 0 || src_t >= cap) {
                    bad = cat("source token ", src_t, " outside [0, ", cap, ")");
                } else if (src_t <= prev) {
                    bad = cat("source token ", src_t, " after token ", prev, " (tokens arrive once each, ascending)");
                } else {
                    int local = 0;
                    for (int k = 0; k < cfg_.num_topk && bad.empty(); ++k) {
                        int32_t e;
                        std::memcpy(&e, msg + m.idx_offset + 4 * k, 4);
                        if (e < -1 || e >= cfg_.num_experts)
                            bad = cat("expert id ", e, " at k=", k, " outside [-1, ", cfg_.num_experts, ")");
                        for (int q = 0; q < k && bad.empty() && e >= 0; ++q) {
                            int32_t f;
                            std::memcpy(&f, msg + m.idx_offset + 4 * q, 4);
                            if (f == e) bad = cat("expert id ", e, " repeated at k=", q, " and k=", k);
                        }
                        if (e >= 0 && e / e_local_ == rank_) ++local;
                    }
                    if (bad.empty() && local == 0) bad = "no route to an expert of this rank";
                }
                if (!bad.empty()) {
                    note(s, cat("message ", j, " of ", n, ": ", bad));
                    mask[static_cast<size_t>(j)] = 0;
                } else {
                    prev = src_t;
                }
            }
        }
        if (!fault.empty()) {
            if (host_sync) {
                arena_->recv_done[rank_].store(epoch, std::memory_order_release);
                raise(ErrorCode::kInternal, fault + "; no outputs were returned");
            }
            if (peer_fault_.empty()) peer_fault_ = fault;
        }
        return ok;
    }

    void receive(const DispatchRequest& req, const OutputPtrs& outs, const std::vector<std::vector<uint8_t>>& ok,
                 CpuHandleData& data, DispatchResult& result) {
        const DispatchArgs& a = *req.args;
        const MessageLayout& m = arena_->msg;
        const int k_count = cfg_.num_topk;
        const int h_count = cfg_.hidden;
        const bool fp8 = cfg_.payload == Payload::kFP8;
        const int scols = fp8 ? scale_columns(cfg_.scale_format, h_count) : 0;
        const size_t row_bytes = static_cast<size_t>(h_count) * (fp8 ? 1 : 2);
        const bool contiguous = a.layout == Layout::kExpertContiguous;
        const int64_t rc = int64_t{num_ranks_} * cfg_.max_tokens_per_rank;
        auto for_each_message = [&](auto fn) {
            for (int s = 0; s < num_ranks_; ++s) {
                const auto& mask = ok[static_cast<size_t>(s)];
                for (size_t j = 0; j < mask.size(); ++j)
                    if (mask[j]) fn(s, arena_->slot(rank_, s, static_cast<int64_t>(j)));
            }
        };

        // counts per local expert, in (s, j) order
        std::vector<int32_t> counts(static_cast<size_t>(e_local_), 0);
        for_each_message([&](int, const uint8_t* msg) {
            const auto* idx = reinterpret_cast<const int32_t*>(msg + m.idx_offset);
            for (int k = 0; k < k_count; ++k)
                if (idx[k] >= 0 && idx[k] / e_local_ == rank_) ++counts[static_cast<size_t>(idx[k] % e_local_)];
        });
        std::vector<int64_t> start(static_cast<size_t>(e_local_) + 1, 0);
        for (int l = 0; l < e_local_; ++l)
            start[static_cast<size_t>(l) + 1] =
                start[static_cast<size_t>(l)] +
                (contiguous ? round_up(counts[static_cast<size_t>(l)], a.expert_alignment) : 0);
        const int64_t m_rows = start[static_cast<size_t>(e_local_)];
        // checked messages cannot overflow the worst case; the layout relies on it
        ELASTICEP_INTERNAL(!contiguous || m_rows <= req.rows_cap, "received rows ", m_rows, " exceed M_cap ",
                           req.rows_cap);
        const int64_t rows_out = contiguous ? (a.host_sync ? m_rows : req.rows_cap) : rc;

        // outputs: caller-provided (fixed worst-case shape) or buffer-owned, both with the strides of
        // the worst case's storage
        const auto cap_specs = dispatch_output_specs(cfg_, num_ranks_, a.layout, req.rows_cap, a.scales_mn_major);
        const auto specs = dispatch_output_specs(cfg_, num_ranks_, a.layout, rows_out, a.scales_mn_major);
        auto bind = [&](void* data_ptr, const OutputSpec& cap, const OutputSpec& spec, bool given) {
            TensorRef t = spec.bind(data_ptr, Device{});
            if (given) t.strides = cap.strides;
            return t;
        };
        result.recv_x = bind(outs.recv_x, cap_specs.recv_x, specs.recv_x, a.outputs.recv_x.has_value());
        result.recv_weights =
            bind(outs.recv_weights, cap_specs.recv_weights, specs.recv_weights, a.outputs.recv_weights.has_value());
        result.recv_src = bind(outs.recv_src, cap_specs.recv_src, specs.recv_src, a.outputs.recv_src.has_value());
        if (fp8)
            result.recv_scales = bind(outs.recv_scales, *cap_specs.recv_scales, *specs.recv_scales,
                                      a.outputs.recv_scales.has_value());  // the caller's tensor keeps its stride
        if (contiguous)
            result.m_indices =
                bind(outs.m_indices, *cap_specs.m_indices, *specs.m_indices, a.outputs.m_indices.has_value());
        auto* counts_out = static_cast<int32_t*>(meta_block_->data());
        std::memcpy(counts_out, counts.data(), counts.size() * 4);
        result.counts = TensorRef::contiguous(counts_out, DType::kInt32, {e_local_});
        if (contiguous) {
            int32_t* off = counts_out + e_local_;
            for (int l = 0; l <= e_local_; ++l) off[l] = static_cast<int32_t>(start[static_cast<size_t>(l)]);
            result.offsets = TensorRef::contiguous(off, DType::kInt32, {e_local_ + 1});
            result.num_rows = a.host_sync ? m_rows : -1;
        } else {
            result.masked_m = result.counts;
        }
        for (int l = 0; l < e_local_; ++l) load_[static_cast<size_t>(l)] += counts[static_cast<size_t>(l)];

        auto* rx = static_cast<uint8_t*>(result.recv_x.data);
        auto* rw = static_cast<float*>(result.recv_weights.data);
        auto* rs = static_cast<int32_t*>(result.recv_src.data);
        auto* mi = contiguous ? static_cast<int32_t*>(result.m_indices.data) : nullptr;
        auto* sc = fp8 ? static_cast<uint32_t*>(result.recv_scales->data) : nullptr;  // fp32 and int32 alike: 4 bytes
        const std::vector<int64_t> sst = fp8 ? result.recv_scales->strides : std::vector<int64_t>{};
        auto scale_at = [&](int64_t l, int64_t pos, int64_t row, int c) -> uint32_t& {
            return contiguous ? sc[row * sst[0] + c * sst[1]] : sc[l * sst[0] + pos * sst[1] + c * sst[2]];
        };
        // padding and metadata defaults: every row that is not written below is padding
        const int64_t total_rows = contiguous ? rows_out : int64_t{e_local_} * rc;
        for (int64_t r = 0; r < total_rows; ++r) {
            rw[r] = 0.0f;
            rs[r] = -1;
            if (mi) mi[r] = -1;
        }
        if (a.zero_padding) {
            // zero every padding row; real rows are overwritten below
            for (int64_t l = 0; l < (contiguous ? 1 : e_local_); ++l) {
                const int64_t rows = contiguous ? rows_out : rc;
                for (int64_t pos = 0; pos < rows; ++pos) {
                    const int64_t row = contiguous ? pos : l * rc + pos;
                    std::memset(rx + row * static_cast<int64_t>(row_bytes), 0, row_bytes);
                    for (int c = 0; c < scols; ++c) scale_at(l, pos, row, c) = 0;
                }
            }
        }

        // place rows in (s, j) order and remember each route's row for combine
        std::vector<int64_t> fill(static_cast<size_t>(e_local_), 0);
        for_each_message([&](int s, const uint8_t* msg) {
            const auto* idx = reinterpret_cast<const int32_t*>(msg + m.idx_offset);
            const auto* w = reinterpret_cast<const float*>(msg + m.weight_offset);
            int32_t src_t;
            std::memcpy(&src_t, msg + m.src_offset, 4);
            CpuHandleData::Msg rec{s, src_t, static_cast<int32_t>(data.route_rows.size()), 0};
            for (int k = 0; k < k_count; ++k) {
                if (idx[k] < 0 || idx[k] / e_local_ != rank_) continue;
                const int64_t l = idx[k] % e_local_;
                const int64_t pos = fill[static_cast<size_t>(l)]++;
                const int64_t row = contiguous ? start[static_cast<size_t>(l)] + pos : l * rc + pos;
                std::memcpy(rx + row * static_cast<int64_t>(row_bytes), msg, row_bytes);
                for (int c = 0; c < scols; ++c)
                    std::memcpy(&scale_at(l, pos, row, c), msg + m.payload_bytes + 4 * c, 4);
                rw[row] = w[k];
                rs[row] = static_cast<int32_t>(s * cfg_.max_tokens_per_rank + src_t);
                if (mi) mi[row] = static_cast<int32_t>(l);
                data.route_rows.push_back(row);
                data.route_weights.push_back(w[k]);
            }
            rec.route_end = static_cast<int32_t>(data.route_rows.size());
            data.msgs.push_back(rec);
        });
    }

    BufferConfig cfg_;
    int rank_, num_ranks_, e_local_;
    // nodes (SEMANTICS.md, "Topology"): P ranks each, N of them; this rank's node and local index
    int node_size_, nodes_, node_, local_;
    bool hybrid_;        // topology=hybrid: the network hop (emulated) and forwarding
    bool hierarchical_;  // several nodes: combine reduces per node first (direct and hybrid)
    std::vector<int> all_ranks_, node_ranks_, rail_ranks_;
    transport::scaleout::EmulationKnobs net_;
    std::shared_ptr<Arena> arena_;
    uint64_t epoch_ = 0;
    BadRoute fault_{};        // sticky: first invalid route of a graph-mode call, until reported
    std::string peer_fault_;  // sticky: first malformed peer data of a graph-mode call, until reported
    std::vector<int64_t> load_;
    OutputStore outputs_;
    std::unique_ptr<Block> out_block_, meta_block_;
    testing::DispatchForger forger_;
};

}  // namespace

size_t cpu_reservation_bytes(const BufferConfig& c, int num_ranks) {
    // this rank's share of the arena: its receive slots and its combine slots, plus its combine output;
    // hybrid adds its network regions (rail messages and node partials from every node)
    const Reservation r = reservation(c, num_ranks);
    const int64_t nodes = c.topology == Topology::kHybrid ? num_ranks / c.node_size(num_ranks) : 0;
    const int64_t network = nodes * c.max_tokens_per_rank * (int64_t{message_layout(c).bytes} + int64_t{c.hidden} * 2);
    return static_cast<size_t>(r.dispatch_slots + r.combine_slots + r.combine_out + network);
}

std::unique_ptr<BackendBuffer> make_cpu_backend(const BackendContext& ctx) { return std::make_unique<CpuBackend>(ctx); }

}  // namespace elasticep::detail
