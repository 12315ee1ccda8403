"""The serving layer: what an inference engine runs around dispatch and combine.

- Start-up checks: :func:`check_serving_budget` (the engine's largest prefill step and CUDA-graph
  decode batch against the buffer capacity) and :func:`check_expert_quant` (the checkpoint's
  ``quantization_config`` against what the dispatch and the grouped GEMMs can carry).
- :func:`serving_buffer`: a buffer whose payload and scale format follow the experts and the GPU.
- :class:`MoeDispatcher`: the phase-aware dispatcher (decode -> masked slab without host sync,
  CUDA-graph capturable; prefill/extend -> aligned contiguous rows with host sync) that owns the one
  outstanding handle. An SGLang-style ``BaseDispatcher`` is a thin wrapper over it.
- Grouped-GEMM adapters: :func:`masked_to_contiguous`, :func:`contiguous_to_masked`,
  :func:`m_indices_from_offsets`, :func:`apply_route_weights`, :func:`convert_scale_layout`,
  :func:`fp32_scales_to_ue8m0`, :func:`check_adapter_status` (CPU and CUDA, byte-identical).
- :class:`ReferenceMoeLayer`: per local expert gate/up GEMM -> SiLU(gate) * up -> (FP8 1x128
  requantization) -> down GEMM, in plain loops on the CPU and through cuBLASLt on a GPU.

Tensors are numpy arrays (bf16 as ``uint16`` bits or ``ml_dtypes.bfloat16``, fp8 as ``uint8`` bits or
``ml_dtypes.float8_e4m3fn``) or torch tensors; outputs this module allocates follow the framework and
device of the main input. CUDA tensors run on torch's current stream unless ``stream`` is given.

combine's output is complete per token: every route's expert output, weighted and summed over the
ranks holding the experts, plus the optional bias. Do not all-reduce it again across the EP group.
docs/SERVING.md is the guide; include/elasticep/serving.hpp is the C++ API with the same contract.
"""

import re

from . import _C
from . import _tensors as T
from .buffer import Buffer, get_buffer
from .errors import InvalidArgumentError

__all__ = [
    "BudgetReport", "check_serving_budget", "budget_from_server_args", "ExpertQuant", "check_expert_quant",
    "scale_format_for_device", "scale_format_for_compute_capability", "serving_buffer", "MoeDispatcher",
    "MoeDispatchOutput", "expected_m", "masked_to_contiguous", "contiguous_to_masked", "m_indices_from_offsets",
    "apply_route_weights", "convert_scale_layout", "fp32_scales_to_ue8m0", "check_adapter_status",
    "ReferenceMoeLayer", "synthetic_expert_weights",
]

# ---------------------------------------------------------------------------------------------
# tensors (internal)


def _np():
    import numpy

    return numpy


def _mld():
    try:
        import ml_dtypes

        return ml_dtypes
    except ImportError:
        return None


def _arg(obj, name, kind=None):
    """A zero-copy ``_C._ServingTensor`` over obj. kind: "bf16" or "fp8" where raw bits may stand
    for those (uint16 / uint8), else None."""
    if obj is None:
        return None
    fw = T.framework_of(obj)
    if fw == T.NUMPY:
        np = _np()
        mld = _mld()
        dt = obj.dtype
        if mld is not None and dt == np.dtype(mld.bfloat16):
            return _C._ServingTensor(obj.view(np.uint16), "bf16", name)
        if mld is not None and dt == np.dtype(mld.float8_e4m3fn):
            return _C._ServingTensor(obj.view(np.uint8), "fp8_e4m3", name)
        if dt == np.uint16 and kind == "bf16":
            return _C._ServingTensor(obj, "bf16", name)
        if dt == np.uint8 and kind == "fp8":
            return _C._ServingTensor(obj, "fp8_e4m3", name)
        plain = {np.dtype(np.float32): "fp32", np.dtype(np.int32): "int32", np.dtype(np.int64): "int64",
                 np.dtype(np.uint8): "uint8"}
        if dt in plain:
            return _C._ServingTensor(obj, plain[dt], name)
        raise InvalidArgumentError("%s is %s, which this call does not take" % (name, T._describe(obj)))
    if fw == T.TORCH:
        torch = T._torch()
        if obj.requires_grad:
            obj = obj.detach()
        dt = obj.dtype
        if dt == torch.bfloat16:
            view, name_dt = obj.view(torch.int16), "bf16"
        elif dt == getattr(torch, "float8_e4m3fn", None):
            view, name_dt = obj.view(torch.uint8), "fp8_e4m3"
        elif dt == torch.uint8 and kind == "fp8":
            view, name_dt = obj, "fp8_e4m3"
        elif dt == torch.int16 and kind == "bf16":
            view, name_dt = obj, "bf16"
        elif dt in (torch.float32, torch.int32, torch.int64, torch.uint8):
            view = obj
            name_dt = {torch.float32: "fp32", torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8"}[dt]
        else:
            raise InvalidArgumentError("%s is %s, which this call does not take" % (name, T._describe(obj)))
        if view.device.type == "cuda":
            view = view.__dlpack__(stream=-1)  # no stream synchronisation: the work runs on the given stream
        return _C._ServingTensor(view, name_dt, name)
    raise InvalidArgumentError("%s: expected a numpy array or a torch tensor, got %s" % (name, type(obj).__name__))


def _empty(like, shape, kind, zero=False):
    """A new tensor in like's framework and device. kind: bf16, fp8, fp32, int32."""
    if T.framework_of(like) == T.TORCH:
        torch = T._torch()
        dt = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32, "int32": torch.int32}[kind]
        f = torch.zeros if zero else torch.empty
        return f(tuple(shape), dtype=dt, device=like.device)
    np = _np()
    mld = _mld()
    ml = mld is not None and like.dtype in (np.dtype(mld.bfloat16), np.dtype(mld.float8_e4m3fn))
    dt = {"bf16": mld.bfloat16 if ml else np.uint16, "fp8": mld.float8_e4m3fn if ml else np.uint8,
          "fp32": np.float32, "int32": np.int32}[kind]
    return (np.zeros if zero else np.empty)(tuple(shape), dtype=dt)


