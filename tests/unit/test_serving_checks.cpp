// Start-up checks of the serving layer: the token budget (every boundary: == C passes, C + 1 fails)
// and the expert-quant contract (real checkpoint configs accepted, a matrix of rejects).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "elasticep/elasticep.hpp"
#include "harness.hpp"

namespace {

using namespace elasticep;
using eptest::throws_error;

ServingBudget prefill_only(int64_t c, int64_t chunk) {
    ServingBudget b;
    b.max_tokens_per_rank = c;
    b.role = ServingRole::kPrefill;
    b.chunked_prefill_size = chunk;
    return b;
}

ServingBudget decode_only(int64_t c, int64_t graph_bs) {
    ServingBudget b;
    b.max_tokens_per_rank = c;
    b.role = ServingRole::kDecode;
    b.cuda_graph_max_bs = graph_bs;
    return b;
}

// ---- budget: a tiny hand-checkable case first ---------------------------------------------------

TEST(ServingBudget, MixedRoleReportsBothSteps) {
    ServingBudget b;
    b.max_tokens_per_rank = 4096;
    b.chunked_prefill_size = 4096;
    b.cuda_graph_max_bs = 256;
    b.max_running_requests = 1024;
    b.dp_attention = true;
    b.attention_dp_size = 8;             // 1024 // 8 = 128 requests per DP rank
    b.speculative_num_draft_tokens = 4;  // 128 * 4 = 512 tokens
    const BudgetReport r = check_serving_budget(b);
    EXPECT_TRUE(r.prefill_checked);
    EXPECT_EQ(r.prefill_tokens, 4096);
    EXPECT_TRUE(r.decode_checked);
    EXPECT_EQ(r.decode_batch, 128);
    EXPECT_EQ(r.tokens_per_request, 4);
    EXPECT_EQ(r.decode_tokens, 512);
    EXPECT_NE(r.describe().find("512"), std::string::npos) << r.describe();
}

TEST(ServingBudget, PrefillBoundaryIsInclusive) {
    EXPECT_EQ(check_serving_budget(prefill_only(4096, 4096)).prefill_tokens, 4096);
    EXPECT_TRUE(
        throws_error([] { check_serving_budget(prefill_only(4096, 4097)); }, ErrorCode::kCapacityExceeded,
                     {"4097", "max_tokens_per_rank=4096", "--chunked-prefill-size", "at least 4097", "at most 4096"}));
}

TEST(ServingBudget, MaxPrefillTokensWhenChunkingIsOff) {
    ServingBudget b = prefill_only(8192, -1);
    b.max_prefill_tokens = 8192;
    EXPECT_EQ(check_serving_budget(b).prefill_tokens, 8192);
    b.max_prefill_tokens = 8193;
    EXPECT_TRUE(
        throws_error([&] { check_serving_budget(b); }, ErrorCode::kCapacityExceeded, {"8193", "--max-prefill-tokens"}));
    // chunking on: its size is the step, max_prefill_tokens is not consulted
    b.chunked_prefill_size = 8192;
    EXPECT_EQ(check_serving_budget(b).prefill_tokens, 8192);
}

TEST(ServingBudget, DynamicChunkProbeCounts) {
    ServingBudget b = prefill_only(4096, 2048);
    b.dynamic_chunk_probe_size = 4096;
    EXPECT_EQ(check_serving_budget(b).prefill_tokens, 4096);
    b.dynamic_chunk_probe_size = 4097;
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kCapacityExceeded, {"4097", "probe"}));
    b.dynamic_chunk_probe_size = 100;  // below the chunk: the chunk decides
    EXPECT_EQ(check_serving_budget(b).prefill_tokens, 2048);
}

TEST(ServingBudget, DecodeBoundaryIsInclusive) {
    EXPECT_EQ(check_serving_budget(decode_only(128, 128)).decode_tokens, 128);
    EXPECT_TRUE(throws_error([] { check_serving_budget(decode_only(127, 128)); }, ErrorCode::kCapacityExceeded,
                             {"128 tokens per rank", "max_tokens_per_rank=127", "--cuda-graph-max-bs to at most 127"}));
}

