"""Driving the real CLI from a bench: job TOMLs in a temp dir, `mpiexec -n N python -m rlx_mpi run`.

Each launch does one forward (the CLI's unit of work) and writes its stats with ``--json``;
the benches launch every configuration several times, round-robin, and keep the best.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _machine import wait_quiet

__all__ = ["default_mpiexec", "write_job", "run_job", "run_warm", "probe_cpus", "ensure_checkpoint", "summarize"]


def default_mpiexec() -> str:
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")


def ensure_checkpoint(path: Path, preset: str) -> bool:
    """Create the random ``preset`` checkpoint at ``path`` if missing; True when created."""
    if path.exists():
        return False
    from rlx_mpi.families.llama import PRESETS
    from rlx_mpi.families.llama import FAMILY as _LLAMA
    init_random = _LLAMA.init_random

    init_random(path, PRESETS[preset], seed=0)
    return True


def write_job(folder: Path, name: str, *, checkpoint: Path, preset: str, batch: int, seq: int,
              microbatches: int = 1, tp: int = 1, policy: str = "balanced", timeout_s: float = 600.0,
              wire: str = "f32") -> Path:
    path = folder / f"{name}.toml"
    path.write_text(f"""# written by bench/ ({name})
[model]
checkpoint = "{checkpoint}"
preset = "{preset}"

[run]
batch = {batch}
seq = {seq}
microbatches = {microbatches}
wire = "{wire}"
timeout_s = {timeout_s}
startup_timeout_s = {max(timeout_s, 600.0)}

[placement]
policy = "{policy}"
tp = {tp}
reserve_ram_gb = 0.5
""")
    return path


def _launch(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{tail}")
    return proc


def run_job(ranks: int, job: Path, stats: Path, *, mpiexec: str, timeout_s: float = 900.0,
            quiet: float = 1.0, quiet_wait_s: float = 0.0, prefix: list[str] | None = None,
            extra: list[str] | None = None) -> dict:
    """One `rlx_mpi run` launch; returns its ``--json`` stats document. ``prefix`` goes before
    the launcher (e.g. ``["taskset", "-c", "0"]`` for one core), ``extra`` after the job.

    With ``quiet_wait_s`` it first waits up to that long for the host's CPUs to be less than
    ``quiet`` busy (other users' jobs); the busy fraction seen is stored as ``busy_before``.
    """
    busy = wait_quiet(quiet, quiet_wait_s) if quiet_wait_s > 0 else None
    if stats.exists():
        stats.unlink()
    _launch([*(prefix or []), mpiexec, "-n", str(ranks), sys.executable, "-m", "rlx_mpi", "run", str(job),
             "--json", str(stats), *(extra or [])], timeout_s)
    doc = json.loads(stats.read_text())
    doc["busy_before"] = busy
    return doc


def run_warm(ranks: int, job: Path, out: Path, *, mpiexec: str, reps: int, timeout_s: float = 1800.0,
             prefix: list[str] | None = None, python: str | None = None) -> list[dict]:
    """Start-up once, then ``reps`` warm forwards (bench/_drive.py); the stats of each, cold first."""
    if out.exists():
        out.unlink()
    _launch([*(prefix or []), mpiexec, "-n", str(ranks), python or sys.executable,
             str(Path(__file__).with_name("_drive.py")), str(job), "--reps", str(reps), "--out", str(out)], timeout_s)
    return json.loads(out.read_text())


def probe_cpus(ranks: int, *, mpiexec: str) -> list[int | None]:
    """The BLAS threads each rank pins (`rlx_mpi probe`'s ``cpus``, what `Cluster.probe` passes
    to threadpoolctl)."""
    proc = _launch([mpiexec, "-n", str(ranks), sys.executable, "-m", "rlx_mpi", "probe", "--json"], 300.0)
    return [c["cpus"] for c in json.loads(proc.stdout)]


def summarize(runs: list[dict], per_rank: tuple[str, ...]) -> dict:
    """Best and median of the launches; the ``per_rank`` stats columns come from the best launch."""
    import statistics

    best = min(runs, key=lambda r: r["total_forward_ms"])
    ranks = sorted(best["timings"], key=lambda t: t["rank"])
    out = {"best_ms": best["total_forward_ms"],
           "median_ms": statistics.median(r["total_forward_ms"] for r in runs),
           "all_ms": [r["total_forward_ms"] for r in runs],
           "busy_before": [r["busy_before"] for r in runs],
           "tokens": best["tokens"],
           "layers": [f"{t['layers'][0]}:{t['layers'][1]}" for t in ranks]}
    out.update({key: [t[key] for t in ranks] for key in per_rank})
    return out
