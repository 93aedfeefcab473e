"""Under a real Slurm (tests/slurm_cluster.py): the shipped sbatch scripts and each case of issue 11.

A single-node Slurm (munged, slurmctld, slurmd started by hand, config in a temp folder) runs
for the session. Each test submits with sbatch or runs srun with a hard timeout and checks the
output, the exit code and the job's state from `scontrol show job`. Skipped, with the reason,
only where Slurm is not installed or we are not root; CI (`.ci/run`) installs it and is root.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TESTS, write_job
from helpers import faulty_ckpt, pids_matching  # noqa: F401 (a fixture)
from slurm_cluster import SlurmCluster, missing_reason

pytestmark = [pytest.mark.mpi, pytest.mark.slurm, pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]

REPO = TESTS.parent
PY = sys.executable
TIMEOUT_S = 3.0  # the jobs' [run] timeout_s: a job that ends only at a deadline shows it


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> SlurmCluster:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.up()
    yield cluster
    cluster.down()


def _env(**extra) -> dict:
    env = {"RLX_PYTHON": PY, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)}
    env.update(extra)
    return env


def _job(tmp_path: Path, ckpt: Path, name: str = "job.toml", plugins=(), **placement) -> Path:
    return write_job(tmp_path, name, model={"checkpoint": str(ckpt), "plugins": list(plugins)},
                     run={"batch": 2, "seq": 8, "microbatches": 2, "timeout_s": TIMEOUT_S, "startup_timeout_s": 60.0},
                     placement={"policy": "uniform", "reserve_ram_gb": 0.0, **placement})


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rlx-mpi: error:")]


_pids = pids_matching


def _no_leftovers(needle: str, within_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := _pids(needle)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# -- the shipped scripts -------------------------------------------------------------------------


def test_run_sbatch_as_shipped(slurm, tmp_path, tiny_ckpt):
    """slurm/run.sbatch with its defaults: COMPLETED 0:0, the table names the job, one log per rank."""
    job = _job(tmp_path, tiny_ckpt)
    jid = slurm.sbatch(str(REPO / "slurm" / "run.sbatch"), str(job), cwd=tmp_path, env=_env())
    info = slurm.wait(jid, 120)
    out = (tmp_path / f"rlx-mpi-{jid}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert f"slurm job {jid}" in out, out
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s+\S+\s+-\s+\d+:\d+", line)]
    assert len(rows) == 4, out  # 4 tasks -> 4 stages
    logs = sorted(p.name for p in (tmp_path / f"rlx-mpi-logs-{jid}").iterdir())
    assert logs == [f"rank-{r:04d}.log" for r in range(4)], logs
    for r in range(4):
        text = (tmp_path / f"rlx-mpi-logs-{jid}" / f"rank-{r:04d}.log").read_text()
        assert f"[rank {r} {slurm.host}]" in text and f"slurm job {jid}" in text, text
    stats = json.loads((tmp_path / f"rlx-mpi-{jid}.json").read_text())
    assert stats["job_id"] == jid and len(stats["timings"]) == 4


def test_run_sbatch_without_python_is_one_clear_line(slurm, tmp_path, tiny_ckpt):
    job = _job(tmp_path, tiny_ckpt)
    jid = slurm.sbatch(str(REPO / "slurm" / "run.sbatch"), str(job), cwd=tmp_path,
                       env=_env(RLX_PYTHON=str(tmp_path / "no-venv" / "bin" / "python")))
    info = slurm.wait(jid, 60)
    out = (tmp_path / f"rlx-mpi-{jid}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), out
    assert _errors(out) and "set RLX_PYTHON" in _errors(out)[0], out


def test_missing_checkpoint_is_one_line_failed_2(slurm, tmp_path):
    job = _job(tmp_path, tmp_path / "absent.h5")
    jid = slurm.sbatch(str(REPO / "slurm" / "run.sbatch"), str(job), cwd=tmp_path, env=_env())
    info = slurm.wait(jid, 60)
    out = (tmp_path / f"rlx-mpi-{jid}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), out
    assert len(_errors(out)) == 1 and "absent.h5" in _errors(out)[0], out


def _generate_available(cwd: Path) -> str | None:
    p = subprocess.run([PY, "-m", "rlx_mpi", "generate", "--help"], capture_output=True, text=True, timeout=60,
                       cwd=cwd, env=_env())
    return None if p.returncode == 0 else "this rlx_mpi has no `generate` command yet (issue 9)"


def test_generate_sbatch_requeues_and_resumes(slurm, tmp_path, tiny_ckpt):
    """SIGTERM as Slurm sends it before the time limit: exit 75, requeue, resume, every prompt once."""
    if (reason := _generate_available(tmp_path)) is not None:
        pytest.skip(reason)
    job = _job(tmp_path, tiny_ckpt)
    prompts = tmp_path / "prompts.jsonl"
    # enough work that the signal (sent once the first row is written) lands mid-run on a fast
    # machine. 200 prompts (~13k tokens) gave ~12 s of decode after the first row on a 2-core CI
    # box, but a 2-core Xeon VM (2026-12-02) finished all of them in 2.2 s, before the signal
    # reached the ranks (which then died of it on their way out, 143: 4 of 26 runs). 800 prompts
    # (~51k tokens) give that VM ~9 s; the slower box's resumed run grows to ~4x its old length
    # (600 prompts took ~35 s alone there)
    n = 800
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [1 + i % 100, 2, 3]}) + "\n" for i in range(n)))
    out = tmp_path / "completions.jsonl"
    jid = slurm.sbatch(str(REPO / "slurm" / "generate.sbatch"), str(job), str(prompts), str(out),
                       "--max-new-tokens", "64", cwd=tmp_path, env=_env())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") >= 1):
        time.sleep(0.2)
    # what --signal=B:TERM@120 does at the limit: SIGTERM to the batch shell only
    subprocess.run(["scancel", "--signal=TERM", "--batch", jid], env=slurm.env, check=True, timeout=30)
    # Slurm holds a requeued job back ~2 minutes (its BeginTime); start it at once instead
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = slurm.job(jid)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        # Restarts counts up while the job still shows REQUEUED/COMPLETING, where the update
        # below would be lost and the job held back past the wait: wait for PENDING (or RUNNING)
        if int(info.get("Restarts", "0")) >= 1 and info.get("JobState") in ("PENDING", "RUNNING"):
            break
        time.sleep(0.3)
    if info.get("JobState") == "PENDING":
        # Not within the requeue's second: slurmd refuses a credential made no later than the
        # second it revoked the last one in ("Job credential revoked", job FAILED); the hold
        # back is what normally keeps the restart out of it.
        time.sleep(1.1)
        slurm.scontrol("update", f"JobId={jid}", "StartTime=now", check=False)
    info = slurm.wait(jid, 120, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    log = (tmp_path / f"rlx-generate-{jid}.out").read_text()
    assert info["JobState"] == "COMPLETED" and int(info.get("Restarts", "0")) >= 1, (info, log)
    assert "requeueing" in log, log
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids == [f"p{i}" for i in range(n)], log


# -- Found 1: a dead rank ends the job -----------------------------------------------------------


def _srun_fault(slurm, tmp_path, ckpt, fault: str, *srun_args, env=None, timeout_s=90):
    job = _job(tmp_path, ckpt, f"fault-{fault}-{time.monotonic_ns()}.toml", plugins=["faulty_family"])
    env = _env(RLX_TEST_FAULT_STAMP=str(tmp_path / "stamp"), **(env or {}))
    t0 = time.time()
    p = slurm.srun(*srun_args, PY, "-m", "rlx_mpi", "run", str(job), cwd=tmp_path, env=env, timeout_s=timeout_s)
    p.after_fault = time.time() - float((tmp_path / "stamp").read_text()) if (tmp_path / "stamp").exists() else \
        time.time() - t0
    p.leftovers = _no_leftovers(job.name)
    return p


@pytest.mark.parametrize("kill_on_bad_exit", [True, False], ids=["kill-on-bad-exit", "plain-srun"])
def test_rank_killed_mid_forward_ends_the_job(slurm, tmp_path, faulty_ckpt, kill_on_bad_exit):
    """Found 1: a SIGKILLed rank ends the job in seconds, named, under srun with or without
    --kill-on-bad-exit (the supervisor ends it itself), not at the forward's deadline."""
    flags = ["-n", "3", "--mpi=pmi2"] + (["--kill-on-bad-exit=1"] if kill_on_bad_exit else [])
    p = _srun_fault(slurm, tmp_path, faulty_ckpt, "kill", *flags,
                    env={"RLX_TEST_FAULT": "kill", "RLX_TEST_FAULT_RANK": "1"})
    report = f"exit {p.returncode}, {p.after_fault:.1f} s after the fault\n{p.stderr}"
    assert p.returncode != 0, report
    assert any("rank 1 (" in e and "died of SIGKILL" in e for e in _errors(p.stderr)), report
    assert p.after_fault < TIMEOUT_S, report  # before any deadline could expire
    assert not p.leftovers, report


