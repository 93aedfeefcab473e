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
4. A rank that dies of a signal can say nothing, so its `supervise` parent names it.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import numpy as np

from .errors import EXIT_FAULT, DeadlineExpired, RlxError

__all__ = ["RankContext", "AgreedFailure", "wait", "agree", "report_and_abort", "supervise"]

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
        if _post_fd is not None and "extra" in self.__dict__:  # fully built: keep the supervisor posted
            _post(self.describe())


class AgreedFailure(Exception):
    """Every rank raises this with the same message and exit code after `agree`."""

    def __init__(self, line: str, exit_code: int, rank: int):
        super().__init__(line)
        self.line, self.exit_code, self.rank = line, exit_code, rank


def wait(request: Any, timeout_s: float, ctx: RankContext, waiting_for: Callable[[], str],
         suspect: str | Callable[[], str] = "the rank it waits for") -> None:
    """Finish ``request`` or raise `DeadlineExpired` after ``timeout_s`` seconds."""
    if request.Test():
        return
    deadline = time.monotonic() + timeout_s
    polls, nap = 0, 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            raise DeadlineExpired(ctx.describe(), f"waited {timeout_s:.1f} s for {waiting_for()}",
                                  f"{suspect() if callable(suspect) else suspect} is stuck or dead, see its "
                                  "output above; if it is only slow, "
                                  "raise [run] timeout_s")
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
    _drain(sys.stderr.fileno())
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


# -- the supervisor: name a rank that dies of a signal ------------------------------------------

_post_fd: int | None = None  # in a supervised rank: the pipe to its supervisor
# Signals the supervisor survives; it passes on those that end a process and that a sender may
# have meant for the rank (launchers signal the whole process group, so the rank has the rest).
_NOTED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_PASSED_ON = (signal.SIGTERM, signal.SIGHUP)
_CRASHES = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)
_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def supervise() -> None:
    """Split this process into a supervisor and the rank proper; return in the rank.

    Note: a rank killed by a signal (kill -9, the kernel's OOM killer, a crash in native code)
    cannot report anything, and MPICH's launcher then ends the job naming only a PID (at times
    one it killed while cleaning up). So the process the launcher started forks before MPI is
    initialised and waits for its child, the rank, which posts its `RankContext.describe()`
    through a pipe as it changes. If the rank dies of a signal the supervisor prints that
    context and exits with EXIT_FAULT, which makes the launcher end the job; otherwise it exits
    with the rank's status. A signal the supervisor got too (the launcher's SIGTERM, a Ctrl-C)
    is no fault of the rank's and is not reported. The rank is killed if its supervisor dies
    (PR_SET_PDEATHSIG), so killing the launched process ends the rank.
    Linux only; ``RLX_MPI_SUPERVISE=0`` turns it off. Call it only from the process's entry
    point, never from a library call: the caller's process becomes the supervisor.
    """
    global _post_fd
    if os.environ.get("RLX_MPI_SUPERVISE", "1") == "0" or not sys.platform.startswith("linux"):
        return
    if "mpi4py.MPI" in sys.modules:  # MPI may be initialised: a fork now would confuse it
        return
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    supervisor = os.getpid()
    child = os.fork()
    if child == 0:
        os.close(read_fd)
        _die_with_parent(supervisor)
        os.set_blocking(write_fd, False)  # never stall the rank on its supervisor
        _post_fd = write_fd
        import faulthandler

        faulthandler.enable()  # a crash in native code shows the Python stack
        return
    os.close(write_fd)
    os._exit(_watch(child, read_fd))


def _drain(fd: int, limit_s: float = 1.0) -> None:
    """Wait (briefly) until the reader of pipe ``fd`` has taken what we wrote.

    The launcher forwards our stderr and our abort by different routes; MPICH's exits on the
    abort, and a report still sitting in the pipe would be lost.
    """
    import fcntl
    import termios

    deadline = time.monotonic() + limit_s
    buf = bytearray(4)
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(fd, termios.FIONREAD, buf)
        except OSError:  # not a pipe (a file, a terminal): nothing to wait for
            return
        if int.from_bytes(buf, sys.byteorder) == 0:
            return
        time.sleep(0.002)


def _post(text: str) -> None:
    try:
        os.write(_post_fd, text.encode("utf-8", "replace")[:1000] + b"\n")
    except OSError:  # a full pipe or a gone supervisor: a message matters less than the run
        pass


def _die_with_parent(parent: int) -> None:
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        os._exit(EXIT_FAULT)


def _watch(child: int, fd: int) -> int:
    """Wait for ``child`` without burning a core; return the exit code to end with."""
    noted: set[int] = set()

    def note(sig, _frame):
        noted.add(sig)
        if sig in _PASSED_ON:
            try:
                os.kill(child, sig)
            except ProcessLookupError:
                pass

    for sig in _NOTED:
        signal.signal(sig, note)
    try:
        pidfd = os.pidfd_open(child)  # readable when the child ends (Linux >= 5.3)
    except (AttributeError, OSError):
        pidfd = None
    last, pending, watched = b"", b"", [fd]
    while True:
        ready, _, _ = select.select(watched + ([pidfd] if pidfd is not None else []), [], [],
                                    None if pidfd is not None else 0.2)
        if fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                watched = []  # the rank closed the pipe (or died): only wait for it now
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop()
            last = lines[-1] if lines else last
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
    os.set_blocking(fd, False)
    try:
        lines = (pending + os.read(fd, 65536)).split(b"\n")
        last = next((line for line in reversed(lines) if line), last)
    except OSError:
        pass
    if not os.WIFSIGNALED(status):
        return os.waitstatus_to_exitcode(status)
    sig = os.WTERMSIG(status)
    if sig in noted:  # sent to us both (the launcher, a Ctrl-C): not this rank's fault
        return 128 + sig
    who = last.decode("utf-8", "replace") or _rank_from_env()
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig == signal.SIGKILL:
        hint = "killed from outside: by the kernel's OOM killer (check dmesg or the job's memory limit) or a kill -9"
    elif sig in _CRASHES:
        hint = "crashed in native code (numpy, h5py, MPI); its Python stack is above"
    else:
        hint = "killed by a signal from outside the program"
    sys.stderr.write(f"rlx-mpi: error: {who}: died of {name} (pid {child}); {hint}\n"
                     "rlx-mpi: ending the job\n")
    sys.stderr.flush()
    return EXIT_FAULT


def _rank_from_env() -> str:
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return f"rank {os.environ[var]}"
    return "a rank"
