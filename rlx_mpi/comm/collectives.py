"""The tensor-parallel collective: an in-place all-reduce over a communicator."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = ["ReduceKind", "all_reduce", "default_comm"]

_DTYPES = (np.float32, np.float64, np.int32, np.int64)
_default_comm = None


class ReduceKind(enum.Enum):
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


def default_comm() -> Any:
    """A private clone of COMM_WORLD, made on first use (never at import)."""
    global _default_comm
    if _default_comm is None:
        from mpi4py import MPI

        _default_comm = MPI.COMM_WORLD.Dup()
    return _default_comm


def world_ranks(comm: Any) -> list[int]:
    """The COMM_WORLD ranks of ``comm``'s members, for messages that name them."""
    from mpi4py import MPI

    return list(comm.group.Translate_ranks(list(range(comm.size)), MPI.COMM_WORLD.group))


def _mpi_op(kind: ReduceKind) -> Any:
    from mpi4py import MPI

    return {ReduceKind.SUM: MPI.SUM, ReduceKind.MEAN: MPI.SUM, ReduceKind.MAX: MPI.MAX,
            ReduceKind.MIN: MPI.MIN}[kind]


def all_reduce(buf: np.ndarray, kind: ReduceKind = ReduceKind.SUM, *, comm: Any = None,
               timeout_s: float | None = None, ctx: Any = None) -> np.ndarray:
    """Reduce ``buf`` element-wise across ``comm`` in place and return it.

    ``buf`` must be a C-contiguous, writable numpy array of float32, float64, int32 or int64
    (MEAN needs a float dtype). With ``timeout_s`` the wait has a deadline and raises
    `DeadlineExpired` naming ``ctx`` (a `RankContext`) instead of hanging.
    """
    if not isinstance(kind, ReduceKind):
        raise TypeError(f"all_reduce: kind must be a ReduceKind, got {type(kind).__name__}")
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"all_reduce: buf must be a numpy array, got {type(buf).__name__}")
    if buf.dtype.type not in _DTYPES:
        raise TypeError(f"all_reduce: buf dtype {buf.dtype} is not supported; "
                        "use float32, float64, int32 or int64 (e.g. buf.astype(np.float32))")
    if not buf.flags.c_contiguous:
        raise ValueError("all_reduce: buf is not C-contiguous (a slice or transpose?); "
                         "pass np.ascontiguousarray(buf) and use the returned array")
    if not buf.flags.writeable:
        raise ValueError("all_reduce: buf is read-only; reduce into a writable copy (buf.copy())")
    if kind is ReduceKind.MEAN and buf.dtype.kind != "f":
        raise TypeError(f"all_reduce: MEAN needs a float buffer, got {buf.dtype}; reduce with SUM and divide")
    comm = default_comm() if comm is None else comm
    if comm.size == 1:
        return buf
    from mpi4py import MPI

    if timeout_s is None:
        comm.Allreduce(MPI.IN_PLACE, buf, op=_mpi_op(kind))
    else:
        from ..lifecycle.faults import RankContext, wait

        request = comm.Iallreduce(MPI.IN_PLACE, buf, op=_mpi_op(kind))
        ctx = ctx or RankContext(rank=comm.rank, size=comm.size)
        wait(request, timeout_s, ctx, lambda: f"an all-reduce over {comm.size} tensor-parallel ranks",
             lambda: f"one of world ranks {world_ranks(comm)}")
    if kind is ReduceKind.MEAN:
        buf /= comm.size
    return buf
