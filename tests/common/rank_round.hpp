// The one rank runner of every test program: what one rank does in one dispatch -> combine round on
// one buffer, wherever its tensors live (TestMemory: host memory for the CPU backend, device memory
// for CUDA, tests/common/cuda_memory.hpp), whether the ranks are threads or processes. No test
// framework here; the callers compare the outcome with the oracle (expected_round) and, on the GPU,
// with the CPU backend's outcome of the same round.
//
// The round, on rank r:
//   1. place the call's inputs, y and (caller outputs) in `mem`      (may allocate: before any collective)
//   2. hooks.before_calls()   (GPU: a barrier, so no rank allocates while a peer's kernel waits for it)
//   3. dispatch, combine with y[row][h] = y_value(r, row, h) in the dispatch's row positions
//   4. mem.synchronize(); hooks.after_calls()   (GPU: a barrier before anything is read back)
//   5. read every output back (canonical, host)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/observe.hpp"
#include "common/scenario.hpp"

namespace eptest {

// Where one backend's call tensors live.
class TestMemory {
 public:
    virtual ~TestMemory() = default;
    virtual Device device() const = 0;
    // The address the call reads for `bytes` host bytes: the bytes themselves (host) or a copy.
    virtual void* place(const void* host, size_t bytes) = 0;
    // Fresh memory the call writes (combine's caller-provided out), filled with `fill`.
    virtual void* fresh(size_t bytes, uint8_t fill) = 0;
    virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
    virtual void* stream() const { return nullptr; }
    virtual void synchronize() {}
};

// Host memory: the storage is passed as is.
class HostMemory final : public TestMemory {
 public:
    Device device() const override { return Device{}; }
    void* place(const void* host, size_t) override { return const_cast<void*>(host); }
    void* fresh(size_t bytes, uint8_t fill) override {
        blocks_.emplace_back(bytes, fill);
        return blocks_.back().data();
    }
    void copy_to_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }

 private:
    std::vector<std::vector<uint8_t>> blocks_;
};

struct RoundHooks {
    std::function<void()> before_calls;  // after every allocation, before the first collective
    std::function<void()> after_calls;   // after the stream finished, before anything is read back
};

// What one rank saw in one round.
struct RankOutcome {
    Observed got;
    std::vector<uint16_t> y;    // canonical [rows, H] as passed to combine
    std::vector<uint16_t> out;  // canonical [T, H]
    bool handle_valid_after = true;
    int handle_num_sms = -1;
    bool canaries_ok = true;
    bool inputs_untouched = true;
    bool out_gaps_untouched = true;
    bool wrote_caller_outputs = true;  // caller outputs: dispatch and combine wrote them
    std::vector<int64_t> scale_strides;
    std::vector<int64_t> scale_shape;
    bool scales_present = false;
};

// y of rank r in the row positions of its dispatch: y_value(r, row, h) for `rows` rows.
inline std::vector<uint16_t> make_y(const Scenario& sc, int rank, int64_t rows) {
    const int64_t h = sc.cfg.hidden;
    std::vector<uint16_t> y(static_cast<size_t>(rows * h));
    for (int64_t row = 0; row < rows; ++row)
        for (int64_t c = 0; c < h; ++c) y[static_cast<size_t>(row * h + c)] = y_value(rank, row, c);
    return y;
}

