// The subcommands of the `elasticep` CLI, each returning the process exit code.
#pragma once

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench.hpp"

namespace elasticep::cli {

// Exit codes: 0 ok, 1 a verification or self-test failed, 2 bad options or a library error.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitError = 2;

// `--json [FILE]`: JSON on stdout (no FILE, or "-") instead of the text, or into FILE next to it.
// The file is opened when the options are read, so a bad path fails before anything runs.
struct JsonOutput {
    bool requested = false;
    std::string path;                     // "" or "-": stdout
    std::unique_ptr<std::ofstream> file;  // open when a path was given
    bool to_stdout() const { return requested && !file; }
    // Opens the file (throws Error naming the option and the reason when it cannot be written).
    void open(const std::string& option);
    // Writes `json` to the file, or to stdout; then `text` to stdout unless JSON went there.
    void emit(const std::string& json, const std::string& text);
};

struct BenchOptions {
    Sweep sweep;
    JsonOutput json;
    bool progress = true;
};
int run_bench_command(BenchOptions& o);

struct InfoOptions {
    JsonOutput json;
    bool show_config = false;  // a config option was given: print reservation and output sizes
    Scenario scenario;         // ranks, experts, topk, hidden, tokens/capacity, payload, format, backend, alignment
};
int run_info_command(InfoOptions& o);

struct CheckOptions {
    BackendKind backend = BackendKind::kAuto;
    bool verbose = false;
    JsonOutput json;
};
int run_check_command(CheckOptions& o);

}  // namespace elasticep::cli
