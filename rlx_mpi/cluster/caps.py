"""What each rank has: host, cores, memory, devices, speed. Every rank probes itself."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["NodeCaps", "probe_local", "format_caps", "host_memory", "usable_cpus", "measure_gflops", "cgroup_memory",
           "slurm_memory", "cpu_share", "mpi_library", "mpi_versions_differ"]


@dataclass(frozen=True)
class NodeCaps:
    """One rank's probed capabilities. ``None`` means unknown, never zero."""

    rank: int
    host: str
    local_rank: int  # index among the ranks on this host
    local_size: int  # ranks sharing this host (memory and cores are divided by it)
    cpus: int | None  # usable cores for this rank (affinity / local_size)
    ram_total_bytes: int | None  # this rank's share of the host (or cgroup) memory
    ram_available_bytes: int | None  # this rank's share of what is free now
    devices: tuple[str, ...] = ("cpu",)
    gpus: tuple[str, ...] = ()  # names from nvidia-smi, when present
    ckpt_readable: bool | None = None
    gflops: float | None = None  # measured float32 matmul speed, when asked for
    mpi_library: str | None = None  # first line of MPI_Get_library_version
    job_id: str | None = None  # SLURM_JOB_ID, when launched by Slurm
    arithmetic: str | None = None  # what its products run: amx | avx512 | avx2 | generic (`kernels.isa`)
    isa: str | None = None  # one line: that, what the CPU offers and why (`kernels.isa.Isa.describe`)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NodeCaps":
        return cls(**{**d, "devices": tuple(d["devices"]), "gpus": tuple(d["gpus"])})


# -- probing -------------------------------------------------------------------------------------



def _meminfo() -> dict[str, int]:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


# Note: a process's memory limit is that of its own cgroup (and of every ancestor: the tightest
# wins), not the root's. Under Slurm that is the job's cgroup (`--mem`), under a container the
# container's. /proc/self/cgroup names the cgroup; the hierarchy is mounted at /sys/fs/cgroup
# (v2), /sys/fs/cgroup/memory (v1) or /sys/fs/cgroup/unified (v2 beside v1). Where the path is
# not visible (a container sees its own cgroup as the mount's root) we walk up to what exists.
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes")
_V2_FILES = ("memory.max", "memory.current")
_UNLIMITED = 1 << 60


def _own_cgroups(text: str) -> list[tuple[str, str]]:
    """(version, path) of this process's memory cgroups from /proc/self/cgroup text."""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        number, controllers, path = parts
        if "memory" in controllers.split(","):
            out.append(("v1", path))
        elif number == "0" and controllers == "":
            out.append(("v2", path))
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _walk_up(mount: Path, path: str) -> list[Path]:
    """The folder of cgroup ``path`` under ``mount`` and its ancestors up to the mount (existing ones)."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    dirs = [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def cgroup_memory(proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                  sys_cgroup: str | os.PathLike = "/sys/fs/cgroup") -> tuple[int | None, int | None]:
    """(limit, headroom) bytes of this process's own memory cgroup, v1 or v2; None when unlimited.

    The limit is the tightest on the path up to the root; headroom is that cgroup's limit minus
    its usage (what the process may still take before the OOM killer acts).
    """
    try:
        text = Path(proc_cgroup).read_text()
    except OSError:
        return None, None
    root = Path(sys_cgroup)
    best: tuple[int, int | None] | None = None
    for version, path in _own_cgroups(text):
        limit_file, usage_file = _V1_FILES if version == "v1" else _V2_FILES
        mounts = [root / "memory"] if version == "v1" else [root, root / "unified"]
        for mount in mounts:
            if not (mount / "cgroup.procs").exists():
                continue  # not mounted here
            for d in _walk_up(mount, path):
                limit = _read_int(d / limit_file)  # v2's "max" (unlimited) reads as None
                if limit is None or limit >= _UNLIMITED:
                    continue
                usage = _read_int(d / usage_file)
                headroom = None if usage is None else max(limit - usage, 0)
                if best is None or limit < best[0]:
                    best = (limit, headroom)
            break
    return (None, None) if best is None else best


def slurm_memory(env: dict | None = None) -> int | None:
    """Bytes Slurm gave the job on this node: SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU x its CPUs here.

    The fallback where the job's cgroup is not visible or Slurm does not enforce ``--mem`` with one.
    """
    env = os.environ if env is None else env
    per_node = env.get("SLURM_MEM_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0:
        return int(per_node) * 2**20  # Slurm counts MiB
    per_cpu, cpus = env.get("SLURM_MEM_PER_CPU", ""), env.get("SLURM_CPUS_ON_NODE", "")
    if per_cpu.isdigit() and int(per_cpu) > 0:
        return int(per_cpu) * (int(cpus) if cpus.isdigit() and int(cpus) > 0 else 1) * 2**20
    return None


def host_memory(env: dict | None = None, proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                sys_cgroup: str | os.PathLike = "/sys/fs/cgroup") -> tuple[int | None, int | None]:
    """(total, available) bytes for this process's host, honouring its cgroup's and Slurm's limits.

    Shared by the ranks of the host (one job's cgroup holds them all): callers divide it.
    """
    info = _meminfo()
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    for limit, headroom in (cgroup_memory(proc_cgroup, sys_cgroup), (slurm_memory(env), None)):
        if limit is None:
            continue
        total = limit if total is None else min(total, limit)
        cap = limit if headroom is None else headroom
        available = cap if available is None else min(available, cap)
    return total, available


def usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def cpu_share(own: frozenset[int] | None, local: list[frozenset[int]] | None, local_size: int,
              env: dict | None = None) -> int | None:
    """Cores this rank may use: SLURM_CPUS_PER_TASK when set, else its affinity divided among the
    ranks of the host that have the very same affinity.

    Note: under ``srun --cpu-bind`` (or ``mpiexec -bind-to core``) each rank's affinity is
    already its own cores and dividing it again by the ranks on the host counts them twice;
    under a plain ``mpiexec`` every rank has the whole host and must share it.
    """
    env = os.environ if env is None else env
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0 and env.get("SLURM_STEP_ID") is not None:
        n = int(per_task)
        return n if own is None else max(1, min(n, len(own)))
    if own is None:
        cpus = os.cpu_count()
        return None if cpus is None else max(1, cpus // local_size)
    sharing = local_size if local is None else max(1, sum(1 for a in local if a == own))
    return max(1, len(own) // sharing)


def own_affinity() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def mpi_library() -> str | None:
    """The first line of the MPI library's version (e.g. ``MPICH Version: 4.2.0``), spaces squeezed."""
    try:
        from mpi4py import MPI

        text = MPI.Get_library_version()
    except Exception:  # no MPI at all: say so as unknown rather than fail the probe
        return None
    first = text.strip().splitlines()[0] if text.strip() else ""
    return " ".join(first.split()) or None


def list_gpus() -> tuple[str, ...]:
    """GPU names from nvidia-smi, when it is on PATH and answers within a few seconds."""
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())


