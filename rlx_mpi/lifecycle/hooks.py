"""Test hooks: the few behaviours a test injects into a real job, as one object.

A driver takes a `TestHooks` (the default does nothing); the command line builds it once from
the environment (`TestHooks.from_env`: the launched ranks of an MPI test cannot be given an
object, only an environment), so the production code asks the object, never the environment,
and a test that drives a driver in-process passes its own. Each field is off by default.

- ``tp_diverge`` (``RLX_MPI_TEST_TP_DIVERGE=RANK:STEP``): world rank RANK flips a bit of the
  first token of its STEP-th step (from 1), as a scheduler gone out of lockstep would.
- ``step_delay_s`` (``RLX_MPI_TEST_STEP_DELAY_S``): stage 0 sleeps before issuing each step, so
  a test's signal lands mid-run however fast the host is.
- ``hold_s`` (``RLX_MPI_TEST_HOLD_S``): once the first row is in the output (rank 0), or once its
  replica finished a row (another replica's first stage), a replica stops between steps until a
  stop is requested (at most that long), so a test's signal lands mid-run however fast or late
  each replica is (CI: rank 0 reached its loop after the others had done all 120 prompts). Not
  with TP: its other ranks would wait on the first's all-reduce.
- ``kill_after`` (``RLX_MPI_TEST_KILL=RANK:SECONDS[:STOP][,...]``): world rank RANK SIGKILLs
  itself (a node dying mid-run), or with ``:STOP`` SIGSTOPs itself (a stuck node), that long after
  its generate run starts, after one stderr line.

(The pre-MPI faults, ``RLX_MPI_TEST_PREINIT``, act before any object exists: `launch`.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["TestHooks", "NO_HOOKS"]

_armed = False  # `TestHooks.arm_kill` ran in this process


@dataclass(frozen=True)
class TestHooks:
    """What a test asks of a job (the module's list); all off by default."""

    __test__ = False  # (not a pytest class)

    tp_diverge: tuple[int, int] | None = None  # (world rank, step from 1)
    step_delay_s: float = 0.0
    hold_s: float = 0.0
    kill_after: tuple[tuple[int, float, str], ...] = ()  # (world rank, seconds into the run, "KILL" | "STOP")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TestHooks":
        env = os.environ if env is None else env
        who, _, step = env.get("RLX_MPI_TEST_TP_DIVERGE", "").partition(":")
        diverge = (int(who), int(step or 1)) if who.strip().isdigit() else None
        kills = tuple((int(r), float(t), (how or "KILL").upper()) for r, t, how in
                      ((k.split(":") + [""])[:3] for k in env.get("RLX_MPI_TEST_KILL", "").split(",") if k.strip()))
        return cls(diverge, float(env.get("RLX_MPI_TEST_STEP_DELAY_S", "0") or 0),
                   float(env.get("RLX_MPI_TEST_HOLD_S", "0") or 0), kills)

    def arm_kill(self, rank: int) -> None:
        """Start ``kill_after``'s timer for world rank ``rank`` (a daemon thread), if it names it;
        once a process (a job started again on its survivors numbers them anew: `cluster.restart`)."""
        import signal
        import sys
        import threading
        import time

        global _armed
        if _armed:
            return
        _armed = True
        for who, seconds, how in self.kill_after:
            if who == rank:
                def die(who=who, how=how) -> None:
                    sys.stderr.write(f"rlx-mpi test: rank {who} kills itself (SIG{how}) at {time.time():.3f}\n")
                    sys.stderr.flush()
                    os.kill(os.getpid(), getattr(signal, f"SIG{how}"))

                timer = threading.Timer(seconds, die)
                timer.daemon = True  # (a job that ends first ends it)
                timer.start()

    def diverge_step(self, rank: int) -> int | None:
        """The step at which world rank ``rank`` flips a token, or None."""
        return self.tp_diverge[1] if self.tp_diverge and self.tp_diverge[0] == rank else None

    @property
    def hold_polls(self) -> int:
        """``hold_s`` as 10 ms polls."""
        return int(self.hold_s * 100)


NO_HOOKS = TestHooks()