def _empty_mn_major(like, shape, kind):
    """[rows, G] or [B, rows, G] with strides (.., 1, round_up(rows, 4)), owning its whole storage."""
    rows, g = shape[-2], shape[-1]
    pad = (rows + 3) // 4 * 4
    base = _empty(like, tuple(shape[:-2]) + (g, pad), kind, zero=True)
    if T.framework_of(like) == T.TORCH:
        return base.transpose(-1, -2)[..., :rows, :]
    return base.swapaxes(-1, -2)[..., :rows, :]


def _kind_of(obj):
    """bf16 / fp8 / fp32 / int32 of an array."""
    s = str(obj.dtype)
    if "bfloat16" in s or s.endswith("uint16") or s.endswith("int16"):
        return "bf16"
    if "float8" in s or s.endswith("uint8"):
        return "fp8"
    if "float32" in s:
        return "fp32"
    return "int32"


def _capturing(obj):
    return T.capturing(obj)


class _Status:
    """The adapters' fault word: given by the caller (checked by the caller), or made here and
    checked right after the call (impossible while a CUDA graph is being captured)."""

    def __init__(self, status, like, fn):
        self.given = status is not None
        if not self.given and _capturing(like):
            raise InvalidArgumentError("%s: pass status= (an int32 [1] tensor on the data's device) while capturing a "
                                       "CUDA graph, and call check_adapter_status(status) after the replay" % fn)
        self.tensor = status if self.given else _empty(like, (1,), "int32", zero=True)
        self.arg = _arg(self.tensor, fn + ": status")

    def finish(self, stream):
        if not self.given:
            _C.adapter_check_status(self.arg, stream)


# ---------------------------------------------------------------------------------------------
# 1. start-up budget


class BudgetReport:
    """What :func:`check_serving_budget` found.

    Attributes: ``capacity``, ``prefill_checked``, ``prefill_tokens``, ``prefill_source``,
    ``decode_checked``, ``decode_batch``, ``tokens_per_request``, ``decode_tokens``,
    ``decode_source``; ``str(report)`` says it in one paragraph.
    """

    def __init__(self, d):
        self._describe = d.pop("describe")
        self.__dict__.update(d)

    def __str__(self):
        return self._describe

    def __repr__(self):
        return "BudgetReport(%s)" % self._describe


def check_serving_budget(max_tokens_per_rank, *, role="mixed", chunked_prefill_size=0, max_prefill_tokens=0,
                         dynamic_chunk_probe_size=0, decode_cuda_graphs=True, cuda_graph_max_bs=0,
                         max_running_requests=0, dp_attention=False, attention_dp_size=1,
                         speculative_num_draft_tokens=0):
    """Checks at start-up that no step the engine may run exceeds the buffer capacity C.

    Args:
        max_tokens_per_rank: C, the buffer's per-rank capacity (a memory reservation).
        role: ``"mixed"`` (prefill and decode), ``"prefill"`` or ``"decode"`` (disaggregated serving).
        chunked_prefill_size: SGLang's ``--chunked-prefill-size`` (per rank, as the scheduler uses it;
            <= 0: chunking off). The prefill step.
        max_prefill_tokens: ``--max-prefill-tokens``: the step when chunking is off.
        dynamic_chunk_probe_size: the largest chunk a dynamic-chunking probe may run (0: none).
        decode_cuda_graphs: False when decode runs eagerly (``--disable-cuda-graph``): not checked.
        cuda_graph_max_bs: ``--cuda-graph-max-bs``.
        max_running_requests: ``--max-running-requests`` (0: not set).
        dp_attention, attention_dp_size: ``--enable-dp-attention`` and ``--dp-size``: the running
            requests are split over the DP ranks.
        speculative_num_draft_tokens: the widest speculative draft per request (0: no speculation).

    The prefill step must be <= C unless the role is decode-only; the decode tokens
    ``min(cuda_graph_max_bs, max(1, max_running_requests // dp)) * max(1, draft tokens)`` must be <= C
    unless the role is prefill-only or graphs are off. Equal to C passes, C + 1 fails.

    Returns:
        :class:`BudgetReport`.

    Raises:
        CapacityExceededError naming the numbers, the capacity and the settings to change;
        InvalidArgumentError for missing or negative settings. Every dispatch still checks its real
        row count against C.
    """
    return BudgetReport(_C.serving_budget(dict(
        max_tokens_per_rank=int(max_tokens_per_rank), role=str(role), chunked_prefill_size=int(chunked_prefill_size or 0),
        max_prefill_tokens=int(max_prefill_tokens or 0), dynamic_chunk_probe_size=int(dynamic_chunk_probe_size or 0),
        decode_cuda_graphs=bool(decode_cuda_graphs), cuda_graph_max_bs=int(cuda_graph_max_bs or 0),
        max_running_requests=int(max_running_requests or 0), dp_attention=bool(dp_attention),
        attention_dp_size=int(attention_dp_size or 1),
        speculative_num_draft_tokens=int(speculative_num_draft_tokens or 0))))


