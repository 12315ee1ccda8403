// `elasticep bench`: ranks are threads of this process (ThreadGroup), one Buffer each, in up to
// three timing modes per scenario:
//   isolated      every round: barrier, timed dispatch, verification against the oracle, barrier,
//                 timed combine, verification (warm-up rounds first, verified too);
//   back-to-back  `rounds` dispatch + combine pairs enqueued without host synchronisation (the
//                 protocol alone keeps the ranks in step), a mark between every two calls; every
//                 combine output and the last dispatch's outputs verified afterwards;
//   graph         (CUDA, --graph) one dispatch + combine captured into a CUDA graph, replayed
//                 isolated (barrier before each replay) and back to back; its outputs verified.
// The stand-in expert computes y once, from the first (verified) dispatch: the inputs are the same
// every round, so are the outputs. Verification reads outputs between timed calls, never inside.
#include "bench.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "backend_io.hpp"
#include "core/layout.hpp"
#include "core/numerics.hpp"
#include "elasticep/buffer.hpp"
#include "elasticep/error.hpp"
#include "elasticep/group.hpp"
#include "elasticep/limits.hpp"
#include "elasticep/traffic.hpp"
#include "elasticep/version.hpp"
#include "inputs.hpp"

namespace elasticep::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

[[noreturn]] void bad_option(const std::string& msg) { throw Error(ErrorCode::kInvalidArgument, msg); }

constexpr size_t kMaxFailures = 8;

// Where element (row, col) of a [rows, cols] or [E_local, R*C, cols] result lives, in elements.
struct RowAddress {
    bool masked = false;
    int64_t rc = 0;  // R*C for the masked slab
    int64_t operator()(const TensorRef& t, int64_t row, int64_t col) const {
        if (!masked) return row * t.stride(0) + (t.ndim() > 1 ? col * t.stride(1) : 0);
        const int64_t l = row / rc, pos = row % rc;
        return l * t.stride(0) + pos * t.stride(1) + (t.ndim() > 2 ? col * t.stride(2) : 0);
    }
};

// Bytes a strided view spans from its data pointer.
size_t span_bytes(const TensorRef& t) {
    int64_t last = 0;
    for (int i = 0; i < t.ndim(); ++i) {
        if (t.size(i) == 0) return 0;
        last += (t.size(i) - 1) * t.stride(i);
    }
    return static_cast<size_t>(last + 1) * dtype_size(t.dtype);
}

struct Mismatch {
    int64_t count = 0;
    std::string first;
    template <class... Args>
    void add(const Args&... args) {
        if (count++ == 0) {
            std::ostringstream os;
            (os << ... << args);
            first = os.str();
        }
    }
};

std::string hex(uint32_t v) {
    std::ostringstream os;
    os << "0x" << std::hex << v;
    return os.str();
}

