// `elasticep bench`: ranks are threads of this process (ThreadGroup), one Buffer each. Every
// round: barrier, timed dispatch, verification against the oracle, the stand-in expert computes
// y from what arrived, barrier, timed combine, verification. Verification reads the outputs
// between the timed calls, so it never counts as latency.
#include "bench.hpp"

#include <algorithm>
#include <chrono>
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
                         const reference::RankDispatch& want, BenchMemory& mem) {
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

struct RankRecord {
    std::vector<double> dispatch_us, combine_us;  // per round, warm-up included
    std::vector<char> dispatch_ok, combine_ok;
    std::vector<std::string> failures;
};

double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void summarize(PhaseStats& p, const std::vector<RankRecord>& recs, bool dispatch, int warmup, int rounds,
               int64_t peer_bytes, int64_t local_bytes) {
    for (int r = warmup; r < warmup + rounds; ++r) {
        std::vector<double> ranks;
        for (const auto& rec : recs)
            ranks.push_back((dispatch ? rec.dispatch_us : rec.combine_us)[static_cast<size_t>(r)]);
        p.rank_us.push_back(ranks);
        p.round_us.push_back(*std::max_element(ranks.begin(), ranks.end()));
    }
    for (int r = 0; r < warmup + rounds; ++r) {
        bool ok = true;
        for (const auto& rec : recs) ok = ok && (dispatch ? rec.dispatch_ok : rec.combine_ok)[static_cast<size_t>(r)];
        ++(ok ? p.rounds_verified : p.rounds_failed);
    }
    p.median_us = median(p.round_us);
    p.mean_us = std::accumulate(p.round_us.begin(), p.round_us.end(), 0.0) / std::max<size_t>(1, p.round_us.size());
    p.min_us = *std::min_element(p.round_us.begin(), p.round_us.end());
    p.max_us = *std::max_element(p.round_us.begin(), p.round_us.end());
    p.peer_bytes = peer_bytes;
    p.local_bytes = local_bytes;
    if (p.median_us > 0) {
        p.peer_gbps = static_cast<double>(peer_bytes) / (p.median_us * 1e3);
        p.total_gbps = static_cast<double>(peer_bytes + local_bytes) / (p.median_us * 1e3);
    }
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
    if (num_ranks < 1) bad_option("--ranks " + to_string(num_ranks) + " must be at least 1");
    if (tokens < 0) bad_option("--tokens " + to_string(tokens) + " must be >= 0");
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
    if (alignment < 1) bad_option("--alignment " + to_string(alignment) + " must be >= 1");
    if (rounds < 1) bad_option("--rounds must be at least 1");
    if (warmup < 0) bad_option("--warmup must be >= 0");
    if (prequantized && payload != Payload::kFP8) bad_option("--prequantized needs --payload fp8");
    if (!(skew >= 0.0)) bad_option("--skew must be >= 0");
    if (!(drop >= 0.0 && drop <= 1.0)) bad_option("--drop must be in [0, 1]");
    if (timeout_ms < 1) bad_option("--timeout-ms must be positive");
    if (inject_mismatch < 0 || inject_mismatch > 2) bad_option("--inject-mismatch must be none, dispatch or combine");
    if (inject_mismatch != 0 && (!verify || rounds < 1)) bad_option("--inject-mismatch needs verification on");
    buffer_config().validate(num_ranks);
}

std::string Scenario::describe() const {
    std::ostringstream os;
    os << num_ranks << " ranks, T=" << tokens;
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
    if (drop > 0) os << ", drop " << drop;
    os << ", idx " << (idx_int64 ? "int64" : "int32");
    return os.str();
}

BenchReport run_bench(const Scenario& s, const ProgressFn& progress) {
    const auto t_start = Clock::now();
    s.validate();
    BenchReport rep;
    rep.scenario = s;
    rep.backend = Buffer::resolve_backend(s.backend);
    if (!Buffer::backend_available(rep.backend))
        throw Error(ErrorCode::kUnsupported, std::string("backend ") + backend_name(rep.backend) +
                                                 " is not available here (" + build_backends() +
                                                 " compiled; see `elasticep info`); use --backend cpu");
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
    rep.message_bytes = MessageLayout::make(cfg.hidden, k, fp8 ? 1 : 2, cols).bytes;

    const std::vector<RankData> data = make_inputs(s);
    const Traffic traffic = count_traffic(s, data);
    rep.rows_received = traffic.routes;
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
        if (rep.backend != BackendKind::kCPU)
            throw Error(ErrorCode::kUnsupported, "--inject-mismatch alters host memory: use --backend cpu");
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
    std::vector<std::thread> threads;

    auto run_rank = [&](int r) {
        const RankData& in = data[static_cast<size_t>(r)];
        RankRecord& rec = recs[static_cast<size_t>(r)];
        auto& group = groups[static_cast<size_t>(r)];
        auto mem = make_bench_memory(rep.backend, r);
        auto timer = make_phase_timer(rep.backend);
        auto buf = Buffer::create(group, cfg, rep.backend);
        const int64_t t_count = in.input.num_tokens;

        DispatchArgs args;
        if (s.prequantized) {
            args.x = mem->upload(in.input.x_fp8.data(), DType::kFloat8E4M3, {t_count, h});
            args.x_scales = mem->upload(in.input.x_scales.data(),
                                        cfg.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32,
                                        {t_count, cols});
        } else {
            args.x = mem->upload(in.input.x.data(), DType::kBFloat16, {t_count, h});
        }
        args.topk_idx = s.idx_int64 ? mem->upload(in.input.topk_idx.data(), DType::kInt64, {t_count, k})
                                    : mem->upload(in.idx32.data(), DType::kInt32, {t_count, k});
        if (s.weighted) args.topk_weights = mem->upload(in.input.topk_weights.data(), DType::kFloat32, {t_count, k});
        args.layout = s.layout;
        args.expert_alignment = s.alignment;
        args.host_sync = s.host_sync;
        args.zero_padding = s.zero_padding;
        args.scales_mn_major = s.scales_mn_major;
        args.stream = mem->stream();

        CombineArgs cargs;
        cargs.weighted = s.weighted;
        if (s.bias) cargs.bias = mem->upload(in.bias.data(), DType::kBFloat16, {t_count, h});
        cargs.stream = mem->stream();
        std::vector<uint16_t> y_host;
        TensorRef y_dev;

        for (int round = 0; round < total_rounds; ++round) {
            const auto t_round = Clock::now();
            group->barrier();
            timer->start(args.stream);
            DispatchResult res = buf->dispatch(args);
            rec.dispatch_us.push_back(timer->stop_us(args.stream));

            bool ok = true;
            if (s.verify && s.inject_mismatch == 1 && round == s.warmup && r == inject_rank) {
                // flip a bit of the first real row's first byte (host memory on the CPU backend)
                const auto& want = want_dispatch[static_cast<size_t>(r)];
                const auto real = std::find(want.row_is_real.begin(), want.row_is_real.end(), 1);
                const int64_t row = real - want.row_is_real.begin();
                static_cast<uint8_t*>(res.recv_x.data)[RowAddress{!contiguous, rc}(res.recv_x, row, 0) *
                                                       static_cast<int64_t>(dtype_size(res.recv_x.dtype))] ^= 0x01;
            }
            if (s.verify) {
                const Mismatch mm = verify_dispatch(s, cfg, res, want_dispatch[static_cast<size_t>(r)], *mem);
                ok = mm.count == 0;
                if (!ok && rec.failures.size() < kMaxFailures)
                    rec.failures.push_back("round " + std::to_string(round) + " rank " + std::to_string(r) +
                                           " dispatch: " + mm.first + " (" + std::to_string(mm.count) + " mismatches)");
            }
            rec.dispatch_ok.push_back(ok);

            // the stand-in expert, on this rank's own rows
            const int64_t rows = contiguous ? res.recv_x.size(0) : int64_t{e_local} * rc;
            const bool reshape = y_dev.shape != res.recv_x.shape;
            if (reshape) {
                y_host.assign(static_cast<size_t>(rows * h), 0);
                y_dev = mem->scratch(DType::kBFloat16, res.recv_x.shape);
            }
            const RowAddress at{!contiguous, rc};
            const auto* x = static_cast<const uint8_t*>(mem->fetch(res.recv_x, span_bytes(res.recv_x), 2));
            const auto* sc =
                fp8 ? static_cast<const uint32_t*>(mem->fetch(*res.recv_scales, span_bytes(*res.recv_scales), 6))
                    : nullptr;
            const int32_t* mi =
                contiguous ? static_cast<const int32_t*>(mem->fetch(res.m_indices, span_bytes(res.m_indices), 5))
                           : nullptr;
            const auto* counts = static_cast<const int32_t*>(mem->fetch(res.counts, span_bytes(res.counts), 0));
            expert_outputs(
                cfg, r, e_local, rows, x, [&](int64_t row) { return at(res.recv_x, row, 0); },
                [&](int64_t row, int c) { return sc[at(*res.recv_scales, row, c)]; },
                [&](int64_t row) -> int {
                    if (contiguous) return mi[row * res.m_indices.stride(0)];
                    const int l = static_cast<int>(row / rc);
                    return row % rc < counts[l] ? l : -1;
                },
                y_host.data(), contiguous);
            mem->refresh(y_dev, y_host.data());
            cargs.y = y_dev;

            group->barrier();
            timer->start(cargs.stream);
            CombineResult out = buf->combine(std::move(res.handle), cargs);
            rec.combine_us.push_back(timer->stop_us(cargs.stream));

            ok = true;
            if (s.verify && s.inject_mismatch == 2 && round == s.warmup && r == inject_rank)
                static_cast<uint16_t*>(out.out.data)[0] ^= 0x0001;
            if (s.verify) {
                Mismatch mm;
                if (out.out.shape != std::vector<int64_t>{t_count, h}) {
                    mm.add("out is ", out.out.describe(), ", want [", t_count, ", ", h, "]");
                } else {
                    const auto* o = static_cast<const uint16_t*>(mem->fetch(out.out, span_bytes(out.out), 7));
                    const std::vector<uint16_t>& want = want_out[static_cast<size_t>(r)];
                    for (int64_t t = 0; t < t_count; ++t)
                        for (int64_t c = 0; c < h; ++c) {
                            const uint16_t g = o[t * out.out.stride(0) + c];
                            const uint16_t e = want[static_cast<size_t>(t * h + c)];
                            if (g != e)
                                mm.add("out[", t, ", ", c, "] = ", hex(g), " (", num::bf16_to_float(g), "), want ",
                                       hex(e), " (", num::bf16_to_float(e), ")");
                        }
                }
                ok = mm.count == 0;
                if (!ok && rec.failures.size() < kMaxFailures)
                    rec.failures.push_back("round " + std::to_string(round) + " rank " + std::to_string(r) +
                                           " combine: " + mm.first + " (" + std::to_string(mm.count) + " mismatches)");
            }
            rec.combine_ok.push_back(ok);
            if (r == 0 && progress) progress(round, total_rounds, seconds_since(t_round));
        }
    };
    for (int r = 0; r < nr; ++r)
        threads.emplace_back([&, r] {
            try {
                run_rank(r);
            } catch (...) {
                errors[static_cast<size_t>(r)] = std::current_exception();
            }
        });
    for (auto& t : threads) t.join();
    // A failing rank makes its peers time out; report the cause, not the consequence.
    std::exception_ptr first, first_timeout;
    for (auto& e : errors) {
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
    if (first) std::rethrow_exception(first);
    if (first_timeout) std::rethrow_exception(first_timeout);

    const int64_t msg = rep.message_bytes;
    summarize(rep.dispatch, recs, true, s.warmup, s.rounds, traffic.peer_messages * msg, traffic.local_messages * msg);
    summarize(rep.combine, recs, false, s.warmup, s.rounds, traffic.peer_messages * h * 2,
              traffic.local_messages * h * 2);
    rep.dispatch.name = "dispatch";
    rep.combine.name = "combine";
    for (PhaseStats* p : {&rep.dispatch, &rep.combine}) {
        p->peer_messages = traffic.peer_messages;
        p->local_messages = traffic.local_messages;
        if (!s.verify) p->rounds_verified = 0;
    }
    for (const auto& rec : recs)
        for (const auto& f : rec.failures)
            if (rep.failures.size() < kMaxFailures) rep.failures.push_back(f);
    rep.verified = s.verify && rep.dispatch.rounds_failed == 0 && rep.combine.rounds_failed == 0;
    rep.wall_s = seconds_since(t_start);
    return rep;
}

}  // namespace elasticep::cli
