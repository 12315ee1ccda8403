"""ElasticEP as an SGLang token dispatcher, over SGLang's own base classes.

:class:`ElasticEPDispatcher` subclasses SGLang's real ``BaseDispatcher``
(``sglang/srt/layers/moe/token_dispatcher/base.py``; checked against SGLang
:data:`SGLANG_VERSION_CHECKED`) and is constructed like SGLang's DeepEP dispatchers
(``group, router_topk, permute_fusion, num_experts, num_local_experts, hidden_size, params_dtype,
deepep_mode, async_finish, return_recv_hook``). It wraps :class:`elasticep.serving.MoeDispatcher`, so
it has its phase-aware behaviour and its fail-closed handle lifecycle:

- **decode** (``deepep_mode`` ``"low_latency"``, or ``"auto"`` with no extend tokens in the batch):
  :class:`ElasticEPLLDispatchOutput`, the fields and order of SGLang's ``DeepEPLLDispatchOutput``
  (``hidden_states [E_local, R*C, H]``, ``hidden_states_scale``, ``topk_ids`` int64 ``[T, K]``,
  ``topk_weights``, ``masked_m`` int32 ``[E_local]``, ``expected_m``) with format
  ``DispatchOutputFormat.DEEPEP_LL``: SGLang's deepep_ll -> deep_gemm pre-permute takes it as is.
  No host synchronisation; CUDA-graph capturable.
- **prefill / extend** (``"normal"``, or ``"auto"`` with extend tokens):
  :class:`ElasticEPContiguousDispatchOutput`: expert-contiguous rows (segments aligned to
  ``expert_alignment``) with ``m_indices`` for the contiguous grouped GEMM, under the format
  :attr:`ElasticEPFormat.CONTIGUOUS` (value ``"elasticep_contiguous"``). It is deliberately not
  ``DEEPEP_NORMAL``: that format carries one row per received *token* with local expert ids, which
  SGLang's pre-permute (``ep_scatter``) then spreads into per-expert rows itself; ours are already
  one row per route in expert order, and would be scattered wrongly. :func:`register_deep_gemm_permutes`
  registers its pre/post-permute onto SGLang's DeepGEMM runner.
- ``combine(combine_input)``: ``combine_input.hidden_states`` (decode: ``[E_local, R*C, H]`` bf16,
  e.g. SGLang's ``DeepEPLLCombineInput``; prefill: ``[M, H]`` bf16 in an
  :class:`ElasticEPContiguousCombineInput`) -> ``[T, H]`` bf16, a new tensor. The route weights are the
  ones the dispatch carried (combine multiplies, as DeepEP's combines do); the input's ``topk_ids`` /
  ``topk_weights`` are not read again. The output is complete per token: do not all-reduce it across
  the EP group.

The hooks of the base class (``register_pre_dispatch_hook`` ... ``register_post_combine_hook``) work
unchanged. Not provided: two-batch overlap's split ``dispatch_a`` / ``dispatch_b`` calls and the
single-batch-overlap combine signalled by the down GEMM (``set_overlap_args`` raises).

Importing this module loads SGLang's ``base.py`` (:func:`load_sglang_base`): the installed package's
module when ``import sglang.srt.layers.moe.token_dispatcher.base`` works, else that file by path (from
``$ELASTICEP_SGLANG_BASE`` or the installed distribution), since the package's ``__init__`` files pull
in most of SGLang. It raises ImportError naming what is missing (torch, SGLang).

Tensors are torch tensors (CPU with the CPU backend, CUDA with the CUDA backend); numpy arrays work
too (the outputs then follow numpy). docs/INTEGRATIONS.md is the guide.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from enum import Enum
from typing import Any, NamedTuple, Optional

from .. import serving as _serving
from .._tensors import NUMPY, TORCH, framework_of
from ..errors import InvalidArgumentError, UnsupportedError

SGLANG_VERSION_CHECKED = "0.5.10.post1"
BASE_MODULE = "sglang.srt.layers.moe.token_dispatcher.base"
BASE_ENV = "ELASTICEP_SGLANG_BASE"
_PRIVATE_NAME = "elasticep.integrations._sglang_base"
_DP_ATTENTION = "sglang.srt.layers.dp_attention"

__all__ = [
    "SGLANG_VERSION_CHECKED", "load_sglang_base", "sglang_base_origin", "sglang_version", "ElasticEPDispatcher",
    "ElasticEPLLDispatchOutput", "ElasticEPLLCombineInput", "ElasticEPContiguousDispatchOutput",
    "ElasticEPContiguousCombineInput", "ElasticEPFormat", "pre_permute_contiguous_to_deep_gemm",
    "post_permute_deep_gemm_to_contiguous", "register_deep_gemm_permutes",
]

# ---------------------------------------------------------------------------------------------
# SGLang's base module

_loaded = None  # (module, origin)


def _distribution_base_path():
    """base.py inside the installed sglang package, located without running its __init__."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        p = os.path.join(root, "srt", "layers", "moe", "token_dispatcher", "base.py")
        if os.path.isfile(p):
            return p
    return None


