"""The pre-MPI parent of every launched rank: it names a rank that dies or stalls and ends the job.

Note: why a parent process. A rank killed by a signal (kill -9, the OOM killer, a crash in
native code) cannot report anything, and one that dies or stops *before or during MPI_Init*
leaves the other ranks spinning in MPI_Init for ever: MPICH's launcher ends the job when a
process dies of a signal, but not when one exits (with any status) before MPI start-up, and a
process that exits 0 after it makes the whole job "succeed". So the process the launcher
started forks before MPI is touched; the child is the rank, the parent waits for it and reads
short lines the rank posts through a pipe:

    ctx <text>     the rank's `RankContext.describe()`, for messages
    watch <s> <by> the start-up deadline: MPI must be initialised within <s> s of launch
    init           the rank is entering MPI_Init (where it waits for every other rank)
    ready          MPI is initialised; from here on every wait has its own deadline
    code <n>       the rank's exit code is decided (a failure every rank agreed on); it is ending
    finish         the rank is past its last message (the finish barrier, MPI_Finalize, the exit are
                   left): the other ranks may leave, so a stop from here is the parent's to name
    done           the rank reached the normal end of the command (any exit code)
    tolerate       on_rank_failure = "continue" under ULFM: the rank's death is the survivors' to
                   report and to survive (`lifecycle.ulfm`'s note); the parent then exits 0 quietly

What the parent makes of them, and how it ends the job naming the rank, is `watcher.py`. This
module is the rank's side (posting those lines) and the fork.

The supervisor must itself stay responsive: stopped (a SIGSTOP, a debugger) it would neither
report nor end, and the launcher would wait for it for ever. So the rank watches it in turn (a
daemon thread reading ``/proc/<pid>/stat``: state ``T`` is certain and costs one read every
0.5 s); a supervisor stopped for ``RLX_MPI_SUPERVISOR_STOP_S`` seconds (default 10) makes the
rank print one line naming itself and its supervisor, then end the job as a dead rank does:
it SIGKILLs its stopped supervisor (the launcher sees the process it started die of a signal;
the rank follows by its parent-death signal), after cancelling the Slurm step under srun. When
the rank was stopped too (a suspended job: ``scontrol suspend``, a whole-tree SIGSTOP) its
clock starts again when it runs again, so resuming a suspended job is not a fault.

The deadline before the job file is read is ``RLX_MPI_STARTUP_TIMEOUT_S`` (default 600 s);
the rank replaces it with the job's ``[run] startup_timeout_s`` as soon as it has read it.
Linux only; ``RLX_MPI_SUPERVISE=0`` turns it off. Call `supervise` only from the process's
entry point, never from a library: the caller's process becomes the supervisor.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from ..rules import DEFAULT_STARTUP_TIMEOUT_S  # (rules imports only errors: still numpy-free)
from .watcher import StoppedFor, Watcher, cancel_slurm_step, drain, launched_at, rank_from_env, state

__all__ = ["supervise", "active", "post_context", "watch", "entering_mpi", "ready", "finishing", "done", "default_startup_timeout_s",
           "stopped_supervisor_s", "exiting", "tolerate", "DEFAULT_STARTUP_TIMEOUT_S", "DEFAULT_STOPPED_SUPERVISOR_S"]

DEFAULT_STOPPED_SUPERVISOR_S = 10.0  # RLX_MPI_SUPERVISOR_STOP_S: a stopped supervisor ends the job after this
_EXIT_FAULT = 4  # errors.EXIT_FAULT, without importing the package's heavier modules here

_post_fd: int | None = None  # in a supervised rank: the pipe to its supervisor
_context = ""  # in a supervised rank: the last context posted (names the rank in its own report)


def default_startup_timeout_s() -> float:
    """The start-up deadline before the job file is read: ``RLX_MPI_STARTUP_TIMEOUT_S`` or 600 s."""
    try:
        value = float(os.environ.get("RLX_MPI_STARTUP_TIMEOUT_S", DEFAULT_STARTUP_TIMEOUT_S))
    except ValueError:
        return DEFAULT_STARTUP_TIMEOUT_S
    return value if 0 < value < float("inf") else DEFAULT_STARTUP_TIMEOUT_S


# -- the rank's side ---------------------------------------------------------------------------


def active() -> bool:
    """Is this process a supervised rank?"""
    return _post_fd is not None


def _post(text: str) -> None:
    if _post_fd is None:
        return
    try:
        os.write(_post_fd, text.replace("\n", " ").encode("utf-8", "replace")[:1000] + b"\n")
    except OSError:  # a full pipe or a gone supervisor: a message matters less than the run
        pass


def post_context(text: str) -> None:
    """Tell the supervisor who this rank is now (rank, host, stage, layers, microbatch)."""
    global _context
    _context = text
    _post(f"ctx {text}")


def watch(seconds: float, by: str) -> None:
    """MPI must be initialised within ``seconds`` of launch; ``by`` names the setting."""
    _post(f"watch {seconds!r} {by}")


def entering_mpi() -> None:
    """The rank is about to initialise MPI (and wait there for the others)."""
    _post("init")


def ready() -> None:
    """MPI is initialised: the start-up deadline is over, later waits carry their own."""
    _post("ready")


def exiting(code: int) -> None:
    """This rank's exit code is decided; a launcher's signal from here on must not change it."""
    _post(f"code {int(code)}")


def tolerate() -> None:
    """The survivors go on without this rank if it dies (ULFM): its supervisor must not end the job."""
    _post("tolerate")


def finishing() -> None:
    """This rank is past its command's last message: the other ranks may leave before it ends."""
    _post("finish")


