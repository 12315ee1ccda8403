// CUDA backend, hybrid topology: one network hop per destination node to the rank with the same local
// index there, then NVLink forwarding inside the node; combine reduces inside the node before the hop
// back (protocol: src/core/protocol.hpp, H1-H6; contract: docs/SEMANTICS.md). This file is the launch
// sequence; the pieces:
//   src/kernels/hybrid/layout.hpp          every byte of the NVLink window, the network area, the workspace
//   src/kernels/hybrid/{dispatch,combine}.cuh  the kernels and their launch contracts
//   src/transport/sub_group.hpp            the node and rail groups (collectives through the parent Group)
//   src/transport/symmetric_memory.hpp     the node's NVLink window (pool or CUDA IPC)
//   src/transport/scaleout/rail.hpp        the network: emulated, NCCL point-to-point, NCCL GIN
//   backends/cuda/device_outputs.hpp       caller-provided and buffer-owned outputs (as direct)
//
// One call, on the caller's stream (or the buffer's own, synchronously):
//   dispatch: plan -> header -> pack -> [network move of the other nodes' slabs -> network wait]
//             -> forward -> forward_publish -> NVLink wait -> exchange -> [host_sync: read M and the
//             status] -> expand
//   combine:  partial -> comb_publish -> NVLink wait -> [several nodes: node_reduce -> network move ->
//             network wait] -> reduce
// Waits: a one-thread kernel (bounded, on the device), or with host waits (two ranks of one process on
// one GPU, not capturing) a host poll of the same words, so no kernel ever spins on a peer whose
// kernels may not run (see cuda_backend.cu). NCCL point-to-point orders by the stream; its eager moves
// are bounded by the rail's watchdog (Rail::settle), called before anything waits for the stream.
// The epoch lives on the device (header_kernel advances it), so a captured graph replays with fresh
// epochs; NCCL moves whole slabs in graph mode and exact sizes after a count exchange with host sync.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/device_outputs.hpp"
#include "backends/cuda/host_records.hpp"
#include "backends/cuda/hybrid_launch.hpp"
#include "backends/cuda/launch_config.hpp"
#include "core/backend.hpp"
#include "core/check.hpp"
#include "core/protocol.hpp"
#include "kernels/common/cuda_check.hpp"
#include "kernels/common/device_scope.hpp"
#include "transport/device_pool.hpp"
#include "transport/scaleout/rail.hpp"
#include "transport/sub_group.hpp"
#include "transport/symmetric_memory.hpp"

namespace elasticep::detail {
namespace {

namespace hk = kernels::hybrid;
namespace so = transport::scaleout;
using cuda::hybrid::Modes;

// Host-mapped records, recycled and never freed (cudaFreeHost waits for the whole device).
class RecordLease {
 public:
    RecordLease() {
        {
            std::lock_guard<std::mutex> lock(mu());
            if (pool().empty()) {
                constexpr int kChunk = 32;
                hk::HybridRecord* chunk = nullptr;
                ELASTICEP_CUDA_CALL(cudaHostAlloc(reinterpret_cast<void**>(&chunk), kChunk * sizeof(hk::HybridRecord),
                                                  cudaHostAllocMapped | cudaHostAllocPortable));
                for (int i = kChunk - 1; i >= 0; --i) pool().push_back(chunk + i);
            }
            host_ = pool().back();
            pool().pop_back();
        }
        std::memset(static_cast<void*>(host_), 0, sizeof(*host_));
        host_->bad_sender = -1;
        const cudaError_t e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0);
        if (e != cudaSuccess) {
            give_back();
            ELASTICEP_CUDA_CALL(e);
        }
    }
    ~RecordLease() { give_back(); }
    RecordLease(const RecordLease&) = delete;
    RecordLease& operator=(const RecordLease&) = delete;
    hk::HybridRecord* host() const { return host_; }
    hk::HybridRecord* device() const { return device_; }