def _load_file(path, why):
    if not os.path.isfile(path):
        raise ImportError("SGLang's token dispatcher base %s (%s) is not a file" % (path, why))
    spec = importlib.util.spec_from_file_location(_PRIVATE_NAME, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_PRIVATE_NAME] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(_PRIVATE_NAME, None)
        raise
    return mod


def load_sglang_base():
    """SGLang's ``token_dispatcher/base.py`` module, once per process.

    In order: the module SGLang already imported; the file named by ``$ELASTICEP_SGLANG_BASE``;
    ``import sglang.srt.layers.moe.token_dispatcher.base`` (which runs SGLang's package ``__init__``
    files); the file inside the installed ``sglang`` distribution, loaded by path. The file imports
    only torch. Raises ImportError naming every way tried and why it failed."""
    global _loaded
    if _loaded is not None:
        return _loaded[0]
    tried = []
    mod = sys.modules.get(BASE_MODULE)
    origin = "the module SGLang imported"
    if mod is None and os.environ.get(BASE_ENV):
        path = os.environ[BASE_ENV]
        mod, origin = _load_file(path, "$" + BASE_ENV), path
    if mod is None:
        try:
            mod = importlib.import_module(BASE_MODULE)
            origin = "import %s" % BASE_MODULE
        except Exception as e:  # noqa: BLE001 - the package __init__ files pull in most of SGLang
            tried.append("import %s: %s: %s" % (BASE_MODULE, type(e).__name__, e))
    if mod is None:
        path = _distribution_base_path()
        if path is None:
            tried.append("no installed sglang distribution holds srt/layers/moe/token_dispatcher/base.py")
            raise ImportError("elasticep.integrations.sglang needs SGLang's token_dispatcher/base.py (SGLang %s: "
                              "`pip install --no-deps sglang==%s` brings it, or set %s=/path/to/base.py); tried: %s"
                              % (SGLANG_VERSION_CHECKED, SGLANG_VERSION_CHECKED, BASE_ENV, "; ".join(tried)))
        mod, origin = _load_file(path, "the installed sglang distribution"), path
    for name in ("BaseDispatcher", "DispatchOutputFormat", "CombineInputFormat", "DispatchOutput", "CombineInput"):
        if not hasattr(mod, name):
            raise ImportError("%s (%s) has no %s: not the SGLang token dispatcher base this was written against "
                              "(SGLang %s)" % (getattr(mod, "__file__", mod), origin, name, SGLANG_VERSION_CHECKED))
    _loaded = (mod, origin)
    return mod


def sglang_base_origin():
    """Where :func:`load_sglang_base` found the module (a path, or how it was imported)."""
    load_sglang_base()
    return _loaded[1]


def sglang_version():
    """The installed SGLang distribution's version, or None when its metadata is not found."""
    try:
        import importlib.metadata as md

        return md.version("sglang")
    except Exception:  # noqa: BLE001
        return None


_base = load_sglang_base()
BaseDispatcher = _base.BaseDispatcher
DispatchOutputFormat = _base.DispatchOutputFormat
CombineInputFormat = _base.CombineInputFormat

# ---------------------------------------------------------------------------------------------
# formats and NamedTuples


class ElasticEPFormat(Enum):
    """The dispatch-output / combine-input format of the prefill layout, next to SGLang's
    ``DispatchOutputFormat`` / ``CombineInputFormat`` (an SGLang patch would add the same value as a
    member of both). Its ``value`` is the key SGLang's MoeRunner looks permutes up by; the ``is_*``
    helpers of SGLang's enum answer False, so no SGLang code path mistakes it for DeepEP's."""

    CONTIGUOUS = "elasticep_contiguous"

    def is_standard(self) -> bool:
        return False

    def is_deepep_normal(self) -> bool:
        return False

    def is_deepep_ll(self) -> bool:
        return False

    def is_deepep(self) -> bool:
        return False

    def is_flashinfer(self) -> bool:
        return False

    def is_elasticep_contiguous(self) -> bool:
        return self == ElasticEPFormat.CONTIGUOUS


