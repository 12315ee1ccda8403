// The README's example: 2 ranks as threads, 8 experts, top-2, bf16; experts are the identity, so
// combine returns each token times the sum of its weights (here 1.0: the token itself).
#include <cstdio>
#include <elasticep/elasticep.hpp>
#include <thread>
#include <vector>

using namespace elasticep;

int run_rank(std::shared_ptr<Group> group) {
    BufferConfig cfg{.num_experts = 8, .num_topk = 2, .hidden = 128, .max_tokens_per_rank = 4};
    auto buffer = Buffer::create(group, cfg, BackendKind::kCPU);
    const int t = 4, r = group->rank();
    std::vector<uint16_t> x(t * 128, 0x4040);             // bf16 3.0
    std::vector<int32_t> idx = {0, 5, 7, 2, 3, 4, r, 6};  // top-2 expert ids per token
    std::vector<float> w(t * 2, 0.5f);
    DispatchArgs d{.x = TensorRef::contiguous(x.data(), DType::kBFloat16, {t, 128}),
                   .topk_idx = TensorRef::contiguous(idx.data(), DType::kInt32, {t, 2}),
                   .topk_weights = TensorRef::contiguous(w.data(), DType::kFloat32, {t, 2})};
    DispatchResult res = buffer->dispatch(d);  // res.recv_x: rows grouped by local expert
    CombineResult out = buffer->combine(std::move(res.handle), {.y = res.recv_x});
    const auto* o = out.out.data_as<uint16_t>();
    for (int i = 0; i < t * 128; ++i)
        if (o[i] != 0x4040) return std::printf("rank %d: mismatch at %d\n", r, i), 1;
    std::printf("rank %d: received %lld rows, combine ok\n", r, (long long)res.num_rows);
    return 0;
}

int main() {
    auto groups = ThreadGroup::create(2);
    int rc[2] = {1, 1};
    std::thread t0([&] { rc[0] = run_rank(groups[0]); }), t1([&] { rc[1] = run_rank(groups[1]); });
    t0.join(), t1.join();
    return rc[0] | rc[1];
}
