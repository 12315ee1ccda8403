"""The FP8 expert FFN on DeepGEMM's grouped GEMMs, fed by ElasticEP's dispatch outputs with no copy.

Per local expert and row: gate/up GEMM ``[2I, H]`` -> ``SiLU(gate) * up`` in fp32 -> FP8 1x128
requantization (``amax`` floored at 1e-4, ``scale = amax / 448``, ``q = e4m3(h * (448 / amax))``, the
formula of :class:`elasticep.serving.ReferenceMoeLayer`) -> down GEMM ``[H, I]`` -> bf16, with

- prefill (contiguous layout): ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` on the dispatch's
  ``[M, H]`` rows, their fp32 ``[M, H/128]`` MN-major TMA-aligned scales and ``m_indices``;
- decode (masked slab): ``deep_gemm.m_grouped_fp8_gemm_nt_masked`` on ``[E_local, R*C, H]``, its
  ``[E_local, R*C, H/128]`` scales, ``masked_m`` and ``expected_m``; no host synchronisation, so the
  decode FFN can be captured in a CUDA graph once it ran eagerly (DeepGEMM JIT-compiles a kernel at
  its first call of a shape). ``R*C`` must be a multiple of :data:`MASKED_ROW_MULTIPLE` (128): DeepGEMM
  stores whole row blocks (DeepEP's low-latency slabs, 128 tokens x ranks, always are).

The dispatch outputs go to DeepGEMM as they are: A is K-major and contiguous, and the scales are
already the layout DeepGEMM's first step (``transform_sf_into_required_layout``) wants on Hopper, so
that step returns them untouched; :func:`zero_copy_report` runs that step and says so. The weights
are DeepGEMM's ``[G, N, K]`` fp8 with fp32 ``[G, N/128, K/128]`` block scales, the layout of
:func:`elasticep.serving.synthetic_expert_weights` and of FP8 checkpoints (DeepSeek-V3).

Hopper only (``f32_g128`` scales, sm90 kernels). On Blackwell DeepGEMM takes packed UE8M0 scales
(``ue8m0_g128``, which ElasticEP's dispatch emits in DeepGEMM's packing) and power-of-two weight
scales; this FFN refuses other scale formats rather than compute with them untested.
"""

import sys

from ..errors import InvalidArgumentError, UnsupportedError

__all__ = ["load_deep_gemm", "DeepGemmExperts", "zero_copy_report", "layout_of", "MASKED_ROW_MULTIPLE"]

# DeepGEMM's sm90 masked kernel picks 64- or 128-row blocks and TMA-stores whole blocks into D viewed
# as [G * M_max, N] (csrc/jit_kernels/heuristics/sm90.hpp, impls/sm90_fp8_gemm_1d2d.cuh): the slab's
# rows per expert must be a multiple of the larger block, or a block past M_max lands in the next group.
MASKED_ROW_MULTIPLE = 128


def load_deep_gemm():
    """The ``deep_gemm`` module; ImportError naming the cause where it does not import."""
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - a broken build raises more than ImportError
        raise ImportError("deep_gemm does not import here (%s: %s); build DeepGEMM (deepseek-ai/DeepGEMM) against "
                          "this torch and put it on PYTHONPATH" % (type(e).__name__, e)) from e
    for name in ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
                 "get_mk_alignment_for_contiguous_layout"):
        if not hasattr(deep_gemm, name):
            raise ImportError("deep_gemm (%s) has no %s: a DeepGEMM without its FP8 grouped GEMMs (CUDA < 12.1 build?)"
                              % (getattr(deep_gemm, "__file__", "?"), name))
    return deep_gemm


