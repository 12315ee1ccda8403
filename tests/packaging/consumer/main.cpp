// A program outside the source tree, built against the installed package: one rank, one token,
// two experts; checks the dispatch and combine results by hand.
#include <cstdio>
#include <elasticep/elasticep.hpp>
#include <vector>

int main() {
    using namespace elasticep;
    BufferConfig cfg;
    cfg.num_experts = 2;
    cfg.num_topk = 2;
    cfg.hidden = 8;
    cfg.max_tokens_per_rank = 1;
    auto buf = Buffer::create(ThreadGroup::create(1)[0], cfg, BackendKind::kCPU);
    std::vector<uint16_t> x(8, 0x3f80);  // bf16 1.0
    std::vector<int32_t> idx = {1, 0};
    std::vector<float> w = {0.5f, 0.25f};
    DispatchArgs d;
    d.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {1, 8});
    d.topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {1, 2});
    d.topk_weights = TensorRef::contiguous(w.data(), DType::kFloat32, {1, 2});
    DispatchResult r = buf->dispatch(d);
    if (r.num_rows != 2) return std::printf("expected 2 rows, got %lld\n", (long long)r.num_rows), 1;
    CombineArgs c;
    c.y = r.recv_x;  // identity experts: out = (0.5 + 0.25) * 1.0 = 0.75 = bf16 0x3f40
    const auto* out = static_cast<const uint16_t*>(buf->combine(std::move(r.handle), c).out.data);
    for (int h = 0; h < 8; ++h)
        if (out[h] != 0x3f40) return std::printf("out[%d] = 0x%04x, expected 0x3f40\n", h, out[h]), 1;
    std::printf("consumer ok: elasticep %s (%s)\n", version_string(), build_backends());
    return 0;
}