// One rank's dispatch result against the oracle's expectation, element by element.
Mismatch verify_dispatch(const Scenario& s, const BufferConfig& cfg, const DispatchResult& res,
                         const reference::RankDispatch& want, RankDevice& mem) {
    Mismatch mm;
    const int e_local = cfg.num_experts / s.num_ranks;
    const bool contiguous = s.layout == Layout::kExpertContiguous;
    const bool fp8 = cfg.payload == Payload::kFP8;
    const int64_t h = cfg.hidden;
    const int64_t rc = int64_t{s.num_ranks} * cfg.max_tokens_per_rank;
    const size_t elem = fp8 ? 1 : 2;
    const int cols = fp8 ? scale_columns(cfg.scale_format, cfg.hidden) : 0;

    const auto* counts = static_cast<const int32_t*>(mem.fetch(res.counts, span_bytes(res.counts), 0));
    if (res.counts.numel() != e_local) return mm.add("counts has ", res.counts.numel(), " entries, want ", e_local), mm;
    for (int l = 0; l < e_local; ++l)
        if (counts[l] != want.counts[static_cast<size_t>(l)])
            mm.add("counts[", l, "] = ", counts[l], ", want ", want.counts[static_cast<size_t>(l)]);
    if (contiguous) {
        const auto* off = static_cast<const int32_t*>(mem.fetch(res.offsets, span_bytes(res.offsets), 1));
        for (int l = 0; l <= e_local; ++l)
            if (off[l] != want.offsets[static_cast<size_t>(l)])
                mm.add("offsets[", l, "] = ", off[l], ", want ", want.offsets[static_cast<size_t>(l)]);
        if (res.num_rows != want.num_rows) mm.add("num_rows = ", res.num_rows, ", want ", want.num_rows);
        if (res.recv_x.shape != std::vector<int64_t>{want.rows, h})
            return mm.add("recv_x is ", res.recv_x.describe(), ", want ", want.rows, " rows"), mm;
    } else {
        if (res.recv_x.shape != std::vector<int64_t>{e_local, rc, h})
            return mm.add("recv_x is ", res.recv_x.describe(), ", want [", e_local, ", ", rc, ", ", h, "]"), mm;
        const auto* mm_m = static_cast<const int32_t*>(mem.fetch(res.masked_m, span_bytes(res.masked_m), 1));
        for (int l = 0; l < e_local; ++l)
            if (mm_m[l] != want.counts[static_cast<size_t>(l)])
                mm.add("masked_m[", l, "] = ", mm_m[l], ", want ", want.counts[static_cast<size_t>(l)]);
    }
    if (mm.count) return mm;

    const RowAddress at{!contiguous, rc};
    const auto* x = static_cast<const uint8_t*>(mem.fetch(res.recv_x, span_bytes(res.recv_x), 2));
    const auto* w = static_cast<const float*>(mem.fetch(res.recv_weights, span_bytes(res.recv_weights), 3));
    const auto* src = static_cast<const int32_t*>(mem.fetch(res.recv_src, span_bytes(res.recv_src), 4));
    const int32_t* mi =
        contiguous ? static_cast<const int32_t*>(mem.fetch(res.m_indices, span_bytes(res.m_indices), 5)) : nullptr;
    const uint32_t* sc = nullptr;
    if (fp8) {
        if (!res.recv_scales) return mm.add("recv_scales is missing for an fp8 payload"), mm;
        sc = static_cast<const uint32_t*>(mem.fetch(*res.recv_scales, span_bytes(*res.recv_scales), 6));
    }
    for (int64_t row = 0; row < want.rows; ++row) {
        const bool real = want.row_is_real[static_cast<size_t>(row)] != 0;
        if (real || s.zero_padding) {
            const uint8_t* got = x + at(res.recv_x, row, 0) * static_cast<int64_t>(elem);
            const uint8_t* exp = want.recv_x.data() + static_cast<size_t>(row) * static_cast<size_t>(h) * elem;
            if (std::memcmp(got, exp, static_cast<size_t>(h) * elem) != 0) {
                int64_t i = 0;
                while (got[i] == exp[i]) ++i;
                mm.add("recv_x row ", row, " byte ", i, " = ", hex(got[i]), ", want ", hex(exp[i]),
                       real ? "" : " (padding)");
            }
            for (int c = 0; c < cols; ++c) {
                const uint32_t g = sc[at(*res.recv_scales, row, c)];
                const uint32_t e =
                    want.recv_scales[static_cast<size_t>(row) * static_cast<size_t>(cols) + static_cast<size_t>(c)];
                if (g != e)
                    mm.add("recv_scales[", row, ", ", c, "] = ", hex(g), ", want ", hex(e), real ? "" : " (padding)");
            }
        }
        // contiguous metadata is specified on padding rows too (0 weight, -1 src and m_indices);
        // the masked slab's rows past masked_m are not
        if (real || contiguous) {
            const float gw = w[at(res.recv_weights, row, 0)];
            const float ew = want.recv_weights[static_cast<size_t>(row)];
            if (num::float_bits(gw) != num::float_bits(ew)) mm.add("recv_weights[", row, "] = ", gw, ", want ", ew);
            const int32_t gs = src[at(res.recv_src, row, 0)];
            if (gs != want.recv_src[static_cast<size_t>(row)])
                mm.add("recv_src[", row, "] = ", gs, ", want ", want.recv_src[static_cast<size_t>(row)]);
            if (mi && mi[row * res.m_indices.stride(0)] != want.m_indices[static_cast<size_t>(row)])
                mm.add("m_indices[", row, "] = ", mi[row * res.m_indices.stride(0)], ", want ",
                       want.m_indices[static_cast<size_t>(row)]);
        }
    }
    return mm;
}

// The stand-in expert over one rank's dispatch output, real rows only (padding rows of y are
// zero). `real_expert(row)` is the local expert of a real row or -1.
template <class RowOffset, class Scale, class RealExpert>
void expert_outputs(const BufferConfig& cfg, int rank, int e_local, int64_t rows, const uint8_t* x,
                    RowOffset x_row_offset, Scale scale, RealExpert real_expert, uint16_t* y, bool clear_padding) {
    const bool fp8 = cfg.payload == Payload::kFP8;
    const int cols = fp8 ? scale_columns(cfg.scale_format, cfg.hidden) : 0;
    const size_t elem = fp8 ? 1 : 2;
    std::vector<uint32_t> row_scales(static_cast<size_t>(cols));
    for (int64_t row = 0; row < rows; ++row) {
        uint16_t* out = y + row * cfg.hidden;
        const int l = real_expert(row);
        if (l < 0) {
            if (clear_padding) std::memset(out, 0, static_cast<size_t>(cfg.hidden) * 2);
            continue;
        }
        for (int c = 0; c < cols; ++c) row_scales[static_cast<size_t>(c)] = scale(row, c);
        expert_output_row(cfg, x + x_row_offset(row) * static_cast<int64_t>(elem), row_scales.data(),
                          rank * e_local + l, out);
    }
}

// One rank's combine output against the oracle's.
Mismatch verify_combine(const TensorRef& out, int64_t t_count, int64_t h, const std::vector<uint16_t>& want,
                        RankDevice& mem) {
    Mismatch mm;
    if (out.shape != std::vector<int64_t>{t_count, h})
        return mm.add("out is ", out.describe(), ", want [", t_count, ", ", h, "]"), mm;
    const auto* o = static_cast<const uint16_t*>(mem.fetch(out, span_bytes(out), 7));
    for (int64_t t = 0; t < t_count; ++t)
        for (int64_t c = 0; c < h; ++c) {
            const uint16_t g = o[t * out.stride(0) + c];
            const uint16_t e = want[static_cast<size_t>(t * h + c)];
            if (g != e)
                mm.add("out[", t, ", ", c, "] = ", hex(g), " (", num::bf16_to_float(g), "), want ", hex(e), " (",
                       num::bf16_to_float(e), ")");
        }
    return mm;
}

