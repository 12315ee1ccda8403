// `elasticep bench --moe-layer`: shared expert -> dispatch -> routed experts -> combine, the whole
// MoE layer of a DeepSeek-V3-shaped model with synthetic weights, on ranks as threads. Every stage
// is timed per rank (CUDA events on a GPU, a steady clock on the CPU); the layer's output is
// compared with the dense reference (one token at a time through its experts, no dispatch) under
// the FP8 error model of docs/SERVING.md.
#include "moe_layer.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "commands.hpp"
#include "core/check.hpp"
#include "core/numerics.hpp"
#include "elasticep/elasticep.hpp"
#include "moe/dense_reference.hpp"
#include "moe/synthetic_weights.hpp"

#if defined(ELASTICEP_CLI_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace elasticep::cli {
namespace {

namespace mr = elasticep::moe_ref;

constexpr const char* kDeepSeekV3Quant =
    R"({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]})";

// ---- the quantization_config (nlohmann-json) -----------------------------------------------------

QuantizationConfig parse_quant(std::string text) {
    if (text.empty()) text = kDeepSeekV3Quant;
    if (text == "none" || text == "null") return QuantizationConfig{};
    if (text[0] == '@') {
        std::ifstream f(text.substr(1));
        if (!f) throw Error(ErrorCode::kInvalidArgument, "--quant-config: cannot read " + text.substr(1));
        std::stringstream ss;
        ss << f.rdbuf();
        text = ss.str();
    }
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
        throw Error(ErrorCode::kInvalidArgument, std::string("--quant-config is not JSON: ") + e.what());
    }
    if (j.contains("quantization_config")) j = j["quantization_config"];  // a whole config.json
    if (j.is_null()) return QuantizationConfig{};
    if (!j.is_object()) throw Error(ErrorCode::kInvalidArgument, "--quant-config must be a JSON object, null or none");
    QuantizationConfig q;
    q.present = true;
    auto str = [&](const char* k) {
        return j.contains(k) && j[k].is_string() ? j[k].get<std::string>() : std::string();
    };
    q.quant_method = str("quant_method");
    q.fmt = str("fmt");
    q.activation_scheme = str("activation_scheme");
    q.format = str("format");
    q.quant_algo = str("quant_algo");
    if (q.quant_algo.empty() && j.contains("quantization") && j["quantization"].is_object() &&
        j["quantization"].contains("quant_algo"))
        q.quant_algo = j["quantization"]["quant_algo"].get<std::string>();
    if (j.contains("bits") && j["bits"].is_number_integer()) q.bits = j["bits"].get<int64_t>();
    if (j.contains("weight_block_size") && j["weight_block_size"].is_array())
        q.weight_block_size = j["weight_block_size"].get<std::vector<int64_t>>();
    return q;
}

// ---- per-rank device memory and timing ----------------------------------------------------------

