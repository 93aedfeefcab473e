"""The MPI lifecycle of one rank: everything between the parsed command line and the exit code.

``run(command, args, mpi=...)`` is the only caller of MPI_Init and MPI_Finalize. Before MPI: the
supervisor hand-off (`supervisor.py`: a rank that dies, stops or hangs is named), the PMIx
refusal for an MPICH without it, test-only fault injection (``RLX_MPI_TEST_PREINIT``), MPI
start-up under the job's ``[run] startup_timeout_s``; then the launcher check (N tasks that
each see a world of 1). After the command: the finish barrier and MPI_Finalize, each under a
deadline (`set_finish_timeout`, called by the shared start-up in `cluster.py`). A failure is
mapped to one ``rlx-mpi: error:`` line and its exit code (`errors.py`): an `RlxError` raised on
some ranks aborts the others, an `AgreedFailure` (raised on all) is printed by rank 0 alone, an
`ImportError` names the node's broken dependency, anything else is an internal error.

Note: this module and `cli.py` import no numpy before the supervisor is forked, so a rank whose
numpy is broken or hangs on import is still watched.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import EXIT_BAD_INPUT, EXIT_FAULT, EXIT_INTERNAL, EXIT_TIMEOUT, ConfigError, RlxError
from ..rules import DEFAULT_STARTUP_TIMEOUT_S

__all__ = ["run", "refuse", "UsageError", "launch_rank", "set_finish_timeout"]


_LAUNCH_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def launch_rank() -> int | None:
    """This process's rank as the launcher set it (before MPI starts), or None outside a launch."""
    for var in _LAUNCH_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


# Note: OpenBLAS's idle threads. After a BLAS call OpenBLAS's worker threads spin for
# 2**OPENBLAS_THREAD_TIMEOUT cycles (default 28: about 0.1 s at 2.5 GHz) before they sleep. A decode
# step calls no BLAS (numba matvecs on numba's pool), so after a prefill those spinners take the
# cores from numba's threads for its first several steps (in-process, medium int8, 2 threads: the
# first steps 38-50 ms against 17 ms later). Measured through `generate` (medium, 32-token prompt,
# 32 decode steps, 2 threads, interleaved launches): decode tokens/s with 20 against the default
# int8 59.0 vs 49.5 (1.19x), bf16 +6-13 %, f32 +5 %; prefill unchanged. 2**20 cycles (~0.4 ms)
# still spans the gaps between a prefill's GEMMs. The variable is read when OpenBLAS loads, so it
# is set here, before anything imports numpy; a value the user set is kept.
BLAS_THREAD_TIMEOUT = "20"


def _quiet_blas_threads() -> None:
    """Let OpenBLAS's idle threads sleep after ~0.4 ms (see the note), unless the user chose."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)


class UsageError(Exception):
    """A command line the parser refused (exit 2): ``usage`` and ``line``, the message without
    the ``rlx-mpi: error:`` prefix. Raised by the CLI's parser, handed to `refuse`."""

    def __init__(self, usage: str, line: str):
        super().__init__(line)
        self.usage, self.line = usage, line


