"""Faults under real MPI: a rank that raises, dies, stops or hangs mid-forward ends the job.

Each test runs the CLI under mpiexec with the "faulty_llama" plug-in family
(tests/faulty_family.py), whose forward misbehaves on one rank at microbatch 0. The job must
end within ``timeout_s + 5`` seconds of the fault, with the documented exit code, one message
that names the rank at fault, and no process left behind.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from conftest import finish_cli, kill_tree, run_cli, start_cli, write_job
from helpers import faulty_ckpt, gone_within, pids_matching  # noqa: F401 (a fixture)

pytestmark = pytest.mark.mpi

TIMEOUT_S = 3.0
HOST = socket.gethostname()
EXIT_FAULT, EXIT_TIMEOUT = 4, 5


def fault_job(tmp_path: Path, ckpt: Path, kind: str) -> Path:
    return write_job(tmp_path, f"fault_{kind}_{os.getpid()}_{time.monotonic_ns()}.toml",
                     model={"checkpoint": str(ckpt), "plugins": ["faulty_family"]},
                     run={"batch": 2, "seq": 8, "microbatches": 2, "timeout_s": TIMEOUT_S,
                          "startup_timeout_s": 30.0},
                     placement={"policy": "uniform", "reserve_ram_gb": 0.0})


def fault_env(tmp_path: Path, kind: str, rank: int = 1) -> dict:
    return {"RLX_TEST_FAULT": kind, "RLX_TEST_FAULT_RANK": str(rank), "RLX_TEST_FAULT_STAMP": str(tmp_path / "stamp")}


def job_pids(job: Path) -> list[int]:
    """Processes whose command line names ``job`` (mpiexec, the ranks and their supervisors)."""
    return pids_matching(job.name)


def kill_leftovers(job: Path) -> list[int]:
    left = job_pids(job)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def since_fault(tmp_path: Path) -> float:
    """Seconds from the injected fault until now."""
    return time.time() - float((tmp_path / "stamp").read_text())


def run_fault(tmp_path, ckpt, kind: str, ranks: int, rank: int = 1):
    job = fault_job(tmp_path, ckpt, kind)
    try:
        p = run_cli(["run", job], ranks=ranks, timeout=60, env=fault_env(tmp_path, kind, rank))
        if not (tmp_path / "stamp").exists():
            pytest.fail(f"the fault never fired (exit {p.returncode})\n{p.stderr}")
        p.after_fault = since_fault(tmp_path)
        p.leftovers = gone_within(job.name, 0.2)  # the launcher's SIGKILLs are asynchronous: a grace, polled
    finally:
        kill_leftovers(job)
    print(f"{kind}: exit {p.returncode}, {p.elapsed:.2f} s from launch, {p.after_fault:.2f} s after the fault")
    return p


def errors(p) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.startswith("rlx-mpi: error:")]


def waited(line: str, rank: int, where: str, what: str) -> bool:
    """Is ``line`` rank ``rank``'s deadline report? (Deadlines may be staggered past timeout_s.)"""
    head = re.escape(f"rlx-mpi: error: rank {rank} ({where}): waited ")
    return re.match(head + r"(\d+\.\d) s for " + re.escape(what), line) is not None and \
        float(re.match(head + r"(\d+\.\d)", line).group(1)) >= TIMEOUT_S


def test_rank_raises(tmp_path, faulty_ckpt):
    p = run_fault(tmp_path, faulty_ckpt, "raise", ranks=2)
    report = p.stderr
    assert p.returncode == EXIT_FAULT, report
    assert errors(p) == [f"rlx-mpi: error: rank 1 ({HOST}, stage 1, layers 4:8, microbatch 0): "
                         "RuntimeError: injected fault (RLX_TEST_FAULT=raise)"], report
    assert p.stderr.count("Traceback (most recent call last)") == 1, report
    assert "in forward" in p.stderr and "aborting all 2 ranks (exit code 4)" in p.stderr, report
    assert p.after_fault < TIMEOUT_S + 5, report
    assert not p.leftovers, report


def test_rank_killed(tmp_path, faulty_ckpt):
    """SIGKILL leaves the rank no last words: its supervisor names it, and the job ends at once."""
    p = run_fault(tmp_path, faulty_ckpt, "kill", ranks=3)
    report = p.stderr
    assert p.returncode != 0, report
    assert len(errors(p)) == 1, report
    assert errors(p)[0].startswith(f"rlx-mpi: error: rank 1 ({HOST}, stage 1, layers 3:6, microbatch 0): "
                                   "died of SIGKILL"), report
    assert p.after_fault < TIMEOUT_S + 5, report
    assert not p.leftovers, report


