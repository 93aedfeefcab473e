"""Stop requests: a signal asks the job to finish its step, write what is complete and exit.

Note: Slurm sends a signal before the time limit when asked to (``sbatch --signal=USR1@120``,
or SIGTERM at the limit itself, then SIGKILL ``KillWait`` seconds later), and so does a
preemption; a user's Ctrl-C is SIGINT. The handler only sets a flag: the decode loop looks at
it between steps, the ranks agree on it (a signal may reach some ranks only), every rank
finishes the step it is in, the journal is closed, and the job exits with
`rlx_mpi.journal.REQUEUE_EXIT`. Nothing is done inside the handler, so a signal cannot land
in the middle of a write or an MPI call. A second SIGINT is not a request any more: it acts
as it would without us (a KeyboardInterrupt), for the user who does not want to wait.

Under MPICH's mpiexec a signal to the launcher reaches every rank (measured: SIGTERM, SIGINT
and SIGUSR1 alike), and SIGTERM often twice, once more through the rank's supervisor
(`rlx_mpi.faults.supervise`); call `StopRequest.restore` before exiting, which then ignores
the late copy instead of letting it kill the rank on its way out with the requeue code.
A signal sent to a supervisor alone (not its process group) is passed on for SIGTERM and
SIGHUP only: SIGUSR1 sent that way never reaches the rank.
"""

from __future__ import annotations

import signal
import threading
from typing import Iterable

__all__ = ["StopRequest", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """A flag set by the stop signals; install it once per rank, in the main thread.

    >>> stop = StopRequest().install()
    >>> # ... in the loop, between steps:  if stop.requested: finish, flush, exit
    >>> stop.restore()
    """

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None  # the first stop signal received, e.g. "SIGTERM"
        self.count = 0  # stop signals received
        self._previous: dict[int, object] = {}

    def install(self, signals: Iterable[int] = STOP_SIGNALS) -> "StopRequest":
        """Catch ``signals`` from now on (the previous handlers are kept for `restore`)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopRequest.install must be called from the main thread "
                               "(Python runs signal handlers there only)")
        for sig in signals:
            sig = signal.Signals(sig)
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)  # installing twice keeps the first previous
        return self

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        if not self.requested:
            self.requested, self.signal_name = True, name  # the loop logs it when it acts on it
        if signum == signal.SIGINT:  # a second Ctrl-C interrupts at once, as without us
            signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def restore(self, finished: bool = False) -> None:
        """Put back the handlers that were there before `install`.

        Once a stop was requested, SIGTERM and SIGUSR1 are ignored instead: the launcher and
        the rank's supervisor may each deliver the same signal, and a late copy must not kill
        a rank that is exiting cleanly with the requeue code (Python puts the default action
        back at exit, so leaving our handler would not do). So they are once the work is
        ``finished``: a time limit reached just after the last row, while the ranks write
        their report and exit, killed them (exit 143) and the job ended FAILED with its output
        complete (seen in test_slurm's requeue test on a fast host). SIGINT gets its old handler back.
        """
        for sig, previous in self._previous.items():
            if (self.requested or finished) and sig != signal.SIGINT:
                previous = signal.SIG_IGN
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "StopRequest":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"StopRequest(requested={self.requested}, signal_name={self.signal_name!r})"
