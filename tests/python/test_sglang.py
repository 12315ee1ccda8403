"""elasticep.integrations.sglang against SGLang's own token-dispatcher base classes.

Skipped, with the reason, where torch is missing or SGLang's ``token_dispatcher/base.py`` cannot be
found (install the wheel with ``pip install --no-deps --target DIR sglang-0.5.10.post1-*.whl`` and put
DIR on PYTHONPATH, or set ELASTICEP_SGLANG_BASE=/path/to/base.py). Ranks are threads of one
ThreadGroup; tensors are torch CPU tensors on the CPU backend and, where a GPU and the CUDA backend
are present, torch CUDA tensors on the CUDA backend.

A toy MoE forward runs through the dispatcher (hidden states and SGLang-shaped top-k output in,
the DEEPEP_LL / contiguous outputs through a toy expert FFN, the combine input back) and is compared
with an independent dense torch computation: each token through its top-k experts, weighted and
summed in float64. The expert outputs are bf16 on both sides (the same function of the same input
row), so the only difference is combine's rounding: per destination rank one bf16 rounding of the
partial sum and one of the total, at most 2^-7 * sum_k |w_k y_k|.
"""

import ast
import collections
import dataclasses
import os
import threading
import types

import pytest

from conftest import ep, run_ranks

try:
    import torch
except ImportError:
    pytest.skip("torch is not installed: the SGLang dispatcher works on torch tensors (pip install torch)",
                allow_module_level=True)
try:
    import elasticep.integrations.sglang as S
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

BASE = S.load_sglang_base()
DSV3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
DEVICES = ["cpu"]
if torch.cuda.is_available() and ep.backend_available("cuda"):
    DEVICES.append("cuda")


def test_loaded_from_sglang():
    origin = S.sglang_base_origin()
    version = S.sglang_version()
    print("SGLang base: %s (version %s; checked against %s)" % (origin, version, S.SGLANG_VERSION_CHECKED))
    assert issubclass(S.ElasticEPDispatcher, BASE.BaseDispatcher)
    assert S.BaseDispatcher is BASE.BaseDispatcher and S.DispatchOutputFormat is BASE.DispatchOutputFormat


# ---- SGLang's own definitions, read from its sources next to base.py --------------------------


def _sglang_source(*rel):
    """A file of SGLang's moe package, found from the loaded base.py (token_dispatcher/base.py)."""
    moe = os.path.dirname(os.path.dirname(os.path.abspath(BASE.__file__)))
    path = os.path.join(moe, *rel)
    if not os.path.isfile(path):
        pytest.skip("%s is not next to SGLang's base.py (%s): only base.py was given"
                    % (os.path.join(*rel), BASE.__file__))
    with open(path) as f:
        return ast.parse(f.read())


def _class_fields(tree, name):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    raise AssertionError("SGLang's source has no class %s" % name)


def _topk_output_type():
    """SGLang's StandardTopKOutput field list (from its topk.py where present) as a namedtuple."""
    moe = os.path.dirname(os.path.dirname(os.path.abspath(BASE.__file__)))
    path = os.path.join(moe, "topk.py")
    fields = ["topk_weights", "topk_ids", "router_logits"]  # SGLang 0.5.10.post1
    if os.path.isfile(path):
        with open(path) as f:
            fields = _class_fields(ast.parse(f.read()), "StandardTopKOutput")
    return collections.namedtuple("StandardTopKOutput", fields)


TopK = _topk_output_type()


def test_outputs_have_the_fields_and_order_of_sglangs_namedtuples():
    tree = _sglang_source("token_dispatcher", "deepep.py")
    assert list(S.ElasticEPLLDispatchOutput._fields) == _class_fields(tree, "DeepEPLLDispatchOutput")
    assert list(S.ElasticEPLLCombineInput._fields) == _class_fields(tree, "DeepEPLLCombineInput")
    # the prefill tuple starts like DeepEPNormalDispatchOutput (then the contiguous layout's own fields)
    normal = _class_fields(tree, "DeepEPNormalDispatchOutput")
    assert list(S.ElasticEPContiguousDispatchOutput._fields[:4]) == normal[:4]
    assert list(S.ElasticEPContiguousCombineInput._fields) == _class_fields(tree, "DeepEPNormalCombineInput")


