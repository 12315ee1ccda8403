// CUDA intranode backend, direct topology: every rank writes straight into every peer's receive
// window. This file is the launch sequence; the pieces it stands on:
//   src/core/protocol.hpp               what is sent and when, the route status, the error texts
//   src/transport/                      symmetric memory (pool or CUDA IPC, peer access, the device
//                                       peer table) and the device team the kernels address peers by
//   src/kernels/common/buffer_layout.hpp  every byte of the window, the workspace and the host record
//   src/kernels/intranode/*.cuh          the kernels and their launch contracts
//   backends/cuda/kernel_launch.hpp      runtime modes -> kernel instantiations
//   backends/cuda/launch_config.hpp      the SM count and how calls meet their peers
//   backends/cuda/device_outputs.hpp     caller-provided and buffer-owned outputs
//   backends/cuda/peer_watch.hpp         host waits, timeouts and their diagnosis
//   backends/cuda/host_records.hpp       the host-mapped record
//
// Two paths (docs/PERFORMANCE.md, "Two paths"; ELASTICEP_KERNEL_VARIANT = auto | staged | direct,
// read when the buffer is built; auto = direct where it applies):
//   direct  every rank a thread of this process on this GPU: senders write rows straight into the
//           receivers' outputs, origins read the holders' y in place (src/kernels/intranode/direct.cuh).
//           dispatch: [plan, unless the kernel plans itself] -> direct dispatch (publish, tables,
//           move, finish).  combine: direct combine (publish, move, finish).
//   staged  everything else (peers in other processes or on other GPUs): one call, on the caller's
//           stream (or the buffer's own non-blocking stream, synchronously):
//           dispatch: plan -> send -> exchange (publish + bounded wait) -> [host_sync: D2H read of M,
//             the status word and the rounds] -> expand, then for every further round r (a host-sync
//             call whose busiest pair has more than S messages): round -> send(r) -> round -> expand(r).
//             Graph mode reads nothing on the host (and has one round: its ring holds C slots).
//           combine: partial (holder writes into origin) -> publish (bounded wait) -> reduce (origin).
// The epoch lives on the device, so a captured graph replays with fresh epochs.
// stream == nullptr: the call runs on the buffer's own non-blocking stream and synchronises it
// before returning. Buffer-owned outputs are allocated (stream-ordered) at the first call of each
// layout shape: warm up before capturing a graph.
//
// Several ranks on one GPU (threads of one process, the development setup): a kernel that waits for
// a peer on the device relies on the peer's kernels running at the same time, which CUDA does not
// promise (streams share CUDA_DEVICE_MAX_CONNECTIONS hardware queues; compute-sanitizer runs kernels
// one at a time). Measured on an H200: with 4-8 ranks on one GPU about one matrix run in three timed
// out at the first call of some buffer, the late rank's kernels starting only after its peers' waits
// gave up. So when any GPU holds two ranks of one process, every rank of the group waits on the host
// instead (LaunchConfig::host_waits, PeerWatch). Capturing a graph keeps the device waits (the host
// cannot wait inside a graph): such replays are for tests, with CUDA_DEVICE_MAX_CONNECTIONS=32.
// No rank may make a call that waits for the whole device (cudaFree, cudaFreeHost,
// cudaDeviceEnablePeerAccess; tests/gpu/probe_blocking.cu measures which calls do) while a peer's
// kernel may wait for it. So this backend frees with cudaFreeAsync, takes its host-mapped record
// from a process-wide pool that is never freed, allocates from a stream-ordered pool, and makes
// every other such call before its last collective.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "backends/cuda/device_outputs.hpp"
#include "backends/cuda/dispatch_forger.hpp"
#include "backends/cuda/host_records.hpp"
#include "backends/cuda/kernel_launch.hpp"
#include "backends/cuda/launch_config.hpp"
#include "backends/cuda/peer_watch.hpp"
#include "backends/cuda/stage_timer.hpp"
#include "core/backend.hpp"
#include "core/check.hpp"
#include "core/outputs.hpp"
#include "core/protocol.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/common/device_scope.hpp"
#include "kernels/intranode/direct.cuh"
#include "transport/device_pool.hpp"
#include "transport/symmetric_memory.hpp"

