// The `elasticep` command line: bench (dispatch + combine timed and verified), info, check.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "commands.hpp"
#include "moe_layer.hpp"
#include "elasticep/error.hpp"
#include "elasticep/version.hpp"

namespace elasticep::cli {
namespace {

// Choice options are read as text (CLI11 checks membership, the library parses the name).
struct Choices {
    std::string payload = "fp8", scale_format = "f32_g128", backend = "auto";
};

// The buffer-shape options bench and info share. Returns the options so info can tell whether
// any was given.
std::vector<CLI::Option*> add_shape_options(CLI::App* app, Scenario& s, Choices& c) {
    std::vector<CLI::Option*> o;
    o.push_back(app->add_option("--ranks,-r", s.num_ranks, "ranks (threads of this process), one Buffer each")
                    ->check(CLI::PositiveNumber)
                    ->capture_default_str());
    o.push_back(app->add_option("--tokens,-t", s.tokens, "tokens per rank (the busiest rank with --tokens-min)")
                    ->check(CLI::NonNegativeNumber)
                    ->capture_default_str());
    o.push_back(
        app->add_option("--max-tokens-per-rank,--capacity", s.capacity, "buffer capacity C per rank (0 = --tokens)")
            ->check(CLI::NonNegativeNumber)
            ->capture_default_str());
    o.push_back(app->add_option("--hidden", s.hidden, "hidden size H (multiple of 8, or of the fp8 scale group)")
                    ->check(CLI::PositiveNumber)
                    ->capture_default_str());
    o.push_back(app->add_option("--experts,-e", s.num_experts, "experts E (a multiple of --ranks)")
                    ->check(CLI::PositiveNumber)
                    ->capture_default_str());
    o.push_back(app->add_option("--topk,-k", s.num_topk, "experts per token K")
                    ->check(CLI::Range(1, 32))
                    ->capture_default_str());
    o.push_back(app->add_option("--payload", c.payload, "dispatch payload")
                    ->check(CLI::IsMember({"bf16", "fp8"}))
                    ->capture_default_str());
    o.push_back(app->add_option("--scale-format", c.scale_format, "fp8 scale format")
                    ->check(CLI::IsMember({"f32_g128", "ue8m0_g128", "ue8m0_g32"}))
                    ->capture_default_str());
    o.push_back(app->add_option("--alignment,-a", s.alignment, "contiguous layout: expert segment alignment A")
                    ->check(CLI::PositiveNumber)
                    ->capture_default_str());
    o.push_back(app->add_flag("--mn-major", s.scales_mn_major, "fp8: MN-major (column-major) received scales"));
    o.push_back(app->add_option("--backend", c.backend, "backend (auto = cuda when a GPU is usable, else cpu)")
                    ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
                    ->capture_default_str());
    return o;
}

// Library validation of the whole scenario (E % R, H vs scale group, capacity...), reported as
// a usage error before anything runs.
void check_scenario(Scenario& s, const Choices& c) {
    try {
        s.payload = parse_payload(c.payload);
        s.scale_format = parse_scale_format(c.scale_format);
        s.backend = parse_backend(c.backend);
        s.validate();
    } catch (const Error& e) {
        throw CLI::ValidationError(e.message());
    }
}

int bench_main(const Scenario& s, const BenchOutput& out) {
    const bool tty = isatty(STDERR_FILENO) != 0;
    bool printed = false;
    ProgressFn progress;
    if (out.progress)
        progress = [&](int round, int total, double sec) {
            if (!tty && sec < 1.0) return;
            std::fprintf(stderr, tty ? "\rround %d/%d (%.2f s)" : "round %d/%d (%.2f s)\n", round + 1, total, sec);
            std::fflush(stderr);
            printed = tty;
        };
    const BenchReport r = run_bench(s, progress);
    if (printed) std::fprintf(stderr, "\r%40s\r", "");
    const std::string json = report_json(r);
    if (!out.json_out.empty()) {
        std::ofstream f(out.json_out);
        f << json;
        if (!f) throw Error(ErrorCode::kInvalidArgument, "cannot write --json-out " + out.json_out);
    }
    std::cout << (out.json ? json : format_report(r));
    std::cout.flush();
    return s.verify && !r.verified ? kExitFailed : kExitOk;
}

}  // namespace

int run_bench_command(const Scenario& s, const BenchOutput& out) { return bench_main(s, out); }

}  // namespace elasticep::cli

