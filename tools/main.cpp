// The `elasticep` command line: bench (dispatch + combine timed and verified), info, check.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <regex>

#include "commands.hpp"
#include "elasticep/error.hpp"
#include "elasticep/limits.hpp"
#include "elasticep/version.hpp"
#include "moe_layer.hpp"

namespace elasticep::cli {

void JsonOutput::open(const std::string& option) {
    if (!requested || path.empty() || path == "-") return;
    file = std::make_unique<std::ofstream>(path, std::ios::out | std::ios::trunc);
    if (!*file) {
        const std::string why = std::strerror(errno);
        file.reset();
        throw Error(ErrorCode::kInvalidArgument,
                    option + " " + path + ": cannot open it for writing (" + why + "); create its folder first");
    }
}

void JsonOutput::emit(const std::string& json, const std::string& text) {
    if (file) {
        *file << json;
        file->flush();
        if (!*file) throw Error(ErrorCode::kInvalidArgument, "--json " + path + ": writing failed");
    }
    std::cout << (to_stdout() ? json : text);
    std::cout.flush();
}

namespace {

std::string number_text(long double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.10Lg", v);
    return buf;
}

// Range checks that read like the library's errors: "--ranks must be >= 1, got 0" (the failure
// message below drops CLI11's colon after the option name).
CLI::Validator int_range(long long lo, long long hi = INT_MAX) {
    const std::string desc = hi == INT_MAX ? "INT>=" + std::to_string(lo)
                                           : "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    return CLI::Validator(
        [lo, hi](std::string& in) -> std::string {
            errno = 0;
            char* end = nullptr;
            const long long v = std::strtoll(in.c_str(), &end, 10);
            const std::string want = hi == INT_MAX ? ">= " + std::to_string(lo)
                                                   : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
            if (in.empty() || *end != '\0') return "must be an integer " + want + ", got '" + in + "'";
            if (errno == ERANGE || v > hi)
                return hi == INT_MAX ? "must be <= " + std::to_string(INT_MAX) + ", got " + in
                                     : "must be " + want + ", got " + in;
            if (v < lo) return "must be " + want + ", got " + in;
            return "";
        },
        desc);
}

CLI::Validator real_range(long double lo, long double hi) {
    const bool open_top = hi == HUGE_VALL;
    const std::string want =
        open_top ? ">= " + number_text(lo) : "in [" + number_text(lo) + ", " + number_text(hi) + "]";
    return CLI::Validator(
        [lo, hi, want](std::string& in) -> std::string {
            char* end = nullptr;
            const long double v = std::strtold(in.c_str(), &end);
            if (in.empty() || *end != '\0' || v != v) return "must be a number " + want + ", got '" + in + "'";
            if (v < lo || v > hi) return "must be " + want + ", got " + in;
            return "";
        },
        open_top ? "NUM>=" + number_text(lo) : "NUM in [" + number_text(lo) + ", " + number_text(hi) + "]");
}

// `--json [FILE]`.
void add_json_option(CLI::App* app, JsonOutput& j, const char* what) {
    app->add_option_function<std::vector<std::string>>(
           "--json",
           [&j](const std::vector<std::string>& v) {
               j.requested = true;
               j.path = v.empty() ? "" : v.back();
           },
           std::string("print ") + what +
               " as JSON on stdout instead of the text; with FILE, write the JSON there "
               "(the text still goes to stdout)")
        ->expected(0, 1)
        ->type_name("[FILE]");
}

// Choice options are read as text (CLI11 checks membership, the library parses the name).
struct Choices {
    std::string payload = "fp8", scale_format = "f32_g128", backend = "auto", topology = "direct", scaleout = "auto";
};

// The buffer-shape options bench and info share (one line each).
// `tokens_list`: bench takes a comma list (one report row per value); info one value. Returns
// the options so info can tell whether any was given.
std::vector<CLI::Option*> add_shape_options(CLI::App* app, Scenario& s, Choices& c, std::vector<int>* tokens_list) {
    std::vector<CLI::Option*> o;
    o.push_back(app->add_option("--ranks,-r", s.num_ranks, "ranks (threads of this process), one Buffer each")
                    ->check(int_range(1))
                    ->capture_default_str());
    if (tokens_list)
        o.push_back(app->add_option("--tokens,-t", *tokens_list,
                                    "tokens per rank (the busiest rank with --tokens-min); a comma list runs one row "
                                    "per value")
                        ->delimiter(',')
                        ->check(int_range(0))
                        ->default_str(std::to_string(s.tokens)));
    else
        o.push_back(
            app->add_option("--tokens,-t", s.tokens, "tokens per rank")->check(int_range(0))->capture_default_str());
    o.push_back(
        app->add_option("--max-tokens-per-rank,--capacity", s.capacity, "buffer capacity C per rank (0 = --tokens)")
            ->check(int_range(0))
            ->capture_default_str());
    o.push_back(app->add_option("--hidden", s.hidden, "hidden size H (multiple of 8, or of the fp8 scale group)")
                    ->check(int_range(1))
                    ->capture_default_str());
    o.push_back(app->add_option("--experts,-e", s.num_experts, "experts E (a multiple of --ranks)")
                    ->check(int_range(1))
                    ->capture_default_str());
    o.push_back(app->add_option("--topk,-k", s.num_topk, "experts per token K")
                    ->check(int_range(1, kMaxTopk))
                    ->capture_default_str());
    o.push_back(app->add_option("--payload", c.payload, "dispatch payload")
                    ->check(CLI::IsMember({"bf16", "fp8"}))
                    ->capture_default_str());
    o.push_back(app->add_option("--scale-format", c.scale_format, "fp8 scale format")
                    ->check(CLI::IsMember({"f32_g128", "ue8m0_g128", "ue8m0_g32"}))
                    ->capture_default_str());
    o.push_back(app->add_option("--alignment,-a", s.alignment, "contiguous layout: expert segment alignment A")
                    ->check(int_range(1, kMaxExpertAlignment))
                    ->capture_default_str());
    o.push_back(app->add_flag("--mn-major", s.scales_mn_major, "fp8: MN-major (column-major) received scales"));
    o.push_back(app->add_option("--backend", c.backend, "backend (auto = cuda when a GPU is usable, else cpu)")
                    ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
                    ->capture_default_str());
    o.push_back(app->add_option("--topology", c.topology,
                                "direct (every rank writes into every peer) or hybrid (one network hop per "
                                "destination node, then NVLink forwarding)")
                    ->check(CLI::IsMember({"direct", "hybrid"}))
                    ->capture_default_str());
    o.push_back(app->add_option("--ranks-per-node", s.ranks_per_node,
                                "ranks per node P, a divisor of --ranks (0 = all ranks one node); with several nodes "
                                "combine reduces per node first")
                    ->check(int_range(0))
                    ->capture_default_str());
    o.push_back(app->add_option("--scaleout", c.scaleout,
                                "hybrid's network hop: emulated (peer copies; one host), nccl (NCCL point-to-point: "
                                "its rail ranks must not share a GPU inside this process, e.g. --gpus with one node "
                                "per GPU), gin (NCCL GIN: needs an RDMA NIC), auto")
                    ->check(CLI::IsMember({"auto", "emulated", "nccl", "gin"}))
                    ->capture_default_str());
    return o;
}

void apply_choices(Scenario& s, const Choices& c) {
    s.payload = parse_payload(c.payload);
    s.scale_format = parse_scale_format(c.scale_format);
    s.backend = parse_backend(c.backend);
    s.topology = parse_topology(c.topology);
    s.scaleout = parse_scaleout(c.scaleout);
}

// Library validation of a whole scenario (E % R, H vs scale group, capacity...), reported as a
// usage error before anything runs.
void check_scenario(const Scenario& s) {
    try {
        s.validate();
    } catch (const Error& e) {
        throw CLI::ValidationError(e.message());
    }
}

std::string failure_text(const CLI::Error& e) {
    std::string what = e.what();
    // CLI11 writes "--ranks: must be >= 1, got 0"; the library's style has no colon there
    static const std::regex option_colon("^(-[-A-Za-z0-9,]+): (must .*)$");
    what = std::regex_replace(what, option_colon, "$1 $2");
    return "error: " + what + "\nRun with --help for more information.\n";
}

int bench_main(BenchOptions& o) {
    const bool tty = isatty(STDERR_FILENO) != 0;
    const std::vector<Scenario> points = o.sweep.points();
    std::vector<BenchReport> reports;
    for (const Scenario& s : points) {
        bool printed = false;
        ProgressFn progress;
        if (o.progress)
            progress = [&](int round, int total, double sec) {
                if (!tty && sec < 1.0) return;
                std::fprintf(stderr,
                             tty ? "\rT=%d sms=%d: round %d/%d (%.2f s)" : "T=%d sms=%d: round %d/%d (%.2f s)\n",
                             s.tokens, s.num_sms, round + 1, total, sec);
                std::fflush(stderr);
                printed = tty;
            };
        reports.push_back(run_bench(s, progress));
        if (printed) std::fprintf(stderr, "\r%60s\r", "");
    }
    o.json.emit(report_json(reports), format_report(reports));
    for (const BenchReport& r : reports)
        if (r.scenario.verify && !r.verified) return kExitFailed;
    return kExitOk;
}

}  // namespace

