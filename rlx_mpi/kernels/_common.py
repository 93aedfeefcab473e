"""What every kernel module shares: the array check of the public wrappers and compile flags."""

from __future__ import annotations


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


def pool_threads() -> int:
    """Threads of numba's pool for the parallel kernels.

    Note: numba.get_num_threads() first calls numba's _launch_threads, 3-7 us per call (measured
    under load); a decode step calls a matvec ~113 times (medium preset), so the count
    `set_threads` gave is kept here and numba asked only when it was never set."""
    return _threads[0] if _threads else numba.get_num_threads()


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


def check_f32(name: str, a: np.ndarray) -> None:
    """TypeError naming ``name`` unless ``a`` is a C-contiguous float32 array."""
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise TypeError(f"{name}: expected a C-contiguous float32 array, got {a.dtype} "
                        f"({'contiguous' if a.flags.c_contiguous else 'non-contiguous'}); "
                        "pass np.ascontiguousarray(x, dtype=np.float32)")