def budget_from_server_args(server_args, max_tokens_per_rank, *, dynamic_chunk_probe_size=0):
    """:func:`check_serving_budget` over an SGLang ``ServerArgs`` (or any object with its attribute
    names: chunked_prefill_size, max_prefill_tokens, disable_cuda_graph, cuda_graph_max_bs,
    max_running_requests, enable_dp_attention, dp_size, speculative_num_draft_tokens,
    disaggregation_mode). ``chunked_prefill_size`` is taken as ServerArgs holds it after its own
    adjustment (divided by dp_size under DP attention)."""
    g = lambda name, default=0: getattr(server_args, name, default)  # noqa: E731
    mode = str(g("disaggregation_mode", "null") or "null")
    return check_serving_budget(
        max_tokens_per_rank, role={"prefill": "prefill", "decode": "decode"}.get(mode, "mixed"),
        chunked_prefill_size=g("chunked_prefill_size") or 0, max_prefill_tokens=g("max_prefill_tokens") or 0,
        dynamic_chunk_probe_size=dynamic_chunk_probe_size, decode_cuda_graphs=not g("disable_cuda_graph", False),
        cuda_graph_max_bs=g("cuda_graph_max_bs") or 0, max_running_requests=g("max_running_requests") or 0,
        dp_attention=bool(g("enable_dp_attention", False)), attention_dp_size=g("dp_size", 1) or 1,
        speculative_num_draft_tokens=g("speculative_num_draft_tokens") or 0)


# ---------------------------------------------------------------------------------------------
# 2. expert-quant contract

_QUANT_KEYS = ("quant_method", "fmt", "activation_scheme", "weight_block_size", "format", "quant_algo", "bits")


def _quant_fields(config):
    """The fields the contract reads, from None, a dict, a transformers QuantizationConfig (to_dict)
    or a model config carrying ``quantization_config``."""
    if config is None:
        return None
    if not isinstance(config, dict):
        if hasattr(config, "quantization_config"):
            return _quant_fields(getattr(config, "quantization_config"))
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        else:
            raise InvalidArgumentError("check_expert_quant: expected a quantization_config dict (or None), got %s"
                                       % type(config).__name__)
    f = {k: config[k] for k in _QUANT_KEYS if config.get(k) is not None}
    if "quant_algo" not in f and isinstance(config.get("quantization"), dict):  # ModelOpt's hf_quant_config.json
        algo = config["quantization"].get("quant_algo")
        if algo is not None:
            f["quant_algo"] = algo
    for k in ("quant_method", "fmt", "activation_scheme", "format", "quant_algo"):
        if k in f:
            f[k] = str(f[k])
    if "weight_block_size" in f:
        f["weight_block_size"] = [int(v) for v in f["weight_block_size"]]
    if "bits" in f:
        f["bits"] = int(f["bits"])
    return f


class ExpertQuant:
    """The experts' number format, as :func:`check_expert_quant` accepted it.

    Attributes:
        kind: ``"bf16"``, ``"fp8_block128"`` or ``"mxfp8"``.
        payload: the dispatch payload these experts consume (``"bf16"`` or ``"fp8"``).
        weight_block_n, weight_block_k: 128x128, 1x32 (0 for bf16).
        activation_group: channels per activation scale (128, 32; 0 for bf16).
        scale_formats: the buffer scale formats that fit.
        source: what was found.
    """

    def __init__(self, fields, d):
        self._fields = fields
        self._describe = d.pop("describe")
        self.__dict__.update(d)

    def accepts(self, scale_format):
        """Whether a buffer with this scale format feeds these experts correctly."""
        return str(scale_format) in self.scale_formats

    def check_buffer(self, payload, scale_format="f32_g128"):
        """Raises InvalidArgumentError when a buffer's payload / scale format does not fit."""
        _C.serving_check_quant_buffer(self._fields, str(payload), str(scale_format))

    def __str__(self):
        return self._describe

    def __repr__(self):
        return "ExpertQuant(%s)" % self._describe


def check_expert_quant(quantization_config):
    """Checks a Hugging Face ``quantization_config`` (dict, object or None) at layer construction.

    Accepts unquantized bf16 experts (None), FP8 E4M3 with ``weight_block_size`` [128, 128] and
    ``activation_scheme`` "dynamic" (DeepSeek-V3, Qwen3-*-FP8) and MXFP8 (``quant_method`` "mxfp8",
    [1, 32] blocks, dynamic). Anything else (static activation scales, other block sizes, FP4/NVFP4,
    INT8/INT4, AWQ/GPTQ, compressed-tensors, unknown methods) raises UnsupportedError naming what was
    found and what to use.

    Returns:
        :class:`ExpertQuant`.
    """
    fields = _quant_fields(quantization_config)
    return ExpertQuant(fields, _C.serving_expert_quant(fields))