TEST(ServingBudget, RunningRequestsDividedByDpOnlyWithDpAttention) {
    ServingBudget b = decode_only(256, 512);
    b.max_running_requests = 2048;
    b.attention_dp_size = 8;
    b.dp_attention = true;
    EXPECT_EQ(check_serving_budget(b).decode_batch, 256);  // min(512, 2048 // 8)
    b.max_running_requests = 2056;                         // 257 per DP rank, but the graph batch caps at 512 -> 257
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kCapacityExceeded,
                             {"257", "--max-running-requests 2056 // --dp-size 8"}));
    b.dp_attention = false;  // no division: min(512, 2056) = 512
    b.max_running_requests = 2056;
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kCapacityExceeded, {"512"}));
    b.max_running_requests = 100;  // fewer running requests than the graph batch: 100 decides
    EXPECT_EQ(check_serving_budget(b).decode_batch, 100);
}

TEST(ServingBudget, AtLeastOneRequestPerDpRank) {
    ServingBudget b = decode_only(1, 64);
    b.max_running_requests = 3;
    b.dp_attention = true;
    b.attention_dp_size = 8;  // 3 // 8 = 0 -> max(1, 0) = 1
    const BudgetReport r = check_serving_budget(b);
    EXPECT_EQ(r.decode_batch, 1);
    EXPECT_EQ(r.decode_tokens, 1);
}

TEST(ServingBudget, SpeculativeDraftMultipliesDecodeTokens) {
    ServingBudget b = decode_only(128, 32);
    b.speculative_num_draft_tokens = 4;
    EXPECT_EQ(check_serving_budget(b).decode_tokens, 128);
    b.max_tokens_per_rank = 127;
    EXPECT_TRUE(
        throws_error([&] { check_serving_budget(b); }, ErrorCode::kCapacityExceeded,
                     {"x 4 token(s) per request", "= 128", "at least 128", "--cuda-graph-max-bs to at most 31"}));
    // a draft wider than the capacity: no batch size fits, the draft must shrink
    b.max_tokens_per_rank = 3;
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kCapacityExceeded,
                             {"--speculative-num-draft-tokens to at most 3"}));
}

TEST(ServingBudget, RolesAndGraphsDecideWhatIsChecked) {
    ServingBudget b;
    b.max_tokens_per_rank = 64;
    b.chunked_prefill_size = 1 << 20;  // far too big
    b.cuda_graph_max_bs = 1 << 20;     // far too big
    b.role = ServingRole::kDecode;
    b.decode_cuda_graphs = false;
    BudgetReport r = check_serving_budget(b);  // decode-only without graphs: nothing to check
    EXPECT_FALSE(r.prefill_checked);
    EXPECT_FALSE(r.decode_checked);
    b.role = ServingRole::kPrefill;
    b.decode_cuda_graphs = true;
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kCapacityExceeded, {"prefill:"}));
    b.chunked_prefill_size = 64;
    r = check_serving_budget(b);  // prefill-only: the graph batch is not checked
    EXPECT_TRUE(r.prefill_checked);
    EXPECT_FALSE(r.decode_checked);
}

TEST(ServingBudget, BothFailuresInOneMessage) {
    ServingBudget b;
    b.max_tokens_per_rank = 100;
    b.chunked_prefill_size = 101;
    b.cuda_graph_max_bs = 101;
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kCapacityExceeded,
                             {"prefill:", "; and decode:", "--chunked-prefill-size", "--cuda-graph-max-bs"}));
}

TEST(ServingBudget, MissingOrNegativeSettingsAreInvalid) {
    ServingBudget b;
    b.cuda_graph_max_bs = 8;
    b.chunked_prefill_size = 8;
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kInvalidArgument, {"max_tokens_per_rank=0"}));
    b.max_tokens_per_rank = 8;
    b.chunked_prefill_size = 0;  // chunking off and no max_prefill_tokens: unbounded
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kInvalidArgument,
                             {"--chunked-prefill-size or --max-prefill-tokens"}));
    b.chunked_prefill_size = 8;
    b.cuda_graph_max_bs = 0;
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kInvalidArgument, {"--cuda-graph-max-bs"}));
    b.cuda_graph_max_bs = 8;
    b.speculative_num_draft_tokens = -1;
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kInvalidArgument,
                             {"speculative_num_draft_tokens=-1"}));
    b.speculative_num_draft_tokens = 0;
    b.dp_attention = true;
    b.attention_dp_size = 0;
    EXPECT_TRUE(throws_error([&] { check_serving_budget(b); }, ErrorCode::kInvalidArgument, {"attention_dp_size=0"}));
}