 private:
    static std::mutex& mu() {
        static std::mutex m;
        return m;
    }
    static std::vector<hk::HybridRecord*>& pool() {
        static std::vector<hk::HybridRecord*> p;
        return p;
    }
    void give_back() {
        if (host_ == nullptr) return;
        std::lock_guard<std::mutex> lock(mu());
        pool().push_back(host_);
        host_ = nullptr;
    }
    hk::HybridRecord* host_ = nullptr;
    hk::HybridRecord* device_ = nullptr;
};

hk::RailPayload rail_payload(const BufferConfig& c, bool prequantized) {
    if (c.payload == Payload::kBF16) return hk::RailPayload::kBF16;
    if (prequantized) return hk::RailPayload::kFP8Copy;
    switch (c.scale_format) {
        case ScaleFormat::kF32G128:
            return hk::RailPayload::kFP8F32G128;
        case ScaleFormat::kUE8M0G128:
            return hk::RailPayload::kFP8UE8M0G128;
        case ScaleFormat::kUE8M0G32:
            return hk::RailPayload::kFP8UE8M0G32;
    }
    raise(ErrorCode::kInternal, "internal: unknown scale format");
}

using cuda::timeout_ns;

hk::HybridShape make_shape(const BufferConfig& c, int num_ranks, int rank) {
    return hk::HybridShape::make(num_ranks, c.num_experts, c.num_topk, c.hidden, c.max_tokens_per_rank,
                                 c.node_size(num_ranks), rank, message_layout(c));
}

// One collective step's outcome on every rank: a rank that failed raises its own error; every other
// rank raises the first failed rank's code naming it. `step` completes "failed ...".
struct Verdict {
    int32_t ok;
    int32_t code;
    char message[480];
};

void agree(Group& group, const std::exception_ptr& mine, const char* step) {
    Verdict v{};
    v.ok = 1;
    if (mine) {
        v.ok = 0;
        v.code = static_cast<int32_t>(ErrorCode::kInternal);
        try {
            std::rethrow_exception(mine);
        } catch (const Error& e) {
            v.code = static_cast<int32_t>(e.code());
            std::snprintf(v.message, sizeof(v.message), "%s", e.message().c_str());
        } catch (const std::exception& e) {
            std::snprintf(v.message, sizeof(v.message), "%s", e.what());
        }
    }
    const auto all = group.all_gather_value(v);
    if (mine) std::rethrow_exception(mine);
    for (size_t q = 0; q < all.size(); ++q)
        if (!all[q].ok)
            raise(static_cast<ErrorCode>(all[q].code),
                  cat("hybrid buffer: rank ", q, " failed ", step, ": ",
                      std::string(all[q].message, strnlen(all[q].message, sizeof(all[q].message)))));
}

struct HybridHandle {
    bool host_sized = false;  // nccl: the combine's sizes are on the host
    so::HostSizes combine;
};

class CudaHybridBackend final : public BackendBuffer {
 public:
    explicit CudaHybridBackend(const BackendContext& ctx)
        : cfg_(ctx.config),
          rank_(ctx.rank),
          num_ranks_(ctx.num_ranks),
          e_local_(cfg_.num_experts / ctx.num_ranks),
          shape_(make_shape(cfg_, ctx.num_ranks, ctx.rank)),
          region_(hk::NodeRegion::make(shape_)),
          rail_region_(hk::RailRegion::make(shape_)) {
        std::exception_ptr failure;
        int device_sms = 1;
        try {
            ELASTICEP_CHECK(e_local_ <= kMaxLocalExperts, ErrorCode::kUnsupported, "the CUDA backend supports at most ",
                            "kMaxLocalExperts=", kMaxLocalExperts, " local experts per rank; this config has ",
                            e_local_);
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
            cuda::hybrid::load_dispatch_kernels();
            cuda::hybrid::load_combine_kernels();
            const int64_t ws_bytes = hk::HybridWorkspace::carve(shape_, nullptr).bytes;
            ws_ptr_ = transport::pool_alloc(static_cast<size_t>(ws_bytes), dev_, own_stream_);
            ELASTICEP_CUDA_CALL(cudaMemsetAsync(ws_ptr_, 0, static_cast<size_t>(ws_bytes), own_stream_));
            ws_ = hk::HybridWorkspace::carve(shape_, ws_ptr_);
            ELASTICEP_CUDA_CALL(cudaMemsetAsync(ws_.first_bad_route, 0xff, sizeof(*ws_.first_bad_route), own_stream_));
            outputs_ = std::make_unique<cuda::DeviceOutputs>(cfg_, num_ranks_, rank_, dev_, own_stream_);
            record_ = std::make_unique<RecordLease>();
            // the host waits' copies land in page-locked memory (host_records.hpp: pageable polls
            // of ranks sharing a GPU slowed each other down): the epoch line, then up to R words
            poll_ = std::make_unique<cuda::PinnedScratch>(64 + 8 * static_cast<size_t>(num_ranks_));
            ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
        } catch (...) {
            failure = std::current_exception();
        }
        try {
            Group& group = *ctx.group;
            const transport::Placement all = transport::Placement::gather(group, rank_, dev_, failure);
            launch_ = cuda::LaunchConfig::choose(cfg_, all, device_sms);
            std::vector<int> node_members, rail_members;
            for (int r = 0; r < num_ranks_; ++r) {
                if (r / shape_.node_size == shape_.node) node_members.push_back(r);
                if (r % shape_.node_size == shape_.local) rail_members.push_back(r);
            }
            node_group_ = std::make_unique<transport::SubGroup>(group, node_members, cat("node", shape_.node));
            rail_group_ = std::make_unique<transport::SubGroup>(group, rail_members, cat("rail", shape_.local));
            const transport::Placement node_where = transport::Placement::gather(*node_group_, shape_.local, dev_);
            node_mem_ = std::make_unique<transport::SymmetricMemory>(*node_group_, node_where,
                                                                     static_cast<size_t>(region_.bytes), own_stream_);
            const transport::Placement rail_where = transport::Placement::gather(*rail_group_, shape_.node, dev_);
            build_rail(group, rail_where);
        } catch (...) {
            release();
            throw;
        }
    }