namespace elasticep::detail {
namespace {

using kernels::HostRecord;
using kernels::RegionLayout;
using kernels::Workspace;

// The staging budget of the window's message ring (kStagingBudgetBytes; ELASTICEP_STAGING_BYTES
// overrides it, for tests that make a small ring stream in rounds). Every rank must agree: checked.
int64_t staging_budget() {
    if (const char* v = std::getenv("ELASTICEP_STAGING_BYTES"); v && *v) {
        char* end = nullptr;
        const long long b = std::strtoll(v, &end, 10);
        ELASTICEP_CHECK(end && *end == '\0' && b > 0, ErrorCode::kInvalidArgument, "ELASTICEP_STAGING_BYTES=", v,
                        " is not a positive byte count; unset it or give one");
        return b;
    }
    return kStagingBudgetBytes;
}

// `ring`: the staged window's slots per sender (0: C); `direct`: the direct path's layout.
kernels::Shape make_shape(const BufferConfig& c, int num_ranks, int ring = 0, bool direct = false) {
    kernels::Shape s{};
    s.num_ranks = num_ranks;
    s.num_experts = c.num_experts;
    s.num_local_experts = c.num_experts / num_ranks;
    s.num_topk = c.num_topk;
    s.hidden = c.hidden;
    s.capacity = c.max_tokens_per_rank;
    s.msg = message_layout(c);
    s.ring = ring;
    s.ranks_per_node = c.ranks_per_node > 0 && c.ranks_per_node < num_ranks ? c.ranks_per_node : 0;
    s.direct = direct;
    return s;
}

int ring_of(const BufferConfig& c, int num_ranks, int64_t budget) {
    return staging_ring_slots(num_ranks, c.max_tokens_per_rank, c.num_topk, message_layout(c).bytes, budget);
}

// The kernel path of a buffer: the same answer on every rank (the placement comes from one
// all_gather, the variant from the environment, which the build checks every rank agrees on).
struct PathChoice {
    bool direct = false;
    std::string why;  // why not direct
};

// ELASTICEP_KERNEL_VARIANT: auto, staged or direct; unset: kDefaultKernelVariant. auto takes the direct
// path where it applies (every rank a thread of this process on this GPU) and the staged path
// elsewhere; direct asks for the direct path and says on stderr when it does not apply. (From
// 2026-12-01 to 2026-12-02 auto was staged: the direct kernels deadlocked beside other kernels in
// replayed graphs, ServingGpu.DecodeLayerReplaysFromACudaGraphOnTheDirectPath; only one block of a
// rank waits for peers now.)
constexpr const char* kDefaultKernelVariant = "auto";

std::string kernel_variant() {
    std::string variant = kDefaultKernelVariant;
    if (const char* v = std::getenv("ELASTICEP_KERNEL_VARIANT"); v && *v) variant = v;
    ELASTICEP_CHECK(variant == "auto" || variant == "staged" || variant == "direct", ErrorCode::kInvalidArgument,
                    "ELASTICEP_KERNEL_VARIANT=", variant, " is not one of auto, staged, direct; unset it or pick one");
    return variant;
}

PathChoice choose_path(const std::string& variant, const BufferConfig& c, const transport::Placement& where,
                       int num_ranks) {
    PathChoice p;
    if (variant == "staged")
        p.why = "ELASTICEP_KERNEL_VARIANT=staged";
    else if (!where.one_process || where.remote_gpu)
        p.why = "the direct path needs every rank as a thread of this process on this GPU";
    else if (num_ranks > kernels::kDirectMaxRanks)
        p.why = cat(num_ranks, " ranks exceed the direct path's ", kernels::kDirectMaxRanks);
    else if (c.num_experts > kernels::kDirectMaxExperts)
        p.why = cat(c.num_experts, " experts exceed the direct path's ", kernels::kDirectMaxExperts);
    else
        p.direct = true;
    if (variant == "direct" && !p.direct && where.rank == 0)
        std::fprintf(stderr, "[elasticep] ELASTICEP_KERNEL_VARIANT=direct: using the staged path (%s)\n",
                     p.why.c_str());
    return p;
}

kernels::SendPayload send_payload(const BufferConfig& c, bool prequantized) {
    if (c.payload == Payload::kBF16) return kernels::SendPayload::kBF16;
    if (prequantized) return kernels::SendPayload::kFP8Copy;
    switch (c.scale_format) {
        case ScaleFormat::kF32G128:
            return kernels::SendPayload::kFP8F32G128;
        case ScaleFormat::kUE8M0G128:
            return kernels::SendPayload::kFP8UE8M0G128;
        case ScaleFormat::kUE8M0G32:
            return kernels::SendPayload::kFP8UE8M0G32;
    }
    raise(ErrorCode::kInternal, "internal: unknown scale format");
}

using cuda::timeout_ns;

class CudaBackend final : public BackendBuffer {
 public:
    explicit CudaBackend(const BackendContext& ctx)
        : cfg_(ctx.config),
          group_(ctx.group),
          rank_(ctx.rank),
          num_ranks_(ctx.num_ranks),
          e_local_(cfg_.num_experts / ctx.num_ranks),
          shape_(make_shape(cfg_, ctx.num_ranks)),
          region_(RegionLayout::make(shape_)),
          stages_(ctx.rank) {
        // Everything before the first collective may fail on this rank alone: the failure travels with
        // the first exchange (Placement::gather), so every rank raises at the same point.
        std::exception_ptr failure;
        int device_sms = 1;
        int64_t budget = kStagingBudgetBytes;
        std::string variant = "auto";
        try {
            ELASTICEP_CHECK(e_local_ <= kMaxLocalExperts, ErrorCode::kUnsupported, "the CUDA backend supports at most ",
                            "kMaxLocalExperts=", kMaxLocalExperts, " local experts per rank; this config has ",
                            e_local_);
            budget = staging_budget();
            variant = kernel_variant();
            if (cfg_.device >= 0)
                dev_ = cfg_.device;
            else
                ELASTICEP_CUDA_CALL(cudaGetDevice(&dev_));
            ELASTICEP_CUDA_CALL(cudaSetDevice(dev_));
            cudaDeviceProp prop{};
            ELASTICEP_CUDA_CALL(cudaGetDeviceProperties(&prop, dev_));
            device_sms = prop.multiProcessorCount;
            ELASTICEP_CUDA_CALL(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
            ELASTICEP_CUDA_CALL(cudaEventCreateWithFlags(&last_event_, cudaEventDisableTiming));
            // Everything that may wait for the device happens before the first collective: once a peer
            // passes the last one (the front end's), it may launch kernels that wait for this rank.
            cuda::load_dispatch_kernels();
            cuda::load_combine_kernels();
            cuda::load_direct_kernels();
            direct_blocks_per_sm_ = cuda::direct_blocks_per_sm();
            outputs_ = std::make_unique<cuda::DeviceOutputs>(cfg_, num_ranks_, rank_, dev_, own_stream_);
            record_ = std::make_unique<cuda::HostRecordLease>();
        } catch (...) {
            failure = std::current_exception();
        }

        try {
            // who is where, then the path and the ring (every rank must agree), then the symmetric
            // receive window of every rank (collective), then this rank's workspace
            const transport::Placement where = transport::Placement::gather(*ctx.group, rank_, dev_, failure);
            launch_ = cuda::LaunchConfig::choose(cfg_, where, device_sms);
            const PathChoice path = choose_path(variant, cfg_, where, num_ranks_);
            const int ring = path.direct ? 0 : ring_of(cfg_, num_ranks_, budget);
            struct Agree {
                int32_t direct, ring;
            };
            const auto all = ctx.group->all_gather_value(Agree{path.direct ? 1 : 0, ring});
            for (size_t q = 0; q < all.size(); ++q)
                ELASTICEP_CHECK(all[q].direct == all[0].direct && all[q].ring == all[0].ring, ErrorCode::kInternal,
                                "CUDA backend: rank ", q, " chose ", all[q].direct ? "the direct" : "the staged",
                                " path with a ring of ", all[q].ring, " slots, rank 0 ",
                                all[0].direct ? "the direct" : "the staged", " path with ", all[0].ring,
                                "; every rank must see the same ELASTICEP_KERNEL_VARIANT and ELASTICEP_STAGING_BYTES");
            direct_ = path.direct;
            // a rank's direct grids take at most its share of the SMs (they share the HBM; the
            // one-kernel variant also needs every block of every rank of this GPU resident at once).
            // The variant comes from the environment of this one process, the same for every rank.
            if (const char* v = std::getenv("ELASTICEP_DIRECT_ONE_KERNEL"); v && std::string(v) == "1")
                direct_one_kernel_ = direct_;
            if (const char* v = std::getenv("ELASTICEP_DIRECT_PDL"); v && std::string(v) == "0") direct_pdl_ = false;
            if (direct_) grid_sms_ = std::min(launch_.num_sms, std::max(1, device_sms / where.ranks_on_my_gpu));
            shape_ = make_shape(cfg_, num_ranks_, ring, direct_);
            region_ = RegionLayout::make(shape_);
            window_ = std::make_unique<transport::SymmetricMemory>(*ctx.group, where,
                                                                   static_cast<size_t>(region_.bytes), own_stream_);
            where_ = where;
            // after the last collective: a failure here is heard through the front end's agreement
            const int64_t ws_bytes = Workspace::carve(shape_, nullptr).bytes;
            ws_ptr_ = transport::pool_alloc(static_cast<size_t>(ws_bytes), dev_, own_stream_);
            ELASTICEP_CUDA_CALL(cudaMemsetAsync(ws_ptr_, 0, static_cast<size_t>(ws_bytes), own_stream_));
            ws_ = Workspace::carve(shape_, ws_ptr_);
            ws_.points = stages_.points();  // ELASTICEP_STAGE_TIMES=1: the direct kernels' device points
            ELASTICEP_CUDA_CALL(cudaMemsetAsync(ws_.first_bad_route, 0xff, sizeof(*ws_.first_bad_route), own_stream_));
            ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
            watch_ = std::make_unique<cuda::PeerWatch>(rank_, num_ranks_, cfg_.timeout, region_, *window_,
                                                       record_->host(), ws_, own_stream_);
        } catch (...) {
            release();  // no destructor runs for a constructor that throws
            throw;
        }
    }

    ~CudaBackend() override { release(); }

    // Frees everything this rank holds (whatever the constructor got to). Nothing here waits for the
    // whole device (see the header comment): peers of this process may already run kernels of their
    // next buffer.
    void release() noexcept {
        cudaSetDevice(dev_);
        if (own_stream_) cudaStreamSynchronize(own_stream_);
        if (has_event_) cudaEventSynchronize(last_event_);
        // after a timeout a late peer may still write into this rank's window: keep it (leaked)
        if (window_ && watch_ && watch_->timed_out()) window_->keep_local_window();
        watch_.reset();
        window_.reset();
        outputs_.reset();
        if (ws_ptr_) cudaFreeAsync(ws_ptr_, own_stream_);
        ws_ptr_ = nullptr;
        record_.reset();
        if (last_event_) cudaEventDestroy(last_event_);
        if (own_stream_) cudaStreamDestroy(own_stream_);
        last_event_ = nullptr;
        own_stream_ = nullptr;
        cudaGetLastError();
    }

    void set_dispatch_forger(testing::DispatchForger forger) override { forger_ = std::move(forger); }

    Device device() const override { return Device{DeviceType::kCUDA, dev_}; }
    std::string kernel_path() const override { return direct_ ? "direct" : "staged"; }
    size_t reserved_bytes() const override {
        return static_cast<size_t>(region_.bytes + ws_.bytes) +
               static_cast<size_t>(reservation(cfg_, num_ranks_).combine_out);
    }

    std::vector<int64_t> expert_load() override {
        const cuda::DeviceScope device_scope(dev_);
        sync_last();
        return cuda::read_expert_load(ws_.expert_load, e_local_);
    }
    void reset_expert_load() override {
        const cuda::DeviceScope device_scope(dev_);
        sync_last();
        cuda::clear_expert_load(ws_.expert_load, e_local_, own_stream_);
    }

    void check() override {
        const cuda::DeviceScope device_scope(dev_);
        sync_last();
        watch_->raise_faults();
        volatile RouteStatus* s = &record_->host()->sticky;
        if (s->kind != kRouteOk) {
            const RouteStatus b{s->kind, s->token, s->k, s->dup_of, s->value, 0, 0};
            s->kind = kRouteOk;
            raise(ErrorCode::kInvalidArgument, sticky_fault_message(b, rank_, cfg_.num_experts));
        }
    }

    void dispatch(const DispatchRequest& req, HandleState& handle, DispatchResult& result) override {
        stages_.host_point("entry");
        const cuda::DeviceScope device_scope(dev_);
        watch_->raise_faults();
        const DispatchArgs& a = *req.args;
        cudaStream_t stream = a.stream ? static_cast<cudaStream_t>(a.stream) : own_stream_;
        const bool fp8 = cfg_.payload == Payload::kFP8;
        const int scols = fp8 ? scale_columns(cfg_.scale_format, cfg_.hidden) : 0;
        const bool contiguous = a.layout == Layout::kExpertContiguous;
        const int64_t t_count = req.num_tokens;
        // the masked slab's rows are int32 in the kernels' route table
        ELASTICEP_CHECK_ARG(contiguous || int64_t{e_local_} * shape_.slots() < (int64_t{1} << 31),
                            "dispatch: the masked layout has E_local * R * C = ", int64_t{e_local_} * shape_.slots(),
                            " rows, beyond int32 row indices; lower max_tokens_per_rank or use the contiguous layout");
        const bool capturing = is_capturing(stream);
        ELASTICEP_CHECK_ARG(!(capturing && a.host_sync),
                            "dispatch: host_sync=true cannot be captured in a CUDA graph (it reads the row count on "
                            "the host); pass host_sync=false (graph mode) while capturing");
        if (!a.host_sync) grow_ring_for_graph_mode(stream, capturing);
        stages_.host_point("checks");

        cuda::DispatchParams p{};
        fill_common(p, t_count);
        p.x = a.x.data;
        const int xelem = static_cast<int>(dtype_size(a.x.dtype));
        p.x_row_stride = t_count > 1 ? a.x.stride(0) : cfg_.hidden;
        p.x_aligned = reinterpret_cast<uintptr_t>(a.x.data) % 16 == 0 && (p.x_row_stride * xelem) % 16 == 0;
        p.x_scales = a.x_scales ? static_cast<const uint32_t*>(a.x_scales->data) : nullptr;
        p.x_scales_row_stride = a.x_scales && t_count > 1 ? a.x_scales->stride(0) : scols;
        p.topk_idx = a.topk_idx.data;
        p.topk_idx_row_stride = t_count > 1 ? a.topk_idx.stride(0) : cfg_.num_topk;
        p.topk_weights = a.topk_weights ? static_cast<const float*>(a.topk_weights->data) : nullptr;
        p.topk_weights_row_stride = a.topk_weights && t_count > 1 ? a.topk_weights->stride(0) : cfg_.num_topk;
        p.scale_columns = scols;
        p.host_sync = a.host_sync;  // masked too: the CPU backend rejects bad routes synchronously then
        p.zero_padding = a.zero_padding;
        p.expert_alignment = contiguous ? a.expert_alignment : 0;  // 0: no segments (masked)
        const cuda::DispatchModes modes{send_payload(cfg_, req.prequantized), a.topk_idx.dtype == DType::kInt64,
                                        contiguous};

        ELASTICEP_CHECK_ARG(!(capturing && forger_), "dispatch: a test's dispatch forger cannot run while capturing");
        ELASTICEP_CHECK(!(direct_ && forger_), ErrorCode::kUnsupported,
                        "dispatch: a test's dispatch forger plays a sender of the staged protocol; build the buffer "
                        "with ELASTICEP_KERNEL_VARIANT=staged");
        const cuda::DispatchTargets out = outputs_->dispatch_targets(a, req.rows_cap, capturing, stream);
        stages_.host_point("output targets");
        p.recv_x = out.recv_x;
        p.recv_weights = out.recv_weights;
        p.recv_src = out.recv_src;
        p.recv_scales = out.recv_scales;
        p.m_indices = out.m_indices;

        int64_t rows_out = contiguous ? req.rows_cap : shape_.slots();
        int rounds = 1;
        stages_.begin("dispatch", stream, capturing);
        if (direct_) {
            // the receivers' scale strides before the counts are known (MN-major buffer-owned
            // contiguous scales with host sync depend on M: the senders derive them on the device)
            p.num_rows_out = rows_out;
            if (fp8) {
                const auto cap = dispatch_output_specs(cfg_, num_ranks_, a.layout, req.rows_cap, a.scales_mn_major);
                const auto& st = cap.recv_scales->strides;
                p.recv_scale_strides =
                    contiguous ? kernels::ScaleStrides{0, st[0], st[1]} : kernels::ScaleStrides{st[0], st[1], st[2]};
                p.scales_mn_dynamic = contiguous && a.scales_mn_major && a.host_sync && !a.outputs.recv_scales;
            }
            run_direct([&](int grid, bool after) { cuda::launch_direct_dispatch(p, modes, grid, after, stream); }, p,
                       stream, capturing, kPhaseDispatch, region_.plan_flags, region_.sent_flags, 1, true);
            if (p.host_sync) {
                ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
                watch_->raise_faults();
                const volatile HostRecord* r = record_->host();
                if (r->bad_sender >= 0) {
                    const RouteStatus b{r->bad.kind,  r->bad.token,  r->bad.k, r->bad.dup_of,
                                        r->bad.value, r->bad.sticky, 0};
                    raise(ErrorCode::kInvalidArgument, rejected_dispatch_message(b, r->bad_sender, cfg_.num_experts));
                }
                if (contiguous) rows_out = r->num_rows;
            }
            outputs_->bind_dispatch(a, out, req.rows_cap, rows_out, result);
        } else {
            const int grid = 2 * launch_.num_sms;
            p.round = 0;
            cuda::launch_plan(p, modes, stream);
            stages_.mark("plan");
            cuda::launch_send(p, modes, grid, stream);
            stages_.mark("send");
            // a test playing a sender that breaks the protocol (core/testing.hpp)
            if (forger_) cuda::forge_outgoing(forger_, rank_, shape_, region_, window_->windows(), ws_, stream);
            meet_peers([&] { cuda::launch_exchange(p, modes, stream); }, p, stream, capturing,
                       [&] { watch_->host_wait(stream, kPhaseDispatch); });
            stages_.mark("exchange");
            if (p.host_sync) {
                ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
                watch_->raise_faults();
                const volatile HostRecord* r = record_->host();
                if (r->bad_sender >= 0) {
                    const RouteStatus b{r->bad.kind,  r->bad.token,  r->bad.k, r->bad.dup_of,
                                        r->bad.value, r->bad.sticky, 0};
                    raise(ErrorCode::kInvalidArgument, rejected_dispatch_message(b, r->bad_sender, cfg_.num_experts));
                }
                if (contiguous) rows_out = r->num_rows;
                rounds = r->num_rounds;
                ELASTICEP_INTERNAL(rounds >= 1 && rounds <= ceil_div(cfg_.max_tokens_per_rank, region_.ring),
                                   "dispatch: the exchange reported ", rounds, " rounds");
            }
            outputs_->bind_dispatch(a, out, req.rows_cap, rows_out, result);
            p.num_rows_out = rows_out;
            if (fp8) {
                const auto& st = result.recv_scales->strides;
                p.recv_scale_strides =
                    contiguous ? kernels::ScaleStrides{0, st[0], st[1]} : kernels::ScaleStrides{st[0], st[1], st[2]};
            }
            if (p.host_sync) stages_.mark("host read of M");
            cuda::launch_expand(p, modes, grid, stream);
            stages_.mark("expand");
            // further rounds through the ring: free (every rank expanded), fill (send), read (expand)
            for (int r = 1; r < rounds; ++r) {
                p.round = r;
                round_barrier(p, 2 * r - 1, stream);
                cuda::launch_send(p, modes, grid, stream);
                round_barrier(p, 2 * r, stream);
                cuda::launch_expand(p, modes, grid, stream);
                stages_.mark("round (barriers, send, expand)");
            }
        }
        const Device dev = device();
        result.counts = TensorRef::contiguous(ws_.counts, DType::kInt32, {e_local_}, dev);
        if (contiguous) {
            result.offsets = TensorRef::contiguous(ws_.offsets, DType::kInt32, {e_local_ + 1}, dev);
            result.num_rows = p.host_sync ? rows_out : -1;
        } else {
            result.masked_m = result.counts;
        }
        finish(stream, a.stream == nullptr, capturing);
        stages_.host_point("result");
        stages_.end();
        handle.num_sms = launch_.num_sms;
        handle.backend_data = nullptr;
    }

    TensorRef combine(HandleState& handle, const CombineArgs& args) override {
        stages_.host_point("entry");
        const cuda::DeviceScope device_scope(dev_);
        watch_->raise_faults();
        cudaStream_t stream = args.stream ? static_cast<cudaStream_t>(args.stream) : own_stream_;
        const int64_t t_count = handle.num_tokens;
        cuda::CombineParams p{};
        fill_common(p, t_count);
        p.y = static_cast<const uint16_t*>(args.y.data);
        ELASTICEP_CHECK_ARG(reinterpret_cast<uintptr_t>(args.y.data) % 16 == 0,
                            "combine: y must be 16-byte aligned for the CUDA backend");
        if (args.bias) {
            p.bias = static_cast<const uint16_t*>(args.bias->data);
            p.bias_row_stride = t_count > 1 ? args.bias->stride(0) : cfg_.hidden;
            ELASTICEP_CHECK_ARG(reinterpret_cast<uintptr_t>(p.bias) % 16 == 0 && p.bias_row_stride % 8 == 0,
                                "combine: bias rows must be 16-byte aligned for the CUDA backend (row stride a "
                                "multiple of 8)");
        }
        const TensorRef out = outputs_->combine_out(args, t_count);
        stages_.host_point("output");
        p.out = static_cast<uint16_t*>(out.data);
        p.out_row_stride = t_count > 1 ? out.stride(0) : cfg_.hidden;
        ELASTICEP_CHECK_ARG(
            reinterpret_cast<uintptr_t>(p.out) % 16 == 0 && p.out_row_stride % 8 == 0,
            "combine: out rows must be 16-byte aligned for the CUDA backend (row stride a multiple of 8)");
        p.weighted = args.weighted;
        const bool capturing = is_capturing(stream);
        const bool nodes = shape_.node_level();
        stages_.begin("combine", stream, capturing);
        if (direct_) {
            run_direct([&](int grid, bool after) { cuda::launch_direct_combine(p, nodes, grid, after, stream); }, p,
                       stream, capturing, kPhaseCombine, region_.ready_flags, region_.done_flags, 0, false);
        } else {
            const int grid = 2 * (handle.num_sms > 0 ? handle.num_sms : launch_.num_sms);
            cuda::launch_partial(p, args.weighted, grid, stream);
            stages_.mark("partial");
            meet_peers([&] { cuda::launch_publish(p, stream); }, p, stream, capturing,
                       [&] { watch_->host_wait(stream, kPhaseCombine); });
            stages_.mark("publish");
            cuda::launch_reduce(p, p.bias != nullptr, nodes, grid, stream);
            stages_.mark("reduce");
        }
        finish(stream, args.stream == nullptr, capturing);
        stages_.host_point("result");
        stages_.end();
        if (args.stream == nullptr) watch_->raise_faults();
        return out;
    }

 private:
    void fill_common(kernels::CallParams<cuda::Team>& p, int64_t num_tokens) const {
        p.team = cuda::Team{window_->nvlink_windows()};
        p.shape = shape_;
        p.region = region_;
        p.ws = ws_;
        p.record = record_->device();
        p.timeout_ns = timeout_ns(cfg_.timeout);
        p.sync_mode = kernels::kDevice;
        p.num_tokens = static_cast<int>(num_tokens);
        p.step = 0;
    }

    static bool is_capturing(cudaStream_t stream) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        ELASTICEP_CUDA_CALL(cudaStreamIsCapturing(stream, &capture));
        return capture != cudaStreamCaptureStatusNone;
    }