class ElasticEPLLDispatchOutput(NamedTuple):
    """Decode output: SGLang's ``DeepEPLLDispatchOutput`` fields, in its order (SGLang unpacks it
    positionally). ``hidden_states``: the masked slab ``[E_local, R*C, H]`` (fp8 or bf16), expert
    ``l``'s rows ``[l, 0, masked_m[l])``; ``hidden_states_scale``: fp8 only, MN-major TMA-aligned
    (fp32 ``[E_local, R*C, H/128]`` with strides ``(H/128 * align(R*C, 4), 1, align(R*C, 4))`` for
    ``f32_g128``; packed UE8M0 int32 ``[E_local, R*C, ceil(H/512)]`` for ``ue8m0_g128``), else None;
    ``topk_ids`` int64 / ``topk_weights`` ``[T, K]``: this rank's own routing; ``masked_m`` int32
    ``[E_local]`` on the device; ``expected_m``: DeepEP's schedule hint ``max(1, (T*R*K + E) // E)``."""

    hidden_states: Any
    hidden_states_scale: Optional[Any]
    topk_ids: Any
    topk_weights: Any
    masked_m: Any
    expected_m: int

    @property
    def format(self):
        return DispatchOutputFormat.DEEPEP_LL


class ElasticEPLLCombineInput(NamedTuple):
    """Decode combine input: SGLang's ``DeepEPLLCombineInput`` fields (SGLang's own works as well).
    ``hidden_states``: bf16 ``[E_local, R*C, H]`` expert outputs in the slab's rows."""

    hidden_states: Any
    topk_ids: Any
    topk_weights: Any

    @property
    def format(self):
        return CombineInputFormat.DEEPEP_LL


class ElasticEPContiguousDispatchOutput(NamedTuple):
    """Prefill / extend output: one row per received route, grouped by local expert.

    ``hidden_states`` ``[M, H]`` (fp8 or bf16): expert ``l``'s rows ``[offsets[l], offsets[l] +
    counts[l])``, each segment starting at a multiple of ``expert_alignment``, padding rows after the
    real ones; ``hidden_states_scale``: fp8 only, MN-major TMA-aligned (fp32 ``[M, H/128]`` with
    strides ``(1, align(M, 4))``, or packed UE8M0 int32), else None; ``topk_ids`` int64 /
    ``topk_weights`` ``[T, K]``: this rank's own routing (not per row); ``m_indices`` int32 ``[M]``:
    the local expert of each row, -1 on padding rows (DeepGEMM's contiguous-layout indices);
    ``offsets`` int32 ``[E_local + 1]``; ``counts`` int32 ``[E_local]``; ``num_rows``: M on the host."""

    hidden_states: Any
    hidden_states_scale: Optional[Any]
    topk_ids: Any
    topk_weights: Any
    m_indices: Any
    offsets: Any
    counts: Any
    num_rows: int
    expert_alignment: int

    @property
    def format(self):
        return ElasticEPFormat.CONTIGUOUS


class ElasticEPContiguousCombineInput(NamedTuple):
    """Prefill combine input: bf16 ``[M, H]`` expert outputs in the dispatch's rows."""

    hidden_states: Any
    topk_ids: Any
    topk_weights: Any

    @property
    def format(self):
        return ElasticEPFormat.CONTIGUOUS


# ---------------------------------------------------------------------------------------------
# the dispatcher

_MODES = ("auto", "normal", "low_latency")


def _mode_name(mode):
    v = getattr(mode, "value", mode)  # SGLang's DeepEPMode or its value
    if v not in _MODES:
        raise InvalidArgumentError("ElasticEPDispatcher: deepep_mode=%r; choose 'auto', 'normal' (prefill layout) or "
                                   "'low_latency' (decode layout), or SGLang's DeepEPMode" % (mode,))
    return v


def _as_int64(ids):
    fw = framework_of(ids)
    if fw == TORCH:
        torch = sys.modules["torch"]
        return ids if ids.dtype == torch.int64 else ids.to(torch.int64)
    if fw == NUMPY:
        import numpy as np

        return ids.astype(np.int64, copy=False)
    return ids


