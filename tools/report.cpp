// The bench report: a table for people (one row per scenario, as nccl-tests prints), JSON for
// scripts (the same numbers and more).
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench.hpp"
#include "elasticep/version.hpp"

namespace elasticep::cli {
namespace {

using Json = nlohmann::ordered_json;

std::string human_bytes(int64_t b) {
    char buf[32];
    const double v = static_cast<double>(b);
    if (b >= 1000000000)
        std::snprintf(buf, sizeof buf, "%.2f GB", v / 1e9);
    else if (b >= 1000000)
        std::snprintf(buf, sizeof buf, "%.2f MB", v / 1e6);
    else if (b >= 1000)
        std::snprintf(buf, sizeof buf, "%.1f kB", v / 1e3);
    else
        std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
    return buf;
}

std::string us(double v, bool shown = true) {
    if (!shown) return "-";
    char buf[32];
    std::snprintf(buf, sizeof buf, v >= 10000 ? "%.0f" : "%.1f", v);
    return buf;
}

std::string verified_cell(const BenchReport& r) {
    if (!r.scenario.verify) return "off";
    const int ok = r.dispatch.rounds_verified + r.combine.rounds_verified + r.graph.rounds_verified;
    const int n = ok + r.dispatch.rounds_failed + r.combine.rounds_failed + r.graph.rounds_failed;
    return (ok == n ? "yes (" : "NO (") + std::to_string(ok) + "/" + std::to_string(n) + ")";
}

Json timing_json(const Timing& t) {
    if (t.empty()) return nullptr;
    Json j{{"median", t.median_us}, {"mean", t.mean_us},    {"min", t.min_us},
           {"max", t.max_us},       {"rounds", t.round_us}, {"per_rank", t.rank_us}};
    const bool clock = t.start_spread_us >= 0;
    j["start_spread"] = clock ? Json(t.start_spread_us) : Json();
    j["from_last_start"] = clock ? Json(t.from_last_start_us) : Json();
    j["start_spread_rounds"] = t.start_spread_rounds;
    j["from_last_start_rounds"] = t.from_last_start_rounds;
    if (t.host_call_us >= 0) {
        j["host_call"] = t.host_call_us;
        j["host_call_rounds"] = t.host_call_rounds;
    }
    return j;
}

Json phase_json(const BenchReport& r, const PhaseStats& p) {
    Json j;
    j["latency_us"] = timing_json(p.isolated);
    j["back_to_back_us"] = timing_json(p.back_to_back);
    j["peer_messages"] = p.peer_messages;
    j["local_messages"] = p.local_messages;
    j["peer_bytes"] = p.peer_bytes;
    j["local_bytes"] = p.local_bytes;
    j["peer_gbps"] = p.peer_gbps;
    j["total_gbps"] = p.total_gbps;
    j["hbm_bytes"] = p.hbm_bytes;
    j["hbm_floor_us"] = p.hbm_floor_us > 0 ? Json(p.hbm_floor_us) : Json();
    j["hbm_min_bytes"] = p.hbm_min_bytes;
    j["hbm_min_floor_us"] = p.hbm_min_floor_us > 0 ? Json(p.hbm_min_floor_us) : Json();
    j["verified"] = r.scenario.verify ? Json(p.rounds_failed == 0) : Json();
    j["rounds_verified"] = p.rounds_verified;
    j["rounds_failed"] = p.rounds_failed;
    return j;
}

Json result_json(const BenchReport& r) {
    const Traffic& t = r.traffic;
    Json j;
    j["tokens"] = r.scenario.tokens;
    j["tokens_per_rank"] = r.tokens;
    j["max_tokens_per_rank"] = r.scenario.buffer_config().max_tokens_per_rank;
    j["num_sms"] = r.scenario.num_sms;
    j["num_sms_used"] = r.num_sms_used;
    j["message_bytes"] = t.message_bytes;
    j["routes_per_round"] = t.routes;
    j["traffic"] = {{"tokens", t.tokens},
                    {"routes", t.routes},
                    {"peer_messages", t.peer_messages},
                    {"local_messages", t.local_messages},
                    {"message_bytes", t.message_bytes},
                    {"partial_bytes", t.partial_bytes},
                    {"dispatch_peer_bytes", t.dispatch_peer_bytes()},
                    {"dispatch_local_bytes", t.dispatch_local_bytes()},
                    {"combine_peer_bytes", t.combine_peer_bytes()},
                    {"combine_local_bytes", t.combine_local_bytes()},
                    {"dispatch_hbm_bytes", t.dispatch_hbm_bytes},
                    {"combine_hbm_bytes", t.combine_hbm_bytes},
                    {"dispatch_min_hbm_bytes", t.dispatch_min_hbm_bytes},
                    {"combine_min_hbm_bytes", t.combine_min_hbm_bytes}};
    j["phases"] = {{"dispatch", phase_json(r, r.dispatch)},
                   {"combine", phase_json(r, r.combine)},
                   {"graph", r.scenario.graph ? phase_json(r, r.graph) : Json()}};
    j["verified"] = r.scenario.verify ? Json(r.verified) : Json();
    j["failures"] = r.failures;
    j["seconds"] = {{"wall", r.wall_s}, {"inputs", r.setup_s}, {"oracle", r.oracle_s}};
    return j;
}

}  // namespace

std::string format_report(const std::vector<BenchReport>& reports) {
    if (reports.empty()) return "";
    const BenchReport& first = reports.front();
    const Scenario& s = first.scenario;
    const bool cuda = first.backend == BackendKind::kCUDA;
    const bool floor = first.hbm_gbps > 0;
    std::ostringstream os;
    char line[512];
    os << "elasticep bench: " << backend_name(first.backend) << " backend"
       << (first.gpu.empty() ? "" : " (" + first.gpu + ")") << ", " << s.describe() << "\n";
    if (s.topology == Topology::kHybrid) os << "network hop: " << first.scaleout << "\n";
    if (cuda) os << "kernel path: " << first.kernel_path << "\n";
    os << "rounds: " << s.rounds << " timed + " << s.warmup << " warm-up per row, seed " << s.seed
       << "; latency = the slowest rank per round, median of the timed rounds; isolated: the ranks meet at a barrier "
          "before every call"
       << (s.start_line ? " and leave it together (--start-line)" : "");
    if (s.back_to_back)
        os << "; b2b: the rounds enqueued back to back, no host synchronisation between the calls"
           << (s.host_sync && s.layout == Layout::kExpertContiguous ? " (a host-sync dispatch still waits for M inside)"
                                                                    : "");
    os << "\nbytes: one " << first.traffic.message_bytes << " B message per token and destination rank; combine "
       << "returns one " << first.traffic.partial_bytes << " B bf16 row per message; GB/s = peer bytes / isolated "
       << "median";
    if (floor)
        os << "\nHBM floor = device-memory bytes of every rank (the staged data flow: each message and partial written "
              "and read once) / "
           << static_cast<int64_t>(first.hbm_gbps + 0.5) << " GB/s ("
           << (first.hbm_measured ? "measured device copy, read + write" : "--hbm-gbps")
           << "); rows written once (no copy between): dispatch " << us(first.dispatch.hbm_min_floor_us)
           << " us, combine " << us(first.combine.hbm_min_floor_us) << " us (first row; JSON: hbm_min_floor_us)";
    os << "\n\n";

    // header: [tokens sms peer-msgs] | dispatch | combine | [graph] | verified
    std::string h1 = "                         ", h2 = " tokens  sms   peer msgs ";
    auto phase_head = [&](const char* name) {
        char a[160], b[160];
        std::snprintf(a, sizeof a, "| %-*s", floor ? 40 : 30, name);
        std::snprintf(b, sizeof b, "| %10s %8s %9s%s ", "isolated", "b2b", "GB/s", floor ? "  floor us" : "");
        h1 += a;
        h2 += b;
    };
    phase_head("dispatch us");
    phase_head("combine us");
    if (s.graph) {
        char a[64], b[64];
        std::snprintf(a, sizeof a, "| %-20s", "graph D+C us");
        std::snprintf(b, sizeof b, "| %10s %8s ", "isolated", "b2b");
        h1 += a;
        h2 += b;
    }
    h1 += "|";
    h2 += "| verified";
    os << h1 << "\n" << h2 << "\n";
    for (const BenchReport& r : reports) {
        std::string sms = "-";
        if (cuda) sms = std::to_string(r.num_sms_used) + (r.scenario.num_sms == 0 ? "*" : "");
        std::snprintf(line, sizeof line, " %6d %4s %11lld ", r.scenario.tokens, sms.c_str(),
                      static_cast<long long>(r.traffic.peer_messages));
        std::string row = line;
        for (const PhaseStats* p : {&r.dispatch, &r.combine}) {
            char floor_cell[32] = "";
            if (floor) std::snprintf(floor_cell, sizeof floor_cell, " %9s", us(p->hbm_floor_us).c_str());
            std::snprintf(line, sizeof line, "| %10s %8s %9.2f%s ", us(p->isolated.median_us).c_str(),
                          us(p->back_to_back.median_us, !p->back_to_back.empty()).c_str(), p->peer_gbps, floor_cell);
            row += line;
        }
        if (s.graph) {
            std::snprintf(line, sizeof line, "| %10s %8s ", us(r.graph.isolated.median_us).c_str(),
                          us(r.graph.back_to_back.median_us).c_str());
            row += line;
        }
        row += "| " + verified_cell(r);
        os << row << "\n";
    }
    if (cuda) os << "(sms: SMs the dispatch used; * = chosen by the library)\n";
    // the ranks' start spread, where their marks share a clock
    for (const BenchReport& r : reports) {
        std::vector<std::pair<std::string, const Timing*>> cells{{"dispatch", &r.dispatch.isolated},
                                                                 {"combine", &r.combine.isolated}};
        if (s.graph) cells.push_back({"graph", &r.graph.isolated});
        std::string spread, rest;
        for (const auto& [name, t] : cells) {
            if (t->start_spread_us < 0) continue;
            spread += (spread.empty() ? "" : ", ") + name + " " + us(t->start_spread_us);
            rest += (rest.empty() ? "" : ", ") + name + " " + us(t->from_last_start_us);
        }
        if (!spread.empty())
            os << "T=" << r.scenario.tokens << " isolated, medians: ranks' start spread " << spread
               << " us; from the last rank's start to the last end " << rest << " us\n";
        if (r.dispatch.isolated.host_call_us >= 0 && r.combine.isolated.host_call_us >= 0)
            os << "T=" << r.scenario.tokens << " isolated, the slowest rank's host time of a call (median): dispatch "
               << us(r.dispatch.isolated.host_call_us) << ", combine " << us(r.combine.isolated.host_call_us)
               << " us\n";
    }
    os << "\n";

    bool all_ok = true;
    int64_t checks = 0;
    double wall = 0, setup = 0, oracle = 0;
    for (const BenchReport& r : reports) {
        for (const auto& f : r.failures) os << "mismatch (T=" << r.scenario.tokens << "): " << f << "\n";
        all_ok = all_ok && r.verified;
        checks += r.dispatch.rounds_verified + r.dispatch.rounds_failed + r.combine.rounds_verified +
                  r.combine.rounds_failed + r.graph.rounds_verified + r.graph.rounds_failed;
        wall += r.wall_s;
        setup += r.setup_s;
        oracle += r.oracle_s;
    }
    const char* verdict = !s.verify ? "UNVERIFIED (--no-verify)" : all_ok ? "PASS" : "FAIL";
    std::snprintf(line, sizeof line,
                  "summary: %s; %zu row%s, %lld outputs checked against the oracle; peer bytes per round (first row): "
                  "dispatch %s, combine %s; wall %.2f s (inputs %.2f s, oracle %.2f s)\n",
                  verdict, reports.size(), reports.size() == 1 ? "" : "s", static_cast<long long>(checks),
                  human_bytes(first.dispatch.peer_bytes).c_str(), human_bytes(first.combine.peer_bytes).c_str(), wall,
                  setup, oracle);
    os << line;
    return os.str();
}

std::string report_json(const std::vector<BenchReport>& reports, int indent) {
    Json j;
    j["tool"] = "elasticep bench";
    j["version"] = version_string();
    if (!reports.empty()) {
        const BenchReport& first = reports.front();
        const Scenario& s = first.scenario;
        j["backend"] = backend_name(first.backend);
        j["gpu"] = first.gpu.empty() ? Json() : Json(first.gpu);
        j["scaleout"] = first.scaleout;
        j["kernel_path"] = first.kernel_path;
        j["scenario"] = {
            {"ranks", s.num_ranks},
            {"gpus", first.backend == BackendKind::kCUDA ? Json(s.num_gpus) : Json()},
            {"tokens_min", s.tokens_min},
            {"max_tokens_per_rank", s.capacity},
            {"hidden", s.hidden},
            {"experts", s.num_experts},
            {"topk", s.num_topk},
            {"payload", payload_name(s.payload)},
            {"scale_format", s.payload == Payload::kFP8 ? Json(scale_format_name(s.scale_format)) : Json()},
            {"topology", topology_name(s.topology)},
            {"ranks_per_node", s.ranks_per_node},
            {"scaleout", scaleout_name(s.scaleout)},
            {"prequantized", s.prequantized},
            {"layout", layout_name(s.layout)},
            {"alignment", s.alignment},
            {"host_sync", s.host_sync},
            {"zero_padding", s.zero_padding},
            {"scales_mn_major", s.scales_mn_major},
            {"idx_dtype", s.idx_int64 ? "int64" : "int32"},
            {"weighted", s.weighted},
            {"bias", s.bias},
            {"skew", s.skew},
            {"drop", s.drop},
            {"back_to_back", s.back_to_back},
            {"start_line", s.start_line},
            {"graph", s.graph},
            {"rounds", s.rounds},
            {"warmup", s.warmup},
            {"seed", s.seed},
            {"verify", s.verify},
        };
        j["hbm"] = first.hbm_gbps > 0 ? Json{{"gbps", first.hbm_gbps}, {"measured", first.hbm_measured}} : Json();
    }
    bool all = true;
    j["results"] = Json::array();
    for (const BenchReport& r : reports) {
        j["results"].push_back(result_json(r));
        all = all && r.verified;
    }
    j["verified"] = !reports.empty() && reports.front().scenario.verify ? Json(all) : Json();
    return j.dump(indent) + "\n";
}

}  // namespace elasticep::cli
