"""Buffer: the dispatch/combine engine of one rank, and the buffer registry.

The C++ argument structs are nanobind classes (``_C.BufferConfig``, ``_C.DispatchArgs`` with its
``_C.DispatchOutputs``, ``_C.DispatchResult``, ``_C.CombineArgs``); each lists its field names in
``fields``. This layer fills them by name from the keyword arguments of the signatures below, so a
new option is one field line in python/src/bindings.cpp and one parameter here.
"""

import inspect
import weakref

from . import _C
from . import _tensors as T
from .errors import InvalidArgumentError
from .groups import as_group

_OUTPUT_NAMES = _C.DispatchOutputs.fields


class DispatchResult:
    """What :meth:`Buffer.dispatch` returns.

    Tensors are of the framework of ``x`` (numpy in -> numpy out, torch in -> torch out). Buffer-owned
    ones are zero-copy views of the buffer's memory: the memory stays valid as long as a view lives
    (a view keeps its buffer alive), but the next dispatch on the same buffer rewrites it; copy what
    you need to keep.

    Attributes:
        layout: ``"contiguous"`` or ``"masked"``.
        recv_x: contiguous ``[M, H]`` (``[M_cap, H]`` without host sync); masked ``[E_local, R*C, H]``.
            bf16 (numpy: uint16 bits, or ml_dtypes.bfloat16 when x was) or fp8 (numpy: uint8 bits).
        recv_scales: fp8 payloads only: ``[rows, scale_columns]`` fp32 or packed-int32 scales
            (column-major when ``scales_mn_major``); else None.
        recv_weights: fp32 route weight per row (0 on padding rows).
        recv_src: int32 ``s * max_tokens_per_rank + t`` per row (-1 on padding rows).
        m_indices: contiguous only: int32 local expert per row (-1 on padding rows); else None.
        counts: int32 ``[E_local]`` real rows per local expert.
        offsets: contiguous only: int32 ``[E_local + 1]`` segment starts; else None.
        masked_m: masked only: int32 ``[E_local]`` (= counts); else None.
        num_rows: contiguous with host sync: M; otherwise -1.
        handle: the single-use handle :meth:`Buffer.combine` needs.
    """

    __slots__ = ("layout",) + _C.DispatchResult.tensors + ("num_rows", "handle")

    @classmethod
    def _from(cls, raw, flavor, payload):
        """Re-types a ``_C.DispatchResult`` into the caller's framework."""
        r = cls()
        r.layout = raw.layout
        for name in _C.DispatchResult.tensors:
            setattr(r, name, T.from_raw(getattr(raw, name), flavor, payload if name == "recv_x" else None))
        r.num_rows = int(raw.num_rows)
        r.handle = raw.handle
        return r

    def __repr__(self):
        def d(t):
            return None if t is None else "%s%s" % (getattr(t, "dtype", "?"), list(getattr(t, "shape", ())))

        return "DispatchResult(layout=%r, num_rows=%d, recv_x=%s, recv_scales=%s, counts=%s)" % (
            self.layout, self.num_rows, d(self.recv_x), d(self.recv_scales), self.counts)


_WRAPPERS = weakref.WeakValueDictionary()  # id(_C.Buffer) -> Buffer, so get_buffer returns one object


