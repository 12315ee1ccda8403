// `elasticep bench --moe-layer`: a whole MoE layer (shared expert, dispatch, routed experts through
// the reference MoE layer, combine) on ranks as threads, every stage timed, the output checked
// against the dense reference (src/moe/dense_reference.hpp).
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace elasticep::cli {

struct Scenario;
struct JsonOutput;

// The --moe-layer options. Shape options the bench shares (--ranks, --tokens, --hidden, --experts,
// --topk, --backend, --rounds, --warmup, --seed) are read from the bench's own when given; otherwise
// the layer's defaults apply: DeepSeek-V3's shape on a GPU, a reduced one on the CPU.
struct MoeLayerCli {
    bool enabled = false;
    int intermediate = 0;         // I (0: 2048 on GPU, 256 on CPU)
    int shared_experts = 1;       // 0 or 1
    double routed_scaling = 2.5;  // DeepSeek-V3's routed_scaling_factor
    std::string phase = "prefill";
    std::string weight_placement = "combine";
    std::string quant_config;  // JSON text or @file; "none": bf16 experts; empty: DeepSeek-V3's config
    int check_tokens = -1;     // tokens per rank checked against the dense reference (-1: auto)
    bool force_dequant = false;
};

void add_moe_layer_options(CLI::App* bench, MoeLayerCli& m);
// Runs the layer benchmark; returns the exit code (0 pass, 1 check failed). Throws Error.
// JSON (when --json was given) goes where the bench's --json says; the text table goes to stdout otherwise.
int run_moe_layer_command(CLI::App* bench, const Scenario& s, JsonOutput& json, const MoeLayerCli& m);

}  // namespace elasticep::cli