int main(int argc, char** argv) {
    using namespace elasticep;
    using namespace elasticep::cli;

    CLI::App app{std::string("elasticep ") + version_string() +
                 ": Mixture-of-Experts dispatch/combine across expert-parallel ranks"};
    app.require_subcommand(1);
    app.set_version_flag("--version", version_string());
    app.failure_message([](const CLI::App*, const CLI::Error& e) {
        return std::string("error: ") + e.what() + "\nRun with --help for more information.\n";
    });

    // ---- bench ----
    Scenario bs;
    Choices bc;
    BenchOutput bo;
    std::string layout = "contiguous", inject = "none";
    auto* bench = app.add_subcommand(
        "bench",
        "Time rounds of dispatch + combine, each verified bit for bit against the oracle.\n"
        "Default scenario: DeepSeek-V3 MoE shape (H=7168, 256 experts, top-8, fp8 f32_g128 dispatch, bf16 combine)\n"
        "on 8 ranks x 128 tokens, 5 timed rounds + 1 warm-up: 4-12 s on 2 CPU cores with verification.\n"
        "Latency of a round = its slowest rank; bytes count one message per token and destination rank\n"
        "(peers and the rank itself apart). Exit code 1 when a verification fails, 2 on errors.");
    add_shape_options(bench, bs, bc);
    bench
        ->add_option("--tokens-min", bs.tokens_min,
                     "uneven tokens: rank r gets a linear share from --tokens down to this")
        ->check(CLI::NonNegativeNumber);
    bench->add_option("--layout", layout, "dispatch layout")
        ->check(CLI::IsMember({"contiguous", "masked"}))
        ->capture_default_str();
    bool graph_mode = false;
    bench->add_flag("--graph-mode", graph_mode, "contiguous: graph mode (fixed M_cap rows, no host sync)");
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
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    bench->add_option("--drop", bs.drop, "probability that a route is -1")
        ->check(CLI::Range(0.0, 1.0))
        ->capture_default_str();
    bench->add_option("--num-sms", bs.num_sms, "SMs for the GPU kernels (0 = chosen by the library)")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    bench->add_option("--rounds,-n", bs.rounds, "timed rounds")->check(CLI::PositiveNumber)->capture_default_str();
    bench->add_option("--warmup,-w", bs.warmup, "untimed rounds first (verified too)")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    bench->add_option("--seed", bs.seed, "seed of inputs and routing")->capture_default_str();
    bench->add_option("--timeout-ms", bs.timeout_ms, "bound on every wait for a peer")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    bench->add_flag("!--no-verify", bs.verify, "skip the oracle comparison");
    bench->add_flag("--json", bo.json, "print the report as JSON on stdout instead of the table");
    bench->add_option("--json-out", bo.json_out, "also write the JSON report to this file");
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
        "buffer reserves and the output sizes of each layout (unspecified options take bench's defaults).");
    const std::vector<CLI::Option*> info_shape = add_shape_options(info, io.scenario, ic);
    info->add_flag("--json", io.json, "print JSON");

    // ---- check ----
    CheckOptions co;
    std::string check_backend = "auto";
    auto* check =
        app.add_subcommand("check", "Quick self-test: a small scenario matrix through bench with verification");
    check->add_option("--backend", check_backend, "backend")
        ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
        ->capture_default_str();
    check->add_flag("--verbose,-v", co.verbose, "print the first mismatch of every scenario");
    check->add_flag("--json", co.json, "print JSON");

    try {
        app.parse(argc, argv);
        if (bench->parsed()) {
            bs.inject_mismatch = inject == "dispatch" ? 1 : inject == "combine" ? 2 : 0;
            bs.host_sync = !graph_mode;
            bs.idx_int64 = idx_dtype == "int64";
            bs.layout = parse_layout(layout);
            check_scenario(bs, bc);
        }
        if (info->parsed()) {
            for (auto* o : info_shape) io.show_config = io.show_config || o->count() > 0;
            io.scenario.backend = parse_backend(ic.backend);
            if (io.show_config) check_scenario(io.scenario, ic);
        }
        if (check->parsed()) co.backend = parse_backend(check_backend);
    } catch (const CLI::ParseError& e) {
        const int rc = app.exit(e);
        return rc == 0 ? kExitOk : kExitError;
    }

    try {
        if (bench->parsed()) return moe.enabled ? run_moe_layer_command(bench, bs, bo.json, moe) : run_bench_command(bs, bo);
        if (info->parsed()) return run_info_command(io);
        if (check->parsed()) return run_check_command(co);
    } catch (const Error& e) {
        std::fprintf(stderr, "error: %s\n", e.message().c_str());
        return kExitError;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return kExitError;
    }
    return kExitError;
}
