// `elasticep bench`: rounds of dispatch + combine across ranks-as-threads, timed per rank and
// verified against the oracle (src/reference/oracle.hpp) with exact equality.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "elasticep/config.hpp"
#include "elasticep/tensor.hpp"
#include "elasticep/traffic.hpp"

namespace elasticep::cli {

// One benchmark scenario (one row of the report). The defaults are the DeepSeek-V3 MoE layer shape
// (H=7168, 256 experts, top-8, fp8 dispatch with fp32 scales per 128 channels, bf16 combine) at a
// token count that runs with verification in well under a minute on two CPU cores.
struct Scenario {
    int num_ranks = 8;
    int tokens = 128;     // tokens of the busiest rank
    int tokens_min = -1;  // < 0: every rank has `tokens`; else spread linearly down to tokens_min
    int capacity = 0;     // max_tokens_per_rank; 0 = tokens
    int hidden = 7168;
    int num_experts = 256;
    int num_topk = 8;
    Payload payload = Payload::kFP8;
    ScaleFormat scale_format = ScaleFormat::kF32G128;
    bool prequantized = false;  // fp8: hand dispatch fp8 x with scales instead of bf16 x
    Layout layout = Layout::kExpertContiguous;
    int alignment = 1;
    bool host_sync = true;  // contiguous: false = graph mode (M_cap rows)
    bool zero_padding = false;
    bool scales_mn_major = false;
    bool idx_int64 = true;  // topk_idx dtype
    bool weighted = true;   // dispatch carries weights and combine applies them
    bool bias = false;      // combine adds a per-token bias
    double skew = 0.8;      // expert popularity ~ 1/(rank+1)^skew (0 = uniform)
    double drop = 0.0;      // probability that a route is -1
    BackendKind backend = BackendKind::kAuto;
    Topology topology = Topology::kDirect;
    int ranks_per_node = 0;               // 0 = all ranks one node
    ScaleOut scaleout = ScaleOut::kAuto;  // hybrid's network hop
    int num_gpus = 1;                     // cuda: rank r runs on GPU r % num_gpus
    int num_sms = 0;
    bool back_to_back = true;  // also time `rounds` calls enqueued without host synchronisation
    bool graph = false;        // cuda: also time replays of a captured dispatch + combine
    // Before every timed call the ranks meet at the group's barrier; with start_line they then also
    // line up at a spinning start line that releases them together (the barrier's condition
    // variable wakes them one after another). Off by default: on one H200 with 8 ranks the GPU-side
    // start spread was about 11 us either way, and the spinning made decode slower (docs/PERFORMANCE.md,
    // "Seventh session").
    bool start_line = false;
    double hbm_gbps = 0;  // HBM floor denominator; 0 = measure (cuda, one GPU)
    int rounds = 5;
    int warmup = 1;
    uint64_t seed = 1;
    bool verify = true;
    int timeout_ms = 30000;
    // Self-test of the verifier: alter one received byte of the first timed round before it is
    // verified (1 = a dispatch row, 2 = a combine output); the run must then fail.
    int inject_mismatch = 0;

    BufferConfig buffer_config() const;
    std::vector<int64_t> tokens_per_rank() const;
    // Throws Error(kInvalidArgument) naming the option and the fix.
    void validate() const;
    std::string describe() const;  // one line, for the report header and `check`
};

// Latencies of one timing mode of one phase.
struct Timing {
    std::vector<double> round_us;              // per timed round: the slowest rank's latency
    std::vector<std::vector<double>> rank_us;  // [round][rank]
    double median_us = 0, mean_us = 0, min_us = 0, max_us = 0;
    // Where every rank's marks share one clock (one GPU, or the host): per round, the last rank's
    // start minus the first's, and the last end minus the last start (the collective's time once
    // every rank has begun); medians over the timed rounds, -1 where not measured.
    std::vector<double> start_spread_rounds, from_last_start_rounds;
    double start_spread_us = -1, from_last_start_us = -1;
    // Isolated calls: per round, the slowest rank's host time of the call (from entering dispatch() or
    // combine() to its return, on the host's clock); their median; -1 where not measured.
    std::vector<double> host_call_rounds;
    double host_call_us = -1;
    bool empty() const { return round_us.empty(); }
};

struct PhaseStats {
    std::string name;
    Timing isolated;                                // ranks meet at a host barrier before every call
    Timing back_to_back;                            // all rounds enqueued without host synchronisation
    int64_t peer_messages = 0, local_messages = 0;  // per round, all ranks together
    int64_t peer_bytes = 0, local_bytes = 0;        // per round, all ranks together
    int64_t hbm_bytes = 0;                          // device-memory floor bytes, all ranks
    int64_t hbm_min_bytes = 0;                      // ... of rows written once (Traffic::*_min_hbm_bytes)
    double peer_gbps = 0;                           // peer bytes / isolated median
    double total_gbps = 0;                          // (peer + local) bytes / isolated median
    double hbm_floor_us = 0;                        // hbm_bytes / HBM copy bandwidth (0 = not shown)
    double hbm_min_floor_us = 0;                    // hbm_min_bytes / HBM copy bandwidth
    int rounds_verified = 0;
    int rounds_failed = 0;
};

struct BenchReport {
    Scenario scenario;
    BackendKind backend = BackendKind::kCPU;  // resolved
    std::vector<int64_t> tokens;              // T per rank
    Traffic traffic;                          // one round, all ranks (include/elasticep/traffic.hpp)
    int num_sms_used = 0;                     // what the dispatch chose (0 on the CPU backend)
    PhaseStats dispatch, combine;
    PhaseStats graph;                   // --graph: one replay of dispatch + combine
    bool verified = false;              // verify on and every checked output matched
    std::vector<std::string> failures;  // first mismatches, "round r rank d: ..."
    double hbm_gbps = 0;                // the floor's denominator, 0 when no floor is shown
    bool hbm_measured = false;
    std::string gpu;          // GPU name (cuda)
    std::string scaleout;     // the network hop the buffers used (Buffer::scaleout(): "none" for direct)
    std::string kernel_path;  // Buffer::kernel_path(): "reference", "direct", "staged" or "hybrid"
    double setup_s = 0, oracle_s = 0, wall_s = 0;
};

// Called after every isolated round (warm-up included) with the round index, the total and its
// seconds.
using ProgressFn = std::function<void(int round, int total, double seconds)>;

// Throws Error on invalid scenarios and on library errors.
BenchReport run_bench(const Scenario& scenario, const ProgressFn& progress = {});

// Several rows: the scenario at every (tokens, num_sms) of the lists, tokens outer.
struct Sweep {
    Scenario base;
    std::vector<int> tokens;   // empty: base.tokens
    std::vector<int> num_sms;  // empty: base.num_sms
    std::vector<Scenario> points() const;
};

// The table (one row per scenario, as nccl-tests prints) and summary, and the JSON of a sweep.
std::string format_report(const std::vector<BenchReport>& reports);
std::string report_json(const std::vector<BenchReport>& reports, int indent = 2);

}  // namespace elasticep::cli
