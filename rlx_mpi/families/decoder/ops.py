"""Kernels only some families need: GeGLU (tanh), logit soft-capping, GPT-OSS's clamped
SwiGLU, and a per-head product for latent attention's absorbed decode (`head_matmul`).

Validation-free ``@numba.njit(cache=True)`` loops behind wrappers that check dtype, shape
and contiguity, as `rlx_mpi.kernels` does; tested against naive numpy (tests/test_families.py).

Note: both run in place on a fresh projection output (the gate; the logits), so they
allocate nothing. ``gelu_tanh_mul_`` is GELU's tanh approximation exactly as torch's
``gelu(approximate="tanh")``: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in float32.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ...kernels.experts import _swiglu_clamped  # the experts' decode kernel computes it too: one copy

__all__ = ["gelu_tanh_mul_", "softcap_", "swiglu_clamped_", "head_matmul"]

_K = np.float32(math.sqrt(2.0 / math.pi))
_C = np.float32(0.044715)


@numba.njit(cache=True, error_model="numpy")
def _gelu_tanh_mul(gate, up):  # gate, up (N, I) float32: gate <- gelu_tanh(gate) * up
    half = np.float32(0.5)
    one = np.float32(1.0)
    for r in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            x = gate[r, j]
            inner = _K * (x + _C * x * x * x)
            gate[r, j] = half * x * (one + np.float32(math.tanh(inner))) * up[r, j]


@numba.njit(cache=True, error_model="numpy")
def _softcap(flat, cap):  # flat (N,) float32 <- cap * tanh(flat / cap)
    for j in range(flat.shape[0]):
        flat[j] = cap * np.float32(math.tanh(flat[j] / cap))


# Note: per-head products. MLA's decode multiplies each head's vector by that head's own matrix
# (uk_h: 128 x 512 in DeepSeek-V3). A batched BLAS matmul reads each matrix once for all rows
# but its reduction order depends on how many rows there are (a row's logits would change with
# its batch); one product per row reads all 128 matrices (32 MB) per row. These loops read a
# head's matrix once for all rows, and each output is the same ordered sum whatever the batch.
@numba.njit(cache=True, error_model="numpy")
def _head_axpy(x, w, out):  # x (B, H, K), w (H, K, N): out[b, h] = sum_k x[b, h, k] w[h, k]
    B, H, K = x.shape
    for h in range(H):
        for b in range(B):
            o = out[b, h]
            o[:] = 0.0
            for k in range(K):
                a = x[b, h, k]
                wk = w[h, k]
                for n in range(o.shape[0]):
                    o[n] += a * wk[n]


@numba.njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _head_dot(x, w, out):  # x (B, H, K), w (H, N, K): out[b, h, n] = x[b, h] . w[h, n]
    B, H, K = x.shape
    for h in range(H):
        for b in range(B):
            xb = x[b, h]
            for n in range(w.shape[1]):
                wn = w[h, n]
                acc = np.float32(0.0)
                for k in range(K):
                    acc += xb[k] * wn[k]
                out[b, h, n] = acc


def head_matmul(x: np.ndarray, w: np.ndarray, transposed: bool = False) -> np.ndarray:
    """Each head's own product: x (B, H, K) with w (H, K, N) -> (B, H, N); with ``transposed``
    w is (H, N, K) (out[b, h] = w[h] @ x[b, h]). float32; a row's result never depends on the
    other rows (the note above)."""
    _check("head_matmul x", x)
    _check("head_matmul w", w)
    B, H, K = x.shape
    if w.ndim != 3 or w.shape[0] != H or w.shape[2 if transposed else 1] != K:
        raise ValueError(f"head_matmul: x {x.shape} and w {w.shape} do not fit (B, H, K) x "
                         f"{'(H, N, K)' if transposed else '(H, K, N)'}")
    out = np.empty((B, H, w.shape[1] if transposed else w.shape[2]), np.float32)
    (_head_dot if transposed else _head_axpy)(np.ascontiguousarray(x), np.ascontiguousarray(w), out)
    return out


def _check(name: str, a: np.ndarray) -> None:
    if a.dtype != np.float32:
        raise TypeError(f"{name} is {a.dtype}; pass float32")


def gelu_tanh_mul_(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GeGLU's ``gelu_tanh(gate) * up`` into ``gate`` (..., I); returns gate."""
    _check("gelu_tanh_mul_ gate", gate)
    _check("gelu_tanh_mul_ up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gelu_tanh_mul_: gate {gate.shape} and up {up.shape} differ")
    if not gate.flags.c_contiguous:
        raise ValueError("gelu_tanh_mul_: gate must be C-contiguous (it is written in place)")
    g2 = gate.reshape(-1, gate.shape[-1])
    _gelu_tanh_mul(g2, np.ascontiguousarray(up).reshape(g2.shape))
    return gate


def swiglu_clamped_(gate: np.ndarray, up: np.ndarray, limit: float, alpha: float) -> np.ndarray:
    """GPT-OSS's ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = min(gate, limit),
    into ``gate`` (..., I); returns gate."""
    _check("swiglu_clamped_ gate", gate)
    _check("swiglu_clamped_ up", up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_clamped_: gate {gate.shape} and up {up.shape} differ")
    if not gate.flags.c_contiguous:
        raise ValueError("swiglu_clamped_: gate must be C-contiguous (it is written in place)")
    g2 = gate.reshape(-1, gate.shape[-1])
    _swiglu_clamped(g2, np.ascontiguousarray(up).reshape(g2.shape), np.float32(limit), np.float32(alpha))
    return gate


def softcap_(x: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(x / cap)`` in place (Gemma 2's logit soft-capping); returns x."""
    _check("softcap_ x", x)
    if not x.flags.c_contiguous:
        raise ValueError("softcap_: x must be C-contiguous (it is written in place)")
    if not cap > 0:
        raise ValueError(f"softcap_: cap must be > 0, got {cap}")
    _softcap(x.reshape(-1), np.float32(cap))
    return x


def warm_up() -> None:
    """Compile (or load) both kernels at build time."""
    gelu_tanh_mul_(np.ones((1, 2), np.float32), np.ones((1, 2), np.float32))
    softcap_(np.ones(2, np.float32), 1.0)
    swiglu_clamped_(np.ones((1, 2), np.float32), np.ones((1, 2), np.float32), 7.0, 1.702)
    for transposed in (False, True):
        head_matmul(np.ones((1, 1, 2), np.float32), np.ones((1, 2, 2), np.float32), transposed)
