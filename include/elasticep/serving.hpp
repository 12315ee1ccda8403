// The serving layer around a Buffer: start-up checks an inference engine runs once (token budget,
// expert-quant contract), the phase-aware dispatcher it calls per MoE layer, grouped-GEMM adapters
// between the two dispatch layouts, and a reference MoE layer. docs/SERVING.md is the user guide.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "elasticep/buffer.hpp"
#include "elasticep/config.hpp"
#include "elasticep/tensor.hpp"

namespace elasticep {

// =============================================================================================
// 1. Start-up token budget

enum class ServingRole : uint8_t {
    kMixed,    // one server runs prefill and decode (the default)
    kPrefill,  // prefill-only server of a disaggregated deployment: decode is not checked
    kDecode,   // decode-only server: prefill is not checked
};

// The engine settings that decide how many tokens one rank hands one dispatch, next to the
// buffer's capacity C. Field names follow SGLang's server arguments. 0 means "not set".
struct ServingBudget {
    int64_t max_tokens_per_rank = 0;  // C of the buffer (a memory reservation, not a token limit)
    ServingRole role = ServingRole::kMixed;
    // Prefill: the largest step one rank dispatches. Pass the per-rank values the scheduler uses
    // (SGLang divides --chunked-prefill-size by the DP size under DP attention before it uses it).
    int64_t chunked_prefill_size = 0;      // --chunked-prefill-size; <= 0: chunking off
    int64_t max_prefill_tokens = 0;        // --max-prefill-tokens; the step when chunking is off
    int64_t dynamic_chunk_probe_size = 0;  // largest chunk a dynamic-chunking probe may run; 0: none
    // Decode: the largest CUDA-graph batch.
    bool decode_cuda_graphs = true;            // false: decode runs eagerly (--disable-cuda-graph); not checked
    int64_t cuda_graph_max_bs = 0;             // --cuda-graph-max-bs
    int64_t max_running_requests = 0;          // --max-running-requests; 0: not set
    bool dp_attention = false;                 // --enable-dp-attention: requests are split over DP ranks
    int64_t attention_dp_size = 1;             // --dp-size (used only with dp_attention)
    int64_t speculative_num_draft_tokens = 0;  // widest speculative draft per request; 0: no speculation
};

// What check_serving_budget found (also when it passed).
struct BudgetReport {
    int64_t capacity = 0;  // C
    bool prefill_checked = false;
    int64_t prefill_tokens = 0;  // largest prefill step per rank
    std::string prefill_source;  // the setting it comes from, e.g. "--chunked-prefill-size 8192"
    bool decode_checked = false;
    int64_t decode_batch = 0;        // min(cuda_graph_max_bs, max(1, max_running_requests // DP))
    int64_t tokens_per_request = 1;  // max(1, speculative_num_draft_tokens)
    int64_t decode_tokens = 0;       // decode_batch * tokens_per_request
    std::string decode_source;       // how decode_batch was formed
    std::string describe() const;    // one paragraph, the numbers and the verdict
};

// One call at start-up. Passes when every checked step is <= C (== C passes, C + 1 fails).
// Throws Error(kCapacityExceeded) naming the numbers, the capacity and the settings to change
// (max_tokens_per_rank, --chunked-prefill-size / --max-prefill-tokens, --cuda-graph-max-bs);
// Error(kInvalidArgument) for settings that are missing or negative. Every dispatch still checks
// its real row count against C (Buffer::dispatch raises kCapacityExceeded before communicating).
BudgetReport check_serving_budget(const ServingBudget& budget);

const char* serving_role_name(ServingRole r);
ServingRole parse_serving_role(const std::string& s);  // "mixed", "prefill", "decode"

// =============================================================================================
// 2. Expert-quant contract

// The fields of a Hugging Face `quantization_config` that decide the experts' number format.
// `present = false` is a model without quantization_config (bf16 experts). Absent keys stay empty.
struct QuantizationConfig {
    bool present = false;
    std::string quant_method;                               // "fp8", "mxfp8", "compressed-tensors", "awq", ...
    std::string fmt;                                        // "e4m3" for DeepSeek/Qwen FP8 checkpoints
    std::string activation_scheme;                          // "dynamic" or "static"
    std::optional<std::vector<int64_t>> weight_block_size;  // [128, 128]
    std::string format;                                     // compressed-tensors' "format" ("float-quantized", ...)
    std::string quant_algo;                                 // ModelOpt's "quant_algo" ("FP8", "NVFP4", ...)
    int64_t bits = 0;                                       // AWQ/GPTQ-style "bits"; 0: absent
};

enum class ExpertQuantKind : uint8_t {
    kBF16,         // unquantized experts; bf16 dispatch
    kFP8Block128,  // FP8 E4M3 weights with 128x128 block scales, activations 1x128 dynamic
    kMXFP8,        // MXFP8: E4M3 with UE8M0 scales per 1x32 block, activations dynamic
};

struct ExpertQuant {
    ExpertQuantKind kind = ExpertQuantKind::kBF16;
    int weight_block_n = 0, weight_block_k = 0;  // 128x128, 1x32; 0 for bf16
    int activation_group = 0;                    // channels per activation scale: 128, 32; 0 for bf16
    std::string source;                          // what was found, for messages