    // Launches the one-block kernel that publishes this rank's epoch and waits for the peers'.
    // With host waits (never inside a capture) it runs twice: publish only, the host waits on the
    // flags (`host_wait`), then a wait-only launch that finds them set. `launch` launches the kernel
    // with `p` as it is at the time of the call.
    template <class Launch, class HostWait>
    void meet_peers(Launch&& launch, kernels::CallParams<cuda::Team>& p, cudaStream_t stream, bool capturing,
                    HostWait&& host_wait) {
        if (launch_.host_waits && !capturing) {
            p.sync_mode = kernels::kPublishOnly;
            launch();
            host_wait();
            p.sync_mode = kernels::kWaitOnly;
        }
        launch();
        p.sync_mode = kernels::kDevice;
        (void)stream;
    }

    // One round step of a host-sync call with more than one round (round_kernel).
    void round_barrier(cuda::DispatchParams& p, int step, cudaStream_t stream) {
        p.step = step;
        meet_peers([&] { cuda::launch_round(p, stream); }, p, stream, false,
                   [&] {
                       watch_->host_wait_words(stream, kPhaseDispatch, region_.round_flags, 0, kernels::kRoundShift,
                                               static_cast<uint64_t>(step));
                   });
        p.step = 0;
    }

    // A direct kernel's steps. Device waits: publish and meet (one block, or the grid when the
    // publish step plans: `grid_publishes`; the block that publishes then waits for the first flags)
    // -> move and finish (the grid, which finds them set; its last block waits for the second): no
    // more than one block of a rank waits for peers at a time. Host waits (never inside a capture):
    // publish -> host wait for the first flags -> move -> host wait for the second -> finish (one
    // block).
    // Device waits launch the second step as a programmatic dependent of the first (direct.cuh,
    // wait_for_first): it is scheduled once the first's waiting block has seen the flags, its launch
    // latency hidden behind that block's exit; ELASTICEP_DIRECT_PDL=0 launches it plainly (A/B).
    // ELASTICEP_DIRECT_ONE_KERNEL=1 (measurement only): one launch of every step, every block waiting,
    // which needs every rank's grid resident at once (nothing else on the GPU).
    // `epoch_delta`: the flags carry ws.epoch + 1 (dispatch) or ws.epoch (combine).
    template <class Launch>
    void run_direct(Launch&& launch, kernels::CallParams<cuda::Team>& p, cudaStream_t stream, bool capturing,
                    int32_t phase, int64_t first_flags, int64_t second_flags, uint64_t epoch_delta,
                    bool grid_publishes) {
        const int grid = grid_sms_ * direct_blocks_per_sm_;
        auto step = [&](int32_t which, int blocks, const char* name) {
            p.step = which;
            launch(blocks, which == kernels::kStepMoveFinish && direct_pdl_);
            stages_.host_point(name);
            stages_.mark(name);
        };
        if (launch_.host_waits && !capturing) {
            step(kernels::kStepPublish, grid_publishes ? grid : 1, "direct publish");
            watch_->host_wait_words(stream, phase, first_flags, epoch_delta);
            step(kernels::kStepMove, grid, "direct move");
            watch_->host_wait_words(stream, phase, second_flags, epoch_delta);
            step(kernels::kStepFinish, 1, "direct finish");
        } else if (direct_one_kernel_) {
            step(kernels::kStepAll, grid, "direct (one kernel)");
        } else {
            step(kernels::kStepPublishMeet, grid_publishes ? grid : 1, "direct publish and meet");
            step(kernels::kStepMoveFinish, grid, "direct move and finish");
        }
        p.step = 0;
    }