class Buffer:
    """The dispatch/combine engine of one rank of an expert-parallel group.

    Building it is collective: every rank of ``group`` constructs its Buffer with the same arguments
    (ranks of a :func:`ThreadGroup` in their own threads, torch.distributed ranks in their processes).

    Args:
        group: a :class:`Group` (one of :func:`ThreadGroup`'s, a :class:`TorchGroup`, or a
            ``torch.distributed`` ProcessGroup, wrapped in a TorchGroup for you).
        num_experts: E in [1, 65536], a multiple of the number of ranks.
        num_topk: K in [1, 32].
        hidden: H in [1, 65536], a multiple of 8 (bf16) or of the scale group (fp8).
        max_tokens_per_rank: C >= 1, the per-rank token capacity reserved in memory
            (ranks * C * K < 2^30 and E * C < 2^31).
        payload: ``"bf16"`` or ``"fp8"`` (OCP E4M3 on the wire).
        scale_format: fp8 scales: ``"f32_g128"``, ``"ue8m0_g128"`` or ``"ue8m0_g32"``.
        topology: ``"direct"`` or ``"hybrid"``.
        ranks_per_node: ranks sharing NVLink, a divisor of the number of ranks (0 = all ranks one
            node); with several nodes combine reduces per node first (docs/SEMANTICS.md).
        scaleout: hybrid's network transport: ``"auto"``, ``"emulated"``, ``"nccl"`` or ``"gin"``
            (``"auto"`` for direct).
        num_sms: SMs for the CUDA kernels in [0, 1024] (0 = chosen from a bandwidth model).
        timeout: seconds any wait on a peer may take before :class:`elasticep.TimeoutError`: finite,
            from 1 ms to 7 days.
        backend: ``"auto"`` (CUDA when a GPU is usable, else CPU), ``"cpu"`` or ``"cuda"``.
        device: CUDA device of this rank (None: the current device).

    Integer arguments must be integers (numpy integers too); a float or an out-of-range value is
    refused with an :class:`InvalidArgumentError` naming it (docs/SEMANTICS.md, "Value ranges").

    A Buffer is one rank's endpoint and takes one call at a time: a second thread calling into it
    while a call runs gets an :class:`InvalidArgumentError` naming that call. The CPU backend's ranks
    share one host arena: threads of one process, or processes of one host.
    """

    def __init__(self, group, num_experts, num_topk, hidden, max_tokens_per_rank, payload="bf16",
                 scale_format="f32_g128", topology="direct", ranks_per_node=0, scaleout="auto", num_sms=0,
                 timeout=30.0, backend="auto", device=None):
        params = dict(locals())  # this signature is the one list of Buffer's (and get_buffer's) options
        del params["self"], params["group"]
        self._init(group, params, cached=False)

    def _init(self, group, params, cached):
        grp = as_group(group)
        impl = _create(grp, params, cached)
        self._impl = impl
        self._payload = str(params["payload"])
        self._group = grp

    @classmethod
    def _wrap(cls, impl, group, payload):
        b = _WRAPPERS.get(id(impl))
        if b is not None and b._impl is impl:
            return b
        b = cls.__new__(cls)
        b._impl = impl
        b._group = group
        b._payload = payload
        _WRAPPERS[id(impl)] = b
        return b

    # ---- properties -------------------------------------------------------------------------------

    def _live(self):
        impl = self._impl
        if impl is None:
            raise InvalidArgumentError("this Buffer was destroyed; build a new one (Buffer(...) or get_buffer)")
        return impl

    @property
    def rank(self):
        """This rank's index in the group."""
        return self._live().rank

    @property
    def num_ranks(self):
        """R, the number of ranks in the group."""
        return self._live().num_ranks

    @property
    def num_local_experts(self):
        """E / R, the experts this rank holds."""
        return self._live().num_local_experts

    @property
    def backend(self):
        """The backend in use: ``"cpu"`` or ``"cuda"``."""
        return self._live().backend

    @property
    def kernel_path(self):
        """The implementation the calls run: ``"reference"`` (CPU backend), ``"direct"`` (CUDA, every
        rank a thread of this process on this GPU), ``"staged"`` (CUDA, every other placement, or
        ``ELASTICEP_KERNEL_VARIANT=staged``) or ``"hybrid"`` (CUDA, ``topology="hybrid"``)."""
        return self._live().kernel_path

    @property
    def config(self):
        """The buffer's configuration, as one line of text."""
        return self._live().config

    @property
    def settings(self):
        """The buffer's configuration as a structure: a copy of its ``_C.BufferConfig``, whose fields
        (``_C.BufferConfig.fields``: num_experts, num_topk, hidden, max_tokens_per_rank, payload,
        scale_format, topology, ...) read as attributes (enums by name, e.g. ``payload == "fp8"``)."""
        return self._live().settings

    @property
    def group(self):
        """The :class:`Group` this buffer was built over."""
        return self._group

    def max_contiguous_rows(self, expert_alignment=1):
        """M_cap: rows of the contiguous layout without host sync, ``R*C*min(K, E_local) + E_local*(A-1)``."""
        return self._live().max_contiguous_rows(expert_alignment)

    # ---- the collectives --------------------------------------------------------------------------

    def dispatch(self, x, topk_idx, topk_weights=None, *, layout="contiguous", expert_alignment=1, host_sync=None,
                 zero_padding=False, scales=None, scales_mn_major=False, out=None, stream=None):
        """Sends each token to the ranks holding its experts and lays the rows out per local expert.

        Collective: every rank calls it (a rank with no tokens passes ``[0, H]`` / ``[0, K]`` arrays).

        Args:
            x: ``[T, H]`` bf16 tokens, or pre-quantized fp8 (then ``scales`` is required).
            topk_idx: ``[T, K]`` int32/int64 expert ids in ``[-1, E)`` (-1: no route).
            topk_weights: ``[T, K]`` fp32 route weights (needed for a weighted combine).
            layout: ``"contiguous"`` (prefill, grouped GEMM over ``[M, H]``) or ``"masked"``
                (decode, ``[E_local, R*C, H]`` with ``masked_m``).
            expert_alignment: contiguous: each expert's segment starts at a multiple of this.
            host_sync: True waits for the counts on the host: contiguous returns exactly M rows, and
                invalid expert ids raise on every rank. False (CUDA-graph mode) never synchronises:
                contiguous returns the fixed worst case M_cap rows with M only on the device
                (``offsets[-1]``), and invalid ids are dropped and reported by the next host-visible
                call or :meth:`check`. None (default): False while torch is capturing a CUDA graph on
                the current stream, else True.
            zero_padding: zero padding rows' data and scales.
            scales: pre-quantized fp8 x only: ``[T, scale_columns]`` fp32 (f32_g128) or int32 (ue8m0).
            scales_mn_major: fp8: return ``recv_scales`` column-major (row stride rounded up to 4).
            out: optional caller-provided outputs, a dict with any of ``recv_x``, ``recv_scales``,
                ``recv_weights``, ``recv_src``, ``m_indices``; each of the layout's fixed worst-case
                shape. The result then holds views of them.
            stream: CUDA stream (int handle or torch.cuda.Stream); default: torch's current stream.

        Returns:
            :class:`DispatchResult`. Buffer-owned outputs are valid until the next dispatch.

        Raises:
            InvalidArgumentError / CapacityExceededError before any communication for bad inputs;
            InvalidArgumentError on every rank for invalid expert ids (with host sync);
            TimeoutError when a peer does not arrive in time.
        """
        options = {k: v for k, v in locals().items() if k in _C.DispatchArgs.options}  # the signature's options
        impl = self._live()
        flavor = T.flavor_of(x)
        fp8 = self._payload == "fp8"
        a = _C.DispatchArgs()
        if options["host_sync"] is None:
            options["host_sync"] = not T.capturing(x)
        options["stream"] = T.cuda_stream_of(x, stream)
        for name, value in options.items():
            setattr(a, name, value)
        a.x = T.to_arg(x, "dispatch: x", T.X)
        a.x_scales = None if scales is None else T.to_arg(scales, "dispatch: x_scales", T.PLAIN)
        a.topk_idx = T.to_arg(topk_idx, "dispatch: topk_idx", T.PLAIN)
        a.topk_weights = None if topk_weights is None else T.to_arg(topk_weights, "dispatch: topk_weights", T.PLAIN)
        if out is not None:
            unknown = set(out) - set(_OUTPUT_NAMES)
            if unknown:
                raise InvalidArgumentError("dispatch: unknown output name(s) %s in out=; choose from %s"
                                           % (sorted(unknown), ", ".join(_OUTPUT_NAMES)))
            for n in _OUTPUT_NAMES:
                if out.get(n) is not None:
                    slot = (T.FP8 if fp8 else T.BF16) if n == "recv_x" else T.PLAIN
                    setattr(a.outputs, n, T.to_arg(out[n], "caller-provided output " + n, slot, writable=True))
        return DispatchResult._from(impl.dispatch(a), flavor, "fp8" if fp8 else "bf16")

    def combine(self, y, handle, *, weighted=True, bias=None, out=None, stream=None):
        """Sends expert outputs back and reduces them per token (SEMANTICS.md "Combine").

        Collective. Consumes ``handle``, also when it fails, wherever it fails (in this layer's argument
        checks too): afterwards ``handle.valid`` is False and the buffer may dispatch again.

        Args:
            y: bf16 expert outputs with the shape of the dispatch's ``recv_x``.
            handle: ``DispatchResult.handle`` of this buffer's last dispatch.
            weighted: multiply by the route weights the dispatch carried (False: weight 1).
            bias: optional ``[T, H]`` bf16 added once per token.
            out: optional caller-provided ``[T, H]`` bf16 output.
            stream: CUDA stream; default: torch's current stream.

        Returns:
            ``[T, H]`` bf16 in y's framework: a view of ``out``, or buffer-owned memory valid until
            the next combine on this buffer.
        """
        if not isinstance(handle, _C.Handle):
            raise InvalidArgumentError("combine: the handle is empty (moved from, or not made by dispatch); pass "
                                       "DispatchResult.handle")
        try:
            impl = self._live()
            flavor = T.flavor_of(y)
            a = _C.CombineArgs()
            a.y = T.to_arg(y, "combine: y", T.BF16)
            a.weighted = weighted
            a.bias = None if bias is None else T.to_arg(bias, "combine: bias", T.BF16)
            a.out = None if out is None else T.to_arg(out, "combine: out", T.BF16, writable=True)
            a.stream = T.cuda_stream_of(y, stream)
        except BaseException:
            handle._release()  # the one handle rule: a combine that fails, wherever it fails, consumes it
            raise
        return T.from_raw(impl.combine(handle, a), flavor, "bf16")

    def check(self):
        """Raises a sticky fault left by an earlier graph-mode dispatch (invalid routes, as
        InvalidArgumentError) or a past timeout (TimeoutError); returns None when all is well."""
        self._live().check()

    def expert_load(self):
        """Rows received per local expert since creation or the last :meth:`reset_expert_load`
        (numpy int64 ``[E_local]``)."""
        import numpy as np

        return np.asarray(self._live().expert_load(), dtype=np.int64)

    def reset_expert_load(self):
        """Zeroes the counters :meth:`expert_load` reports."""
        self._live().reset_expert_load()

    def destroy(self):
        """Drops this object's hold on the native buffer.

        Its memory is freed once nothing else holds it: outputs still referenced keep it alive, and a
        buffer from :func:`get_buffer` stays cached until :func:`reset`. Later calls on this object
        raise InvalidArgumentError.
        """
        impl, self._impl = self._impl, None
        if impl is not None:
            _WRAPPERS.pop(id(impl), None)

    def __repr__(self):
        if self._impl is None:
            return "elasticep.Buffer(destroyed)"
        return "elasticep.Buffer(rank=%d/%d, backend=%s, %s)" % (self.rank, self.num_ranks, self.backend, self.config)


