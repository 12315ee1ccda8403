import concurrent.futures as cf
import ml_dtypes
import numpy as np
import elasticep as ep

R, E, K, H, T = 2, 8, 2, 256, 16
groups = ep.ThreadGroup(R)  # ranks as threads, CPU backend

def rank_main(r):
    rng = np.random.default_rng(r)
    buf = ep.get_buffer(groups[r], num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T, backend="cpu")
    x = rng.standard_normal((T, H)).astype(ml_dtypes.bfloat16)
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :K]  # top-k expert ids (int64)
    w = rng.random((T, K)).astype(np.float32)
    res = buf.dispatch(x, idx, w, expert_alignment=8)  # numpy in -> numpy out
    y = (res.recv_x.astype(np.float32) * 2).astype(ml_dtypes.bfloat16)  # your experts here
    out = buf.combine(y, res.handle)  # [T, H] bf16
    np.testing.assert_allclose(out.astype(np.float32), 2 * x.astype(np.float32) * w.sum(1, keepdims=True),
                               rtol=2e-2, atol=2e-2)
    return res.counts.tolist()

with cf.ThreadPoolExecutor(R) as pool:
    print("rows per local expert:", list(pool.map(rank_main, range(R))))
