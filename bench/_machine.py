"""What every bench prints first (the machine and library versions), and the quiet-host gate.

Times are only ever compared with other times from the same run (ratios, never absolute
numbers asserted anywhere). The machine is shared, so every bench takes the best of several
interleaved trials, waits for the host to be quiet before each case, and prints the load.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

__all__ = ["machine", "header", "loadavg", "cpu_busy", "wait_quiet", "quiet_gate", "pct", "add_common_args", "save_json", "fmt_table"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mpi_library() -> str:
    """The MPI library's first version line, without initialising MPI ("unavailable (...)" without one)."""
    try:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False  # a launcher script only wants the version string
        from mpi4py import MPI

        return " ".join(MPI.Get_library_version().splitlines()[0].split())
    except Exception as e:  # no MPI library in this venv (the torch one): say so, don't fail
        return f"unavailable ({type(e).__name__})"


def _blas() -> list[str]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    return [f"{p.get('internal_api')} {p.get('version')} ({p.get('num_threads')} threads)" for p in threadpool_info()]


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _cpu_ticks() -> tuple[int, int] | None:
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields), idle


def cpu_busy(seconds: float = 0.5) -> float | None:
    """Fraction of the host's CPU time spent busy over the next ``seconds`` (None if unknown)."""
    a = _cpu_ticks()
    time.sleep(seconds)
    b = _cpu_ticks()
    if a is None or b is None or b[0] == a[0]:
        return None
    return 1.0 - (b[1] - a[1]) / (b[0] - a[0])


def wait_quiet(threshold: float, max_wait_s: float) -> float | None:
    """Wait (up to ``max_wait_s``) until other processes use less than ``threshold`` of the CPUs.

    The machine is shared: a launch that starts while another job runs measures that job.
    Returns the last busy fraction seen, so the caller can record how quiet it was.
    """
    end = time.monotonic() + max_wait_s
    busy = cpu_busy()
    while busy is not None and busy > threshold and time.monotonic() < end:
        time.sleep(1.0)
        busy = cpu_busy()
    return busy


def machine() -> dict:
    """The facts a reader needs to judge the numbers: CPU, cores, memory, versions, load."""
    import numpy as np

    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": _blas(),
        "loadavg_start": loadavg(),
    }
    for mod in ("mpi4py", "numba", "torch", "transformers"):
        if mod in sys.modules or mod in ("mpi4py", "numba"):
            try:
                info[mod] = __import__(mod).__version__
            except ImportError:
                info[mod] = None
    info["mpi"] = _mpi_library()
    return info


def header(title: str, info: dict, extra: str = "") -> str:
    """The lines every bench output starts with."""
    versions = ", ".join(f"{k} {info[k]}" for k in ("python", "numpy", "mpi4py", "numba", "torch", "transformers")
                         if info.get(k))
    lines = [f"# {title}",
             f"# {info['date']} on {info['host']}: {info['cpu']}, {info['cores']} cores "
             f"({info['usable_cores']} usable), {info['mem_gb']} GB RAM, load average {info['loadavg_start']}",
             f"# {versions}",
             f"# MPI: {info['mpi']}",
             f"# BLAS: {'; '.join(info['blas']) or '?'}"]
    if extra:
        lines.append(f"# {extra}")
    return "\n".join(lines)


def save_json(path: str | None, doc: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"# wrote {path}")


def fmt_table(head: list[str], rows: list[list[str]]) -> str:
    """A right-aligned plain-text table (pastes into Markdown as a code block)."""
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in [head, *rows])


def pct(x: float | None) -> str:
    """A busy fraction as a percentage, "?" when unknown."""
    return "?" if x is None else f"{100 * x:.0f}%"


def quiet_gate(comm, quiet: float, quiet_wait_s: float) -> float | None:
    """Rank 0 waits for the shared host to be quiet while the others sleep (not spin) in a barrier."""
    busy = wait_quiet(quiet, quiet_wait_s) if comm.rank == 0 and quiet_wait_s > 0 else None
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)
    return busy


def add_common_args(ap, quiet_wait_s: float) -> None:
    """--quiet, --quiet-wait and --json, the options every bench shares."""
    ap.add_argument("--quiet", type=float, default=0.25,
                    help="before each case wait until the host's CPUs are less busy than this fraction "
                    "(other users' jobs; default 0.25)")
    ap.add_argument("--quiet-wait", type=float, default=quiet_wait_s,
                    help=f"longest wait for --quiet, seconds (0: never wait; default {quiet_wait_s:g})")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
