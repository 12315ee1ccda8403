"""DLPack plumbing between the caller's framework and the extension (internal).

Inputs: every tensor becomes a ``_C.TensorArg`` over a zero-copy DLPack view. The element type is
named here because numpy has no bf16/fp8 and DLPack float8 support differs between frameworks:

- numpy: ``uint16`` is taken as bf16 bits where a bf16 tensor is expected, ``uint8`` as fp8 (E4M3)
  bits where fp8 is expected; ``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn`` are taken as such.
- torch: ``torch.bfloat16`` and ``torch.float8_e4m3fn`` (and uint8 bits where fp8 is expected).
- anything else with ``__dlpack__``: its DLPack dtype.

Outputs come back as raw-bit views (bf16 -> uint16, fp8 -> uint8) that are re-typed here into the
caller's framework: numpy in -> numpy out, torch in -> torch out.
"""

from . import _C

try:  # optional: numpy is a dependency of the package, but keep import errors explicit
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

try:
    import ml_dtypes as _mld
except ImportError:
    _mld = None

NUMPY = "numpy"
TORCH = "torch"
OTHER = "dlpack"

# Slot kinds: which raw-bit dtypes a slot reinterprets.
BF16 = "bf16"  # x (bf16), y, bias, combine out, recv_x of a bf16 payload
X = "x"  # dispatch x: bf16 or fp8
FP8 = "fp8"  # pre-quantized fp8 outputs
PLAIN = "plain"  # indices, weights, scales, metadata


def _torch():
    import sys

    return sys.modules.get("torch")


def framework_of(obj):
    """'numpy', 'torch' or 'dlpack' (any other DLPack producer)."""
    if _np is not None and isinstance(obj, _np.ndarray):
        return NUMPY
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return TORCH
    return OTHER


class Flavor:
    """How outputs are re-typed for the caller: framework plus the bf16/fp8 representation."""

    __slots__ = ("framework", "ml_dtypes")

    def __init__(self, framework, ml_dtypes=False):
        self.framework = framework
        self.ml_dtypes = ml_dtypes


def flavor_of(obj):
    fw = framework_of(obj)
    ml = fw == NUMPY and _mld is not None and obj.dtype in (_np.dtype(_mld.bfloat16), _np.dtype(_mld.float8_e4m3fn))
    return Flavor(fw, ml)


def _describe(obj):
    """'<dtype>[d0, d1] <device>' in the C++ describe() style, for messages raised here."""
    shape = ", ".join(str(int(s)) for s in getattr(obj, "shape", ()))
    dev = "cpu"
    fw = framework_of(obj)
    if fw == TORCH and obj.device.type == "cuda":
        dev = "cuda:%d" % obj.device.index
    return "%s[%s] %s" % (str(getattr(obj, "dtype", type(obj).__name__)).replace("torch.", ""), shape, dev)


def to_arg(obj, name, slot, writable=False):
    """Wraps ``obj`` as a ``_C.TensorArg`` for the C++ argument ``name`` (zero-copy).

    ``writable``: the library writes it (a caller-provided output); a read-only array is refused."""
    if isinstance(obj, _C.TensorArg):
        return obj
    fw = framework_of(obj)
    dtype = ""
    view = obj
    if fw == NUMPY:
        dt = obj.dtype
        if _mld is not None and dt == _np.dtype(_mld.bfloat16):
            view, dtype = obj.view(_np.uint16), "bf16"
        elif _mld is not None and dt == _np.dtype(_mld.float8_e4m3fn):
            view, dtype = obj.view(_np.uint8), "fp8_e4m3"
        elif dt == _np.uint16 and slot in (BF16, X):
            dtype = "bf16"
        elif dt == _np.uint8 and slot in (X, FP8):
            dtype = "fp8_e4m3"
        elif dt.kind not in "biuf" or dt.itemsize not in (1, 2, 4, 8):
            from .errors import InvalidArgumentError

            raise InvalidArgumentError("%s is %s, which ElasticEP does not take" % (name, _describe(obj)))
    elif fw == TORCH:
        torch = _torch()
        if obj.requires_grad:
            obj = obj.detach()
        dt = obj.dtype
        view = obj
        if dt == torch.bfloat16:
            dtype = "bf16"
        elif dt == getattr(torch, "float8_e4m3fn", None):
            view, dtype = obj.view(torch.uint8), "fp8_e4m3"
        elif dt == torch.uint8 and slot in (X, FP8):
            dtype = "fp8_e4m3"
        elif dt == getattr(torch, "uint16", None) and slot in (BF16, X):
            view, dtype = obj.view(torch.int16), "bf16"
        elif dt in (torch.float32, torch.int32, torch.int64, torch.uint8):
            pass
        else:
            from .errors import InvalidArgumentError

            raise InvalidArgumentError(
                "%s is %s, which ElasticEP does not take (it takes bf16, fp8_e4m3, fp32, int32, int64)"
                % (name, _describe(obj))
            )
        if view.device.type == "cuda":
            # No stream synchronisation here (-1): the library runs on the stream it is given, the
            # caller's current stream by default, which also keeps torch.cuda.graph capture legal.
            view = view.__dlpack__(stream=-1)
    return _C.TensorArg(view, dtype, name, writable)


def cuda_stream_of(obj, stream):
    """The cudaStream_t (as int) to run on: ``stream`` if given (int or torch.cuda.Stream), else
    torch's current stream of the tensor's device for torch CUDA tensors, else 0."""
    if stream is not None:
        return int(getattr(stream, "cuda_stream", stream))
    if framework_of(obj) == TORCH and obj.device.type == "cuda":
        torch = _torch()
        return int(torch.cuda.current_stream(obj.device).cuda_stream)
    return 0


def capturing(obj):
    """Whether torch is capturing a CUDA graph on the current stream of ``obj``'s device."""
    if framework_of(obj) != TORCH or obj.device.type != "cuda":
        return False
    torch = _torch()
    return bool(torch.cuda.is_current_stream_capturing())


def from_raw(raw, flavor, semantic):
    """Re-types a raw-bit output view for the caller. ``semantic``: 'bf16', 'fp8' or None."""
    if raw is None:
        return None
    if flavor.framework == TORCH:
        torch = _torch()
        t = torch.from_dlpack(raw)
        if semantic == "bf16":
            t = t.view(torch.bfloat16)
        elif semantic == "fp8":
            t = t.view(torch.float8_e4m3fn)
        return t
    if flavor.framework == NUMPY or _np is not None:
        try:
            a = _np.from_dlpack(raw)
        except (BufferError, RuntimeError, TypeError):
            if flavor.framework == NUMPY:
                raise
            return raw  # device memory for a non-torch producer: hand back the DLPack object
        if flavor.ml_dtypes and semantic == "bf16":
            a = a.view(_mld.bfloat16)
        elif flavor.ml_dtypes and semantic == "fp8":
            a = a.view(_mld.float8_e4m3fn)
        return a
    return raw
