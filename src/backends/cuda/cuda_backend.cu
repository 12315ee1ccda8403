// CUDA intranode backend, direct topology: every rank writes straight into every peer's receive
// region (same-process pointers, peer access between GPUs, or CUDA IPC between processes).
// The protocol is the CPU backend's (src/backends/cpu/cpu_backend.cpp), so results are the same
// bytes; src/kernels/intranode/*.cuh hold the kernels and their index contracts.
//
// One call, on the caller's stream (or the buffer's own non-blocking stream, synchronously):
//   dispatch: plan -> send -> exchange (publish + bounded wait) -> [host_sync: D2H read of M and
//             the status word] -> expand.  Graph mode reads nothing on the host.
//   combine:  partial (holder writes into origin) -> publish (bounded wait) -> reduce (origin).
// The epoch lives on the device, so a captured graph replays with fresh epochs.
// stream == nullptr: the call runs on the buffer's own non-blocking stream and synchronises it
// before returning. Buffer-owned outputs are allocated (stream-ordered) at the first call of each
// layout shape: warm up before capturing a graph. Ranks in other processes map each other's region
// through CUDA IPC handles exchanged by the Group (tests/mpi/test_mpi_cuda.cpp, the Python
// one-process-per-GPU test).
//
// Several ranks on one GPU (threads of one process, the development setup): a kernel that waits for
// a peer on the device relies on the peer's kernels running at the same time, which CUDA does not
// promise (streams share CUDA_DEVICE_MAX_CONNECTIONS hardware queues; compute-sanitizer runs kernels
// one at a time). Measured on an H200: with 4-8 ranks on one GPU about one matrix run in three timed
// out at the first call of some buffer, the late rank's kernels starting only after its peers' waits
// gave up. So when any GPU holds two ranks of one process, every rank of the group waits on the host
// instead (kernels::SyncMode): publish, synchronise, poll the flags (bounded), then go on. Capturing
// a graph keeps the device waits (the host cannot wait inside a graph): such replays are for tests,
// with CUDA_DEVICE_MAX_CONNECTIONS=32. ELASTICEP_SHARED_GPU_DEVICE_WAITS=1 keeps the device waits
// (benchmarks of the kernels on one GPU). One rank per GPU always waits on the device.
// No rank may make a call that waits for the whole device (cudaFree, cudaFreeHost,
// cudaDeviceEnablePeerAccess; tests/gpu/probe_blocking.cu measures which calls do) while a peer's
// kernel may wait for it. So this backend frees with cudaFreeAsync, takes its host-mapped records
// from a process-wide pool that is never freed, allocates the receive region of same-process ranks
// from a stream-ordered pool, and makes every other such call before its last collective.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/check.hpp"
#include "core/layout.hpp"
#include "core/outputs.hpp"
#include "core/protocol.hpp"
#include "core/routing.hpp"
#include "backends/cuda/kernel_launch.hpp"
#include "kernels/common/cuda_check.hpp"
#include "core/numerics.hpp"
#include "kernels/common/primitives.cuh"
#include "transport/device_pool.hpp"
#include "transport/symmetric_memory.hpp"

