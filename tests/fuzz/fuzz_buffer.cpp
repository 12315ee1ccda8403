// libFuzzer target over the C++ API on the CPU backend (the bad-input suite's fuzzing half,
// issue 10). Each input decodes into a group of 1-3 ranks as threads, a BufferConfig per rank
// (mostly equal, sometimes invalid or mismatched), then up to three dispatch/combine rounds with
// fuzzed shapes, dtypes, strides, odd pointer offsets, expert ids (out of range, repeated),
// weights, layouts, alignments, caller-provided outputs (sometimes of the wrong shape) and
// combine arguments.
//
// What it checks, besides ASan/UBSan finding no memory error or undefined behaviour:
// - every failure is an elasticep::Error (anything else traps);
// - Buffer::create succeeds on every rank or on none;
// - no write outside caller-provided outputs (guard bytes) and no write into inputs;
// - a handle is invalid after its combine, whatever the outcome;
// - when every rank's dispatch (combine) succeeded, the outputs equal the oracle's bit for bit,
//   and a host-synchronising dispatch never succeeds with an invalid route.
#include <fuzzer/FuzzedDataProvider.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "elasticep/elasticep.hpp"
#include "reference/oracle.hpp"

using namespace elasticep;
namespace ref = elasticep::reference;

namespace {

[[noreturn]] void fail(const char* what, const std::string& detail = "") {
    std::fprintf(stderr, "fuzz_buffer: %s %s\n", what, detail.c_str());
    std::abort();
}

// Runs fn(r) on one thread per rank; only elasticep::Error may escape a rank.
template <class Fn>
std::vector<std::optional<Error>> run_ranks(int n, Fn fn) {
    std::vector<std::optional<Error>> errors(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
        threads.emplace_back([&, r] {
            try {
                fn(r);
            } catch (const Error& e) {
                errors[static_cast<size_t>(r)] = e;
            } catch (const std::exception& e) {
                fail("a call raised something other than elasticep::Error:", e.what());
            } catch (...) {
                fail("a call raised a non-std exception");
            }
        });
    for (auto& t : threads) t.join();
    return errors;
}

// Memory with guard bytes on both sides; `offset` shifts the data off its natural alignment.
struct Guarded {
    static constexpr size_t kGuard = 64;
    std::vector<uint8_t> mem;
    size_t bytes = 0, offset = 0;
    Guarded(size_t n, size_t off) : mem(n + 2 * kGuard + 8, 0xa5), bytes(n), offset(off) {}
    uint8_t* data() { return mem.data() + kGuard + offset; }
    bool intact() const {
        for (size_t i = 0; i < kGuard + offset; ++i)
            if (mem[i] != 0xa5) return false;
        for (size_t i = kGuard + offset + bytes; i < mem.size(); ++i)
            if (mem[i] != 0xa5) return false;
        return true;
    }
};

const int kHiddens[] = {8, 16, 24, 32, 64, 120, 128, 136, 256, 384, 100, 0, 65544};

BufferConfig fuzz_config(FuzzedDataProvider& in, int ranks) {
    BufferConfig c;
    c.num_experts = ranks * in.ConsumeIntegralInRange(1, 4) + (in.ConsumeIntegralInRange(0, 31) == 0 ? 1 : 0);
    c.num_topk = in.ConsumeIntegralInRange(0, 6);
    c.hidden = kHiddens[in.ConsumeIntegralInRange<size_t>(0, std::size(kHiddens) - 1)];
    c.max_tokens_per_rank = in.ConsumeIntegralInRange(0, 5);
    c.payload = in.ConsumeBool() ? Payload::kFP8 : Payload::kBF16;
    c.scale_format = static_cast<ScaleFormat>(in.ConsumeIntegralInRange(0, 2));
    // short: a rank that fails alone leaves its peers waiting this long
    c.timeout = std::chrono::milliseconds(in.ConsumeIntegralInRange(0, 63) == 0 ? 0 : 10);
    c.num_sms = in.ConsumeIntegralInRange(0, 2);
    c.ranks_per_node = in.ConsumeIntegralInRange(0, 15) == 0 ? 1 : 0;
    return c;
}

struct RankCall {
    // canonical inputs (for the oracle) and the storage the call reads
    ref::RankInput in;
    std::vector<uint8_t> storage;  // every input tensor, 8-byte aligned slots
    DispatchArgs args;
    std::vector<std::unique_ptr<Guarded>> outputs;
    std::optional<DispatchResult> result;
    std::optional<Error> dispatch_error, combine_error;
    std::vector<uint16_t> y_canonical, out_canonical;
    std::unique_ptr<Guarded> y_mem, bias_mem, out_mem;
    std::vector<uint16_t> bias;
    bool handle_valid_after = false;
    uint64_t input_sum = 0;
};

uint64_t checksum(const std::vector<uint8_t>& v) {
    uint64_t h = 1469598103934665603ull;
    for (uint8_t b : v) h = (h ^ b) * 1099511628211ull;
    return h;
}

uint16_t small_bf16(uint8_t b) {  // finite bf16 of small magnitude, both signs, some zeros
    if (b % 11 == 0) return 0;
    const uint16_t exp = static_cast<uint16_t>(120 + (b >> 4) % 12);
    return static_cast<uint16_t>(((b & 1) << 15) | (exp << 7) | ((b * 37u) & 0x7f));
}

// Places `src` (rows x cols of `elem` bytes) in `storage` with row stride `stride` elements at an
// 8-byte aligned offset plus `skew` bytes; returns the byte offset of element 0.
size_t place(std::vector<uint8_t>& storage, const void* src, int64_t rows, int64_t cols, int64_t stride, size_t elem,
             size_t skew) {
    const size_t at = (storage.size() + 15) / 8 * 8 + skew;
    storage.resize(at + static_cast<size_t>(std::max<int64_t>(rows * stride, 1)) * elem + 8, 0x7f);
    for (int64_t r = 0; r < rows; ++r)
        std::memcpy(storage.data() + at + static_cast<size_t>(r * stride) * elem,
                    static_cast<const uint8_t*>(src) + static_cast<size_t>(r * cols) * elem,
                    static_cast<size_t>(cols) * elem);
    return at;
}

void build_call(FuzzedDataProvider& in, const BufferConfig& c, int ranks, int rank, const DispatchArgs& shared,
                bool prequant, bool idx64, bool weights, int pad, bool caller_outputs, RankCall& call) {
    const int h = c.hidden, k = c.num_topk;
    const bool fp8 = c.payload == Payload::kFP8;
    const int scols = fp8 && h >= 1 && h <= kMaxHidden ? scale_columns(c.scale_format, h) : 0;
    // now and then one token more than the capacity (CapacityExceeded on this rank alone)
    const int64_t t = in.ConsumeIntegralInRange(0, 63) == 0 ? c.max_tokens_per_rank + 1
                                                            : in.ConsumeIntegralInRange(0, c.max_tokens_per_rank);
    const bool skew = in.ConsumeIntegralInRange(0, 63) == 0;  // one tensor off its alignment
    const int skewed = in.ConsumeIntegralInRange(0, 3);
    call.in.num_tokens = t;
    for (int64_t i = 0; i < t * k; ++i) call.in.topk_idx.push_back(in.ConsumeIntegralInRange(-2, c.num_experts + 1));
    if (weights)
        for (int64_t i = 0; i < t * k; ++i) call.in.topk_weights.push_back(in.ConsumeIntegralInRange(-8, 8) * 0.125f);
    if (prequant) {
        for (int64_t i = 0; i < t * h; ++i) call.in.x_fp8.push_back(in.ConsumeIntegral<uint8_t>());
        for (int64_t i = 0; i < t * scols; ++i)
            call.in.x_scales.push_back(in.ConsumeIntegral<uint32_t>() | 0x3f000000u);
    } else {
        for (int64_t i = 0; i < t * h; ++i) call.in.x.push_back(small_bf16(in.ConsumeIntegral<uint8_t>()));
    }
    // storage with row strides padded by `pad` elements; offsets recorded, pointers bound at the end
    auto& st = call.storage;
    st.reserve(1 << 16);
    std::vector<int32_t> idx32(call.in.topk_idx.begin(), call.in.topk_idx.end());
    const size_t x_at = prequant ? place(st, call.in.x_fp8.data(), t, h, h + pad, 1, skew && skewed == 0 ? 1 : 0)
                                 : place(st, call.in.x.data(), t, h, h + pad, 2, skew && skewed == 0 ? 1 : 0);
    const size_t s_at =
        prequant ? place(st, call.in.x_scales.data(), t, scols, scols + pad, 4, skew && skewed == 1 ? 2 : 0) : 0;
    const size_t i_at = idx64 ? place(st, call.in.topk_idx.data(), t, k, k + pad, 8, skew && skewed == 2 ? 4 : 0)
                              : place(st, idx32.data(), t, k, k + pad, 4, skew && skewed == 2 ? 1 : 0);
    const size_t w_at =
        weights ? place(st, call.in.topk_weights.data(), t, k, k + pad, 4, skew && skewed == 3 ? 3 : 0) : 0;
    DispatchArgs& a = call.args;
    a = shared;
    auto ref2 = [&](size_t at, DType dt, int64_t rows, int64_t cols) {
        TensorRef r = TensorRef::contiguous(st.data() + at, dt, {rows, cols});
        if (pad != 0) r.strides = {cols + pad, 1};
        return r;
    };
    a.x = ref2(x_at, prequant ? DType::kFloat8E4M3 : DType::kBFloat16, t, h);
    if (prequant)
        a.x_scales = ref2(s_at, c.scale_format == ScaleFormat::kF32G128 ? DType::kFloat32 : DType::kInt32, t, scols);
    a.topk_idx = ref2(i_at, idx64 ? DType::kInt64 : DType::kInt32, t, k);
    if (weights) a.topk_weights = ref2(w_at, DType::kFloat32, t, k);
    call.input_sum = checksum(st);
    if (!caller_outputs || c.num_experts < ranks || c.max_tokens_per_rank < 1 || h < 1 || h > kMaxHidden) return;
    // caller-provided outputs of the layout's fixed worst-case shape (or, sometimes, claiming one row
    // fewer: the library must refuse it); memory always for the full shape, with guards around it
    const int64_t e_local = c.num_experts / ranks, rc = int64_t{ranks} * c.max_tokens_per_rank;
    const bool contiguous = a.layout == Layout::kExpertContiguous;
    const int64_t align = std::max(a.expert_alignment, 1);
    const int64_t rows = contiguous ? rc * std::min<int64_t>(k, e_local) + e_local * (align - 1) : e_local * rc;
    const int64_t short_by = in.ConsumeIntegralInRange(0, 63) == 0 ? 1 : 0;
    if (rows < 1 || rows > (1 << 16)) return;
    const size_t xe = fp8 ? 1 : 2;
    auto out = [&](size_t bytes) {
        call.outputs.push_back(std::make_unique<Guarded>(bytes, 0));
        return call.outputs.back()->data();
    };
    const std::vector<int64_t> shape1 =
        contiguous ? std::vector<int64_t>{rows - short_by} : std::vector<int64_t>{e_local, rc - short_by};
    std::vector<int64_t> shape_x = shape1;
    shape_x.push_back(h);
    a.outputs.recv_x = TensorRef::contiguous(out(static_cast<size_t>(rows * h) * xe),
                                             fp8 ? DType::kFloat8E4M3 : DType::kBFloat16, shape_x);
    a.outputs.recv_weights = TensorRef::contiguous(out(static_cast<size_t>(rows) * 4), DType::kFloat32, shape1);
    a.outputs.recv_src = TensorRef::contiguous(out(static_cast<size_t>(rows) * 4), DType::kInt32, shape1);
    if (contiguous)
        a.outputs.m_indices = TensorRef::contiguous(out(static_cast<size_t>(rows) * 4), DType::kInt32, shape1);
    (void)rank;
}

// Canonical row-major copies of one rank's dispatch outputs, read through their strides.
bool equal_to_oracle(const BufferConfig& c, const DispatchResult& r, const ref::RankDispatch& want, bool zero_padding) {
    const bool fp8 = c.payload == Payload::kFP8;
    const int64_t h = c.hidden;
    const size_t xe = fp8 ? 1 : 2;
    const int64_t rows = r.recv_x.ndim() == 2 ? r.recv_x.size(0) : r.recv_x.size(0) * r.recv_x.size(1);
    if (rows != want.rows || r.num_rows != want.num_rows) return false;
    auto flat = [](const TensorRef& t, int64_t i) {  // element i of a 1-D [rows] or 2-D [A, B] tensor
        if (t.ndim() == 1) return i * t.stride(0);
        return (i / t.size(1)) * t.stride(0) + (i % t.size(1)) * t.stride(1);
    };
    const TensorRef& cnt = r.layout == Layout::kExpertContiguous ? r.counts : r.masked_m;
    for (int64_t l = 0; l < cnt.size(0); ++l)
        if (static_cast<const int32_t*>(cnt.data)[l] != want.counts[static_cast<size_t>(l)]) return false;
    const int scols = fp8 ? scale_columns(c.scale_format, c.hidden) : 0;
    for (int64_t i = 0; i < rows; ++i) {
        const float w = static_cast<const float*>(r.recv_weights.data)[flat(r.recv_weights, i)];
        if (std::memcmp(&w, &want.recv_weights[static_cast<size_t>(i)], 4) != 0) return false;
        if (static_cast<const int32_t*>(r.recv_src.data)[flat(r.recv_src, i)] != want.recv_src[static_cast<size_t>(i)])
            return false;
        if (r.layout == Layout::kExpertContiguous &&
            static_cast<const int32_t*>(r.m_indices.data)[flat(r.m_indices, i)] !=
                want.m_indices[static_cast<size_t>(i)])
            return false;
        if (!want.row_is_real[static_cast<size_t>(i)] && !zero_padding) continue;
        const int64_t x_off = r.recv_x.ndim() == 2 ? i * r.recv_x.stride(0)
                                                   : (i / r.recv_x.size(1)) * r.recv_x.stride(0) +
                                                         (i % r.recv_x.size(1)) * r.recv_x.stride(1);
        if (std::memcmp(static_cast<const uint8_t*>(r.recv_x.data) + static_cast<size_t>(x_off) * xe,
                        &want.recv_x[static_cast<size_t>(i * h) * xe], static_cast<size_t>(h) * xe) != 0)
            return false;
        for (int col = 0; col < scols; ++col) {
            const TensorRef& s = *r.recv_scales;
            const int64_t off = s.ndim() == 2
                                    ? i * s.stride(0) + col * s.stride(1)
                                    : (i / s.size(1)) * s.stride(0) + (i % s.size(1)) * s.stride(1) + col * s.stride(2);
            if (static_cast<const uint32_t*>(s.data)[off] != want.recv_scales[static_cast<size_t>(i * scols + col)])
                return false;
        }
    }
    return true;
}

void fuzz_one(FuzzedDataProvider& in) {
    const int ranks = in.ConsumeIntegralInRange(1, 3);
    const BufferConfig base = fuzz_config(in, ranks);
    std::vector<BufferConfig> cfgs(static_cast<size_t>(ranks), base);
    if (ranks > 1 && in.ConsumeIntegralInRange(0, 15) == 0) {
        BufferConfig& odd = cfgs[static_cast<size_t>(in.ConsumeIntegralInRange(0, ranks - 1))];
        switch (in.ConsumeIntegralInRange(0, 3)) {
            case 0:
                odd.hidden += 8;
                break;
            case 1:
                odd.scale_format = ScaleFormat::kUE8M0G32;
                break;
            case 2:
                odd.num_topk = 0;
                break;
            default:
                odd.timeout = std::chrono::milliseconds(11);
                break;
        }
    }
    auto groups = ThreadGroup::create(ranks, std::chrono::milliseconds(5000));
    std::vector<std::shared_ptr<Buffer>> bufs(static_cast<size_t>(ranks));
    auto created = run_ranks(ranks, [&](int r) {
        bufs[static_cast<size_t>(r)] =
            Buffer::create(groups[static_cast<size_t>(r)], cfgs[static_cast<size_t>(r)], BackendKind::kCPU);
    });
    int built = 0;
    for (int r = 0; r < ranks; ++r) built += bufs[static_cast<size_t>(r)] != nullptr;
    if (built != 0 && built != ranks) fail("Buffer::create succeeded on some ranks only");
    if (built == 0) return;
    const BufferConfig& c = base;

    const int rounds = in.ConsumeIntegralInRange(1, 3);
    for (int round = 0; round < rounds && in.remaining_bytes() > 0; ++round) {
        DispatchArgs shared;
        shared.layout = in.ConsumeBool() ? Layout::kExpertMasked : Layout::kExpertContiguous;
        shared.expert_alignment = in.ConsumeIntegralInRange(0, 9);
        shared.host_sync = in.ConsumeBool();
        shared.zero_padding = in.ConsumeBool();
        shared.scales_mn_major =
            in.ConsumeBool() && (c.payload == Payload::kFP8 || in.ConsumeIntegralInRange(0, 7) == 0);
        const bool prequant = c.payload == Payload::kFP8 && in.ConsumeBool();
        const bool idx64 = in.ConsumeBool(), weights = in.ConsumeBool(), caller_outputs = in.ConsumeBool();
        const int pad = in.ConsumeIntegralInRange(0, 3) == 0 ? in.ConsumeIntegralInRange(1, 5) : 0;
        const bool weighted = weights && in.ConsumeBool();
        const bool bias = in.ConsumeBool(), caller_out = in.ConsumeBool();
        std::vector<RankCall> calls(static_cast<size_t>(ranks));
        for (int r = 0; r < ranks; ++r)
            build_call(in, c, ranks, r, shared, prequant, idx64, weights, pad, caller_outputs,
                       calls[static_cast<size_t>(r)]);
        const bool bad_y = in.ConsumeIntegralInRange(0, 63) == 0;

        run_ranks(ranks, [&](int r) {
            RankCall& call = calls[static_cast<size_t>(r)];
            try {
                call.result = bufs[static_cast<size_t>(r)]->dispatch(call.args);
            } catch (const Error& e) {
                call.dispatch_error = e;
                return;
            }
            DispatchResult& d = *call.result;
            if (!d.handle.valid()) fail("dispatch returned an invalid handle");
            const int64_t rows = d.recv_x.ndim() == 2 ? d.recv_x.size(0) : d.recv_x.size(0) * d.recv_x.size(1);
            call.y_canonical.resize(static_cast<size_t>(rows * c.hidden));
            for (size_t i = 0; i < call.y_canonical.size(); ++i)
                call.y_canonical[i] = small_bf16(static_cast<uint8_t>(i * 7 + static_cast<size_t>(r) * 13));
            call.y_mem = std::make_unique<Guarded>(call.y_canonical.size() * 2, 0);
            if (!call.y_canonical.empty())
                std::memcpy(call.y_mem->data(), call.y_canonical.data(), call.y_canonical.size() * 2);
            CombineArgs ca;
            ca.y = TensorRef::contiguous(call.y_mem->data(), DType::kBFloat16, d.recv_x.shape);
            if (bad_y && r == 0) ca.y.shape[0] += 1;
            ca.weighted = weighted;
            const int64_t t = call.in.num_tokens;
            if (bias) {
                call.bias.resize(static_cast<size_t>(t * c.hidden));
                for (size_t i = 0; i < call.bias.size(); ++i)
                    call.bias[i] = small_bf16(static_cast<uint8_t>(i * 3 + 1));
                call.bias_mem = std::make_unique<Guarded>(call.bias.size() * 2, 0);
                if (!call.bias.empty()) std::memcpy(call.bias_mem->data(), call.bias.data(), call.bias.size() * 2);
                ca.bias = TensorRef::contiguous(call.bias_mem->data(), DType::kBFloat16, {t, c.hidden});
            }
            if (caller_out) {
                call.out_mem = std::make_unique<Guarded>(static_cast<size_t>(t * c.hidden) * 2, 0);
                ca.out = TensorRef::contiguous(call.out_mem->data(), DType::kBFloat16, {t, c.hidden});
            }
            try {
                CombineResult cr = bufs[static_cast<size_t>(r)]->combine(std::move(d.handle), ca);
                call.out_canonical.resize(static_cast<size_t>(t * c.hidden));
                for (int64_t i = 0; i < t; ++i)
                    std::memcpy(&call.out_canonical[static_cast<size_t>(i * c.hidden)],
                                static_cast<const uint16_t*>(cr.out.data) + i * cr.out.stride(0),
                                static_cast<size_t>(c.hidden) * 2);
            } catch (const Error& e) {
                call.combine_error = e;
            }
            call.handle_valid_after = d.handle.valid();
        });

        bool all_dispatched = true, all_combined = true;
        for (RankCall& call : calls) {
            for (auto& o : call.outputs)
                if (!o->intact()) fail("a write outside a caller-provided dispatch output");
            for (auto* g : {call.y_mem.get(), call.bias_mem.get(), call.out_mem.get()})
                if (g != nullptr && !g->intact()) fail("a write outside a combine tensor");
            if (checksum(call.storage) != call.input_sum) fail("an input was modified");
            if (call.result && call.handle_valid_after) fail("a handle stayed valid after its combine");
            all_dispatched &= call.result.has_value();
            all_combined &= call.result.has_value() && !call.combine_error;
        }
        // A rank that failed alone left its peers to time out: their buffers are unusable now, and one
        // more round would only wait for that again.
        if (!all_dispatched) break;
        std::vector<ref::RankInput> inputs;
        for (RankCall& call : calls) inputs.push_back(call.in);
        // (the masked layout ignores expert_alignment; the oracle wants one >= 1 anyway)
        ref::DispatchOptions opt{shared.layout, std::max(shared.expert_alignment, 1), shared.host_sync,
                                 shared.zero_padding};
        if (shared.host_sync)
            for (const auto& i : inputs)
                if (ref::first_invalid_route(c, i).token >= 0)
                    fail("a host-sync dispatch succeeded with an invalid route");
        const auto want = ref::dispatch(c, ranks, inputs, opt);
        for (int r = 0; r < ranks; ++r)
            if (!equal_to_oracle(c, *calls[static_cast<size_t>(r)].result, want[static_cast<size_t>(r)],
                                 shared.zero_padding))
                fail("dispatch differs from the oracle on rank", std::to_string(r));
        if (!all_combined) break;
        std::vector<std::vector<uint16_t>> ys, biases;
        for (RankCall& call : calls) {
            ys.push_back(call.y_canonical);
            biases.push_back(call.bias);
        }
        const auto want_out =
            ref::combine(c, ranks, inputs, opt, ys, weighted, bias ? biases : std::vector<std::vector<uint16_t>>{});
        for (int r = 0; r < ranks; ++r)
            if (calls[static_cast<size_t>(r)].out_canonical != want_out[static_cast<size_t>(r)])
                fail("combine differs from the oracle on rank", std::to_string(r));
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    FuzzedDataProvider in(data, size);
    fuzz_one(in);
    return 0;
}
