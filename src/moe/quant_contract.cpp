// Expert-quant contract (serving.hpp, part 2) and the scale format a GPU's grouped GEMMs read.
#include <algorithm>
#include <cctype>
#include <sstream>
#include <string>

#include "core/check.hpp"
#include "elasticep/info.hpp"
#include "elasticep/serving.hpp"
#include "moe/moe_internal.hpp"

namespace elasticep {
namespace {

constexpr const char* kUseInstead =
    "use bf16 experts (no quantization_config), an FP8 E4M3 checkpoint with weight_block_size [128, 128] and "
    "activation_scheme 'dynamic' (quant_method 'fp8', as DeepSeek-V3 and Qwen3-*-FP8 ship), or MXFP8 "
    "(quant_method 'mxfp8': E4M3 with UE8M0 scales per 1x32 block, dynamic activations)";

std::string lower(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return s;
}

std::string block_text(const std::vector<int64_t>& b) {
    std::string s = "[";
    for (size_t i = 0; i < b.size(); ++i) s += (i ? ", " : "") + std::to_string(b[i]);
    return s + "]";
}

std::string found_text(const QuantizationConfig& q) {
    std::ostringstream os;
    os << "{quant_method: '" << q.quant_method << "'";
    if (!q.fmt.empty()) os << ", fmt: '" << q.fmt << "'";
    if (!q.activation_scheme.empty()) os << ", activation_scheme: '" << q.activation_scheme << "'";
    if (q.weight_block_size) os << ", weight_block_size: " << block_text(*q.weight_block_size);
    if (!q.format.empty()) os << ", format: '" << q.format << "'";
    if (!q.quant_algo.empty()) os << ", quant_algo: '" << q.quant_algo << "'";
    if (q.bits) os << ", bits: " << q.bits;
    return os.str() + "}";
}

[[noreturn]] void reject(const QuantizationConfig& q, const std::string& why) {
    throw Error(ErrorCode::kUnsupported,
                "expert quantization " + found_text(q) + " is not supported: " + why + "; " + kUseInstead);
}

bool is_one_of(const std::string& s, std::initializer_list<const char*> names) {
    for (const char* n : names)
        if (s == n) return true;
    return false;
}

void check_e4m3(const QuantizationConfig& q) {
    const std::string f = lower(q.fmt);
    if (!f.empty() && !is_one_of(f, {"e4m3", "float8_e4m3fn", "e4m3fn"}))
        reject(q, "fmt '" + q.fmt + "' is not E4M3 (the dispatch payload and DeepGEMM's FP8 kernels are E4M3)");
}

void check_dynamic(const QuantizationConfig& q, bool required) {
    const std::string a = lower(q.activation_scheme);
    if (a == "dynamic") return;
    if (a.empty() && !required) return;
    if (a.empty())
        reject(q, "activation_scheme is missing (expected 'dynamic': per-token 1x128 scales computed at run time)");
    if (a == "static")
        reject(q,
               "static activation scales (one calibrated scale per tensor) do not match per-token group "
               "quantization in dispatch");
    reject(q, "activation_scheme '" + q.activation_scheme + "' is not 'dynamic'");
}

}  // namespace

bool ExpertQuant::accepts(ScaleFormat f) const {
    switch (kind) {
        case ExpertQuantKind::kBF16:
            return false;
        case ExpertQuantKind::kFP8Block128:
            return f == ScaleFormat::kF32G128 || f == ScaleFormat::kUE8M0G128;
        case ExpertQuantKind::kMXFP8:
            return f == ScaleFormat::kUE8M0G32;
    }
    return false;
}

std::string ExpertQuant::describe() const {
    switch (kind) {
        case ExpertQuantKind::kBF16:
            return "bf16 experts (" + source + "), bf16 dispatch";
        case ExpertQuantKind::kFP8Block128:
            return "FP8 E4M3 experts, 128x128 weight blocks, 1x128 dynamic activation scales (" + source +
                   "); fp8 dispatch with f32_g128 (Hopper) or ue8m0_g128 (Blackwell) scales";
        case ExpertQuantKind::kMXFP8:
            return "MXFP8 experts, 1x32 UE8M0 blocks, dynamic activations (" + source +
                   "); fp8 dispatch with ue8m0_g32";
    }
    return "?";
}

void ExpertQuant::check_buffer(const BufferConfig& c) const {
    if (kind == ExpertQuantKind::kBF16) {
        ELASTICEP_CHECK_ARG(c.payload == Payload::kBF16, "the experts are bf16 (", source,
                            ") but the buffer dispatches fp8; build it with payload=bf16 (fp8 rows would be "
                            "quantized for experts that do not expect it)");
        return;
    }
    ELASTICEP_CHECK_ARG(c.payload == Payload::kFP8, "the experts are quantized (", describe(),
                        ") but the buffer dispatches bf16; build it with payload=fp8");
    ELASTICEP_CHECK_ARG(accepts(c.scale_format), "the buffer's scale format ", scale_format_name(c.scale_format),
                        " (groups of ", scale_group_size(c.scale_format), " channels) does not match the experts' ",
                        activation_group, "-channel activation groups (", describe(), "); build the buffer with ",
                        kind == ExpertQuantKind::kMXFP8 ? "scale_format=ue8m0_g32"
                                                        : "scale_format=f32_g128 (Hopper) or ue8m0_g128 (Blackwell)");
}

ExpertQuant check_expert_quant(const QuantizationConfig& q) {
    ExpertQuant r;
    if (!q.present) {
        r.kind = ExpertQuantKind::kBF16;
        r.source = "no quantization_config";
        return r;
    }
    const std::string m = lower(q.quant_method);
    if (m.empty()) reject(q, "quantization_config has no quant_method");
    if (m == "fp8") {
        check_e4m3(q);
        if (!q.weight_block_size)
            reject(q,
                   "no weight_block_size, so the weights have per-tensor (or per-channel) scales, not 128x128 blocks");
        const std::vector<int64_t>& b = *q.weight_block_size;
        if (b == std::vector<int64_t>{1, 32})
            reject(
                q,
                "1x32 blocks under quant_method 'fp8' carry fp32 scales; MXFP8 checkpoints say quant_method 'mxfp8'");
        if (b != std::vector<int64_t>{128, 128})
            reject(q, "weight_block_size " + block_text(b) +
                          " is not [128, 128] (the block the 1x128 activation groups "
                          "and the grouped GEMM's K tiles are built for)");
        check_dynamic(q, true);
        r.kind = ExpertQuantKind::kFP8Block128;
        r.weight_block_n = r.weight_block_k = 128;
        r.activation_group = 128;
        r.source = "quant_method 'fp8', weight_block_size [128, 128], dynamic activations";
        return r;
    }
    if (m == "mxfp8") {
        check_e4m3(q);
        if (q.weight_block_size && *q.weight_block_size != std::vector<int64_t>{1, 32})
            reject(q, "MXFP8 blocks are [1, 32], not " + block_text(*q.weight_block_size));
        check_dynamic(q, false);
        r.kind = ExpertQuantKind::kMXFP8;
        r.weight_block_n = 1;
        r.weight_block_k = 32;
        r.activation_group = 32;
        r.source = "quant_method 'mxfp8', [1, 32] blocks, dynamic activations";
        return r;
    }
    if (is_one_of(m, {"compressed-tensors", "compressed_tensors"}))
        reject(q, "compressed-tensors checkpoints (format '" + q.format +
                      "') describe their schemes per module group, which this contract does not read; serve the "
                      "model's native FP8 block-quantized release or convert it");
    if (is_one_of(m, {"modelopt", "modelopt_fp8", "modelopt_fp4"}))
        reject(q, "ModelOpt " + (q.quant_algo.empty() ? std::string("quantization") : "'" + q.quant_algo + "'") +
                      " uses per-tensor FP8 or NVFP4 scales, not 128x128 blocks");
    if (is_one_of(m, {"mxfp4", "nvfp4", "fp4", "w4afp8", "petit_nvfp4"}))
        reject(q, "FP4 experts (" + q.quant_method + ") are not dispatched as E4M3 rows with 1x128 or 1x32 scales");
    if (is_one_of(m, {"awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "gguf", "bitsandbytes", "moe_wna16", "qoq",
                      "hqq", "exl2", "auto-round", "auto_round"}))
        reject(q, "weight-only integer quantization (" + q.quant_method +
                      (q.bits ? ", " + std::to_string(q.bits) + "-bit" : std::string()) +
                      ") is not an FP8 format the grouped GEMMs read");
    if (is_one_of(m, {"w8a8_int8", "int8", "smoothquant", "w8a16", "int4"}))
        reject(q, "INT8/INT4 experts (" + q.quant_method + ") are not an FP8 format");
    if (is_one_of(m, {"fbgemm_fp8", "w8a8_fp8", "fp8_per_channel", "ptpc_fp8"}))
        reject(q, "per-channel FP8 (" + q.quant_method + ") has no 128x128 weight blocks");
    reject(q, "unknown quant_method '" + q.quant_method + "'");
}

ScaleFormat scale_format_for_compute_capability(int major) {
    return major >= 10 ? ScaleFormat::kUE8M0G128 : ScaleFormat::kF32G128;
}

ScaleFormat scale_format_for_device(int device) {
    const SystemInfo info = system_info();
    if (info.gpus.empty()) return ScaleFormat::kF32G128;
    const int d = device >= 0 ? device : detail::moe_cuda_current_device();
    for (const GpuInfo& g : info.gpus)
        if (g.index == d) return scale_format_for_compute_capability(g.major);
    ELASTICEP_CHECK_ARG(false, "scale_format_for_device: CUDA device ", d, " does not exist (", info.gpus.size(),
                        " GPU(s) visible)");
    return ScaleFormat::kF32G128;
}

BufferConfig serving_buffer_config(BufferConfig base, const ExpertQuant& quant,
                                   std::optional<ScaleFormat> scale_format) {
    base.payload = quant.payload();
    if (quant.kind == ExpertQuantKind::kBF16) {
        ELASTICEP_CHECK_ARG(!scale_format.has_value(), "serving_buffer_config: a scale format was given (",
                            scale_format_name(*scale_format), ") but the experts are bf16, which dispatch bf16 rows");
        return base;
    }
    if (scale_format) {
        ELASTICEP_CHECK_ARG(quant.accepts(*scale_format), "serving_buffer_config: scale format ",
                            scale_format_name(*scale_format), " does not fit ", quant.describe());
        base.scale_format = *scale_format;
    } else {
        base.scale_format =
            quant.kind == ExpertQuantKind::kMXFP8 ? ScaleFormat::kUE8M0G32 : scale_format_for_device(base.device);
    }
    quant.check_buffer(base);
    return base;
}

}  // namespace elasticep
