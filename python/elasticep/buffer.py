"""Buffer: the dispatch/combine engine of one rank, and the buffer registry."""

import weakref

from . import _C
from . import _tensors as T
from .errors import InvalidArgumentError
from .groups import as_group

_OUTPUT_NAMES = ("recv_x", "recv_scales", "recv_weights", "recv_src", "m_indices")


class DispatchResult:
    """What :meth:`Buffer.dispatch` returns.

    Tensors are of the framework of ``x`` (numpy in -> numpy out, torch in -> torch out). Buffer-owned
    ones are zero-copy views of the buffer's memory: they stay valid (and keep the buffer's memory
    alive) until the next dispatch on the same buffer overwrites them; copy what you need to keep.

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

    __slots__ = ("layout", "recv_x", "recv_scales", "recv_weights", "recv_src", "m_indices", "counts", "offsets",
                 "masked_m", "num_rows", "handle")

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
        num_experts: E, a multiple of the number of ranks.
        num_topk: K in [1, 32].
        hidden: H, a multiple of 8 (bf16) or of the scale group (fp8).
        max_tokens_per_rank: C, the per-rank token capacity reserved in memory.
        payload: ``"bf16"`` or ``"fp8"`` (OCP E4M3 on the wire).
        scale_format: fp8 scales: ``"f32_g128"``, ``"ue8m0_g128"`` or ``"ue8m0_g32"``.
        topology: ``"direct"`` or ``"hybrid"``.
        ranks_per_node: hybrid only: ranks sharing NVLink (0 = all).
        num_sms: SMs for the CUDA kernels (0 = chosen from a bandwidth model).
        timeout: seconds any wait on a peer may take before :class:`elasticep.TimeoutError`.
        backend: ``"auto"`` (CUDA when a GPU is usable, else CPU), ``"cpu"`` or ``"cuda"``.
        device: CUDA device of this rank (None: the current device).

    The CPU backend shares one host arena between ranks, so its ranks must be threads of one process.
    """

    def __init__(self, group, num_experts, num_topk, hidden, max_tokens_per_rank, payload="bf16",
                 scale_format="f32_g128", topology="direct", ranks_per_node=0, num_sms=0, timeout=30.0,
                 backend="auto", device=None):
        self._init(group, num_experts, num_topk, hidden, max_tokens_per_rank, payload, scale_format, topology,
                   ranks_per_node, num_sms, timeout, backend, device, cached=False)

    def _init(self, group, num_experts, num_topk, hidden, max_tokens_per_rank, payload, scale_format, topology,
              ranks_per_node, num_sms, timeout, backend, device, cached):
        grp = as_group(group)
        if device is None:
            device = _current_cuda_device(backend)
        self._impl = _C.Buffer.create(grp, int(num_experts), int(num_topk), int(hidden), int(max_tokens_per_rank),
                                      str(payload), str(scale_format), str(topology), int(ranks_per_node),
                                      int(num_sms), float(timeout), int(device), str(backend), bool(cached))
        self._payload = str(payload)
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
    def config(self):
        """The buffer's configuration, as one line of text."""
        return self._live().config

    @property
    def group(self):
        """The :class:`Group` this buffer was built over."""
        return self._group

    def max_contiguous_rows(self, expert_alignment=1):
        """M_cap: rows of the contiguous layout without host sync, ``R*C*min(K, E_local) + E_local*(A-1)``."""
        return self._live().max_contiguous_rows(int(expert_alignment))

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
        impl = self._live()
        flavor = T.flavor_of(x)
        fp8 = self._payload == "fp8"
        if host_sync is None:
            host_sync = not T.capturing(x)
        args = [T.to_arg(x, "dispatch: x", T.X),
                None if scales is None else T.to_arg(scales, "dispatch: x_scales", T.PLAIN),
                T.to_arg(topk_idx, "dispatch: topk_idx", T.PLAIN),
                None if topk_weights is None else T.to_arg(topk_weights, "dispatch: topk_weights", T.PLAIN)]
        outs = [None] * 5
        if out is not None:
            unknown = set(out) - set(_OUTPUT_NAMES)
            if unknown:
                raise InvalidArgumentError("dispatch: unknown output name(s) %s in out=; choose from %s"
                                           % (sorted(unknown), ", ".join(_OUTPUT_NAMES)))
            for i, n in enumerate(_OUTPUT_NAMES):
                if out.get(n) is not None:
                    slot = (T.FP8 if fp8 else T.BF16) if n == "recv_x" else T.PLAIN
                    outs[i] = T.to_arg(out[n], "caller-provided output " + n, slot)
        raw = impl.dispatch(args[0], args[1], args[2], args[3], str(layout), int(expert_alignment), bool(host_sync),
                            bool(zero_padding), bool(scales_mn_major), outs[0], outs[1], outs[2], outs[3], outs[4],
                            T.cuda_stream_of(x, stream))
        r = DispatchResult()
        r.layout = "contiguous" if raw[4] is not None else "masked"
        r.recv_x = T.from_raw(raw[0], flavor, "fp8" if fp8 else "bf16")
        r.recv_scales = T.from_raw(raw[1], flavor, None)
        r.recv_weights = T.from_raw(raw[2], flavor, None)
        r.recv_src = T.from_raw(raw[3], flavor, None)
        r.m_indices = T.from_raw(raw[4], flavor, None)
        r.counts = T.from_raw(raw[5], flavor, None)
        r.offsets = T.from_raw(raw[6], flavor, None)
        r.masked_m = T.from_raw(raw[7], flavor, None)
        r.num_rows = int(raw[8])
        r.handle = raw[9]
        return r

    def combine(self, y, handle, *, weighted=True, bias=None, out=None, stream=None):
        """Sends expert outputs back and reduces them per token (SEMANTICS.md "Combine").

        Collective. Consumes ``handle`` (also when it fails).

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
        impl = self._live()
        if not isinstance(handle, _C.Handle):
            raise InvalidArgumentError("combine: the handle is empty (moved from, or not made by dispatch); pass "
                                       "DispatchResult.handle")
        flavor = T.flavor_of(y)
        raw = impl.combine(handle, T.to_arg(y, "combine: y", T.BF16), bool(weighted),
                           None if bias is None else T.to_arg(bias, "combine: bias", T.BF16),
                           None if out is None else T.to_arg(out, "combine: out", T.BF16), T.cuda_stream_of(y, stream))
        return T.from_raw(raw, flavor, "bf16")

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


def get_buffer(group, num_experts, num_topk, hidden, max_tokens_per_rank, payload="bf16", scale_format="f32_g128",
               topology="direct", ranks_per_node=0, num_sms=0, timeout=30.0, backend="auto", device=None):
    """The registry: the cached :class:`Buffer` for (group identity, config, backend).

    Collective like ``Buffer(...)``: every rank calls it with the same arguments. The first call (and
    any call whose configuration differs from the cached one) builds a buffer collectively; the new
    buffer is published only after every rank built it. Returns the same object while the key is
    unchanged. :func:`reset` drops the cache.
    """
    grp = as_group(group)
    if device is None:
        device = _current_cuda_device(backend)
    impl = _C.Buffer.create(grp, int(num_experts), int(num_topk), int(hidden), int(max_tokens_per_rank), str(payload),
                            str(scale_format), str(topology), int(ranks_per_node), int(num_sms), float(timeout),
                            int(device), str(backend), True)
    return Buffer._wrap(impl, grp, str(payload))


def reset():
    """Drops every buffer cached by :func:`get_buffer` in this process (local, not collective).

    Buffers still referenced elsewhere (a Buffer object, an output view) live on until released.
    """
    _C.reset_buffers()