    Payload payload() const { return kind == ExpertQuantKind::kBF16 ? Payload::kBF16 : Payload::kFP8; }
    bool accepts(ScaleFormat f) const;  // FP8 block: f32_g128 or ue8m0_g128; MXFP8: ue8m0_g32
    // Throws InvalidArgument when the buffer's payload or scale format is not what these experts
    // consume (a wrong granularity would compute silently wrong results).
    void check_buffer(const BufferConfig& config) const;
    std::string describe() const;
};

// Accepts bf16 experts (no config), FP8 E4M3 with weight_block_size [128, 128] and
// activation_scheme "dynamic" (DeepSeek-V3, Qwen3 FP8), and MXFP8 (quant_method "mxfp8", [1, 32]
// blocks, dynamic). Throws Error(kUnsupported) for everything else, naming what was found and
// what to use instead.
ExpertQuant check_expert_quant(const QuantizationConfig& config);

// =============================================================================================
// Scale format from the GPU

// What DeepGEMM's FP8 kernels read: fp32 1x128 scales on Hopper and older (major < 10), packed
// UE8M0 1x128 scales on Blackwell (major >= 10).
ScaleFormat scale_format_for_compute_capability(int major);
// The same for a CUDA device (-1: the current one). Without a usable GPU: f32_g128 (Hopper's).
ScaleFormat scale_format_for_device(int device = -1);

// `base` with the payload the experts consume and the scale format for them: `scale_format` when
// given (checked against the experts), else from the GPU of base.device (ue8m0_g32 for MXFP8).
BufferConfig serving_buffer_config(BufferConfig base, const ExpertQuant& quant,
                                   std::optional<ScaleFormat> scale_format = std::nullopt);

// =============================================================================================
// 3. Phase-aware dispatcher

enum class Phase : uint8_t {
    kDecode,   // expert-masked slab, no host sync: CUDA-graph capturable, feeds a masked GEMM
    kPrefill,  // expert-contiguous, aligned segments, host sync: feeds a contiguous GEMM
    kExtend,   // SGLang's extend (prefill with a prefix cache): same as kPrefill
};
const char* phase_name(Phase p);
Phase parse_phase(const std::string& s);  // "decode", "prefill", "extend"

// Where the route weights are applied.
enum class WeightPlacement : uint8_t {
    kCombine,  // combine multiplies (fmaf per route, SEMANTICS.md); the experts leave y unweighted
    kAdapter,  // the expert side multiplies y by recv_weights on real rows (apply_route_weights or
               // a fused repack) and combine runs unweighted
};
const char* weight_placement_name(WeightPlacement w);
WeightPlacement parse_weight_placement(const std::string& s);  // "combine", "adapter"

struct DispatcherOptions {
    int expert_alignment = 128;  // prefill segment alignment: the GEMM's M block (DeepGEMM: 128)
    WeightPlacement weight_placement = WeightPlacement::kCombine;
    bool scales_mn_major = true;  // fp8: TMA-aligned MN-major scales (what grouped GEMMs load)
    bool zero_padding = false;    // zero padding rows' data and scales
};

// What the expert GEMMs consume. Tensors are views of the buffer's memory, valid until the next
// dispatch on the buffer.
struct MoeDispatchOutput {
    Phase phase = Phase::kDecode;
    Layout layout = Layout::kExpertMasked;
    WeightPlacement weight_placement = WeightPlacement::kCombine;
    TensorRef hidden_states;                       // masked [E_local, R*C, H]; contiguous [M, H]
    std::optional<TensorRef> hidden_states_scale;  // fp8 payloads
    ScaleFormat scale_format = ScaleFormat::kF32G128;
    bool scales_mn_major = false;
    TensorRef recv_weights;  // fp32 route weight per row (0 on padding rows)
    TensorRef recv_src;      // int32 s*C + t per row (-1 on padding rows)
    TensorRef counts;        // int32 [E_local] real rows per local expert
    // decode (masked)
    TensorRef masked_m;      // int32 [E_local] (device)
    int64_t expected_m = 0;  // masked-GEMM schedule hint: max(1, (T*R*K + E) / E), as DeepEP does
    int64_t max_m = 0;       // R*C, rows per expert in the slab
    // prefill (contiguous)
    TensorRef m_indices;    // int32 [M]: local expert per row, -1 on padding rows
    TensorRef offsets;      // int32 [E_local + 1] segment starts
    int64_t num_rows = -1;  // M
    int expert_alignment = 1;
    int64_t num_tokens = 0;  // T of this rank's dispatch (rows of the combine output)
};

// One per MoE layer (or per buffer) and rank. Owns the single outstanding handle: dispatch with an
// unconsumed handle and combine without one are errors (InvalidArgument, before any
// communication); a failed combine releases the handle. A rank with T = 0 tokens passes [0, H] x
// and [0, K] ids and takes part as usual. Topology (direct now, hybrid later) is the buffer's
// business: the interface is the same.
//
// combine's output is complete per token: every route's expert output, weighted, summed over the
// ranks that hold the experts, plus the optional bias. An engine must not all-reduce it again
// across the EP group (that double-counts, the pitfall some Qwen2/GLM MoE paths hit in SGLang).
class MoeDispatcher {
 public:
    explicit MoeDispatcher(std::shared_ptr<Buffer> buffer, DispatcherOptions options = {});

