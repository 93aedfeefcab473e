"""Decode's float matvec: ``x @ w.T`` for a few activation rows and float32, bfloat16 or float16
weights (lowp.py's bf16 and f16 decode is this kernel: bf16 as its uint16 bits, f16 as its bits
read as int16, so typing tells the two apart), output rows split over the rank's numba threads
(compiled parallel, unlike the element-wise kernels: see _common.py)."""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from ._common import FAST, check_f32, pool_threads
from .bits import as_f32, f16_exact, pack_bf16
from .rowdot import (AHEAD_BYTES, BF16_DOT, DP_STEP, ROWS, STEP, TILE_W, row_dot, row_dot_bf16, row_dots, row_dots2,
                     row_dots3, row_dots_tile)

__all__ = ["matvec_f32", "F32_MATVEC_ROWS"]


def _weight(w, n, k):
    """w[n, k] as float32: float32 weights as they are, bfloat16 bits (uint16) shifted, float16
    bits (int16) decoded; all exact."""


@overload(_weight, inline="always")
def _weight_typed(w, n, k):
    if w.dtype == types.float32:
        return lambda w, n, k: w[n, k]
    if w.dtype == types.uint16:
        return lambda w, n, k: as_f32(np.uint32(w[n, k]) << np.uint32(16))
    if w.dtype == types.int16:
        return lambda w, n, k: f16_exact(w[n, k])
    return None


@numba.njit(cache=True, fastmath=FAST)
def _dot_from(w, n, x, r, k0):  # w[n, k0:] . x[r, k0:]: the columns past the vector steps
    acc = np.float32(0.0)
    for k in range(np.uint64(k0), np.uint64(w.shape[1])):  # unsigned: no negative-index wrap per element,
        acc += x[r, k] * _weight(w, n, k)  # which kept LLVM from vectorising a loop from a run-time start (2x slower)
    return acc


@numba.njit(cache=True, fastmath=FAST)
def _one_row(x, w, r, n):  # x[r] . w[n]: LLVM's own loop (4 accumulators), measured faster for a lone row
    acc = np.float32(0.0)
    for k in range(x.shape[1]):
        acc += x[r, k] * _weight(w, n, k)
    return acc


