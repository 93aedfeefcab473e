"""Element-wise kernels only some families need: GeGLU (tanh), logit soft-capping and
GPT-OSS's clamped SwiGLU.

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

__all__ = ["gelu_tanh_mul_", "softcap_", "swiglu_clamped_"]

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


@numba.njit(cache=True, error_model="numpy")
def _swiglu_clamped(gate, up, limit, alpha):  # gate, up (N, I) float32: gate <- GPT-OSS's clamped SwiGLU
    one = np.float32(1.0)
    for r in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            g = min(gate[r, j], limit)
            u = min(max(up[r, j], -limit), limit)
            gate[r, j] = (u + one) * (g / (one + np.float32(math.exp(-alpha * g))))


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