struct Mem {
    bool cuda = false;
    std::vector<void*> owned;
    ~Mem() {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        for (void* p : owned) cudaFree(p);
#endif
    }
    void* alloc(size_t bytes) {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        if (cuda) {
            void* p = nullptr;
            if (cudaMalloc(&p, std::max<size_t>(bytes, 16)) != cudaSuccess)
                throw Error(ErrorCode::kCuda,
                            "bench --moe-layer: cudaMalloc of " + std::to_string(bytes) + " bytes failed");
            owned.push_back(p);
            return p;
        }
#endif
        host.emplace_back(std::max<size_t>(bytes, 16));
        return host.back().data();
    }
    TensorRef put(const void* src, DType dt, std::vector<int64_t> shape) {
        TensorRef t = TensorRef::contiguous(nullptr, dt, std::move(shape), device());
        t.data = alloc(t.nbytes());
        copy_in(t.data, src, t.nbytes());
        return t;
    }
    TensorRef empty(DType dt, std::vector<int64_t> shape) {
        TensorRef t = TensorRef::contiguous(nullptr, dt, std::move(shape), device());
        t.data = alloc(t.nbytes());
        return t;
    }
    void copy_in(void* dst, const void* src, size_t n) {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        if (cuda) {
            // finished before returning (a pageable cudaMemcpy may return before its DMA lands, and the
            // ranks' streams are not ordered after the legacy stream)
            if (n && (cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice) != cudaSuccess ||
                      cudaStreamSynchronize(cudaStreamLegacy) != cudaSuccess))
                throw Error(ErrorCode::kCuda, "bench --moe-layer: upload failed");
            return;
        }
#endif
        if (n) std::memcpy(dst, src, n);
    }
    std::vector<uint16_t> fetch_bf16(const TensorRef& t) {
        std::vector<uint16_t> v(static_cast<size_t>(t.numel()));
#if defined(ELASTICEP_CLI_WITH_CUDA)
        if (cuda) {
            if (!v.empty() && cudaMemcpy(v.data(), t.data, v.size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
                throw Error(ErrorCode::kCuda, "bench --moe-layer: download failed");
            return v;
        }
#endif
        if (!v.empty()) std::memcpy(v.data(), t.data, v.size() * 2);
        return v;
    }
    Device device() const { return cuda ? Device{DeviceType::kCUDA, 0} : Device{}; }
    std::vector<std::vector<uint8_t>> host;
};

// Timestamps on the rank's stream (CUDA events) or the host clock; elapsed() after a sync.
class Marks {
 public:
    Marks(bool cuda, void* stream, int n) : cuda_(cuda), stream_(stream), host_(static_cast<size_t>(n)) {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        if (cuda_)
            for (int i = 0; i < n; ++i) {
                cudaEvent_t e;
                cudaEventCreate(&e);
                events_.push_back(e);
            }
#endif
    }
    ~Marks() {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        for (auto e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
#endif
    }
    void mark(int i) {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        if (cuda_) {
            cudaEventRecord(static_cast<cudaEvent_t>(events_[static_cast<size_t>(i)]),
                            static_cast<cudaStream_t>(stream_));
            return;
        }
#endif
        host_[static_cast<size_t>(i)] = std::chrono::steady_clock::now();
    }
    void sync() {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        if (cuda_) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
#endif
    }
    double us(int a, int b) const {
#if defined(ELASTICEP_CLI_WITH_CUDA)
        if (cuda_) {
            float ms = 0;
            cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[static_cast<size_t>(a)]),
                                 static_cast<cudaEvent_t>(events_[static_cast<size_t>(b)]));
            return ms * 1000.0;
        }
#endif
        return std::chrono::duration<double, std::micro>(host_[static_cast<size_t>(b)] - host_[static_cast<size_t>(a)])
            .count();
    }

 private:
    bool cuda_;
    void* stream_;
    std::vector<std::chrono::steady_clock::time_point> host_;
    std::vector<void*> events_;
};

// ---- inputs -------------------------------------------------------------------------------------

struct RankInputs {
    int64_t t = 0;
    std::vector<uint16_t> x;   // [T, H] bf16
    std::vector<int64_t> idx;  // [T, K] distinct experts
    std::vector<float> w;      // [T, K] softmax over the chosen experts, times the routed scaling factor
};

RankInputs make_rank_inputs(int64_t t, int e, int k, int64_t h, double rsf, uint64_t seed) {
    RankInputs in;
    in.t = t;
    std::mt19937_64 g(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    in.x.resize(static_cast<size_t>(t * h));
    for (auto& v : in.x) v = num::float_to_bf16(nd(g));
    in.idx.resize(static_cast<size_t>(t * k));
    in.w.resize(static_cast<size_t>(t * k));
    std::vector<int64_t> pool(static_cast<size_t>(e));
    for (int64_t i = 0; i < t; ++i) {
        for (int j = 0; j < e; ++j) pool[static_cast<size_t>(j)] = j;
        double sum = 0;
        std::vector<double> logit(static_cast<size_t>(k));
        for (int j = 0; j < k; ++j) {
            std::swap(pool[static_cast<size_t>(j)], pool[static_cast<size_t>(j + static_cast<int>(g() % (e - j)))]);
            in.idx[static_cast<size_t>(i * k + j)] = pool[static_cast<size_t>(j)];
            logit[static_cast<size_t>(j)] = std::exp(nd(g));
            sum += logit[static_cast<size_t>(j)];
        }
        for (int j = 0; j < k; ++j)
            in.w[static_cast<size_t>(i * k + j)] = static_cast<float>(logit[static_cast<size_t>(j)] / sum * rsf);
    }
    return in;
}

struct StageStats {
    std::string name;
    std::vector<double> round_us;  // per timed round: the slowest rank
    double median = 0, min = 0, max = 0;
    void finish() {
        if (round_us.empty()) return;
        std::vector<double> v = round_us;
        std::sort(v.begin(), v.end());
        median = v[v.size() / 2];
        min = v.front();
        max = v.back();
    }
};

}  // namespace