def done() -> None:
    """This rank reached the normal end of its command (whatever its exit code).

    A supervisor stopped at this moment would never reap the rank, and the job would hang in its
    launcher: the rank waits here while the supervisor stays stopped, so the watch thread ends
    the job named once it has been stopped RLX_MPI_SUPERVISOR_STOP_S (a job whose work was done
    just before the stop, seen under Open MPI); a supervisor that resumes lets the rank go on."""
    _post("done")
    if _post_fd is not None:
        parent = os.getppid()
        while state(parent) == "T":  # as _watch_supervisor reads it
            time.sleep(0.1)


# -- the supervisor's side ---------------------------------------------------------------------


def supervise() -> None:
    """Split this process into a supervisor and the rank proper; return in the rank."""
    global _post_fd
    if os.environ.get("RLX_MPI_SUPERVISE", "1") == "0" or not sys.platform.startswith("linux"):
        return
    if "mpi4py.MPI" in sys.modules:  # MPI may be initialised: a fork now would confuse it
        return
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    parent, started = os.getpid(), launched_at()
    child = os.fork()
    if child == 0:
        os.close(read_fd)
        _die_with_parent(parent)
        os.set_blocking(write_fd, False)  # never stall the rank on its supervisor
        _post_fd = write_fd
        import faulthandler
        import threading

        faulthandler.enable()  # a crash in native code shows the Python stack
        threading.Thread(target=_watch_supervisor, args=(parent, stopped_supervisor_s()),
                         name="rlx-mpi-supervisor-watch", daemon=True).start()
        return
    os.close(write_fd)
    code = Watcher(child, read_fd, started, default_startup_timeout_s(), stopped_supervisor_s()).run()
    os._exit(code)


def stopped_supervisor_s() -> float:
    """How long a rank lets its supervisor stay stopped (and a supervisor its rank, at the end):
    ``RLX_MPI_SUPERVISOR_STOP_S`` or 10 s."""
    try:
        value = float(os.environ.get("RLX_MPI_SUPERVISOR_STOP_S", DEFAULT_STOPPED_SUPERVISOR_S))
    except ValueError:
        return DEFAULT_STOPPED_SUPERVISOR_S
    return value if 0 < value < float("inf") else DEFAULT_STOPPED_SUPERVISOR_S


def _watch_supervisor(parent: int, limit_s: float, poll_s: float = 0.5) -> None:
    """The rank's side (a daemon thread): end the job if the supervisor stays stopped ``limit_s``."""
    stopped = StoppedFor(min(poll_s, limit_s / 4))
    while True:
        time.sleep(stopped.poll_s)
        if os.getppid() != parent:  # the supervisor is gone: the parent-death signal ends us
            return
        seconds = stopped.look(parent)  # (this rank stopped too, a suspended job: the count starts again)
        if seconds >= limit_s:
            _supervisor_stopped(parent, seconds)
            return


def _supervisor_stopped(parent: int, seconds: float) -> None:
    """Report the stopped supervisor in one line, then end the job as its death would."""
    who = _context or f"{rank_from_env()} ({socket.gethostname()})"
    line = (f"rlx-mpi: error: {who}: its supervisor (pid {parent}, the process the launcher started) has been "
            f"stopped (SIGSTOP or SIGTSTP) for {seconds:.0f} s, and a stopped process never lets the job end; "
            "find what stopped it (a debugger, a kill -STOP, the batch system) and run the job again "
            "(RLX_MPI_SUPERVISOR_STOP_S sets how long a rank waits for it)\nrlx-mpi: ending the job\n")
    try:
        os.write(2, line.encode("utf-8", "replace"))  # not sys.stderr: the main thread may hold its lock
    except OSError:
        pass
    drain(2)
    cancel_slurm_step()
    try:
        os.kill(parent, signal.SIGKILL)  # the launcher sees its process die of a signal, as for a dead rank
    except ProcessLookupError:
        pass
    time.sleep(1.0)  # the parent-death signal arrives first
    os.kill(os.getpid(), signal.SIGKILL)


def _die_with_parent(parent: int) -> None:
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        os._exit(_EXIT_FAULT)
