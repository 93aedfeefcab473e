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

__all__ = ["causal_softmax_", "rms_norm", "attend", "warm_up"]


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


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray | None = None,
           window: int = 0) -> np.ndarray:
    """Scaled dot-product attention of ``q`` over the keys ``k``/values ``v`` (grouped-query).

    q (B, nh, T, hs); k, v (B, nkv, S, hs) with nh a multiple of nkv (query head h reads kv
    head h // (nh // nkv)); key j sits at position j (k, v may be a prefix view of a cache).
    q_pos (B, T) int: the position of each query; key j is visible to query (b, t) when
    ``j <= q_pos[b, t]`` and, with ``window > 0``, ``j > q_pos[b, t] - window``. None means
    the last T positions of every sequence (q_pos[b, t] = S - T + t: plain causal prefill,
    or a decode step). Returns y (B, T, nh, hs) float32, C-contiguous, so that
    ``y.reshape(B, T, nh * hs)`` feeds o_proj without a copy.
    """
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    if k.shape != (B, nkv, S, hs) or v.shape != k.shape or nh % nkv:
        raise ValueError(f"attend: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                         "(B, nh, T, hs) / (B, nkv, S, hs) with nh a multiple of nkv")
    g = nh // nkv
    qg = q.reshape(B, nkv, g * T, hs)  # the g query heads of one kv head share its keys
    scores = (qg @ k.transpose(0, 1, 3, 2)).reshape(B, nkv, g, T, S) * np.float32(hs ** -0.5)
    if q_pos is None and window <= 0:
        probs = causal_softmax_(np.ascontiguousarray(scores, dtype=np.float32), S - T)
    else:
        if q_pos is None:
            q_pos = np.broadcast_to(np.arange(S - T, S), (B, T))
        q_pos = np.asarray(q_pos)
        if q_pos.shape != (B, T) or not np.issubdtype(q_pos.dtype, np.integer):
            raise ValueError(f"attend: q_pos must be an integer array of shape {(B, T)}, got "
                             f"{q_pos.dtype} {q_pos.shape}")
        j = np.arange(S)
        visible = j[None, None, :] <= q_pos[:, :, None]  # (B, T, S)
        if window > 0:
            visible &= j[None, None, :] > q_pos[:, :, None] - window
        scores = np.where(visible[:, None, None], scores, np.float32(-np.inf))
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = (scores / scores.sum(-1, keepdims=True)).astype(np.float32)
    y = probs.reshape(B, nkv, g * T, S) @ v  # (B, nkv, g*T, hs)
    return np.ascontiguousarray(y.reshape(B, nh, T, hs).transpose(0, 2, 1, 3))


def warm_up() -> None:
    """Load (or compile) every kernel now, at build time, not inside the first timed forward."""
    causal_softmax_(np.zeros((1, 1, 1), np.float32))
    rms_norm(np.ones((1, 2), np.float32), np.ones(2, np.float32), 1e-6)
