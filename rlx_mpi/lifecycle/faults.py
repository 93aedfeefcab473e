"""Failure handling under MPI: deadlines on every wait, agreed errors, abort on faults.

MPI has no timeouts of its own, and one failing rank leaves the others blocked for ever.

Note: four rules, used by every command.
1. Every blocking wait on the run path is a non-blocking MPI call finished by `wait`, which
   polls with back-off (no core burnt) and raises `DeadlineExpired` naming the rank waited for.
2. Start-up phases (config, probe, plan, weight loading) run under `agree`: the ranks
   combine an error flag, the first failing rank's message is broadcast, and every rank raises
   the same `AgreedFailure`, so rank 0 prints one line and all exit with the same code.
3. Anything else (an exception mid-run, an expired deadline) is reported once by the rank
   that saw it, with its context and traceback, and `abort` ends the whole job.
4. A rank that dies, exits early or stalls before MPI is up can say nothing, so its parent
   process (`rlx_mpi.supervisor`) names it and ends the job.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from . import supervisor
from .. import tags
from ..errors import EXIT_FAULT, DeadlineExpired, RankFault, RlxError
from .supervisor import supervise  # noqa: F401  (moved to supervisor.py; kept importable here)
from .watcher import drain

__all__ = ["RankContext", "AgreedFailure", "wait", "agree", "bounded", "check_finite", "check_output",
           "report_and_abort", "supervise", "set_watch", "STARTUP_SETTING"]

STARTUP_SETTING = "[run] startup_timeout_s"

T = TypeVar("T")

_SPIN_POLLS = 2000  # short waits (a TP allreduce) stay on the fast path
_MAX_SLEEP_S = 0.001  # long waits wake up 1000 times a second at most
_BURST_POLLS = 20  # Tests in a row after each nap: MPI progresses only inside Test, and an
# allreduce or a rendezvous send needs several rounds once the late rank arrives; one Test per
# nap made each round cost a whole nap (15-30 ms per late all-reduce, bench_collectives.py)


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

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if supervisor.active() and "extra" in self.__dict__:  # fully built: keep the supervisor posted
            supervisor.post_context(self.describe())


class AgreedFailure(Exception):
    """Every rank raises this with the same message and exit code after `agree`."""

    def __init__(self, line: str, exit_code: int, rank: int):
        super().__init__(line)
        self.line, self.exit_code, self.rank = line, exit_code, rank


_watch: Callable[[], None] | None = None  # `set_watch`


def set_watch(check: Callable[[], None] | None) -> None:
    """Run ``check`` in every `wait` of this rank until cleared (None): it raises to end the wait
    (`ulfm.watch`: a rank died under ``on_rank_failure = "continue"``)."""
    global _watch
    _watch = check


def wait(request: Any, timeout_s: float, ctx: RankContext, waiting_for: Callable[[], str],
         suspect: str | Callable[[], str] = "the rank it waits for", setting: str | None = None) -> None:
    """Finish ``request`` or raise `DeadlineExpired` after ``timeout_s`` seconds.

    ``setting`` is the knob the message tells the user to raise if the wait is only slow;
    by default the one of the rank's phase (``ctx.extra["deadline_setting"]``: start-up
    steps wait under ``[run] startup_timeout_s``, the run under ``[run] timeout_s``).
    """
    if request.Test():
        return
    deadline = time.monotonic() + timeout_s
    setting = setting or ctx.extra.get("deadline_setting", "[run] timeout_s")
    polls, nap = 0, 1e-5
    while not request.Test():
        if _watch is not None:  # (on_rank_failure = "continue": a death that ends the layout, `ulfm.watch`)
            _watch()
        if time.monotonic() > deadline:
            raise DeadlineExpired(ctx.describe(), f"waited {timeout_s:.1f} s for {waiting_for()}",
                                  f"{suspect() if callable(suspect) else suspect} is stuck or dead, see its "
                                  f"output above; if it is only slow, raise {setting}")
        polls += 1
        if polls < _SPIN_POLLS:
            os.sched_yield()  # a rank sharing the core (oversubscribed) may be the one we wait for
        else:
            time.sleep(nap)
            nap = min(nap * 2, _MAX_SLEEP_S)
            for _ in range(_BURST_POLLS):
                if request.Test():
                    return
                os.sched_yield()


class _AllOf:
    """Several requests finished together (so `wait` can put one deadline on them)."""

    def __init__(self, requests: list):
        self.requests = requests

    def Test(self) -> bool:  # noqa: N802 (mpi4py's spelling)
        from mpi4py import MPI

        return MPI.Request.Testall(self.requests)


def _bcast_text(comm: Any, text: str, root: int, timeout_s: float, ctx: RankContext, setting: str) -> str:
    """Broadcast a short string as bytes (no pickle)."""
    import numpy as np  # here, not at the top: the failure path runs without numpy
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8) if comm.rank == root else None
    n = np.array([0 if data is None else data.size], dtype=np.int64)
    what = lambda: f"an error message from rank {root}"  # noqa: E731
    wait(comm.Ibcast(n, root=root), timeout_s, ctx, what, setting=setting)
    buf = data.copy() if data is not None else np.empty(int(n[0]), dtype=np.uint8)
    wait(comm.Ibcast(buf, root=root), timeout_s, ctx, what, setting=setting)
    return buf.tobytes().decode("utf-8")


def bounded(fn: Callable[[], T], timeout_s: float, ctx: RankContext, what: str,
            setting: str = STARTUP_SETTING) -> T:
    """``fn()``, or `DeadlineExpired` if it has not returned after ``timeout_s`` seconds.

    Note: start-up work before a collective (opening the job file, the checkpoint, the input
    ids) can block for ever on a FIFO or a hung NFS/Lustre mount, and every rank blocks on the
    same file. No MPI deadline covers that, so the work runs in a daemon thread the caller
    stops waiting for; the stuck thread is abandoned and the process ends soon after.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException:  # handed to the caller's thread below
            box["exc"] = sys.exc_info()

    worker = threading.Thread(target=target, name=f"rlx-mpi {what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise DeadlineExpired(ctx.describe(), f"{what} did not finish within {timeout_s:g} s",
                              "a file it reads may be a FIFO or on a hung filesystem (NFS, Lustre); check the "
                              f"paths and mounts on that node; if it is only slow, raise {setting}")
    if "exc" in box:
        _, exc, tb = box["exc"]
        raise exc.with_traceback(tb)
    return box["result"]


