// Run under mpirun (2 processes; any count >= 1 works, the timeout part needs >= 2): the CUDA backend
// with ranks as PROCESSES (receive regions mapped through CUDA IPC), compared byte for byte with the
// CPU backend over the same processes (its arena in a shared file mapping). Process r uses GPU
// r % device_count, so two processes may share one GPU (their kernels time-slice).
//
// Per payload setup (bf16; fp8 f32_g128 quantized inside dispatch; fp8 ue8m0_g32 pre-quantized) one
// CPU buffer and one CUDA buffer live through every scenario of the setup (contiguous host_sync,
// contiguous graph mode, masked), each run for two rounds with other token counts, so the buffers see
// six epochs and three layout switches. Every dispatch output (recv_x, recv_scales, recv_weights,
// recv_src, m_indices, counts, offsets / masked_m, num_rows, shapes and strides) and the combine
// output must be equal; padding rows are compared only where SEMANTICS.md defines them.
// Then the timeout contract across processes: rank 1 skips a dispatch (then, on a second buffer, a
// combine); every other rank must get Error(kTimeout) naming rank 1, the buffer stays unusable, and
// a freshly built buffer runs a normal round in the same processes.
//
// Exit codes: 0 pass, 1 mismatch (every rank), 77 skip (no GPU or no CUDA backend; every rank).
// An unexpected exception aborts the job (MPI_Abort) so no rank waits for a dead peer.
// Run: ctest -R mpi_cuda_dispatch (mpirun -np 2), or by hand with any -np, e.g. 4 processes on 2 GPUs:
//   mpirun -np 4 --oversubscribe -x CUDA_DEVICE_MAX_CONNECTIONS=32 build/tests/elasticep_mpi_cuda_test
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/round_inputs.hpp"
#include "elasticep/elasticep.hpp"

using namespace elasticep;