    ~CudaHybridBackend() override { release(); }

    void release() noexcept {
        cudaSetDevice(dev_);
        if (own_stream_) cudaStreamSynchronize(own_stream_);
        if (has_event_ && !rail_stuck_) cudaEventSynchronize(last_event_);
        const bool timed_out = record_ && record_->host()->timeout_phase != kPhaseNone;
        if (timed_out) {  // a late peer may still write into this rank's memory: keep it (leaked)
            if (node_mem_) node_mem_->keep_local_window();
            if (rail_) rail_->keep_memory();
        }
        rail_.reset();
        node_mem_.reset();
        rail_group_.reset();
        node_group_.reset();
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

    Device device() const override { return Device{DeviceType::kCUDA, dev_}; }
    size_t reserved_bytes() const override { return cuda_hybrid_reservation_bytes(cfg_, num_ranks_); }

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
        raise_faults();
        volatile RouteStatus* s = &record_->host()->sticky;
        if (s->kind != kRouteOk) {
            const RouteStatus b{s->kind, s->token, s->k, s->dup_of, s->value, 0, 0};
            s->kind = kRouteOk;
            raise(ErrorCode::kInvalidArgument, sticky_fault_message(b, rank_, cfg_.num_experts));
        }
    }

    void dispatch(const DispatchRequest& req, HandleState& handle, DispatchResult& result) override {
        const cuda::DeviceScope device_scope(dev_);
        settle_rail();
        raise_faults();
        const DispatchArgs& a = *req.args;
        cudaStream_t stream = a.stream ? static_cast<cudaStream_t>(a.stream) : own_stream_;
        const bool fp8 = cfg_.payload == Payload::kFP8;
        const int scols = fp8 ? scale_columns(cfg_.scale_format, cfg_.hidden) : 0;
        const bool contiguous = a.layout == Layout::kExpertContiguous;
        const int64_t t_count = req.num_tokens;
        ELASTICEP_CHECK_ARG(contiguous || int64_t{e_local_} * shape_.slots() < (int64_t{1} << 31),
                            "dispatch: the masked layout has E_local * R * C = ", int64_t{e_local_} * shape_.slots(),
                            " rows, beyond int32 row indices; lower max_tokens_per_rank or use the contiguous layout");
        hk::DispatchParams p{};
        fill(p, t_count);
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
        p.host_sync = a.host_sync;
        p.zero_padding = a.zero_padding;
        p.expert_alignment = contiguous ? a.expert_alignment : 0;
        const Modes modes{rail_payload(cfg_, req.prequantized), a.topk_idx.dtype == DType::kInt64, contiguous};

        const bool capturing = is_capturing(stream);
        ELASTICEP_CHECK_ARG(!(capturing && a.host_sync),
                            "dispatch: host_sync=true cannot be captured in a CUDA graph (it reads the row count on "
                            "the host); pass host_sync=false (graph mode) while capturing");
        const cuda::DispatchTargets out = outputs_->dispatch_targets(a, req.rows_cap, capturing, stream);
        p.recv_x = out.recv_x;
        p.recv_weights = out.recv_weights;
        p.recv_src = out.recv_src;
        p.recv_scales = out.recv_scales;
        p.m_indices = out.m_indices;
        ++calls_;

        const int grid = 2 * launch_.num_sms;
        auto hh = std::make_shared<HybridHandle>();
        cuda::hybrid::launch_plan(p, modes, stream);
        cuda::hybrid::launch_header(p, modes, stream);
        cuda::hybrid::launch_pack(p, modes, grid, stream);
        if (shape_.num_nodes > 1) network_dispatch(p, stream, capturing, a.host_sync, *hh);
        cuda::hybrid::launch_forward(p, grid, stream);
        cuda::hybrid::launch_forward_publish(p, stream);
        meet(p, node_flags_wait(), stream, capturing);
        cuda::hybrid::launch_exchange(p, stream);

        int64_t rows_out = contiguous ? req.rows_cap : shape_.slots();
        if (p.host_sync) {
            settle_rail();
            ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
            raise_faults();
            const volatile hk::HybridRecord* r = record_->host();
            if (r->bad_sender >= 0) {
                const RouteStatus b{r->bad.kind, r->bad.token, r->bad.k, r->bad.dup_of, r->bad.value, r->bad.sticky, 0};
                raise(ErrorCode::kInvalidArgument, rejected_dispatch_message(b, r->bad_sender, cfg_.num_experts));
            }
            if (contiguous) rows_out = r->num_rows;
        }
        outputs_->bind_dispatch(a, out, req.rows_cap, rows_out, result);
        const Device dev = device();
        result.counts = TensorRef::contiguous(ws_.counts, DType::kInt32, {e_local_}, dev);
        if (contiguous) {
            result.offsets = TensorRef::contiguous(ws_.offsets, DType::kInt32, {e_local_ + 1}, dev);
            result.num_rows = p.host_sync ? rows_out : -1;
        } else {
            result.masked_m = result.counts;
        }
        p.num_rows_out = rows_out;
        if (fp8) {
            const auto& st = result.recv_scales->strides;
            p.scale_expert_stride = contiguous ? 0 : st[0];
            p.scale_row_stride = contiguous ? st[0] : st[1];
            p.scale_column_stride = contiguous ? st[1] : st[2];
        }
        cuda::hybrid::launch_expand(p, modes, grid, stream);
        finish(stream, a.stream == nullptr, capturing);
        if (a.stream == nullptr) raise_faults();
        handle.num_sms = launch_.num_sms;
        handle.backend_data = hh;
    }