def test_pre_permute_fills_what_sglangs_deep_gemm_runner_reads():
    tree = _sglang_source("moe_runner", "deep_gemm.py")
    fields = _class_fields(tree, "DeepGemmRunnerInput")
    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_run_contiguous_gemm":
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name)
                        and sub.value.id == "running_state" and isinstance(sub.slice, ast.Constant)):
                    reads.add(sub.slice.value)
    assert reads, "found no running_state reads in SGLang's _run_contiguous_gemm"
    RunnerInput = dataclasses.make_dataclass("DeepGemmRunnerInput", [(f, object, None) for f in fields])
    g = ep.ThreadGroup(1)[0]
    d = S.ElasticEPDispatcher(g, 2, num_experts=4, hidden_size=256, deepep_mode="normal", max_tokens_per_rank=8,
                              quantization_config=DSV3, backend="cpu", cached=False)
    x = torch.randn(5, 256).to(torch.bfloat16)
    out = d.dispatch(x, TopK(torch.rand(5, 2), torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]]), None))
    state = {}
    ri = S.pre_permute_contiguous_to_deep_gemm(out, None, None, state, runner_input_cls=RunnerInput)
    assert reads <= set(state), "SGLang's runner reads %s, not set" % sorted(reads - set(state))
    assert state["all_tokens"] == out.num_rows == int(out.offsets[-1]) and state["hidden_states_shape"][1] == 256
    assert ri.use_masked_gemm is False and ri.m_indices is out.m_indices and ri.hidden_states is out.hidden_states
    assert ri.hidden_states_scale is out.hidden_states_scale
    ci = S.post_permute_deep_gemm_to_contiguous(types.SimpleNamespace(hidden_states=torch.zeros(
        out.num_rows, 256, dtype=torch.bfloat16)), None, None, state)
    assert ci.format.value == "elasticep_contiguous" and ci.topk_ids is out.topk_ids
    assert d.combine(ci).shape == (5, 256)


# ---- the toy MoE forward ------------------------------------------------------------------------


class ToyExperts:
    """E experts, W1 [2I, H] and W2 [H, I] in fp32; one row at a time so both sides compute the
    same bits: y = bf16(W2 (silu(W1_gate x) * W1_up x))."""

    def __init__(self, E, H, I, device, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.w1 = (torch.rand(E, 2 * I, H, generator=gen) * 2 - 1).mul_(H ** -0.5).to(device)
        self.w2 = (torch.rand(E, H, I, generator=gen) * 2 - 1).mul_(I ** -0.5).to(device)
        self.I = I

    def __call__(self, e, row):  # row fp32 [H] -> bf16 [H]
        g = row.view(1, -1) @ self.w1[e].T
        h = torch.nn.functional.silu(g[:, :self.I]) * g[:, self.I:]
        return (h @ self.w2[e].T).to(torch.bfloat16).view(-1)


def quantize_like_dispatch(x):
    """x bf16 [T, H] -> the dequantized fp32 values dispatch's f32_g128 quantization produces
    (docs/SEMANTICS.md: amax floored at 1e-4, q = e4m3(x * (448 / amax)), scale = amax / 448)."""
    t, h = x.shape
    v = x.float().view(t, h // 128, 128)
    amax = v.abs().amax(-1).clamp_min(1e-4)
    inv = torch.full_like(amax, 448.0) / amax  # tensor / tensor: IEEE division, as the library
    q = (v * inv.unsqueeze(-1)).to(torch.float8_e4m3fn).float()
    return (q * (amax / torch.full_like(amax, 448.0)).unsqueeze(-1)).view(t, h)


def dequantize_row(x, scale):
    if scale is None:
        return x.float()
    return x.float() * scale.float().repeat_interleave(128)


def rank_inputs(r, T, E, K, H, device):
    gen = torch.Generator().manual_seed(100 + r)
    x = (torch.rand(T, H, generator=gen) * 2 - 1).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].to(torch.int32)
    idx[torch.rand(T, K, generator=gen) < 0.1] = -1  # some routes unused
    w = torch.rand(T, K, generator=gen) + 0.1
    return x.to(device), idx.to(device), w.to(device)


def expert_side(out, experts, first_expert):
    """The toy FFN over the dispatch output's real rows -> the combine input."""
    y = torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16, device=out.hidden_states.device)
    sc = out.hidden_states_scale
    if out.format.value == "deepep_ll":
        mm = out.masked_m.cpu()
        for l in range(out.hidden_states.shape[0]):
            for i in range(int(mm[l])):
                s = None if sc is None else sc[l, i]
                y[l, i] = experts(first_expert + l, dequantize_row(out.hidden_states[l, i], s))
        return S.ElasticEPLLCombineInput(y, out.topk_ids, out.topk_weights)
    mi = out.m_indices.cpu()
    for i in range(out.num_rows):
        if int(mi[i]) >= 0:
            s = None if sc is None else sc[i]
            y[i] = experts(first_expert + int(mi[i]), dequantize_row(out.hidden_states[i], s))
    return S.ElasticEPContiguousCombineInput(y, out.topk_ids, out.topk_weights)