def scale_format_for_compute_capability(major):
    """fp32 1x128 (``"f32_g128"``) below Blackwell, packed UE8M0 1x128 (``"ue8m0_g128"``) from major 10."""
    return _C.serving_scale_format_for_cc(int(major))


def scale_format_for_device(device=None):
    """The scale format DeepGEMM's FP8 kernels read on this CUDA device (None: the current one);
    ``"f32_g128"`` without a GPU."""
    if device is None:
        device = -1
    elif not isinstance(device, int):
        device = getattr(device, "index", None)
        device = -1 if device is None else int(device)
    return _C.serving_scale_format_for_device(int(device))


def serving_buffer(group, num_experts, num_topk, hidden, max_tokens_per_rank, *, quant=None, scale_format=None,
                   backend="auto", device=None, cached=True, **kwargs):
    """A buffer for experts in ``quant``'s format: bf16 dispatch for bf16 experts; fp8 for quantized
    ones, with ``scale_format`` when given, else the GPU's (``f32_g128`` on Hopper, ``ue8m0_g128`` on
    Blackwell; ``ue8m0_g32`` for MXFP8). ``quant``: an :class:`ExpertQuant`, or a quantization_config
    for :func:`check_expert_quant`. ``cached``: through :func:`elasticep.get_buffer`, else a new
    :class:`elasticep.Buffer`. Other keyword arguments go to the buffer. Collective."""
    q = quant if isinstance(quant, ExpertQuant) else check_expert_quant(quant)
    payload = q.payload
    if payload == "bf16":
        if scale_format is not None:
            raise InvalidArgumentError("serving_buffer: scale_format=%r given but the experts are bf16" % scale_format)
        fmt = "f32_g128"
    elif scale_format is not None:
        fmt = str(scale_format)
    elif q.kind == "mxfp8":
        fmt = "ue8m0_g32"
    else:  # what the GPU's grouped GEMMs read; the CPU backend keeps Hopper's format
        fmt = "f32_g128" if backend == "cpu" else scale_format_for_device(device)
    q.check_buffer(payload, fmt)
    make = get_buffer if cached else Buffer
    return make(group, num_experts, num_topk, hidden, max_tokens_per_rank, payload=payload, scale_format=fmt,
                backend=backend, device=device, **kwargs)


# ---------------------------------------------------------------------------------------------
# 3. phase-aware dispatcher

_PHASES = ("decode", "prefill", "extend")


def expected_m(num_tokens, num_ranks, num_topk, num_experts):
    """The masked-GEMM schedule hint as DeepEP computes it: ``max(1, (T * R * K + E) // E)``."""
    return int(_C.serving_expected_m(int(num_tokens), int(num_ranks), int(num_topk), int(num_experts)))


def _buffer_config(buffer):
    cfg = dict(re.findall(r"(\w+)=(\S+)", buffer.config))
    try:
        return dict(num_experts=int(cfg["num_experts"]), num_topk=int(cfg["num_topk"]), hidden=int(cfg["hidden"]),
                    max_tokens_per_rank=int(cfg["max_tokens_per_rank"]), payload=cfg["payload"],
                    scale_format=cfg.get("scale_format", "f32_g128"))
    except KeyError as e:  # pragma: no cover - the config text is the library's own
        raise InvalidArgumentError("MoeDispatcher: cannot read %s from the buffer's config %r" % (e, buffer.config))


class MoeDispatchOutput:
    """What the expert GEMMs consume (views of the buffer's memory, valid until the next dispatch).

    Attributes:
        phase, layout: ``"decode"`` -> ``"masked"``; ``"prefill"``/``"extend"`` -> ``"contiguous"``.
        hidden_states: masked ``[E_local, R*C, H]``; contiguous ``[M, H]`` (bf16 or fp8).
        hidden_states_scale: fp8 payloads: scales (MN-major unless the dispatcher was told otherwise).
        scale_format, scales_mn_major: how to read them.
        masked_m (decode): int32 ``[E_local]`` rows per expert, on the device.
        expected_m (decode): DeepEP's schedule hint ``max(1, (T * R * K + E) // E)``.
        max_m (decode): ``R*C``, rows per expert in the slab.
        m_indices, offsets, num_rows (prefill): the contiguous layout (-1 on padding rows).
        expert_alignment: the contiguous segment alignment.
        counts, recv_weights, recv_src: per expert / per row metadata.
        weight_placement: ``"combine"`` or ``"adapter"`` (then apply recv_weights on real rows before
            combine, e.g. :func:`apply_route_weights`).
        num_tokens: T of this rank.
    """

    __slots__ = ("phase", "layout", "hidden_states", "hidden_states_scale", "scale_format", "scales_mn_major",
                 "masked_m", "expected_m", "max_m", "m_indices", "offsets", "num_rows", "expert_alignment", "counts",
                 "recv_weights", "recv_src", "weight_placement", "num_tokens")

    def __repr__(self):
        x = self.hidden_states
        return "MoeDispatchOutput(phase=%r, layout=%r, hidden_states=%s%s, expected_m=%s, num_rows=%s)" % (
            self.phase, self.layout, getattr(x, "dtype", "?"), list(getattr(x, "shape", ())), self.expected_m,
            self.num_rows)


