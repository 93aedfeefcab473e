"""What each rank has: host, cores, memory, devices, speed. Every rank probes itself."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["NodeCaps", "probe_local", "format_caps", "host_memory", "usable_cpus", "measure_gflops"]


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


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 or v1), or None when unlimited/unknown."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def _cgroup_usage() -> int | None:
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            return int(Path(path).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes for the whole host, honouring a cgroup limit."""
    info = _meminfo()
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    limit = _cgroup_limit()
    if limit is not None:
        total = limit if total is None else min(total, limit)
        usage = _cgroup_usage()
        if usage is not None:
            headroom = max(limit - usage, 0)
            available = headroom if available is None else min(available, headroom)
    return total, available


def usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


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
                gflops: bool = False) -> NodeCaps:
    """This rank's capabilities; memory and cores are divided among the ranks of the host."""
    total, available = host_memory()
    cpus = usable_cpus()
    share = None if cpus is None else max(1, cpus // local_size)
    ckpt_ok = None if ckpt is None else (Path(ckpt).is_file() and os.access(ckpt, os.R_OK))
    gpus = list_gpus()
    return NodeCaps(
        rank=rank,
        host=socket.gethostname(),
        local_rank=local_rank,
        local_size=local_size,
        # affinity is usually per host under mpiexec; a rank's share is the host's / ranks on it
        cpus=share,
        ram_total_bytes=None if total is None else total // local_size,
        ram_available_bytes=None if available is None else available // local_size,
        devices=("cpu",) + tuple(f"cuda:{i}" for i in range(len(gpus))),
        gpus=gpus,
        ckpt_readable=ckpt_ok,
        gflops=_measure_pinned(share) if gflops else None,
    )


def format_caps(caps: list[NodeCaps]) -> str:
    """A plain-text table of probed ranks (``rlx-mpi probe``)."""

    def gb(n: int | None) -> str:
        return "?" if n is None else f"{n / 1e9:.2f}"

    head = ("rank", "host", "local", "cpus", "ram_GB", "avail_GB", "devices", "ckpt", "GFLOP/s")
    rows = [head] + [(str(c.rank), c.host, f"{c.local_rank}/{c.local_size}", "?" if c.cpus is None else str(c.cpus),
                      gb(c.ram_total_bytes), gb(c.ram_available_bytes), ",".join(c.devices),
                      {None: "-", True: "ok", False: "NO"}[c.ckpt_readable],
                      "-" if c.gflops is None else f"{c.gflops:.1f}") for c in caps]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
