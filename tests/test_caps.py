"""caps.py against fake /proc and /sys trees and fake environments; --log-dir under mpiexec."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import run_cli, write_job
from rlx_mpi.lifecycle.launch import launcher_tasks
from rlx_mpi.cluster.caps import (NodeCaps, cgroup_memory, cpu_share, format_caps, host_memory,
                          mpi_versions_differ, slurm_memory)

GB = 10**9
MAX = str(2**63 - 4096)  # what cgroup v1 shows for "no limit"


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _v1(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    _tree(tmp_path / "sys", {"memory/cgroup.procs": "", **{f"memory/{k}": v for k, v in files.items()}})
    _tree(tmp_path, {"proc/self/cgroup": proc})
    return tmp_path / "proc/self/cgroup", tmp_path / "sys"


def _v2(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    _tree(tmp_path / "sys", {"cgroup.procs": "", **files})
    _tree(tmp_path, {"proc/self/cgroup": proc})
    return tmp_path / "proc/self/cgroup", tmp_path / "sys"


def test_v1_own_cgroup_not_the_root(tmp_path):
    """Found 3: the job's cgroup (a Slurm step) has the limit; the root has none."""
    proc, sys_ = _v1(tmp_path, "12:pids:/\n4:memory:/slurm/uid_0/job_7/step_0/task_1\n0::/\n", {
        "memory.limit_in_bytes": MAX, "memory.usage_in_bytes": str(20 * GB),
        "slurm/uid_0/job_7/memory.limit_in_bytes": str(2**30),
        "slurm/uid_0/job_7/memory.usage_in_bytes": str(100 * 2**20),
        "slurm/uid_0/job_7/step_0/memory.limit_in_bytes": MAX,
        "slurm/uid_0/job_7/step_0/task_1/memory.limit_in_bytes": MAX,
        "slurm/uid_0/job_7/step_0/task_1/memory.usage_in_bytes": str(50 * 2**20)})
    assert cgroup_memory(proc, sys_) == (2**30, 2**30 - 100 * 2**20)


def test_v1_tightest_limit_on_the_way_up_wins(tmp_path):
    proc, sys_ = _v1(tmp_path, "4:memory:/a/b\n", {
        "a/memory.limit_in_bytes": str(4 * GB), "a/memory.usage_in_bytes": str(GB),
        "a/b/memory.limit_in_bytes": str(8 * GB), "a/b/memory.usage_in_bytes": str(GB)})
    assert cgroup_memory(proc, sys_) == (4 * GB, 3 * GB)


def test_v2_own_cgroup_and_max(tmp_path):
    proc, sys_ = _v2(tmp_path, "0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0\n", {
        "memory.max": "max",  # the root: unlimited
        "system.slice/slurmstepd.scope/job_9/memory.max": str(3 * GB),
        "system.slice/slurmstepd.scope/job_9/memory.current": str(GB),
        "system.slice/slurmstepd.scope/job_9/step_0/user/task_0/memory.max": "max",
        "system.slice/slurmstepd.scope/job_9/step_0/user/task_0/memory.current": "0"})
    assert cgroup_memory(proc, sys_) == (3 * GB, 2 * GB)


def test_container_sees_its_cgroup_as_the_root(tmp_path):
    """Inside a container /proc/self/cgroup names a path the mount does not have: walk up to it."""
    proc, sys_ = _v2(tmp_path, "0::/docker/abc123\n", {"memory.max": str(6 * GB), "memory.current": str(GB)})
    assert cgroup_memory(proc, sys_) == (6 * GB, 5 * GB)


def test_no_limit_anywhere_and_no_cgroup_file(tmp_path):
    proc, sys_ = _v1(tmp_path, "4:memory:/x\n", {"memory.limit_in_bytes": MAX, "x/memory.limit_in_bytes": MAX})
    assert cgroup_memory(proc, sys_) == (None, None)
    assert cgroup_memory(tmp_path / "absent", sys_) == (None, None)


def test_slurm_memory_fallback():
    assert slurm_memory({"SLURM_MEM_PER_NODE": "1024"}) == 2**30
    assert slurm_memory({"SLURM_MEM_PER_CPU": "512", "SLURM_CPUS_ON_NODE": "4"}) == 2 * 2**30
    assert slurm_memory({"SLURM_MEM_PER_NODE": "0"}) is None  # --mem=0: the whole node
    assert slurm_memory({}) is None


def test_host_memory_takes_the_tightest(tmp_path):
    proc, sys_ = _v1(tmp_path, "4:memory:/j\n", {"j/memory.limit_in_bytes": str(4 * GB),
                                                 "j/memory.usage_in_bytes": str(GB)})
    total, available = host_memory({"SLURM_MEM_PER_NODE": "1024"}, proc, sys_)
    assert total == 2**30 and available <= 2**30
    total, available = host_memory({}, proc, sys_)
    from rlx_mpi.cluster.caps import _meminfo

    assert total == min(4 * GB, _meminfo()["MemTotal"]) and available <= 3 * GB


