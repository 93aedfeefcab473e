"""LoRA's low-rank products for a step whose rows use different adapters (`lora_add_`).

``y[n, col:col+O] += scale[k] * B[k] (A[k] x[n])`` for every token row n whose adapter is k
(``rows[n] == k``; -1: the base model, left alone), after the base product wrote y.

Note: segments, not a gathered batch. Rows of one adapter are taken together (the adapter loop
is the outer one), so each adapter's A and B (r = 16 on a 4096-wide projection: 256 KiB each
in float32) are read once a step while they sit in cache, and no row is copied to group them.
B is held transposed (K, R, O): the product adds t_j times B's column j to the row, a contiguous
loop the compiler vectorises; stored (O, R) its inner loop was r = 16 long, and the kernel ran at
a ninth of the base product's rate (medium's gate/up, 512 rows, 1 thread: 3.4 ms against 18 ms).
Every row's value is the same two ordered sums whatever its neighbours are (the rows beside it
never enter its loops), so a row gives the same bits in any batch, as the base products do
(rowdot's invariance note). The products are serial: at r = 16 they are 2 x 16 x (in + out)
multiply-adds a row against the base product's in x out (0.8 % of a 4096 x 4096 projection),
so a thread team would cost more to start than it saves; bench/bench_lora.py measures it.
Ranks are padded to the stack's widest with zero rows (A) and columns (B); the loops stop at
each adapter's own rank, so the padding is never read.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["lora_add_", "warm_up"]


@numba.njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _lora_add(y, x, rows, a, bt, ranks, scale, col):  # y (N, W), x (N, I), rows (N,), a (K, R, I), bt (K, R, O)
    N, I = x.shape
    O = bt.shape[2]
    t = np.empty(a.shape[1], np.float32)
    for k in range(a.shape[0]):
        r = ranks[k]
        s = scale[k]
        for n in range(N):
            if rows[n] != k:
                continue
            xn = x[n]
            for j in range(r):  # t = s (A x)
                aj = a[k, j]
                acc = np.float32(0.0)
                for i in range(I):
                    acc += aj[i] * xn[i]
                t[j] = s * acc
            yn = y[n, col:col + O]
            for j in range(r):  # y += B t, one column of B (a row of bt) at a time: contiguous, vectorised
                bj = bt[k, j]
                tj = t[j]
                for o in range(O):
                    yn[o] += tj * bj[o]


def lora_add_(y: np.ndarray, x: np.ndarray, rows: np.ndarray, a: np.ndarray, b: np.ndarray, ranks: np.ndarray,
              scale: np.ndarray, col: int = 0) -> np.ndarray:
    """Add each row's adapter product into columns ``col:col+O`` of ``y`` (N, W), in place; returns y.

    x (N, I) float32: the projection's input rows; rows (N,) int: each row's adapter (-1: none);
    a (K, R, I) and b (K, R, O) float32: the K adapters' A and B transposed (B's column j is
    ``b[k, j]``), padded to rank R; ranks (K,)
    int: each one's own rank; scale (K,) float32: alpha / r (or alpha / sqrt(r))."""
    for name, arr, nd in (("y", y, 2), ("x", x, 2), ("a", a, 3), ("b", b, 3), ("scale", scale, 1)):
        if arr.dtype != np.float32 or arr.ndim != nd:
            raise TypeError(f"lora_add_: {name} is {arr.dtype} {arr.shape}; pass float32 of {nd} dimensions")
    if not y.flags.c_contiguous:
        raise ValueError("lora_add_: y must be C-contiguous (it is written in place)")
    N, I = x.shape
    K, R, _ = a.shape
    O = b.shape[2]
    if y.shape[0] != N or a.shape[2] != I or b.shape[0] != K or b.shape[1] != R or not 0 <= col <= y.shape[1] - O:
        raise ValueError(f"lora_add_: y {y.shape}, x {x.shape}, a {a.shape}, b {b.shape} at column {col} do not fit "
                         "y (N, W), x (N, I), a (K, R, I), b (K, R, O) with col + O <= W")
    rows = np.ascontiguousarray(rows, np.int64)
    ranks = np.ascontiguousarray(ranks, np.int64)
    if rows.shape != (N,) or ranks.shape != (K,) or scale.shape != (K,):
        raise ValueError(f"lora_add_: rows {rows.shape}, ranks {ranks.shape}, scale {scale.shape}; pass ({N},), "
                         f"({K},), ({K},)")
    if K and (ranks.min() < 0 or ranks.max() > R):
        raise ValueError(f"lora_add_: ranks {ranks.tolist()} must lie in [0, {R}]")
    if N and (rows.min() < -1 or rows.max() >= K):
        raise ValueError(f"lora_add_: row adapters must lie in [-1, {K - 1}], got {rows.min()}..{rows.max()}")
    _lora_add(y, np.ascontiguousarray(x), rows, np.ascontiguousarray(a), np.ascontiguousarray(b), ranks,
              np.ascontiguousarray(scale), col)
    return y


def warm_up() -> None:
    """Compile (or load) the kernel."""
    one = np.ones((1, 1, 2), np.float32)
    lora_add_(np.zeros((1, 2), np.float32), np.ones((1, 2), np.float32), np.zeros(1, np.int64), one,
              np.ones((1, 1, 2), np.float32), np.ones(1, np.int64), np.ones(1, np.float32))