    TensorRef combine(HandleState& handle, const CombineArgs& args) override {
        const cuda::DeviceScope device_scope(dev_);
        settle_rail();
        raise_faults();
        cudaStream_t stream = args.stream ? static_cast<cudaStream_t>(args.stream) : own_stream_;
        const int64_t t_count = handle.num_tokens;
        hk::CombineParams p{};
        fill(p, t_count);
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
        p.out = static_cast<uint16_t*>(out.data);
        p.out_row_stride = t_count > 1 ? out.stride(0) : cfg_.hidden;
        ELASTICEP_CHECK_ARG(
            reinterpret_cast<uintptr_t>(p.out) % 16 == 0 && p.out_row_stride % 8 == 0,
            "combine: out rows must be 16-byte aligned for the CUDA backend (row stride a multiple of 8)");
        const auto* hh = static_cast<const HybridHandle*>(handle.backend_data.get());
        const int grid = 2 * (handle.num_sms > 0 ? handle.num_sms : launch_.num_sms);
        const bool capturing = is_capturing(stream);
        cuda::hybrid::launch_partial(p, args.weighted, grid, stream);
        cuda::hybrid::launch_comb_publish(p, stream);
        meet(p, comb_flags_wait(), stream, capturing);
        const bool nodes = shape_.num_nodes > 1;
        if (nodes) {
            cuda::hybrid::launch_node_reduce(p, grid, stream);
            const so::RailCall call = rail_call(kPhaseCombine);
            so::HostSizes full;
            const so::HostSizes* sizes = nullptr;
            if (rail_->kind() == ScaleOut::kNccl) {
                if (hh != nullptr && hh->host_sized) {
                    sizes = &hh->combine;
                } else {
                    full.send.assign(static_cast<size_t>(shape_.num_nodes), rail_region_.comb_slab);
                    full.recv = full.send;
                    sizes = &full;
                }
            }
            rail_->send(call, stream, sizes, capturing);
            network_wait(p, call, stream, capturing);
        }
        cuda::hybrid::launch_reduce(p, p.bias != nullptr, nodes, grid, stream);
        finish(stream, args.stream == nullptr, capturing);
        if (args.stream == nullptr) raise_faults();
        return out;
    }