@numba.njit(cache=True, fastmath=FAST)
def _put(out, sums, w, x, n, r, k_vec):
    """A tile's sums into out: ``sums[j * ROWS + i]`` (weight row n+j against activation row r+i,
    the columns up to k_vec) plus the columns past them."""
    for j in range(len(sums) // ROWS):
        for i in range(ROWS):
            out[r + i, n + j] = sums[j * ROWS + i] + _dot_from(w, n + j, x, r + i, k_vec)


def _lone_row(x, w, r, n, k_vec, ahead):
    """x[r] . w[n] for a row outside the groups of ROWS: numba's loop for float32 and bf16 weights,
    the vector IR for f16 (whose loop decodes each weight with integer ops, ~2x slower)."""


@overload(_lone_row, inline="always")
def _lone_row_typed(x, w, r, n, k_vec, ahead):
    if w.dtype == types.int16:
        return lambda x, w, r, n, k_vec, ahead: row_dot(w, n, x, r, k_vec, ahead)[0] + _dot_from(w, n, x, r, k_vec)
    return lambda x, w, r, n, k_vec, ahead: _one_row(x, w, r, n)


def _dot_operand(x, w, grouped):
    """The activation rows as the lone-row dot product of ``w`` reads them: bf16 bits (rounded to
    nearest even) for bf16 weights on a CPU with BF16_DOT when the rows are too few for the tile
    (``grouped`` 0); else an empty array, unused, or for other formats x itself (nothing
    allocated; rowdot's bf16 dot note)."""


@overload(_dot_operand, inline="always")
def _dot_operand_typed(x, w, grouped):
    if w.dtype == types.uint16 and BF16_DOT:
        def pack(x, w, grouped):
            if grouped:
                return np.empty((0, 0), np.uint16)
            xb = np.empty(x.shape, np.uint16)
            for r in range(x.shape[0]):
                pack_bf16(x[r], xb[r])
            return xb
        return pack
    return lambda x, w, grouped: x


def _few_row(x, xb, w, r, n, k_vec, ahead):
    """x[r] . w[n] when the rows are too few for the tile: bf16 weights against bf16 activations
    (xb) where the CPU has BF16_DOT, else `_lone_row`."""


@overload(_few_row, inline="always")
def _few_row_typed(x, xb, w, r, n, k_vec, ahead):
    if w.dtype == types.uint16 and BF16_DOT:
        def dot(x, xb, w, r, n, k_vec, ahead):
            k_dp = x.shape[1] - x.shape[1] % DP_STEP
            return row_dot_bf16(w, n, xb, r, k_dp) + _dot_from(w, n, x, r, k_dp)
        return dot
    return lambda x, xb, w, r, n, k_vec, ahead: _lone_row(x, w, r, n, k_vec, ahead)


@numba.njit(cache=True, parallel=True, fastmath=FAST)
def _matvec_float(x, w, out, chunks):  # x (R, K) f32, w (N, K) f32, bf16 or f16 bits, out (R, N) f32: decode's product
    r_len, k_len = x.shape
    n_len = w.shape[0]
    k_vec = k_len - k_len % STEP
    grouped = r_len - r_len % ROWS
    ahead = AHEAD_BYTES // w.itemsize
    xb = _dot_operand(x, w, grouped)  # bf16 x bf16 products for a few rows, where the CPU has them
    for c in numba.prange(chunks):
        lo, hi = c * n_len // chunks, (c + 1) * n_len // chunks
        if grouped == 0:  # fewer rows than a group: each weight row against each, one at a time
            for n in range(lo, hi):
                for r in range(r_len):
                    out[r, n] = _few_row(x, xb, w, r, n, k_vec, ahead if r == 0 else 0)
            continue
        n = lo
        while n + TILE_W <= hi:  # TILE_W weight rows share each activation load (rowdot's tile note)
            for r in range(0, grouped, ROWS):  # and ROWS activation rows each weight load
                _put(out, row_dots_tile(w, n, x, r, k_vec, ahead if r == 0 else 0), w, x, n, r, k_vec)  # (ahead: once a row)
            for r in range(grouped, r_len):
                for j in range(TILE_W):
                    out[r, n + j] = _lone_row(x, w, r, n + j, k_vec, 0)
            n += TILE_W
        for r in range(0, grouped, ROWS):  # the chunk's last three weight rows (after 4-row tiles), two or one
            if hi - n == 3:
                _put(out, row_dots3(w, n, x, r, k_vec, ahead if r == 0 else 0), w, x, n, r, k_vec)
            elif hi - n == 2:
                _put(out, row_dots2(w, n, x, r, k_vec, ahead if r == 0 else 0), w, x, n, r, k_vec)
            elif hi - n == 1:
                _put(out, row_dots(w, n, x, r, k_vec, ahead if r == 0 else 0), w, x, n, r, k_vec)
        for m in range(n, hi):
            for r in range(grouped, r_len):
                out[r, m] = _lone_row(x, w, r, m, k_vec, 0)


def matvec_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for a few float32 rows x (R, K) and float32 w (N, K), on the rank's numba
    threads: for weights in DRAM it reads them 1.7-1.8x faster than OpenBLAS's GEMV (measured
    over the small preset's decode step, 101 MB, 1 and 2 threads; F32_MATVEC_ROWS)."""
    check_f32("matvec_f32 x", x)
    check_f32("matvec_f32 w", w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matvec_f32: x {x.shape} and w {w.shape} do not fit (R, K) @ (N, K).T")
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _matvec_float(x, w, out, min(w.shape[0], 4 * pool_threads()))
    return out


F32_MATVEC_ROWS = 64  # up to this many rows a decode step's f32 projections run on matvec_f32, not BLAS.
# In the model the step is what counts: with numba's matvecs the step runs as one call per layer
# (kernels.decode_layer) and its attention on the pool, with BLAS neither. With the 2-row tiles (rowdot's
# tile note), whole decode step at this threshold against BLAS's path (medium, 2 threads, in process,
# bench/ab_decode.py against the code before the tiles, where these rows took BLAS): 28 rows 1.54x,
# 32 rows 1.27x (1.32x on 1 thread), 48 rows 1.23x, 64 rows 0.96x; logits within 6e-6. Before the tiles
# the crossover was 24-32 rows (step time BLAS / numba: 24 rows 1.32, 32 rows 1.02). The 3-row tile made
# the numba side 1.1-1.2x faster from 16 rows (rowdot's tile note), and the limit moved 48 -> 64: the
# limit's rows on numba against one row fewer on BLAS (in process, 5 interleaved rounds), decode step
# 2 threads 48 rows 1.23x, 64 1.11x, 80 1.13x, 96 0.90x; 1 thread 48 1.16x, 64 1.09x, 80 1.02x, 96 0.98x;
# a prefill of 64 / 80 tokens 0.98x / 1.02x (2 threads), 1.03x / 1.00x (1 thread).