// Releases the rank threads together. The group's barrier wakes its waiters one after another (a
// condition variable: each retakes the mutex in turn), tens of microseconds apart on a busy host, and a
// timed collective counts that spread as its own latency (its earliest rank waits for the latest).
// Waiters spin (yielding) on a generation counter instead, bounded by the run's timeout.
class StartLine {
 public:
    StartLine(int n, int timeout_ms) : n_(n), timeout_(std::chrono::milliseconds(timeout_ms)) {}
    void wait(int rank) {
        const uint64_t gen = gen_.load(std::memory_order_acquire);
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
            arrived_.store(0, std::memory_order_relaxed);
            gen_.store(gen + 1, std::memory_order_release);
            return;
        }
        const auto deadline = Clock::now() + timeout_;
        while (gen_.load(std::memory_order_acquire) == gen) {
            if (Clock::now() > deadline)
                throw Error(ErrorCode::kTimeout, "bench: rank " + std::to_string(rank) +
                                                     " waited --timeout-ms at the start line for the other ranks");
            std::this_thread::yield();
        }
    }

 private:
    const int n_;
    const Clock::duration timeout_;
    std::atomic<int> arrived_{0};
    std::atomic<uint64_t> gen_{0};
};

// Per rank: latencies per call of every mode, and the outcome of every check.
struct RankRecord {
    std::vector<double> dispatch_us, combine_us;            // isolated, warm-up included
    std::vector<double> dispatch_host_us, combine_host_us;  // isolated: the host time of each call
    std::vector<double> b2b_dispatch_us, b2b_combine_us;
    std::vector<double> graph_us, b2b_graph_us;  // graph: warm-up included
    // each call's start against rank 0's start of the same call (us; NaN: not on one clock)
    std::vector<double> dispatch_at, combine_at, b2b_dispatch_at, b2b_combine_at, graph_at, b2b_graph_at;
    // one entry per check, in the same order on every rank: 1 = the output matched the oracle
    std::vector<char> dispatch_checks, combine_checks, graph_checks;
    std::vector<std::string> failures;
    int num_sms = 0;
};

double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Timing over the rounds [skip, end) of one series, the slowest rank per round; `at`: the calls'
// starts against rank 0's (RankRecord::*_at), for the start spread.
// `host` (optional): the calls' host times (RankRecord::*_host_us), the slowest rank's per round.
Timing timing(const std::vector<RankRecord>& recs, std::vector<double> RankRecord::*series, int skip,
              std::vector<double> RankRecord::*at, std::vector<double> RankRecord::*host = nullptr) {
    Timing t;
    const size_t n = recs.empty() ? 0 : (recs[0].*series).size();
    for (size_t r = static_cast<size_t>(skip); r < n; ++r) {
        std::vector<double> ranks;
        for (const auto& rec : recs) ranks.push_back((rec.*series)[r]);
        if (host != nullptr) {
            double slowest = 0;
            for (const auto& rec : recs) slowest = std::max(slowest, (rec.*host).at(r));
            t.host_call_rounds.push_back(slowest);
        }
        t.rank_us.push_back(ranks);
        t.round_us.push_back(*std::max_element(ranks.begin(), ranks.end()));
        double first = HUGE_VAL, last = -HUGE_VAL;
        bool clock = true;
        for (const auto& rec : recs) {
            const double s = r < (rec.*at).size() ? (rec.*at)[r] : std::nan("");
            if (!std::isfinite(s)) clock = false;
            first = std::min(first, s);
            last = std::max(last, s);
        }
        if (clock) {
            // the last end minus the last start, as each rank's latency less its lead on the last start
            // (so that it never exceeds the slowest rank's latency by a rounding)
            double from_last = 0;
            for (const auto& rec : recs) from_last = std::max(from_last, (rec.*series)[r] - (last - (rec.*at)[r]));
            t.start_spread_rounds.push_back(last - first);
            t.from_last_start_rounds.push_back(from_last);
        }
    }
    if (t.round_us.empty()) return t;
    if (t.start_spread_rounds.size() == t.round_us.size()) {
        t.start_spread_us = median(t.start_spread_rounds);
        t.from_last_start_us = median(t.from_last_start_rounds);
    }
    if (!t.host_call_rounds.empty()) t.host_call_us = median(t.host_call_rounds);
    t.median_us = median(t.round_us);
    t.mean_us = std::accumulate(t.round_us.begin(), t.round_us.end(), 0.0) / static_cast<double>(t.round_us.size());
    t.min_us = *std::min_element(t.round_us.begin(), t.round_us.end());
    t.max_us = *std::max_element(t.round_us.begin(), t.round_us.end());
    return t;
}

void set_bytes(PhaseStats& p, int64_t peer_messages, int64_t local_messages, int64_t peer_bytes, int64_t local_bytes,
               int64_t hbm_bytes, int64_t hbm_min_bytes, double hbm_gbps) {
    p.peer_messages = peer_messages;
    p.local_messages = local_messages;
    p.peer_bytes = peer_bytes;
    p.local_bytes = local_bytes;
    p.hbm_bytes = hbm_bytes;
    p.hbm_min_bytes = hbm_min_bytes;
    if (p.isolated.median_us > 0) {
        p.peer_gbps = static_cast<double>(peer_bytes) / (p.isolated.median_us * 1e3);
        p.total_gbps = static_cast<double>(peer_bytes + local_bytes) / (p.isolated.median_us * 1e3);
    }
    if (hbm_gbps > 0) {
        p.hbm_floor_us = static_cast<double>(hbm_bytes) / (hbm_gbps * 1e3);
        p.hbm_min_floor_us = static_cast<double>(hbm_min_bytes) / (hbm_gbps * 1e3);
    }
}