def layout_of(d):
    """``"masked"`` or ``"contiguous"`` for an :class:`elasticep.serving.MoeDispatchOutput` or one of
    the SGLang dispatcher's outputs."""
    lay = getattr(d, "layout", None)
    if lay in ("masked", "contiguous"):
        return lay
    fmt = getattr(getattr(d, "format", None), "value", None)
    if fmt == "deepep_ll":
        return "masked"
    if fmt == "elasticep_contiguous":
        return "contiguous"
    raise InvalidArgumentError("DeepGemmExperts: %s is neither a masked nor a contiguous dispatch output"
                               % type(d).__name__)


def _scale_format(d):
    f = getattr(d, "scale_format", None)
    if f is not None:
        return f
    s = d.hidden_states_scale
    torch = sys.modules["torch"]
    return "f32_g128" if s is not None and s.dtype == torch.float32 else "ue8m0_g128"


def zero_copy_report(d):
    """Runs DeepGEMM's own activation-scale step (``transform_sf_into_required_layout``, what its
    grouped GEMMs call before the kernel) on the dispatch output's scales and reports whether it
    returned the very same tensor. A dict: ``layout``, ``a_ptr``, ``a_strides``, ``a_k_major``,
    ``sfa_ptr``, ``sfa_strides``, ``sfa_after_ptr``, ``sfa_after_strides``, ``no_copy`` (True when
    DeepGEMM reads A and the scales where the dispatch wrote them), ``arch_major``."""
    dg = load_deep_gemm()
    torch = sys.modules["torch"]
    x, sx = d.hidden_states, d.hidden_states_scale
    if sx is None:
        raise InvalidArgumentError("zero_copy_report: a bf16 dispatch has no scales; DeepGEMM's FP8 GEMMs need fp8")
    lay = layout_of(d)
    k = int(x.shape[-1])
    if lay == "masked":
        groups, mn = int(x.shape[0]), int(x.shape[1])
        after = dg.transform_sf_into_required_layout(sx, mn, k, (1, 128, 128), groups, True)
    else:
        mn = int(x.shape[0])
        after = dg.transform_sf_into_required_layout(sx, mn, k, (1, 128, 128), None, True)
    a_k_major = x.stride(-1) == 1 and (x.dim() == 2 or x.stride(0) == x.shape[1] * x.shape[2])
    same = (after.data_ptr() == sx.data_ptr() and tuple(after.stride()) == tuple(sx.stride())
            and tuple(after.shape) == tuple(sx.shape))
    return dict(layout=lay, arch_major=torch.cuda.get_device_capability(x.device)[0], a_ptr=x.data_ptr(),
                a_strides=tuple(x.stride()), a_k_major=bool(a_k_major), sfa_ptr=sx.data_ptr(),
                sfa_strides=tuple(sx.stride()), sfa_after_ptr=after.data_ptr(), sfa_after_strides=tuple(after.stride()),
                no_copy=bool(a_k_major and same))


