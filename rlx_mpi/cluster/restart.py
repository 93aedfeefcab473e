"""A job that lost ranks starts again on the survivors, as a resume (issue 46).

    code = run_command(job, make_driver, debug=False, log_dir=None, nothing_to_do=lambda d: 0)

`run_command` is `Cluster.start` -> `Cluster.run` -> ``driver.report`` for the commands whose
output resumes (``generate``, ``score``). Under ``[run] on_rank_failure = "continue"``, a death
the layout cannot carry (one pipeline, tp > 1, rank 0 with its collector and journal, or every
replica hit: `ulfm.deadly`) ends the run on every survivor (the watch, `ulfm`'s note) and
`again` starts the job once more on them:

1. rank 0's journal, if it lives, is closed: its whole rows are on disk and its lock released;
2. the survivors shrink the world (`ulfm.shrink`): its rank 0, the lowest survivor, is the new
   collector and journal owner;
3. `Cluster.start` runs again on that communicator with a fresh driver: the planner places the
   layers over the survivors (a fixed ``replicas`` is cut to one that divides them:
   `job_on_survivors`), each rank loads its layers from the checkpoint, and the driver's
   resume reads the output (a last line torn by a dead rank 0 is cut off: `io.journal`) and
   skips every row there. Rows in flight are computed again: a row's bits do not depend on
   the layout (`comm.replicas`' second note);
4. one warning line names the dead ranks (as launched), the new layout and the rows written.

What does not fit ends the job as before, with exit 75 (requeue) and one line saying why: the
model not fitting the survivors' memory, a layout the job file pins (``[[rank]]`` sections,
a manual placement that no longer tiles, tp not dividing them), or a second death during the
start-up (the watch is on meanwhile). Under ``on_rank_failure = "abort"`` (or MPICH)
`Cluster.run` never raises `ulfm.Restart` and nothing here differs from a plain start.

Note: nothing of the old layout is freed (`_kept`): its communicators and windows (freeing is
collective over ranks that are dead), and the failed run's frames with their MPI requests. A
receive left pending there may still be matched by a message a live peer sent before it left,
and MPI then writes into its buffer: with the buffer collected, that corrupted the heap (glibc
"malloc(): unsorted double linked list corrupted" in the shrink, 1 run of 2). Only the old
stage's own attributes (its weights and cache) are cleared before the new plan (`_drop_stage`):
what a request still holds stays alive through its own reference.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import socket
import sys
import time
from typing import Any, Callable

from ..errors import ConfigError
from ..lifecycle import faults, ulfm
from .start import Cluster

__all__ = ["run_command", "again", "job_on_survivors"]

log = logging.getLogger("rlx_mpi")

_kept: list = []  # the old layouts' communicators and windows (the module's note)


class _GiveUp(Exception):
    """The survivors cannot start again; every rank has said so: end with ``code``."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def run_command(job_path: Any, make_driver: Callable[[], Any], *, debug: bool = False, log_dir: Any = None,
                nothing_to_do: Callable[[Any], int] = lambda driver: 0) -> int:
    """The start-up, the work and the report of one command, started again on the survivors
    whenever ranks die (the module's list); ``nothing_to_do(driver)``: the exit code when the
    output was already complete."""
    driver = make_driver()
    cx = Cluster.start(job_path, driver, debug=debug, log_dir=log_dir)
    while cx is not None:
        try:
            result = cx.run(driver, restart=True)
        except ulfm.Restart as r:
            _kept.append(r)  # its frames hold the run's MPI requests and their buffers (the module's note)
            comm, dead = r.comm, r.dead
        else:
            return driver.report(cx, result)
        try:
            cx, driver = again(job_path, cx, driver, comm, dead, make_driver, debug)
        except _GiveUp as g:
            return g.code
    return nothing_to_do(driver)


def again(job_path: Any, cx: Cluster, driver: Any, comm: Any, dead: list[int], make_driver: Callable[[], Any],
          debug: bool) -> tuple[Cluster | None, Any]:
    """Start the job again on the survivors of ``comm`` (``dead``: its dead ranks), as a resume."""
    t0 = time.monotonic()
    lost = ulfm.world_numbers(comm, dead)
    journal = getattr(driver, "holder", {}).get("journal")
    if journal is not None:  # (rank 0 lives: its whole rows on disk, its lock released)
        try:
            journal.close()
        except Exception as e:  # a full disk: the rows not written are computed again
            log.warning("%s: closing the output before the restart: %s", journal.path, e)
    _kept.append((cx, driver))
    _drop_stage(cx)
    survivors = ulfm.shrink(comm)
    where = f"rank {survivors.rank} ({socket.gethostname()}) of the {survivors.size} survivors"
    faults.set_watch(ulfm.watch(survivors, None, where))  # a second death meanwhile: requeue
    driver = make_driver()
    try:
        new = Cluster.start(job_path, driver, debug=debug, comm=survivors, adjust=job_on_survivors)
    except Exception:
        _give_up(survivors, lost, sys.exc_info(), debug)
    finally:
        faults.set_watch(None)
    if survivors.rank == 0:
        sys.stderr.write(f"rlx-mpi: warning: {_said(lost, new, driver, survivors.size)}\n")
        sys.stderr.flush()
    log.info("restarted on %d ranks %.2f s after ranks %s were found dead", survivors.size, time.monotonic() - t0, lost)
    return new, driver


