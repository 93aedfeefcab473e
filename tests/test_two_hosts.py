"""Ranks on two emulated hosts (tests/two_hosts.py): network namespaces, MPICH over TCP.

Checks what a cluster of two nodes shows and the cases of issue 11 that need two hosts: host
columns, logits equal to one host's, TP groups within a host, a checkpoint only one host sees,
and a rank killed mid-forward or right after the table (repeated: whether the launcher ends
the job was a race). Every launch has a hard timeout. Skipped, with the reason, only where
network namespaces are not permitted (not root, no iproute2).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import MPIEXEC, TESTS, kill_tree, run_cli, write_job
from helpers import faulty_ckpt  # noqa: F401 (a fixture)
from two_hosts import TwoHosts, missing_reason

pytestmark = [pytest.mark.mpi, pytest.mark.twohost, pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]

TIMEOUT_S = 3.0
REPEATS = int(os.environ.get("RLX_TEST_REPEATS", "5"))  # kill trials per case (the race showed in 1 of 3-5)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> TwoHosts:
    h = TwoHosts(tmp_path_factory.mktemp("hosts")).up()
    yield h
    h.down()


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def start2(hosts: TwoHosts, args: list, ranks: int = 4, env: dict | None = None, cwd=None) -> subprocess.Popen:
    """mpiexec across the two hosts, ranks in blocks (0,1 on h1; 2,3 on h2)."""
    cmd = [MPIEXEC, *hosts.mpiexec_args(ranks), "-ppn", str(ranks // 2), sys.executable, "-m", "rlx_mpi",
           *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env), cwd=cwd,
                            start_new_session=True)


def finish(p: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, err = p.communicate()
        pytest.fail(f"two-host run did not end within {timeout} s\n--- stdout\n{out}\n--- stderr\n{err}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run2(hosts, args, ranks=4, timeout=90, env=None) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    p = finish(start2(hosts, args, ranks, env), timeout)
    p.elapsed = time.monotonic() - t0
    return p


def _job(tmp_path: Path, ckpt: Path | str, name="job.toml", tp=1, plugins=(), **model) -> Path:
    return write_job(tmp_path, name, model={"checkpoint": str(ckpt), "plugins": list(plugins), **model},
                     run={"batch": 2, "seq": 16, "microbatches": 2, "timeout_s": TIMEOUT_S,
                          "startup_timeout_s": 60.0},
                     placement={"policy": "uniform", "reserve_ram_gb": 0.0, "tp": tp})


def _table(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if re.match(r"\s*\d+\s+\d+\s", line)]


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rlx-mpi: error:")]


def _logits(path: Path) -> np.ndarray:
    import h5py

    with h5py.File(path, "r") as f:
        return f["logits"][...]


# -- what works ----------------------------------------------------------------------------------


def test_pipeline_across_hosts_equals_one_host(hosts, tmp_path, tiny_ckpt):
    job = _job(tmp_path, tiny_ckpt)
    p = run2(hosts, ["run", job, "--out", tmp_path / "two.h5"])
    assert p.returncode == 0, p.stderr
    rows = _table(p.stdout)
    assert [(r[1], r[2]) for r in rows] == [("0", "h1"), ("1", "h1"), ("2", "h2"), ("3", "h2")], p.stdout
    one = run_cli(["run", job, "--out", tmp_path / "one.h5"], ranks=4, timeout=90)
    assert one.returncode == 0, one.stderr
    assert np.array_equal(_logits(tmp_path / "two.h5"), _logits(tmp_path / "one.h5"))  # bit for bit


def test_tp_groups_stay_within_a_host(hosts, tmp_path, tiny_ckpt):
    job = _job(tmp_path, tiny_ckpt, tp=2)
    p = run2(hosts, ["run", job, "--out", tmp_path / "two.h5"])
    assert p.returncode == 0, p.stderr
    rows = _table(p.stdout)  # stage rank host tp ...
    groups = {}
    for r in rows:
        groups.setdefault(r[3], set()).add(r[2])
    assert sorted(groups) == ["0,1", "2,3"] and all(len(h) == 1 for h in groups.values()), p.stdout
    one = run_cli(["run", job, "--out", tmp_path / "one.h5"], ranks=4, timeout=90)
    assert one.returncode == 0, one.stderr
    np.testing.assert_allclose(_logits(tmp_path / "two.h5"), _logits(tmp_path / "one.h5"), rtol=0, atol=1e-6)


def test_probe_shows_both_hosts(hosts):
    p = run2(hosts, ["probe"])
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if re.match(r"\d+\s", line)]
    assert [(r[1], r[2]) for r in rows] == [("h1", "0/2"), ("h1", "1/2"), ("h2", "0/2"), ("h2", "1/2")], p.stdout
    assert "warning" not in p.stdout, p.stdout


# -- Found 6: a checkpoint one host does not see -------------------------------------------------


def test_checkpoint_on_one_host_names_the_other(hosts, tmp_path, tiny_ckpt):
    local = hosts.local / f"ckpt-{os.getpid()}.h5"
    hosts.run_in("h1", ["cp", str(tiny_ckpt), str(local)], check=True, timeout=30)
    try:
        p = run2(hosts, ["run", _job(tmp_path, local)])
    finally:
        hosts.run_in("h1", ["rm", "-f", str(local)], timeout=30)
    assert p.returncode == 2, p.stderr
    errors = _errors(p.stderr)
    assert len(errors) == 1, p.stderr
    assert "exists on h1 (ranks 0-1), not on h2 (ranks 2-3)" in errors[0], p.stderr
    assert "filesystem every node mounts" in errors[0], p.stderr


def test_preset_created_on_one_host_only_is_refused(hosts, tmp_path):
    local = hosts.local / f"preset-{os.getpid()}.h5"
    try:
        p = run2(hosts, ["run", _job(tmp_path, local, preset="tiny")])
    finally:
        hosts.run_in("h1", ["rm", "-f", str(local)], timeout=30)
    assert p.returncode == 2, p.stderr
    errors = _errors(p.stderr)
    assert len(errors) == 1, p.stderr
    assert "created from the preset by rank 0 on its own disk" in errors[0], p.stderr
    assert "not on h2 (ranks 2-3)" in errors[0], p.stderr


# -- Found 5: a rank killed on the other host ----------------------------------------------------


def test_rank_killed_mid_forward_ends_the_job_every_time(hosts, tmp_path, faulty_ckpt):
    """Killed mid-forward on h2: the job ends before the forward's deadline, naming rank 2,
    in every one of REPEATS trials (it was a race: 4 of 12 ended only at the deadline)."""
    job = _job(tmp_path, faulty_ckpt, plugins=["faulty_family"])
    results = []
    for trial in range(REPEATS):
        stamp = tmp_path / f"stamp{trial}"
        p = run2(hosts, ["run", job], timeout=60,
                 env={"RLX_TEST_FAULT": "kill", "RLX_TEST_FAULT_RANK": "2", "RLX_TEST_FAULT_STAMP": str(stamp)})
        after = time.time() - float(stamp.read_text()) if stamp.exists() else float("nan")
        named = [e for e in _errors(p.stderr) if "died of SIGKILL" in e]
        results.append((p.returncode, round(after, 1), named, p.stderr))
    report = "\n".join(f"trial {i}: exit {c}, {a} s after the fault, {n}" for i, (c, a, n, _) in enumerate(results))
    for code, after, named, err in results:
        assert code != 0, report + "\n" + err
        assert len(named) == 1 and named[0].startswith("rlx-mpi: error: rank 2 (h2"), report + "\n" + err
        assert after < TIMEOUT_S, report + "\n" + err  # before the deadline: the kill itself ended it


def _rank_pids(job_path: str, rank: int) -> list[int]:
    """The rank proper (the supervisor's child) of world rank ``rank`` running ``job_path`` (a
    full, unique path: other jobs on the machine must never match)."""
    job_name = job_path
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            if job_name.encode() not in cmd or b"rlx_mpi" not in cmd:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1])
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"PMI_RANK={rank}".encode() in env and job_name.encode() in parent:
            found.append(int(entry))
    return found


def test_rank_killed_after_the_table_never_hangs(hosts, tmp_path, tiny_ckpt):
    """Killed right after rank 0 printed the table: the job ends within the end barrier's
    deadline in every trial (6 of 31 hung for ever in MPI_Finalize)."""
    job = _job(tmp_path, tiny_ckpt)
    outcomes = []
    for trial in range(REPEATS):
        p = start2(hosts, ["run", job])
        t0, killed = time.monotonic(), None
        line = ""
        while time.monotonic() - t0 < 60:
            line = p.stdout.readline()
            print(f"trial {trial} {time.monotonic() - t0:.1f} s: {line.rstrip()}")
            if not line or line.startswith("total forward"):
                break
        pids = _rank_pids(str(job), 3)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
            except ProcessLookupError:
                pass
        done = finish(p, 60)  # the barrier's deadline is ~10 s here; a hang fails at 60
        outcomes.append((done.returncode, None if killed is None else round(time.monotonic() - killed, 1),
                         bool(pids), done.stderr))
    report = "\n".join(f"trial {i}: exit {c}, ended {t} s after the kill (rank found: {f})"
                       for i, (c, t, f, _) in enumerate(outcomes))
    print(report)
    for code, took, found, err in outcomes:
        # the rank may have finished before the kill landed (exit 0); otherwise the job must end
        assert code == 0 or took is None or took < 20, report + "\n" + err
