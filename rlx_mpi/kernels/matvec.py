"""Decode's float32 matvec: ``x @ w.T`` for a few activation rows, output rows split over the
rank's numba threads (compiled parallel, unlike the element-wise kernels: see _common.py)."""

from __future__ import annotations

import numba
import numpy as np

from ._common import FAST, check_f32, pool_threads
from .rowdot import AHEAD_BYTES, ROWS, STEP, row_dots

__all__ = ["matvec_f32", "F32_MATVEC_ROWS"]

_AHEAD = AHEAD_BYTES // 4  # float32 weights


@numba.njit(cache=True, fastmath=FAST)
def _dot_from(w, n, x, r, k0):  # w[n, k0:] . x[r, k0:]: the columns past the vector steps
    acc = np.float32(0.0)
    for k in range(np.uint64(k0), np.uint64(w.shape[1])):  # unsigned: no negative-index wrap per element,
        acc += x[r, k] * w[n, k]  # which kept LLVM from vectorising a loop from a run-time start (2x slower)
    return acc


@numba.njit(cache=True, parallel=True, fastmath=FAST)
def _matvec_f32(x, w, out, chunks):  # x (R, K) f32, w (N, K) f32, out (R, N) f32: decode's f32 product
    r_len, k_len = x.shape
    n_len = w.shape[0]
    k_vec = k_len - k_len % STEP
    grouped = r_len - r_len % ROWS
    for c in numba.prange(chunks):
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(0, grouped, ROWS):  # ROWS activation rows share each weight load
                sums = row_dots(w, n, x, r, k_vec, _AHEAD if r == 0 else 0)  # (the weights ahead: once a row)
                for i in range(ROWS):
                    out[r + i, n] = sums[i] + _dot_from(w, n, x, r + i, k_vec)
            for r in range(grouped, r_len):
                acc = np.float32(0.0)  # one row: LLVM's own loop (4 accumulators), measured faster
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


F32_MATVEC_ROWS = 24  # up to this many rows a decode step's f32 projections run on matvec_f32, not BLAS.
# Kernel alone, weights read from DRAM (medium shapes), time over BLAS's W @ x.T at 8 / 12 / 16 / 32 rows:
# 0.96 / 1.00 / 1.09 / 1.47 on 1 thread, 0.86 / 0.76 / 1.10 / 1.35 on 2. In the model the step is what
# counts: with numba's matvecs the step runs as one call per layer (kernels.decode_layer) and its attention
# on the pool, with BLAS neither (medium, 2 threads, step time BLAS path / this one: 12 rows 1.54, 16 rows
# 1.30-1.48, 24 rows 1.32, 32 rows 1.02; 16 rows on 1 thread 1.22; logits within 5e-6), hence 24.