def refuse(usage: UsageError, *, mpi: bool, supervise: bool = False) -> int:
    """End a process whose command line was refused, with one line and exit code 2.

    Outside a launch (or for a command that never starts MPI) the process says so and exits,
    once per launch: every rank parses the same argv, so the rank the launcher numbers 0 speaks.
    Under a launch of an MPI command (``mpi``) the refused rank starts MPI like the others and
    agrees with them first (`_agree_command_line`), so the whole job ends in seconds with exit 2.

    Note: why not just exit. The ranks of an MPMD launch (``mpiexec -n 1 rlx-mpi run job : -n 3
    rlx-mpi run --bogus job``) get different command lines; MPICH's launcher ignores an exit before
    MPI_Init, so a refused rank that exits leaves the others in MPI_Init until the start-up
    deadline (600 s by default), and a silent one (not numbered 0) is named by nobody.
    """
    if not mpi or launch_rank() is None:
        if launch_rank() in (None, 0):
            sys.stderr.write(usage.usage)
            print(f"rlx-mpi: error: {usage.line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run(lambda _: EXIT_BAD_INPUT, None, mpi=True, supervise=supervise, refused=usage)


def run(command: Callable[[Any], int], args: Any, *, mpi: bool, supervise: bool = False,
        refused: UsageError | None = None) -> int:
    """Run ``command(args)`` as one process of the job and return its exit code.

    With ``mpi`` (run, generate, probe): fork the supervisor first when ``supervise`` (the
    console script's choice; it names a rank that dies of a signal, see `rlx_mpi.supervisor`),
    refuse a PMIx launch of a PMI-only MPICH and a launcher whose N tasks each see a world of 1,
    start MPI under the start-up deadline, and after the command meet every rank at the finish
    barrier and finalize under a deadline. Every failure becomes one ``rlx-mpi: error:`` line
    and the exit code of its `RlxError` (`errors.py`); outside an agreed step a failing rank
    ends every rank (`faults.report_and_abort`). ``refused`` (from `refuse`): this rank's command
    line was refused; it takes part in MPI start-up only to end the job with the others.
    """
    debug = bool(getattr(args, "debug", False))
    if mpi:
        _quiet_blas_threads()
    if supervise and mpi:
        from . import supervisor

        supervisor.supervise()
    if mpi:
        if (code := _check_pmix()) is not None:
            return code
        startup_s = _start_mpi(getattr(args, "job", None))
        if refused is None and (code := _check_launch()) is not None:  # (refused: the usage line says more)
            return code
    try:
        try:
            if mpi and (code := _agree_command_line(refused, startup_s, debug)) is not None:
                _keep_exit_code(code)
                _finish(_finish_timeout_s, debug)
                return code
            code = command(args)
        except ImportError as e:  # numpy, numba, h5py...: the node's Python, not a bug of ours
            raise _broken_import(e) from e
        if mpi:
            _keep_exit_code(code)
            _finish(_finish_timeout_s, debug)
            _leave_if_ranks_were_lost(code)
        return code
    except RlxError as e:
        if mpi:  # raised on some ranks outside an agreed step: the others may wait for ever
            _abort(sys.exc_info(), e.exit_code, debug)
        if debug:
            import traceback

            traceback.print_exc()
        print(f"rlx-mpi: error: {e.line()}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:
        raise
    except Exception as e:
        from .faults import AgreedFailure  # (numpy-free: this also reports a rank whose numpy is broken)

        if isinstance(e, AgreedFailure):  # every rank raised it: rank 0 speaks for all
            if _rank() == 0:
                print(f"rlx-mpi: error: {e.line}", file=sys.stderr)
            if mpi:
                _keep_exit_code(e.exit_code)
                _finish(_finish_timeout_s, debug)
            return e.exit_code
        if mpi:  # a fault outside the agreed steps: report once and end every rank
            _abort(sys.exc_info(), EXIT_FAULT, True)
        import traceback

        traceback.print_exc()
        print(f"rlx-mpi: error: internal error ({type(e).__name__}: {e}); please report it with the traceback above",
              file=sys.stderr)
        return EXIT_INTERNAL


def _keep_exit_code(code: int) -> None:
    """A failure every rank agreed on (exit ``code``) survives the launcher's SIGTERM.

    Note: srun --kill-on-bad-exit (as slurm/run.sbatch runs) terminates the other tasks as soon
    as the first exits non-zero; a rank still in the finish barrier, MPI_Finalize or Python's
    exit then died of SIGTERM and the job ended 143:0 instead of 2:0 (1 CI run in ~20, missing
    checkpoint). So from here a SIGTERM ends the rank with ``code`` at once, and its supervisor
    is told the code for a death in C code, where no Python handler runs. A code of 0 changes
    nothing: a launcher that ends a succeeding rank is still reported as it was.
    """
    if not code:
        return
    import signal

    from . import supervisor

    def leave(*_) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, RuntimeError, ValueError):  # (a reentrant flush, a closed pipe)
                pass
        os._exit(code)

    supervisor.exiting(code)
    signal.signal(signal.SIGTERM, leave)


_FINISH_TIMEOUT_S = 60.0  # the end barrier's deadline when no job file gave [run] timeout_s
_finish_timeout_s = _FINISH_TIMEOUT_S


def set_finish_timeout(run_timeout_s: float, world_size: int) -> float:
    """Set the finish barrier's deadline from the job's ``[run] timeout_s``: past every staggered
    deadline of the run (each stage waits ``timeout + stage x grace``), so a rank stuck in the run
    is named by the rank waiting for it, not by the barrier. Returns the deadline."""
    global _finish_timeout_s
    _finish_timeout_s = run_timeout_s + (world_size + 2) * max(1.0, 0.1 * run_timeout_s)
    return _finish_timeout_s


def _start_mpi(job: str | None) -> float:
    """Initialise MPI under the supervisor's start-up deadline, then tell it MPI is up.

    The deadline (returned) is the job's ``[run] startup_timeout_s`` when the job file can be
    read without blocking (a regular file), else the supervisor's default.
    """
    from . import supervisor

    limit = _startup_timeout_of(job)
    if limit is not None:
        supervisor.watch(limit, "startup_timeout_s")
    _test_fault_before_mpi()
    supervisor.entering_mpi()
    try:
        from mpi4py import MPI
    except ImportError as e:  # a broken mpi4py or MPI on this node: the supervisor names the rank
        sys.stderr.write(f"rlx-mpi: rank {launch_rank()}: cannot import mpi4py.MPI ({e}); reinstall mpi4py "
                         "against this node's MPI\n")
        sys.stderr.flush()
        os._exit(EXIT_FAULT)
    MPI.COMM_WORLD  # noqa: B018  (initialised on import; touched so the order is plain)
    supervisor.ready()
    return supervisor.default_startup_timeout_s() if limit is None else limit


def _agree_command_line(refused: UsageError | None, timeout_s: float, debug: bool) -> int | None:
    """Did every rank accept its command line? None if so, else exit code 2 on every rank.

    One small all-reduce right after MPI_Init (numpy-free: an ``array``). When every rank
    refused its command line (the same argv everywhere), rank 0 prints the usage and the line
    as outside MPI; when only some did (an MPMD launch), the lowest of them prints its line
    naming itself. The others stay quiet; every rank then meets the finish barrier and exits 2.
    """
    import socket
    from array import array

    from mpi4py import MPI

    from .faults import RankContext, wait

    world = MPI.COMM_WORLD
    n, rank = world.size, world.rank
    # (lowest refused rank, lowest accepting rank): n when there is none
    mine = array("i", [rank, n] if refused is not None else [n, rank])
    first = array("i", mine)
    if n > 1:
        ctx = RankContext(rank, n, host=socket.gethostname(), debug=debug)
        wait(world.Iallreduce(mine, first, op=MPI.MIN), timeout_s, ctx,
             lambda: "every rank to check its command line", "some rank", "[run] startup_timeout_s")
    first_refused, first_accepted = first
    if first_refused == n:
        return None
    if rank == first_refused and (n > 1 or launch_rank() in (None, 0)):  # (n tasks of a world of 1: one line)
        sys.stderr.write(refused.usage)
        if first_accepted == n:  # the same argv everywhere: one line, as outside MPI
            line = refused.line
        else:
            line = (f"rank {rank} ({socket.gethostname()}) of {n}: {refused.line} (rank {first_accepted} accepted "
                    "its own: the launch gave the ranks different command lines)")
        print(f"rlx-mpi: error: {line}", file=sys.stderr)
        sys.stderr.flush()
    return EXIT_BAD_INPUT


def _startup_timeout_of(job: str | None) -> float | None:
    """``[run] startup_timeout_s`` of ``job`` if it reads quickly and sanely, else None."""
    if not job:
        return None
    try:
        import stat

        if not stat.S_ISREG(os.stat(job).st_mode):  # a FIFO would block: the default deadline covers it
            return None
        try:  # not via .config: that imports numpy, and this runs before the rank is known to have one
            import tomllib
        except ModuleNotFoundError:  # Python < 3.11
            import tomli as tomllib

        run = tomllib.loads(Path(job).read_text(encoding="utf-8-sig")).get("run", {})
        value = run.get("startup_timeout_s", DEFAULT_STARTUP_TIMEOUT_S) if isinstance(run, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
            return float(value)
    except Exception:  # the real load, after MPI is up, reports what is wrong with the file
        pass
    return None


def _test_fault_before_mpi() -> None:
    """Test-only fault injection before MPI_Init (tests/test_reliability_mpi.py).

    ``RLX_MPI_TEST_PREINIT`` = exit0 | exit3 | kill | stop | hang, on the ranks given by
    ``RLX_MPI_TEST_PREINIT_RANK`` (default 1; a comma list, or ``all``); it stands for a broken
    Python or MPI on one node, the OOM killer at start-up, a SIGSTOP or a hung mount (on every
    node: a shared filesystem). Unset in normal use.
    """
    kind = os.environ.get("RLX_MPI_TEST_PREINIT")
    ranks = os.environ.get("RLX_MPI_TEST_PREINIT_RANK", "1")
    if not kind or (ranks != "all" and str(launch_rank()) not in ranks.split(",")):
        return
    import signal

    if kind == "exit0":
        os._exit(0)
    elif kind == "exit3":
        os._exit(3)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "hang":
        while True:
            time.sleep(3600)


def _abort(exc_info, exit_code: int, debug: bool) -> None:
    """Report this rank's failure once and end every rank of the job."""
    import socket

    from mpi4py import MPI

    from .faults import RankContext, report_and_abort

    world = MPI.COMM_WORLD
    report_and_abort(world, RankContext(world.rank, world.size, host=socket.gethostname(), debug=debug),
                     exc_info, exit_code)


def _finish(timeout_s: float, debug: bool) -> None:
    """Meet every rank at a barrier under a deadline before MPI_Finalize; abort when it expires.

    Note: MPI_Finalize has no deadline of its own. A rank that dies after its last message (after
    the table, say) left the others blocked in it for ever on two hosts; a barrier first, with a
    deadline, turns that into one error line and an abort (exit code 5).
    """
    import socket

    from mpi4py import MPI

    from .faults import RankContext, report_and_abort, wait

    from . import supervisor, ulfm

    supervisor.finishing()  # the others may leave from here: a stop of this rank is its supervisor's to name
    world = ulfm.survivors or MPI.COMM_WORLD  # (ranks were lost: the survivors meet, `lifecycle.ulfm`)
    if world.size == 1:
        return
    ctx = RankContext(world.rank, world.size, host=socket.gethostname(), debug=debug)
    try:
        wait(world.Ibarrier(), timeout_s, ctx, lambda: "every rank to finish", "some rank")
    except RlxError:
        report_and_abort(world, ctx, sys.exc_info(), EXIT_TIMEOUT)
    if ulfm.survivors is None:  # (ranks were lost: no MPI_Finalize, `_leave_if_ranks_were_lost`)
        _finalize(ctx, timeout_s)


def _leave_if_ranks_were_lost(code: int) -> None:
    """After ranks were lost (``on_rank_failure = "continue"``): end this survivor without MPI_Finalize.

    Note: under Open MPI 5.0.11's ULFM, MPI_Finalize after a rank died sometimes blocks (ranks 0
    and 1 of a 2 x 2 job, 1 run in ~8, stuck past the finalize watchdog with every row written);
    a survivor that exits 0 without it is a normal end to ``mpirun --with-ft ulfm`` (exit 0, no
    message), and the survivors have met at the finish barrier, so nothing is left to wait for.
    """
    from . import supervisor, ulfm

    if ulfm.survivors is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    supervisor.done()
    os._exit(code)


def _finalize(ctx, timeout_s: float) -> None:
    """MPI_Finalize under a watchdog: a rank that dies between the barrier and here leaves the
    others blocked in it for ever (seen across two hosts), so past ``timeout_s`` this process
    ends itself; its supervisor names it and the launcher ends the job.

    Note: faulthandler's watchdog is a C thread, so it fires while MPI_Finalize holds the GIL;
    it can only _exit(1), hence the context posted first for the supervisor's message.
    """
    import faulthandler

    from mpi4py import MPI

    from . import supervisor

    supervisor.post_context(f"{ctx.describe()} in MPI_Finalize (stuck over {timeout_s:g} s: a rank died at "
                            "the end of the job)")
    with open(os.devnull, "w") as devnull:
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=devnull)
        try:
            MPI.Finalize()
        finally:
            faulthandler.cancel_dump_traceback_later()
    supervisor.post_context(ctx.describe())


def _broken_import(e: ImportError) -> RlxError:
    """The one line for a dependency that fails to import on this rank's node."""
    import traceback

    from ..errors import RankFault

    name = e.name.split(".")[0] if e.name else None
    if name is None:  # raised inside the module (a broken install): the first frame outside rlx_mpi
        ours = Path(__file__).resolve().parent.parent  # (the package: lifecycle/ is one folder in it)
        for frame, _ in traceback.walk_tb(e.__traceback__):
            f = Path(frame.f_code.co_filename)
            if f.is_absolute() and ours not in f.resolve().parents:
                name = f.parent.name if f.name == "__init__.py" else f.stem
                break
    check = f"import {name}" if name else "import rlx_mpi.cluster, rlx_mpi.families.decoder.stage"
    return RankFault(f"cannot import {name or 'a dependency'}", f"{type(e).__name__}: {e}",
                     f"this node's Python environment is broken or differs from the other nodes': run "
                     f"`{sys.executable} -c '{check}'` there, and start every rank from the same venv")


def _check_pmix() -> int | None:
    """Exit code 2 when the launcher speaks only PMIx and the MPI library is an MPICH without it.

    Note: MPICH built without PMIx (the `mpich` wheel speaks PMI-1 and PMI-2) aborts inside
    MPI_Init under ``srun --mpi=pmix`` with a stack of internal errors on every rank. We look
    before MPI starts: MPI_Get_library_version may be called before MPI_Init, then we start MPI
    as mpi4py would have.
    """
    env = os.environ
    if "PMIX_RANK" not in env or any(v in env for v in ("PMI_FD", "PMI_PORT", "PMI_RANK")) \
            or "mpi4py.MPI" in sys.modules:
        return None
    import mpi4py

    initialize, finalize = mpi4py.rc.initialize, mpi4py.rc.finalize
    mpi4py.rc.initialize, mpi4py.rc.finalize = False, True
    from mpi4py import MPI

    mpi4py.rc.initialize, mpi4py.rc.finalize = initialize, finalize
    version = MPI.Get_library_version()
    if "MPICH" in version and "pmix" not in version.lower():
        if env.get("PMIX_RANK") == "0":
            first = " ".join(version.strip().splitlines()[0].split())
            print(f"rlx-mpi: error: launch: the launcher speaks PMIx but this MPI ({first}) was built without it; "
                  "launch with `srun --mpi=pmi2` (the mpich wheel speaks PMI-1 and PMI-2), or use the site's MPI "
                  "(mpi4py built against it)", file=sys.stderr)
        return EXIT_BAD_INPUT
    MPI.Init_thread({"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED, "serialized":
                     MPI.THREAD_SERIALIZED}.get(str(mpi4py.rc.thread_level), MPI.THREAD_MULTIPLE))
    return None


def _check_launch() -> int | None:
    """Exit code 2 when a launcher started N > 1 tasks but MPI sees a world of 1, else None.

    Note: ``srun --mpi=none`` (or a PMI the MPI library does not speak) starts N copies that
    each believe they are the whole job: N tables, N times the work, exit 0. Only the task the
    launcher numbers 0 prints the line, so the log shows it once.
    """
    from mpi4py import MPI


    said = launcher_tasks()
    if MPI.COMM_WORLD.size != 1 or said is None:
        return None
    var, n = said
    if os.environ.get("SLURM_PROCID", os.environ.get("PMI_RANK", "0")) == "0":
        line = ConfigError("launch", f"{var}={n} says this is one of {n} tasks, but the MPI world has 1 rank "
                           f"(every task would run the whole job alone)",
                           "under Slurm launch with `srun --mpi=pmi2` (the mpich wheel speaks PMI-1 and PMI-2, "
                           "not PMIx) or use the site's MPI (mpi4py built against it, e.g. `pip install "
                           "--no-binary=mpi4py mpi4py` after `module load` of it); under mpiexec use the "
                           "mpiexec of the MPI that mpi4py was built with").line()
        print(f"rlx-mpi: error: {line}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.rank


_SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def launcher_tasks(env: dict | None = None) -> tuple[str, int] | None:
    """(variable, N) of the first launcher variable saying this process is one of N > 1 tasks."""
    env = os.environ if env is None else env
    for var in _SIZE_VARS:
        value = env.get(var, "")
        if value.isdigit() and int(value) > 1:
            return var, int(value)
    return None
