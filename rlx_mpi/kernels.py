"""numba kernels for the element-wise parts of a forward (BLAS does the matmuls).

Each fuses what numpy does in several passes over memory with a temporary per pass
(measured in bench/bench_kernels.py). The ``_`` kernels do no validation and no allocation;
the public wrappers check dtype, shape and contiguity and allocate; a caller with other
dtypes gets an error that says what to pass. Kernels are single-threaded on purpose: the rank's cores belong to
its BLAS threads (pinned in `cluster._pin_threads`).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["causal_softmax_", "rms_norm", "warm_up"]


@numba.njit(cache=True, fastmath=False)
def _causal_softmax(scores, offset):  # scores (N, T, S) float32, row t sees keys 0..t+offset
    n, t_len, s_len = scores.shape
    for i in range(n):
        for t in range(t_len):
            row = scores[i, t]
            last = min(t + offset + 1, s_len)
            peak = row[0]
            for s in range(1, last):
                if row[s] > peak:
                    peak = row[s]
            total = np.float32(0.0)
            for s in range(last):
                e = np.exp(row[s] - peak)
                row[s] = e
                total += e
            inv = np.float32(1.0) / total
            for s in range(last):
                row[s] *= inv
            for s in range(last, s_len):
                row[s] = 0.0


@numba.njit(cache=True)
def _rms_norm(x, weight, eps, out):  # x (N, C) float32
    n, c = x.shape
    for i in range(n):
        acc = 0.0  # float64: as accurate as numpy's pairwise float32 mean
        for j in range(c):
            acc += np.float64(x[i, j]) * x[i, j]
        scale = np.float32(1.0 / np.sqrt(acc / c + eps))
        for j in range(c):
            out[i, j] = weight[j] * (x[i, j] * scale)


def _check(name: str, a: np.ndarray) -> None:
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise TypeError(f"{name}: expected a C-contiguous float32 array, got {a.dtype} "
                        f"({'contiguous' if a.flags.c_contiguous else 'non-contiguous'}); "
                        "pass np.ascontiguousarray(x, dtype=np.float32)")


def causal_softmax_(scores: np.ndarray, offset: int = 0) -> np.ndarray:
    """Softmax over the last axis with a causal mask, in place: query t sees keys <= t + offset."""
    _check("causal_softmax_", scores)
    if not scores.flags.writeable:
        raise ValueError("causal_softmax_: scores is read-only; pass a writable array")
    _causal_softmax(scores.reshape(-1, scores.shape[-2], scores.shape[-1]), offset)
    return scores


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, into a new array."""
    _check("rms_norm", x)
    _check("rms_norm weight", weight)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {weight.shape} does not match x's last axis {x.shape[-1]}")
    out = np.empty_like(x)
    _rms_norm(x.reshape(-1, x.shape[-1]), weight, np.float32(eps), out.reshape(-1, x.shape[-1]))
    return out


def warm_up() -> None:
    """Load (or compile) every kernel now, at build time, not inside the first timed forward."""
    causal_softmax_(np.zeros((1, 1, 1), np.float32))
    rms_norm(np.ones((1, 2), np.float32), np.ones(2, np.float32), 1e-6)
