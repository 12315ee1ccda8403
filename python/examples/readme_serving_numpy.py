import concurrent.futures as cf
import ml_dtypes
import numpy as np
import elasticep as ep
from elasticep import serving

R, E, K, H, I, T = 2, 8, 2, 256, 128, 16  # ranks, experts, top-k, hidden, expert width, tokens per rank
dsv3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
quant = serving.check_expert_quant(dsv3)  # the checkpoint's quantization_config: FP8 with 128x128 blocks
serving.check_serving_budget(T, chunked_prefill_size=T, cuda_graph_max_bs=T)  # no step may exceed T tokens
groups = ep.ThreadGroup(R)  # ranks as threads, CPU backend

def rank_main(r):
    rng = np.random.default_rng(r)
    buf = serving.serving_buffer(groups[r], E, K, H, T, quant=quant, backend="cpu")
    disp = serving.MoeDispatcher(buf)  # decode: masked slab, no host sync; prefill: 128-aligned rows
    experts = serving.ReferenceMoeLayer.synthetic(quant, E // R, H, I, first_expert=r * E // R)
    x = rng.standard_normal((T, H)).astype(ml_dtypes.bfloat16)
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :K]  # top-k expert ids (int64)
    w = rng.random((T, K)).astype(np.float32)
    outs = [disp.combine(experts(disp.dispatch(x, idx, w, phase=p))) for p in ("prefill", "decode")]
    np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))  # the same bytes on the CPU
    return experts.path

with cf.ThreadPoolExecutor(R) as pool:
    print("prefill == decode on every rank; expert GEMMs:", list(pool.map(rank_main, range(R))))
