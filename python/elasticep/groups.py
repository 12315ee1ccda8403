"""Groups: the bootstrap channel between the ranks of one expert-parallel group.

- :func:`ThreadGroup` -- ranks as Python threads of one process (tests, the CPU backend, several
  ranks on one GPU).
- :class:`TorchGroup` -- over a ``torch.distributed`` process group (``torchrun``, one rank per GPU).
- :func:`MpiWorld` -- MPI_COMM_WORLD when the library was built with MPI.
- Subclass :class:`Group` to bring your own: implement ``rank()``, ``size()``,
  ``all_gather(data: bytes) -> bytes | list[bytes]``, ``barrier()`` and ``identity() -> str``.
"""

import uuid

from . import _C

Group = _C.Group
Group.__doc__ = """A collective channel for small control messages (buffer setup, registry keys, IPC handles).

Subclass it in Python to implement your own (call ``super().__init__()``), overriding:

- ``rank() -> int`` and ``size() -> int``;
- ``all_gather(data: bytes) -> bytes | list[bytes]``: every rank's ``data`` (all the same length),
  rank-major, either concatenated or as a list;
- ``barrier()``;
- ``identity() -> str``: the same on every rank of this group, different from every other live group.

Every rank calls each collective in the same order. The library calls these from its own code with
the GIL released and takes it back for the call, so they may run in any thread.
"""


def ThreadGroup(num_ranks, timeout=60.0):  # noqa: N802 - reads like the C++ class it wraps
    """Ranks as threads of one process: returns one :class:`Group` per rank.

    Hand ``groups[i]`` to the thread that plays rank i. Collectives wait at most ``timeout`` seconds
    for the other threads, then raise :class:`elasticep.TimeoutError`.
    """
    return list(_C.thread_group(num_ranks, timeout))  # checked there: an error names a bad value


def MpiWorld(timeout=60.0):  # noqa: N802
    """MPI_COMM_WORLD as a :class:`Group` (raises UnsupportedError when built without MPI)."""
    return _C.mpi_world(timeout)


class TorchGroup(Group):
    """A :class:`Group` over a ``torch.distributed`` process group.

    ``all_gather`` goes through ``torch.distributed.all_gather_object`` and ``barrier`` through
    ``torch.distributed.barrier``, so waits are bounded by the process group's own timeout (set it with
    ``init_process_group(timeout=...)``). Constructing it is collective (the ranks agree on an
    identity). With the NCCL backend, set the CUDA device (``torch.cuda.set_device``) first.

    Args:
        process_group: the torch ProcessGroup; None means the default (WORLD) group.
    """

    def __init__(self, process_group=None):
        super().__init__()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            from .errors import InvalidArgumentError

            raise InvalidArgumentError("TorchGroup: torch.distributed is not initialized; call "
                                       "torch.distributed.init_process_group first (torchrun sets the environment)")
        self._dist = dist
        self._pg = process_group
        self._rank = dist.get_rank(process_group)
        self._size = dist.get_world_size(process_group)
        mine = [uuid.uuid4().hex if self._rank == 0 else None]
        ids = [None] * self._size
        dist.all_gather_object(ids, mine[0], group=process_group)
        self._identity = "torch-pg-" + ids[0]

    @property
    def process_group(self):
        """The wrapped torch ProcessGroup (None: WORLD)."""
        return self._pg

    def rank(self):
        """This process's rank in the process group."""
        return self._rank

    def size(self):
        """The number of ranks in the process group."""
        return self._size

    def all_gather(self, data):
        """Every rank's ``data`` (bytes), rank-major, as a list."""
        out = [None] * self._size
        self._dist.all_gather_object(out, bytes(data), group=self._pg)
        return out

    def barrier(self):
        """torch.distributed.barrier over the process group."""
        self._dist.barrier(group=self._pg)

    def identity(self):
        """'torch-pg-<uuid>', agreed by every rank at construction."""
        return self._identity


_TORCH_GROUPS = {}  # id(process group) -> (process group, TorchGroup): one identity per process group


def as_group(group):
    """A :class:`Group` for ``group``: a Group as is; a torch ProcessGroup (or None with
    torch.distributed initialized) wrapped in a cached :class:`TorchGroup`."""
    if isinstance(group, Group):
        return group
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available():
        dist = torch.distributed
        if group is None or isinstance(group, dist.ProcessGroup):
            if group is None and not dist.is_initialized():
                pass
            else:
                key = id(group)
                hit = _TORCH_GROUPS.get(key)
                if hit is None or hit[0] is not group:
                    hit = (group, TorchGroup(group))
                    _TORCH_GROUPS[key] = hit
                return hit[1]
    from .errors import InvalidArgumentError

    raise InvalidArgumentError("group must be an elasticep.Group (ThreadGroup(n)[rank], TorchGroup(...)) or a "
                               "torch.distributed ProcessGroup; got %r" % (group,))