namespace {

constexpr int kSkip = 77;
constexpr auto kGroupTimeout = std::chrono::seconds(120);  // longer than any buffer timeout below
constexpr auto kBufferTimeout = std::chrono::seconds(20);

[[noreturn]] void abort_job(int rank, const std::string& what) {
    std::fprintf(stderr, "rank %d: FATAL: %s\n", rank, what.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::abort();
}

void cuda_ok(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Device memory of one round's inputs (cudaMalloc'd, so 256-byte aligned).
class DevMem {
 public:
    DevMem() = default;
    template <class T>
    explicit DevMem(const std::vector<T>& v) {
        const size_t bytes = v.size() * sizeof(T);
        cuda_ok(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)), "cudaMalloc");
        if (bytes) cuda_ok(cudaMemcpy(ptr_, v.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    }
    DevMem(const DevMem&) = delete;
    DevMem& operator=(const DevMem&) = delete;
    ~DevMem() {
        if (ptr_) cudaFree(ptr_);
    }
    void* get() const { return ptr_; }

 private:
    void* ptr_ = nullptr;
};

// ---- inputs: tests/common/round_inputs.hpp ---------------------------------------------------

using roundgen::Inputs;
using roundgen::make_inputs;
using roundgen::random_bf16;

// ---- scenarios ------------------------------------------------------------------------------

struct Scenario {
    Layout layout = Layout::kExpertContiguous;
    bool host_sync = true;
    int alignment = 1;
    bool weights = true;   // dispatch gets topk_weights
    bool weighted = true;  // combine multiplies by them
    bool bias = false;
    bool zero_padding = false;
    bool mn_major = false;
    bool idx64 = false;
};

struct Setup {
    std::string name;
    BufferConfig cfg;
    bool prequant = false;
    std::vector<Scenario> scenarios;
};

std::string describe(const Setup& su, const Scenario& sc, int round) {
    std::ostringstream os;
    os << su.name << " " << layout_name(sc.layout);
    if (sc.layout == Layout::kExpertContiguous) os << (sc.host_sync ? " host_sync" : " graph") << " A=" << sc.alignment;
    os << " weights=" << sc.weights << " weighted=" << sc.weighted << " bias=" << sc.bias << " zpad=" << sc.zero_padding
       << " mn_major=" << sc.mn_major << " idx" << (sc.idx64 ? 64 : 32) << " (E=" << su.cfg.num_experts
       << " K=" << su.cfg.num_topk << " H=" << su.cfg.hidden << " C=" << su.cfg.max_tokens_per_rank << ") round "
       << round + 1;
    return os.str();
}

// Token counts: the full capacity, empty ranks and uneven counts all occur.
int64_t tokens_of(int capacity, int rank, int scenario, int round) {
    if (round == 0 && rank == 0) return capacity;
    if (round == 1 && rank == 1) return 0;
    return (rank * 13 + scenario * 7 + round * 11 + 5) % (capacity + 1);
}

uint64_t seed_of(int setup, int scenario, int round, int rank, uint64_t salt) {
    return ((((static_cast<uint64_t>(setup) * 131 + static_cast<uint64_t>(scenario)) * 131 +
              static_cast<uint64_t>(round)) *
                 131 +
             static_cast<uint64_t>(rank)) *
            0x9e3779b97f4a7c15ull) ^
           salt;
}

// ---- host snapshots of outputs --------------------------------------------------------------

struct Snap {
    bool present = false;
    DType dtype = DType::kUInt8;
    std::vector<int64_t> shape, strides;
    std::vector<uint8_t> bytes;  // the span the (possibly strided) view covers

    template <class T>
    T at(int64_t i) const {
        T v;
        std::memcpy(&v, bytes.data() + static_cast<size_t>(i) * sizeof(T), sizeof(T));
        return v;
    }
};

// `t == nullptr`: the output is absent (recv_scales of a bf16 payload, m_indices of the masked layout).
Snap snap(const TensorRef* t, bool device) {
    Snap s;
    if (t == nullptr) return s;
    s.present = true;
    s.dtype = t->dtype;
    s.shape = t->shape;
    int64_t span = 1;
    for (int d = 0; d < t->ndim(); ++d) {
        s.strides.push_back(t->stride(d));
        if (t->size(d) == 0) span = 0;
    }
    if (span != 0)
        for (int d = 0; d < t->ndim(); ++d) span += (t->size(d) - 1) * t->stride(d);
    s.bytes.resize(static_cast<size_t>(span) * dtype_size(t->dtype));
    if (s.bytes.empty()) return s;
    if (t->data == nullptr)
        throw std::runtime_error("an output of shape " + std::to_string(t->numel()) + " elements has no data");
    if (device)
        cuda_ok(cudaMemcpy(s.bytes.data(), t->data, s.bytes.size(), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    else
        std::memcpy(s.bytes.data(), t->data, s.bytes.size());
    return s;
}

struct DispatchSnap {
    Layout layout = Layout::kExpertContiguous;
    int64_t num_rows = -1;
    Snap x, scales, w, src, mi, counts, offsets, masked_m;
};

DispatchSnap snap_dispatch(const DispatchResult& r, bool device) {
    DispatchSnap s;
    s.layout = r.layout;
    s.num_rows = r.num_rows;
    s.x = snap(&r.recv_x, device);
    s.scales = snap(r.recv_scales ? &*r.recv_scales : nullptr, device);
    s.w = snap(&r.recv_weights, device);
    s.src = snap(&r.recv_src, device);
    s.counts = snap(&r.counts, device);
    if (r.layout == Layout::kExpertContiguous) {
        s.mi = snap(&r.m_indices, device);
        s.offsets = snap(&r.offsets, device);
    } else {
        s.masked_m = snap(&r.masked_m, device);
    }
    return s;
}

using roundgen::views_of;

// ---- comparison -----------------------------------------------------------------------------

class Mismatches {
 public:
    Mismatches(int rank, std::string tag) : rank_(rank), tag_(std::move(tag)) {}
    void add(const std::string& what) {
        ++count_;
        if (count_ <= 12) std::fprintf(stderr, "rank %d: MISMATCH [%s] %s\n", rank_, tag_.c_str(), what.c_str());
    }
    int count() const { return count_; }

 private:
    int rank_;
    std::string tag_;
    int count_ = 0;
};

std::string dims(const std::vector<int64_t>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
}

bool same_layout(const Snap& c, const Snap& g, const char* name, Mismatches& mm) {
    if (c.present != g.present) {
        mm.add(std::string(name) + ": present on " + (c.present ? "cpu" : "cuda") + " only");
        return false;
    }
    if (!c.present) return true;
    if (c.dtype != g.dtype || c.shape != g.shape || c.strides != g.strides || c.bytes.size() != g.bytes.size()) {
        mm.add(std::string(name) + ": cpu " + dtype_name(c.dtype) + dims(c.shape) + " strides " + dims(c.strides) +
               " vs cuda " + dtype_name(g.dtype) + dims(g.shape) + " strides " + dims(g.strides));
        return false;
    }
    return true;
}

// Every element of a small tensor (counts, offsets, masked_m).
void compare_all(const Snap& c, const Snap& g, const char* name, Mismatches& mm) {
    if (!same_layout(c, g, name, mm) || !c.present) return;
    const size_t n = c.bytes.size() / 4;
    for (size_t i = 0; i < n; ++i)
        if (c.at<int32_t>(static_cast<int64_t>(i)) != g.at<int32_t>(static_cast<int64_t>(i))) {
            mm.add(std::string(name) + ": first difference at index " + std::to_string(i) + " (cpu " +
                   std::to_string(c.at<int32_t>(static_cast<int64_t>(i))) + ", cuda " +
                   std::to_string(g.at<int32_t>(static_cast<int64_t>(i))) + ")");
            return;
        }
}

void compare_dispatch(const DispatchSnap& c, const DispatchSnap& g, const BufferConfig& cfg, int num_ranks,
                      bool zero_padding, Mismatches& mm) {
    if (c.num_rows != g.num_rows)
        mm.add("num_rows: cpu " + std::to_string(c.num_rows) + ", cuda " + std::to_string(g.num_rows));
    compare_all(c.counts, g.counts, "counts", mm);
    compare_all(c.offsets, g.offsets, "offsets", mm);
    compare_all(c.masked_m, g.masked_m, "masked_m", mm);
    const bool x_ok = same_layout(c.x, g.x, "recv_x", mm);
    const bool sc_ok = same_layout(c.scales, g.scales, "recv_scales", mm);
    const bool w_ok = same_layout(c.w, g.w, "recv_weights", mm);
    const bool src_ok = same_layout(c.src, g.src, "recv_src", mm);
    const bool mi_ok = same_layout(c.mi, g.mi, "m_indices", mm);
    if (!x_ok) return;

    const bool masked = c.layout == Layout::kExpertMasked;
    const int64_t rc = int64_t{num_ranks} * cfg.max_tokens_per_rank;
    const int64_t rows = masked ? c.x.shape[0] * c.x.shape[1] : c.x.shape[0];
    const size_t row_bytes = static_cast<size_t>(cfg.hidden) * dtype_size(c.x.dtype);
    // the reference's own shapes must be the documented ones before rows can be indexed
    const int64_t per_row_elems = masked ? c.x.shape[0] * c.x.shape[1] : rows;
    auto elems = [](const Snap& s) {
        return s.present ? static_cast<int64_t>(s.bytes.size() / dtype_size(s.dtype)) : -1;
    };
    const int64_t el = cfg.num_experts / num_ranks;
    if (c.x.shape.size() != (masked ? 3u : 2u) || c.x.shape.back() != cfg.hidden || elems(c.w) != per_row_elems ||
        elems(c.src) != per_row_elems || (!masked && elems(c.mi) != per_row_elems) || elems(c.counts) != el ||
        (masked && c.x.shape[1] != rc) || (c.scales.present && c.scales.shape.size() != c.x.shape.size())) {
        mm.add("the CPU backend's outputs do not have the documented shapes: recv_x " + dims(c.x.shape));
        return;
    }
    // A row is real where the CPU backend (the reference here) says so: m_indices != -1 (contiguous),
    // or below masked_m of its expert (masked).
    auto real = [&](int64_t r) {
        if (masked) return r % rc < c.counts.at<int32_t>(r / rc);
        return c.mi.at<int32_t>(r) != -1;
    };
    // Contiguous: weights/src/m_indices are defined on padding rows too (0 / -1 / -1), data only with
    // zero_padding. Masked: rows at or past masked_m are unspecified (data zero with zero_padding).
    auto data_defined = [&](int64_t r) { return zero_padding || real(r); };
    auto meta_defined = [&](int64_t r) { return !masked || real(r); };
    int64_t first_x = -1, first_sc = -1, first_w = -1, first_src = -1, first_mi = -1, bad_rows = 0;
    for (int64_t r = 0; r < rows; ++r) {
        if (data_defined(r)) {
            const size_t off = static_cast<size_t>(r) * row_bytes;
            bool bad = false;
            if (std::memcmp(c.x.bytes.data() + off, g.x.bytes.data() + off, row_bytes) != 0) {
                bad = true;
                if (first_x < 0) first_x = r;
            }
            if (sc_ok && c.scales.present) {
                const int64_t cols = c.scales.shape.back();
                const auto& st = c.scales.strides;
                for (int64_t col = 0; col < cols; ++col) {
                    const int64_t at =
                        masked ? (r / rc) * st[0] + (r % rc) * st[1] + col * st[2] : r * st[0] + col * st[1];
                    if (c.scales.at<uint32_t>(at) != g.scales.at<uint32_t>(at)) {
                        bad = true;
                        if (first_sc < 0) first_sc = r;
                    }
                }
            }
            bad_rows += bad;
        }
        if (meta_defined(r)) {
            if (w_ok && c.w.at<uint32_t>(r) != g.w.at<uint32_t>(r) && first_w < 0) first_w = r;
            if (src_ok && c.src.at<int32_t>(r) != g.src.at<int32_t>(r) && first_src < 0) first_src = r;
            if (mi_ok && c.mi.present && c.mi.at<int32_t>(r) != g.mi.at<int32_t>(r) && first_mi < 0) first_mi = r;
        }
    }
    if (first_x >= 0) {
        const size_t off = static_cast<size_t>(first_x) * row_bytes;
        size_t b = 0;
        while (b < row_bytes && c.x.bytes[off + b] == g.x.bytes[off + b]) ++b;
        mm.add("recv_x: " + std::to_string(bad_rows) + " row(s) differ (with scales); first at row " +
               std::to_string(first_x) + ", byte " + std::to_string(b) + " of the row");
    }
    if (first_sc >= 0) mm.add("recv_scales: first differing row " + std::to_string(first_sc));
    if (first_w >= 0)
        mm.add("recv_weights: first difference at row " + std::to_string(first_w) + " (cpu " +
               std::to_string(c.w.at<float>(first_w)) + ", cuda " + std::to_string(g.w.at<float>(first_w)) + ")");
    if (first_src >= 0)
        mm.add("recv_src: first difference at row " + std::to_string(first_src) + " (cpu " +
               std::to_string(c.src.at<int32_t>(first_src)) + ", cuda " + std::to_string(g.src.at<int32_t>(first_src)) +
               ")");
    if (first_mi >= 0)
        mm.add("m_indices: first difference at row " + std::to_string(first_mi) + " (cpu " +
               std::to_string(c.mi.at<int32_t>(first_mi)) + ", cuda " + std::to_string(g.mi.at<int32_t>(first_mi)) +
               ")");
}

// ---- one round ------------------------------------------------------------------------------

struct Ctx {
    int rank = 0, size = 1, device = 0;
    std::shared_ptr<Group> cpu_group, gpu_group;
    cudaStream_t stream = nullptr;
};

// One dispatch -> combine on the CPU buffer and on the CUDA buffer with the same inputs; returns
// the number of mismatches this rank saw. With ranks on one GPU every allocation and upload of this
// rank happens before a barrier that precedes the first GPU dispatch, and every download after a
// barrier that follows the last combine (a blocking CUDA call must never wait behind a kernel that
// waits for a peer still on its host side).
int run_round(const Ctx& cx, Buffer& cpu, Buffer& gpu, const Inputs& in, const Scenario& sc, bool prequant,
              uint64_t y_seed, const std::string& tag) {
    const BufferConfig& cfg = cpu.config();
    const int64_t h = cfg.hidden, t = in.t;
    Mismatches mm(cx.rank, tag);

    auto make_args = [&](const void* x, const void* xs, const void* idx, const void* w, Device d) {
        return roundgen::dispatch_args(cfg, sc, prequant, t, x, xs, idx, w, d);
    };
    const void* hx = prequant ? static_cast<const void*>(in.x_fp8.data()) : in.x.data();
    const void* hidx = sc.idx64 ? static_cast<const void*>(in.idx64.data()) : in.idx32.data();

    // CPU backend: dispatch, then combine a random y in its row positions
    DispatchResult cres = cpu.dispatch(make_args(hx, in.scales.data(), hidx, in.w.data(), Device{}));
    const DispatchSnap csnap = snap_dispatch(cres, false);
    const std::vector<int64_t> y_shape = cres.recv_x.shape;
    std::mt19937_64 g(y_seed);
    std::vector<uint16_t> y(static_cast<size_t>(cres.recv_x.numel()));
    for (auto& v : y) v = random_bf16(g, false);
    CombineArgs cc;
    cc.y = TensorRef::contiguous(y.data(), DType::kBFloat16, y_shape);
    cc.weighted = sc.weighted;
    if (sc.bias) cc.bias = TensorRef::contiguous(const_cast<uint16_t*>(in.bias.data()), DType::kBFloat16, {t, h});
    const CombineResult cout = cpu.combine(std::move(cres.handle), cc);
    const Snap cpu_out = snap(&cout.out, false);

    // CUDA backend: uploads, barrier, dispatch + combine, barrier, downloads
    cuda_ok(cudaSetDevice(cx.device), "cudaSetDevice");
    const Device dev{DeviceType::kCUDA, cx.device};
    const DevMem dx = prequant ? DevMem(in.x_fp8) : DevMem(in.x);
    const DevMem dsc(in.scales);
    const DevMem didx = sc.idx64 ? DevMem(in.idx64) : DevMem(in.idx32);
    const DevMem dw(in.w);
    const DevMem dy(y);
    const DevMem dbias(in.bias);
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize (uploads)");
    cx.gpu_group->barrier();

    DispatchArgs ga = make_args(dx.get(), dsc.get(), didx.get(), dw.get(), dev);
    ga.stream = cx.stream;
    DispatchResult gres = gpu.dispatch(ga);
    const DispatchResult gviews = views_of(gres);
    if (gres.handle.num_sms() <= 0) mm.add("handle.num_sms() = " + std::to_string(gres.handle.num_sms()));
    if (gres.recv_x.shape != y_shape)
        mm.add("recv_x shape: cpu " + dims(y_shape) + ", cuda " + dims(gres.recv_x.shape) +
               " (combine below fails on this rank; peers time out)");
    CombineArgs gc;
    gc.y = TensorRef::contiguous(dy.get(), DType::kBFloat16, y_shape, dev);
    gc.weighted = sc.weighted;
    if (sc.bias) gc.bias = TensorRef::contiguous(dbias.get(), DType::kBFloat16, {t, h}, dev);
    gc.stream = cx.stream;
    const CombineResult gout = gpu.combine(std::move(gres.handle), gc);
    cuda_ok(cudaStreamSynchronize(cx.stream), "cudaStreamSynchronize");
    cx.gpu_group->barrier();  // every rank's kernels are done: downloads may synchronise freely
    gpu.check();              // a device-side timeout or sticky fault of this round, if any

    const DispatchSnap gsnap = snap_dispatch(gviews, true);
    compare_dispatch(csnap, gsnap, cfg, cx.size, sc.zero_padding, mm);
    const Snap gpu_out = snap(&gout.out, true);
    if (same_layout(cpu_out, gpu_out, "combine out", mm)) {
        const int64_t n = static_cast<int64_t>(cpu_out.bytes.size() / 2);
        for (int64_t i = 0; i < n; ++i)
            if (cpu_out.at<uint16_t>(i) != gpu_out.at<uint16_t>(i)) {
                char buf[160];
                std::snprintf(buf, sizeof(buf),
                              "combine out: first difference at token %lld channel %lld (cpu 0x%04x, cuda 0x%04x)",
                              static_cast<long long>(i / h), static_cast<long long>(i % h), cpu_out.at<uint16_t>(i),
                              gpu_out.at<uint16_t>(i));
                mm.add(buf);
                break;
            }
    }
    return mm.count();
}

// Every rank learns whether any rank failed; returns the number of failing ranks.
int failing_ranks(const Ctx& cx, int my_failures) {
    const auto all = cx.cpu_group->all_gather_value<int32_t>(my_failures > 0 ? 1 : 0);
    int n = 0;
    for (int32_t v : all) n += v;
    return n;
}

// Expert counts scale with the number of processes (E_local fixed), so any -np works.
std::vector<Setup> setups(int num_ranks) {
    std::vector<Setup> out;
    auto base = [](int e, int k, int h, int c) {
        BufferConfig cfg;
        cfg.num_experts = e;
        cfg.num_topk = k;
        cfg.hidden = h;
        cfg.max_tokens_per_rank = c;
        cfg.timeout = kBufferTimeout;
        return cfg;
    };
    auto contiguous = [](bool host_sync, int a) {
        Scenario s;
        s.host_sync = host_sync;
        s.alignment = a;
        return s;
    };
    auto masked = [] {
        Scenario s;
        s.layout = Layout::kExpertMasked;
        return s;
    };
    {
        Setup su{"bf16", base(8 * num_ranks, 4, 256, 32), false, {}};
        Scenario a = contiguous(true, 1);  // weighted, no bias
        Scenario b = contiguous(false, 128);
        b.weighted = false;  // weights carried, combine unweighted
        b.bias = true;
        b.idx64 = true;
        Scenario m = masked();
        m.weights = m.weighted = false;
        m.bias = true;
        m.zero_padding = true;
        su.scenarios = {a, b, m};
        out.push_back(su);
    }
    {
        Setup su{"fp8/f32_g128/quantize", base(4 * num_ranks, 2, 512, 48), false, {}};
        su.cfg.payload = Payload::kFP8;
        su.cfg.scale_format = ScaleFormat::kF32G128;
        Scenario a = contiguous(true, 64);
        a.bias = true;
        a.idx64 = true;
        Scenario b = contiguous(false, 1);
        b.weighted = false;
        b.mn_major = true;
        b.zero_padding = true;
        Scenario m = masked();  // weighted, no bias
        su.scenarios = {a, b, m};
        out.push_back(su);
    }
    {
        Setup su{"fp8/ue8m0_g32/prequantized", base(8 * num_ranks, 3, 256, 64), true, {}};
        su.cfg.payload = Payload::kFP8;
        su.cfg.scale_format = ScaleFormat::kUE8M0G32;
        Scenario a = contiguous(true, 1);
        a.weights = a.weighted = false;
        a.bias = true;
        a.mn_major = true;
        Scenario b = contiguous(false, 32);  // weighted
        b.bias = true;
        b.zero_padding = true;
        b.idx64 = true;
        Scenario m = masked();
        m.weighted = false;
        m.mn_major = true;
        su.scenarios = {a, b, m};
        out.push_back(su);
    }
    return out;
}

// Builds a CPU buffer and a CUDA buffer of one config and runs every scenario twice on them.
int run_setup(const Ctx& cx, int setup_index, const Setup& su) {
    cuda_ok(cudaSetDevice(cx.device), "cudaSetDevice");
    auto cpu = Buffer::create(cx.cpu_group, su.cfg, BackendKind::kCPU);
    BufferConfig gpu_cfg = su.cfg;
    gpu_cfg.device = cx.device;  // per rank: not part of what the ranks must agree on
    auto gpu = Buffer::create(cx.gpu_group, gpu_cfg, BackendKind::kCUDA);
    int failures = 0;
    for (int s = 0; s < static_cast<int>(su.scenarios.size()); ++s)
        for (int round = 0; round < 2; ++round) {
            const Scenario& sc = su.scenarios[static_cast<size_t>(s)];
            const std::string tag = describe(su, sc, round);
            const Inputs in = make_inputs(su.cfg, tokens_of(su.cfg.max_tokens_per_rank, cx.rank, s, round),
                                          seed_of(setup_index, s, round, cx.rank, 1), su.prequant, sc.weights, sc.bias);
            const int mine =
                run_round(cx, *cpu, *gpu, in, sc, su.prequant, seed_of(setup_index, s, round, cx.rank, 2), tag);
            const int bad = failing_ranks(cx, mine);
            if (cx.rank == 0) std::printf("%-110s %s\n", tag.c_str(), bad ? "FAILED" : "ok");
            if (bad) failures += 1;
            if (bad) return failures;  // the remaining scenarios would only repeat the noise
        }
    std::fflush(stdout);
    cx.gpu_group->barrier();  // every rank is done with these buffers before any rank frees its part
    return failures;
}

// ---- timeouts -------------------------------------------------------------------------------

// Whether `msg` names exactly rank 1 among the peers, once the waiting rank's own number is set aside.
bool names_only_rank_1(const std::string& msg, int me) {
    static const std::regex re(R"(\brank(?:s|\(s\))? ([0-9]+(?:, [0-9]+)*))");
    std::set<int> named;
    for (auto it = std::sregex_iterator(msg.begin(), msg.end(), re); it != std::sregex_iterator(); ++it) {
        std::stringstream ss((*it)[1].str());
        std::string num;
        while (std::getline(ss, num, ',')) named.insert(std::stoi(num));
    }
    named.erase(me);
    return named == std::set<int>{1};
}

// Expects `fn` to throw Error(kTimeout) whose message names `phase` and rank 1 (only).
int expect_timeout(const Ctx& cx, const char* what, const char* phase, bool check_names,
                   const std::function<void()>& fn) {
    try {
        fn();
    } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout) {
            std::fprintf(stderr, "rank %d: %s: expected a timeout error, got %s\n", cx.rank, what, e.what());
            return 1;
        }
        if (check_names && (e.message().find(phase) == std::string::npos || !names_only_rank_1(e.message(), cx.rank))) {
            std::fprintf(stderr, "rank %d: %s: the timeout error must name the phase '%s' and rank 1 (only): %s\n",
                         cx.rank, what, phase, e.what());
            return 1;
        }
        std::printf("rank %d: %s: got the expected timeout: %s\n", cx.rank, what, e.message().c_str());
        return 0;
    }
    std::fprintf(stderr, "rank %d: %s: returned normally although rank 1 never called it\n", cx.rank, what);
    return 1;
}

// Rank 1 skips a dispatch (phase 0) or a combine (phase 1) on a fresh buffer with a 1.5 s timeout;
// every other rank must fail with a timeout naming rank 1, and the buffer must stay unusable.
int run_timeout_case(const Ctx& cx, bool skip_combine) {
    BufferConfig cfg;
    cfg.num_experts = 4 * cx.size;
    cfg.num_topk = 2;
    cfg.hidden = 256;
    cfg.max_tokens_per_rank = 16;
    cfg.timeout = std::chrono::milliseconds(1500);
    cfg.device = cx.device;
    cuda_ok(cudaSetDevice(cx.device), "cudaSetDevice");
    const Device dev{DeviceType::kCUDA, cx.device};
    const Inputs in =
        make_inputs(cfg, cfg.max_tokens_per_rank, seed_of(9, skip_combine, 0, cx.rank, 3), false, true, false);
    std::vector<uint16_t> y(static_cast<size_t>(cx.size * cfg.max_tokens_per_rank * cfg.num_topk * cfg.hidden), 0x3f80);
    int failures = 0;
    {
        auto gpu = Buffer::create(cx.gpu_group, cfg, BackendKind::kCUDA);
        const DevMem dx(in.x), didx(in.idx32), dw(in.w), dy(y);
        cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize (uploads)");
        cx.gpu_group->barrier();
        DispatchArgs a;
        a.x = TensorRef::contiguous(dx.get(), DType::kBFloat16, {in.t, cfg.hidden}, dev);
        a.topk_idx = TensorRef::contiguous(didx.get(), DType::kInt32, {in.t, cfg.num_topk}, dev);
        a.topk_weights = TensorRef::contiguous(dw.get(), DType::kFloat32, {in.t, cfg.num_topk}, dev);
        const char* phase = skip_combine ? "combine" : "dispatch";
        const std::string what = std::string("rank 1 skips ") + phase;
        if (!skip_combine) {
            if (cx.rank != 1)
                failures += expect_timeout(cx, what.c_str(), phase, true, [&] { (void)gpu->dispatch(a); });
        } else {
            DispatchResult r = gpu->dispatch(a);  // every rank takes part (own stream: synchronous)
            if (cx.rank != 1) {
                CombineArgs c;
                c.y = TensorRef::contiguous(dy.get(), DType::kBFloat16, r.recv_x.shape, dev);
                failures +=
                    expect_timeout(cx, what.c_str(), phase, true, [&] { (void)gpu->combine(std::move(r.handle), c); });
            }
        }
        if (cx.rank != 1) {
            // the buffer is unusable until rebuilt: the next call fails at once, without communicating
            const auto t0 = std::chrono::steady_clock::now();
            failures += expect_timeout(cx, (what + ", then dispatch again on the broken buffer").c_str(), phase, false,
                                       [&] { (void)gpu->dispatch(a); });
            if (std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(1000)) {
                std::fprintf(stderr, "rank %d: the broken buffer's dispatch waited instead of failing at once\n",
                             cx.rank);
                ++failures;
            }
        }
        cx.gpu_group->barrier();  // the waiting ranks' kernels have ended; rank 1 never launched any
    }
    cx.gpu_group->barrier();  // every rank dropped the broken buffer
    return failures;
}

int run(const Ctx& cx) {
    int failures = 0;
    const auto list = setups(cx.size);
    for (int i = 0; i < static_cast<int>(list.size()); ++i) {
        failures += run_setup(cx, i, list[static_cast<size_t>(i)]);
        if (failures) return failures;
    }
    if (cx.size < 2) {
        std::printf("rank 0: one process only: the timeout part needs 2 or more (run under mpirun -np 2)\n");
        return failures;
    }
    for (bool skip_combine : {false, true}) {
        const int mine = run_timeout_case(cx, skip_combine);
        const int bad = failing_ranks(cx, mine);
        if (cx.rank == 0)
            std::printf("timeout: rank 1 skips %-10s %s\n", skip_combine ? "combine" : "dispatch",
                        bad ? "FAILED" : "ok");
        if (bad) return failures + 1;
    }
    // the processes stay usable: fresh buffers, a normal round
    Setup su = list[1];
    su.name += " after timeouts";
    const int bad = run_setup(cx, 7, su);
    return failures + bad;
}

}  // namespace

int main() {
    // Ranks of one process sharing a GPU need a hardware queue per stream; harmless otherwise.
    ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    auto cpu_group = MpiGroup::world(kGroupTimeout);
    auto gpu_group = MpiGroup::world(kGroupTimeout);
    Ctx cx;
    cx.rank = gpu_group->rank();
    cx.size = gpu_group->size();
    cx.cpu_group = cpu_group;
    cx.gpu_group = gpu_group;

    // skip on every rank alike when any rank has no usable GPU or no CUDA backend
    int gpus = 0;
    std::string why;
    if (!Buffer::backend_available(BackendKind::kCUDA)) {
        why = "the CUDA backend is not compiled in or no CUDA GPU is visible";
    } else if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus <= 0) {
        cudaGetLastError();
        gpus = 0;
        why = "cudaGetDeviceCount found no GPU";
    }
    const auto counts = cpu_group->all_gather_value<int32_t>(gpus);
    if (std::find(counts.begin(), counts.end(), 0) != counts.end()) {
        std::printf("rank %d: SKIP: this test needs a CUDA GPU on every rank (%s)\n", cx.rank,
                    why.empty() ? "another rank has none" : why.c_str());
        return kSkip;
    }
    cx.device = cx.rank % gpus;

    int failures = 0;
    try {
        cuda_ok(cudaSetDevice(cx.device), "cudaSetDevice");
        cuda_ok(cudaStreamCreateWithFlags(&cx.stream, cudaStreamNonBlocking), "cudaStreamCreate");
        std::printf("rank %d of %d: GPU %d of %d\n", cx.rank, cx.size, cx.device, gpus);
        std::fflush(stdout);
        cx.gpu_group->barrier();
        failures = run(cx);
        cx.gpu_group->barrier();
        cudaStreamDestroy(cx.stream);
    } catch (const std::exception& e) {
        abort_job(cx.rank, e.what());
    }
    std::printf("rank %d: cuda backend across processes vs cpu backend: %s\n", cx.rank, failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