def agree(comm: Any, ctx: RankContext, timeout_s: float, fn: Callable[[], T], what: str = "start-up",
          setting: str = STARTUP_SETTING) -> T:
    """Run ``fn`` on every rank; if it raises `RlxError` on any, all raise one `AgreedFailure`.

    ``fn`` itself is bounded by ``timeout_s`` (see `bounded`). Unexpected exceptions are faults,
    not bad input: they are reported and abort the job.

    Note: one line naming the right rank. Every rank sends its verdict to rank 0, which waits
    for all with a deadline a little past ``timeout_s`` (so a rank whose own ``fn`` timed out
    is heard first) and, if some never answer, names them and aborts. The other ranks wait
    longer for rank 0's decision, staggered by rank, so if rank 0 is the one stuck, rank 1
    alone names it before the others give up.
    """
    import numpy as np  # here, not at the top: the failure path runs without numpy
    failure: RlxError | None = None
    try:
        result = bounded(fn, timeout_s, ctx, what, setting)
    except RlxError as e:
        failure, result = e, None
    except Exception:  # a bug or a broken node: no agreement possible, end the job
        report_and_abort(comm, ctx, sys.exc_info(), EXIT_FAULT)
        raise  # only reached with a fake comm in tests
    n, grace = comm.size, max(2.0, 0.1 * timeout_s)
    mine = np.array([comm.rank if failure else n], dtype=np.int32)
    verdict = np.array([n], dtype=np.int32)
    if n > 1:
        if comm.rank == 0:
            flags = np.full(n, n, dtype=np.int32)
            flags[0] = mine[0]
            requests = [comm.Irecv(flags[r:r + 1], source=r, tag=tags.AGREE) for r in range(1, n)]
            try:
                wait(_AllOf(requests), timeout_s + grace, ctx, lambda: f"every rank to finish {what}",
                     "some rank", setting)
            except DeadlineExpired:
                missing = [r for r, q in zip(range(1, n), requests) if not q.Test()]
                raise DeadlineExpired(ctx.describe(), f"rank{'s' if len(missing) > 1 else ''} "
                                      f"{', '.join(map(str, missing))} did not finish {what} within "
                                      f"{timeout_s + grace:.1f} s", "stuck or dead, see the output above; if "
                                      f"start-up is only slow, raise {setting}") from None
            verdict[0] = flags.min()
        else:
            wait(comm.Isend(mine, dest=0, tag=tags.AGREE), timeout_s + grace, ctx,
                 lambda: f"rank 0 to take this rank's result of {what}", "rank 0", setting)
        late = timeout_s + 2 * grace + 0.5 * min(comm.rank, 10)
        wait(comm.Ibcast(verdict, root=0), late, ctx, lambda: f"rank 0 to finish {what}", "rank 0", setting)
    else:
        verdict[0] = mine[0]
    root = int(verdict[0])
    if root == n:
        return result
    payload = f"{failure.exit_code}|{failure.line()}" if comm.rank == root else ""
    code, _, line = _bcast_text(comm, payload, root, timeout_s + 2 * grace, ctx, setting).partition("|")
    if ctx.debug and failure is not None:
        traceback.print_exception(failure, file=sys.stderr)
    raise AgreedFailure(line, int(code), root)