namespace elasticep::detail {

bool cuda_backend_ready() { return true; }

namespace {

using kernels::HostRecord;
using kernels::RegionLayout;
using kernels::RouteStatus;
using kernels::Workspace;
using transport::GrowingBlock;
using transport::pool_alloc;


kernels::Shape make_shape(const BufferConfig& c, int num_ranks) {
    kernels::Shape s{};
    s.num_ranks = num_ranks;
    s.num_experts = c.num_experts;
    s.num_local_experts = c.num_experts / num_ranks;
    s.num_topk = c.num_topk;
    s.hidden = c.hidden;
    s.capacity = c.max_tokens_per_rank;
    s.msg = message_layout(c);
    return s;
}

// Host-mapped records, recycled and never freed: cudaFreeHost waits for the whole device.
class HostRecordPool {
   public:
    static HostRecord* acquire() {
        std::lock_guard<std::mutex> lock(mu());
        auto& free = list();
        if (free.empty()) {
            constexpr int kChunk = 64;
            HostRecord* chunk = nullptr;
            ELASTICEP_CUDA_CALL(cudaHostAlloc(reinterpret_cast<void**>(&chunk), kChunk * sizeof(HostRecord),
                                              cudaHostAllocMapped | cudaHostAllocPortable));
            for (int i = kChunk - 1; i >= 0; --i) free.push_back(chunk + i);
        }
        HostRecord* r = free.back();
        free.pop_back();
        std::memset(static_cast<void*>(r), 0, sizeof(HostRecord));
        return r;
    }
    static void release(HostRecord* r) {
        std::lock_guard<std::mutex> lock(mu());
        list().push_back(r);
    }

   private:
    static std::mutex& mu() {
        static std::mutex m;
        return m;
    }
    static std::vector<HostRecord*>& list() {
        static std::vector<HostRecord*> l;
        return l;
    }
};

// Warns on stderr when a host-side CUDA call of the protocol took long: with several ranks on one
// GPU that is the sign of a call that waited for a peer's kernel (see the header comment).
class SlowCallWatch {
   public:
    SlowCallWatch(const char* what, int rank) : what_(what), rank_(rank), t0_(std::chrono::steady_clock::now()) {}
    ~SlowCallWatch() {
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0_).count();
        if (ms >= 1000)
            std::fprintf(stderr, "[elasticep] rank %d: %s took %lld ms (did it wait for a peer's kernel?)\n", rank_,
                         what_, static_cast<long long>(ms));
    }

   private:
    const char* what_;
    int rank_;
    std::chrono::steady_clock::time_point t0_;
};

class CudaBackend final : public BackendBuffer {
   public:
    explicit CudaBackend(const BackendContext& ctx)
        : cfg_(ctx.config), rank_(ctx.rank), num_ranks_(ctx.num_ranks), e_local_(cfg_.num_experts / ctx.num_ranks) {
        ELASTICEP_CHECK(e_local_ <= kMaxLocalExperts, ErrorCode::kUnsupported, "the CUDA backend supports at most ",
                        "kMaxLocalExperts=", kMaxLocalExperts, " local experts per rank; this config has ", e_local_);
        if (cfg_.device >= 0) {
            dev_ = cfg_.device;
        } else {
            ELASTICEP_CUDA_CALL(cudaGetDevice(&dev_));
        }
        ELASTICEP_CUDA_CALL(cudaSetDevice(dev_));
        cudaDeviceProp prop{};
        ELASTICEP_CUDA_CALL(cudaGetDeviceProperties(&prop, dev_));
        device_sms_ = prop.multiProcessorCount;
        shape_ = make_shape(cfg_, num_ranks_);
        region_ = RegionLayout::make(shape_);
        const int64_t ws_bytes = Workspace::carve(shape_, nullptr).bytes;

        ELASTICEP_CUDA_CALL(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
        ELASTICEP_CUDA_CALL(cudaEventCreateWithFlags(&last_event_, cudaEventDisableTiming));
        // Everything that may wait for the device happens before the first collective: once a peer
        // passes the last one (the front end's), it may launch kernels that wait for this rank.
        // load every kernel now: lazy loading mid-protocol could stall a context while peers spin
        cuda::load_dispatch_kernels();
        cuda::load_combine_kernels();
        ws_ptr_ = pool_alloc(static_cast<size_t>(ws_bytes), dev_, own_stream_);
        ELASTICEP_CUDA_CALL(cudaMemsetAsync(ws_ptr_, 0, static_cast<size_t>(ws_bytes), own_stream_));
        out_ptr_ = pool_alloc(static_cast<size_t>(cfg_.max_tokens_per_rank) * static_cast<size_t>(cfg_.hidden) * 2,
                              dev_, own_stream_);
        rec_ = HostRecordPool::acquire();
        ELASTICEP_CUDA_CALL(cudaHostGetDevicePointer(reinterpret_cast<void**>(&rec_dev_), rec_, 0));

        // who is where, then the symmetric receive region of every rank (src/transport)
        where_ = transport::Placement::gather(*ctx.group, rank_, dev_);
        ranks_on_gpu_ = where_.ranks_on_my_gpu;
        remote_gpu_ = where_.remote_gpu;
        // the same decision on every rank: does any GPU hold two ranks of one process?
        host_waits_ = where_.shared_gpu_in_process;
        if (const char* v = std::getenv("ELASTICEP_SHARED_GPU_DEVICE_WAITS"); v && std::string(v) == "1") host_waits_ = false;
        region_mem_ = std::make_unique<transport::SymmetricMemory>(*ctx.group, where_, static_cast<size_t>(region_.bytes),
                                                                   own_stream_);
        ws_ = Workspace::carve(shape_, ws_ptr_);
        ELASTICEP_CUDA_CALL(cudaMemsetAsync(ws_.first_bad_route, 0xff, sizeof(*ws_.first_bad_route), own_stream_));
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));

