// Plain-integer description of one rank's symmetric region and workspace, shared by the host
// (sizing, allocation) and the kernels (addressing).
//
// Symmetric region of receiver d (peers write into it):
//   disp_slots   [R senders][C][msg.bytes]   messages, one per (sender, token) routed to d
//   route_pos    [R][C][K] int32             per route: position among the sender's routes to
//                                            the same local expert (t ascending); -1 elsewhere
//   disp_flags   [R][2 parity] DispFlag      count + status, epoch published last (release.sys)
//   disp_ecounts [R][2][E_local] int32       per local expert: the sender's route count
//   comb_slots   [R holders][C][H] bf16      combine partials for d's own tokens
//   comb_flags   [R] uint64                  holder's combine epoch
#pragma once

#include <cstdint>

#include "core/layout.hpp"
#include "kernels/common/protocol.cuh"
#include "transport/nvlink_team.cuh"

namespace elasticep::kernels {

struct DispFlag {
    uint64_t epoch;
    int64_t count;
    RouteStatus status;
    uint64_t pad[2];
};
static_assert(sizeof(DispFlag) == 64, "DispFlag is one 64-byte line");

struct RegionLayout {
    int64_t disp_slots = 0, route_pos = 0, disp_flags = 0, disp_ecounts = 0, comb_slots = 0, comb_flags = 0;
    int64_t bytes = 0;

    ELASTICEP_HD static RegionLayout make(int r, int c, int k, int e_local, int h, int msg_bytes) {
        RegionLayout g;
        int64_t at = 0;
        auto take = [&at](int64_t n) {
            const int64_t o = at;
            at = round_up(at + n, 256);
            return o;
        };
        const int64_t slots = int64_t{r} * c;
        g.disp_slots = take(slots * msg_bytes);
        g.route_pos = take(slots * k * 4);
        g.disp_flags = take(int64_t{r} * 2 * 64);
        g.disp_ecounts = take(int64_t{r} * 2 * e_local * 4);
        g.comb_slots = take(slots * h * 2);
        g.comb_flags = take(int64_t{r} * 8);
        g.bytes = at;
        return g;
    }
};

// Local workspace of one rank (device memory, only this rank touches it).
struct Workspace {
    int32_t* pos_in_expert;  // [C][K]
    int32_t* slot_of;        // [C][K] at the first k of each destination: the token's slot there
    int32_t* clean_idx;      // [C][K]
    int32_t* expert_count;   // [E]
    int32_t* dest_count;     // [R]
    RouteStatus* status;     // [1]
    unsigned long long* bad_key;  // [1] first invalid route t*32+k (~0: none); reset by the exchange
    uint64_t* epoch;         // [1]
    int32_t* state;          // [0] aborted (timeout), [1] rejected (bad status), [2] M, [3] sticky seen
    int32_t* msg_start;      // [R + 1] received messages per sender, exclusive scan
    int32_t* base;           // [R][E_local]
    int32_t* counts;         // [E_local]
    int32_t* start;          // [E_local + 1] (the offsets output)
    int32_t* recv_rows;      // [R*C][K]
    int64_t* load;           // [E_local]
};

// How a call meets its peers. kDevice: one kernel publishes, then waits on the device (bounded).
// Ranks of one process that share a GPU cannot rely on that: CUDA may serialise their streams (they
// share hardware queues, or a tool such as compute-sanitizer runs kernels one at a time), and a
// waiting kernel then blocks the very kernel it waits for. For them the kernel only publishes
// (kPublishOnly), the host waits on the flags (bounded), then a kWaitOnly launch finds them set.
enum SyncMode : int32_t { kDevice = 0, kPublishOnly = 1, kWaitOnly = 2 };

struct Shape {
    int rank, num_ranks, num_experts, e_local, num_topk, hidden, capacity;
    MessageLayout msg;
    RegionLayout region;
};

// What every kernel of a call needs: the shapes, this rank's workspace and region, its host record,
// the wait bound, how the call meets its peers, and this rank's token count.
struct CallParams {
    transport::NvlinkTeam team;
    Shape sh;
    Workspace ws;
    HostRecord* rec;
    uint64_t timeout_ns;
    int32_t sync_mode;
    int num_tokens;
};

struct DispatchParams : CallParams {
    // inputs
    const void* x;
    int64_t x_stride;  // elements
    bool x_aligned;    // 16-byte loads allowed
    const uint32_t* x_scales;
    int64_t xs_stride;  // words
    const void* idx;
    int64_t idx_stride;
    bool idx64;
    const float* weights;
    int64_t w_stride;
    // payload
    bool fp8, quantize, prequantized, f32_scales;
    int group, num_groups, scale_cols;
    // layout
    bool contiguous, host_sync, zero_padding;
    int alignment;
    int64_t rows_out;
    uint8_t* rx;
    uint32_t* rsc;
    int64_t sst0, sst1, sst2;
    float* rw;
    int32_t* rs;
    int32_t* mi;
};

struct CombineParams : CallParams {
    const uint16_t* y;
    bool weighted;
    const uint16_t* bias;
    int64_t bias_stride;
    uint16_t* out;
    int64_t out_stride;
};

}  // namespace elasticep::kernels