def check_finite(array: np.ndarray, what: str, ctx: RankContext) -> None:
    """Raise `RankFault` (exit 4) if ``array`` holds NaN or Inf: exit 0 means finite results."""
    import numpy as np  # here, not at the top: the failure path runs without numpy
    if np.isfinite(array).all():
        return
    bad = int(array.size - np.count_nonzero(np.isfinite(array)))
    raise RankFault(ctx.describe(), f"{what} has {bad} non-finite values (NaN or Inf) of {array.size}",
                    "the weights or the model config are broken (rms_norm_eps, rope_theta); set [model] "
                    "check_finite = true to find a bad tensor, or re-convert the model")


def check_output(out: Any, stage: int, ctx: RankContext, parts: Callable[[], Any], what: str = "output",
                 after: str = "") -> None:
    """The one non-finite rule: every stage checks its output before sending it (run, score,
    generate), so a NaN or Inf ends the job (exit 4) naming the stage that made it, not the
    last one it reached, and the rows it belongs to.

    ``parts()`` gives ``(name, view)`` per row (a prompt, a line, a batch row): the real tokens
    only, so that padding past a row's end is never blamed; it is called only when ``out`` holds
    a non-finite value (the common case costs one ``isfinite`` pass). ``after`` ends the message
    (e.g. what was not written).
    """
    import numpy as np  # here, not at the top: the failure path runs without numpy
    if np.isfinite(out).all():
        return
    bad = []
    for name, view in parts():
        n = int(view.size - np.count_nonzero(np.isfinite(view)))
        if n:
            bad.append((name, n))
    if not bad:  # only padding past the rows' real tokens
        return
    names = [name for name, _ in bad]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise RankFault(ctx.describe(), f"stage {stage}'s {what} for {shown} has {sum(n for _, n in bad)} non-finite "
                    f"values (NaN or Inf){after}", "the weights or the model config are broken (rms_norm_eps, "
                    "rope_theta); set [model] check_finite = true to find a bad tensor, or re-convert the model")


def report_and_abort(comm: Any, ctx: RankContext, exc_info: Any, exit_code: int = EXIT_FAULT) -> None:
    """Print this rank's context and the fault once, then end every rank of the job."""
    exc = exc_info[1]
    if isinstance(exc, RlxError):
        exit_code = exc.exit_code or EXIT_FAULT  # bad input found mid-run is still bad input (2)
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
    drain(sys.stderr.fileno())
    supervisor.done()  # reported: the supervisor must not report this end a second time
    from mpi4py import MPI

    if not isinstance(comm, MPI.Comm):  # a fake communicator in a test
        comm.Abort(exit_code)
        return
    # Note: abort COMM_WORLD, not ``comm``. MPICH's launcher takes the job's exit code from an
    # abort of COMM_WORLD; an abort of a duplicate (every `Cluster` works on one) races its
    # clean-up and often ends the job with code 9. And MPICH's abort of COMM_WORLD returns,
    # leaving the launcher to kill us: exit now, so nothing else runs or prints meanwhile.
    MPI.COMM_WORLD.Abort(exit_code)
    os._exit(exit_code)