def test_rank_crashes(tmp_path, faulty_ckpt):
    """A crash in native code (SIGSEGV): the Python stack, then the rank named by its supervisor."""
    p = run_fault(tmp_path, faulty_ckpt, "segv", ranks=2)
    report = p.stderr
    assert p.returncode != 0, report
    assert "Fatal Python error: Segmentation fault" in p.stderr and "in forward" in p.stderr, report
    assert len(errors(p)) == 1, report
    assert errors(p)[0].startswith(f"rlx-mpi: error: rank 1 ({HOST}, stage 1, layers 4:8, microbatch 0): "
                                   "died of SIGSEGV"), report
    assert p.after_fault < TIMEOUT_S + 5, report
    assert not p.leftovers, report


def test_stopped_rank_is_named_by_its_neighbour(tmp_path, faulty_ckpt):
    """Rank 0 is stopped (SIGSTOP) mid-forward: rank 1's deadline fires and names it."""
    p = run_fault(tmp_path, faulty_ckpt, "stop", ranks=2, rank=0)
    report = p.stderr
    assert p.returncode == EXIT_TIMEOUT, report
    assert len(errors(p)) == 1, report
    assert waited(errors(p)[0], 1, f"{HOST}, stage 1, layers 4:8, microbatch 0",
                  "the hidden state of microbatch 0 from rank 0; rank 0 is stuck or dead"), report
    assert "Traceback" not in p.stderr, report
    assert TIMEOUT_S - 0.5 <= p.after_fault < TIMEOUT_S + 5, report
    assert not p.leftovers, report


def test_hung_last_stage_is_named_by_rank_0(tmp_path, faulty_ckpt):
    """The last stage hangs in its compute: rank 0, waiting for the logits, names it."""
    p = run_fault(tmp_path, faulty_ckpt, "hang", ranks=3, rank=2)
    report = p.stderr
    assert p.returncode == EXIT_TIMEOUT, report
    assert len(errors(p)) == 1, report
    assert waited(errors(p)[0], 0, f"{HOST}, stage 0, layers 0:3", "the logits from rank 2; rank 2 is stuck"), report
    assert TIMEOUT_S - 0.5 <= p.after_fault < TIMEOUT_S + 5, report
    assert not p.leftovers, report


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


@pytest.fixture(scope="module")
def middle_stopped(tmp_path_factory, faulty_ckpt):
    """Rank 1 of 3 stopped (SIGSTOP) mid-forward, run once for the two tests below (they were two
    launches of the same job): while the others wait for it, the CPU the waiting processes use
    over 1.5 s, then the job's end as ``run_fault`` reports it."""
    tmp_path = tmp_path_factory.mktemp("middle_stopped")
    job = fault_job(tmp_path, faulty_ckpt, "stop")
    t0 = time.monotonic()
    proc = start_cli(["run", job], ranks=3, env=fault_env(tmp_path, "stop"))
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "stamp").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.02)
        time.sleep(0.1)  # past the first fast polls
        pids = [pid for pid in job_pids(job) if _state(pid) != "T"]
        before, t1 = {pid: _cpu_seconds(pid) for pid in pids}, time.monotonic()
        time.sleep(1.5)
        used = sum(_cpu_seconds(pid) - before[pid] for pid in pids)
        share = used / (time.monotonic() - t1)
        p = finish_cli(proc, 60, t0)
        p.after_fault = since_fault(tmp_path)
        p.leftovers = gone_within(job.name, 0.2)  # the launcher's SIGKILLs are asynchronous: a grace, polled
        print(f"{len(pids)} waiting processes used {share:.1%} of a core; "
              f"exit {p.returncode}, {p.after_fault:.2f} s after the fault")
        return p, share, len(pids)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.communicate()
        kill_leftovers(job)


def test_stuck_middle_stage_is_named(middle_stopped):
    """Rank 1 of 3 stops: rank 2 (waiting for its hidden state) must be the one to report."""
    p, _, _ = middle_stopped
    report = p.stderr
    assert p.returncode == EXIT_TIMEOUT, report
    assert len(errors(p)) == 1, report
    assert waited(errors(p)[0], 2, f"{HOST}, stage 2, layers 6:8, microbatch 0",
                  "the hidden state of microbatch 0 from rank 1; rank 1 is stuck or dead"), report
    assert p.after_fault < TIMEOUT_S + 5, report
    assert not p.leftovers, report


def test_waiting_does_not_burn_a_core(middle_stopped):
    """While rank 1 is stopped, the ranks waiting for it (and their supervisors) mostly sleep."""
    p, share, n = middle_stopped
    assert p.returncode == EXIT_TIMEOUT, p.stderr
    assert share < 0.5, f"{n} waiting processes used {share:.0%} of a core"