def test_rank_killed_before_mpi_init_ends_the_job(slurm, tmp_path, faulty_ckpt):
    """Found 1: a rank that dies before MPI_Init completes must not leave the others in MPI_Init."""
    p = _srun_fault(slurm, tmp_path, faulty_ckpt, "preinit", "-n", "3", "--mpi=pmi2",
                    env={"RLX_MPI_TEST_PREINIT": "kill", "RLX_MPI_TEST_PREINIT_RANK": "1"}, timeout_s=30)
    report = f"exit {p.returncode} in {p.elapsed:.1f} s\n{p.stderr}"
    assert p.returncode != 0, report
    assert p.elapsed < 20, report
    assert any("died of SIGKILL" in e for e in _errors(p.stderr)), report
    assert not p.leftovers, report


def test_oom_killed_rank_ends_the_job(slurm, tmp_path, faulty_ckpt):
    """Found 1/3: under --mem the OOM killer takes a rank; the job ends (not RUNNING) and says so."""
    if not slurm.cgroups:
        pytest.skip("no memory cgroups here: Slurm cannot enforce --mem, so there is no OOM kill to test")
    p = _srun_fault(slurm, tmp_path, faulty_ckpt, "oom", "-n", "2", "--mpi=pmi2", "--mem=600M",
                    env={"RLX_TEST_FAULT": "oom", "RLX_TEST_FAULT_RANK": "1"})
    report = f"exit {p.returncode}, {p.after_fault:.1f} s after the fault\n{p.stderr}"
    assert p.returncode != 0, report
    assert any("died of SIGKILL" in e and "OOM" in e for e in _errors(p.stderr)), report
    assert p.after_fault < 30, report
    assert not p.leftovers, report


