// `elasticep check`: a quick self-test. A small scenario matrix (odd shapes, every payload and
// scale format, both layouts, uneven and empty ranks, dropped routes, graph mode) runs through
// bench's code with verification; then the verifier itself must catch an altered byte.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "elasticep/buffer.hpp"
#include "elasticep/error.hpp"

namespace elasticep::cli {
namespace {

Scenario base(int ranks, int tokens, int hidden, int experts, int topk) {
    Scenario s;
    s.num_ranks = ranks;
    s.tokens = tokens;
    s.hidden = hidden;
    s.num_experts = experts;
    s.num_topk = topk;
    s.payload = Payload::kBF16;
    s.rounds = 2;
    s.warmup = 1;
    s.seed = 7;
    s.timeout_ms = 20000;
    return s;
}

Scenario fp8(Scenario s, ScaleFormat f) {
    s.payload = Payload::kFP8;
    s.scale_format = f;
    return s;
}

std::vector<std::pair<Scenario, bool>> matrix() {
    std::vector<std::pair<Scenario, bool>> m;  // (scenario, must pass)
    {
        Scenario s = base(1, 5, 128, 4, 2);
        m.push_back({s, true});
    }
    {
        Scenario s = base(2, 16, 256, 8, 2);
        s.layout = Layout::kExpertMasked;
        s.weighted = false;
        s.bias = true;
        m.push_back({s, true});
    }
    {
        Scenario s = fp8(base(3, 7, 384, 12, 4), ScaleFormat::kF32G128);
        s.tokens_min = 0;
        s.alignment = 4;
        s.drop = 0.2;
        s.idx_int64 = false;
        m.push_back({s, true});
    }
    {
        Scenario s = fp8(base(4, 9, 512, 16, 8), ScaleFormat::kUE8M0G128);
        s.alignment = 128;
        s.zero_padding = true;
        s.scales_mn_major = true;
        m.push_back({s, true});
    }
    {
        Scenario s = fp8(base(4, 12, 256, 32, 6), ScaleFormat::kUE8M0G32);
        s.layout = Layout::kExpertMasked;
        s.zero_padding = true;
        s.scales_mn_major = true;
        s.bias = true;
        m.push_back({s, true});
    }
    {
        Scenario s = fp8(base(2, 8, 256, 4, 4), ScaleFormat::kF32G128);  // K > E_local
        s.prequantized = true;
        s.host_sync = false;
        m.push_back({s, true});
    }
    {
        Scenario s = base(8, 16, 128, 64, 8);
        s.tokens_min = 1;
        s.alignment = 8;
        s.skew = 2.0;
        s.bias = true;
        m.push_back({s, true});
    }
    {
        Scenario s = base(4, 0, 128, 8, 2);  // every rank empty
        m.push_back({s, true});
    }
    {
        Scenario s = fp8(base(3, 10, 640, 6, 3), ScaleFormat::kUE8M0G128);  // all routes dropped
        s.prequantized = true;
        s.layout = Layout::kExpertMasked;
        s.drop = 1.0;
        m.push_back({s, true});
    }
    {
        Scenario s = fp8(base(2, 33, 7168, 16, 8), ScaleFormat::kF32G128);  // DeepSeek-V3 row width
        s.rounds = 1;
        m.push_back({s, true});
    }
    {
        Scenario s = fp8(base(8, 16, 7168, 256, 8), ScaleFormat::kUE8M0G128);  // DeepSeek-V3 decode, masked
        s.layout = Layout::kExpertMasked;
        s.tokens_min = 2;
        s.rounds = 1;
        s.seed = 11;
        m.push_back({s, true});
    }
    {
        Scenario s = fp8(base(5, 11, 384, 20, 5), ScaleFormat::kUE8M0G32);
        s.capacity = 16;
        s.alignment = 16;
        s.host_sync = false;
        s.tokens_min = 3;
        m.push_back({s, true});
    }
    // the verifier must notice one altered bit, in either phase
    {
        Scenario s = fp8(base(3, 6, 256, 6, 2), ScaleFormat::kF32G128);
        s.inject_mismatch = 1;
        m.push_back({s, false});
        s.inject_mismatch = 2;
        s.payload = Payload::kBF16;
        s.layout = Layout::kExpertMasked;
        m.push_back({s, false});
    }
    return m;
}

}  // namespace

int run_check_command(CheckOptions& o) {
    const BackendKind backend = Buffer::resolve_backend(o.backend);
    const auto t0 = std::chrono::steady_clock::now();
    int passed = 0, total = 0;
    nlohmann::ordered_json items = nlohmann::ordered_json::array();
    for (auto [s, must_pass] : matrix()) {
        s.backend = backend;
        if (s.inject_mismatch != 0 && backend != BackendKind::kCPU) continue;  // alters host memory
        ++total;
        const auto t1 = std::chrono::steady_clock::now();
        bool verified = false;
        std::string detail;
        try {
            const BenchReport r = run_bench(s);
            verified = r.verified;
            if (!r.failures.empty()) detail = r.failures.front();
        } catch (const Error& e) {
            detail = std::string("error: ") + e.what();
        }
        const bool ok = verified == must_pass && (must_pass || !detail.empty());
        passed += ok;
        const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        std::string what = s.describe();
        if (s.inject_mismatch)
            what = std::string("verifier catches an altered ") +
                   (s.inject_mismatch == 1 ? "dispatch row" : "combine output") + ": " + what;
        items.push_back({{"scenario", what}, {"pass", ok}, {"seconds", sec}, {"detail", detail}});
        if (!o.json.to_stdout()) {
            std::printf("%s  %s  (%.2f s)\n", ok ? "PASS" : "FAIL", what.c_str(), sec);
            if ((!ok || o.verbose) && !detail.empty()) std::printf("      %s\n", detail.c_str());
            std::fflush(stdout);
        }
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const nlohmann::ordered_json j{{"backend", backend_name(backend)},
                                   {"passed", passed},
                                   {"total", total},
                                   {"ok", passed == total},
                                   {"seconds", sec},
                                   {"items", items}};
    char line[160];
    std::snprintf(line, sizeof line, "check (%s backend): %d/%d passed in %.2f s: %s\n", backend_name(backend), passed,
                  total, sec, passed == total ? "PASS" : "FAIL");
    o.json.emit(j.dump(2) + "\n", line);
    return passed == total ? kExitOk : kExitFailed;
}

}  // namespace elasticep::cli