    // Collective. x: [T, H] bf16 (or fp8 with x_scales when pre-quantized); topk_idx [T, K];
    // topk_weights [T, K] fp32 (required with WeightPlacement::kAdapter). `stream`: cudaStream_t.
    MoeDispatchOutput dispatch(Phase phase, const TensorRef& x, const TensorRef& topk_idx,
                               const std::optional<TensorRef>& topk_weights, void* stream = nullptr,
                               const std::optional<TensorRef>& x_scales = std::nullopt);
    // Collective. y: bf16 expert outputs in the rows of the last dispatch's hidden_states.
    // Returns [T, H] bf16 (buffer-owned unless `out` is given). Weighted per the placement.
    TensorRef combine(const TensorRef& y, void* stream = nullptr, const std::optional<TensorRef>& bias = std::nullopt,
                      const std::optional<TensorRef>& out = std::nullopt);

    bool pending() const;  // a dispatch waits for its combine
    const std::shared_ptr<Buffer>& buffer() const { return buffer_; }
    const DispatcherOptions& options() const { return options_; }
    static int64_t expected_m(int64_t num_tokens, int num_ranks, int num_topk, int num_experts);

 private:
    std::shared_ptr<Buffer> buffer_;
    DispatcherOptions options_;
    Handle handle_;
    bool has_weights_ = false;
    Phase last_phase_ = Phase::kDecode;
};

// =============================================================================================
// 4. Grouped-GEMM adapters
//
// CPU and CUDA implementations, chosen by the tensors' device (CUDA tensors run on `stream`),
// bit-exact between them. CUDA launches have fixed grids that depend on shapes only (never on
// counts), so they can be captured in a CUDA graph. Inconsistent counts or offsets never make an
// adapter write outside the tensors it is given: it skips or clamps, and ORs a fault bit into
// `status` (int32 [1] on the data's device); check_adapter_status reads, clears and raises it.
// Rows an adapter does not own are left untouched (documented per function).

enum AdapterFault : int32_t {
    kAdapterCountOverflow = 1,  // a count exceeds the slab's rows per expert (clamped)
    kAdapterRowsOverflow = 2,   // the layout needs more contiguous rows than given (rows dropped)
    kAdapterBadLayout = 4,      // negative count, decreasing offsets or a segment shorter than its count (skipped)
};

// Raises Error(kCapacityExceeded) naming the faults recorded in `status` since the last check and
// clears it. On CUDA it synchronises `stream` (not graph-capturable: call it after the replay).
void check_adapter_status(const TensorRef& status, void* stream = nullptr);

// m_indices[i] = l for offsets[l] <= i < offsets[l] + counts[l], else -1, for every i < rows.
// counts int32 [E_local], offsets int32 [E_local + 1], m_indices int32 [rows].
void m_indices_from_offsets(const TensorRef& counts, const TensorRef& offsets, const TensorRef& m_indices,
                            const TensorRef& status, void* stream = nullptr);

// Masked slab -> expert-contiguous rows (e.g. a decode dispatch fed to a contiguous GEMM, or a
// masked GEMM's output handed back to a contiguous dispatch's combine).
struct MaskedToContiguousArgs {
    TensorRef x;                          // [E_local, S, W] (bf16, fp8 or any 1/2/4-byte rows)
    TensorRef masked_m;                   // int32 [E_local]
    std::optional<TensorRef> scales;      // [E_local, S, G] fp32/int32, any strides
    int expert_alignment = 1;             // segment alignment A of the output
    TensorRef out_x;                      // [Mc, W], rows contiguous
    std::optional<TensorRef> out_scales;  // [Mc, G], any strides (MN-major allowed)
    TensorRef out_offsets;                // int32 [E_local + 1]: computed, start_{l+1} = start_l + round_up(count_l, A)
    std::optional<TensorRef> out_m_indices;  // int32 [Mc]
    std::optional<TensorRef> weights;        // fp32 [Mc], the destination rows' route weights: fused
                                             // out = bf16(float(x) * w) on real rows (bf16 x only)
    TensorRef status;
    void* stream = nullptr;
};
// Writes real rows and the zeroed padding rows inside segments (data and scales); rows >= M get
// m_indices -1 and are not written otherwise.
void masked_to_contiguous(const MaskedToContiguousArgs& args);

// Expert-contiguous rows -> masked slab.
struct ContiguousToMaskedArgs {
    TensorRef x;                            // [Mc, W]
    TensorRef counts;                       // int32 [E_local]
    TensorRef offsets;                      // int32 [E_local + 1]
    std::optional<TensorRef> scales;        // [Mc, G], any strides
    TensorRef out_x;                        // [E_local, S, W]
    std::optional<TensorRef> out_scales;    // [E_local, S, G], any strides
    std::optional<TensorRef> out_masked_m;  // int32 [E_local]: counts clamped to S
    std::optional<TensorRef> weights;       // fp32 [E_local, S] (a masked dispatch's recv_weights): fused
    TensorRef status;
    void* stream = nullptr;
};
// Writes rows [l, 0, count_l); slab rows at or past the count are not written.
void contiguous_to_masked(const ContiguousToMaskedArgs& args);

// out = bf16_rne(float(y) * w) on real rows only (fp32 multiply; NaN -> 0x7fc0); `out` may alias y.
// Masked: y/out [E_local, S, H], weights [E_local, S], counts = masked_m [E_local].
// Contiguous: y/out [M, H], weights [M], m_indices [M] (rows with m_indices < 0 are skipped).
void apply_route_weights(const TensorRef& y, const TensorRef& weights, const TensorRef& rows_or_counts,
                         const TensorRef& out, const TensorRef& status, void* stream = nullptr);

// Scale layouts. A scale tensor is [rows, G] or [B, rows, G] (fp32, or int32 packed UE8M0 words)
// with any strides; MN-major TMA-aligned means strides (..., 1, round_up(rows, 4)). The copy goes
// element by element through the strides, so it converts row-major <-> MN-major either way. When
// `dst` is MN-major its padding lanes (rows .. round_up(rows, 4) - 1 of every column) are zeroed:
// its storage must span G * round_up(rows, 4) elements per batch, as dispatch's and DeepGEMM's
// MN-major tensors do.
void convert_scale_layout(const TensorRef& src, const TensorRef& dst, void* stream = nullptr);

// fp32 scales [.., rows, G] -> packed UE8M0 [.., rows, ceil(G/4)] int32 (any strides, MN-major
// padding lanes zeroed as above). byte = biased exponent of |s| rounded up (2^ceil(log2 |s|); 0 for
// s = 0; 255 for Inf/NaN); group g in byte g % 4 of word g / 4; bytes past G are zero. Exact when
// the fp32 scales are powers of two (DeepGEMM's UE8M0-rounded scales); otherwise data quantized with
// the old scales must be requantized with the new ones.
void fp32_scales_to_ue8m0(const TensorRef& src, const TensorRef& dst, void* stream = nullptr);

// =============================================================================================
// 5. Reference MoE layer

// One rank's local experts. Tensors live on the layer's device (host for CPU).
struct ExpertWeights {
    ExpertQuantKind kind = ExpertQuantKind::kBF16;  // kBF16 or kFP8Block128
    int hidden = 0;                                 // H
    int intermediate = 0;                           // I (a multiple of 128 on the FP8 path)
    TensorRef gate_up;                              // [E_local, 2I, H] bf16 or fp8: rows [0, I) gate, [I, 2I) up
    std::optional<TensorRef> gate_up_scales;        // fp8: fp32 [E_local, 2I/128, H/128]
    TensorRef down;                                 // [E_local, H, I]
    std::optional<TensorRef> down_scales;           // fp8: fp32 [E_local, H/128, I/128]
};

enum class GemmPath : uint8_t {
    kCpuLoops,            // plain loops, fp32 accumulation
    kCublasLtBf16,        // bf16 weights through cuBLASLt
    kCublasLtFp8Blocked,  // FP8 through cuBLASLt's VEC128_32F (activations) / BLK128x128_32F (weights)
    kCublasLtDequant,     // FP8 dequantized to bf16, then bf16 cuBLASLt (when the blocked path is absent)
};
const char* gemm_path_name(GemmPath p);

struct MoeLayerOptions {
    // Masked inputs: run every expert over all max_m slab rows instead of reading masked_m on the
    // host (fixed shapes: capturable; rows past masked_m compute values nobody reads).
    bool graph_safe = false;
    bool force_dequant = false;  // FP8: skip the blocked cuBLASLt path (for comparisons)
};

class ReferenceMoeLayer {
 public:
    // GPU: builds the cuBLASLt handle and probes the FP8 path (heuristic query plus a numeric
    // self-check on a small problem); path() and path_note() say what runs and why.
    ReferenceMoeLayer(const ExpertWeights& weights, Device device, MoeLayerOptions options = {});
    ~ReferenceMoeLayer();
    ReferenceMoeLayer(const ReferenceMoeLayer&) = delete;
    ReferenceMoeLayer& operator=(const ReferenceMoeLayer&) = delete;

    // y = FFN_l(row) for every real row of local expert l: gate/up GEMM [2I, H] -> SiLU(gate) * up
    // (fp32) -> (FP8: 1x128 requantization) -> down GEMM [H, I] -> bf16. y: bf16 in the shape of
    // in.hidden_states. With WeightPlacement::kAdapter the route weights are applied to y too.
    // Rows that are not real are left untouched (graph_safe: written with unread values).
    void forward(const MoeDispatchOutput& in, const TensorRef& y, void* stream = nullptr);
    // Dense rows through one local expert (a shared expert): x [T, H] bf16 -> y [T, H] bf16.
    void forward_dense(int local_expert, const TensorRef& x, const TensorRef& y, void* stream = nullptr);

    GemmPath path() const;
    const std::string& path_note() const;  // plain words: which path runs and why
    int num_local_experts() const;

    struct Impl;

 private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace elasticep
