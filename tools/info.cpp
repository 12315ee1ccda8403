// `elasticep info`: what this build and machine offer, and what one buffer costs for a config.
#include "elasticep/info.hpp"

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "backend_io.hpp"
#include "commands.hpp"
#include "core/layout.hpp"
#include "core/outputs.hpp"
#include "core/protocol.hpp"
#include "elasticep/buffer.hpp"
#include "elasticep/error.hpp"
#include "elasticep/version.hpp"

namespace elasticep::cli {
namespace {

std::string version_text(int v, bool nccl) {
    if (v <= 0) return "none";
    std::ostringstream os;
    if (nccl) {
        // NCCL_VERSION_CODE = major*10000 + minor*100 + patch (2.9 and later)
        os << v / 10000 << "." << v / 100 % 100 << "." << v % 100;
    } else {
        // CUDA: major*1000 + minor*10
        os << v / 1000 << "." << v % 1000 / 10;
    }
    return os.str();
}

std::string mib(int64_t b) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%lld B (%.2f MiB)", static_cast<long long>(b), static_cast<double>(b) / (1 << 20));
    return buf;
}

struct Tensor {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    int64_t bytes = 0;
};

std::string shape_text(const std::vector<int64_t>& s) {
    std::ostringstream os;
    os << "[";
    for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
    os << "]";
    return os.str();
}

std::vector<Tensor> layout_tensors(const BufferConfig& cfg, int nr, Layout layout, int alignment, bool mn_major) {
    const int e_local = cfg.num_experts / nr;
    const int64_t rows = contiguous_rows_cap(nr, cfg.max_tokens_per_rank, cfg.num_topk, e_local, alignment);
    const detail::DispatchOutputSpecs sp = detail::dispatch_output_specs(cfg, nr, layout, rows, mn_major);
    std::vector<Tensor> out;
    auto add = [&](const char* name, const detail::OutputSpec& o) {
        out.push_back(
            {name, dtype_name(o.dtype), o.shape, o.storage_elems * static_cast<int64_t>(dtype_size(o.dtype))});
    };
    add("recv_x", sp.recv_x);
    if (sp.recv_scales) add("recv_scales", *sp.recv_scales);
    add("recv_weights", sp.recv_weights);
    add("recv_src", sp.recv_src);
    if (sp.m_indices) add("m_indices", *sp.m_indices);
    if (layout == Layout::kExpertContiguous) {
        out.push_back({"counts", "int32", {e_local}, int64_t{e_local} * 4});
        out.push_back({"offsets", "int32", {e_local + 1}, int64_t{e_local + 1} * 4});
    } else {
        out.push_back({"masked_m", "int32", {e_local}, int64_t{e_local} * 4});
    }
    return out;
}

}  // namespace

