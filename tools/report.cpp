// The bench report: a table for people, JSON for scripts (same numbers).
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench.hpp"
#include "elasticep/version.hpp"

namespace elasticep::cli {
namespace {

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

std::string verified_cell(const BenchReport& r, const PhaseStats& p) {
    if (!r.scenario.verify) return "off";
    const int n = p.rounds_verified + p.rounds_failed;
    return (p.rounds_failed == 0 ? "yes (" : "NO (") + std::to_string(p.rounds_verified) + "/" + std::to_string(n) +
           ")";
}

nlohmann::ordered_json phase_json(const BenchReport& r, const PhaseStats& p) {
    nlohmann::ordered_json j;
    j["latency_us"] = {{"median", p.median_us}, {"mean", p.mean_us},    {"min", p.min_us},
                       {"max", p.max_us},       {"rounds", p.round_us}, {"per_rank", p.rank_us}};
    j["peer_messages"] = p.peer_messages;
    j["local_messages"] = p.local_messages;
    j["peer_bytes"] = p.peer_bytes;
    j["local_bytes"] = p.local_bytes;
    j["peer_gbps"] = p.peer_gbps;
    j["total_gbps"] = p.total_gbps;
    if (r.scenario.verify) {
        j["verified"] = p.rounds_failed == 0;
    } else {
        j["verified"] = nullptr;
    }
    j["rounds_verified"] = p.rounds_verified;
    j["rounds_failed"] = p.rounds_failed;
    return j;
}

}  // namespace

std::string format_report(const BenchReport& r) {
    const Scenario& s = r.scenario;
    std::ostringstream os;
    char line[256];
    os << "elasticep bench: " << backend_name(r.backend) << " backend, " << s.describe() << "\n";
    os << "rounds: " << s.rounds << " timed + " << s.warmup << " warm-up, seed " << s.seed << "; " << r.rows_received
       << " routes/round; wire message " << r.message_bytes << " B/token; latency = slowest rank per round\n\n";
    std::snprintf(line, sizeof line, "%-9s %12s %12s %12s %12s %12s %10s %10s  %s\n", "phase", "median us", "mean us",
                  "min us", "peer bytes", "local bytes", "peer GB/s", "all GB/s", "verified");
    os << line;
    for (const PhaseStats* p : {&r.dispatch, &r.combine}) {
        std::snprintf(line, sizeof line, "%-9s %12.1f %12.1f %12.1f %12s %12s %10.2f %10.2f  %s\n", p->name.c_str(),
                      p->median_us, p->mean_us, p->min_us, human_bytes(p->peer_bytes).c_str(),
                      human_bytes(p->local_bytes).c_str(), p->peer_gbps, p->total_gbps, verified_cell(r, *p).c_str());
        os << line;
    }
    os << "\n";
    for (const auto& f : r.failures) os << "mismatch: " << f << "\n";
    const char* verdict = !s.verify ? "UNVERIFIED (--no-verify)" : r.verified ? "PASS" : "FAIL";
    std::snprintf(line, sizeof line,
                  "summary: %s; dispatch %.1f us, combine %.1f us (median of %d); %lld peer + %lld local "
                  "messages/round; wall %.2f s (inputs %.2f s, oracle %.2f s)\n",
                  verdict, r.dispatch.median_us, r.combine.median_us, s.rounds,
                  static_cast<long long>(r.dispatch.peer_messages), static_cast<long long>(r.dispatch.local_messages),
                  r.wall_s, r.setup_s, r.oracle_s);
    os << line;
    return os.str();
}

std::string report_json(const BenchReport& r, int indent) {
    const Scenario& s = r.scenario;
    nlohmann::ordered_json j;
    j["tool"] = "elasticep bench";
    j["version"] = version_string();
    j["backend"] = backend_name(r.backend);
    j["scenario"] = {
        {"ranks", s.num_ranks},
        {"tokens", s.tokens},
        {"tokens_min", s.tokens_min},
        {"max_tokens_per_rank", s.buffer_config().max_tokens_per_rank},
        {"hidden", s.hidden},
        {"experts", s.num_experts},
        {"topk", s.num_topk},
        {"payload", payload_name(s.payload)},
        {"scale_format", s.payload == Payload::kFP8 ? nlohmann::ordered_json(scale_format_name(s.scale_format))
                                                    : nlohmann::ordered_json()},
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
        {"num_sms", s.num_sms},
        {"rounds", s.rounds},
        {"warmup", s.warmup},
        {"seed", s.seed},
        {"verify", s.verify},
    };
    j["tokens_per_rank"] = r.tokens;
    j["message_bytes"] = r.message_bytes;
    j["routes_per_round"] = r.rows_received;
    j["phases"] = {{"dispatch", phase_json(r, r.dispatch)}, {"combine", phase_json(r, r.combine)}};
    if (s.verify) {
        j["verified"] = r.verified;
    } else {
        j["verified"] = nullptr;
    }
    j["failures"] = r.failures;
    j["seconds"] = {{"wall", r.wall_s}, {"inputs", r.setup_s}, {"oracle", r.oracle_s}};
    return j.dump(indent) + "\n";
}

}  // namespace elasticep::cli