// Generated: for several capacities, a step of C - 1 and C passes, C + 1 fails, for prefill,
// plain decode and speculative decode alike.
TEST(ServingBudget, BoundaryMatrix) {
    for (int64_t c : {1, 2, 7, 128, 4095, 65536}) {
        for (int64_t d : {-1, 0, 1}) {
            const int64_t step = c + d;
            if (step < 1) continue;
            const bool ok = step <= c;
            auto run_prefill = [&] { return check_serving_budget(prefill_only(c, step)); };
            auto run_decode = [&] { return check_serving_budget(decode_only(c, step)); };
            if (ok) {
                EXPECT_EQ(run_prefill().prefill_tokens, step) << "C=" << c;
                EXPECT_EQ(run_decode().decode_tokens, step) << "C=" << c;
            } else {
                EXPECT_TRUE(throws_error(run_prefill, ErrorCode::kCapacityExceeded, {std::to_string(step)})) << c;
                EXPECT_TRUE(throws_error(run_decode, ErrorCode::kCapacityExceeded, {std::to_string(step)})) << c;
            }
        }
        if (c % 4 == 0) {  // speculative: batch c/4 x 4 tokens == c passes, one more request fails
            ServingBudget b = decode_only(c, c / 4);
            b.speculative_num_draft_tokens = 4;
            EXPECT_EQ(check_serving_budget(b).decode_tokens, c);
            b.cuda_graph_max_bs = c / 4 + 1;
            EXPECT_TRUE(
                throws_error([&] { check_serving_budget(b); }, ErrorCode::kCapacityExceeded, {std::to_string(c + 4)}));
        }
    }
}

TEST(ServingBudget, RoleNames) {
    EXPECT_EQ(parse_serving_role("decode"), ServingRole::kDecode);
    EXPECT_STREQ(serving_role_name(parse_serving_role("prefill")), "prefill");
    EXPECT_TRUE(
        throws_error([] { parse_serving_role("both"); }, ErrorCode::kInvalidArgument, {"mixed, prefill or decode"}));
}

// ---- expert-quant contract ----------------------------------------------------------------------

// DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3): "quantization_config":
// {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
QuantizationConfig deepseek_v3() {
    QuantizationConfig q;
    q.present = true;
    q.activation_scheme = "dynamic";
    q.fmt = "e4m3";
    q.quant_method = "fp8";
    q.weight_block_size = std::vector<int64_t>{128, 128};
    return q;
}

// Qwen/Qwen3-30B-A3B-FP8's config.json: "quantization_config": {"activation_scheme": "dynamic",
// "modules_to_not_convert": ["lm_head", "model.layers.0.input_layernorm", "model.layers.0.mlp.gate", ...],
// "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]} (the C++ struct has no
// field for modules_to_not_convert: it names the non-expert modules left in bf16).
QuantizationConfig qwen3_moe_fp8() {
    QuantizationConfig q;
    q.present = true;
    q.activation_scheme = "dynamic";
    q.fmt = "e4m3";
    q.quant_method = "fp8";
    q.weight_block_size = std::vector<int64_t>{128, 128};
    return q;
}

TEST(ExpertQuant, AcceptsRealCheckpoints) {
    for (const QuantizationConfig& q : {deepseek_v3(), qwen3_moe_fp8()}) {
        const ExpertQuant e = check_expert_quant(q);
        EXPECT_EQ(e.kind, ExpertQuantKind::kFP8Block128);
        EXPECT_EQ(e.payload(), Payload::kFP8);
        EXPECT_EQ(e.weight_block_n, 128);
        EXPECT_EQ(e.weight_block_k, 128);
        EXPECT_EQ(e.activation_group, 128);
        EXPECT_TRUE(e.accepts(ScaleFormat::kF32G128));
        EXPECT_TRUE(e.accepts(ScaleFormat::kUE8M0G128));
        EXPECT_FALSE(e.accepts(ScaleFormat::kUE8M0G32));
    }
}

