"""The real DeepGEMM fed straight from ElasticEP's dispatch, on one GPU (ranks as threads).

Skipped, with the reason, without torch, a CUDA device, the CUDA backend or an importable
``deep_gemm``; the GEMM tests also need DeepGEMM's sm90 kernels (Hopper). Run in one go with ``-s``
for the summary printed at the end:

    PYTHONPATH=build-gpu/python:<deep_gemm dir> python -m pytest -q -s tests/python/test_deepgemm.py

- prefill: the contiguous dispatch (alignment from ``get_mk_alignment_for_contiguous_layout()``, FP8
  with fp32 1x128 scales MN-major TMA-aligned) -> ``m_grouped_fp8_gemm_nt_contiguous`` with our
  ``m_indices``; decode: the masked slab -> ``m_grouped_fp8_gemm_nt_masked`` with our ``masked_m`` and
  ``expected_m``; both inside the whole expert FFN (elasticep.integrations.deepgemm), then combine,
  on 1, 2, 4 and 8 ranks. DeepGEMM's own scale-layout step is run on the dispatch's scales and must
  return the very same tensor (no copy), and A must be K-major and contiguous where it lies.
- The result must pass docs/SERVING.md section 6 against the numpy dense reference (tests/python/
  moe_dense.py): RMS(err) / RMS(sigma) <= 1.5; the reference MoE layer (cuBLASLt) on the same
  dispatch is held to the same bound, and the two paths must agree within the sum of both (3.0).
- The decode layer (dispatch -> DeepGEMM FFN -> combine) is captured in a CUDA graph per rank and
  replayed with new inputs. The slab's rows per expert (R*C) are a multiple of 128: DeepGEMM's masked
  kernel stores whole 64/128-row blocks (the FFN refuses other slabs, tested).
- Packed UE8M0 (Blackwell's format): our ``ue8m0_g128`` dispatch scales against DeepGEMM's own
  ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` of independently computed power-of-two scales:
  shape, strides and every word.
"""

import threading

import numpy as np
import pytest

import moe_dense as D
import oracle as O
from conftest import ep, run_ranks

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if not ep.backend_available("cuda"):
    pytest.skip("the CUDA backend is not compiled in or not usable", allow_module_level=True)
from elasticep.integrations import deepgemm as DG  # noqa: E402

try:
    dg = DG.load_deep_gemm()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

S = ep.serving
ARCH = torch.cuda.get_device_capability()[0]
needs_sm90 = pytest.mark.skipif(ARCH != 9, reason="DeepGEMM's f32_g128 FP8 kernels are sm90 (Hopper); this GPU is "
                                "sm%d0" % ARCH)
DSV3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
H, I, EL, K, SEED = 512, 256, 4, 4, 5  # E_local fixed, so the kernels' shapes (N, K, groups) do not change with R
DECODE_C = 128  # decode capacity: R*C must be a multiple of DG.MASKED_ROW_MULTIPLE (DeepGEMM stores whole blocks)
SUMMARY = []


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    print("\n==== DeepGEMM on ElasticEP dispatch: summary (GPU sm%d0, DeepGEMM %s, alignment %d) ===="
          % (ARCH, getattr(dg, "__version__", "?"), dg.get_mk_alignment_for_contiguous_layout()))
    for line in SUMMARY:
        print("  " + line)


def cuda_bf16(a):
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()


def bits(t):
    return t.detach().cpu().view(torch.int16).numpy().view(np.uint16)


def run_threads(R, fn):
    """conftest.run_ranks with the long waits DeepGEMM's first JIT compiles need."""
    return run_ranks(R, fn, timeout=900.0, group_timeout=600.0)


def layer_inputs(R, T, E, seed):
    out = []
    for r in range(R):
        rng = np.random.default_rng(seed * 10 + r)
        x = O.f32_to_bf16(rng.uniform(-1, 1, (T, H)).astype(np.float32))
        idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
        idx[rng.random((T, K)) < 0.1] = -1
        w = (rng.uniform(0.1, 1.0, (T, K)) * 2.5).astype(np.float32)
        out.append((x, idx, w))
    return out


def ratios(outs, inputs, E, dequant=False):
    experts = D.weights_f64(S.synthetic_expert_weights("fp8_block128", E, H, I, seed=SEED))
    got = []
    for r, (x, idx, w) in enumerate(inputs):
        ref, var = D.moe(x, idx, w, experts, True, None, dequant=dequant)
        got.append((ref, var, D.rms_ratio(outs[r], ref, var)))
    return got