// A check counts as verified when the output of every rank matched.
void tally(PhaseStats& p, const std::vector<RankRecord>& recs, std::vector<char> RankRecord::*checks) {
    const size_t n = (recs[0].*checks).size();
    for (size_t i = 0; i < n; ++i) {
        const bool ok = std::all_of(recs.begin(), recs.end(), [&](const RankRecord& rec) { return (rec.*checks)[i]; });
        ++(ok ? p.rounds_verified : p.rounds_failed);
    }
}

[[noreturn]] void rethrow_cause(const std::vector<std::exception_ptr>& errors) {
    // A failing rank makes its peers time out; report the cause, not the consequence.
    std::exception_ptr first, first_timeout;
    for (const auto& e : errors) {
        if (!e) continue;
        try {
            std::rethrow_exception(e);
        } catch (const Error& err) {
            if (err.code() == ErrorCode::kTimeout) {
                if (!first_timeout) first_timeout = e;
                continue;
            }
            if (!first) first = e;
        } catch (...) {
            if (!first) first = e;
        }
    }
    std::rethrow_exception(first ? first : first_timeout);
}

}  // namespace

BufferConfig Scenario::buffer_config() const {
    BufferConfig c;
    c.num_experts = num_experts;
    c.num_topk = num_topk;
    c.hidden = hidden;
    c.max_tokens_per_rank = capacity > 0 ? capacity : std::max(tokens, 1);  // C >= 1 even when every rank is empty
    c.payload = payload;
    c.scale_format = scale_format;
    c.topology = topology;
    c.ranks_per_node = ranks_per_node;
    c.scaleout = scaleout;
    c.num_sms = num_sms;
    c.timeout = std::chrono::milliseconds(timeout_ms);
    return c;
}

std::vector<int64_t> Scenario::tokens_per_rank() const {
    std::vector<int64_t> t(static_cast<size_t>(std::max(num_ranks, 0)), tokens);
    if (tokens_min >= 0 && num_ranks > 1)
        for (int r = 0; r < num_ranks; ++r)
            t[static_cast<size_t>(r)] = tokens - (int64_t{tokens} - tokens_min) * r / (num_ranks - 1);
    return t;
}

void Scenario::validate() const {
    using std::to_string;
    if (num_ranks < 1) bad_option("--ranks must be >= 1, got " + to_string(num_ranks));
    if (tokens < 0) bad_option("--tokens must be >= 0, got " + to_string(tokens));
    if (tokens_min > tokens)
        bad_option("--tokens-min " + to_string(tokens_min) + " exceeds --tokens " + to_string(tokens));
    if (capacity > 0 && capacity < tokens)
        bad_option("--max-tokens-per-rank " + to_string(capacity) + " is below --tokens " + to_string(tokens) +
                   "; raise it or lower --tokens");
    if (num_experts % std::max(num_ranks, 1) != 0)
        bad_option("--experts " + to_string(num_experts) + " is not a multiple of --ranks " + to_string(num_ranks));
    if (num_topk > num_experts)
        bad_option("--topk " + to_string(num_topk) + " exceeds --experts " + to_string(num_experts) +
                   " (a token's experts are distinct)");
    if (alignment < 1 || alignment > kMaxExpertAlignment)
        bad_option("--alignment must be in [1, " + to_string(kMaxExpertAlignment) + "], got " + to_string(alignment));
    if (num_gpus < 1) bad_option("--gpus must be >= 1, got " + to_string(num_gpus));
    if (num_gpus > num_ranks)
        bad_option("--gpus " + to_string(num_gpus) + " exceeds --ranks " + to_string(num_ranks) +
                   " (a GPU without a rank); lower --gpus or raise --ranks");
    if (graph && host_sync)
        bad_option("--graph: a captured dispatch cannot synchronise with the host; use --graph-mode (no host sync)");
    if (rounds < 1) bad_option("--rounds must be >= 1, got " + to_string(rounds));
    if (warmup < 0) bad_option("--warmup must be >= 0, got " + to_string(warmup));
    if (prequantized && payload != Payload::kFP8) bad_option("--prequantized needs --payload fp8");
    if (!(skew >= 0.0)) bad_option("--skew must be >= 0");
    if (!(drop >= 0.0 && drop <= 1.0)) bad_option("--drop must be in [0, 1]");
    if (!(hbm_gbps >= 0.0)) bad_option("--hbm-gbps must be >= 0 (0 = measure)");
    if (timeout_ms < 1) bad_option("--timeout-ms must be >= 1, got " + to_string(timeout_ms));
    if (inject_mismatch < 0 || inject_mismatch > 2) bad_option("--inject-mismatch must be none, dispatch or combine");
    if (inject_mismatch != 0 && !verify) bad_option("--inject-mismatch needs verification on");
    buffer_config().validate(num_ranks);
}

