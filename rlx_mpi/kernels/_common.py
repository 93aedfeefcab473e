"""What every kernel module shares: the array check of the public wrappers and compile flags."""

from __future__ import annotations

import numpy as np

# Note: threads. The element-wise and attention kernels are written with `numba.prange` but
# compiled serial: measured on a 2-core host with 2 BLAS threads, alternating numba's OpenMP
# pool with OpenBLAS's threads (each spins after its region) made blocked attention 5.5x slower
# than the serial kernels, which match the old materialising attention's time. Their matmuls are
# BLAS's, on the rank's BLAS threads; flip this to try again. The decode matvecs (matvec.py,
# lowp.py) are the exception: compiled parallel, they split output rows over numba's pool,
# which `set_threads` sizes like BLAS's (`cluster._pin_threads`).
PARALLEL = False

# IEEE division (Inf/NaN, no ZeroDivisionError check): a float division carries a zero check
# unless error_model="numpy", and that check keeps LLVM from vectorising the loop.
ERR = "numpy"

FAST = {"reassoc", "contract"}  # lets LLVM vectorise float32 dot-product reductions (SIMD lanes)


def check_f32(name: str, a: np.ndarray) -> None:
    """TypeError naming ``name`` unless ``a`` is a C-contiguous float32 array."""
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise TypeError(f"{name}: expected a C-contiguous float32 array, got {a.dtype} "
                        f"({'contiguous' if a.flags.c_contiguous else 'non-contiguous'}); "
                        "pass np.ascontiguousarray(x, dtype=np.float32)")