def test_scancel_ends_everything(slurm, tmp_path, faulty_ckpt):
    job = _job(tmp_path, faulty_ckpt, "hang.toml", plugins=["faulty_family"])
    text = job.read_text().replace(f"timeout_s = {TIMEOUT_S}", "timeout_s = 600.0").replace(
        "startup_timeout_s = 60.0", "startup_timeout_s = 600.0")
    job.write_text(text)
    stamp = tmp_path / "stamp"
    jid = slurm.sbatch(str(REPO / "slurm" / "run.sbatch"), str(job), cwd=tmp_path,
                       env=_env(RLX_TEST_FAULT="hang", RLX_TEST_FAULT_STAMP=str(stamp)))
    deadline = time.monotonic() + 90
    while not stamp.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stamp.exists(), slurm.job(jid)
    t0 = time.monotonic()
    slurm.cancel(jid)
    info = slurm.wait(jid, 30)
    assert info["JobState"] == "CANCELLED", info
    assert not _no_leftovers(job.name, 10.0), f"left after scancel ({time.monotonic() - t0:.1f} s)"


# -- Found 2: a wrong launch ---------------------------------------------------------------------


def test_srun_mpi_none_is_refused(slurm, tmp_path, tiny_ckpt):
    """Found 2: four 1-rank worlds must not each run the job: exit 2, one line naming the fix."""
    job = _job(tmp_path, tiny_ckpt)
    p = slurm.srun("-n", "4", "--mpi=none", PY, "-m", "rlx_mpi", "run", str(job), cwd=tmp_path, env=_env())
    assert p.returncode == 2, p.stderr
    assert "stage" not in p.stdout, p.stdout  # no table: nothing ran
    errors = _errors(p.stderr)
    assert len(errors) == 1 and "srun --mpi=pmi2" in errors[0] and "1 rank" in errors[0], p.stderr


def test_srun_mpi_pmix_with_the_mpich_wheel_is_refused(slurm, tmp_path, tiny_ckpt):
    """Found 2: the mpich wheel speaks PMI-1/PMI-2, not PMIx: one line, exit 2, not an MPI stack."""
    types = subprocess.run(["srun", "--mpi=list"], env=slurm.env, capture_output=True, text=True, timeout=30)
    if "pmix" not in types.stdout + types.stderr:
        pytest.skip("this Slurm has no mpi/pmix plugin")
    from mpi4py import MPI  # noqa: F401  (this test process only asks the library's name)

    if "pmix" in MPI.Get_library_version().lower() or "MPICH" not in MPI.Get_library_version():
        pytest.skip("the MPI here speaks PMIx: nothing to refuse")
    job = _job(tmp_path, tiny_ckpt)
    p = slurm.srun("-n", "2", "--mpi=pmix", PY, "-m", "rlx_mpi", "run", str(job), cwd=tmp_path, env=_env())
    if "can not load PMIx library" in p.stderr:
        pytest.fail("Slurm's pmix plugin cannot load libpmix: install libpmix-dev (.ci/run does)\n" + p.stderr)
    assert p.returncode == 2, p.stderr
    errors = _errors(p.stderr)
    assert len(errors) == 1 and "PMIx" in errors[0] and "--mpi=pmi2" in errors[0], p.stderr
    assert "Fatal error" not in p.stderr, p.stderr