std::string Scenario::describe() const {
    std::ostringstream os;
    os << num_ranks << " ranks";
    if (backend == BackendKind::kCUDA) os << " on " << num_gpus << (num_gpus == 1 ? " GPU" : " GPUs");
    os << ", T=" << tokens;
    if (tokens_min >= 0) os << ".." << tokens_min;
    os << "/rank";
    if (capacity > 0 && capacity != tokens) os << " (C=" << capacity << ")";
    os << ", H=" << hidden << ", E=" << num_experts << " (" << (num_ranks ? num_experts / num_ranks : 0)
       << "/rank), top-" << num_topk << ", " << payload_name(payload);
    if (payload == Payload::kFP8)
        os << " " << scale_format_name(scale_format) << (prequantized ? " pre-quantized" : "");
    os << " dispatch, bf16 combine, " << layout_name(layout);
    if (layout == Layout::kExpertContiguous) os << " A=" << alignment << (host_sync ? "" : " graph-mode");
    if (zero_padding) os << ", zero padding";
    if (scales_mn_major) os << ", MN-major scales";
    os << ", " << (weighted ? "weighted" : "unweighted") << (bias ? " + bias" : "");
    if (skew != 0.8) os << ", skew " << skew;
    if (drop > 0) os << ", drop " << drop;
    os << ", idx " << (idx_int64 ? "int64" : "int32");
    if (topology == Topology::kHybrid || ranks_per_node != 0) {
        const int p = ranks_per_node == 0 ? num_ranks : ranks_per_node;
        os << ", " << topology_name(topology) << " " << (p > 0 ? num_ranks / p : 0) << " nodes x " << p << " ranks";
        if (topology == Topology::kHybrid) os << " (scaleout " << scaleout_name(scaleout) << ")";
    }
    return os.str();
}

std::vector<Scenario> Sweep::points() const {
    std::vector<Scenario> out;
    const std::vector<int> ts = tokens.empty() ? std::vector<int>{base.tokens} : tokens;
    const std::vector<int> sms = num_sms.empty() ? std::vector<int>{base.num_sms} : num_sms;
    for (int t : ts)
        for (int m : sms) {
            Scenario s = base;
            s.tokens = t;
            s.num_sms = m;
            out.push_back(s);
        }
    return out;
}