int run_bench_command(BenchOptions& o) { return bench_main(o); }

}  // namespace elasticep::cli

int main(int argc, char** argv) {
    using namespace elasticep;
    using namespace elasticep::cli;
    // Several ranks may share a GPU: give every stream its own hardware queue, before CUDA starts
    // (an explicit setting in the environment wins).
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);

    const std::vector<std::string> commands = {"bench", "info", "check"};
    if (argc > 1 && argv[1][0] != '-' && std::find(commands.begin(), commands.end(), argv[1]) == commands.end()) {
        std::fprintf(stderr,
                     "error: unknown command '%s'; the commands are bench, info and check\n"
                     "Run with --help for more information.\n",
                     argv[1]);
        return kExitError;
    }

    CLI::App app{std::string("elasticep ") + version_string() +
                 ": Mixture-of-Experts dispatch/combine across expert-parallel ranks"};
    app.require_subcommand(1);
    app.set_version_flag("--version", version_string());
    app.failure_message([](const CLI::App*, const CLI::Error& e) { return failure_text(e); });

    // ---- bench ----
    BenchOptions bo;
    Scenario& bs = bo.sweep.base;
    Choices bc;
    std::string layout = "contiguous", inject = "none";
    auto* bench = app.add_subcommand(
        "bench",
        "Time rounds of dispatch + combine, each verified bit for bit against the oracle.\n"
        "Default scenario: DeepSeek-V3 MoE shape (H=7168, 256 experts, top-8, fp8 f32_g128 dispatch, bf16 combine)\n"
        "on 8 ranks x 128 tokens, 5 timed rounds + 1 warm-up: 5-15 s on 2 CPU cores with verification.\n"
        "Ranks are threads of this process; with --backend cuda rank r runs on GPU r % --gpus.\n"
        "Timings per phase: isolated (the ranks meet at a barrier before every call) and back to back (the\n"
        "rounds enqueued without host synchronisation); --graph adds replays of a captured dispatch + combine.\n"
        "Latency of a round = its slowest rank; the table shows medians. Bytes count one message per token\n"
        "and destination rank (peers and the rank itself apart), as include/elasticep/traffic.hpp counts them.\n"
        "--tokens and --sms take comma lists: one row per combination. Exit code 1 when a verification fails,\n"
        "2 on errors. CUDA_DEVICE_MAX_CONNECTIONS defaults to 32 (ranks sharing a GPU).");
    add_shape_options(bench, bs, bc, &bo.sweep.tokens);
    bench
        ->add_option("--tokens-min", bs.tokens_min,
                     "uneven tokens: rank r gets a linear share from --tokens down to this")
        ->check(int_range(0));
    bench->add_option("--layout", layout, "dispatch layout")
        ->check(CLI::IsMember({"contiguous", "masked"}))
        ->capture_default_str();
    bool graph_mode = false;
    bench->add_flag("--graph-mode", graph_mode,
                    "contiguous: graph mode, no host sync (fixed M_cap rows; bad routes become sticky faults); the "
                    "masked layout always runs so");
    bench->add_flag(
        "--graph", bs.graph,
        "cuda: also time a CUDA graph of one dispatch + combine, replayed (implies --graph-mode: a captured "
        "call cannot synchronise with the host)");
    bench->add_flag("!--no-b2b", bs.back_to_back, "skip the back-to-back timing");
    bench->add_flag("--start-line", bs.start_line,
                    "after the group's barrier before every timed call, also release the ranks together from a "
                    "spinning start line (the barrier wakes them one after another)");
    bench->add_option("--gpus", bs.num_gpus, "cuda: GPUs the ranks spread over (rank r on GPU r % N; default 1)")
        ->check(int_range(1))
        ->capture_default_str();
    bench->add_flag("--zero-padding", bs.zero_padding, "zero padding rows (then verified too)");
    bench->add_flag("--prequantized", bs.prequantized, "fp8: hand dispatch fp8 x with scales (moved as is)");
    std::string idx_dtype = "int64";
    bench->add_option("--idx-dtype", idx_dtype, "topk_idx dtype")
        ->check(CLI::IsMember({"int64", "int32"}))
        ->capture_default_str();
    bench->add_flag("--weighted,!--no-weights", bs.weighted,
                    "dispatch carries route weights and combine applies them (default), or neither");
    bench->add_flag("--bias", bs.bias, "combine adds a random per-token bias");
    bench->add_option("--skew", bs.skew, "expert popularity 1/(i+1)^skew over a seeded permutation (0 = uniform)")
        ->check(real_range(0, HUGE_VALL))
        ->capture_default_str();
    bench->add_option("--drop", bs.drop, "probability that a route is -1")
        ->check(real_range(0, 1))
        ->capture_default_str();
    bench
        ->add_option("--sms,--num-sms", bo.sweep.num_sms,
                     "SMs for the GPU kernels (0 = chosen by the library); a comma list runs one row per value")
        ->delimiter(',')
        ->check(int_range(0))
        ->default_str("0");
    bench
        ->add_option("--hbm-gbps", bs.hbm_gbps,
                     "cuda, one GPU: HBM bandwidth for the floor column (0 = measure a device copy)")
        ->check(real_range(0, HUGE_VALL))
        ->capture_default_str();
    bench->add_option("--rounds,-n", bs.rounds, "timed rounds")->check(int_range(1))->capture_default_str();
    bench->add_option("--warmup,-w", bs.warmup, "untimed rounds first (verified too)")
        ->check(int_range(0))
        ->capture_default_str();
    bench->add_option("--seed", bs.seed, "seed of inputs and routing")->capture_default_str();
    bench->add_option("--timeout-ms", bs.timeout_ms, "bound on every wait for a peer")
        ->check(int_range(1))
        ->capture_default_str();
    bench->add_flag("!--no-verify", bs.verify, "skip the oracle comparison");
    add_json_option(bench, bo.json, "the report");
    bench->add_flag("!--no-progress", bo.progress, "no 'round i/n' lines on stderr");
    bench
        ->add_option("--inject-mismatch", inject,
                     "self-test of the verifier: alter one received byte (cpu backend); the run must fail")
        ->check(CLI::IsMember({"none", "dispatch", "combine"}))
        ->capture_default_str();

    MoeLayerCli moe;
    add_moe_layer_options(bench, moe);  // bench --moe-layer (tools/moe_layer.cpp)

    // ---- info ----
    InfoOptions io;
    Choices ic;
    auto* info = app.add_subcommand(
        "info",
        "Version, compiled backends, GPUs, CUDA/NCCL versions. With any buffer option: the bytes one rank's\n"
        "buffer reserves, the output sizes of each layout and their total per rank (unspecified options take\n"
        "bench's defaults).");
    const std::vector<CLI::Option*> info_shape = add_shape_options(info, io.scenario, ic, nullptr);
    add_json_option(info, io.json, "the information");

    // ---- check ----
    CheckOptions co;
    std::string check_backend = "auto";
    auto* check =
        app.add_subcommand("check", "Quick self-test: a small scenario matrix through bench with verification");
    check->add_option("--backend", check_backend, "backend")
        ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
        ->capture_default_str();
    check->add_flag("--verbose,-v", co.verbose, "print the first mismatch of every scenario");
    add_json_option(check, co.json, "the results");

    try {
        app.parse(argc, argv);
        if (bench->parsed()) {
            bs.inject_mismatch = inject == "dispatch" ? 1 : inject == "combine" ? 2 : 0;
            bs.idx_int64 = idx_dtype == "int64";
            bs.layout = parse_layout(layout);
            // the masked layout (decode) runs in graph mode, as python -m elasticep.bench does; a captured
            // dispatch never synchronises with the host
            bs.host_sync = bs.layout == Layout::kExpertContiguous && !graph_mode && !bs.graph;
            if (bs.num_gpus > 1 && bench->count("--ranks") == 0) bs.num_ranks = bs.num_gpus;  // one rank per GPU
            apply_choices(bs, bc);
            for (const Scenario& s : bo.sweep.points()) check_scenario(s);  // every row, before the first runs
        }
        if (info->parsed()) {
            for (auto* o : info_shape) io.show_config = io.show_config || o->count() > 0;
            apply_choices(io.scenario, ic);
            if (io.show_config) check_scenario(io.scenario);
        }
        if (check->parsed()) co.backend = parse_backend(check_backend);
    } catch (const CLI::ParseError& e) {
        const int rc = app.exit(e);
        return rc == 0 ? kExitOk : kExitError;
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.message().c_str());
        return kExitError;
    }

    try {
        if (bench->parsed()) {
            bo.json.open("--json");
            if (moe.enabled) {
                // one layer shape: a --tokens / --sms list takes its first value
                return run_moe_layer_command(bench, bo.sweep.points().front(), bo.json, moe);
            }
            return run_bench_command(bo);
        }
        if (info->parsed()) {
            io.json.open("--json");
            return run_info_command(io);
        }
        if (check->parsed()) {
            co.json.open("--json");
            return run_check_command(co);
        }
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.message().c_str());
        return kExitError;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return kExitError;
    }
    return kExitError;
}