void add_moe_layer_options(CLI::App* bench, MoeLayerCli& m) {
    bench->add_flag(
        "--moe-layer", m.enabled,
        "time a whole MoE layer instead (shared expert, dispatch, routed experts, combine) with synthetic "
        "weights, checked against a dense reference; DeepSeek-V3's shape on a GPU, a reduced one on the CPU");
    bench
        ->add_option("--intermediate", m.intermediate, "--moe-layer: expert intermediate size I (0: 2048 GPU, 256 CPU)")
        ->check(CLI::NonNegativeNumber);
    bench->add_option("--shared-experts", m.shared_experts, "--moe-layer: shared experts (0 or 1)")
        ->check(CLI::Range(0, 1));
    bench->add_option("--routed-scaling", m.routed_scaling, "--moe-layer: routed scaling factor (DeepSeek-V3: 2.5)")
        ->check(CLI::PositiveNumber);
    bench->add_option("--phase", m.phase, "--moe-layer: decode (masked slab) or prefill (aligned contiguous rows)")
        ->check(CLI::IsMember({"decode", "prefill", "extend"}));
    bench
        ->add_option("--weight-placement", m.weight_placement,
                     "--moe-layer: route weights in combine or in the adapter")
        ->check(CLI::IsMember({"combine", "adapter"}));
    bench->add_option("--quant-config", m.quant_config,
                      "--moe-layer: the checkpoint's quantization_config as JSON (or @file, or none for bf16 experts); "
                      "default DeepSeek-V3's");
    bench->add_option("--check-tokens", m.check_tokens,
                      "--moe-layer: tokens per rank checked against the dense reference (-1: all on small shapes, 2 on "
                      "DeepSeek-V3-sized ones)");
    bench->add_flag("--force-dequant", m.force_dequant, "--moe-layer: FP8 on a GPU: dequantize to bf16 GEMMs");
}

