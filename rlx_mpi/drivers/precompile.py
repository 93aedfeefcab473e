"""`rlx-mpi compile-kernels`: fill numba's on-disk cache once, so no job pays the compile.

Note: where compiled kernels go, and why a site install wants this. Every kernel is
``@numba.njit(cache=True)``: the first process that calls it compiles it (14-16 s for all of
them on the 2-core VM, one core) and writes it to numba's cache, which later processes load in
~0.4 s. numba puts the cache beside the kernel's source (``rlx_mpi/kernels/__pycache__``) where
that folder is writable, else in the user's cache folder (``~/.cache/numba``), else (a read-only
install and no writable HOME) nowhere: then every job compiles again, inside its start-up
deadline. ``NUMBA_CACHE_DIR`` names another folder. Run this once as the user who installed
the package (an HPC module: right after ``pip install``), on a node of the CPU kind the jobs run
on (numba compiles for the host's instruction set; a cache made for another CPU is not used).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["compile_kernels", "cache_folders", "compile_report"]


def _dispatchers():
    """Every cached numba dispatcher of the package's kernel modules."""
    import numba

    import importlib
    import pkgutil

    from .. import kernels
    from ..comm import wire
    from ..families.decoder import ops

    # every module of the kernels package (a kernel module added or removed needs no edit here)
    mods = [importlib.import_module(f"{kernels.__name__}.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
    for mod in (*mods, wire, ops, kernels):
        for value in vars(mod).values():
            if isinstance(value, numba.core.registry.CPUDispatcher) and getattr(value, "_cache", None) is not None:
                yield value


def cache_folders() -> list[Path]:
    """The folders numba reads and writes the package's kernels in, on this host."""
    seen = []
    for d in _dispatchers():
        path = Path(getattr(d._cache, "_cache_path", ""))
        if str(path) and path not in seen:
            seen.append(path)
    return seen


def compile_kernels() -> float:
    """Load or compile every kernel a stage can run (every weight format, the one-call decode
    layer, the wire codecs); returns the seconds it took."""
    from .. import kernels
    from ..comm import wire
    from ..families.decoder import ops

    t0 = time.perf_counter()
    kernels.warm_up()
    ops.warm_up()
    wire.warm_up()
    kernels.warm_up_lowp()
    kernels.warm_up_lora()  # LoRA adapters' products (a job with [adapters])
    for fmt in kernels.DECODE_LAYER_FORMATS:
        kernels.warm_up_decode_layer(fmt)
    for fmt in ("f32", "bf16", "f16", "int8", "q4"):  # MoE layers' experts (kernels/experts.py)
        kernels.warm_up_experts(fmt)
    return time.perf_counter() - t0


def writable(folder: Path) -> bool:
    """Whether this process can write numba's cache there (the folder, or its nearest parent)."""
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.access(p, os.W_OK)


def compile_report() -> list[str]:
    """Compile or load every kernel (`compile_kernels`); the lines ``rlx-mpi compile-kernels``
    prints: each cache folder and whether it is written, then the time taken."""
    seconds = compile_kernels()
    lines = []
    for folder in cache_folders():
        state = "written" if writable(folder) else "NOT writable: every job compiles again; set NUMBA_CACHE_DIR"
        lines.append(f"kernel cache: {folder} ({state})")
    return lines + [f"compiled or loaded every kernel in {seconds:.1f} s"]