    // Graph-mode calls cannot stream through the ring in rounds (no host in the loop): the first one
    // on a buffer whose ring holds fewer than C slots per sender rebuilds the window with all C
    // (collective: every rank makes its first graph-mode dispatch at the same call, as the first
    // call of a layout already must be made outside a capture).
    void grow_ring_for_graph_mode(cudaStream_t stream, bool capturing) {
        if (direct_ || shape_.ring_slots() >= shape_.capacity) return;
        ELASTICEP_CHECK_ARG(!capturing,
                            "dispatch: the first graph-mode dispatch (host_sync=false) of this buffer "
                            "grows its receive window to max_tokens_per_rank slots per sender and cannot be "
                            "captured; run one graph-mode dispatch and combine before capturing");
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
        sync_last();
        const kernels::Shape full = make_shape(cfg_, num_ranks_, 0, false);
        const RegionLayout region = RegionLayout::make(full);
        auto window = std::make_unique<transport::SymmetricMemory>(*group_, where_, static_cast<size_t>(region.bytes),
                                                                   own_stream_);
        watch_ = std::make_unique<cuda::PeerWatch>(rank_, num_ranks_, cfg_.timeout, region, *window, record_->host(),
                                                   ws_, own_stream_);
        window_ = std::move(window);  // the old window: every kernel that addressed it has completed
        shape_ = full;
        region_ = region;
    }