def _sglang_is_extend_in_batch():
    mod = sys.modules.get(_DP_ATTENTION)
    if mod is None:
        try:
            mod = importlib.import_module(_DP_ATTENTION)
        except Exception as e:  # noqa: BLE001
            raise InvalidArgumentError(
                "ElasticEPDispatcher: deepep_mode='auto' picks the phase from SGLang's "
                "%s.get_is_extend_in_batch(), which does not import here (%s: %s); pass is_extend_in_batch= (a "
                "callable returning True when the batch has extend tokens) or deepep_mode='normal' / 'low_latency'"
                % (_DP_ATTENTION, type(e).__name__, e)) from None
    return bool(mod.get_is_extend_in_batch())


class ElasticEPDispatcher(BaseDispatcher):
    """SGLang token dispatcher over one ElasticEP buffer (see the module docstring).

    Args (SGLang's DeepEP dispatcher arguments):
        group: the EP group: a ``torch.distributed`` ProcessGroup (SGLang passes
            ``get_tp_group().device_group``) or an elasticep Group (e.g. a ThreadGroup rank).
        router_topk: K, routes per token.
        permute_fusion: accepted for signature compatibility (DeepEP stores it and does not use it).
        num_experts: E, a multiple of the group size.
        num_local_experts: E / R; checked against the buffer when given.
        hidden_size: H.
        params_dtype: the activations' dtype; ElasticEP dispatches bf16 activations (None: bf16).
        deepep_mode: ``"auto"`` (phase per batch), ``"normal"`` (always the prefill layout) or
            ``"low_latency"`` (always the decode layout), or SGLang's ``DeepEPMode``.
        async_finish, return_recv_hook: accepted for signature compatibility. ElasticEP's dispatch and
            combine are ordered on the current CUDA stream and finish there: there is no host event to
            wait for and no receive hook to call, so neither changes anything.

    ElasticEP's own (keyword only):
        max_tokens_per_rank: C, the largest T one rank hands one dispatch (a memory reservation; it
            must cover the prefill chunk and the CUDA-graph decode batch). None: ``$ELASTICEP_MAX_TOKENS_PER_RANK``.
        quantization_config: the checkpoint's Hugging Face ``quantization_config`` (dict, object or
            None for bf16 experts), checked by :func:`elasticep.serving.check_expert_quant`; FP8 block
            experts get an fp8 dispatch.
        scale_format: fp8 scales (None: the GPU's, ``f32_g128`` on Hopper, ``ue8m0_g128`` on Blackwell).
        expert_alignment: prefill segment alignment (None: 128, DeepGEMM's
            ``get_mk_alignment_for_contiguous_layout()`` on Hopper and Blackwell).
        is_extend_in_batch: ``deepep_mode="auto"``: a callable saying whether this step's batch has
            extend tokens (None: SGLang's ``get_is_extend_in_batch``). Every rank must get the same answer.
        server_args: SGLang's ``ServerArgs``: when given, the start-up budget check
            (:func:`elasticep.serving.budget_from_server_args`) runs here; its report is :attr:`budget`.
        backend, device, timeout, num_sms, topology, ranks_per_node: the buffer's options.
        cached: share one buffer per configuration (SGLang builds a dispatcher per MoE layer), through
            :func:`elasticep.get_buffer`; False builds a new one.

    Building it is collective over ``group`` (the buffer), as in SGLang each rank builds its layers.
    """

    def __init__(self, group, router_topk, permute_fusion=False, num_experts=None, num_local_experts=None,
                 hidden_size=None, params_dtype=None, deepep_mode="auto", async_finish=False, return_recv_hook=False,
                 *, max_tokens_per_rank=None, quantization_config=None, scale_format=None, expert_alignment=None,
                 is_extend_in_batch=None, server_args=None, backend="auto", device=None, timeout=30.0, num_sms=0,
                 topology="direct", ranks_per_node=0, cached=True):
        super().__init__()
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size)):
            if v is None:
                raise InvalidArgumentError("ElasticEPDispatcher: %s is required" % name)
        if params_dtype is not None:
            torch = sys.modules.get("torch")
            if torch is None or params_dtype != torch.bfloat16:
                raise InvalidArgumentError("ElasticEPDispatcher: params_dtype=%s; ElasticEP dispatches bf16 "
                                           "activations (torch.bfloat16): run the model in bf16" % (params_dtype,))
        if max_tokens_per_rank is None:
            env = os.environ.get("ELASTICEP_MAX_TOKENS_PER_RANK")
            if not env:
                raise InvalidArgumentError(
                    "ElasticEPDispatcher: max_tokens_per_rank is required (the largest number of tokens one rank hands "
                    "one dispatch: at least the prefill chunk per rank and the CUDA-graph decode batch); pass it or "
                    "set ELASTICEP_MAX_TOKENS_PER_RANK")
            try:
                max_tokens_per_rank = int(env)
            except ValueError:
                raise InvalidArgumentError("ElasticEPDispatcher: ELASTICEP_MAX_TOKENS_PER_RANK=%r is not an integer"
                                           % env) from None
        self.group = group
        self.router_topk = router_topk
        self.permute_fusion = permute_fusion
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.params_dtype = params_dtype
        self.deepep_mode = _mode_name(deepep_mode)
        self.async_finish = async_finish
        self.return_recv_hook = return_recv_hook
        self.max_tokens_per_rank = max_tokens_per_rank
        self._is_extend_in_batch = is_extend_in_batch or _sglang_is_extend_in_batch
        self.budget = None
        if server_args is not None:  # before the collective build: a bad budget fails alike on every rank
            self.budget = _serving.budget_from_server_args(server_args, max_tokens_per_rank)
        self.buffer = _serving.serving_buffer(group, num_experts, router_topk, hidden_size, max_tokens_per_rank,
                                              quant=quantization_config, scale_format=scale_format, backend=backend,
                                              device=device, cached=cached, timeout=timeout, num_sms=num_sms,
                                              topology=topology, ranks_per_node=ranks_per_node)
        if num_local_experts is not None and int(num_local_experts) != self.buffer.num_local_experts:
            raise InvalidArgumentError("ElasticEPDispatcher: num_local_experts=%s but num_experts %d over %d ranks "
                                       "gives %d per rank" % (num_local_experts, num_experts, self.buffer.num_ranks,
                                                        self.buffer.num_local_experts))
        self.num_local_experts = self.buffer.num_local_experts
        self.dispatcher = _serving.MoeDispatcher(self.buffer, expert_alignment=128 if expert_alignment is None
                                                 else expert_alignment, weight_placement="combine",
                                                 scales_mn_major=True)
        self._pending = None  # (phase, num_tokens) of the dispatch awaiting its combine

    @property
    def expert_alignment(self):
        return self.dispatcher.expert_alignment

    def phase(self):
        """The phase the next dispatch uses: ``"decode"`` or ``"extend"``."""
        if self.deepep_mode == "normal":
            return "extend"
        if self.deepep_mode == "low_latency":
            return "decode"
        return "extend" if self._is_extend_in_batch() else "decode"

    def dispatch(self, hidden_states, topk_output):
        """Collective: ``hidden_states`` ``[T, H]`` bf16 and SGLang's ``StandardTopKOutput``
        (``topk_weights``, ``topk_ids``, ``router_logits``) -> :class:`ElasticEPLLDispatchOutput`
        (decode) or :class:`ElasticEPContiguousDispatchOutput` (prefill / extend). A rank with no
        tokens passes ``[0, H]`` / ``[0, K]``."""
        topk_ids = getattr(topk_output, "topk_ids", None)
        if topk_ids is None or not hasattr(topk_output, "topk_weights"):
            raise InvalidArgumentError(
                "ElasticEPDispatcher.dispatch: topk_output must carry topk_ids and topk_weights (SGLang's "
                "StandardTopKOutput); got %s%s" % (type(topk_output).__name__,
                                                   " with format %s" % topk_output.format
                                                   if hasattr(topk_output, "format") else ""))
        if self.overlap_args is not None:
            raise UnsupportedError("ElasticEPDispatcher: single-batch overlap (overlap_args) is not supported")
        topk_weights = topk_output.topk_weights
        topk_ids = _as_int64(topk_ids)
        phase = self.phase()
        d = self.dispatcher.dispatch(hidden_states, topk_ids, topk_weights, phase=phase)
        self._pending = (phase, int(hidden_states.shape[0]))
        if phase == "decode":
            return ElasticEPLLDispatchOutput(d.hidden_states, d.hidden_states_scale, topk_ids, topk_weights, d.masked_m,
                                             d.expected_m)
        return ElasticEPContiguousDispatchOutput(d.hidden_states, d.hidden_states_scale, topk_ids, topk_weights,
                                                 d.m_indices, d.offsets, d.counts, d.num_rows, d.expert_alignment)

    def combine(self, combine_input):
        """Collective: the expert outputs of the last dispatch back to their tokens, weighted by the
        route weights that dispatch carried and summed: a new ``[T, H]`` bf16 tensor."""
        if self._pending is None or not self.dispatcher.pending:
            raise InvalidArgumentError("ElasticEPDispatcher.combine: no dispatch is waiting for its combine (combine "
                                       "follows each dispatch exactly once)")
        phase, num_tokens = self._pending
        self._pending = None
        want = CombineInputFormat.DEEPEP_LL.value if phase == "decode" else ElasticEPFormat.CONTIGUOUS.value
        got = getattr(getattr(combine_input, "format", None), "value", None)
        y = getattr(combine_input, "hidden_states", None)
        if got != want or y is None:
            self.dispatcher.release()
            raise InvalidArgumentError(
                "ElasticEPDispatcher.combine: the %s dispatch needs a combine input of format %r with hidden_states "
                "(%s), got %s of format %r; the dispatch was released" % (
                    phase, want, "ElasticEPLLCombineInput or SGLang's DeepEPLLCombineInput" if phase == "decode"
                    else "ElasticEPContiguousCombineInput", type(combine_input).__name__, got))
        out = _serving._empty(y, (num_tokens, self.hidden_size), "bf16")
        return self.dispatcher.combine(y, out=out)

    def set_overlap_args(self, combine_overlap_args, meta_overlap_args):
        raise UnsupportedError("ElasticEPDispatcher does not implement single-batch overlap (the combine signalled by "
                               "the down GEMM); run SGLang without --enable-single-batch-overlap")

    def __repr__(self):
        return "ElasticEPDispatcher(deepep_mode=%r, E=%d, K=%d, H=%d, C=%d, %r)" % (
            self.deepep_mode, self.num_experts, self.router_topk, self.hidden_size, self.max_tokens_per_rank,
            self.buffer)


