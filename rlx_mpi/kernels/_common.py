"""What every kernel module shares: the array check of the public wrappers and compile flags."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Sequence

import numba
import numpy as np

# Note: threads. The element-wise and attention kernels are written with `numba.prange` but
# compiled serial: measured on a 2-core host with 2 BLAS threads, alternating numba's OpenMP
# pool with OpenBLAS's threads (each spins after its region) made blocked attention 5.5x slower
# than the serial kernels, which match the old materialising attention's time. Their matmuls are
# BLAS's, on the rank's BLAS threads; flip this to try again. The decode matvecs (matvec.py,
# lowp.py) are the exception: compiled parallel, they split output rows over numba's pool,
# which `set_threads` sizes like BLAS's (`cluster._pin_threads`). OpenBLAS's threads spin ~0.1 s
# after each call by default; a launched rank lets them sleep after ~0.4 ms (launch.py's note), or a
# decode step after a prefill shares its cores with them.
PARALLEL = False

# IEEE division (Inf/NaN, no ZeroDivisionError check): a float division carries a zero check
# unless error_model="numpy", and that check keeps LLVM from vectorising the loop.
ERR = "numpy"

FAST = {"reassoc", "contract"}  # lets LLVM vectorise float32 dot-product reductions (SIMD lanes)


_threads: list[int] = []  # the count `set_threads` last gave numba's pool (empty: never set)
_here = threading.local()  # .threads: the count numba was last given in this thread


def pool_threads() -> int:
    """Threads of numba's pool for the parallel kernels: the rank's share (`set_threads`),
    given to numba in the calling thread first if this thread has not had it.

    Note: numba.get_num_threads() first calls numba's _launch_threads, 3-7 us per call (measured
    under load); a decode step calls a matvec ~113 times (medium preset), so the count
    `set_threads` gave is kept here and numba asked only when it was never set.

    Note: the count is per thread. numba keeps it thread-local: a thread other than the one
    `set_threads` ran on starts at NUMBA_NUM_THREADS (all the host's cores). The start-up's work
    runs in such a thread (`faults.bounded`), so a q4 job of 2 ranks on the 2-core VM quantized
    its weights at load on 2 OpenMP threads a rank, 4 on 2 cores (seen in gdb: GOMP_parallel with
    num_threads=2 under `_quantize_q4`): 15-16 ns a weight where 1 thread alone takes 10-12.
    Each parallel kernel's wrapper asks here (a thread-local look, ~50 ns) before its call."""
    if not _threads:
        return numba.get_num_threads()
    if getattr(_here, "threads", 0) != _threads[0]:
        numba.set_num_threads(_threads[0])
        _here.threads = _threads[0]
    return _threads[0]


# Note: threading layer. numba's default (OpenMP, GNU libgomp) is kept. Its workers spin after
# each parallel region; on a shared or oversubscribed core that spin takes the core from the next
# serial kernel: under load (2026-12-01, load 4.6-5.8 from other jobs) workqueue decoded the
# medium preset 2.2-8.7x faster at 2 threads. On a quiet host, the case of a batch job on its own
# node, it is the other way round: bench_llamacpp.py, medium preset, batch-1 decode, 2 threads,
# tokens/s workqueue / omp / omp with OMP_WAIT_POLICY=passive: f32 13.7 / 16.9 / 18.5, bf16
# 20.4 / 30.2 / 31.2. A user on an oversubscribed node can set NUMBA_THREADING_LAYER=workqueue
# (or OMP_WAIT_POLICY=passive); it passes through mpiexec and srun.


def set_threads(n: int | None) -> None:
    """Run the parallel kernels (the decode matvecs) on ``n`` threads: the rank's share of its host, like BLAS."""
    if n:
        numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))
        _threads[:] = [numba.get_num_threads()]
        _here.threads = _threads[0]


