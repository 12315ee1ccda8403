import concurrent.futures as cf
import torch
import elasticep as ep
from elasticep import serving

R, E, K, H, I, T = 2, 8, 2, 256, 128, 16  # ranks, experts, top-k, hidden, expert width, tokens per rank
dsv3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
quant = serving.check_expert_quant(dsv3)  # the checkpoint's quantization_config: FP8 with 128x128 blocks
serving.check_serving_budget(T, chunked_prefill_size=T, cuda_graph_max_bs=T)  # no step may exceed T tokens
groups, dev = ep.ThreadGroup(R), ("cuda" if ep.backend_available("cuda") else "cpu")

def rank_main(r):
    with torch.cuda.stream(torch.cuda.Stream() if dev == "cuda" else None):
        buf = serving.serving_buffer(groups[r], E, K, H, T, quant=quant)  # fp8 dispatch, scales for this GPU
        disp = serving.MoeDispatcher(buf)  # decode: masked slab, no host sync; prefill: 128-aligned rows
        experts = serving.ReferenceMoeLayer.synthetic(quant, E // R, H, I, first_expert=r * E // R, like=torch.device(dev))
        x = torch.randn(T, H, device=dev).bfloat16()
        w, idx = torch.randn(T, E, device=dev).softmax(-1).topk(K)  # router: fp32 weights, int64 ids
        outs = [disp.combine(experts(disp.dispatch(x, idx, w, phase=p))) for p in ("prefill", "decode")]
        torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)  # [T, H]: complete, no all-reduce after
        return experts.path

with cf.ThreadPoolExecutor(R) as pool:
    print("prefill == decode on every rank; expert GEMMs:", list(pool.map(rank_main, range(R))))