inline RankOutcome run_rank_round(const Scenario& sc, int rank, Buffer& buf, const RankData& d, TestMemory& mem,
                                  const RoundHooks& hooks = {}) {
    RankOutcome o;
    const int h = sc.cfg.hidden;
    const int64_t t = d.in.num_tokens;
    const Device dev = mem.device();
    const bool on_host = dev.type == DeviceType::kCPU;
    const RankData before = d;
    // 1. everything the round needs, placed before any collective
    DispatchArgs args = make_args(
        sc, d, [&](const void* p, size_t n) { return mem.place(p, n); }, dev);
    args.stream = mem.stream();
    std::unique_ptr<CallerOutputs> outs;
    if (sc.caller_outputs && on_host) {
        outs = make_caller_outputs(sc);
        args.outputs = outs->refs;
    }
    // y: on the host made after the dispatch for its rows; elsewhere placed now for the layout's worst
    // case (a backend returning a wrong row count still finds its rows)
    std::vector<uint16_t> y_all;
    void* y_mem = nullptr;
    if (!on_host) {
        y_all = make_y(sc, rank, worst_case_rows(sc));
        y_mem = mem.place(y_all.data(), y_all.size() * 2);
    }
    const TensorRef bias = sc.bias ? strided_2d(mem.place(d.bias_storage.data(), d.bias_storage.size() * 2),
                                                DType::kBFloat16, t, h, d.bias_stride, dev)
                                   : TensorRef{};
    const int64_t out_stride = h + (sc.strided ? 8 : 0);
    void* out_mem = nullptr;
    std::unique_ptr<Guarded> out_guarded;
    if (sc.caller_outputs) {
        if (on_host) {
            out_guarded = std::make_unique<Guarded>(static_cast<size_t>(t * out_stride * 2));
            out_mem = out_guarded->data();
        } else {
            out_mem = mem.fresh(static_cast<size_t>(t * out_stride * 2), Guarded::kFillByte);
        }
    }
    if (hooks.before_calls) hooks.before_calls();

    // 2. the collective calls
    DispatchResult res = buf.dispatch(args);
    o.handle_num_sms = res.handle.num_sms();
    const DispatchResult views = [&] {
        DispatchResult v;
        v.layout = res.layout;
        v.recv_x = res.recv_x;
        v.recv_scales = res.recv_scales;
        v.recv_weights = res.recv_weights;
        v.recv_src = res.recv_src;
        v.m_indices = res.m_indices;
        v.counts = res.counts;
        v.offsets = res.offsets;
        v.masked_m = res.masked_m;
        v.num_rows = res.num_rows;
        return v;
    }();
    if (on_host) {
        y_all = make_y(sc, rank, res.recv_x.numel() / h);
        y_mem = y_all.data();
    }
    CombineArgs c;
    c.y = TensorRef::contiguous(y_mem, DType::kBFloat16, res.recv_x.shape, dev);
    c.weighted = sc.weighted;
    c.stream = mem.stream();
    if (sc.bias) c.bias = bias;
    if (out_mem) c.out = strided_2d(out_mem, DType::kBFloat16, t, h, out_stride, dev);
    CombineResult cr = buf.combine(std::move(res.handle), c);
    o.handle_valid_after = res.handle.valid();
    mem.synchronize();
    if (hooks.after_calls) hooks.after_calls();

    // 3. read back (the outputs stay valid until this buffer's next dispatch)
    std::vector<std::vector<uint8_t>> keep;
    const CopyToHost copy = [&](void* dst, const void* src, size_t n) { mem.copy_to_host(dst, src, n); };
    DispatchResult copied;
    if (!on_host) copied = to_host(views, copy, keep);
    const DispatchResult& host = on_host ? views : copied;
    o.got = observe(host, sc.cfg);
    o.scales_present = host.recv_scales.has_value();
    if (host.recv_scales) {
        o.scale_shape = host.recv_scales->shape;
        for (int i = 0; i < host.recv_scales->ndim(); ++i) o.scale_strides.push_back(host.recv_scales->stride(i));
    }
    const size_t y_rows = static_cast<size_t>(o.got.rows);
    o.y.assign(y_all.begin(), y_all.begin() + static_cast<std::ptrdiff_t>(std::min(y_rows * h, y_all.size())));
    const TensorRef out_host = on_host ? cr.out : tensor_to_host(cr.out, copy, keep);
    o.out = read_2d<uint16_t>(out_host, t, h);
    if (sc.caller_outputs) {
        o.wrote_caller_outputs = cr.out.data == out_mem && (!outs || res.recv_x.data == outs->x.data());
        std::vector<uint8_t> ob(static_cast<size_t>(t * out_stride * 2));
        if (!ob.empty()) mem.copy_to_host(ob.data(), out_mem, ob.size());
        for (int64_t tt = 0; tt < t; ++tt)
            for (int64_t b = h * 2; b < out_stride * 2; ++b)
                if (ob[static_cast<size_t>(tt * out_stride * 2 + b)] != Guarded::kFillByte)
                    o.out_gaps_untouched = false;
        o.canaries_ok = (!outs || outs->intact()) && (!out_guarded || out_guarded->guards_intact());
    }
    o.inputs_untouched = before.x == d.x && before.x8 == d.x8 && before.xs == d.xs && before.idx32 == d.idx32 &&
                         before.idx64 == d.idx64 && before.w == d.w && before.bias_storage == d.bias_storage;
    return o;
}

// The oracle's answer for a round of `data`: every rank's dispatch outputs and combine outputs.
struct ExpectedRound {
    std::vector<ref::RankDispatch> dispatch;
    std::vector<std::vector<uint16_t>> combine;
};

inline ExpectedRound expected_round(const Scenario& sc, const std::vector<RankData>& data) {
    ExpectedRound e;
    std::vector<ref::RankInput> inputs;
    for (const RankData& d : data) inputs.push_back(d.in);
    e.dispatch = ref::dispatch(sc.cfg, sc.num_ranks, inputs, sc.opt);
    std::vector<std::vector<uint16_t>> ys, biases;
    for (int r = 0; r < sc.num_ranks; ++r) {
        ys.push_back(make_y(sc, r, e.dispatch[static_cast<size_t>(r)].rows));
        biases.push_back(data[static_cast<size_t>(r)].bias);
    }
    e.combine = ref::combine(sc.cfg, sc.num_ranks, inputs, sc.opt, ys, sc.weighted,
                             sc.bias ? biases : std::vector<std::vector<uint16_t>>{});
    return e;
}

// Every difference between one rank's outcome and the oracle's (and its scale layout), as sentences.
inline std::vector<std::string> outcome_mismatches(const Scenario& sc, const RankOutcome& o,
                                                   const ref::RankDispatch& want,
                                                   const std::vector<uint16_t>& want_out) {
    bool fatal = false;
    std::vector<std::string> m = dispatch_mismatches(want, o.got, sc.cfg, sc.opt.zero_padding, &fatal);
    if (o.handle_valid_after) m.push_back("the handle is still valid after combine");
    if (!o.canaries_ok) m.push_back("wrote outside a caller-provided output");
    if (!o.out_gaps_untouched) m.push_back("wrote into the row gaps of a strided combine output");
    if (!o.inputs_untouched) m.push_back("modified an input");
    if (!o.wrote_caller_outputs) m.push_back("did not write the caller-provided outputs");
    if (fatal) return m;
    const std::string c = combine_mismatch(o.out, want_out, sc.cfg.hidden);
    if (!c.empty()) m.push_back(c);
    return m;
}

}  // namespace eptest