class MoeDispatcher:
    """The phase-aware dispatcher over one :class:`elasticep.Buffer`.

    Args:
        buffer: the rank's buffer (e.g. from :func:`serving_buffer`).
        expert_alignment: prefill segment alignment: the contiguous GEMM's M block (DeepGEMM:
            ``get_mk_alignment_for_contiguous_layout()``, 128).
        weight_placement: ``"combine"`` (combine multiplies by the route weights) or ``"adapter"``
            (the expert side applies ``recv_weights`` on real rows; combine runs unweighted).
        scales_mn_major: fp8: TMA-aligned MN-major scales (what grouped GEMMs load), default True.
        zero_padding: zero the padding rows' data and scales.

    Decode dispatches the expert-masked slab without host synchronisation (fixed shapes: safe inside
    ``torch.cuda.graph``); prefill and extend dispatch expert-contiguous rows with host sync. The
    dispatcher holds the single outstanding handle: dispatching again before :meth:`combine`, or
    combining without a dispatch, raises InvalidArgumentError before any communication; a failed
    combine releases the handle. A rank with no tokens passes ``[0, H]`` / ``[0, K]`` tensors.
    """

    def __init__(self, buffer, *, expert_alignment=128, weight_placement="combine", scales_mn_major=True,
                 zero_padding=False):
        if not isinstance(buffer, Buffer):
            raise InvalidArgumentError("MoeDispatcher: buffer must be an elasticep.Buffer, got %s" % type(buffer).__name__)
        if weight_placement not in ("combine", "adapter"):
            raise InvalidArgumentError("MoeDispatcher: weight_placement=%r; choose 'combine' or 'adapter'"
                                       % (weight_placement,))
        if not 1 <= int(expert_alignment) <= 65536:
            raise InvalidArgumentError("MoeDispatcher: expert_alignment=%r must be in [1, 65536]" % (expert_alignment,))
        self.buffer = buffer
        self.expert_alignment = int(expert_alignment)
        self.weight_placement = weight_placement
        self.scales_mn_major = bool(scales_mn_major)
        self.zero_padding = bool(zero_padding)
        self._cfg = _buffer_config(buffer)
        self._handle = None
        self._weighted = False
        self._last_phase = None

    @property
    def pending(self):
        """True while a dispatch waits for its combine."""
        return self._handle is not None

    def dispatch(self, hidden_states, topk_idx, topk_weights=None, *, phase="decode", scales=None, stream=None):
        """Collective: sends each token to the ranks holding its experts, laid out for the phase.

        Args:
            hidden_states: ``[T, H]`` bf16 (or pre-quantized fp8 with ``scales``).
            topk_idx: ``[T, K]`` int32/int64 expert ids (-1: no route).
            topk_weights: ``[T, K]`` fp32 (required with weight_placement "adapter").
            phase: ``"decode"``, ``"prefill"`` or ``"extend"``.
            scales: pre-quantized fp8 input only.
            stream: CUDA stream (default: torch's current stream).

        Returns:
            :class:`MoeDispatchOutput`.
        """
        if phase not in _PHASES:
            raise InvalidArgumentError("MoeDispatcher.dispatch: phase=%r; choose decode, prefill or extend" % (phase,))
        if self._handle is not None:
            raise InvalidArgumentError("MoeDispatcher.dispatch(%s): the previous dispatch (%s) was not combined yet; "
                                       "call combine(y) with its expert outputs before the next dispatch"
                                       % (phase, self._last_phase))
        if self.weight_placement == "adapter" and topk_weights is None:
            raise InvalidArgumentError("MoeDispatcher.dispatch: weight placement 'adapter' applies recv_weights on the "
                                       "expert side, so topk_weights is required")
        cfg = self._cfg
        fp8 = cfg["payload"] == "fp8"
        decode = phase == "decode"
        res = self.buffer.dispatch(hidden_states, topk_idx, topk_weights, layout="masked" if decode else "contiguous",
                                   expert_alignment=1 if decode else self.expert_alignment, host_sync=not decode,
                                   zero_padding=self.zero_padding, scales=scales,
                                   scales_mn_major=fp8 and self.scales_mn_major, stream=stream)
        o = MoeDispatchOutput()
        o.phase = phase
        o.layout = res.layout
        o.hidden_states = res.recv_x
        o.hidden_states_scale = res.recv_scales
        o.scale_format = cfg["scale_format"] if fp8 else None
        o.scales_mn_major = fp8 and self.scales_mn_major
        o.counts = res.counts
        o.recv_weights = res.recv_weights
        o.recv_src = res.recv_src
        o.weight_placement = self.weight_placement
        o.num_tokens = int(hidden_states.shape[0])
        if decode:
            o.masked_m = res.masked_m
            o.max_m = self.buffer.num_ranks * cfg["max_tokens_per_rank"]
            o.expected_m = expected_m(o.num_tokens, self.buffer.num_ranks, cfg["num_topk"], cfg["num_experts"])
            o.m_indices = o.offsets = None
            o.num_rows = -1
            o.expert_alignment = 1
        else:
            o.masked_m = None
            o.max_m = 0
            o.expected_m = 0
            o.m_indices = res.m_indices
            o.offsets = res.offsets
            o.num_rows = res.num_rows
            o.expert_alignment = self.expert_alignment
        self._handle = res.handle
        self._weighted = self.weight_placement == "combine" and topk_weights is not None
        self._last_phase = phase
        return o

    def combine(self, y, *, bias=None, out=None, stream=None):
        """Collective: the expert outputs ``y`` (bf16, shape of the dispatch's hidden_states) back to
        their tokens, reduced per token: ``[T, H]`` bf16, complete (do not all-reduce it again).
        ``bias`` (``[T, H]`` bf16, e.g. the shared expert's output) is added once per token."""
        if self._handle is None:
            raise InvalidArgumentError("MoeDispatcher.combine: no dispatch is waiting for its combine (combine "
                                       "follows each dispatch exactly once)")
        handle, self._handle = self._handle, None  # released whatever happens below
        return self.buffer.combine(y, handle, weighted=self._weighted, bias=bias, out=out, stream=stream)


