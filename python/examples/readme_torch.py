import concurrent.futures as cf
import torch
import elasticep as ep

R, E, K, H, T = 2, 8, 2, 256, 16  # ranks, experts, top-k, hidden size, tokens per rank
groups = ep.ThreadGroup(R)  # ranks as threads here; under torchrun pass ep.TorchGroup() instead
dev = "cuda" if ep.backend_available("cuda") else "cpu"  # what the buffer's "auto" backend picks

def rank_main(r):
    with torch.cuda.stream(torch.cuda.Stream() if dev == "cuda" else None):  # one stream per rank
        buf = ep.get_buffer(groups[r], num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)
        x = torch.randn(T, H, device=dev).bfloat16()
        w, idx = torch.randn(T, E, device=dev).softmax(-1).topk(K)  # router: fp32 weights, int64 ids
        res = buf.dispatch(x, idx, w, expert_alignment=8)  # rows grouped per local expert
        y = res.recv_x * 2  # stand-in expert op (a grouped GEMM over res.m_indices goes here)
        out = buf.combine(y, res.handle)  # [T, H] bf16: sum over k of w_k * y_k
        torch.testing.assert_close(out.float(), 2 * x.float() * w.sum(-1, keepdim=True), rtol=2e-2, atol=2e-2)
        return res.counts.tolist()

with cf.ThreadPoolExecutor(R) as pool:
    print("combine == 2 * x * sum(w) on every rank; rows per local expert:", list(pool.map(rank_main, range(R))))
