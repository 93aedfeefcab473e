"""Decode's float32 matvec: ``x @ w.T`` for a few activation rows, output rows split over the
rank's numba threads (compiled parallel, unlike the element-wise kernels: see _common.py)."""

from __future__ import annotations

import numba
import numpy as np

from ._common import FAST, check_f32, pool_threads

__all__ = ["matvec_f32", "F32_MATVEC_ROWS"]


@numba.njit(cache=True, parallel=True, fastmath=FAST)
def _matvec_f32(x, w, out, chunks):  # x (R, K) f32, w (N, K) f32, out (R, N) f32: decode's f32 product
    r_len, k_len = x.shape
    n_len = w.shape[0]
    for c in numba.prange(chunks):
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(r_len):
                acc = np.float32(0.0)
                for k in range(k_len):
                    acc += x[r, k] * w[n, k]
                out[r, n] = acc


def matvec_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for a few float32 rows x (R, K) and float32 w (N, K), on the rank's numba
    threads: for weights in DRAM it reads them 1.7-1.8x faster than OpenBLAS's GEMV (measured
    over the small preset's decode step, 101 MB, 1 and 2 threads; F32_MATVEC_ROWS)."""
    check_f32("matvec_f32 x", x)
    check_f32("matvec_f32 w", w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matvec_f32: x {x.shape} and w {w.shape} do not fit (R, K) @ (N, K).T")
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _matvec_f32(x, w, out, min(w.shape[0], 4 * pool_threads()))
    return out


F32_MATVEC_ROWS = 8  # up to this many rows matvec_f32 beats BLAS on a decode step (2 rows 1.8x, 8 rows
# 1.26x; at 16 BLAS is 1.45x faster), 1 thread, weights read from DRAM