def _current_cuda_device(backend):
    """torch's current CUDA device when torch is loaded and the backend may be CUDA, else -1."""
    if backend == "cpu":
        return -1
    torch = T._torch()
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return -1


def _create(group, params, cached):
    """The native buffer for ``params`` (Buffer's keyword arguments): built, or taken from the registry."""
    params = dict(params)
    if params.get("device") is None:
        params["device"] = _current_cuda_device(params.get("backend", "auto"))
    return _C.Buffer.create(group, params, bool(cached))


_BUFFER_SIGNATURE = inspect.signature(Buffer.__init__)


def get_buffer(group, *args, **kwargs):
    """The registry: the cached :class:`Buffer` for (group identity, config, backend).

    Takes exactly :class:`Buffer`'s arguments. Collective like ``Buffer(...)``: every rank calls it
    with the same arguments. The first call (and any call whose configuration differs from the
    cached one) builds a buffer collectively; the new buffer is published only after every rank
    built it. Returns the same object while the key is unchanged. :func:`reset` drops the cache.
    """
    bound = _BUFFER_SIGNATURE.bind(None, group, *args, **kwargs)  # TypeError for a wrong call, as Buffer(...)
    bound.apply_defaults()
    params = dict(bound.arguments)
    del params["self"], params["group"]
    grp = as_group(group)
    impl = _create(grp, params, cached=True)
    return Buffer._wrap(impl, grp, str(params["payload"]))


get_buffer.__signature__ = _BUFFER_SIGNATURE.replace(parameters=list(_BUFFER_SIGNATURE.parameters.values())[1:])


def reset():
    """Drops every buffer cached by :func:`get_buffer` in this process (local, not collective).

    Buffers still referenced elsewhere (a Buffer object, an output view) live on until released.
    """
    _C.reset_buffers()
