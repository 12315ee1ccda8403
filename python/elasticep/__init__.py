"""ElasticEP: Mixture-of-Experts dispatch and combine across expert-parallel ranks.

Quick start (ranks as threads, CPU backend)::

    import threading, numpy as np, elasticep as ep

    groups = ep.ThreadGroup(2)
    def rank_main(r):
        buf = ep.Buffer(groups[r], num_experts=4, num_topk=2, hidden=128, max_tokens_per_rank=8)
        x = np.zeros((3, 128), np.uint16)              # bf16 bits (or ml_dtypes.bfloat16, torch.bfloat16)
        idx = np.array([[0, 2], [1, -1], [3, 0]], np.int64)
        w = np.ones((3, 2), np.float32)
        res = buf.dispatch(x, idx, w)                   # res.recv_x, res.counts, res.offsets, ...
        out = buf.combine(res.recv_x, res.handle)       # [3, 128] bf16
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]

With torch.distributed (``torchrun --nproc-per-node N``), pass the process group (or
``elasticep.TorchGroup()``) as the group; tensors may be torch CUDA tensors, and the library runs on
torch's current CUDA stream.

Public API: :class:`Buffer`, :class:`DispatchResult`, :func:`get_buffer`, :func:`reset`,
:class:`Group`, :func:`ThreadGroup`, :class:`TorchGroup`, :func:`MpiWorld`, the errors in
:mod:`elasticep.errors`, :func:`system_info`, :func:`scale_columns`, :func:`backend_available`, and the
serving layer in :mod:`elasticep.serving` (start-up checks, phase-aware dispatcher, adapters, reference
MoE layer).
"""

from . import _C
from . import errors as _errors
from .errors import (
    CapacityExceededError,
    CudaError,
    Error,
    InternalError,
    InvalidArgumentError,
    NcclError,
    TimeoutError,
    UnsupportedError,
)

_C._set_error_factory(_errors._make)

from .buffer import Buffer, DispatchResult, get_buffer, reset  # noqa: E402
from .groups import Group, MpiWorld, ThreadGroup, TorchGroup  # noqa: E402
from . import serving  # noqa: E402  (the serving layer: elasticep.serving)

Handle = _C.Handle
Handle.__doc__ = """Single-use token from a dispatch that its combine consumes.

Properties: ``valid`` (made by a dispatch and not yet consumed), ``num_sms`` (the SM count the
dispatch used), ``layout``."""

__version__ = _C.version()


def system_info():
    """What this build and machine offer: version, compiled backends, CUDA/NCCL versions, GPUs (a dict)."""
    return _C.system_info()


def backend_available(backend):
    """Whether ``backend`` ("cpu", "cuda", "auto") is compiled in and usable here."""
    return _C.backend_available(str(backend))


def scale_columns(scale_format, hidden):
    """Scale columns per row as stored: fp32 groups for f32_g128, packed int32 words for ue8m0."""
    return _C.scale_columns(scale_format, hidden)  # checked there: hidden must be an int in [1, 65536]


__all__ = [
    "Buffer", "DispatchResult", "Handle", "get_buffer", "reset", "Group", "ThreadGroup", "TorchGroup", "MpiWorld",
    "Error", "InvalidArgumentError", "CapacityExceededError", "TimeoutError", "UnsupportedError", "CudaError",
    "NcclError", "InternalError", "system_info", "backend_available", "scale_columns", "__version__", "serving",
]