    std::string scaleout() const override { return scaleout_used_; }
    std::string kernel_path() const override { return "hybrid"; }

 private:
    // ---- the rail ------------------------------------------------------------------------------

    void build_rail(Group& group, const transport::Placement& rail_where) {
        const ScaleOut asked = cfg_.scaleout;
        if (shape_.num_nodes == 1) {  // nothing crosses a network: a local area only
            rail_ = so::make_emulated_rail(*rail_group_, rail_region_, dev_, own_stream_, shape_.node, shape_.local,
                                           shape_.node_size);
            scaleout_used_ = "none";
            return;
        }
        // Can NCCL run this rail? (the same answer on every rank: one all_gather)
        std::string why_not;
        if (!so::nccl_compiled())
            why_not = "this ElasticEP was built without NCCL (cmake/ElasticepNccl.cmake found none)";
        else if (rail_where.shared_gpu_in_process)
            why_not = cat("two ranks of rail ", shape_.local,
                          " (one rank per node) share a GPU inside one process, which one NCCL communicator cannot "
                          "hold (NCCL 2.28)");
        const bool want_nccl = asked == ScaleOut::kNccl || asked == ScaleOut::kGin;
        {
            std::exception_ptr cannot;
            if (!why_not.empty() && want_nccl)
                cannot = std::make_exception_ptr(
                    Error(ErrorCode::kUnsupported, cat("scaleout=", scaleout_name(asked), ": ", why_not,
                                                       "; use scaleout=emulated (one host) or one process per GPU")));
            agree(group, cannot, "to set up the network hop");
        }
        struct Able {
            int32_t ok;
        };
        bool nccl_everywhere = true;
        for (const Able& a : group.all_gather_value(Able{why_not.empty() ? 1 : 0})) nccl_everywhere &= a.ok != 0;
        // auto: NCCL where it starts on every rail (libnccl loads, the communicators form), else emulated
        std::shared_ptr<so::NcclComm> comm;
        if (asked != ScaleOut::kEmulated && nccl_everywhere) {
            std::exception_ptr f;
            try {
                // GIN's set-up takes a blocking communicator; the point-to-point rail a non-blocking one
                comm = so::make_nccl_comm(*rail_group_, dev_, asked != ScaleOut::kNccl, cfg_.timeout);
            } catch (...) {
                f = std::current_exception();
            }
            if (asked != ScaleOut::kAuto) {
                agree(group, f, "to create the rail's NCCL communicator");
            } else {
                bool everywhere = true;
                for (const Able& a : group.all_gather_value(Able{f ? 0 : 1})) everywhere &= a.ok != 0;
                if (!everywhere) comm.reset();
            }
        }
        if (comm == nullptr) {
            std::exception_ptr f;
            try {
                rail_ = so::make_emulated_rail(*rail_group_, rail_region_, dev_, own_stream_, shape_.node, shape_.local,
                                               shape_.node_size);
            } catch (...) {
                f = std::current_exception();
            }
            agree(group, f, "to map the emulated network (scaleout=emulated needs every rank on one host)");
            scaleout_used_ = "emulated";
            return;
        }
        if (asked == ScaleOut::kGin || asked == ScaleOut::kAuto) {
            std::exception_ptr f;
            std::unique_ptr<so::Rail> gin;
            try {
                gin = so::make_gin_rail(comm, rail_region_, dev_, own_stream_, shape_.node);
            } catch (...) {
                f = std::current_exception();
            }
            if (asked == ScaleOut::kGin) {
                agree(group, f, "to set up GIN on the rail");
                rail_ = std::move(gin);
                scaleout_used_ = "gin";
                return;
            }
            bool everywhere = true;
            for (const Able& a : group.all_gather_value(Able{f ? 0 : 1})) everywhere &= a.ok != 0;
            if (everywhere) {
                rail_ = std::move(gin);
                scaleout_used_ = "gin";
                return;
            }
            gin.reset();  // auto: NCCL point-to-point where GIN is not available on every rank
        }
        std::exception_ptr f;
        try {
            comm = so::nonblocking_nccl_comm(std::move(comm), *rail_group_, dev_, cfg_.timeout);  // auto after GIN
            rail_ =
                so::make_nccl_rail(comm, rail_region_, dev_, shape_.node, shape_.local, shape_.node_size, cfg_.timeout);
        } catch (...) {
            f = std::current_exception();
        }
        agree(group, f, "to set up NCCL point-to-point on the rail");
        scaleout_used_ = "nccl";
    }