def check_zero_copy(d, rows_hint):
    """DeepGEMM's own scale step returns our scales untouched and A is K-major where it lies."""
    rep = DG.zero_copy_report(d)
    x, sx = d.hidden_states, d.hidden_states_scale
    assert rep["no_copy"], "DeepGEMM would copy: %s" % rep
    assert rep["sfa_after_ptr"] == sx.data_ptr() and rep["a_ptr"] == x.data_ptr()
    pad = (rows_hint + 3) // 4 * 4
    if d.layout == "masked":
        assert x.is_contiguous() and sx.stride() == (H // 128 * pad, 1, pad)
        assert d.masked_m.dtype == torch.int32 and d.masked_m.is_contiguous() and d.expected_m >= 1
    else:
        assert x.is_contiguous() and (d.num_rows == 0 or sx.stride() == (1, pad))
        a = dg.get_mk_alignment_for_contiguous_layout()
        offs = d.offsets.cpu().numpy()
        counts = d.counts.cpu().numpy()
        mi = d.m_indices.cpu().numpy()
        assert (offs % a == 0).all() and d.num_rows == offs[-1] and d.num_rows % a == 0
        for l in range(len(counts)):  # real rows first in each segment: DeepGEMM skips blocks led by -1
            seg = mi[offs[l]:offs[l + 1]]
            assert (seg[:counts[l]] == l).all() and (seg[counts[l]:] == -1).all()
    return rep


# ---- both phases through the whole FFN, against the dense reference and the cuBLASLt layer -------


@needs_sm90
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_deepgemm_ffn_on_dispatch_outputs(phase, R):
    E = EL * R
    T = 48 if phase == "prefill" else 16
    C = T if phase == "prefill" else DECODE_C
    inputs = layer_inputs(R, T, E, seed=R + (0 if phase == "prefill" else 50))
    notes = []

    def body(r, g):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            buf = S.serving_buffer(g, E, K, H, C, quant=DSV3, backend="cuda", cached=False, timeout=600)
            disp = S.MoeDispatcher(buf, expert_alignment=dg.get_mk_alignment_for_contiguous_layout())
            experts = DG.DeepGemmExperts.synthetic(EL, H, I, first_expert=r * EL, seed=SEED)
            ref_layer = S.ReferenceMoeLayer.synthetic("fp8_block128", EL, H, I, first_expert=r * EL, seed=SEED,
                                                      like=torch.device("cuda"))
            notes.append(ref_layer.path_note)
            x, idx, w = inputs[r]
            xt, it, wt = cuda_bf16(x), torch.from_numpy(idx).cuda(), torch.from_numpy(w).cuda()
            d = disp.dispatch(xt, it, wt, phase=phase)
            assert d.scale_format == "f32_g128" and d.hidden_states.dtype == torch.float8_e4m3fn
            check_zero_copy(d, d.max_m if d.layout == "masked" else d.num_rows)
            a_ptr, s_ptr = d.hidden_states.data_ptr(), d.hidden_states_scale.data_ptr()
            y = experts(d)
            assert d.hidden_states.data_ptr() == a_ptr and d.hidden_states_scale.data_ptr() == s_ptr
            out_dg = disp.combine(y).clone()
            d = disp.dispatch(xt, it, wt, phase=phase)  # the same inputs again, for the cuBLASLt layer
            out_ref = disp.combine(ref_layer(d)).clone()
            torch.cuda.current_stream().synchronize()
            return bits(out_dg), bits(out_ref)

    outs = run_threads(R, body)
    got_dg = ratios([o[0] for o in outs], inputs, E)
    got_ref = ratios([o[1] for o in outs], inputs, E, dequant="DEQUANTIZED" in notes[0])
    for r in range(R):
        ref, var, rd = got_dg[r]
        rr = got_ref[r][2]
        diff = float(np.sqrt(np.mean((O.bf16_to_f32(outs[r][0]).astype(np.float64)
                                      - O.bf16_to_f32(outs[r][1]).astype(np.float64)) ** 2)) / np.sqrt(np.mean(var)))
        SUMMARY.append("%-7s R=%d rank %d: DeepGEMM rms err/sigma %.3f | reference layer %.3f | DeepGEMM vs reference "
                       "%.3f  (bound 1.5 / 1.5 / 3.0)" % (phase, R, r, rd, rr, diff))
        assert rd <= 1.5, "rank %d: DeepGEMM layer rms err / sigma %.3f" % (r, rd)
        assert rr <= 1.5, "rank %d: reference layer rms err / sigma %.3f (%s)" % (r, rr, notes[0])
        assert diff <= 3.0, "rank %d: DeepGEMM vs reference layer %.3f" % (r, diff)
    if R == 1:
        SUMMARY.append("reference layer path: %s" % notes[0])


@needs_sm90
def test_deepgemm_detects_a_wrong_expert_order():
    """The check above can fail: expert weights shifted by one local expert break the bound."""
    R, E, T = 2, 2 * EL, 48
    inputs = layer_inputs(R, T, E, seed=77)

    def body(r, g):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            buf = S.serving_buffer(g, E, K, H, T, quant=DSV3, backend="cuda", cached=False, timeout=600)
            disp = S.MoeDispatcher(buf, expert_alignment=dg.get_mk_alignment_for_contiguous_layout())
            w = S.synthetic_expert_weights("fp8_block128", EL, H, I, first_expert=r * EL, seed=SEED,
                                           like=torch.device("cuda"))
            # local expert e gets expert e - 1's weights (an index select: torch.roll has no fp8 kernel)
            shift = torch.roll(torch.arange(EL, device="cuda"), 1)
            roll = lambda t: t.contiguous().view(torch.uint8).index_select(0, shift).view(t.dtype)  # noqa: E731
            experts = DG.DeepGemmExperts(roll(w["gate_up"]), roll(w["gate_up_scales"]), roll(w["down"]),
                                         roll(w["down_scales"]))
            x, idx, wt = inputs[r]
            d = disp.dispatch(cuda_bf16(x), torch.from_numpy(idx).cuda(), torch.from_numpy(wt).cuda(), phase="prefill")
            out = disp.combine(experts(d)).clone()
            torch.cuda.current_stream().synchronize()
            return bits(out)

    outs = run_threads(R, body)
    worst = min(g[2] for g in ratios(outs, inputs, E))
    SUMMARY.append("negative control (experts rolled by one): rms err/sigma %.1f (must exceed 1.5)" % worst)
    assert worst > 1.5


@needs_sm90
def test_masked_slab_rows_must_be_whole_deepgemm_blocks():
    g = ep.ThreadGroup(1)[0]
    buf = S.serving_buffer(g, EL, K, H, 48, quant=DSV3, backend="cuda", cached=False)
    disp = S.MoeDispatcher(buf)
    experts = DG.DeepGemmExperts.synthetic(EL, H, I, seed=SEED)
    x = torch.zeros(4, H, dtype=torch.bfloat16, device="cuda")
    d = disp.dispatch(x, torch.zeros(4, K, dtype=torch.int64, device="cuda") - 1, phase="decode")
    with pytest.raises(ep.InvalidArgumentError, match="multiple of 128"):
        experts(d)
    disp.release()


# ---- decode in a CUDA graph -----------------------------------------------------------------------


@needs_sm90
@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_decode_layer_captured_in_a_cuda_graph(R):
    E, T, C = EL * R, 16, DECODE_C
    rounds = [layer_inputs(R, T, E, seed=s) for s in (101, 102, 103)]
    barrier = threading.Barrier(R)

    def body(r, g):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            buf = S.serving_buffer(g, E, K, H, C, quant=DSV3, backend="cuda", cached=False, timeout=600)
            disp = S.MoeDispatcher(buf)
            experts = DG.DeepGemmExperts.synthetic(EL, H, I, first_expert=r * EL, seed=SEED)
            x = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
            idx = torch.zeros(T, K, dtype=torch.int64, device="cuda")
            w = torch.zeros(T, K, dtype=torch.float32, device="cuda")
            out = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
            y = torch.zeros(EL, R * C, H, dtype=torch.bfloat16, device="cuda")

            def load(inputs):
                xs, ids, ws = inputs[r]
                x.copy_(cuda_bf16(xs))
                idx.copy_(torch.from_numpy(ids))
                w.copy_(torch.from_numpy(ws))

            def step():
                d = disp.dispatch(x, idx, w, phase="decode")
                experts.forward(d, y)
                disp.combine(y, out=out)

            load(rounds[0])
            step()  # warm-up outside the capture: DeepGEMM's JIT kernels, buffer outputs, FFN scratch
            torch.cuda.current_stream().synchronize()
            barrier.wait()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
                step()
            barrier.wait()
            got = []
            for inputs in rounds:
                load(inputs)
                torch.cuda.current_stream().synchronize()
                barrier.wait()
                graph.replay()
                torch.cuda.current_stream().synchronize()
                got.append(bits(out).copy())
                barrier.wait()
            buf.check()
            return got

    outs = run_threads(R, body)
    worst = 0.0
    for i, inputs in enumerate(rounds):
        for ref, var, ratio in ratios([outs[r][i] for r in range(R)], inputs, E):
            worst = max(worst, ratio)
    SUMMARY.append("decode CUDA graph R=%d: 3 replays with new inputs, worst rms err/sigma %.3f (bound 1.5)"
                   % (R, worst))
    assert worst <= 1.5
    assert not np.array_equal(outs[0][0], outs[0][1]), "replays with new inputs must give new outputs"


# ---- the SGLang dispatcher's outputs into DeepGEMM ------------------------------------------------


@needs_sm90
def test_sglang_dispatcher_outputs_feed_deepgemm():
    try:
        import elasticep.integrations.sglang as SG
    except ImportError as e:
        pytest.skip(str(e))
    import collections

    TopK = collections.namedtuple("StandardTopKOutput", "topk_weights topk_ids router_logits")
    R, E, T = 2, 2 * EL, 32
    inputs = layer_inputs(R, T, E, seed=202)

    def body(r, g):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            res = []
            for mode in ("low_latency", "normal"):
                d = SG.ElasticEPDispatcher(g, K, num_experts=E, num_local_experts=EL, hidden_size=H,
                                           params_dtype=torch.bfloat16, deepep_mode=mode, max_tokens_per_rank=64,
                                           quantization_config=DSV3, backend="cuda", cached=False, timeout=600,
                                           expert_alignment=dg.get_mk_alignment_for_contiguous_layout())
                experts = DG.DeepGemmExperts.synthetic(EL, H, I, first_expert=r * EL, seed=SEED)
                x, idx, w = inputs[r]
                out = d.dispatch(cuda_bf16(x), TopK(torch.from_numpy(w).cuda(), torch.from_numpy(idx).cuda(), None))
                assert DG.zero_copy_report(out)["no_copy"]
                y = experts(out)
                ci = (SG.ElasticEPLLCombineInput if mode == "low_latency" else SG.ElasticEPContiguousCombineInput)(
                    y, out.topk_ids, out.topk_weights)
                res.append(bits(d.combine(ci)))
            torch.cuda.current_stream().synchronize()
            return res

    outs = run_threads(R, body)
    for j, mode in enumerate(("low_latency", "normal")):
        for ref, var, ratio in ratios([o[j] for o in outs], inputs, E):
            SUMMARY.append("SGLang dispatcher %-11s -> DeepGEMM: rms err/sigma %.3f" % (mode, ratio))
            assert ratio <= 1.5


# ---- packed UE8M0 against DeepGEMM's packing ------------------------------------------------------


def pow2_scales(x):
    """fp32 power-of-two scales 2^ceil(log2(amax / 448)) per 1x128 group, computed here from the
    bits (DeepGEMM's ceil_to_ue8m0 rule) from bf16 x [T, Hd]."""
    t, hd = x.shape
    amax = x.float().view(t, hd // 128, 128).abs().amax(-1).clamp_min(1e-4)
    q = (amax / torch.full_like(amax, 448.0)).view(torch.int32)
    exp = ((q >> 23) & 0xFF) + ((q & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


@pytest.mark.parametrize("hd", [640, 7168])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_ue8m0_scales_are_deepgemms_packing(hd, layout):
    if not hasattr(dg, "get_mn_major_tma_aligned_packed_ue8m0_tensor"):
        pytest.skip("this deep_gemm has no get_mn_major_tma_aligned_packed_ue8m0_tensor")
    R, E, T = 2, 2 * EL, 24
    xs = [(torch.rand(T, hd) * 2 - 1).mul_(torch.logspace(-3, 2, hd)).to(torch.bfloat16) for _ in range(R)]
    ids = [torch.argsort(torch.rand(T, E), dim=1)[:, :K] for _ in range(R)]
    checked = []

    def body(r, g):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            buf = ep.Buffer(g, E, K, hd, T, payload="fp8", scale_format="ue8m0_g128", backend="cuda", timeout=600)
            res = buf.dispatch(xs[r].cuda(), ids[r].cuda(), layout=layout, expert_alignment=128 if layout ==
                               "contiguous" else 1, zero_padding=True, scales_mn_major=True)
            got = res.recv_scales
            # the fp32 scale of each received row from its source token (0 on padding rows)
            src = res.recv_src.cpu().long()
            real = (res.m_indices.cpu() >= 0) if layout == "contiguous" else (
                torch.arange(R * T).view(1, -1) < res.masked_m.cpu().view(-1, 1))
            token_scales = torch.cat([pow2_scales(x) for x in xs])  # [R*T, G] in s * C + t order (C = T)
            rows = torch.where(real.unsqueeze(-1), token_scales[src.clamp_min(0)], torch.zeros(()))
            want = dg.get_mn_major_tma_aligned_packed_ue8m0_tensor(rows.cuda().contiguous())
            torch.cuda.current_stream().synchronize()
            assert got.dtype == torch.int32 == want.dtype
            assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
            assert got.stride() == want.stride(), (got.stride(), want.stride())
            assert torch.equal(got.cpu(), want.cpu()), "packed words differ at %s" % (
                (got.cpu() != want.cpu()).nonzero()[:4].tolist(),)
            checked.append((tuple(got.shape), tuple(got.stride()), int(real.sum())))
            return None

    run_threads(R, body)
    SUMMARY.append("ue8m0_g128 %-10s H=%d: shape %s strides %s equal to DeepGEMM's packing (%d real rows + zero "
                   "padding)" % (layout, hd, checked[0][0], checked[0][1], checked[0][2]))