int run_info_command(InfoOptions& o) {
    const SystemInfo si = system_info();
    // Why there is no GPU, in words that say what follows (not "driver version is insufficient"
    // when there is no driver at all); the library's own note stays in the JSON.
    std::string no_gpu;
    if (si.gpus.empty()) {
        no_gpu = gpu_unavailable_reason();
        if (no_gpu.empty()) no_gpu = si.note.empty() ? "no CUDA GPU found" : si.note;
        no_gpu += std::string(": the CUDA backend is unavailable, ") +
                  (o.scenario.backend == BackendKind::kCUDA ? "--backend cuda fails" : "the CPU backend is used");
    }
    nlohmann::ordered_json j;
    j["version"] = si.version;
    j["backends_compiled"] = si.backends_compiled;
    j["cuda_runtime_version"] = si.cuda_runtime_version;
    j["cuda_driver_version"] = si.cuda_driver_version;
    j["nccl_version"] = si.nccl_version;
    j["note"] = si.note;
    j["gpu_unavailable"] = no_gpu.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(no_gpu);
    j["gpus"] = nlohmann::ordered_json::array();
    for (const auto& g : si.gpus)
        j["gpus"].push_back({{"index", g.index},
                             {"name", g.name},
                             {"compute_capability", std::to_string(g.major) + "." + std::to_string(g.minor)},
                             {"memory_bytes", g.memory_bytes},
                             {"num_sms", g.num_sms}});
    j["backend_auto"] = backend_name(Buffer::resolve_backend(BackendKind::kAuto));

    std::ostringstream os;
    os << "elasticep " << si.version << "\n";
    os << "backends compiled: " << si.backends_compiled << " (auto resolves to "
       << backend_name(Buffer::resolve_backend(BackendKind::kAuto)) << ")\n";
    os << "CUDA runtime: " << version_text(si.cuda_runtime_version, false)
       << ", driver: " << version_text(si.cuda_driver_version, false)
       << ", NCCL: " << version_text(si.nccl_version, true) << "\n";
    if (si.gpus.empty()) {
        os << "GPUs: none: " << no_gpu << "\n";
    } else {
        os << "GPUs: " << si.gpus.size() << "\n";
        for (const auto& g : si.gpus)
            os << "  [" << g.index << "] " << g.name << ", sm_" << g.major << g.minor << ", " << g.num_sms << " SMs, "
               << mib(static_cast<int64_t>(g.memory_bytes)) << "\n";
        if (!si.note.empty()) os << "note: " << si.note << "\n";
    }

    if (o.show_config) {
        const Scenario& s = o.scenario;
        s.validate();
        const BufferConfig cfg = s.buffer_config();
        const int nr = s.num_ranks;
        nlohmann::ordered_json c;
        c["ranks"] = nr;
        c["experts"] = cfg.num_experts;
        c["local_experts"] = cfg.num_experts / nr;
        c["topk"] = cfg.num_topk;
        c["hidden"] = cfg.hidden;
        c["max_tokens_per_rank"] = cfg.max_tokens_per_rank;
        c["payload"] = payload_name(cfg.payload);
        if (cfg.payload == Payload::kFP8) c["scale_format"] = scale_format_name(cfg.scale_format);
        c["alignment"] = s.alignment;
        c["topology"] = topology_name(cfg.topology);
        c["ranks_per_node"] = cfg.ranks_per_node;
        c["scaleout"] = scaleout_name(cfg.scaleout);
        const int cols = cfg.payload == Payload::kFP8 ? scale_columns(cfg.scale_format, cfg.hidden) : 0;
        const int64_t msg =
            MessageLayout::make(cfg.hidden, cfg.num_topk, cfg.payload == Payload::kFP8 ? 1 : 2, cols).bytes;
        c["message_bytes"] = msg;

        os << "\nbuffer: " << cfg.describe() << " on " << nr << " ranks\n";
        os << "  wire message: " << msg << " B per token and destination rank\n";
        nlohmann::ordered_json res = nlohmann::ordered_json::object();
        for (BackendKind b : {BackendKind::kCPU, BackendKind::kCUDA}) {
            if (s.backend != BackendKind::kAuto && s.backend != b) continue;
            try {
                const size_t bytes = Buffer::reservation_bytes(cfg, nr, b);
                res[backend_name(b)] = bytes;
                os << "  reservation per rank (" << backend_name(b) << "): " << mib(static_cast<int64_t>(bytes))
                   << "\n";
            } catch (const Error& e) {
                res[backend_name(b)] = nullptr;
                os << "  reservation per rank (" << backend_name(b) << "): n/a (" << e.message() << ")\n";
            }
        }
        c["reservation_bytes"] = res;
        // The CUDA figures by path, from the formula (CPU-side arithmetic: printed without a GPU too)
        {
            const detail::CudaReservation cr = detail::cuda_reservation(cfg, nr);
            const int64_t full = int64_t{nr} * cfg.max_tokens_per_rank;
            os << "  CUDA reservation per rank, by path (formula; docs/PERFORMANCE.md, \"Memory\"):\n";
            os << "    staged, host sync: " << mib(cr.staged()) << " = message ring R*S*(message + 4K) "
               << mib(cr.dispatch_ring) << " (S = " << cr.ring << " of C = " << cfg.max_tokens_per_rank
               << " slots per sender" << (cr.ring < cfg.max_tokens_per_rank ? "; busier pairs stream in rounds" : "")
               << ") + combine slots C*min(K,R)*H*2 " << mib(cr.combine_slots) << " + route tables R*C*K*8 + C*K*12 "
               << mib(cr.route_tables) << " + combine output C*H*2 " << mib(cr.combine_out) << "\n";
            os << "    staged, graph mode: " << mib(cr.staged_graph_mode())
               << " (the first graph-mode call grows the ring to C: + " << mib(cr.graph_extension) << ")\n";
            os << "    direct (every rank a thread of one process on one GPU): " << mib(cr.direct)
               << " = route tables C*K*20 + combine output (no slots: rows go straight into the receivers' outputs)\n";
            os << "    (a window of R*C messages and R*C partial rows would be "
               << mib(full * (detail::message_layout(cfg).bytes + int64_t{cfg.hidden} * 2)) << ")\n";
            nlohmann::ordered_json cj;
            cj["ring_slots"] = cr.ring;
            cj["staged_host_sync_bytes"] = cr.staged();
            cj["staged_graph_mode_bytes"] = cr.staged_graph_mode();
            cj["direct_bytes"] = cr.direct;
            cj["parts"] = {{"dispatch_ring", cr.dispatch_ring},
                           {"combine_slots", cr.combine_slots},
                           {"route_tables", cr.route_tables},
                           {"combine_out", cr.combine_out},
                           {"graph_extension", cr.graph_extension}};
            c["cuda_reservation"] = cj;
        }
        std::vector<std::pair<BackendKind, int64_t>> reserved;
        for (BackendKind b : {BackendKind::kCPU, BackendKind::kCUDA})
            if (res.contains(backend_name(b)) && !res[backend_name(b)].is_null())
                reserved.emplace_back(b, res[backend_name(b)].get<int64_t>());

        nlohmann::ordered_json layouts;
        for (Layout l : {Layout::kExpertContiguous, Layout::kExpertMasked}) {
            nlohmann::ordered_json lj;
            int64_t total = 0;
            os << "  " << layout_name(l) << " layout outputs";
            if (l == Layout::kExpertContiguous)
                os << " (worst case M_cap = "
                   << contiguous_rows_cap(nr, cfg.max_tokens_per_rank, cfg.num_topk, cfg.num_experts / nr, s.alignment)
                   << " rows, alignment " << s.alignment << "; with host sync only M rows are returned)";
            os << ":\n";
            for (const Tensor& t : layout_tensors(cfg, nr, l, s.alignment, s.scales_mn_major)) {
                char line[160];
                std::snprintf(line, sizeof line, "    %-13s %-8s %-24s %s\n", t.name.c_str(), t.dtype.c_str(),
                              shape_text(t.shape).c_str(), mib(t.bytes).c_str());
                os << line;
                lj[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"bytes", t.bytes}};
                total += t.bytes;
            }
            os << "    outputs " << mib(total) << "\n";
            lj["total_bytes"] = total;
            nlohmann::ordered_json per_rank = nlohmann::ordered_json::object();
            for (const auto& [b, bytes] : reserved) {
                os << "    per rank (" << backend_name(b) << "): reservation " << mib(bytes) << " + outputs "
                   << mib(total) << " = " << mib(bytes + total) << "\n";
                per_rank[backend_name(b)] = bytes + total;
            }
            lj["per_rank_total_bytes"] = per_rank;
            layouts[layout_name(l)] = lj;
        }
        const int64_t out_bytes = int64_t{cfg.max_tokens_per_rank} * cfg.hidden * 2;
        os << "  combine output: bf16 [" << cfg.max_tokens_per_rank << ", " << cfg.hidden << "] at most, "
           << mib(out_bytes) << " (part of the reservation)\n";
        os << "  Layout outputs are allocated at the first dispatch of that layout, for its worst case, on top of\n"
              "  the reservation; a rank that uses both layouts holds both.\n";
        c["layouts"] = layouts;
        c["combine_out_bytes"] = out_bytes;
        j["config"] = c;
    }
    o.json.emit(j.dump(2) + "\n", os.str());
    return kExitOk;
}

}  // namespace elasticep::cli
