"""LoRA's low-rank products for a step whose rows use different adapters (`lora_add_`).

``y[n, col:col+O] += scale[k] * B[k] (A[k] x[n])`` for every token row n whose adapter is k
(``rows[n] == k``; -1: the base model, left alone), after the base product wrote y.

Note: segments, in one call. Rows of one adapter are taken together (the adapter loop is the
outer one; its rows gathered), so each adapter's A and B (r = 16 on a 4096-wide projection:
256 KiB each in float32) are read once a step. ``t = x A^T`` runs on the decode matvecs' own
tiles (`matvec._span`, serial here: every element one ordered sum whatever the rows, rowdot's
invariance note); ``y += B t`` is the loop here, with B held transposed (K, R, O) so that it adds
t_j times B's column j to the row, contiguous and vectorised, each row alone. So a row gives the
same bits in any batch, as the base products do. The whole projection is one numba call: through
`float_product` (one call per adapter, each starting the pool) a decode step of the small preset
with 4 adapters on 6 of 8 rows took 2.1x the base step; in one call 1.2-1.5x (1 thread, a busy
2-core VM). Measured on medium's gate/up (in 1024, out 2816, r 16, 512 rows of one adapter):
all in numba with B stored (O, R) (an inner loop r = 16 long) 3.4 ms against the base product's
18; B transposed 2.3 ms. B's product through float_product (a depth of 16) was 50 ms: the
matvecs are tiled for long rows. Ranks are padded to the stack's widest with zero rows (A) and
columns (B); only each adapter's own r are read.
"""

from __future__ import annotations

import numba
import numpy as np

from .matvec import _operand, _span
from .rowdot import AHEAD_BYTES

__all__ = ["lora_add_", "warm_up"]


@numba.njit(cache=True, error_model="numpy")
def _lora_add(y, x, rows, a, bt, ranks, scale, col, ahead):  # y (N, W), x (N, I), a (K, R, I), bt (K, R, O)
    N, I = x.shape
    R, O = bt.shape[1], bt.shape[2]
    for k in range(a.shape[0]):
        r = ranks[k]
        count = 0
        for n in range(N):
            if rows[n] == k:
                count += 1
        if count == 0 or r == 0:
            continue
        idx = np.empty(count, np.int64)
        xs = np.empty((count, I), np.float32)  # this adapter's rows, gathered
        m = 0
        for n in range(N):
            if rows[n] == k:
                idx[m] = n
                xs[m] = x[n]
                m += 1
        w = a[k]
        t = np.empty((count, R), np.float32)
        _span(xs, _operand(xs, w), w, t, 0, r, ahead)  # t[:, :r] = xs A^T: the decode matvecs' tiles
        s = scale[k]
        for m in range(count):
            yn = y[idx[m], col:col + O]
            for j in range(r):  # y += B (s t): one column of B (a row of bt) at a time, contiguous
                tj = s * t[m, j]
                bj = bt[k, j]
                for o in range(O):
                    yn[o] += tj * bj[o]


def lora_add_(y: np.ndarray, x: np.ndarray, rows: np.ndarray, a: np.ndarray, b: np.ndarray, ranks: np.ndarray,
              scale: np.ndarray, col: int = 0, checked: bool = False) -> np.ndarray:
    """Add each row's adapter product into columns ``col:col+O`` of ``y`` (N, W), in place; returns y.

    x (N, I) float32: the projection's input rows; rows (N,) int: each row's adapter (-1: none);
    a (K, R, I) and b (K, R, O) float32: the K adapters' A and B transposed (B's column j is
    ``b[k, j]``), padded to rank R; ranks (K,)
    int: each one's own rank; scale (K,) float32: alpha / r (or alpha / sqrt(r)). ``checked``: the
    caller has made every argument as this says (C-contiguous; rows and ranks int64; a layer's
    stacks checked at load, a step's rows once a step: `decoder.lora`), so a projection's call
    skips the checks (112 calls a decode step on medium)."""
    if checked:
        _lora_add(y, x, rows, a, b, ranks, scale, col, AHEAD_BYTES // 4)
        return y
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
              np.ascontiguousarray(scale), col, AHEAD_BYTES // 4)
    return y


def warm_up() -> None:
    """Compile (or load) the kernel."""
    one = np.ones((1, 1, 2), np.float32)
    lora_add_(np.zeros((1, 2), np.float32), np.ones((1, 2), np.float32), np.zeros(1, np.int64), one,
              np.ones((1, 1, 2), np.float32), np.ones(1, np.int64), np.ones(1, np.float32))