def test_cpus_per_task_under_srun_is_not_divided():
    """Found 4: srun --cpus-per-task=8 with binding: 8 each, not 8 / ranks on the node."""
    own = frozenset(range(8))
    env = {"SLURM_CPUS_PER_TASK": "8", "SLURM_STEP_ID": "0"}
    assert cpu_share(own, [own, frozenset(range(8, 16))], 2, env) == 8
    assert cpu_share(frozenset(range(32)), [frozenset(range(32))] * 4, 4, env) == 8  # unbound: still 8
    assert cpu_share(frozenset(range(4)), None, 1, env) == 4  # never more than it may run on


def test_affinity_divided_only_among_ranks_sharing_it():
    whole = frozenset(range(8))
    assert cpu_share(whole, [whole] * 4, 4, {}) == 2  # plain mpiexec: one set for all
    halves = [frozenset(range(4)), frozenset(range(4, 8))]
    assert cpu_share(halves[0], halves, 2, {}) == 4  # bound: each its own
    assert cpu_share(halves[0], [halves[0], halves[0], halves[1]], 3, {}) == 2
    assert cpu_share(frozenset({0}), [frozenset({0})] * 4, 4, {}) == 1  # never 0
    assert cpu_share(whole, None, 2, {}) == 4  # unknown: assume shared


def test_launcher_tasks():
    assert launcher_tasks({"SLURM_STEP_NUM_TASKS": "4"}) == ("SLURM_STEP_NUM_TASKS", 4)
    assert launcher_tasks({"PMI_SIZE": "1", "OMPI_COMM_WORLD_SIZE": "2"}) == ("OMPI_COMM_WORLD_SIZE", 2)
    assert launcher_tasks({"SLURM_NTASKS": "4"}) is None  # sbatch's own shell, not a launched task
    assert launcher_tasks({}) is None


def _caps(rank, lib):
    return NodeCaps(rank=rank, host="h", local_rank=rank, local_size=2, cpus=1, ram_total_bytes=GB,
                    ram_available_bytes=GB, mpi_library=lib, job_id="42")


def test_mpi_versions_differ_names_the_ranks():
    same = [_caps(0, "MPICH Version: 4.2.0"), _caps(1, "MPICH Version: 4.2.0")]
    assert mpi_versions_differ(same) is None
    text = format_caps(same)
    assert "MPICH 4.2.0" in text and "slurm job 42" in text and "warning" not in text
    mixed = [_caps(0, "MPICH Version: 4.2.0"), _caps(1, "Open MPI v5.0.3")]
    warning = mpi_versions_differ(mixed)
    assert warning and "ranks 0: MPICH Version: 4.2.0" in warning and "ranks 1: Open MPI v5.0.3" in warning
    assert "warning: the ranks run different MPI libraries" in format_caps(mixed)


def test_caps_round_trip_with_new_fields():
    c = _caps(3, "MPICH Version: 5.0.2")
    assert NodeCaps.from_dict(c.to_dict()) == c


# -- under mpiexec -------------------------------------------------------------------------------


@pytest.mark.mpi
def test_log_dir_one_file_per_rank(tmp_path, tiny_ckpt):
    job = write_job(tmp_path, model={"checkpoint": str(tiny_ckpt)}, run={"seq": 8},
                    placement={"reserve_ram_gb": 0.0})
    p = run_cli(["run", job, "--log-dir", tmp_path / "logs"], ranks=3, timeout=90,
                env={"SLURM_JOB_ID": "31337"})
    assert p.returncode == 0, p.stderr
    assert "slurm job 31337" in p.stdout, p.stdout
    assert "[rank 1]" not in p.stderr and "[rank 2]" not in p.stderr, p.stderr  # rank 0 alone on the terminal
    names = sorted(f.name for f in (tmp_path / "logs").iterdir())
    assert names == ["rank-0000.log", "rank-0001.log", "rank-0002.log"], names
    host = os.uname().nodename
    for r in range(3):
        lines = (tmp_path / "logs" / f"rank-{r:04d}.log").read_text().splitlines()
        assert lines and all(f"[rank {r} {host}]" in line for line in lines), lines
        assert any("slurm job 31337" in line for line in lines), lines


@pytest.mark.mpi
def test_log_dir_that_cannot_be_made_is_one_line(tmp_path, tiny_ckpt):
    (tmp_path / "file").write_text("x")
    job = write_job(tmp_path, model={"checkpoint": str(tiny_ckpt)})
    p = run_cli(["run", job, "--log-dir", tmp_path / "file" / "logs"], ranks=2, timeout=60)
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert len(errors) == 1 and re.search(r"--log-dir .*cannot write a log there", errors[0]), p.stderr


@pytest.mark.mpi
def test_wrong_launch_is_refused(tmp_path, tiny_ckpt):
    """Found 2 without Slurm: a launcher that says 4 tasks beside a 1-rank world."""
    job = write_job(tmp_path, model={"checkpoint": str(tiny_ckpt)})
    p = run_cli(["run", job], ranks=None, timeout=60, env={"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"})
    assert p.returncode == 2, p.stderr
    assert "srun --mpi=pmi2" in p.stderr and "stage" not in p.stdout, p.stderr
    quiet = run_cli(["run", job], ranks=None, timeout=60, env={"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"})
    assert quiet.returncode == 2 and "error" not in quiet.stderr, quiet.stderr  # one line per job, not per task