    so::RailCall rail_call(int32_t phase) const {
        so::RailCall c{};
        c.epoch = ws_.epoch;
        c.send_bytes = ws_.send_bytes + (phase == kPhaseDispatch ? 0 : shape_.num_nodes);
        c.state = ws_.state;
        c.record = record_->device();
        c.timeout_ns = timeout_ns(cfg_.timeout);
        c.base = rail_->base();
        c.region = rail_region_;
        c.num_nodes = shape_.num_nodes;
        c.node = shape_.node;
        c.local = shape_.local;
        c.node_size = shape_.node_size;
        c.phase = phase;
        c.expected = calls_;
        return c;
    }

    // Dispatch's network hop: the other nodes' slabs to their rail peers, then the network wait.
    void network_dispatch(const hk::DispatchParams& p, cudaStream_t stream, bool capturing, bool host_sync,
                          HybridHandle& hh) {
        const so::RailCall call = rail_call(kPhaseDispatch);
        const size_t n = static_cast<size_t>(shape_.num_nodes);
        if (rail_->kind() != ScaleOut::kNccl) {
            rail_->send(call, stream, nullptr, capturing);
            network_wait(p, call, stream, capturing);
            return;
        }
        if (!host_sync) {  // graph mode: whole slabs both ways, no host read
            so::HostSizes full;
            full.send.assign(n, rail_region_.disp_slab);
            full.recv = full.send;
            rail_->send(call, stream, &full, capturing);
            return;
        }
        // host sync: the headers first, then exactly the announced messages
        so::HostSizes heads;
        heads.send.assign(n, shape_.header_bytes);
        heads.recv = heads.send;
        rail_->send(call, stream, &heads, capturing);
        settle_rail();
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
        std::vector<hk::RailHeader> in(n);
        std::vector<int32_t> out_count(n);
        uint64_t epoch = 0;
        ELASTICEP_CUDA_CALL(cudaMemcpyAsync(&epoch, ws_.epoch, sizeof(epoch), cudaMemcpyDeviceToHost, own_stream_));
        ELASTICEP_CUDA_CALL(
            cudaMemcpyAsync(out_count.data(), ws_.node_count, n * 4, cudaMemcpyDeviceToHost, own_stream_));
        for (size_t q = 0; q < n; ++q)
            ELASTICEP_CUDA_CALL(
                cudaMemcpyAsync(&in[q], rail_->base() + rail_region_.recv_slab(kPhaseDispatch, static_cast<int>(q)),
                                sizeof(hk::RailHeader), cudaMemcpyDeviceToHost, own_stream_));
        hk::RouteStatus own{};
        ELASTICEP_CUDA_CALL(cudaMemcpyAsync(&own, ws_.route_status, sizeof(own), cudaMemcpyDeviceToHost, own_stream_));
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
        so::HostSizes body;
        body.offset = shape_.header_bytes;
        body.send.assign(n, 0);
        body.recv.assign(n, 0);
        hh.host_sized = true;
        hh.combine.send.assign(n, 0);
        hh.combine.recv.assign(n, 0);
        for (size_t q = 0; q < n; ++q) {
            if (static_cast<int>(q) == shape_.node) continue;
            const int sender = shape_.rail_rank(static_cast<int>(q));
            const int64_t c = in[q].count;
            ELASTICEP_CHECK(
                in[q].epoch == epoch && c >= 0 && c <= cfg_.max_tokens_per_rank, ErrorCode::kInternal,
                peer_fault_message(
                    PeerFault{in[q].epoch != epoch ? kPeerEpoch : kPeerCount, sender, kPhaseDispatch, 0,
                              in[q].epoch != epoch ? static_cast<int64_t>(in[q].epoch) : c,
                              in[q].epoch != epoch ? static_cast<int64_t>(epoch) : cfg_.max_tokens_per_rank},
                    rank_));
            const int64_t out_msgs = own.any() ? 0 : out_count[q];
            body.send[q] = out_msgs * shape_.rail_msg_bytes;
            body.recv[q] = (in[q].status.any() ? 0 : c) * shape_.rail_msg_bytes;
            hh.combine.send[q] = (in[q].status.any() ? 0 : c) * shape_.hidden * 2;
            hh.combine.recv[q] = out_msgs * shape_.hidden * 2;
        }
        rail_->send(call, stream, &body, capturing);
    }

