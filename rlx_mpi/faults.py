"""Failure handling under MPI: deadlines on every wait, agreed errors, abort on faults.

MPI has no timeouts of its own, and one failing rank leaves the others blocked for ever.

Note: three rules, used by every command.
1. Every blocking wait on the run path is a non-blocking MPI call finished by `wait`, which
   polls with back-off (no core burnt) and raises `DeadlineExpired` naming the rank waited for.
2. Start-up phases (config, probe, plan, weight loading) run under `agree`: the ranks
   combine an error flag, the first failing rank's message is broadcast, and every rank raises
   the same `AgreedFailure`, so rank 0 prints one line and all exit with the same code.
3. Anything else (an exception mid-run, an expired deadline) is reported once by the rank
   that saw it, with its context and traceback, and `abort` ends the whole job.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numpy as np

from .errors import EXIT_FAULT, DeadlineExpired, RlxError

__all__ = ["RankContext", "AgreedFailure", "wait", "agree", "report_and_abort"]

T = TypeVar("T")

_SPIN_POLLS = 2000  # short waits (a TP allreduce) stay on the fast path
_MAX_SLEEP_S = 0.005  # long waits poll 200 times a second at most


@dataclass
class RankContext:
    """Who this rank is, for messages: filled in as start-up learns it."""

    rank: int
    size: int
    host: str = "?"
    stage: int | None = None
    layers: range | None = None
    tp_rank: int | None = None
    microbatch: int | None = None
    debug: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [self.host]
        if self.stage is not None:
            parts.append(f"stage {self.stage}")
        if self.layers is not None:
            parts.append(f"layers {self.layers.start}:{self.layers.stop}")
        if self.tp_rank is not None and self.extra.get("tp", 1) > 1:
            parts.append(f"tp rank {self.tp_rank}")
        if self.microbatch is not None:
            parts.append(f"microbatch {self.microbatch}")
        return f"rank {self.rank} ({', '.join(parts)})"


class AgreedFailure(Exception):
    """Every rank raises this with the same message and exit code after `agree`."""

    def __init__(self, line: str, exit_code: int, rank: int):
        super().__init__(line)
        self.line, self.exit_code, self.rank = line, exit_code, rank


def wait(request: Any, timeout_s: float, ctx: RankContext, waiting_for: Callable[[], str],
         suspect: str = "the rank it waits for") -> None:
    """Finish ``request`` or raise `DeadlineExpired` after ``timeout_s`` seconds."""
    if request.Test():
        return
    deadline = time.monotonic() + timeout_s
    polls, nap = 0, 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            raise DeadlineExpired(ctx.describe(), f"waited {timeout_s:.1f} s for {waiting_for()}",
                                  f"{suspect} is stuck or dead, see its output above; if it is only slow, "
                                  "raise [run] timeout_s")
        polls += 1
        if polls < _SPIN_POLLS:
            os.sched_yield()  # a rank sharing the core (oversubscribed) may be the one we wait for
        else:
            time.sleep(nap)
            nap = min(nap * 2, _MAX_SLEEP_S)


def _bcast_text(comm: Any, text: str, root: int, timeout_s: float, ctx: RankContext) -> str:
    """Broadcast a short string as bytes (no pickle)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8) if comm.rank == root else None
    n = np.array([0 if data is None else data.size], dtype=np.int64)
    wait(comm.Ibcast(n, root=root), timeout_s, ctx, lambda: f"an error message from rank {root}")
    buf = data.copy() if data is not None else np.empty(int(n[0]), dtype=np.uint8)
    wait(comm.Ibcast(buf, root=root), timeout_s, ctx, lambda: f"an error message from rank {root}")
    return buf.tobytes().decode("utf-8")


def agree(comm: Any, ctx: RankContext, timeout_s: float, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raises `RlxError` on any, all raise one `AgreedFailure`.

    Unexpected exceptions are faults, not bad input: they are reported and abort the job.
    """
    failure: RlxError | None = None
    try:
        result = fn()
    except RlxError as e:
        failure, result = e, None
    except Exception:  # a bug or a broken node: no agreement possible, end the job
        report_and_abort(comm, ctx, sys.exc_info(), EXIT_FAULT)
        raise  # only reached with a fake comm in tests
    from mpi4py import MPI

    flag = np.array([comm.rank if failure else comm.size], dtype=np.int32)
    wait(comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.MIN), timeout_s, ctx,
         lambda: "the other ranks to finish start-up", "some rank")
    root = int(flag[0])
    if root == comm.size:
        return result
    payload = f"{failure.exit_code}|{failure.line()}" if comm.rank == root else ""
    code, _, line = _bcast_text(comm, payload, root, timeout_s, ctx).partition("|")
    if ctx.debug and failure is not None:
        traceback.print_exception(failure, file=sys.stderr)
    raise AgreedFailure(line, int(code), root)


def report_and_abort(comm: Any, ctx: RankContext, exc_info: Any, exit_code: int = EXIT_FAULT) -> None:
    """Print this rank's context and the fault once, then end every rank of the job."""
    exc = exc_info[1]
    if isinstance(exc, RlxError):
        exit_code = exc.exit_code if exc.exit_code not in (0, 2) else EXIT_FAULT
        head = f"rlx-mpi: error: {exc.line()}"
        if ctx.rank is not None and not exc.where.startswith("rank "):
            head = f"rlx-mpi: error: {ctx.describe()}: {exc.line()}"
    else:
        head = f"rlx-mpi: error: {ctx.describe()}: {type(exc).__name__}: {exc}"
    lines = [head]
    if ctx.debug or not isinstance(exc, RlxError):
        lines.append("".join(traceback.format_exception(*exc_info)).rstrip())
    lines.append(f"rlx-mpi: aborting all {ctx.size} ranks (exit code {exit_code})")
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    comm.Abort(exit_code)