        // SM count: explicit, or a bandwidth model of the link
        if (cfg_.num_sms > 0) num_sms_ = std::min(cfg_.num_sms, device_sms_);
        else if (ranks_on_gpu_ > 1) num_sms_ = std::max(1, device_sms_ / ranks_on_gpu_);  // HBM shared by R ranks
        else if (remote_gpu_) num_sms_ = std::min(24, device_sms_);  // NVLink: ~24 SMs saturate the link
        else num_sms_ = device_sms_;
    }

    ~CudaBackend() override {
        // Nothing here waits for the whole device (see the header comment): peers of this process
        // may already run kernels of their next buffer.
        cudaSetDevice(dev_);
        cudaStreamSynchronize(own_stream_);
        if (has_event_) cudaEventSynchronize(last_event_);
        // after a timeout a late peer may still write into this rank's region: keep it (leaked)
        const bool timed_out = rec_ && rec_->timeout_phase != kernels::kPhaseNone;
        if (region_mem_ && timed_out) region_mem_->keep_local_window();
        region_mem_.reset();
        for (void* p : graveyard_) cudaFreeAsync(p, own_stream_);
        for (GrowingBlock* s : {&x_st_, &sc_st_, &w_st_, &src_st_, &mi_st_})
            if (s->ptr) cudaFreeAsync(s->ptr, own_stream_);
        if (out_ptr_) cudaFreeAsync(out_ptr_, own_stream_);
        if (ws_ptr_) cudaFreeAsync(ws_ptr_, own_stream_);
        if (rec_) HostRecordPool::release(rec_);
        cudaEventDestroy(last_event_);
        cudaStreamDestroy(own_stream_);
        cudaGetLastError();
    }

    Device device() const override { return Device{DeviceType::kCUDA, dev_}; }
    size_t reserved_bytes() const override { return cuda_reservation_bytes(cfg_, num_ranks_); }

    std::vector<int64_t> expert_load() override {
        ELASTICEP_CUDA_CALL(cudaSetDevice(dev_));
        sync_last();
        std::vector<int64_t> v(static_cast<size_t>(e_local_));
        ELASTICEP_CUDA_CALL(cudaMemcpy(v.data(), ws_.expert_load, v.size() * 8, cudaMemcpyDeviceToHost));
        return v;
    }
    void reset_expert_load() override {
        ELASTICEP_CUDA_CALL(cudaSetDevice(dev_));
        sync_last();
        ELASTICEP_CUDA_CALL(cudaMemset(ws_.expert_load, 0, static_cast<size_t>(e_local_) * 8));
    }

