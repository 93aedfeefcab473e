"""The supervisor's side: a parent that waits for its rank and decides how the launched process ends.

`supervisor.supervise` forks every launched process into a rank and this parent (why: the
supervisor module's note), which reads the lines the rank posts (``ctx``, ``watch``, ``init``,
``ready``, ``code``, ``done``) and waits for it without burning a core.

The supervisor (`Watcher`) ends the job, naming the rank, when the child
- dies of a signal nobody sent the parent too (the launcher's SIGTERM, a Ctrl-C are not faults;
  after ``code <n>`` such a death keeps the rank's code: srun --kill-on-bad-exit
  terminates the ranks still exiting once the first has exited 2, and the job must end with 2);
- exits without posting ``done`` (``os._exit(0)`` in a plug-in, an import error, a broken MPI);
- has not posted ``ready`` when the start-up deadline passes (a stopped rank, a hung mount);
- stays stopped for ``RLX_MPI_SUPERVISOR_STOP_S`` after posting ``finish`` (its last wait, the
  finish barrier, and its exit): the other ranks may have left, and no deadline of theirs names it.
  A rank stopped, or stuck before it even reached MPI_Init, is reported at the deadline
  (rank r ``STAGGER_S`` x r later, at most 10 steps); a rank inside MPI_Init is most likely
  waiting for such a rank, so its parent waits a few seconds more (``GRACE_S``, staggered by
  rank) before it reports that start-up did not finish.

Note: one line when every rank stalls. A hung shared filesystem stalls every rank at once, and
their deadlines then expire together: each parent reported, and 2 to 4 lines raced to the log
before the launcher ended the job. So the deadline counts from the start of the launched process
(not the fork, which a loaded node delays differently for each rank), the ranks' verdicts are
staggered (the lowest rank speaks first, its death ends the job before the next one's turn), and
on one host the parents of one launch agree that only the first reports: it holds an abstract
socket named after the launcher's process (`first_report`, nothing left on disk), the others end
the job without a line.
Launchers react to a death by signal, not reliably to an exit code, so after its report the
parent cancels the Slurm step (under srun) and kills itself with SIGKILL (MPICH then ends the
job with code 9, srun --kill-on-bad-exit likewise). A waiting rank's parent gives a stopped or dead rank's parent a few seconds' grace
to report first, so the line names the rank at fault.

Note: a rank stopped at the end. Mid-run, a stopped rank is named by the rank waiting for it (its
deadline expires). After the last message the others leave: under Open MPI a rank SIGSTOPped
after the finish barrier (a quick job, 200 prompts in 2.4 s, stopped as the test saw its second
row) left mpirun waiting for it for ever, every row written. So from ``finish`` on the parent
looks at its rank's state every 0.5 s; stopped (``T``) that long, it names the rank and ends
the job. A suspended job (``scontrol suspend``: the parent stopped too) is not a fault: the
parent's own clock jumps when it runs again, and its count starts again.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time

__all__ = ["Watcher", "StoppedFor", "GRACE_S", "STAGGER_S", "drain", "cancel_slurm_step", "first_report", "launched_at", "state",
           "stat_fields", "rank_from_env"]

GRACE_S = 3.0  # a waiting rank's parent reports this much after a stopped rank's parent
STOP_POLL_S = 0.5  # after ``finish``: how often the parent looks whether its rank is stopped
STAGGER_S = 0.25  # a stalled rank's parent reports this much x rank (at most 10) after the deadline (< GRACE_S)
_EXIT_FAULT = 4  # errors.EXIT_FAULT, without importing the package's heavier modules here
# Signals the supervisor survives; it passes on those that end a process and that a sender may
# have meant for the rank (launchers signal the whole process group, so the rank has the rest).
_NOTED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# SIGUSR1 too: Slurm's `--signal=USR1@T` (or a user's `kill -USR1`) may reach only the launched
# process, and `generate` treats it as "finish the step, write, exit for requeue".
_PASSED_ON = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
_CRASHES = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)
_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


class Watcher:
    """Waits for the rank without burning a core; decides how the launched process ends."""

    def __init__(self, child: int, fd: int, started: float, limit_s: float, stop_limit_s: float):
        self.child, self.fd, self.started = child, fd, started
        # until the rank posts ``watch``: the deadline before the job file is read
        self.limit_s, self.limit_by = limit_s, "RLX_MPI_STARTUP_TIMEOUT_S"
        self.grace_until: float | None = None
        self.waited = False  # the in-MPI grace was given
        self.claim: socket.socket | None = None  # held from the report to the end (`_first_report`)
        self.context, self.in_mpi, self.is_ready, self.is_done = "", False, False, False
        self.finishing = False  # ``finish``: the rank is past its last message; a stop is its parent's to name
        self.stop_limit_s = stop_limit_s
        self.stopped = StoppedFor(min(STOP_POLL_S, stop_limit_s / 4))  # the rank's stop, looked at after ``finish``
        self.decided: int | None = None  # the exit code the rank posted with ``code``
        self.tolerated = False  # ``tolerate``: a death after MPI start-up is the survivors' to handle
        self.noted: set[int] = set()
        self.pending = b""

    def run(self) -> int:
        for sig in _NOTED:
            signal.signal(sig, self._note)
        try:
            pidfd = os.pidfd_open(self.child)  # readable when the child ends (Linux >= 5.3)
        except (AttributeError, OSError):
            pidfd = None
        watched = [self.fd]
        while True:
            timeout = None if self.is_ready else max(0.0, self._deadline() - time.monotonic())
            if pidfd is None:
                timeout = 0.2 if timeout is None else min(timeout, 0.2)
            if self.finishing or self.is_done:
                timeout = self.stopped.poll_s if timeout is None else min(timeout, self.stopped.poll_s)
            try:
                ready_fds, _, _ = select.select(watched + ([pidfd] if pidfd is not None else []), [], [], timeout)
            except InterruptedError:
                ready_fds = []
            if self.fd in ready_fds and not self._read():
                watched = []  # the rank closed the pipe (or died): only wait for it now
            ended, status = os.waitpid(self.child, os.WNOHANG)
            if ended:
                self._read_rest()
                return self._ended(status)
            if not self.is_ready and time.monotonic() >= self._deadline():
                code = self._stalled()
                if code is not None:
                    return code
            if self.finishing or self.is_done:
                seconds = self.stopped.look(self.child)
                if seconds >= self.stop_limit_s:
                    return self._stopped_at_end(seconds)

    def _note(self, sig, _frame) -> None:
        self.noted.add(sig)
        if sig in _PASSED_ON:
            try:
                os.kill(self.child, sig)
            except ProcessLookupError:
                pass

    def _deadline(self) -> float:
        return self.grace_until if self.grace_until is not None else self.started + self.limit_s

    def _read(self) -> bool:
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        self._parse(chunk)
        return bool(chunk)

    def _read_rest(self) -> None:
        os.set_blocking(self.fd, False)
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self._parse(chunk)
        if self.pending:
            self._parse(b"\n")

    def _parse(self, chunk: bytes) -> None:
        lines = (self.pending + chunk).split(b"\n")
        self.pending = lines.pop()
        for raw in lines:
            kind, _, rest = raw.decode("utf-8", "replace").partition(" ")
            if kind == "ctx":
                self.context = rest
            elif kind == "watch":
                seconds, _, by = rest.partition(" ")
                try:
                    self.limit_s, self.limit_by = float(seconds), by or self.limit_by
                except ValueError:
                    pass
            elif kind == "init":
                self.in_mpi = True
            elif kind == "ready":
                self.is_ready = True
            elif kind == "code":
                if rest.strip().isdigit():
                    self.decided = int(rest)
            elif kind == "done":
                self.is_done = True
            elif kind == "finish":
                self.finishing = True
            elif kind == "tolerate":
                self.tolerated = True

    # -- verdicts --------------------------------------------------------------------------------

    def _who(self) -> str:
        return self.context or f"{rank_from_env()} ({socket.gethostname()})"

    def _report(self, what: str, fix: str) -> None:
        """One line naming the rank, unless another rank's parent on this host reported first."""
        self.claim, first = first_report()
        if not first:  # its line is the job's; the launcher is ending every rank
            return
        sys.stderr.write(f"rlx-mpi: error: {self._who()}: {what}; {fix}\nrlx-mpi: ending the job\n")
        sys.stderr.flush()
        drain(sys.stderr.fileno())

    def _end_job(self) -> int:
        """Make the launcher end every rank: cancel the Slurm step, then die of SIGKILL.

        Note: launchers react to a death by signal, not reliably to an exit code. MPICH's hydra
        ignores a non-zero exit of a process that never initialised MPI (the others then spin in
        MPI_Init for ever), and across hosts it did not end the job on an exit code after
        MPI_Init either (5 of 5 trials ran on to the forward deadline); plain srun ends a step
        neither on an exit code nor on a signal unless --kill-on-bad-exit is given, so under
        Slurm the step is cancelled outright. The job's exit code is then the launcher's (9
        under MPICH); the line above names the rank.
        """
        cancel_slurm_step()
        for sig in _NOTED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGKILL)
        return _EXIT_FAULT  # not reached

    def _kill_rank_and_end(self) -> int:
        """After a report on a rank still alive (stopped or stuck): kill it, then end the job."""
        try:
            os.kill(self.child, signal.SIGKILL)
            os.waitpid(self.child, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        return self._end_job()

    def _ended(self, status: int) -> int:
        phase = "" if self.is_ready else " before MPI start-up finished"
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig in self.noted:  # sent to us both (the launcher, a Ctrl-C): not this rank's fault
                return self.decided if self.decided is not None else 128 + sig
            if self.tolerated and self.is_ready and self.decided is None:
                return 0  # ULFM: exit 0 so the launcher tells the survivors at once (`lifecycle.ulfm`)
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            if sig == signal.SIGKILL:
                hint = ("killed from outside: by the kernel's OOM killer (check dmesg or the job's memory limit) "
                        "or a kill -9")
            elif sig in _CRASHES:
                hint = "crashed in native code (numpy, h5py, MPI); its Python stack is above"
            else:
                hint = "killed by a signal from outside the program"
            self._report(f"died of {name} (pid {self.child}){phase}", hint)
            return self._end_job()
        code = os.waitstatus_to_exitcode(status)
        if self.is_done:
            return code
        if self.noted:  # the launcher is ending the job: the rank's early exit is its doing
            return code or 128 + min(self.noted)
        if not self.is_ready:
            hint = ("its output above says why: a broken Python, MPI or package installation on that node, "
                    "an import error, or a plug-in that exits")
        else:
            hint = ("a plug-in or library ended the process (exit(), os._exit()) before the job's end; "
                    "every rank must reach the end for the result to be complete")
        self._report(f"ended with exit status {code}{phase} (pid {self.child}), before the end of the job", hint)
        return self._end_job()

    def _stopped_at_end(self, seconds: float) -> int:
        """Name the rank stopped after its last message, then end it and the job."""
        # (the context posted for MPI_Finalize's watchdog explains an exit, not a stop: its cause is cut)
        self.context = self.context.partition(" (stuck over")[0]
        self._report(f"stopped (SIGSTOP or SIGTSTP) at the end of the job, past its last message, for "
                     f"{seconds:.0f} s (pid {self.child}), and a stopped process never lets the job end",
                     "find what stopped it (a debugger, a kill -STOP, the batch system); the job's output was "
                     "written before this point, and a rerun finds its rows done (RLX_MPI_SUPERVISOR_STOP_S "
                     "sets how long the supervisor waits)")
        return self._kill_rank_and_end()

    def _stalled(self) -> int | None:
        """The start-up deadline passed and MPI is not up: report a stopped rank now, a waiting one later."""
        stopped = state(self.child) in ("T", "t")
        rank = rank_from_env().rpartition(" ")[2]
        steps = min(int(rank) if rank.isdigit() else 0, 10)
        if not stopped and self.in_mpi and not self.waited:  # most likely waiting for a rank reported first
            self.waited = True
            self.grace_until = time.monotonic() + GRACE_S + 0.5 * steps
            return None
        if self.grace_until is None and steps:  # stalled here, maybe on every rank: the lowest speaks first
            self.grace_until = time.monotonic() + STAGGER_S * steps
            return None
        setting = ("[run] startup_timeout_s" if self.limit_by == "startup_timeout_s"
                   else f"{self.limit_by}, the start-up deadline before the job file is read")
        if stopped:
            what = f"stopped (SIGSTOP or SIGTSTP) during start-up and still stopped after {self.limit_s:g} s ({setting})"
            fix = "find what stopped it (a debugger, a Ctrl-Z, the batch system) or resume it with kill -CONT"
        elif not self.in_mpi:
            what = (f"stuck for {self.limit_s:g} s ({setting}) before MPI start-up, while importing Python "
                    "packages or reading the job file")
            fix = ("check this node's filesystems (a hung NFS/Lustre mount, a FIFO given as a file) and its Python "
                   "installation; if start-up is only slow, raise " + setting.split(",")[0])
        else:
            what = f"MPI start-up did not finish within {self.limit_s:g} s ({setting})"
            fix = ("another rank is stuck or dead (see its line above), a filesystem is hanging, or the launcher "
                   "could not start every rank; if start-up is only slow, raise " + setting.split(",")[0])
        self._report(what, fix)
        return self._kill_rank_and_end()


class StoppedFor:
    """How long a process has been seen stopped (state ``T``) by one that looks at it every
    ``poll_s``: a gap in the looks means the looker was stopped too (a suspended job), and the
    count starts again. The rank's watch of its supervisor and the supervisor's of its rank."""

    def __init__(self, poll_s: float):
        self.poll_s, self.since, self.last = poll_s, None, time.monotonic()

    def look(self, pid: int) -> float:
        """Seconds ``pid`` has been stopped so far (0: running, or the count started again)."""
        now = time.monotonic()
        if now - self.last > 4 * self.poll_s + 1.0:
            self.since = None
        self.last = now
        if state(pid) != "T":
            self.since = None
            return 0.0
        self.since = now if self.since is None else self.since
        return now - self.since


def cancel_slurm_step() -> None:
    """Under srun: cancel this job step outright (srun ends a step on a signal only with
    --kill-on-bad-exit). Nothing elsewhere."""
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    if not (job and step):
        return
    import subprocess

    try:
        subprocess.run(["scancel", "--quiet", "--signal=KILL", f"{job}.{step}"], timeout=10,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        pass  # no scancel on this node: the signal still reaches srun --kill-on-bad-exit


def drain(fd: int, limit_s: float = 1.0) -> None:
    """Wait (briefly) until the reader of pipe ``fd`` has taken what we wrote.

    The launcher forwards our stderr and our end by different routes; a report still sitting
    in the pipe when the launcher ends the job would be lost.
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


def stat_fields(pid: int | str) -> list[str]:
    """``/proc/<pid>/stat`` from field 3 (the state) on: field k is at index k - 3."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def launched_at() -> float:
    """When this process started, on the `time.monotonic` clock (now, if /proc cannot say).

    Note: the fork of the supervisor comes after Python has imported the CLI, which a loaded node
    makes take a different time on each rank; the launcher starts them all within milliseconds.
    """
    now = time.monotonic()
    try:
        ticks = int(stat_fields("self")[19])  # field 22: start time in clock ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - min(max(age, 0.0), 3600.0)


def first_report() -> tuple[socket.socket | None, bool]:
    """Is this the first rank's parent on this host, in this launch, to report? (the claim, yes/no)

    The claim is an abstract Unix socket named after the launcher's process here (MPICH's proxy,
    slurmstepd, prted: the parent of every supervisor of the launch on this node) and its start
    time; the kernel frees it when the holder dies, and it leaves no file behind.
    """
    import errno

    launcher = os.getppid()
    try:
        name = f"\0rlx-mpi-report-{launcher}-{stat_fields(launcher)[19]}"
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    except (OSError, IndexError):
        return None, True
    try:
        claim.bind(name)
    except OSError as e:
        claim.close()
        return None, e.errno != errno.EADDRINUSE  # anything else: better two lines than none
    return claim, True


def state(pid: int) -> str:
    """A process's state letter from /proc (\"T\": stopped), \"?\" when it cannot be read."""
    try:
        return stat_fields(pid)[0]
    except (OSError, IndexError):
        return "?"


def rank_from_env() -> str:
    """\"rank N\" from the launcher's environment, \"a rank\" when it does not say."""
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return f"rank {os.environ[var]}"
    return "a rank"
