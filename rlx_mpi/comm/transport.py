"""Hidden states between pipeline stages: buffer-based point-to-point with deadlines.

Buffers are numpy arrays whose shape the plan fixes at setup; a message of another size is
a named error, not silent corruption. Nothing is pickled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import RankFault
from ..lifecycle.faults import RankContext, wait

__all__ = ["Link", "Pending", "bcast_json", "gather_json", "bcast_array"]


@dataclass
class Link:
    """This rank's point-to-point endpoint, with counters for the stats table."""

    comm: Any
    ctx: RankContext
    timeout_s: float
    send_timeout_s: float | None = None  # default: timeout_s
    recv_wait_s: float = 0.0
    bytes_sent: int = 0

    def send(self, buf: np.ndarray, dest: int, tag: int, what: str) -> None:
        """Send ``buf`` (C-contiguous) to ``dest``; the wait has the run deadline."""
        request = self.comm.Isend(buf, dest=dest, tag=tag)
        timeout = self.timeout_s if self.send_timeout_s is None else self.send_timeout_s
        wait(request, timeout, self.ctx, lambda: f"rank {dest} to take {what}", f"rank {dest}")
        self.bytes_sent += buf.nbytes

    def recv(self, buf: np.ndarray, source: int, tag: int, what: str) -> np.ndarray:
        """Receive exactly ``buf.nbytes`` bytes from ``source`` into ``buf``."""
        from mpi4py import MPI

        t0 = time.perf_counter()
        status = MPI.Status()
        request = self.comm.Irecv(buf, source=source, tag=tag)
        wait_status(request, status, self.timeout_s, self.ctx, lambda: f"{what} from rank {source}", f"rank {source}")
        self.recv_wait_s += time.perf_counter() - t0
        got = status.Get_count(MPI.BYTE)
        if got != buf.nbytes:
            raise RankFault(self.ctx.describe(), f"expected {buf.nbytes} bytes of {what} from rank {source}, "
                            f"actual {got}", "the ranks disagree on the plan; this is a bug, please report it")
        return buf


    # -- non-blocking: the executor posts early and waits late ----------------------------------

    def isend(self, buf: np.ndarray, dest: int, tag: int, what: str) -> "Pending":
        """Post a send of ``buf`` (C-contiguous, untouched until waited) to ``dest``."""
        self.bytes_sent += buf.nbytes
        return Pending(self, self.comm.Isend(buf, dest=dest, tag=tag), None, buf, dest, what, True)

    def irecv(self, buf: np.ndarray, source: int, tag: int, what: str) -> "Pending":
        """Post a receive of exactly ``buf.nbytes`` bytes from ``source`` into ``buf``."""
        from mpi4py import MPI

        status = MPI.Status()
        return Pending(self, self.comm.Irecv(buf, source=source, tag=tag), status, buf, source, what, False)


@dataclass
class Pending:
    """A posted send or receive; `wait` finishes it under the link's (staggered) deadline."""

    link: Link
    request: Any
    status: Any  # MPI.Status for receives (to check the byte count), None for sends
    buf: np.ndarray
    peer: int
    what: str
    is_send: bool

    def wait(self) -> float:
        """Block until done or the deadline; returns the seconds waited (a receive's also counted in the link's ``recv_wait_s``)."""
        link, peer, what = self.link, self.peer, self.what
        t0 = time.perf_counter()
        if self.is_send:
            timeout = link.timeout_s if link.send_timeout_s is None else link.send_timeout_s
            wait(self.request, timeout, link.ctx, lambda: f"rank {peer} to take {what}", f"rank {peer}")
            return time.perf_counter() - t0
        wait_status(self.request, self.status, link.timeout_s, link.ctx, lambda: f"{what} from rank {peer}",
                    f"rank {peer}")
        waited = time.perf_counter() - t0
        link.recv_wait_s += waited
        _check_count(self.status, self.buf, link.ctx, what, peer)
        return waited


def _check_count(status: Any, buf: np.ndarray, ctx: RankContext, what: str, source: int) -> None:
    from mpi4py import MPI

    got = status.Get_count(MPI.BYTE)
    if got != buf.nbytes:
        raise RankFault(ctx.describe(), f"expected {buf.nbytes} bytes of {what} from rank {source}, "
                        f"actual {got}", "the ranks disagree on the plan or the wire format; this is a bug, "
                        "please report it")


def wait_status(request: Any, status: Any, timeout_s: float, ctx: RankContext, waiting_for, suspect: str) -> None:
    """`wait`, then fill ``status`` (mpi4py's Test only fills it on the completing call)."""
    holder = _StatusRequest(request, status)
    wait(holder, timeout_s, ctx, waiting_for, suspect)


class _StatusRequest:
    __slots__ = ("request", "status")

    def __init__(self, request: Any, status: Any):
        self.request, self.status = request, status

    def Test(self) -> bool:
        return self.request.Test(self.status)


# -- control messages: small JSON documents, never pickle ----------------------------------------


def bcast_json(comm: Any, obj: Any, root: int, timeout_s: float, ctx: RankContext, what: str) -> Any:
    """Broadcast a JSON-serialisable ``obj`` from ``root``; every rank returns it."""
    import json

    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy() if comm.rank == root else None
    n = np.array([0 if data is None else data.size], dtype=np.int64)
    wait(comm.Ibcast(n, root=root), timeout_s, ctx, lambda: f"{what} from rank {root}", f"rank {root}")
    buf = data if data is not None else np.empty(int(n[0]), dtype=np.uint8)
    wait(comm.Ibcast(buf, root=root), timeout_s, ctx, lambda: f"{what} from rank {root}", f"rank {root}")
    return json.loads(buf.tobytes())


def gather_json(comm: Any, obj: Any, root: int, timeout_s: float, ctx: RankContext, what: str) -> list | None:
    """Gather one JSON-serialisable object per rank on ``root`` (others get None)."""
    import json

    from mpi4py import MPI

    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
    sizes = np.zeros(comm.size, dtype=np.int64) if comm.rank == root else None
    mine = np.array([data.size], dtype=np.int64)
    wait(comm.Igather(mine, sizes, root=root), timeout_s, ctx, lambda: f"{what} of every rank", "some rank")
    if comm.rank == root:
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        recv = [out, sizes.tolist(), displs.tolist(), MPI.BYTE]
    else:
        recv = None
    wait(comm.Igatherv(data, recv, root=root), timeout_s, ctx, lambda: f"{what} of every rank", "some rank")
    if comm.rank != root:
        return None
    return [json.loads(out[d:d + s].tobytes()) for d, s in zip(displs, sizes)]


def bcast_array(comm: Any, array: np.ndarray | None, root: int, timeout_s: float, ctx: RankContext,
                what: str) -> np.ndarray:
    """Broadcast an int64 array of any shape from ``root`` (shape first, then data)."""
    header = np.zeros(8, dtype=np.int64)
    if comm.rank == root:
        header[0] = array.ndim
        header[1:1 + array.ndim] = array.shape
    wait(comm.Ibcast(header, root=root), timeout_s, ctx, lambda: f"{what} from rank {root}", f"rank {root}")
    shape = tuple(int(d) for d in header[1:1 + int(header[0])])
    buf = np.ascontiguousarray(array, dtype=np.int64) if comm.rank == root else np.empty(shape, dtype=np.int64)
    wait(comm.Ibcast(buf, root=root), timeout_s, ctx, lambda: f"{what} from rank {root}", f"rank {root}")
    return buf