    void finish(cudaStream_t stream, bool synchronous, bool capturing) {
        if (capturing) return;  // replays are the caller's to synchronise
        ELASTICEP_CUDA_CALL(cudaEventRecord(last_event_, stream));
        has_event_ = true;
        if (synchronous) ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
    }

    void sync_last() {
        if (has_event_) ELASTICEP_CUDA_CALL(cudaEventSynchronize(last_event_));
    }

    BufferConfig cfg_;
    std::shared_ptr<Group> group_;
    int rank_, num_ranks_, e_local_;
    kernels::Shape shape_;
    RegionLayout region_;
    int dev_ = 0;
    transport::Placement where_{};
    cuda::LaunchConfig launch_;
    bool direct_ = false;
    int grid_sms_ = 1;                // direct: SMs of this rank's grids (its share of the GPU)
    int direct_blocks_per_sm_ = 1;    // direct: resident blocks per SM (occupancy calculator)
    bool direct_one_kernel_ = false;  // ELASTICEP_DIRECT_ONE_KERNEL=1: kStepAll (run_direct)
    bool direct_pdl_ = true;          // ELASTICEP_DIRECT_PDL=0: the second step launched plainly (run_direct)
    cudaStream_t own_stream_ = nullptr;
    cudaEvent_t last_event_ = nullptr;
    bool has_event_ = false;
    void* ws_ptr_ = nullptr;
    Workspace ws_{};
    std::unique_ptr<cuda::DeviceOutputs> outputs_;
    std::unique_ptr<cuda::HostRecordLease> record_;
    std::unique_ptr<transport::SymmetricMemory> window_;
    std::unique_ptr<cuda::PeerWatch> watch_;
    testing::DispatchForger forger_;  // test-only fault injection, empty in every real use
    cuda::StageTimer stages_;         // ELASTICEP_STAGE_TIMES=1: per-kernel times (diagnostics)
};

}  // namespace

std::unique_ptr<BackendBuffer> make_cuda_backend(const BackendContext& ctx) {
    return std::make_unique<CudaBackend>(ctx);
}

size_t cuda_reservation_bytes(const BufferConfig& c, int num_ranks) {
    // the staged path's host-sync reservation (peers in other processes or on other GPUs: the
    // general case): the window with its message ring, the workspace and the combine output. A
    // graph-mode call adds the rest of the ring when it is shorter than C; the direct path (ranks of
    // one process on one GPU) reserves less. Buffer-owned dispatch outputs are allocated at the first
    // call of each layout, for its worst case. (docs/PERFORMANCE.md, "Memory"; `elasticep info`.)
    const kernels::Shape shape = make_shape(c, num_ranks, ring_of(c, num_ranks, kStagingBudgetBytes), false);
    return static_cast<size_t>(RegionLayout::make(shape).bytes + Workspace::carve(shape, nullptr).bytes +
                               reservation(c, num_ranks).combine_out);
}

}  // namespace elasticep::detail