class DeepGemmExperts:
    """One rank's local FP8 experts on DeepGEMM (see the module docstring).

    Args:
        gate_up: fp8 ``[E_local, 2I, H]`` CUDA tensor (rows [0, I) gate, [I, 2I) up).
        gate_up_scales: fp32 ``[E_local, 2I/128, H/128]``.
        down: fp8 ``[E_local, H, I]``.
        down_scales: fp32 ``[E_local, H/128, I/128]``.
    """

    def __init__(self, gate_up, gate_up_scales, down, down_scales):
        self.dg = load_deep_gemm()
        torch = sys.modules["torch"]
        self.torch = torch
        for name, t in (("gate_up", gate_up), ("down", down)):
            if t.dtype != torch.float8_e4m3fn or t.dim() != 3 or not t.is_cuda or not t.is_contiguous():
                raise InvalidArgumentError("DeepGemmExperts: %s must be a contiguous fp8 [E_local, N, K] CUDA tensor, "
                                           "got %s%s on %s" % (name, t.dtype, list(t.shape), t.device))
        g, n1, h = (int(v) for v in gate_up.shape)
        i = n1 // 2
        if n1 % 256 or h % 128 or tuple(down.shape) != (g, h, i):
            raise InvalidArgumentError("DeepGemmExperts: gate_up %s and down %s do not form [E, 2I, H] / [E, H, I] "
                                       "with H and I multiples of 128" % (list(gate_up.shape), list(down.shape)))
        for name, s, want in (("gate_up_scales", gate_up_scales, (g, n1 // 128, h // 128)),
                              ("down_scales", down_scales, (g, h // 128, i // 128))):
            if s.dtype != torch.float32 or tuple(s.shape) != want or not s.is_contiguous():
                raise InvalidArgumentError("DeepGemmExperts: %s must be contiguous fp32 %s, got %s%s"
                                           % (name, list(want), s.dtype, list(s.shape)))
        self.w1, self.s1, self.w2, self.s2 = gate_up, gate_up_scales, down, down_scales
        self.num_local_experts, self.hidden, self.intermediate = g, h, i
        self.alignment = int(self.dg.get_mk_alignment_for_contiguous_layout())
        self._scratch = {}

    @classmethod
    def synthetic(cls, num_local_experts, hidden, intermediate, *, first_expert=0, seed=0, device="cuda"):
        """Over :func:`elasticep.serving.synthetic_expert_weights` (the weights the reference layer
        and the benches use)."""
        from .. import serving

        torch = sys.modules.get("torch") or __import__("torch")
        w = serving.synthetic_expert_weights("fp8_block128", num_local_experts, hidden, intermediate,
                                             first_expert=first_expert, seed=seed, like=torch.device(device))
        return cls(w["gate_up"], w["gate_up_scales"], w["down"], w["down_scales"])

    def _buf(self, key, shape, dtype, mn_major=False):
        """Scratch kept per shape, so that a captured CUDA graph replays into the same memory."""
        torch = self.torch
        k = (key, tuple(shape), dtype, mn_major)
        t = self._scratch.get(k)
        if t is None:
            if mn_major:  # [.., rows, G] with strides (.., 1, align(rows, 4)), DeepGEMM's TMA-aligned MN-major
                rows, groups = shape[-2], shape[-1]
                pad = (rows + 3) // 4 * 4
                t = torch.zeros(tuple(shape[:-2]) + (groups, pad), dtype=dtype, device=self.w1.device)
                t = t.transpose(-1, -2)[..., :rows, :]
            else:
                t = torch.empty(tuple(shape), dtype=dtype, device=self.w1.device)
            self._scratch[k] = t
        return t

    def activation_quant(self, gate_up_out, q, q_scales):
        """``SiLU(gate) * up`` in fp32, then FP8 E4M3 per 1x128 group into ``q`` and ``q_scales``
        (``scale = amax / 448`` with amax floored at 1e-4; ``q = e4m3(h * (448 / amax))``)."""
        torch = self.torch
        i = self.intermediate
        a = gate_up_out[..., :i].float()
        h = torch.nn.functional.silu(a).mul_(gate_up_out[..., i:].float())
        hv = h.view(*h.shape[:-1], i // 128, 128)
        amax = hv.abs().amax(-1).clamp_min_(1e-4)
        k448 = torch.full_like(amax, 448.0)
        q.copy_(hv.mul_((k448 / amax).unsqueeze(-1)).view(h.shape))
        q_scales.copy_(amax.div_(k448))

    def forward(self, d, out=None, *, marks=None):
        """Expert outputs (bf16, the shape of ``d.hidden_states``) for a dispatch output in either
        layout; ``out`` given or allocated. ``marks``: a callable called with ``"gate_up"``,
        ``"act_quant"`` and ``"down"`` after each stage is enqueued (for timing)."""
        torch, dg = self.torch, self.dg
        lay = layout_of(d)
        x, sx = d.hidden_states, d.hidden_states_scale
        if x.dtype != torch.float8_e4m3fn or sx is None:
            raise InvalidArgumentError("DeepGemmExperts: the dispatch must carry fp8 rows with scales (a buffer with "
                                       "payload='fp8'), got %s" % x.dtype)
        fmt = _scale_format(d)
        if fmt != "f32_g128":
            # by design: UE8M0 scales feed DeepGEMM's sm100 (Blackwell) kernels; this FFN calls its sm90 ones.
            # The packed UE8M0 layout itself is checked against DeepGEMM's packing (test_deepgemm.py).
            raise UnsupportedError("DeepGemmExperts calls DeepGEMM's sm90 (Hopper) kernels, which take f32_g128 "
                                   "scales; the dispatch has %s, the scales of its sm100 (Blackwell) kernels, which "
                                   "this FFN does not call: dispatch with scale_format='f32_g128'" % fmt)
        if int(x.shape[-1]) != self.hidden:
            raise InvalidArgumentError("DeepGemmExperts: hidden %d, the experts have H=%d" % (x.shape[-1], self.hidden))
        n1, i = 2 * self.intermediate, self.intermediate
        mark = marks or (lambda stage: None)
        if out is None:
            out = torch.empty(tuple(x.shape), dtype=torch.bfloat16, device=x.device)
        if lay == "masked":
            g, rows, _ = (int(v) for v in x.shape)
            if g != self.num_local_experts:
                raise InvalidArgumentError("DeepGemmExperts: %d experts in the slab, %d here"
                                           % (g, self.num_local_experts))
            if rows % MASKED_ROW_MULTIPLE:
                raise InvalidArgumentError(
                    "DeepGemmExperts: the slab has %d rows per expert (R*C); DeepGEMM's masked kernel stores whole "
                    "64- or 128-row blocks into a [E_local*R*C, N] view, so with R*C not a multiple of %d an expert's "
                    "last block would overwrite the next expert's first rows; choose max_tokens_per_rank so that "
                    "ranks * max_tokens_per_rank is a multiple of %d"
                    % (rows, MASKED_ROW_MULTIPLE, MASKED_ROW_MULTIPLE))
            em = int(d.expected_m)
            gu = self._buf("gu", (g, rows, n1), torch.bfloat16)
            dg.m_grouped_fp8_gemm_nt_masked((x, sx), (self.w1, self.s1), gu, d.masked_m, em)
            mark("gate_up")
            q = self._buf("q", (g, rows, i), torch.float8_e4m3fn)
            qs = self._buf("qs", (g, rows, i // 128), torch.float32, mn_major=True)
            self.activation_quant(gu, q, qs)
            mark("act_quant")
            dg.m_grouped_fp8_gemm_nt_masked((q, qs), (self.w2, self.s2), out, d.masked_m, em)
            mark("down")
            return out
        m = int(x.shape[0])
        if m % self.alignment:
            raise InvalidArgumentError("DeepGemmExperts: %d contiguous rows is not a multiple of DeepGEMM's alignment "
                                       "%d: dispatch with expert_alignment=%d" % (m, self.alignment, self.alignment))
        gu = torch.empty((m, n1), dtype=torch.bfloat16, device=x.device)
        dg.m_grouped_fp8_gemm_nt_contiguous((x, sx), (self.w1, self.s1), gu, d.m_indices)
        mark("gate_up")
        q = torch.empty((m, i), dtype=torch.float8_e4m3fn, device=x.device)
        pad = (m + 3) // 4 * 4
        qs = torch.empty((i // 128, pad), dtype=torch.float32, device=x.device).t()[:m]
        self.activation_quant(gu, q, qs)
        mark("act_quant")
        dg.m_grouped_fp8_gemm_nt_contiguous((q, qs), (self.w2, self.s2), out, d.m_indices)
        mark("down")
        return out

    __call__ = forward

    def __repr__(self):
        return "DeepGemmExperts(%d experts, H=%d, I=%d)" % (self.num_local_experts, self.hidden, self.intermediate)