    void check() override {
        ELASTICEP_CUDA_CALL(cudaSetDevice(dev_));
        sync_last();
        raise_timeout();
        volatile RouteStatus* s = &rec_->sticky;
        if (s->kind != 0) {
            const RouteStatus b{s->kind, s->token, s->k, s->dup_of, s->value, 0, 0};
            s->kind = 0;
            raise(ErrorCode::kInvalidArgument, sticky_fault_message(b, rank_, cfg_.num_experts));
        }
    }

    void dispatch(const DispatchRequest& req, HandleState& handle, DispatchResult& result) override {
        ELASTICEP_CUDA_CALL(cudaSetDevice(dev_));
        raise_timeout();
        const DispatchArgs& a = *req.args;
        cudaStream_t stream = a.stream ? static_cast<cudaStream_t>(a.stream) : own_stream_;
        const bool fp8 = cfg_.payload == Payload::kFP8;
        const int scols = fp8 ? scale_columns(cfg_.scale_format, cfg_.hidden) : 0;
        const bool contiguous = a.layout == Layout::kExpertContiguous;
        const int64_t rc = int64_t{num_ranks_} * cfg_.max_tokens_per_rank;
        const int64_t t_count = req.num_tokens;

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
        cuda::DispatchModes modes{};
        modes.payload = !fp8                ? kernels::SendPayload::kBF16
                        : req.prequantized  ? kernels::SendPayload::kFP8Copy
                        : cfg_.scale_format == ScaleFormat::kF32G128   ? kernels::SendPayload::kFP8F32G128
                        : cfg_.scale_format == ScaleFormat::kUE8M0G128 ? kernels::SendPayload::kFP8UE8M0G128
                                                                       : kernels::SendPayload::kFP8UE8M0G32;
        modes.idx64 = a.topk_idx.dtype == DType::kInt64;
        modes.contiguous = contiguous;

        const bool capturing = is_capturing(stream);
        ELASTICEP_CHECK_ARG(!(capturing && a.host_sync), "dispatch: host_sync=true cannot be captured in a CUDA graph "
                            "(it reads the row count on the host); pass host_sync=false (graph mode) while capturing");

        // outputs: caller-provided (fixed worst-case shape) or buffer-owned (sized for the worst case)
        const auto cap_specs = dispatch_output_specs(cfg_, num_ranks_, a.layout, req.rows_cap, a.scales_mn_major);
        auto ptr_of = [&](const std::optional<TensorRef>& given, const OutputSpec& cap, GrowingBlock& st) -> void* {
            if (given) {
                ELASTICEP_CHECK_ARG(reinterpret_cast<uintptr_t>(given->data) % 16 == 0,
                                    "caller-provided dispatch output at ", given->data,
                                    " must be 16-byte aligned for the CUDA backend");
                return given->data;
            }
            const size_t need = static_cast<size_t>(cap.storage_elems) * dtype_size(cap.dtype);
            if (need > st.bytes) {
                ELASTICEP_CHECK_ARG(!capturing, "dispatch: the first call with this layout (", layout_name(a.layout),
                                    ", expert_alignment ", a.expert_alignment, ") allocates the buffer-owned "
                                    "outputs and cannot be captured; run it once before capturing the graph");
                SlowCallWatch watch("allocating buffer-owned dispatch outputs", rank_);
                st.reserve(need, dev_, stream, graveyard_);
            }
            return st.ptr;
        };
        void* rx = ptr_of(a.outputs.recv_x, cap_specs.recv_x, x_st_);
        void* rw = ptr_of(a.outputs.recv_weights, cap_specs.recv_weights, w_st_);
        void* rs = ptr_of(a.outputs.recv_src, cap_specs.recv_src, src_st_);
        void* rsc = fp8 ? ptr_of(a.outputs.recv_scales, *cap_specs.recv_scales, sc_st_) : nullptr;
        void* mi = contiguous ? ptr_of(a.outputs.m_indices, *cap_specs.m_indices, mi_st_) : nullptr;
        p.recv_x = static_cast<uint8_t*>(rx);
        p.recv_weights = static_cast<float*>(rw);
        p.recv_src = static_cast<int32_t*>(rs);
        p.recv_scales = static_cast<uint32_t*>(rsc);
        p.m_indices = static_cast<int32_t*>(mi);

        const int grid = 2 * num_sms_;
        cuda::launch_plan(p, modes, stream);
        cuda::launch_send(p, modes, grid, stream);
        meet_peers([&] { cuda::launch_exchange(p, modes, stream); }, p, stream, capturing, kernels::kPhaseDispatch);

        int64_t rows_out = contiguous ? req.rows_cap : rc;
        if (p.host_sync) {
            ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
            raise_timeout();
            const volatile HostRecord* r = rec_;
            if (r->bad_sender >= 0) {
                const RouteStatus b{r->bad.kind, r->bad.token, r->bad.k, r->bad.dup_of, r->bad.value, r->bad.sticky, 0};
                raise(ErrorCode::kInvalidArgument, rejected_dispatch_message(b, r->bad_sender, cfg_.num_experts));
            }
            if (contiguous) rows_out = r->num_rows;
        }
        const auto specs = dispatch_output_specs(cfg_, num_ranks_, a.layout, rows_out, a.scales_mn_major);
        const Device dev = device();
        auto bind = [&](const std::optional<TensorRef>& given, const OutputSpec& cap, const OutputSpec& spec, void* ptr) {
            TensorRef t = spec.bind(ptr, dev);
            if (given) t.strides = cap.strides;
            return t;
        };
        result.recv_x = bind(a.outputs.recv_x, cap_specs.recv_x, specs.recv_x, rx);
        result.recv_weights = bind(a.outputs.recv_weights, cap_specs.recv_weights, specs.recv_weights, rw);
        result.recv_src = bind(a.outputs.recv_src, cap_specs.recv_src, specs.recv_src, rs);
        if (fp8) result.recv_scales = bind(a.outputs.recv_scales, *cap_specs.recv_scales, *specs.recv_scales, rsc);
        if (contiguous) result.m_indices = bind(a.outputs.m_indices, *cap_specs.m_indices, *specs.m_indices, mi);
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
            p.recv_scale_strides = contiguous ? kernels::ScaleStrides{0, st[0], st[1]}
                                              : kernels::ScaleStrides{st[0], st[1], st[2]};
        }
        cuda::launch_expand(p, modes, grid, stream);
        finish(stream, a.stream == nullptr, capturing);
        handle.num_sms = num_sms_;
        handle.backend_data = nullptr;
    }

    TensorRef combine(HandleState& handle, const CombineArgs& args) override {
        ELASTICEP_CUDA_CALL(cudaSetDevice(dev_));
        raise_timeout();
        cudaStream_t stream = args.stream ? static_cast<cudaStream_t>(args.stream) : own_stream_;
        const int64_t t_count = handle.num_tokens;
        cuda::CombineParams p{};
        fill_common(p, t_count);
        p.y = static_cast<const uint16_t*>(args.y.data);
        ELASTICEP_CHECK_ARG(reinterpret_cast<uintptr_t>(args.y.data) % 16 == 0, "combine: y must be 16-byte aligned for "
                            "the CUDA backend");
        if (args.bias) {
            p.bias = static_cast<const uint16_t*>(args.bias->data);
            p.bias_row_stride = t_count > 1 ? args.bias->stride(0) : cfg_.hidden;
            ELASTICEP_CHECK_ARG(reinterpret_cast<uintptr_t>(p.bias) % 16 == 0 && p.bias_row_stride % 8 == 0,
                                "combine: bias rows must be 16-byte aligned for the CUDA backend (row stride a "
                                "multiple of 8)");
        }
        TensorRef out = args.out ? *args.out
                                 : TensorRef::contiguous(out_ptr_, DType::kBFloat16, {t_count, cfg_.hidden}, device());
        p.out = static_cast<uint16_t*>(out.data);
        p.out_row_stride = t_count > 1 ? out.stride(0) : cfg_.hidden;
        ELASTICEP_CHECK_ARG(reinterpret_cast<uintptr_t>(p.out) % 16 == 0 && p.out_row_stride % 8 == 0,
                            "combine: out rows must be 16-byte aligned for the CUDA backend (row stride a multiple of 8)");
        const int sms = handle.num_sms > 0 ? handle.num_sms : num_sms_;
        cuda::launch_partial(p, args.weighted, 2 * sms, stream);
        const bool capturing = is_capturing(stream);
        meet_peers([&] { cuda::launch_publish(p, stream); }, p, stream, capturing, kernels::kPhaseCombine);
        cuda::launch_reduce(p, p.bias != nullptr, 2 * sms, stream);
        finish(stream, args.stream == nullptr, capturing);
        if (args.stream == nullptr) raise_timeout();
        return out;
    }

   private:
    void fill_common(kernels::CallParams<cuda::Team>& p, int64_t num_tokens) const {
        p.team = transport::NvlinkTeam{region_mem_->nvlink_windows()};
        p.shape = shape_;
        p.region = region_;
        p.ws = ws_;
        p.record = rec_dev_;
        p.timeout_ns = static_cast<uint64_t>(cfg_.timeout.count()) * 1000000ull;
        p.sync_mode = kernels::kDevice;
        p.num_tokens = static_cast<int>(num_tokens);
    }

    static bool is_capturing(cudaStream_t stream) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        ELASTICEP_CUDA_CALL(cudaStreamIsCapturing(stream, &capture));
        return capture != cudaStreamCaptureStatusNone;
    }

    // Launches the one-block kernel that publishes this rank's epoch and waits for the peers'.
    // With host waits (kernels::SyncMode; never inside a capture) it runs twice: publish only, the
    // host waits on the flags, then a wait-only launch that finds them set. `launch` launches the
    // kernel with `p` as it is at the time of the call.
    template <class Launch>
    void meet_peers(Launch&& launch, kernels::CallParams<cuda::Team>& p, cudaStream_t stream, bool capturing,
                    int32_t phase) {
        if (host_waits_ && !capturing) {
            p.sync_mode = kernels::kPublishOnly;
            launch();
            host_wait(stream, phase);
            p.sync_mode = kernels::kWaitOnly;
        }
        launch();
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

    void raise_timeout() {
        const volatile HostRecord* r = rec_;
        if (r->timeout_phase == kernels::kPhaseNone) return;
        const MissingPeers missing = const_cast<const MissingPeers&>(r->timeout_missing);
        raise(ErrorCode::kTimeout, timeout_message(r->timeout_phase, rank_, cfg_.timeout.count(), missing,
                                                   r->timeout_expected) + ". " + diagnose());
    }

    // Ranks of one process sharing a GPU (kernels::SyncMode): after this rank's publish has run,
    // waits on the host for every peer's epoch in this rank's region, bounded by the timeout. Reads
    // go through the buffer's own non-blocking stream, which no peer's kernel waits on.
    void host_wait(cudaStream_t stream, int32_t phase) {
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(stream));
        uint64_t dev_epoch = 0;
        int32_t aborted = 0;
        ELASTICEP_CUDA_CALL(cudaMemcpyAsync(&dev_epoch, ws_.epoch, 8, cudaMemcpyDeviceToHost, own_stream_));
        ELASTICEP_CUDA_CALL(
            cudaMemcpyAsync(&aborted, &ws_.state->timed_out, sizeof(aborted), cudaMemcpyDeviceToHost, own_stream_));
        ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
        if (phase == kernels::kPhaseCombine && aborted) return;  // the dispatch timed out: nothing was published
        const uint64_t epoch = phase == kernels::kPhaseDispatch ? dev_epoch + 1 : dev_epoch;
        const size_t r = static_cast<size_t>(num_ranks_);
        const uint8_t* base = region_mem_->local();
        std::vector<kernels::DispatchFlag> disp(phase == kernels::kPhaseDispatch ? 2 * r : 0);
        std::vector<uint64_t> comb(phase == kernels::kPhaseCombine ? r : 0);
        const auto start = std::chrono::steady_clock::now();
        for (int spins = 0;; ++spins) {
            if (phase == kernels::kPhaseDispatch)
                ELASTICEP_CUDA_CALL(cudaMemcpyAsync(disp.data(), base + region_.dispatch_flags, disp.size() * sizeof(disp[0]),
                                                    cudaMemcpyDeviceToHost, own_stream_));
            else
                ELASTICEP_CUDA_CALL(cudaMemcpyAsync(comb.data(), base + region_.combine_flags, r * 8, cudaMemcpyDeviceToHost,
                                                    own_stream_));
            ELASTICEP_CUDA_CALL(cudaStreamSynchronize(own_stream_));
            const MissingPeers missing = scan_missing(
                [&](int q) {
                    const size_t i = static_cast<size_t>(q);
                    return phase == kernels::kPhaseDispatch ? disp[2 * i + (epoch & 1)].epoch : comb[i];
                },
                num_ranks_, epoch);
            if (missing.count == 0) return;
            if (std::chrono::steady_clock::now() - start > cfg_.timeout) {
                HostRecord* rec = rec_;
                rec->timeout_missing = missing;
                rec->timeout_expected = epoch;
                *reinterpret_cast<volatile int32_t*>(&rec->timeout_phase) = phase;
                raise_timeout();
            }
            if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }

    // What this rank sees after a timeout (the waiting kernel has left): whether the device copy of
    // the peer table is intact, and every sender's flags in this rank's region. Reads on the legacy
    // stream, which does not wait for the ranks' non-blocking streams.
    std::string diagnose() {
        const size_t r = static_cast<size_t>(num_ranks_);
        std::vector<uint8_t*> table(r);
        std::vector<kernels::DispatchFlag> disp(2 * r);
        std::vector<uint64_t> comb(r);
        const uint8_t* base = region_mem_->local();
        const std::vector<uint8_t*>& windows = region_mem_->windows();
        if (cudaMemcpy(table.data(), region_mem_->device_windows(), r * sizeof(uint8_t*), cudaMemcpyDeviceToHost) !=
                cudaSuccess ||
            cudaMemcpy(disp.data(), base + region_.dispatch_flags, disp.size() * sizeof(kernels::DispatchFlag),
                       cudaMemcpyDeviceToHost) != cudaSuccess ||
            cudaMemcpy(comb.data(), base + region_.combine_flags, r * 8, cudaMemcpyDeviceToHost) != cudaSuccess) {
            cudaGetLastError();
            return "(no diagnosis: the device could not be read)";
        }
        std::string out = "Diagnosis: peer table ";
        bool intact = true;
        for (size_t p = 0; p < r; ++p)
            if (table[p] != windows[p]) {
                out += cat(intact ? "CORRUPT: " : ", ", "entry ", p, " is ", static_cast<void*>(table[p]), " not ",
                           static_cast<void*>(windows[p]));
                intact = false;
            }
        if (intact) out += "intact";
        out += "; dispatch epochs here per sender (even/odd slot):";
        for (size_t p = 0; p < r; ++p) out += cat(" ", p, ":", disp[2 * p].epoch, "/", disp[2 * p + 1].epoch);
        out += "; combine epochs here per holder:";
        for (size_t p = 0; p < r; ++p) out += cat(" ", p, ":", comb[p]);
        return out;
    }

    BufferConfig cfg_;
    int rank_, num_ranks_, e_local_;
    int dev_ = 0, device_sms_ = 0, num_sms_ = 1, ranks_on_gpu_ = 1;
    bool remote_gpu_ = false;
    bool host_waits_ = false;  // some GPU holds two ranks of one process: kernels::SyncMode
    transport::Placement where_;
    std::unique_ptr<transport::SymmetricMemory> region_mem_;
    kernels::Shape shape_{};
    RegionLayout region_{};
    Workspace ws_{};
    cudaStream_t own_stream_ = nullptr;
    cudaEvent_t last_event_ = nullptr;
    bool has_event_ = false;
    void* ws_ptr_ = nullptr;
    void* out_ptr_ = nullptr;
    HostRecord* rec_ = nullptr;
    HostRecord* rec_dev_ = nullptr;
    std::vector<void*> graveyard_;
    GrowingBlock x_st_, sc_st_, w_st_, src_st_, mi_st_;
};

}  // namespace