TEST(ExpertQuant, AcceptsBf16AndMxfp8) {
    const ExpertQuant bf16 = check_expert_quant(QuantizationConfig{});
    EXPECT_EQ(bf16.kind, ExpertQuantKind::kBF16);
    EXPECT_EQ(bf16.payload(), Payload::kBF16);
    QuantizationConfig mx;
    mx.present = true;
    mx.quant_method = "mxfp8";
    EXPECT_EQ(check_expert_quant(mx).kind, ExpertQuantKind::kMXFP8);
    mx.weight_block_size = std::vector<int64_t>{1, 32};
    mx.activation_scheme = "dynamic";
    mx.fmt = "e4m3";
    const ExpertQuant e = check_expert_quant(mx);
    EXPECT_EQ(e.kind, ExpertQuantKind::kMXFP8);
    EXPECT_EQ(e.activation_group, 32);
    EXPECT_TRUE(e.accepts(ScaleFormat::kUE8M0G32));
    EXPECT_FALSE(e.accepts(ScaleFormat::kF32G128));
    QuantizationConfig upper = deepseek_v3();  // names are case-insensitive
    upper.quant_method = "FP8";
    upper.activation_scheme = "Dynamic";
    EXPECT_EQ(check_expert_quant(upper).kind, ExpertQuantKind::kFP8Block128);
}

struct Reject {
    const char* label;
    QuantizationConfig config;
    std::vector<std::string> needles;
};

QuantizationConfig with(std::string method) {
    QuantizationConfig q;
    q.present = true;
    q.quant_method = std::move(method);
    return q;
}

TEST(ExpertQuant, RejectMatrix) {
    std::vector<Reject> cases;
    {
        QuantizationConfig q = deepseek_v3();
        q.activation_scheme = "static";
        cases.push_back({"static activation scales", q, {"static activation scales", "activation_scheme: 'static'"}});
    }
    {
        QuantizationConfig q = deepseek_v3();
        q.activation_scheme.clear();
        cases.push_back({"no activation scheme", q, {"activation_scheme is missing"}});
    }
    {
        QuantizationConfig q = deepseek_v3();
        q.weight_block_size.reset();  // per-tensor FP8 (e.g. a Llama FP8 checkpoint)
        cases.push_back({"per-tensor weights", q, {"no weight_block_size"}});
    }
    for (std::vector<int64_t> b : {std::vector<int64_t>{64, 64}, {128, 64}, {1, 128}, {256, 256}, {128}}) {
        QuantizationConfig q = deepseek_v3();
        q.weight_block_size = b;
        cases.push_back({"block size", q, {"is not [128, 128]"}});
    }
    {
        QuantizationConfig q = deepseek_v3();
        q.weight_block_size = std::vector<int64_t>{1, 32};
        cases.push_back({"1x32 under fp8", q, {"quant_method 'mxfp8'"}});
    }
    {
        QuantizationConfig q = deepseek_v3();
        q.fmt = "e5m2";
        cases.push_back({"e5m2", q, {"fmt 'e5m2' is not E4M3"}});
    }
    {
        QuantizationConfig q = with("mxfp8");
        q.weight_block_size = std::vector<int64_t>{1, 16};
        cases.push_back({"mxfp8 block", q, {"MXFP8 blocks are [1, 32]"}});
    }
    {
        QuantizationConfig q = with("mxfp8");
        q.activation_scheme = "static";
        cases.push_back({"mxfp8 static", q, {"static activation scales"}});
    }
    {
        QuantizationConfig q = with("modelopt");
        q.quant_algo = "NVFP4";
        cases.push_back({"modelopt nvfp4", q, {"ModelOpt 'NVFP4'"}});
    }
    {
        QuantizationConfig q = with("modelopt");
        q.quant_algo = "FP8";
        cases.push_back({"modelopt fp8", q, {"per-tensor FP8"}});
    }
    for (const char* m : {"mxfp4", "nvfp4", "fp4", "w4afp8"}) cases.push_back({m, with(m), {"FP4 experts"}});
    for (const char* m : {"awq", "gptq", "awq_marlin", "gptq_marlin", "bitsandbytes", "moe_wna16", "gguf"}) {
        QuantizationConfig q = with(m);
        q.bits = 4;
        cases.push_back({m, q, {"weight-only integer quantization", "4-bit"}});
    }
    for (const char* m : {"w8a8_int8", "int8", "smoothquant"}) cases.push_back({m, with(m), {"INT8/INT4"}});
    for (const char* m : {"fbgemm_fp8", "w8a8_fp8"}) cases.push_back({m, with(m), {"per-channel FP8"}});
    for (const char* f : {"float-quantized", "nvfp4-pack-quantized", "pack-quantized", "int-quantized"}) {
        QuantizationConfig q = with("compressed-tensors");
        q.format = f;
        cases.push_back({f, q, {"compressed-tensors", f}});
    }
    cases.push_back({"unknown", with("my_new_quant"), {"unknown quant_method 'my_new_quant'"}});
    cases.push_back({"no method", with(""), {"has no quant_method"}});
    for (const Reject& r : cases) {
        EXPECT_TRUE(throws_error([&] { check_expert_quant(r.config); }, ErrorCode::kUnsupported, r.needles)) << r.label;
        // every reject says what would be accepted
        EXPECT_TRUE(throws_error([&] { check_expert_quant(r.config); }, ErrorCode::kUnsupported,
                                 {"weight_block_size [128, 128]", "'dynamic'", "mxfp8", "bf16 experts"}))
            << r.label;
    }
}

