"""Exceptions raised by ElasticEP.

Every error of the C++ library arrives as one of these, with the library's code and message:

- :class:`Error` -- the base class; ``code`` is the C++ ``ErrorCode`` name (``"InvalidArgument"``,
  ``"Timeout"``, ...), ``message`` the text without the code, ``str(e)`` is ``"[Code] message"``
  exactly as C++ ``what()``.
- :class:`InvalidArgumentError` and :class:`CapacityExceededError` are also :class:`ValueError`.
- :class:`TimeoutError` is also the builtin :class:`TimeoutError`.
- :class:`UnsupportedError`, :class:`CudaError`, :class:`NcclError`, :class:`InternalError`.
"""

import builtins


class Error(Exception):
    """Base class of every ElasticEP error.

    Attributes:
        code: the C++ ErrorCode name, e.g. ``"InvalidArgument"``.
        message: the message without the ``[Code]`` prefix.
    """

    code = "Internal"

    def __init__(self, message, code=None):
        if code is not None:
            self.code = code
        self.message = message
        super().__init__("[%s] %s" % (self.code, message))

    def __str__(self):
        return "[%s] %s" % (self.code, self.message)


class InvalidArgumentError(Error, ValueError):
    """Bad shape, dtype, stride, device, expert id, handle or option (C++ ``kInvalidArgument``)."""

    code = "InvalidArgument"


class CapacityExceededError(Error, ValueError):
    """More tokens than ``max_tokens_per_rank``, or an output too small (C++ ``kCapacityExceeded``)."""

    code = "CapacityExceeded"


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - deliberately shadows the builtin name
    """A peer did not arrive within the buffer's timeout (C++ ``kTimeout``).

    The buffer is unusable afterwards: destroy it and build a new one.
    """

    code = "Timeout"


class UnsupportedError(Error):
    """A valid request that this build, backend or machine cannot serve (C++ ``kUnsupported``)."""

    code = "Unsupported"


class CudaError(Error, RuntimeError):
    """A CUDA runtime or driver failure (C++ ``kCuda``)."""

    code = "Cuda"


class NcclError(Error, RuntimeError):
    """An NCCL failure (C++ ``kNccl``)."""

    code = "Nccl"


class InternalError(Error, RuntimeError):
    """A broken invariant inside the library: a bug, please report it (C++ ``kInternal``)."""

    code = "Internal"


_BY_CODE = {
    "InvalidArgument": InvalidArgumentError,
    "CapacityExceeded": CapacityExceededError,
    "Timeout": TimeoutError,
    "Unsupported": UnsupportedError,
    "Cuda": CudaError,
    "Nccl": NcclError,
    "Internal": InternalError,
}


def _make(code, message, what=None):
    """Builds the exception for a C++ error (called by the extension's exception translator)."""
    cls = _BY_CODE.get(code)
    # One positional argument: OSError (a base of TimeoutError) reads two as (errno, strerror).
    return cls(message) if cls is not None else Error(message, code)
