"""The MPI lifecycle's start-up (`rlx_mpi/launch.py`, `rlx_mpi/supervisor.py`) through the real CLI
under mpiexec: a job whose start-up fails on some ranks ends in seconds, with one line.

Each case asserts the exit code, exactly one ``rlx-mpi: error:`` line with the expected words, a
time bound far below the job's start-up deadline, and no process left behind.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from conftest import MPIEXEC, MPIEXEC_ARGS, _env, finish_cli, run_cli
from helpers import job_builder, leftovers_killed

pytestmark = pytest.mark.mpi

HOST = socket.gethostname()
BAD_INPUT, LAUNCHER_KILL = 2, 9
LONG = {"seq": 8, "timeout_s": 5.0, "startup_timeout_s": 600.0}  # a wait for the deadline fails the test

job = job_builder(LONG)


def mpmd(*parts: tuple[int, list], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n N1 rlx-mpi ARGS1 : -n N2 rlx-mpi ARGS2 ...``: each part its own command line."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec found")
    cmd = [MPIEXEC, *MPIEXEC_ARGS]
    for i, (n, args) in enumerate(parts):
        cmd += ([":"] if i else []) + ["-n", str(n), sys.executable, "-m", "rlx_mpi", *map(str, args)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env),
                            start_new_session=True)
    return finish_cli(proc, timeout, t0)


def errors_of(p) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.startswith("rlx-mpi: error:")]


def report(p) -> str:
    return f"exit {p.returncode} after {p.elapsed:.1f} s\n--- stdout\n{p.stdout[-2000:]}\n--- stderr\n{p.stderr}"




# -- 1. a rank whose command line is refused before MPI_Init (issue 17, finding 4) -----------------


@pytest.mark.parametrize("good, bad, named", [(1, 3, 1), (3, 1, 3)], ids=["rank0-ok-3-bad", "3-ok-rank3-bad"])
def test_mpmd_rank_refusing_its_command_line_ends_the_job_at_once(tmp_path, tiny_ckpt, good, bad, named):
    """Before: the refused ranks exited 2 silently before MPI_Init, which MPICH ignores, and the
    others waited in MPI_Init for the whole start-up deadline (600 s here): killed at 30 s."""
    path = job(tmp_path, tiny_ckpt)
    p = mpmd((good, ["run", path]), (bad, ["run", "--bogus-flag", path]), timeout=30)
    errors = errors_of(p)
    assert p.returncode == BAD_INPUT, report(p)
    assert len(errors) == 1, report(p)
    assert f"rank {named} ({HOST}) of 4: rlx-mpi: unrecognized arguments: --bogus-flag" in errors[0], report(p)
    assert "the launch gave the ranks different command lines" in errors[0], report(p)
    assert "Traceback" not in p.stderr and p.elapsed < 25, report(p)
    assert not leftovers_killed(tmp_path), report(p)


def test_mpmd_rank_0_refusing_a_missing_job_is_named(tmp_path, tiny_ckpt):
    """The refused rank is rank 0 and its parser's error is a sub-command's (no job given)."""
    path = job(tmp_path, tiny_ckpt)
    p = mpmd((1, ["run", "--json", tmp_path / "s.json"]), (2, ["run", path]), timeout=30)
    errors = errors_of(p)
    assert p.returncode == BAD_INPUT and len(errors) == 1, report(p)
    assert f"rank 0 ({HOST}) of 3: rlx-mpi run: the following arguments are required: job" in errors[0], report(p)
    assert p.elapsed < 25 and not (tmp_path / "s.json").exists() and not leftovers_killed(tmp_path), report(p)


def test_every_rank_refusing_the_same_command_line_prints_it_once(tmp_path, tiny_ckpt):
    """The same argv on every rank: rank 0's line alone, as outside MPI (no rank named)."""
    path = job(tmp_path, tiny_ckpt)
    p = run_cli(["run", "--bogus-flag", path], ranks=4, timeout=30)
    errors = errors_of(p)
    assert p.returncode == BAD_INPUT and len(errors) == 1, report(p)
    assert errors[0] == "rlx-mpi: error: rlx-mpi: unrecognized arguments: --bogus-flag; see rlx-mpi --help", report(p)
    assert p.stderr.count("usage: rlx-mpi") == 1 and p.elapsed < 25 and not leftovers_killed(tmp_path), report(p)


# -- 2. every rank's start-up deadline expiring together (issue 17, finding 4) ---------------------

STARTUP_S = 4.0


@pytest.mark.parametrize("trial", range(3))
@pytest.mark.parametrize("kind, words", [("hang", "stuck for 4 s ([run] startup_timeout_s) before MPI start-up"),
                                         ("stop", "stopped (SIGSTOP or SIGTSTP) during start-up")])
def test_every_rank_stalling_before_mpi_prints_one_line(tmp_path, tiny_ckpt, kind, words, trial):
    """4 ranks stall before MPI_Init (a hung shared filesystem, a stopped job): their deadlines
    expire together. Before: every rank's supervisor reported at its own deadline, and 2 lines
    (sometimes 3) reached the log in about half the trials; now rank 0 alone speaks."""
    path = job(tmp_path, tiny_ckpt, run={"timeout_s": 3.0, "startup_timeout_s": STARTUP_S})
    p = run_cli(["run", path], ranks=4, timeout=40,
                env={"RLX_MPI_TEST_PREINIT": kind, "RLX_MPI_TEST_PREINIT_RANK": "all"})
    errors = errors_of(p)
    assert p.returncode == LAUNCHER_KILL, report(p)
    assert len(errors) == 1, report(p)
    assert f"rank 0 ({HOST}): {words}" in errors[0], report(p)
    assert "Traceback" not in p.stderr and p.elapsed < STARTUP_S + 10, report(p)
    assert not leftovers_killed(tmp_path), report(p)


def test_the_first_report_claim_is_held_until_its_holder_lets_go():
    """`watcher.first_report`: the first caller on this host and launcher holds the claim; a second is
    told to stay quiet; once the holder is gone (its process dies) the claim is free again."""
    from rlx_mpi.lifecycle import watcher

    first, yes = watcher.first_report()
    try:
        assert yes and first is not None
        second, again = watcher.first_report()
        assert (second, again) == (None, False)
    finally:
        first.close()
    third, yes = watcher.first_report()
    assert yes and third is not None
    third.close()


def test_the_start_up_deadline_counts_from_the_process_start():
    """`watcher.launched_at`: this process's start on the monotonic clock, before now and not after the
    test session began (a fork-time clock would be later than the session's start)."""
    from rlx_mpi.lifecycle import watcher

    started = watcher.launched_at()
    assert started <= time.monotonic()
    assert started <= _SESSION_T0 + 0.05  # the clock tick is 10 ms


_SESSION_T0 = time.monotonic()  # at import of this module, well after this Python started