# ---------------------------------------------------------------------------------------------
# SGLang's MoeRunner: permutes between our contiguous format and its DeepGEMM runner


def pre_permute_contiguous_to_deep_gemm(dispatch_output, quant_info, runner_config, running_state,
                                        runner_input_cls=None):
    """SGLang pre-permute ``("elasticep_contiguous", "deep_gemm")``: our rows already are DeepGEMM's
    contiguous layout, so this only fills ``running_state`` the way SGLang's
    ``DeepGemmRunnerCore._run_contiguous_gemm`` reads it and passes the tensors on.
    ``runner_input_cls``: SGLang's ``DeepGemmRunnerInput`` (imported from SGLang when None)."""
    if runner_input_cls is None:
        from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmRunnerInput as runner_input_cls
    x = dispatch_output.hidden_states
    running_state["all_tokens"] = int(dispatch_output.num_rows)
    running_state["hidden_states_shape"] = x.shape
    running_state["hidden_states_dtype"] = x.dtype
    running_state["hidden_states_device"] = x.device
    running_state["topk_ids"] = dispatch_output.topk_ids
    running_state["topk_weights"] = dispatch_output.topk_weights
    return runner_input_cls(hidden_states=x, hidden_states_scale=dispatch_output.hidden_states_scale,
                            use_masked_gemm=False, m_indices=dispatch_output.m_indices)


def post_permute_deep_gemm_to_contiguous(runner_output, quant_info, runner_config, running_state):
    """SGLang post-permute ``("deep_gemm", "elasticep_contiguous")``: the down GEMM's ``[M, H]`` output
    is in the dispatch's rows already."""
    return ElasticEPContiguousCombineInput(hidden_states=runner_output.hidden_states,
                                           topk_ids=running_state["topk_ids"],
                                           topk_weights=running_state["topk_weights"])


_registered = False


def register_deep_gemm_permutes():
    """Registers the two permutes above with SGLang's ``PermuteMethodPool`` (needs the whole SGLang
    package importable, as in a server). Idempotent. The decode format needs nothing: it is DEEPEP_LL,
    for which SGLang registers its own."""
    global _registered
    if _registered:
        return
    from sglang.srt.layers.moe.moe_runner.base import register_post_permute, register_pre_permute

    register_pre_permute(ElasticEPFormat.CONTIGUOUS.value, "deep_gemm")(pre_permute_contiguous_to_deep_gemm)
    register_post_permute("deep_gemm", ElasticEPFormat.CONTIGUOUS.value)(post_permute_deep_gemm_to_contiguous)
    _registered = True
