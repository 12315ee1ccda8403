// Start-up token budget (serving.hpp, part 1): the largest step an engine hands one dispatch,
// against the buffer capacity C, decided once before any weight is loaded.
#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "elasticep/serving.hpp"

namespace elasticep {

const char* serving_role_name(ServingRole r) {
    switch (r) {
        case ServingRole::kMixed:
            return "mixed";
        case ServingRole::kPrefill:
            return "prefill";
        case ServingRole::kDecode:
            return "decode";
    }
    return "?";
}

ServingRole parse_serving_role(const std::string& s) {
    if (s == "mixed") return ServingRole::kMixed;
    if (s == "prefill") return ServingRole::kPrefill;
    if (s == "decode") return ServingRole::kDecode;
    ELASTICEP_CHECK_ARG(false, "unknown serving role '", s, "'; choose mixed, prefill or decode");
    return ServingRole::kMixed;
}

std::string BudgetReport::describe() const {
    std::ostringstream os;
    os << "capacity max_tokens_per_rank=" << capacity << ";";
    if (prefill_checked)
        os << " prefill step " << prefill_tokens << " tokens (" << prefill_source << ")"
           << (prefill_tokens <= capacity ? " fits" : " EXCEEDS");
    else
        os << " prefill not checked (decode-only role)";
    os << ";";
    if (decode_checked)
        os << " decode graph batch " << decode_batch << " (" << decode_source << ") x " << tokens_per_request
           << " token(s) per request = " << decode_tokens << (decode_tokens <= capacity ? " fits" : " EXCEEDS");
    else
        os << " decode not checked (prefill-only role or CUDA graphs off)";
    return os.str();
}

BudgetReport check_serving_budget(const ServingBudget& b) {
    using detail::cat;
    const int64_t c = b.max_tokens_per_rank;
    ELASTICEP_CHECK_ARG(c >= 1, "serving budget: max_tokens_per_rank=", c,
                        " must be at least 1 (it is the buffer capacity C the engine's steps are checked against)");
    ELASTICEP_CHECK_ARG(b.max_prefill_tokens >= 0, "serving budget: max_prefill_tokens=", b.max_prefill_tokens,
                        " is negative; pass 0 when it is not set");
    ELASTICEP_CHECK_ARG(b.dynamic_chunk_probe_size >= 0,
                        "serving budget: dynamic_chunk_probe_size=", b.dynamic_chunk_probe_size,
                        " is negative; pass 0 when dynamic chunking is off");
    ELASTICEP_CHECK_ARG(b.cuda_graph_max_bs >= 0, "serving budget: cuda_graph_max_bs=", b.cuda_graph_max_bs,
                        " is negative");
    ELASTICEP_CHECK_ARG(b.max_running_requests >= 0, "serving budget: max_running_requests=", b.max_running_requests,
                        " is negative; pass 0 when it is not set");
    ELASTICEP_CHECK_ARG(b.speculative_num_draft_tokens >= 0,
                        "serving budget: speculative_num_draft_tokens=", b.speculative_num_draft_tokens,
                        " is negative; pass 0 without speculative decoding");
    ELASTICEP_CHECK_ARG(!b.dp_attention || b.attention_dp_size >= 1,
                        "serving budget: attention_dp_size=", b.attention_dp_size,
                        " must be at least 1 with dp_attention");

    BudgetReport r;
    r.capacity = c;
    std::vector<std::string> failures;

    if (b.role != ServingRole::kDecode) {
        r.prefill_checked = true;
        if (b.chunked_prefill_size > 0) {
            r.prefill_tokens = b.chunked_prefill_size;
            r.prefill_source = cat("--chunked-prefill-size ", b.chunked_prefill_size);
        } else {
            ELASTICEP_CHECK_ARG(b.max_prefill_tokens > 0,
                                "serving budget: chunked prefill is off (chunked_prefill_size=", b.chunked_prefill_size,
                                ") and max_prefill_tokens is not set, so the largest prefill step is unbounded; set "
                                "--chunked-prefill-size or --max-prefill-tokens (role ",
                                serving_role_name(b.role), " runs prefill)");
            r.prefill_tokens = b.max_prefill_tokens;
            r.prefill_source = cat("--max-prefill-tokens ", b.max_prefill_tokens, " (chunked prefill off)");
        }
        if (b.dynamic_chunk_probe_size > r.prefill_tokens) {
            r.prefill_source =
                cat("dynamic-chunking probe size ", b.dynamic_chunk_probe_size, ", above ", r.prefill_source);
            r.prefill_tokens = b.dynamic_chunk_probe_size;
        }
        if (r.prefill_tokens > c)
            failures.push_back(cat("prefill: the largest prefill step is ", r.prefill_tokens, " tokens per rank (",
                                   r.prefill_source, ") but the buffer holds max_tokens_per_rank=", c,
                                   " tokens; raise max_tokens_per_rank to at least ", r.prefill_tokens,
                                   " (SGLang deepep_v2: SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK), or lower "
                                   "--chunked-prefill-size (or --max-prefill-tokens with chunking off",
                                   b.dynamic_chunk_probe_size > 0 ? ", and the dynamic-chunking probe size" : "",
                                   ") to at most ", c));
    }

    if (b.role != ServingRole::kPrefill && b.decode_cuda_graphs) {
        r.decode_checked = true;
        ELASTICEP_CHECK_ARG(
            b.cuda_graph_max_bs >= 1,
            "serving budget: decode CUDA graphs are on but cuda_graph_max_bs=", b.cuda_graph_max_bs,
            "; pass the engine's --cuda-graph-max-bs (or decode_cuda_graphs=false when graphs are off)");
        int64_t batch = b.cuda_graph_max_bs;
        r.decode_source = cat("--cuda-graph-max-bs ", b.cuda_graph_max_bs);
        if (b.max_running_requests > 0) {
            const int64_t dp = b.dp_attention ? b.attention_dp_size : 1;
            const int64_t per_rank = std::max<int64_t>(1, b.max_running_requests / dp);
            const std::string running = b.dp_attention ? cat("max(1, --max-running-requests ", b.max_running_requests,
                                                             " // --dp-size ", dp, ") = ", per_rank)
                                                       : cat("--max-running-requests ", b.max_running_requests);
            r.decode_source = cat("min(", r.decode_source, ", ", running, ")");
            batch = std::min(batch, per_rank);
        }
        r.decode_batch = batch;
        r.tokens_per_request = std::max<int64_t>(1, b.speculative_num_draft_tokens);
        r.decode_tokens = batch * r.tokens_per_request;
        if (r.decode_tokens > c) {
            const int64_t max_bs = c / r.tokens_per_request;
            std::string fix = max_bs >= 1
                                  ? cat("lower --cuda-graph-max-bs to at most ", max_bs,
                                        " (or --max-running-requests so that the batch is at most ", max_bs, ")")
                                  : cat("lower --speculative-num-draft-tokens to at most ", c);
            failures.push_back(cat(
                "decode: a CUDA-graph decode batch of ", batch, " requests (", r.decode_source, ") x ",
                r.tokens_per_request, " token(s) per request",
                r.tokens_per_request > 1 ? cat(" (speculative draft of ", r.tokens_per_request, ")") : std::string(),
                " = ", r.decode_tokens, " tokens per rank, but the buffer holds max_tokens_per_rank=", c,
                " tokens; raise max_tokens_per_rank to at least ", r.decode_tokens, ", or ", fix));
        }
    }

    if (!failures.empty()) {
        std::string msg = "serving budget check failed: ";
        for (size_t i = 0; i < failures.size(); ++i) msg += (i ? "; and " : "") + failures[i];
        throw Error(ErrorCode::kCapacityExceeded, msg);
    }
    return r;
}

}  // namespace elasticep
