"""LoRA's low-rank products for a step whose rows use different adapters (`lora_add_`).

``y[n, col:col+O] += scale[k] * B[k] (A[k] x[n])`` for every token row n whose adapter is k
(``rows[n] == k``; -1: the base model, left alone), after the base product wrote y.

Note: segments. Rows of one adapter are taken together (the adapter loop is the outer one), so
each adapter's A and B (r = 16 on a 4096-wide projection: 256 KiB each in float32) are read once a
step. ``t = x A^T`` is the base products' own float32 product (`matvec.float_product`: each
element in one order whatever the rows, rowdot's invariance note) over the segment's rows,
gathered; ``y += t B^T`` is the loop here, with B held transposed (K, R, O) so that it adds t_j
times B's column j to the row, contiguous and vectorised, each row alone. So a row gives the same
bits in any batch, as the base products do. Measured on medium's gate/up (in 1024, out 2816,
r 16, 512 rows of one adapter, 1 thread, a busy 2-core VM, so only the ratios mean much): all in
numba with B stored (O, R) (an inner loop r = 16 long) 3.4 ms against the base product's 18; B
transposed 2.3 ms; A's product through float_product 0.3 ms against numba's dot loops' ~1; B's
product through float_product (a depth of 16) 50 ms: the matvecs are tiled for long rows. Ranks
are padded to the stack's widest with zero rows (A) and columns (B); only each adapter's own r are
read.
"""

from __future__ import annotations

import numba
import numpy as np

from ._common import aligned
from .matvec import float_product

__all__ = ["lora_add_", "warm_up"]


@numba.njit(cache=True, error_model="numpy")
def _add_bt(y, idx, t, bt, col):  # y[idx[m], col:col+O] += sum_j t[m, j] bt[j]: t (M, r), bt (R >= r, O)
    O = bt.shape[1]
    for m in range(idx.shape[0]):
        yn = y[idx[m], col:col + O]
        for j in range(t.shape[1]):  # one column of B (a row of bt) at a time: contiguous, vectorised
            tj = t[m, j]
            bj = bt[j]
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
    x = np.ascontiguousarray(x)
    for k in range(K):
        r = int(ranks[k])
        idx = np.flatnonzero(rows == k)
        if not r or not len(idx):
            continue
        xs = x if len(idx) == N else x[idx]  # (this adapter's rows, gathered: one product for the segment)
        t = float_product(aligned(xs), aligned(a[k, :r]))  # (n, r) = x A^T, each row in one order
        t *= scale[k]
        _add_bt(y, idx, t, np.ascontiguousarray(b[k]), col)
    return y


def warm_up() -> None:
    """Compile (or load) the kernel."""
    one = np.ones((1, 1, 2), np.float32)
    lora_add_(np.zeros((1, 2), np.float32), np.ones((1, 2), np.float32), np.zeros(1, np.int64), one,
              np.ones((1, 1, 2), np.float32), np.ones(1, np.int64), np.ones(1, np.float32))
