// The subcommands of the `elasticep` CLI, each returning the process exit code.
#pragma once

#include <string>

#include "bench.hpp"

namespace elasticep::cli {

// Exit codes: 0 ok, 1 a verification or self-test failed, 2 bad options or a library error.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitError = 2;

struct BenchOutput {
    bool json = false;     // JSON to stdout instead of the table
    std::string json_out;  // also write JSON here
    bool progress = true;
};
int run_bench_command(const Scenario& s, const BenchOutput& out);

struct InfoOptions {
    bool json = false;
    bool show_config = false;  // a config option was given: print reservation and output sizes
    Scenario scenario;         // ranks, experts, topk, hidden, tokens/capacity, payload, format, backend, alignment
};
int run_info_command(const InfoOptions& o);

struct CheckOptions {
    BackendKind backend = BackendKind::kAuto;
    bool verbose = false;
    bool json = false;
};
int run_check_command(const CheckOptions& o);

}  // namespace elasticep::cli