# Note: the team. Blocked attention's GEMMs are small (a 64-query block against at most 1024
# keys of one kv head's group), too small for OpenBLAS to split well: at 2 threads they ran
# slower than at 1 (medium heads, 128 tokens: 1.7 against 1.3 ms a layer). `run_parts` splits
# such work into independent parts instead: the calling thread takes the first, Python worker
# threads (one fewer than `pool_threads`) the others, each calling BLAS on one thread (numpy
# releases the GIL in a product, the kernels they call are nogil). The workers wait on a futex,
# so unlike numba's OpenMP pool (threads note) nothing spins beside the next BLAS product.
# Measured (2 threads, medium heads, 16 layers' attention alone, 2026-12-02, a Xeon with AVX-512):
# 128 tokens 27.5 -> 12.1 ms, 512 tokens 156 -> 82 ms. Inside a prefill (medium f32, 2 threads, the
# code before in the same process, interleaved): `attend` 128 tokens 19-20 -> 16-18 ms (the prefill
# unchanged within noise: OpenBLAS's worker still spins ~0.4 ms after the q|k|v product, beside the
# team's), 512 tokens 137 -> 87 ms (prefill 868 -> 803 ms, 1.08x), 1024 tokens 439 -> 285 ms
# (prefill 1.86 -> 1.71 s, 1.09x); 1 thread unchanged. Splitting SwiGLU's rows the same way made a
# 128-token prefill's SwiGLU slower (4.8 -> 7.5 ms) and a 512-token one's 22 -> 18.5 ms: not taken.
_team: list[tuple[int, ThreadPoolExecutor]] = []  # (workers, the executor), made on first use
_blas: list[list] = []  # threadpoolctl's BLAS controllers, found on first use


def _blas_controllers() -> list:
    """threadpoolctl's controllers of the BLAS libraries loaded here (found once; none: [])."""
    if not _blas:
        try:
            from threadpoolctl import ThreadpoolController

            _blas.append([c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"])
        except Exception:  # no threadpoolctl, or a library it cannot drive: leave BLAS as it is
            _blas.append([])
    return _blas[0]


@contextmanager
def blas_on_one_thread():
    """BLAS on one thread inside the block, its count as before after (a C call each way)."""
    libs = _blas_controllers()
    before = [c.get_num_threads() for c in libs]
    for c in libs:
        c.set_num_threads(1)
    try:
        yield
    finally:
        for c, n in zip(libs, before):
            c.set_num_threads(n)


def team_size(units: int) -> int:
    """How many parts `run_parts` should get for ``units`` independent pieces of work."""
    return max(1, min(units, pool_threads()))


def run_parts(fn: Callable[..., None], parts: Sequence[tuple]) -> None:
    """``fn(*part)`` for each part, at once: the first on the calling thread, the rest on the
    team's workers, with BLAS on one thread (the team note). Parts must write disjoint outputs."""
    if len(parts) <= 1:
        for part in parts:
            fn(*part)
        return
    if not _team or _team[0][0] < len(parts) - 1:
        if _team:
            _team[0][1].shutdown(wait=True)
        _team[:] = [(len(parts) - 1, ThreadPoolExecutor(len(parts) - 1, thread_name_prefix="rlx-team"))]
    with blas_on_one_thread():
        futures = [_team[0][1].submit(fn, *part) for part in parts[1:]]
        try:
            fn(*parts[0])
        finally:
            for f in futures:
                f.result()  # re-raises a worker's error here, after every part has stopped


# Note: alignment. The float tiles load 64-byte vectors of a weight row and of an activation row;
# numpy's large arrays start 16 bytes past a page (malloc's header), so every such load spans two
# cache lines. Measured (1 thread, 8 medium matrices, 128 rows, against the broadcast GEMM before
# the invariance note, in process): 0.84x with 16-byte-aligned arrays, 0.97x with 64-byte ones.
# A `Linear` holds its weight 64-byte aligned (a copy at load when it is not), `matmul_float` its
# activations (a copy of x, small beside the product).
ALIGN = 64


def aligned(a: np.ndarray) -> np.ndarray:
    """``a`` when it is C-contiguous and starts on an ALIGN-byte boundary, else such a copy."""
    if a.flags.c_contiguous and a.ctypes.data % ALIGN == 0:
        return a
    buf = np.empty(a.nbytes + ALIGN, np.uint8)
    off = -buf.ctypes.data % ALIGN
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array starting on an ALIGN-byte boundary (no copy made)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(nbytes + ALIGN, np.uint8)
    off = -buf.ctypes.data % ALIGN
    return buf[off:off + nbytes].view(dtype).reshape(shape)


def check_f32(name: str, a: np.ndarray) -> None:
    """TypeError naming ``name`` unless ``a`` is a C-contiguous float32 array."""
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise TypeError(f"{name}: expected a C-contiguous float32 array, got {a.dtype} "
                        f"({'contiguous' if a.flags.c_contiguous else 'non-contiguous'}); "
                        "pass np.ascontiguousarray(x, dtype=np.float32)")