def _drop_stage(cx: Cluster) -> None:
    """Free the old stage's weights and cache before the new plan reads the free memory: its
    attributes are cleared, so what only it held goes (an array a pending request, or a view,
    still holds stays alive: MPI never writes into freed memory, the module's note)."""
    stage, cx.stage = cx.stage, None
    if stage is not None and hasattr(stage, "__dict__"):
        stage.__dict__.clear()
    gc.collect()


def job_on_survivors(job: Any, size: int) -> Any:
    """``job`` for ``size`` survivors: a fixed ``replicas`` cut to the most that divide them;
    refused (one line) when the job names ranks of the launch (``[[rank]]``)."""
    if job.ranks:
        raise ConfigError(f"{job.path}: [[rank]]", "the job sets ranks by their launch number, and the survivors are "
                          "numbered again", "rerun the same command on the full count to resume, or drop the [[rank]] "
                          "sections")
    p = job.placement
    if isinstance(p.replicas, int) and p.replicas > 1 and size % p.tp == 0:
        fit = max(r for r in range(1, p.replicas + 1) if (size // p.tp) % r == 0)
        if fit != p.replicas:
            job = dataclasses.replace(job, placement=dataclasses.replace(p, replicas=fit))
    return job


def _layout(cx: Cluster) -> str:
    topo = cx.topology
    n, s = topo.n_replicas, topo.n_stages
    text = f"{n} pipeline{'s' if n > 1 else ''} of {s} stage{'s' if s > 1 else ''}"
    return text + (f" x tp {topo.tp}" if topo.tp > 1 else "")


def _said(lost: list[int], cx: Cluster | None, driver: Any, size: int) -> str:
    """The warning line (new rank 0): who died, the new layout, the rows already written."""
    who = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} died"
    ranks = f"{size} rank{'s' if size > 1 else ''}"
    opts, total = getattr(driver, "opts", None), getattr(driver, "doc", {}).get("total")
    noun = "lines" if getattr(driver, "command", "") == "score" else "prompts"
    journal = getattr(driver, "holder", {}).get("journal")
    out = getattr(opts, "out", "the output")
    if cx is None:
        return f"{who}; every one of the {total} {noun} is already in {out}: nothing to start again"
    written = f" ({len(journal.done)} of {total} {noun} written)" if journal is not None and total else ""
    return f"{who}; {ranks} go{'es' if size == 1 else ''} on as {_layout(cx)}, resuming from {out}{written}"


def _give_up(comm: Any, lost: list[int], exc_info: Any, debug: bool) -> None:
    """The survivors cannot start again: exit 75 (requeue) with the line saying why; never returns."""
    from ..lifecycle import supervisor

    exc = exc_info[1]
    why = exc.line if isinstance(exc, faults.AgreedFailure) else (exc.line() if hasattr(exc, "line") else
                                                                  f"{type(exc).__name__}: {exc}")
    who = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} died"
    err = ulfm.Requeue(f"the {comm.size} surviving rank{'s' if comm.size > 1 else ''}",
                       f"{who} and the job cannot start again without {'it' if len(lost) == 1 else 'them'} ({why})",
                       "the rows finished are in the output; rerun the same command to resume "
                       "(exit code 75: requeue)")
    supervisor.exiting(ulfm.Requeue.exit_code)
    if isinstance(exc, faults.AgreedFailure):  # every survivor has it: the lowest speaks, all end 75
        if comm.rank == 0:
            sys.stderr.write(f"rlx-mpi: error: {err.line()}\n")
            sys.stderr.flush()
        raise _GiveUp(ulfm.Requeue.exit_code)
    ulfm.end_if_alone(comm, err)
    ctx = faults.RankContext(rank=comm.rank, size=comm.size, host=socket.gethostname(), debug=debug)
    faults.report_and_abort(comm, ctx, (ulfm.Requeue, err, exc_info[2]))