def dense(x, idx, w, experts, fp8):
    """The independent reference: every token through its top-k experts, weighted, summed in fp64;
    plus the bound of combine's rounding."""
    xs = quantize_like_dispatch(x) if fp8 else x.float()
    ref = torch.zeros(x.shape, dtype=torch.float64)
    mag = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                y = experts(e, xs[t]).double().cpu() * float(w[t, k])
                ref[t] += y
                mag[t] += y.abs()
    return ref, mag


def check_output(got, ref, mag, what):
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == tuple(ref.shape), what
    err = (got.double().cpu() - ref).abs()
    bound = 2.0 ** -7 * mag * 1.001 + 1e-30
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert worst <= 1.0, "%s: |err| / bound = %.3f" % (what, worst)
    return worst


def check_layout(out, phase, disp, T, R, K, E, H, C, fp8):
    el = E // R
    assert out.format.value == ("deepep_ll" if phase == "decode" else "elasticep_contiguous")
    assert isinstance(out, BASE.DispatchOutput)
    assert BASE.DispatchOutputChecker.format_is_deepep_ll(out) == (phase == "decode")
    assert not BASE.DispatchOutputChecker.format_is_deepep_normal(out)
    assert out.topk_ids.dtype == torch.int64 and tuple(out.topk_ids.shape) == (T, K)
    x, sc = out.hidden_states, out.hidden_states_scale
    assert x.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    if phase == "decode":
        assert tuple(x.shape) == (el, R * C, H) and x.is_contiguous()
        assert out.masked_m.dtype == torch.int32 and tuple(out.masked_m.shape) == (el,)
        assert out.expected_m == max(1, (T * R * K + E) // E)
        if fp8:
            pad = (R * C + 3) // 4 * 4
            assert sc.dtype == torch.float32 and tuple(sc.shape) == (el, R * C, H // 128)
            assert sc.stride() == (H // 128 * pad, 1, pad)
    else:
        m = out.num_rows
        offs = out.offsets.cpu()
        assert tuple(x.shape) == (m, H) and m == int(offs[-1]) and out.expert_alignment == disp.expert_alignment
        assert all(int(o) % disp.expert_alignment == 0 for o in offs)
        assert out.m_indices.dtype == torch.int32 and tuple(out.m_indices.shape) == (m,)
        if fp8:
            assert sc.dtype == torch.float32 and tuple(sc.shape) == (m, H // 128)
            assert m == 0 or sc.stride() == (1, (m + 3) // 4 * 4)
    if not fp8:
        assert sc is None


def run_forward(device, R, Ts, mode, quant, E=8, K=3, H=256, I=64, phases=None, alignment=128):
    """The toy MoE forward on R ranks, T = Ts[r]; phases: the per-step answers of
    is_extend_in_batch for deepep_mode="auto". Returns the worst |err| / bound."""
    C = max(max(Ts), 1)
    experts = ToyExperts(E, H, I, device, seed=7)
    steps = phases or [None]
    worst = []
    lock = threading.Lock()

    def body(r, g):
        stream = torch.cuda.Stream() if device == "cuda" else None
        ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:
            state = {"extend": False}
            d = S.ElasticEPDispatcher(g, K, num_experts=E, num_local_experts=E // R, hidden_size=H,
                                      params_dtype=torch.bfloat16, deepep_mode=mode, max_tokens_per_rank=C,
                                      quantization_config=quant, backend=device, cached=False,
                                      is_extend_in_batch=lambda: state["extend"], expert_alignment=alignment)
            for step, ph in enumerate(steps):
                state["extend"] = ph == "extend"
                phase = {"normal": "extend", "low_latency": "decode"}.get(mode) or ph
                x, idx, w = rank_inputs(r + 10 * step, Ts[r], E, K, H, device)
                out = d.dispatch(x, TopK(w, idx, None))
                check_layout(out, phase, d, Ts[r], R, K, E, H, C, quant is not None)
                got = d.combine(expert_side(out, experts, r * (E // R)))
                if device == "cuda":
                    torch.cuda.current_stream().synchronize()
                ref, mag = dense(x, idx, w, experts, quant is not None)
                v = check_output(got, ref, mag, "rank %d step %d (%s, T=%d)" % (r, step, phase, Ts[r]))
                with lock:
                    worst.append(v)

    run_ranks(R, body)
    return max(worst)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", [None, DSV3], ids=["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_toy_moe_forward_matches_dense(device, quant, mode):
    worst = run_forward(device, 2, [6, 4], mode, quant)
    print("%s %s %s: worst |err| / bound %.3f" % (device, mode, "fp8" if quant else "bf16", worst))


@pytest.mark.parametrize("device", DEVICES)
def test_four_ranks_with_empty_ranks(device):
    # ranks 1 and 3 have no tokens, in both layouts (alignment 8 keeps the contiguous rows few)
    for mode in ("low_latency", "normal"):
        run_forward(device, 4, [5, 0, 3, 0], mode, DSV3, alignment=8)
    run_forward(device, 2, [0, 0], "normal", None)


@pytest.mark.parametrize("device", DEVICES)
def test_auto_mode_picks_the_phase_per_step(device):
    run_forward(device, 2, [4, 3], "auto", DSV3, phases=["decode", "extend", "extend", "decode"])


def test_auto_mode_without_sglang_needs_a_phase_source():
    g = ep.ThreadGroup(1)[0]
    d = S.ElasticEPDispatcher(g, 1, num_experts=2, hidden_size=128, max_tokens_per_rank=4, backend="cpu", cached=False)
    if "sglang.srt.layers.dp_attention" in __import__("sys").modules:
        pytest.skip("SGLang's dp_attention is importable here")
    try:
        import sglang.srt.layers.dp_attention  # noqa: F401
        pytest.skip("SGLang's dp_attention is importable here")
    except Exception:  # noqa: BLE001
        pass
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ep.InvalidArgumentError, match="is_extend_in_batch"):
        d.dispatch(x, TopK(torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int64), None))
    assert not d.dispatcher.pending


@pytest.mark.parametrize("device", DEVICES)
def test_base_class_hooks_still_work(device):
    E, K, H, I, T = 4, 2, 256, 64, 5
    experts = ToyExperts(E, H, I, device, seed=3)
    seen = []

    def body(r, g):
        d = S.ElasticEPDispatcher(g, K, num_experts=E, hidden_size=H, deepep_mode="low_latency", max_tokens_per_rank=T,
                                  backend=device, cached=False)
        x, idx, w = rank_inputs(r, T, E, K, H, device)
        handles = [
            d.register_pre_dispatch_hook(lambda disp, hs, to: (hs * 2, to)),  # exact in bf16
            d.register_post_dispatch_hook(lambda disp, out: seen.append(("post_dispatch", out.format.value))),
            d.register_pre_combine_hook(lambda disp, ci: ci._replace(hidden_states=ci.hidden_states * 0.5)),
            d.register_post_combine_hook(lambda disp, out: out * 2),
        ]
        got = d.combine(expert_side(d.dispatch(hidden_states=x, topk_output=TopK(w, idx, None)), experts, 0))
        if device == "cuda":
            torch.cuda.synchronize()
        ref, mag = dense(x * 2, idx, w, experts, False)  # halved and doubled again: exact
        check_output(got, ref, mag, "with hooks")
        for h in handles:
            h.remove()
        got = d.combine(expert_side(d.dispatch(x, TopK(w, idx, None)), experts, 0))
        if device == "cuda":
            torch.cuda.synchronize()
        ref, mag = dense(x, idx, w, experts, False)
        check_output(got, ref, mag, "hooks removed")

    run_ranks(1, body)
    assert seen == [("post_dispatch", "deepep_ll")]


# ---- lifecycle and refusals ----------------------------------------------------------------------


def _one_rank(**kw):
    g = ep.ThreadGroup(1)[0]
    args = dict(num_experts=4, hidden_size=128, max_tokens_per_rank=4, backend="cpu", cached=False)
    args.update(kw)
    return S.ElasticEPDispatcher(g, 2, **args)


def test_handle_lifecycle_is_fail_closed():
    d = _one_rank(deepep_mode="low_latency")
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    topk = TopK(torch.ones(2, 2), torch.tensor([[0, 1], [2, 3]]), None)
    with pytest.raises(ep.InvalidArgumentError, match="no dispatch is waiting"):
        d.combine(S.ElasticEPLLCombineInput(torch.zeros(4, 4, 128, dtype=torch.bfloat16), None, None))
    out = d.dispatch(x, topk)
    with pytest.raises(ep.InvalidArgumentError, match="not combined yet"):
        d.dispatch(x, topk)
    y = torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16)
    # the wrong format for a decode dispatch: refused, and the dispatch is released
    with pytest.raises(ep.InvalidArgumentError, match="deepep_ll"):
        d.combine(S.ElasticEPContiguousCombineInput(y, None, None))
    assert not d.dispatcher.pending
    out = d.dispatch(x, topk)
    assert d.combine(S.ElasticEPLLCombineInput(y, out.topk_ids, out.topk_weights)).shape == (2, 128)
    with pytest.raises(ep.InvalidArgumentError, match="no dispatch is waiting"):
        d.combine(S.ElasticEPLLCombineInput(y, None, None))


def test_construction_refusals():
    with pytest.raises(ep.InvalidArgumentError, match="num_local_experts=3"):
        _one_rank(num_local_experts=3)
    with pytest.raises(ep.InvalidArgumentError, match="bf16"):
        _one_rank(params_dtype=torch.float16)
    with pytest.raises(ep.InvalidArgumentError, match="deepep_mode"):
        _one_rank(deepep_mode="fast")
    with pytest.raises(ep.InvalidArgumentError, match="max_tokens_per_rank is required"):
        old = os.environ.pop("ELASTICEP_MAX_TOKENS_PER_RANK", None)
        try:
            _one_rank(max_tokens_per_rank=None)
        finally:
            if old is not None:
                os.environ["ELASTICEP_MAX_TOKENS_PER_RANK"] = old
    with pytest.raises(ep.UnsupportedError, match="quant_method"):
        _one_rank(quantization_config={"quant_method": "awq", "bits": 4})
    d = _one_rank()
    with pytest.raises(ep.UnsupportedError, match="single-batch overlap"):
        d.set_overlap_args(object(), {})
    with pytest.raises(ep.InvalidArgumentError, match="StandardTopKOutput"):
        d.dispatch(torch.zeros(1, 128, dtype=torch.bfloat16), object())
    # SGLang's DeepEPMode-like enum values are taken
    assert _one_rank(deepep_mode=types.SimpleNamespace(value="normal")).phase() == "extend"


def test_start_up_budget_from_server_args():
    args = types.SimpleNamespace(chunked_prefill_size=64, max_prefill_tokens=16384, disable_cuda_graph=False,
                                 cuda_graph_max_bs=8, max_running_requests=None, enable_dp_attention=False, dp_size=1,
                                 speculative_num_draft_tokens=None, disaggregation_mode="null")
    d = _one_rank(max_tokens_per_rank=64, server_args=args)
    assert d.budget.prefill_tokens == 64 and d.budget.decode_tokens == 8
    args.chunked_prefill_size = 65
    with pytest.raises(ep.CapacityExceededError, match="65"):
        _one_rank(max_tokens_per_rank=64, server_args=args)