BenchReport run_bench(const Scenario& s, const ProgressFn& progress) {
    const auto t_start = Clock::now();
    s.validate();
    BenchReport rep;
    rep.scenario = s;
    rep.backend = Buffer::resolve_backend(s.backend);
    rep.scenario.backend = rep.backend;
    if (!Buffer::backend_available(rep.backend))
        throw Error(ErrorCode::kUnsupported, std::string("backend ") + backend_name(rep.backend) +
                                                 " is not available here (" + build_backends() +
                                                 " compiled; see `elasticep info`); use --backend cpu");
    const bool cuda = rep.backend == BackendKind::kCUDA;
    if (!cuda && s.graph) bad_option("--graph times a CUDA-graph replay: it needs --backend cuda");
    if (!cuda && s.num_gpus > 1) bad_option("--gpus " + std::to_string(s.num_gpus) + " needs --backend cuda");
    const BufferConfig cfg = s.buffer_config();
    const int nr = s.num_ranks;
    const int e_local = cfg.num_experts / nr;
    const int64_t h = cfg.hidden;
    const int k = cfg.num_topk;
    const bool fp8 = cfg.payload == Payload::kFP8;
    const bool contiguous = s.layout == Layout::kExpertContiguous;
    const int64_t rc = int64_t{nr} * cfg.max_tokens_per_rank;
    const int cols = fp8 ? scale_columns(cfg.scale_format, cfg.hidden) : 0;
    const int total_rounds = s.warmup + s.rounds;
    rep.tokens = s.tokens_per_rank();

    const std::vector<RankData> data = make_inputs(s);
    for (int r = 0; r < nr; ++r) {
        const reference::RankInput& in = data[static_cast<size_t>(r)].input;
        auto idx = const_cast<int64_t*>(in.topk_idx.data());
        rep.traffic +=
            count_traffic(cfg, nr, r, TensorRef::contiguous(idx, DType::kInt64, {in.num_tokens, k}), s.prequantized);
    }
    if (cuda) {
        rep.gpu = gpu_name(0);
        if (s.num_gpus == 1) {  // the HBM floor: every rank's traffic goes through one GPU's memory
            rep.hbm_measured = s.hbm_gbps <= 0;
            rep.hbm_gbps = rep.hbm_measured ? measure_copy_gbps(0) : s.hbm_gbps;
        }
    }
    rep.setup_s = seconds_since(t_start);

    // The oracle, once: the inputs are the same every round, and so must every round's outputs be.
    std::vector<reference::RankDispatch> want_dispatch;
    std::vector<std::vector<uint16_t>> want_out;
    const reference::DispatchOptions opts{s.layout, s.alignment, s.host_sync, s.zero_padding};
    if (s.verify) {
        const auto t0 = Clock::now();
        std::vector<reference::RankInput> inputs;
        std::vector<std::vector<uint16_t>> biases;
        for (const auto& d : data) {
            inputs.push_back(d.input);
            biases.push_back(d.bias);
        }
        want_dispatch = reference::dispatch(cfg, nr, inputs, opts);
        // y from the oracle's own rows: the backend's y (made from its outputs) must equal it
        std::vector<std::vector<uint16_t>> y(static_cast<size_t>(nr));
        parallel_for(nr, [&](int d) {
            const reference::RankDispatch& w = want_dispatch[static_cast<size_t>(d)];
            y[static_cast<size_t>(d)].assign(static_cast<size_t>(w.rows * h), 0);
            expert_outputs(
                cfg, d, e_local, w.rows, w.recv_x.data(), [&](int64_t row) { return row * h; },
                [&](int64_t row, int c) { return w.recv_scales[static_cast<size_t>(row * cols + c)]; },
                [&](int64_t row) -> int {
                    if (!w.row_is_real[static_cast<size_t>(row)]) return -1;
                    return contiguous ? w.m_indices[static_cast<size_t>(row)] : static_cast<int>(row / rc);
                },
                y[static_cast<size_t>(d)].data(), false);
        });
        want_out = reference::combine(cfg, nr, inputs, opts, y, s.weighted, biases);
        rep.oracle_s = seconds_since(t0);
    }

    // the rank whose output the verifier self-test alters: the first with a real row / a token
    int inject_rank = -1;
    if (s.verify && s.inject_mismatch != 0) {
        if (cuda) throw Error(ErrorCode::kUnsupported, "--inject-mismatch alters host memory: use --backend cpu");
        for (int r = 0; r < nr && inject_rank < 0; ++r) {
            const bool has = s.inject_mismatch == 1
                                 ? std::count(want_dispatch[static_cast<size_t>(r)].row_is_real.begin(),
                                              want_dispatch[static_cast<size_t>(r)].row_is_real.end(), 1) > 0
                                 : rep.tokens[static_cast<size_t>(r)] > 0;
            if (has) inject_rank = r;
        }
        if (inject_rank < 0)
            throw Error(ErrorCode::kInvalidArgument, "--inject-mismatch: the scenario moves no rows to alter");
    }

    auto groups = ThreadGroup::create(nr, std::chrono::milliseconds(s.timeout_ms));
    std::vector<RankRecord> recs(static_cast<size_t>(nr));
    std::vector<std::exception_ptr> errors(static_cast<size_t>(nr));
    std::vector<RankDevice*> devs(static_cast<size_t>(nr), nullptr);  // for the start spread
    StartLine start_line(nr, s.timeout_ms);
    // Every timed call's marks have their own index (none is recorded twice), so that, after the
    // run, each rank can read its starts against rank 0's.
    const int iso_marks = 0;                                     // round r: dispatch 4r, 4r+1; combine 4r+2, 4r+3
    const int b2b_marks = iso_marks + 4 * total_rounds;          // round i: 3i (dispatch), 3i+1 (combine), 3i+2
    const int graph_marks = b2b_marks + 3 * s.rounds;            // round r: 2r, 2r+1
    const int b2b_graph_marks = graph_marks + 2 * total_rounds;  // round i: i, and one after the last
    const int num_marks = b2b_graph_marks + s.rounds + 1;

    auto run_rank = [&](int r) {
        const RankData& in = data[static_cast<size_t>(r)];
        RankRecord& rec = recs[static_cast<size_t>(r)];
        auto& group = groups[static_cast<size_t>(r)];
        auto dev = make_rank_device(rep.backend, r, s.num_gpus);
        dev->reserve_marks(num_marks);
        devs[static_cast<size_t>(r)] = dev.get();
        // before every timed call: the group's barrier, then the start line (Scenario::start_line)
        auto line_up = [&] {
            dev->synchronize();
            group->barrier();
            if (s.start_line) start_line.wait(r);
        };
        BufferConfig rank_cfg = cfg;
        rank_cfg.device = dev->device();
        auto buf = Buffer::create(group, rank_cfg, rep.backend);
        if (r == 0) {
            rep.scaleout = buf->scaleout();
            rep.kernel_path = buf->kernel_path();
        }
        const int64_t t_count = in.input.num_tokens;

        DispatchArgs args;
        if (s.prequantized) {
            args.x = dev->upload(in.input.x_fp8.data(), DType::kFloat8E4M3, {t_count, h});
            args.x_scales = dev->upload(in.input.x_scales.data(),
                                        cfg.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32,
                                        {t_count, cols});
        } else {
            args.x = dev->upload(in.input.x.data(), DType::kBFloat16, {t_count, h});
        }
        args.topk_idx = s.idx_int64 ? dev->upload(in.input.topk_idx.data(), DType::kInt64, {t_count, k})
                                    : dev->upload(in.idx32.data(), DType::kInt32, {t_count, k});
        if (s.weighted) args.topk_weights = dev->upload(in.input.topk_weights.data(), DType::kFloat32, {t_count, k});
        args.layout = s.layout;
        args.expert_alignment = s.alignment;
        args.host_sync = s.host_sync;
        args.zero_padding = s.zero_padding;
        args.scales_mn_major = s.scales_mn_major;
        args.stream = dev->stream();

        CombineArgs cargs;
        cargs.weighted = s.weighted;
        if (s.bias) cargs.bias = dev->upload(in.bias.data(), DType::kBFloat16, {t_count, h});
        cargs.stream = dev->stream();
        // caller-provided outputs: one for the isolated rounds, one per back-to-back round (each is
        // verified after the run), one for the graph
        const TensorRef out_iso = dev->scratch(DType::kBFloat16, {t_count, h});
        std::vector<TensorRef> out_b2b;
        if (s.back_to_back)
            for (int i = 0; i < s.rounds; ++i) out_b2b.push_back(dev->scratch(DType::kBFloat16, {t_count, h}));
        const TensorRef out_graph = s.graph ? dev->scratch(DType::kBFloat16, {t_count, h}) : TensorRef{};
        const reference::RankDispatch* want = s.verify ? &want_dispatch[static_cast<size_t>(r)] : nullptr;
        const std::vector<uint16_t>* want_o = s.verify ? &want_out[static_cast<size_t>(r)] : nullptr;

        auto check_dispatch = [&](const DispatchResult& res, const std::string& what) {
            if (!want) return true;
            const Mismatch mm = verify_dispatch(s, cfg, res, *want, *dev);
            if (mm.count && rec.failures.size() < kMaxFailures)
                rec.failures.push_back(what + " rank " + std::to_string(r) + " dispatch: " + mm.first + " (" +
                                       std::to_string(mm.count) + " mismatches)");
            return mm.count == 0;
        };
        auto check_combine = [&](const TensorRef& out, const std::string& what) {
            if (!want_o) return true;
            const Mismatch mm = verify_combine(out, t_count, h, *want_o, *dev);
            if (mm.count && rec.failures.size() < kMaxFailures)
                rec.failures.push_back(what + " rank " + std::to_string(r) + " combine: " + mm.first + " (" +
                                       std::to_string(mm.count) + " mismatches)");
            return mm.count == 0;
        };

        std::vector<uint16_t> y_host;  // the expert outputs (the CPU backend reads them in place)

        // ---- isolated rounds ----
        for (int round = 0; round < total_rounds; ++round) {
            const auto t_round = Clock::now();
            const std::string what = "round " + std::to_string(round);
            const int m = iso_marks + 4 * round;
            line_up();
            dev->mark(m);
            const auto t_call = Clock::now();
            DispatchResult res = buf->dispatch(args);
            rec.dispatch_host_us.push_back(seconds_since(t_call) * 1e6);
            dev->mark(m + 1);
            dev->synchronize();
            rec.dispatch_us.push_back(dev->elapsed_us(m, m + 1));
            if (round == 0) {
                rec.num_sms = res.handle.num_sms();
                // the stand-in expert, on this rank's own rows, once (outside every timed call)
                const int64_t rows = contiguous ? res.recv_x.size(0) : int64_t{e_local} * rc;
                y_host.assign(static_cast<size_t>(rows * h), 0);
                const RowAddress at{!contiguous, rc};
                const auto* x = static_cast<const uint8_t*>(dev->fetch(res.recv_x, span_bytes(res.recv_x), 2));
                const auto* sc =
                    fp8 ? static_cast<const uint32_t*>(dev->fetch(*res.recv_scales, span_bytes(*res.recv_scales), 6))
                        : nullptr;
                const int32_t* mi =
                    contiguous ? static_cast<const int32_t*>(dev->fetch(res.m_indices, span_bytes(res.m_indices), 5))
                               : nullptr;
                const auto* counts = static_cast<const int32_t*>(dev->fetch(res.counts, span_bytes(res.counts), 0));
                expert_outputs(
                    cfg, r, e_local, rows, x, [&](int64_t row) { return at(res.recv_x, row, 0); },
                    [&](int64_t row, int c) { return sc[at(*res.recv_scales, row, c)]; },
                    [&](int64_t row) -> int {
                        if (contiguous) return mi[row * res.m_indices.stride(0)];
                        const int l = static_cast<int>(row / rc);
                        return row % rc < counts[l] ? l : -1;
                    },
                    y_host.data(), contiguous);
                cargs.y = dev->upload(y_host.data(), DType::kBFloat16, res.recv_x.shape);
            }
            if (s.inject_mismatch == 1 && round == s.warmup && r == inject_rank) {
                // flip a bit of the first real row's first byte (host memory on the CPU backend)
                const auto real = std::find(want->row_is_real.begin(), want->row_is_real.end(), 1);
                const int64_t row = real - want->row_is_real.begin();
                static_cast<uint8_t*>(res.recv_x.data)[RowAddress{!contiguous, rc}(res.recv_x, row, 0) *
                                                       static_cast<int64_t>(dtype_size(res.recv_x.dtype))] ^= 0x01;
            }
            rec.dispatch_checks.push_back(check_dispatch(res, what));

            cargs.out = out_iso;
            line_up();
            dev->mark(m + 2);
            const auto t_combine = Clock::now();
            CombineResult out = buf->combine(std::move(res.handle), cargs);
            rec.combine_host_us.push_back(seconds_since(t_combine) * 1e6);
            dev->mark(m + 3);
            dev->synchronize();
            rec.combine_us.push_back(dev->elapsed_us(m + 2, m + 3));
            if (s.inject_mismatch == 2 && round == s.warmup && r == inject_rank)
                static_cast<uint16_t*>(out.out.data)[0] ^= 0x0001;
            rec.combine_checks.push_back(check_combine(out.out, what));
            if (r == 0 && progress) progress(round, total_rounds, seconds_since(t_round));
        }
        buf->check();

        // ---- back to back: no host synchronisation between the calls ----
        if (s.back_to_back) {
            line_up();
            DispatchResult last;
            for (int i = 0; i < s.rounds; ++i) {
                const int m = b2b_marks + 3 * i;
                dev->mark(m);
                DispatchResult res = buf->dispatch(args);
                dev->mark(m + 1);
                cargs.out = out_b2b[static_cast<size_t>(i)];
                buf->combine(std::move(res.handle), cargs);
                dev->mark(m + 2);
                if (i == s.rounds - 1) last = std::move(res);
            }
            dev->synchronize();
            for (int i = 0; i < s.rounds; ++i) {
                const int m = b2b_marks + 3 * i;
                rec.b2b_dispatch_us.push_back(dev->elapsed_us(m, m + 1));
                rec.b2b_combine_us.push_back(dev->elapsed_us(m + 1, m + 2));
            }
            rec.dispatch_checks.push_back(check_dispatch(last, "back-to-back round " + std::to_string(s.rounds - 1)));
            for (int i = 0; i < s.rounds; ++i)
                rec.combine_checks.push_back(
                    check_combine(out_b2b[static_cast<size_t>(i)], "back-to-back round " + std::to_string(i)));
            buf->check();
        }

        // ---- a captured dispatch + combine, replayed ----
        if (s.graph) {
            dev->synchronize();
            group->barrier();
            DispatchResult gres;
            auto replay = dev->capture([&] {
                gres = buf->dispatch(args);
                cargs.out = out_graph;
                buf->combine(std::move(gres.handle), cargs);
            });
            for (int round = 0; round < total_rounds; ++round) {
                const int m = graph_marks + 2 * round;
                line_up();
                dev->mark(m);
                replay->launch();
                dev->mark(m + 1);
                dev->synchronize();
                rec.graph_us.push_back(dev->elapsed_us(m, m + 1));
            }
            line_up();
            for (int i = 0; i < s.rounds; ++i) {
                dev->mark(b2b_graph_marks + i);
                replay->launch();
            }
            dev->mark(b2b_graph_marks + s.rounds);
            dev->synchronize();
            for (int i = 0; i < s.rounds; ++i)
                rec.b2b_graph_us.push_back(dev->elapsed_us(b2b_graph_marks + i, b2b_graph_marks + i + 1));
            const bool d_ok = check_dispatch(gres, "graph replay");
            const bool c_ok = check_combine(out_graph, "graph replay");
            rec.graph_checks.push_back(d_ok && c_ok);
            buf->check();
        }
        // every call's start against rank 0's (its marks are complete once it passes the barrier)
        dev->synchronize();
        group->barrier();
        RankDevice& ref = *devs[0];
        auto starts = [&](std::vector<double>& into, size_t calls, int first, int step) {
            for (size_t i = 0; i < calls; ++i) {
                const int mk = first + step * static_cast<int>(i);
                into.push_back(dev->since_us(ref, mk, mk));
            }
        };
        starts(rec.dispatch_at, rec.dispatch_us.size(), iso_marks, 4);
        starts(rec.combine_at, rec.combine_us.size(), iso_marks + 2, 4);
        starts(rec.b2b_dispatch_at, rec.b2b_dispatch_us.size(), b2b_marks, 3);
        starts(rec.b2b_combine_at, rec.b2b_combine_us.size(), b2b_marks + 1, 3);
        starts(rec.graph_at, rec.graph_us.size(), graph_marks, 2);
        starts(rec.b2b_graph_at, rec.b2b_graph_us.size(), b2b_graph_marks, 1);
        group->barrier();  // no rank frees its memory while a peer may still read it (or rank 0's marks)
    };
    std::vector<std::thread> threads;
    for (int r = 0; r < nr; ++r)
        threads.emplace_back([&, r] {
            try {
                run_rank(r);
            } catch (...) {
                errors[static_cast<size_t>(r)] = std::current_exception();
            }
        });
    for (auto& t : threads) t.join();
    if (std::any_of(errors.begin(), errors.end(), [](const std::exception_ptr& e) { return bool(e); }))
        rethrow_cause(errors);

    const Traffic& tr = rep.traffic;
    rep.num_sms_used = recs[0].num_sms;
    rep.dispatch.name = "dispatch";
    rep.dispatch.isolated =
        timing(recs, &RankRecord::dispatch_us, s.warmup, &RankRecord::dispatch_at, &RankRecord::dispatch_host_us);
    rep.dispatch.back_to_back = timing(recs, &RankRecord::b2b_dispatch_us, 0, &RankRecord::b2b_dispatch_at);
    set_bytes(rep.dispatch, tr.peer_messages, tr.local_messages, tr.dispatch_peer_bytes(), tr.dispatch_local_bytes(),
              tr.dispatch_hbm_bytes, tr.dispatch_min_hbm_bytes, rep.hbm_gbps);
    tally(rep.dispatch, recs, &RankRecord::dispatch_checks);
    rep.combine.name = "combine";
    rep.combine.isolated =
        timing(recs, &RankRecord::combine_us, s.warmup, &RankRecord::combine_at, &RankRecord::combine_host_us);
    rep.combine.back_to_back = timing(recs, &RankRecord::b2b_combine_us, 0, &RankRecord::b2b_combine_at);
    set_bytes(rep.combine, tr.peer_messages, tr.local_messages, tr.combine_peer_bytes(), tr.combine_local_bytes(),
              tr.combine_hbm_bytes, tr.combine_min_hbm_bytes, rep.hbm_gbps);
    tally(rep.combine, recs, &RankRecord::combine_checks);
    if (s.graph) {
        rep.graph.name = "graph";
        rep.graph.isolated = timing(recs, &RankRecord::graph_us, s.warmup, &RankRecord::graph_at);
        rep.graph.back_to_back = timing(recs, &RankRecord::b2b_graph_us, 0, &RankRecord::b2b_graph_at);
        set_bytes(rep.graph, tr.peer_messages, tr.local_messages, tr.dispatch_peer_bytes() + tr.combine_peer_bytes(),
                  tr.dispatch_local_bytes() + tr.combine_local_bytes(), tr.dispatch_hbm_bytes + tr.combine_hbm_bytes,
                  tr.dispatch_min_hbm_bytes + tr.combine_min_hbm_bytes, rep.hbm_gbps);
        tally(rep.graph, recs, &RankRecord::graph_checks);
    }
    if (!s.verify)
        for (PhaseStats* p : {&rep.dispatch, &rep.combine, &rep.graph}) p->rounds_verified = p->rounds_failed = 0;
    for (const auto& rec : recs)
        for (const auto& f : rec.failures)
            if (rep.failures.size() < kMaxFailures) rep.failures.push_back(f);
    rep.verified =
        s.verify && rep.dispatch.rounds_failed == 0 && rep.combine.rounds_failed == 0 && rep.graph.rounds_failed == 0;
    rep.wall_s = seconds_since(t_start);
    return rep;
}

}  // namespace elasticep::cli