    void network_wait(const hk::Params& p, const so::RailCall& call, cudaStream_t stream, bool capturing) {
        switch (rail_->kind()) {
            case ScaleOut::kEmulated: {
                hk::WaitSpec w{};
                w.base = rail_->base();
                w.offset = rail_region_.signal(call.phase, 0);
                w.stride = 8;
                w.count = shape_.num_nodes;
                w.skip = shape_.node;
                w.first_rank = shape_.local;
                w.rank_stride = shape_.node_size;
                w.phase = call.phase;
                w.hop = kHopNetwork;
                meet(p, w, stream, capturing);
                return;
            }
            case ScaleOut::kGin:
                rail_->device_wait(call, stream);
                return;
            default:
                return;  // nccl: stream order (its watchdog bounds eager calls)
        }
    }

    void settle_rail() {
        if (!rail_) return;
        try {
            rail_->settle(calls_);
        } catch (const Error& e) {
            if (e.code() == ErrorCode::kTimeout) {
                rail_stuck_ = true;
                hk::HybridRecord* r = record_->host();
                if (r->timeout_phase == kPhaseNone) r->timeout_phase = kPhaseDispatch;  // the buffer is done
            }
            throw;
        }
    }

    // ---- the NVLink side -------------------------------------------------------------------------

    hk::WaitSpec node_flags_wait() const {
        hk::WaitSpec w{};
        w.base = node_mem_->local();
        w.offset = region_.flags;
        w.stride = 2 * static_cast<int64_t>(sizeof(hk::NodeFlag));
        w.parity_stride = sizeof(hk::NodeFlag);
        w.count = num_ranks_;
        w.skip = -1;
        w.first_rank = 0;
        w.rank_stride = 1;
        w.phase = kPhaseDispatch;
        w.hop = kHopNvlink;
        return w;
    }

    hk::WaitSpec comb_flags_wait() const {
        hk::WaitSpec w{};
        w.base = node_mem_->local();
        w.offset = region_.comb_flags;
        w.stride = 8;
        w.count = shape_.node_size;
        w.skip = -1;
        w.first_rank = shape_.node * shape_.node_size;
        w.rank_stride = 1;
        w.phase = kPhaseCombine;
        w.hop = kHopNvlink;
        return w;
    }

    // A wait: on the device, or (host waits, not capturing) a host poll of the same words.
    void meet(const hk::Params& p, const hk::WaitSpec& w, cudaStream_t stream, bool capturing) {
        if (!launch_.host_waits || capturing) {
            cuda::hybrid::launch_wait(p, w, stream);
            return;
        }
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
        uint64_t epoch = 0;
        int32_t dead = 0;
        poll_->read_call_state(ws_.epoch, &ws_.state->timed_out, own_stream_, epoch, dead);
        if (dead) return;  // an earlier wait expired: the kernels do nothing, raise_faults reports it
        const int64_t parity = static_cast<int64_t>(epoch & 1) * w.parity_stride;
        ELASTICEP_INTERNAL(w.count >= 0 && w.count <= num_ranks_, "hybrid host wait over ", w.count, " words");
        std::vector<uint64_t> words(static_cast<size_t>(w.count));
        auto* landed = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(poll_->data()) + 64);
        const auto start = std::chrono::steady_clock::now();
        for (int spins = 0;; ++spins) {
            ELASTICEP_CUDA_CALL(cudaMemcpy2DAsync(landed, 8, w.base + w.offset + parity, static_cast<size_t>(w.stride),
                                                  8, static_cast<size_t>(w.count), cudaMemcpyDeviceToHost,
                                                  own_stream_));
            ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
            std::memcpy(words.data(), landed, words.size() * sizeof(uint64_t));
            MissingPeers m{};
            m.observed = epoch;
            for (int i = 0; i < w.count; ++i) {
                if (i == w.skip || words[static_cast<size_t>(i)] >= epoch) continue;
                if (m.count < kMaxNamedPeers) m.named[m.count] = w.first_rank + i * w.rank_stride;
                ++m.count;
                m.observed = std::min(m.observed, words[static_cast<size_t>(i)]);
            }
            if (m.count == 0) return;
            if (std::chrono::steady_clock::now() - start > cfg_.timeout) {
                hk::HybridRecord* r = record_->host();
                if (r->timeout_phase == kPhaseNone) {
                    r->timeout_expected = epoch;
                    r->timeout_missing = m;
                    r->timeout_hop = w.hop;
                    reinterpret_cast<volatile int32_t*>(&r->timeout_phase)[0] = w.phase;
                }
                raise_faults();
            }
            if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }

    // ---- common --------------------------------------------------------------------------------

    template <class P>
    void fill(P& p, int64_t num_tokens) const {
        p.node = transport::NvlinkTeam{node_mem_->nvlink_windows()};
        p.shape = shape_;
        p.region = region_;
        p.rail = rail_region_;
        p.rail_base = rail_->base();
        p.ws = ws_;
        p.record = record_->device();
        p.timeout_ns = timeout_ns(cfg_.timeout);
        p.num_tokens = static_cast<int32_t>(num_tokens);
    }

    void raise_faults() {
        const volatile hk::HybridRecord* r = record_->host();
        if (r->timeout_phase != kPhaseNone) {
            const MissingPeers missing = const_cast<const MissingPeers&>(r->timeout_missing);
            if (missing.count > 0)
                raise(ErrorCode::kTimeout,
                      hybrid_timeout_message(r->timeout_phase, r->timeout_hop, rank_, cfg_.timeout.count(), missing,
                                             r->timeout_expected, shape_.node_size));
            raise(ErrorCode::kTimeout, "this hybrid buffer timed out on the network hop earlier; rebuild it");
        }
        const volatile PeerFault* f = &r->peer_fault;
        if (f->kind != kPeerOk) {
            const PeerFault fault{f->kind, f->sender, f->phase, 0, f->value, f->limit};
            raise(ErrorCode::kInternal, peer_fault_message(fault, rank_));
        }
    }

    static bool is_capturing(cudaStream_t stream) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        ELASTICEP_CUDA_CALL(cudaStreamIsCapturing(stream, &capture));
        return capture != cudaStreamCaptureStatusNone;
    }

    void finish(cudaStream_t stream, bool synchronous, bool capturing) {
        if (capturing) return;
        ELASTICEP_CUDA_CALL(cudaEventRecord(last_event_, stream));
        has_event_ = true;
        // An eager call leaves no rail transfer pending: the next call may be captured, and a capture
        // forbids the event query of the rail's watchdog (device run 2026-12-01: "operation not
        // permitted when stream is capturing" at the first captured call after eager ones).
        settle_rail();
        if (synchronous) ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
    }

    void sync_last() {
        settle_rail();
        if (has_event_) ELASTICEP_CUDA_CALL(cudaEventSynchronize(last_event_));
    }

    BufferConfig cfg_;
    int rank_, num_ranks_, e_local_;
    hk::HybridShape shape_;
    hk::NodeRegion region_;
    hk::RailRegion rail_region_;
    int dev_ = 0;
    cuda::LaunchConfig launch_;
    cudaStream_t own_stream_ = nullptr;
    cudaEvent_t last_event_ = nullptr;
    bool has_event_ = false;
    bool rail_stuck_ = false;
    uint64_t calls_ = 0;
    void* ws_ptr_ = nullptr;
    hk::HybridWorkspace ws_{};
    std::unique_ptr<cuda::DeviceOutputs> outputs_;
    std::unique_ptr<RecordLease> record_;
    std::unique_ptr<cuda::PinnedScratch> poll_;
    std::unique_ptr<transport::SubGroup> node_group_, rail_group_;
    std::unique_ptr<transport::SymmetricMemory> node_mem_;
    std::unique_ptr<so::Rail> rail_;
    const char* scaleout_used_ = "?";
};

}  // namespace

std::unique_ptr<BackendBuffer> make_cuda_hybrid_backend(const BackendContext& ctx) {
    return std::make_unique<CudaHybridBackend>(ctx);
}

size_t cuda_hybrid_reservation_bytes(const BufferConfig& c, int num_ranks) {
    // the node window, the network area, the workspace and the combine output
    const hk::HybridShape shape = make_shape(c, num_ranks, 0);
    return static_cast<size_t>(hk::NodeRegion::make(shape).bytes + hk::RailRegion::make(shape).bytes +
                               hk::HybridWorkspace::carve(shape, nullptr).bytes +
                               reservation(c, num_ranks).combine_out);
}

}  // namespace elasticep::detail