def test_srun_pmi2_runs_one_job(slurm, tmp_path, tiny_ckpt):
    job = _job(tmp_path, tiny_ckpt)
    p = slurm.srun("-n", "2", "--mpi=pmi2", PY, "-m", "rlx_mpi", "run", str(job), cwd=tmp_path, env=_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("total forward") == 1, p.stdout


# -- Found 3 and 4: the job's own memory and CPUs ------------------------------------------------


def _probe(slurm, tmp_path, *srun_args) -> list[dict]:
    p = slurm.srun(*srun_args, "--mpi=pmi2", PY, "-m", "rlx_mpi", "probe", "--json", cwd=tmp_path, env=_env())
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_probe_sees_the_jobs_memory_limit(slurm, tmp_path):
    """Found 3: under --mem=1G two ranks share 1 GiB (cgroup, or SLURM_MEM_PER_NODE without one)."""
    rows = _probe(slurm, tmp_path, "-n", "2", "--mem=1G")
    total = sum(r["ram_total_bytes"] for r in rows)
    assert abs(total - 2**30) <= 2 * 4096, rows
    assert all(r["ram_available_bytes"] <= r["ram_total_bytes"] for r in rows), rows
    assert {r["job_id"] for r in rows} != {None}, rows


def test_memory_limit_gives_no_fit_not_an_oom_kill(slurm, tmp_path, tiny_ckpt):
    """Found 3: a reserve that the job's 1 GiB cannot hold is exit 3 (the host's 20+ GB would fit)."""
    job = _job(tmp_path, tiny_ckpt, reserve_ram_gb=0.6)
    p = slurm.srun("-n", "2", "--mpi=pmi2", "--mem=1G", PY, "-m", "rlx_mpi", "run", str(job), cwd=tmp_path,
                   env=_env())
    assert p.returncode == 3, p.stderr
    assert len(_errors(p.stderr)) == 1 and "placement" in _errors(p.stderr)[0], p.stderr


def test_cpus_per_task_is_not_divided_again(slurm, tmp_path):
    """Found 4: --cpus-per-task=2 gives each rank 2 CPUs, not 2 / ranks on the node."""
    rows = _probe(slurm, tmp_path, "-n", "2", "--cpus-per-task=2")
    assert [r["cpus"] for r in rows] == [min(2, os.cpu_count())] * 2, rows


def test_probe_shows_mpi_library_and_job(slurm, tmp_path):
    p = slurm.srun("-n", "2", "--mpi=pmi2", PY, "-m", "rlx_mpi", "probe", cwd=tmp_path, env=_env())
    assert p.returncode == 0, p.stderr
    assert "MPICH" in p.stdout and re.search(r"slurm job \d+", p.stdout), p.stdout
    assert "warning" not in p.stdout, p.stdout


def test_job_array_of_shards_merged_is_one_job(slurm, tmp_path, tiny_ckpt):
    """#35: a job array of 3 tasks, each 2 replicas (srun -n 2) over its --shard of the prompt
    file, then `rlx-mpi merge`: the rows of one unsharded job (all but their timings)."""
    from conftest import run_cli

    job = _job(tmp_path, tiny_ckpt, replicas=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [1 + i % 50, 2 + i % 7, 3]}) + "\n"
                               for i in range(20)))
    task = (f'srun -n 2 --mpi=pmi2 "$RLX_PYTHON" -m rlx_mpi generate {job} --prompts {prompts} --out '
            f'{tmp_path}/part-$SLURM_ARRAY_TASK_ID.jsonl --max-new-tokens 5 --batch 2 '
            f'--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT')
    jid = slurm.sbatch("--array=1-3", "--ntasks=2", "--cpus-per-task=1", f"--output={tmp_path}/array-%A_%a.out",
                       "--wrap", task, cwd=tmp_path, env=_env())
    for k in (1, 2, 3):
        info = slurm.wait(f"{jid}_{k}", 180)
        log = (tmp_path / f"array-{jid}_{k}.out").read_text()
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    whole = run_cli(["generate", job, "--prompts", prompts, "--out", tmp_path / "whole.jsonl", "--max-new-tokens", 5,
                     "--batch", 2], ranks=2, timeout=120)
    assert whole.returncode == 0, whole.stderr
    merged = run_cli(["merge", tmp_path / "all.jsonl", *(tmp_path / f"part-{k}.jsonl" for k in (3, 1, 2))], timeout=60)
    assert merged.returncode == 0, merged.stderr

    def rows(p):
        return [{k: v for k, v in json.loads(line).items() if k != "ms"} for line in p.read_text().splitlines()]

    assert rows(tmp_path / "all.jsonl") == rows(tmp_path / "whole.jsonl") and len(rows(tmp_path / "all.jsonl")) == 20