int run_moe_layer_command(CLI::App* bench, const Scenario& s, JsonOutput& json, const MoeLayerCli& m) {
    auto given = [&](const char* name) { return bench->get_option(name)->count() > 0; };
    const BackendKind backend = Buffer::resolve_backend(s.backend);
    const bool gpu = backend == BackendKind::kCUDA;
#if !defined(ELASTICEP_CLI_WITH_CUDA)
    if (gpu) throw Error(ErrorCode::kUnsupported, "bench --moe-layer: this CLI was built without CUDA");
#endif
    // the shape: the bench's options when given, else the layer's defaults
    const int ranks = given("--ranks") ? s.num_ranks : gpu ? 8 : 2;
    const int experts = given("--experts") ? s.num_experts : gpu ? 256 : 16;
    const int topk = given("--topk") ? s.num_topk : gpu ? 8 : 4;
    const int64_t hidden = given("--hidden") ? s.hidden : gpu ? 7168 : 1024;
    const int64_t inter = m.intermediate > 0 ? m.intermediate : gpu ? 2048 : 256;
    const int64_t tokens = given("--tokens") ? s.tokens : gpu ? 128 : 8;
    const int rounds = s.rounds, warmup = s.warmup;
    ELASTICEP_CHECK_ARG(experts % ranks == 0, "--experts ", experts, " is not a multiple of --ranks ", ranks);
    ELASTICEP_CHECK_ARG(topk <= experts, "--topk ", topk, " exceeds --experts ", experts);
    const Phase phase = parse_phase(m.phase);
    const WeightPlacement placement = parse_weight_placement(m.weight_placement);
    const ExpertQuant quant = check_expert_quant(parse_quant(m.quant_config));
    ELASTICEP_CHECK(quant.kind != ExpertQuantKind::kMXFP8, ErrorCode::kUnsupported,
                    "bench --moe-layer: the reference MoE layer has bf16 and FP8 128x128 paths, not MXFP8 (",
                    quant.describe(), ")");
    const bool fp8 = quant.kind == ExpertQuantKind::kFP8Block128;

    // start-up checks, as an engine runs them
    ServingBudget sb;
    sb.max_tokens_per_rank = tokens;
    sb.role = phase == Phase::kDecode ? ServingRole::kDecode : ServingRole::kPrefill;
    sb.chunked_prefill_size = tokens;
    sb.cuda_graph_max_bs = tokens;
    const BudgetReport budget = check_serving_budget(sb);
    BufferConfig base{.num_experts = experts,
                      .num_topk = topk,
                      .hidden = static_cast<int>(hidden),
                      .max_tokens_per_rank = static_cast<int>(tokens)};
    base.num_sms = s.num_sms;
    base.timeout = std::chrono::milliseconds(s.timeout_ms);
    base.device = gpu ? 0 : -1;
    const BufferConfig cfg = serving_buffer_config(base, quant);
    const int e_local = experts / ranks;
    const int threads = mr::hardware_threads();

    const auto t_setup = std::chrono::steady_clock::now();
    const mr::SyntheticExperts weights =
        mr::make_synthetic_experts(quant.kind, 0, experts, hidden, inter, s.seed, threads);
    const mr::SyntheticExperts shared_w = mr::make_synthetic_experts(quant.kind, experts, 1, hidden, inter, s.seed, 1);
    std::vector<RankInputs> inputs;
    for (int r = 0; r < ranks; ++r)
        inputs.push_back(make_rank_inputs(tokens, experts, topk, hidden, m.routed_scaling,
                                          s.seed * 7919 + static_cast<uint64_t>(r)));
    const double setup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_setup).count();

    enum { kShared, kDispatch, kExperts, kCombine, kStages };
    const char* stage_names[kStages] = {"shared expert", "dispatch", "experts", "combine"};
    std::vector<std::vector<std::vector<double>>> us(
        static_cast<size_t>(rounds),
        std::vector<std::vector<double>>(static_cast<size_t>(ranks), std::vector<double>(kStages)));
    std::vector<std::vector<uint16_t>> outs(static_cast<size_t>(ranks));
    std::string note;
    std::vector<std::string> errors(static_cast<size_t>(ranks));
    auto groups = ThreadGroup::create(ranks, std::chrono::milliseconds(std::max(60000, s.timeout_ms)));
    std::vector<std::thread> pool;
    for (int r = 0; r < ranks; ++r)
        pool.emplace_back([&, r] {
            try {
#if defined(ELASTICEP_CLI_WITH_CUDA)
                cudaStream_t stream = nullptr;
                if (gpu) {
                    cudaSetDevice(0);
                    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
                }
                void* sp = stream;
#else
                void* sp = nullptr;
#endif
                Mem mem;
                mem.cuda = gpu;
                auto buf = Buffer::create(groups[static_cast<size_t>(r)], cfg, backend);
                MoeDispatcher disp(buf, DispatcherOptions{.weight_placement = placement});
                ExpertWeights ew = weights.tensors(r * e_local, e_local), sw = shared_w.tensors(0, 1);
                for (ExpertWeights* w : {&ew, &sw}) {  // onto the rank's device
                    w->gate_up = mem.put(w->gate_up.data, w->gate_up.dtype, w->gate_up.shape);
                    w->down = mem.put(w->down.data, w->down.dtype, w->down.shape);
                    if (w->gate_up_scales)
                        *w->gate_up_scales =
                            mem.put(w->gate_up_scales->data, DType::kFloat32, w->gate_up_scales->shape);
                    if (w->down_scales)
                        *w->down_scales = mem.put(w->down_scales->data, DType::kFloat32, w->down_scales->shape);
                }
                const MoeLayerOptions lo{.force_dequant = m.force_dequant};
                ReferenceMoeLayer layer(ew, mem.device(), lo), shared(sw, mem.device(), lo);
                if (r == 0) note = layer.path_note();
                const RankInputs& in = inputs[static_cast<size_t>(r)];
                const TensorRef x = mem.put(in.x.data(), DType::kBFloat16, {in.t, hidden});
                const TensorRef idx = mem.put(in.idx.data(), DType::kInt64, {in.t, topk});
                const TensorRef w = mem.put(in.w.data(), DType::kFloat32, {in.t, topk});
                const TensorRef bias = mem.empty(DType::kBFloat16, {in.t, hidden});
                const TensorRef out = mem.empty(DType::kBFloat16, {in.t, hidden});
                const int64_t y_rows =
                    std::max<int64_t>(int64_t{e_local} * ranks * tokens, buf->max_contiguous_rows(128));
                const TensorRef ybuf = mem.empty(DType::kBFloat16, {y_rows, hidden});
                Marks marks(gpu, sp, kStages + 1);
                for (int round = 0; round < warmup + rounds; ++round) {
                    buf->group()->barrier();  // launch skew does not count as communication time
                    marks.mark(0);
                    if (m.shared_experts) shared.forward_dense(0, x, bias, sp);
                    marks.mark(1);
                    const MoeDispatchOutput d = disp.dispatch(phase, x, idx, w, sp);
                    marks.mark(2);
                    TensorRef y = ybuf;
                    y.shape = d.hidden_states.shape;
                    layer.forward(d, y, sp);
                    marks.mark(3);
                    disp.combine(y, sp, m.shared_experts ? std::optional<TensorRef>(bias) : std::nullopt, out);
                    marks.mark(4);
                    marks.sync();
                    if (round >= warmup)
                        for (int st = 0; st < kStages; ++st)
                            us[static_cast<size_t>(round - warmup)][static_cast<size_t>(r)][static_cast<size_t>(st)] =
                                marks.us(st, st + 1);
                }
                outs[static_cast<size_t>(r)] = mem.fetch_bf16(out);
                buf->check();
#if defined(ELASTICEP_CLI_WITH_CUDA)
                if (stream) cudaStreamDestroy(stream);
#endif
            } catch (const std::exception& e) {
                errors[static_cast<size_t>(r)] = e.what();
            }
        });
    for (auto& t : pool) t.join();
    for (int r = 0; r < ranks; ++r)
        if (!errors[static_cast<size_t>(r)].empty())
            throw Error(ErrorCode::kInternal,
                        "bench --moe-layer: rank " + std::to_string(r) + ": " + errors[static_cast<size_t>(r)]);

    // stage statistics: per round the slowest rank
    std::vector<StageStats> stages(kStages + 1);
    for (int st = 0; st <= kStages; ++st) {
        stages[static_cast<size_t>(st)].name = st == kStages ? "layer" : stage_names[st];
        for (int round = 0; round < rounds; ++round) {
            double worst = 0;
            for (int r = 0; r < ranks; ++r) {
                double v = 0;
                for (int q = 0; q < kStages; ++q)
                    if (q == st || st == kStages)
                        v += us[static_cast<size_t>(round)][static_cast<size_t>(r)][static_cast<size_t>(q)];
                worst = std::max(worst, v);
            }
            stages[static_cast<size_t>(st)].round_us.push_back(worst);
        }
        stages[static_cast<size_t>(st)].finish();
    }
    const double comm = stages[kDispatch].median + stages[kCombine].median;
    const double total =
        stages[kShared].median + stages[kDispatch].median + stages[kExperts].median + stages[kCombine].median;

    // the check against the dense reference
    const bool big = int64_t{ranks} * tokens * topk * hidden * inter > (int64_t{1} << 33);
    const int64_t per_rank = m.check_tokens >= 0 ? std::min<int64_t>(m.check_tokens, tokens)
                             : big               ? std::min<int64_t>(2, tokens)
                                                 : tokens;
    std::vector<std::pair<int, int64_t>> rows;
    for (int r = 0; r < ranks; ++r)
        for (int64_t t = 0; t < per_rank; ++t)
            rows.emplace_back(r, t * std::max<int64_t>(1, tokens / std::max<int64_t>(1, per_rank)));
    const auto t_ref = std::chrono::steady_clock::now();
    const mr::ErrorModel model{.fp8 = fp8, .dequant_operands = note.find("DEQUANTIZED") != std::string::npos};
    const mr::ExpertView sv = shared_w.view(0);
    std::vector<mr::Tracked> want(rows.size());
    mr::parallel_for(static_cast<int64_t>(rows.size()), threads, [&](int64_t j) {
        const auto [r, t] = rows[static_cast<size_t>(j)];
        const RankInputs& in = inputs[static_cast<size_t>(r)];
        want[static_cast<size_t>(j)] = mr::moe_token(
            in.x.data() + t * hidden, hidden, in.idx.data() + t * topk, in.w.data() + t * topk, topk,
            [&](int64_t e) { return weights.view(e); }, m.shared_experts ? &sv : nullptr, model);
    });
    mr::Comparison cmp;
    for (size_t j = 0; j < rows.size(); ++j) {
        const auto [r, t] = rows[j];
        for (int64_t n = 0; n < hidden; ++n)
            cmp.add(num::bf16_to_float(outs[static_cast<size_t>(r)][static_cast<size_t>(t * hidden + n)]), want[j], n);
    }
    cmp.finish();
    const double ref_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_ref).count();
    const bool pass = cmp.pass();

    std::ostringstream shape;
    shape << "H=" << hidden << ", I=" << inter << ", E=" << experts << ", K=" << topk << ", shared experts "
          << m.shared_experts << ", routed scaling " << m.routed_scaling;
    if (json.requested) {
        nlohmann::ordered_json j;
        j["shape"] = {{"hidden", hidden},
                      {"intermediate", inter},
                      {"experts", experts},
                      {"topk", topk},
                      {"shared_experts", m.shared_experts},
                      {"routed_scaling", m.routed_scaling}};
        j["ranks"] = ranks;
        j["tokens_per_rank"] = tokens;
        j["phase"] = phase_name(phase);
        j["weight_placement"] = weight_placement_name(placement);
        j["backend"] = backend_name(backend);
        j["experts_quant"] = quant.describe();
        j["dispatch"] = cfg.describe();
        j["gemm_path"] = note;
        j["budget"] = budget.describe();
        for (const StageStats& st : stages)
            j["stages_us"][st.name] = {
                {"median", st.median}, {"min", st.min}, {"max", st.max}, {"rounds", st.round_us}};
        j["communication_share"] = total > 0 ? comm / total : 0.0;
        j["check"] = {{"tokens", rows.size()},          {"values", cmp.elements},
                      {"rms_err", cmp.rms_err},         {"rms_sigma", cmp.rms_sigma},
                      {"rms_ratio", cmp.rms_ratio()},   {"rms_ratio_limit", 1.5},
                      {"max_abs_err", cmp.max_abs_err}, {"max_worst_ratio", cmp.max_worst_ratio},
                      {"worst_ratio_limit", 2.0},       {"pass", pass}};
        j["setup_s"] = setup_s;
        j["reference_s"] = ref_s;
        json.emit(j.dump(2) + "\n", "");
    }
    if (!json.to_stdout()) {
        std::printf("elasticep bench --moe-layer: MoE layer (%s), %d ranks x %lld tokens, %s, weights in %s\n",
                    shape.str().c_str(), ranks, static_cast<long long>(tokens), phase_name(phase),
                    weight_placement_name(placement));
        if (!gpu && !given("--hidden"))
            std::printf(
                "  (CPU: a reduced shape so it runs in seconds; --hidden 7168 --intermediate 2048 --experts 256 "
                "--topk 8 for DeepSeek-V3's)\n");
        std::printf("experts: %s\ndispatch: %s, backend %s\nbudget: %s\nexpert GEMMs: %s\n", quant.describe().c_str(),
                    cfg.describe().c_str(), backend_name(backend), budget.describe().c_str(), note.c_str());
        std::printf("\n%-14s %12s %12s %12s %8s   (%d timed rounds after %d warm-up; per round the slowest rank)\n",
                    "stage", "median us", "min us", "max us", "share", rounds, warmup);
        for (const StageStats& st : stages) {
            if (st.name == "layer") {  // the slowest rank's whole layer per round (stages overlap across ranks)
                std::printf("%-14s %12.1f %12.1f %12.1f %8s\n", st.name.c_str(), st.median, st.min, st.max, "-");
                continue;
            }
            std::printf("%-14s %12.1f %12.1f %12.1f %7.1f%%\n", st.name.c_str(), st.median, st.min, st.max,
                        total > 0 ? 100.0 * st.median / total : 0.0);
        }
        std::printf("communication (dispatch + combine): %.1f%% of the sum of the stage medians\n",
                    total > 0 ? 100.0 * comm / total : 0.0);
        std::printf(
            "\ncheck vs the dense reference (%zu tokens, %lld values): rms err / rms sigma %.3f (pass <= 1.5), "
            "max err / first-order worst case %.4f (pass <= 2), max abs err %.4g: %s\n",
            rows.size(), static_cast<long long>(cmp.elements), cmp.rms_ratio(), cmp.max_worst_ratio, cmp.max_abs_err,
            pass ? "PASS" : "FAIL");
        std::printf("(setup %.1f s, reference %.1f s; the error model is derived in docs/SERVING.md)\n", setup_s,
                    ref_s);
    }
    return pass ? kExitOk : kExitFailed;
}

}  // namespace elasticep::cli
