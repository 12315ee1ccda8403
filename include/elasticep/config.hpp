// BufferConfig and the enums that name layouts, payloads and backends.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "elasticep/limits.hpp"

namespace elasticep {

enum class Payload : uint8_t { kBF16, kFP8 };

// FP8 scale formats (SEMANTICS.md, "Payloads and scales").
enum class ScaleFormat : uint8_t {
    kF32G128,    // one fp32 scale per 1x128 group
    kUE8M0G128,  // power-of-two scale per 1x128 group, exponent bytes packed 4 per int32
    kUE8M0G32,   // MXFP8: as above with 1x32 groups
};

enum class Topology : uint8_t {
    kDirect,  // every rank writes straight into every peer (NVLink inside one node)
    kHybrid,  // network to the same local rank of the destination node, then NVLink forwarding
};

// The network transport of the hybrid topology (docs/SEMANTICS.md, "Topology").
enum class ScaleOut : uint8_t {
    kAuto,      // CPU: emulated; CUDA: gin where NCCL has GIN on the rail, else nccl where it can run, else emulated
    kGin,       // NCCL device API: GPU-initiated puts with signals (needs an RDMA NIC)
    kNccl,      // NCCL host point-to-point (ncclSend/ncclRecv on the call's stream), then NVLink forwarding
    kEmulated,  // the library's own peer copies with GIN's ordering: one host, the CPU backend, tests
};

enum class Layout : uint8_t {
    kExpertContiguous,  // prefill: [M, H] rows grouped by local expert, segments aligned
    kExpertMasked,      // decode: [E_local, R*C, H] slab with masked_m counts, fixed shapes
};

enum class BackendKind : uint8_t { kAuto, kCPU, kCUDA };

const char* payload_name(Payload p);
const char* scale_format_name(ScaleFormat f);
const char* topology_name(Topology t);
const char* layout_name(Layout l);
const char* scaleout_name(ScaleOut s);
const char* backend_name(BackendKind b);

// Parse the names above ("bf16", "fp8", "f32_g128", "ue8m0_g128", "ue8m0_g32", "direct", "hybrid",
// "contiguous", "masked", "auto", "cpu", "cuda", and scale-outs "auto", "gin", "nccl", "emulated"); throws
// InvalidArgument listing the choices.
Payload parse_payload(const std::string& s);
ScaleFormat parse_scale_format(const std::string& s);
Topology parse_topology(const std::string& s);
Layout parse_layout(const std::string& s);
ScaleOut parse_scaleout(const std::string& s);
BackendKind parse_backend(const std::string& s);

// Channels per scale group (128 or 32).
int scale_group_size(ScaleFormat f);
// Scale columns per row as stored: fp32 groups for f32_g128, packed int32 words for ue8m0.
// Throws InvalidArgument unless hidden is in [1, kMaxHidden].
int scale_columns(ScaleFormat f, int hidden);

// Value ranges: include/elasticep/limits.hpp.
// Checks a timeout against [1 ms, kMaxTimeout]; `what` names the parameter in the error.
void validate_timeout(std::chrono::milliseconds timeout, const char* what);

struct BufferConfig {
    int num_experts = 0;          // E in [1, 65536], a multiple of the number of ranks
    int num_topk = 0;             // K in [1, 32]
    int hidden = 0;               // H in [1, 65536], a multiple of 8 (bf16) or of the scale group (fp8)
    int max_tokens_per_rank = 0;  // C >= 1: a memory reservation, not a semantic limit
    Payload payload = Payload::kBF16;
    ScaleFormat scale_format = ScaleFormat::kF32G128;  // used when payload == kFP8
    Topology topology = Topology::kDirect;
    int ranks_per_node = 0;                    // ranks sharing NVLink (a divisor of R); 0 = all ranks in one node
    ScaleOut scaleout = ScaleOut::kAuto;       // hybrid's network transport; must stay kAuto for direct
    int num_sms = 0;                           // in [0, 1024]; 0 = chosen from a bandwidth model of the link
    std::chrono::milliseconds timeout{30000};  // bound on every wait for a peer: [1 ms, 7 days]
    int device = -1;                           // CUDA device of this rank; -1 = the current device

    // Throws InvalidArgument naming the field and the fix.
    void validate(int num_ranks) const;
    // Identity of the config for the buffer registry (every field above).
    std::string key() const;
    // What every rank of a group must agree on: every field but `device`, which is per rank.
    std::string group_key() const;
    std::string describe() const;

    int num_local_experts(int num_ranks) const { return num_experts / num_ranks; }
    // P: ranks_per_node, with 0 meaning all ranks (one node).
    int node_size(int num_ranks) const { return ranks_per_node == 0 ? num_ranks : ranks_per_node; }
};

}  // namespace elasticep