std::unique_ptr<BackendBuffer> make_cuda_backend(const BackendContext& ctx) { return std::make_unique<CudaBackend>(ctx); }

size_t cuda_reservation_bytes(const BufferConfig& c, int num_ranks) {
    // the symmetric region, the workspace and the combine output; buffer-owned dispatch outputs
    // are allocated at the first call of each layout, for its worst case
    const kernels::Shape shape = make_shape(c, num_ranks);
    return static_cast<size_t>(RegionLayout::make(shape).bytes + Workspace::carve(shape, nullptr).bytes +
                               reservation(c, num_ranks).combine_out);
}

}  // namespace elasticep::detail

// ---------------------------------------------------------------------------------------------
// Self-check: hardware E4M3 conversion against the reference arithmetic, all 2^32 inputs.
namespace elasticep::detail {
namespace {
__global__ void e4m3_check_kernel(unsigned long long* count, uint32_t* first) {
    const uint64_t n = uint64_t{1} << 32;
    for (uint64_t i = (uint64_t{blockIdx.x} * blockDim.x + threadIdx.x) * 2; i < n;
         i += uint64_t{gridDim.x} * blockDim.x * 2) {
        const float a = __uint_as_float(static_cast<uint32_t>(i)), b = __uint_as_float(static_cast<uint32_t>(i + 1));
        const uint16_t hw = kernels::e4m3x2(a, b);
        const uint16_t ref = static_cast<uint16_t>(num::float_to_e4m3(a) | (num::float_to_e4m3(b) << 8));
        if (hw != ref) {
            const uint32_t bad = (hw & 0xff) != (ref & 0xff) ? static_cast<uint32_t>(i) : static_cast<uint32_t>(i + 1);
            atomicMin(first, bad);
            atomicAdd(count, ((hw & 0xff) != (ref & 0xff)) + ((hw >> 8) != (ref >> 8)));
        }
    }
}
}  // namespace

uint64_t cuda_e4m3_mismatches(uint32_t* first) {
    unsigned long long* count = nullptr;
    uint32_t* f = nullptr;
    ELASTICEP_CUDA_CALL(cudaMalloc(&count, 8));
    ELASTICEP_CUDA_CALL(cudaMalloc(&f, 4));
    ELASTICEP_CUDA_CALL(cudaMemset(count, 0, 8));
    ELASTICEP_CUDA_CALL(cudaMemset(f, 0xff, 4));
    e4m3_check_kernel<<<1024, 256>>>(count, f);
    ELASTICEP_CUDA_CALL(cudaGetLastError());
    unsigned long long c = 0;
    ELASTICEP_CUDA_CALL(cudaMemcpy(&c, count, 8, cudaMemcpyDeviceToHost));
    ELASTICEP_CUDA_CALL(cudaMemcpy(first, f, 4, cudaMemcpyDeviceToHost));
    cudaFree(count);
    cudaFree(f);
    return c;
}

}  // namespace elasticep::detail