# ---------------------------------------------------------------------------------------------
# 4. grouped-GEMM adapters


def check_adapter_status(status, stream=None):
    """Raises CapacityExceededError naming the faults an adapter recorded in ``status`` (and clears
    it). On CUDA it synchronises the stream: call it after a graph replay, not inside the capture."""
    _C.adapter_check_status(_arg(status, "status"), T.cuda_stream_of(status, stream))


def m_indices_from_offsets(counts, offsets, rows, *, out=None, status=None, stream=None):
    """``m_indices[i] = l`` for ``offsets[l] <= i < offsets[l] + counts[l]``, else -1 (int32 ``[rows]``)."""
    if out is None:
        out = _empty(counts, (int(rows),), "int32")
    st = _Status(status, counts, "m_indices_from_offsets")
    s = T.cuda_stream_of(counts, stream)
    _C.adapter_m_indices(_arg(counts, "counts"), _arg(offsets, "offsets"), _arg(out, "m_indices"), st.arg, s)
    st.finish(s)
    return out


def masked_to_contiguous(x, masked_m, *, expert_alignment=1, scales=None, rows=None, out=None, out_scales=None,
                         scales_mn_major=False, out_offsets=None, out_m_indices=None, weights=None, status=None,
                         stream=None):
    """Masked slab ``[E_local, S, W]`` -> expert-contiguous rows ``[rows, W]`` (segments aligned to
    ``expert_alignment``; padding rows inside segments zeroed; ``m_indices`` -1 off real rows).

    ``rows`` defaults to ``E_local * round_up(S, A)``, enough for any counts <= S. ``weights``
    (fp32 ``[rows]``, the destination rows' route weights) fuses ``bf16(float(x) * w)`` on real rows.
    Returns ``(out, offsets, m_indices, out_scales)``.
    """
    e, srows, w = (int(v) for v in x.shape)
    a = int(expert_alignment)
    if rows is None:
        rows = e * ((srows + a - 1) // a * a)
    kind = _kind_of(x)
    if out is None:
        out = _empty(x, (rows, w), kind)
    if scales is not None and out_scales is None:
        g = int(scales.shape[-1])
        out_scales = (_empty_mn_major(x, (rows, g), _kind_of(scales)) if scales_mn_major
                      else _empty(x, (rows, g), _kind_of(scales)))
    if out_offsets is None:
        out_offsets = _empty(x, (e + 1,), "int32")
    if out_m_indices is None:
        out_m_indices = _empty(x, (rows,), "int32")
    st = _Status(status, x, "masked_to_contiguous")
    s = T.cuda_stream_of(x, stream)
    _C.adapter_masked_to_contiguous(_arg(x, "x", kind), _arg(masked_m, "masked_m"), _arg(scales, "scales"), a,
                                    _arg(out, "out", kind), _arg(out_scales, "out_scales"),
                                    _arg(out_offsets, "out_offsets"), _arg(out_m_indices, "out_m_indices"),
                                    _arg(weights, "weights"), st.arg, s)
    st.finish(s)
    return out, out_offsets, out_m_indices, out_scales


def contiguous_to_masked(x, counts, offsets, *, slab_rows, scales=None, out=None, out_scales=None,
                         scales_mn_major=False, out_masked_m=None, weights=None, status=None, stream=None):
    """Expert-contiguous rows ``[M, W]`` -> masked slab ``[E_local, slab_rows, W]``: rows
    ``[l, 0, count_l)`` written (slab rows past the count untouched). ``weights`` (fp32
    ``[E_local, slab_rows]``, a masked dispatch's recv_weights) fuses ``bf16(float(x) * w)``.
    Returns ``(out, masked_m, out_scales)``."""
    e = int(counts.shape[0])
    w = int(x.shape[1])
    kind = _kind_of(x)
    if out is None:
        out = _empty(x, (e, int(slab_rows), w), kind)
    if scales is not None and out_scales is None:
        g = int(scales.shape[-1])
        out_scales = (_empty_mn_major(x, (e, int(slab_rows), g), _kind_of(scales)) if scales_mn_major
                      else _empty(x, (e, int(slab_rows), g), _kind_of(scales)))
    if out_masked_m is None:
        out_masked_m = _empty(x, (e,), "int32")
    st = _Status(status, x, "contiguous_to_masked")
    s = T.cuda_stream_of(x, stream)
    _C.adapter_contiguous_to_masked(_arg(x, "x", kind), _arg(counts, "counts"), _arg(offsets, "offsets"),
                                    _arg(scales, "scales"), _arg(out, "out", kind), _arg(out_scales, "out_scales"),
                                    _arg(out_masked_m, "out_masked_m"), _arg(weights, "weights"), st.arg, s)
    st.finish(s)
    return out, out_masked_m, out_scales


def apply_route_weights(y, weights, rows_or_counts, *, out=None, status=None, stream=None):
    """``out = bf16(float(y) * w)`` on real rows only (in place by default). Masked: y
    ``[E_local, S, H]``, weights ``[E_local, S]``, ``masked_m``; contiguous: y ``[M, H]``, weights
    ``[M]``, ``m_indices`` (rows with -1 are skipped)."""
    if out is None:
        out = y
    st = _Status(status, y, "apply_route_weights")
    s = T.cuda_stream_of(y, stream)
    _C.adapter_route_weights(_arg(y, "y", "bf16"), _arg(weights, "weights"), _arg(rows_or_counts, "rows_or_counts"),
                             _arg(out, "out", "bf16"), st.arg, s)
    st.finish(s)
    return out


def _check_mn_storage(t, name):
    if T.framework_of(t) != T.TORCH or t.dim() < 2:
        return
    rows, g = t.shape[-2], t.shape[-1]
    pad = (rows + 3) // 4 * 4
    if g > 1 and t.stride(-2) == 1 and t.stride(-1) == pad:
        batch = t.shape[0] if t.dim() == 3 else 1
        need = (t.storage_offset() + batch * g * pad) * 4
        if t.untyped_storage().nbytes() < need:
            raise InvalidArgumentError("%s is MN-major but its storage (%d bytes) does not span the padding lanes "
                                       "(%d bytes needed); allocate [.., G, round_up(rows, 4)] and transpose"
                                       % (name, t.untyped_storage().nbytes(), need))


def convert_scale_layout(src, *, mn_major=True, out=None, stream=None):
    """Copies 4-byte scales ``[rows, G]`` / ``[B, rows, G]`` into ``out`` (default: a new MN-major
    TMA-aligned tensor when ``mn_major``, else row-major), through the strides either way; an MN-major
    destination gets its padding lanes zeroed."""
    if out is None:
        shape = tuple(int(v) for v in src.shape)
        out = _empty_mn_major(src, shape, _kind_of(src)) if mn_major else _empty(src, shape, _kind_of(src))
    _check_mn_storage(out, "convert_scale_layout: out")
    _C.adapter_convert_scales(_arg(src, "src"), _arg(out, "out"), T.cuda_stream_of(src, stream))
    return out


def fp32_scales_to_ue8m0(src, *, mn_major=True, out=None, stream=None):
    """fp32 scales ``[.., rows, G]`` -> packed UE8M0 int32 ``[.., rows, ceil(G/4)]`` (exponent rounded
    up, 0 for 0, 255 for Inf/NaN, bytes past G zero; MN-major TMA-aligned by default)."""
    if out is None:
        shape = tuple(int(v) for v in src.shape[:-1]) + ((int(src.shape[-1]) + 3) // 4,)
        out = _empty_mn_major(src, shape, "int32") if mn_major else _empty(src, shape, "int32")
    _check_mn_storage(out, "fp32_scales_to_ue8m0: out")
    _C.adapter_fp32_to_ue8m0(_arg(src, "src"), _arg(out, "out"), T.cuda_stream_of(src, stream))
    return out


# ---------------------------------------------------------------------------------------------
# 5. reference MoE layer


def synthetic_expert_weights(kind, num_experts, hidden, intermediate, *, first_expert=0, seed=0, like=None,
                             threads=4):
    """Seeded synthetic weights of experts ``[first_expert, first_expert + num_experts)`` (the same
    bytes the C++ tests and ``elasticep bench --moe-layer`` use): a dict with ``gate_up``
    ``[E, 2I, H]``, ``down`` ``[E, H, I]`` and, for ``kind="fp8_block128"``, fp32 128x128 block
    ``gate_up_scales`` / ``down_scales``. Numpy arrays (bf16 as uint16, fp8 as uint8), or torch
    tensors on ``like``'s device when ``like`` is a torch tensor or device."""
    if isinstance(kind, ExpertQuant):
        kind = kind.kind
    np = _np()
    e, h, i = int(num_experts), int(hidden), int(intermediate)
    w1, s1, w2, s2 = _C.serving_synthetic_experts(str(kind), int(first_expert), e, h, i, int(seed), int(threads))
    fp8 = kind == "fp8_block128"
    wdt = np.uint8 if fp8 else np.uint16
    out = dict(gate_up=np.frombuffer(w1, dtype=wdt).reshape(e, 2 * i, h).copy(),
               down=np.frombuffer(w2, dtype=wdt).reshape(e, h, i).copy())
    if fp8:
        out["gate_up_scales"] = np.frombuffer(s1, dtype=np.float32).reshape(e, 2 * i // 128, h // 128).copy()
        out["down_scales"] = np.frombuffer(s2, dtype=np.float32).reshape(e, h // 128, i // 128).copy()
    torch = T._torch()
    if like is not None and torch is not None:
        device = like.device if isinstance(like, torch.Tensor) else torch.device(like)
        conv = {}
        for k, v in out.items():
            if v.dtype == np.uint16:  # bf16 bits: through int16, which every torch version moves and views
                conv[k] = torch.from_numpy(v.view(np.int16)).to(device).view(torch.bfloat16)
            elif v.dtype == np.uint8:
                conv[k] = torch.from_numpy(v).to(device).view(torch.float8_e4m3fn)
            else:
                conv[k] = torch.from_numpy(v).to(device)
        out = conv
    return out


class ReferenceMoeLayer:
    """The reference expert FFN of one rank's local experts.

    Per local expert: gate/up GEMM ``[2I, H]`` -> ``SiLU(gate) * up`` in fp32 -> (FP8: 1x128
    requantization) -> down GEMM ``[H, I]`` -> bf16. CPU tensors run plain loops; CUDA tensors run
    cuBLASLt (bf16; FP8 with VEC128_32F / BLK128x128_32F scales where this cuBLASLt runs them on
    the GPU, else dequantized to bf16): :attr:`path` and :attr:`path_note` say which and why.

    Args:
        gate_up: ``[E_local, 2I, H]`` bf16 or fp8 (rows [0, I) gate, [I, 2I) up).
        down: ``[E_local, H, I]``.
        gate_up_scales, down_scales: fp8: fp32 ``[E_local, 2I/128, H/128]`` and
            ``[E_local, H/128, I/128]`` block scales.
        graph_safe: decode inputs run every expert over the whole slab (no host read of masked_m),
            so :meth:`forward` can be captured in a CUDA graph (run it once before capturing).
        force_dequant: FP8 on a GPU: skip the blocked cuBLASLt path.
    """

    def __init__(self, gate_up, down, *, gate_up_scales=None, down_scales=None, graph_safe=False, force_dequant=False):
        k = _kind_of(gate_up)
        kind = "fp8_block128" if k == "fp8" else "bf16"
        self._keep = (gate_up, down, gate_up_scales, down_scales)
        self._args = (_arg(gate_up, "gate_up", k), _arg(gate_up_scales, "gate_up_scales"), _arg(down, "down", k),
                      _arg(down_scales, "down_scales"))
        self.hidden = int(gate_up.shape[2])
        self.intermediate = int(gate_up.shape[1]) // 2
        self._impl = _C.MoeLayer(kind, self.hidden, self.intermediate, self._args[0], self._args[1], self._args[2],
                                 self._args[3], bool(graph_safe), bool(force_dequant))
        self._like = gate_up

    @classmethod
    def synthetic(cls, quant, num_local_experts, hidden, intermediate, *, first_expert=0, seed=0, like=None, **kwargs):
        """A layer over :func:`synthetic_expert_weights` (for tests, examples and benchmarks)."""
        kind = quant.kind if isinstance(quant, ExpertQuant) else str(quant)
        w = synthetic_expert_weights(kind, num_local_experts, hidden, intermediate, first_expert=first_expert,
                                     seed=seed, like=like)
        return cls(w["gate_up"], w["down"], gate_up_scales=w.get("gate_up_scales"), down_scales=w.get("down_scales"),
                   **kwargs)

    @property
    def path(self):
        """``"cpu-loops"``, ``"cublaslt-bf16"``, ``"cublaslt-fp8-blockscaled"`` or ``"cublaslt-dequant-bf16"``."""
        return self._impl.path

    @property
    def path_note(self):
        """Plain words: which GEMM path runs and why."""
        return self._impl.path_note

    @property
    def num_local_experts(self):
        return self._impl.num_local_experts

    def forward(self, d, y=None, *, stream=None):
        """Expert outputs for a :class:`MoeDispatchOutput` (real rows; bf16 in hidden_states' shape,
        ``y`` given or allocated). With weight placement "adapter" the route weights are applied."""
        x = d.hidden_states
        if y is None:
            y = _empty(x, tuple(int(v) for v in x.shape), "bf16")
        counts = d.masked_m if d.layout == "masked" else d.counts
        self._impl.forward(d.layout, _arg(x, "hidden_states", _kind_of(x)), _arg(d.hidden_states_scale, "scales"),
                           d.scale_format or "f32_g128", _arg(counts, "counts"), _arg(d.offsets, "offsets"),
                           _arg(d.m_indices, "m_indices"), _arg(d.recv_weights, "recv_weights"), d.weight_placement,
                           _arg(y, "y", "bf16"), T.cuda_stream_of(x, stream))
        return y

    __call__ = forward

    def forward_dense(self, expert, x, y=None, *, stream=None):
        """Plain rows through one local expert (a shared expert): ``x`` ``[T, H]`` bf16 -> ``[T, H]`` bf16."""
        if y is None:
            y = _empty(x, tuple(int(v) for v in x.shape), "bf16")
        self._impl.forward_dense(int(expert), _arg(x, "x", "bf16"), _arg(y, "y", "bf16"), T.cuda_stream_of(x, stream))
        return y

    def __repr__(self):
        return "ReferenceMoeLayer(%d experts, H=%d, I=%d, %s)" % (self.num_local_experts, self.hidden,
                                                                 self.intermediate, self.path)