def measure_gflops(n: int = 256, seconds: float = 0.2) -> float:
    """float32 matmul speed of this rank (with its pinned BLAS threads)."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a  # warm-up
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ a
        reps += 1
    return 2.0 * n**3 * reps / elapsed / 1e9


def _measure_pinned(threads: int | None) -> float:
    """Measure with this rank's share of the cores, as it will compute (ranks measure at once)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=threads):
        return measure_gflops()


def probe_local(rank: int, local_rank: int, local_size: int, ckpt: str | os.PathLike | None = None,
                gflops: bool = False, local_affinity: list[frozenset[int]] | None = None) -> NodeCaps:
    """This rank's capabilities; the host's memory, and cores the ranks share, are divided among them.

    ``local_affinity``: every local rank's CPU set (`gather_local_affinity`); without it the
    ranks of a host are assumed to share one set.
    """
    total, available = host_memory()
    share = cpu_share(own_affinity(), local_affinity, local_size)
    ckpt_ok = None if ckpt is None else (Path(ckpt).is_file() and os.access(ckpt, os.R_OK))
    gpus = list_gpus()
    return NodeCaps(
        rank=rank,
        host=socket.gethostname(),
        local_rank=local_rank,
        local_size=local_size,
        cpus=share,
        ram_total_bytes=None if total is None else total // local_size,
        ram_available_bytes=None if available is None else available // local_size,
        devices=("cpu",) + tuple(f"cuda:{i}" for i in range(len(gpus))),
        gpus=gpus,
        ckpt_readable=ckpt_ok,
        gflops=_measure_pinned(share) if gflops else None,
        mpi_library=mpi_library(),
        job_id=os.environ.get("SLURM_JOB_ID") or None,
        **_arithmetic(),
    )


def _arithmetic() -> dict:
    """This rank's arithmetic (`kernels.isa.detect`: CPU flags, and Linux's AMX permission)."""
    from ..errors import ConfigError
    from ..kernels.isa import ENV, detect

    try:
        isa = detect()
    except ValueError as e:
        raise ConfigError(f"environment {ENV}", str(e), f"unset {ENV} or set it to one of the levels named") from None
    return {"arithmetic": isa.products, "isa": isa.describe()}


# Launchers announce the size of the job they started; an MPI world of 1 beside one of these
# saying N > 1 means the MPI library did not understand the launcher (N separate 1-rank jobs).
def mpi_versions_differ(caps: list[NodeCaps]) -> str | None:
    """A warning naming the ranks of each MPI library when the ranks do not all run the same one."""
    by_version: dict[str, list[int]] = {}
    for c in caps:
        by_version.setdefault(c.mpi_library or "unknown", []).append(c.rank)
    if len(by_version) < 2:
        return None
    parts = "; ".join(f"ranks {','.join(map(str, r))}: {v}" for v, r in sorted(by_version.items()))
    return (f"the ranks run different MPI libraries ({parts}); build mpi4py against one MPI and load "
            "the same module on every node")


def _short_mpi(text: str | None) -> str:
    return "?" if not text else text.replace(" Version:", "").replace(" version", "")


def format_caps(caps: list[NodeCaps]) -> str:
    """A plain-text table of probed ranks (``rlx-mpi probe``), a warning if MPI libraries differ."""

    def gb(n: int | None) -> str:
        return "?" if n is None else f"{n / 1e9:.2f}"

    head = ("rank", "host", "local", "cpus", "ram_GB", "avail_GB", "devices", "ckpt", "GFLOP/s", "arith", "mpi")
    rows = [head] + [(str(c.rank), c.host, f"{c.local_rank}/{c.local_size}", "?" if c.cpus is None else str(c.cpus),
                      gb(c.ram_total_bytes), gb(c.ram_available_bytes), ",".join(c.devices),
                      {None: "-", True: "ok", False: "NO"}[c.ckpt_readable],
                      "-" if c.gflops is None else f"{c.gflops:.1f}", c.arithmetic or "?",
                      _short_mpi(c.mpi_library)) for c in caps]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    jobs = sorted({c.job_id for c in caps if c.job_id})
    if jobs:
        lines.append(f"slurm job {', '.join(jobs)}")
    for isa in sorted({c.isa for c in caps if c.isa}):  # (one line per kind of host)
        ranks = ",".join(str(c.rank) for c in caps if c.isa == isa)
        lines.append(f"arithmetic of ranks {ranks}: {isa}")
    warning = mpi_versions_differ(caps)
    if warning:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)