TEST(ExpertQuant, BufferMustMatchTheExperts) {
    BufferConfig c{.num_experts = 8, .num_topk = 2, .hidden = 256, .max_tokens_per_rank = 4};
    const ExpertQuant fp8 = check_expert_quant(deepseek_v3());
    const ExpertQuant bf16 = check_expert_quant(QuantizationConfig{});
    bf16.check_buffer(c);
    EXPECT_TRUE(throws_error([&] { fp8.check_buffer(c); }, ErrorCode::kInvalidArgument, {"payload=fp8"}));
    c.payload = Payload::kFP8;
    fp8.check_buffer(c);
    EXPECT_TRUE(throws_error([&] { bf16.check_buffer(c); }, ErrorCode::kInvalidArgument, {"payload=bf16"}));
    c.scale_format = ScaleFormat::kUE8M0G128;
    fp8.check_buffer(c);
    c.scale_format = ScaleFormat::kUE8M0G32;
    EXPECT_TRUE(throws_error([&] { fp8.check_buffer(c); }, ErrorCode::kInvalidArgument, {"ue8m0_g32", "128-channel"}));
    QuantizationConfig mx = with("mxfp8");
    check_expert_quant(mx).check_buffer(c);
    c.scale_format = ScaleFormat::kF32G128;
    EXPECT_TRUE(throws_error([&] { check_expert_quant(mx).check_buffer(c); }, ErrorCode::kInvalidArgument,
                             {"scale_format=ue8m0_g32"}));
}

TEST(ExpertQuant, ScaleFormatFromTheGpu) {
    EXPECT_EQ(scale_format_for_compute_capability(8), ScaleFormat::kF32G128);
    EXPECT_EQ(scale_format_for_compute_capability(9), ScaleFormat::kF32G128);     // Hopper
    EXPECT_EQ(scale_format_for_compute_capability(10), ScaleFormat::kUE8M0G128);  // Blackwell
    EXPECT_EQ(scale_format_for_compute_capability(12), ScaleFormat::kUE8M0G128);
    const SystemInfo info = system_info();
    const ScaleFormat here = scale_format_for_device(-1);
    if (info.gpus.empty()) EXPECT_EQ(here, ScaleFormat::kF32G128);

    BufferConfig base{.num_experts = 8, .num_topk = 2, .hidden = 256, .max_tokens_per_rank = 4};
    BufferConfig c = serving_buffer_config(base, check_expert_quant(deepseek_v3()));
    EXPECT_EQ(c.payload, Payload::kFP8);
    EXPECT_EQ(c.scale_format, here);
    c = serving_buffer_config(base, check_expert_quant(deepseek_v3()), ScaleFormat::kUE8M0G128);  // told
    EXPECT_EQ(c.scale_format, ScaleFormat::kUE8M0G128);
    c = serving_buffer_config(base, check_expert_quant(with("mxfp8")));
    EXPECT_EQ(c.scale_format, ScaleFormat::kUE8M0G32);
    c = serving_buffer_config(base, check_expert_quant(QuantizationConfig{}));
    EXPECT_EQ(c.payload, Payload::kBF16);
    EXPECT_TRUE(
        throws_error([&] { serving_buffer_config(base, check_expert_quant(deepseek_v3()), ScaleFormat::kUE8M0G32); },
                     ErrorCode::kInvalidArgument, {"ue8m0_g32 does not fit"}));
}

}  // namespace
