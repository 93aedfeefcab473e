"""Element-wise kernels of a forward: RMSNorm, SwiGLU's silu(gate) * up, RoPE, and a vectorisable exp.

Each fuses what numpy does in several passes over memory with a temporary per pass
(measured in bench/bench_kernels.py). The ``_`` kernels do no validation and no allocation;
the public wrappers check dtype, shape and contiguity and allocate; a caller with other
dtypes gets an error that says what to pass. They run serial on the calling thread (see the
threads note in _common.py).
"""

from __future__ import annotations

import numba
import numpy as np

from ._common import ERR, PARALLEL, aligned_empty, check_f32
from .bits import as_f32

__all__ = ["rms_norm", "silu_mul_", "swiglu", "rope"]

# Note: exp. numba's np.exp is a scalar libm call, and a float division carries a zero check
# unless ``error_model="numpy"``: either keeps LLVM from vectorising a loop (SiLU measured 10x
# slower). `_exp` is Cephes' expf (range reduction by ln 2, degree-6 polynomial, 2^n built in
# the exponent bits): max error under 1 ulp on [-87, 88.72] (tests/test_kernels.py), NaN stays
# NaN, above ~88.72 it is Inf, below -87 it saturates at exp(-87) (1.6e-38, ~0 beside any term).


@numba.njit(cache=True, inline="always")
def _exp(x):  # float32 -> float32, vectorisable (see the note above)
    x = np.float32(89.0) if x > np.float32(89.0) else x  # (NaN passes both clamps)
    x = np.float32(-87.0) if x < np.float32(-87.0) else x
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))  # x = n ln2 + r, |r| <= ln2 / 2
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # ln 2 in two parts
    p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    half = np.int32(n) >> np.int32(1)  # 2^n as 2^half * 2^(n - half): n = 128 stays finite
    return (p * as_f32(np.uint32((half + np.int32(127)) << np.int32(23)))
            * as_f32(np.uint32((np.int32(n) - half + np.int32(127)) << np.int32(23))))


@numba.njit(cache=True, error_model=ERR, fastmath={"reassoc", "contract"})
def _rms_norm(x, weight, eps, out):  # x (N, C) float32; reassoc: the float64 sum in SIMD lanes
    n, c = x.shape
    for i in range(n):
        acc = 0.0  # float64: as accurate as numpy's pairwise float32 mean
        for j in range(c):
            acc += np.float64(x[i, j]) * x[i, j]
        scale = np.float32(1.0 / np.sqrt(acc / c + eps))
        for j in range(c):
            out[i, j] = weight[j] * (x[i, j] * scale)


@numba.njit(cache=True, parallel=PARALLEL, error_model=ERR)
def _silu_mul(gate, up):  # gate, up (N, I) float32, any row stride: gate <- silu(gate) * up
    n, width = gate.shape
    for i in numba.prange(n):
        g, u = gate[i], up[i]
        for j in range(width):
            x = g[j]
            g[j] = x / (np.float32(1.0) + _exp(-x)) * u[j]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, into a new array."""
    check_f32("rms_norm", x)
    check_f32("rms_norm weight", weight)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {weight.shape} does not match x's last axis {x.shape[-1]}")
    out = aligned_empty(x.shape, np.float32)  # (a product's input: no aligning copy, _common's alignment note)
    _rms_norm(x.reshape(-1, x.shape[-1]), weight, np.float32(eps), out.reshape(-1, x.shape[-1]))
    return out


@numba.njit(cache=True, error_model=ERR)
def _swiglu(gu, out):  # gu (N, 2I) float32 C-contiguous: [gate | up] per row -> out (N, I)
    n, width = out.shape
    for i in range(n):
        for j in range(width):
            x = gu[i, j]
            out[i, j] = x / (np.float32(1.0) + _exp(-x)) * gu[i, width + j]


def swiglu(gu: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` of a fused gate/up output ``gu`` (..., 2I) = [gate | up] into a new
    C-contiguous (..., I): one pass, and the down projection's input needs no copy."""
    check_f32("swiglu", gu)
    if gu.ndim == 0 or gu.shape[-1] % 2:
        raise ValueError(f"swiglu: the last axis must be [gate | up] of even width, got {gu.shape}")
    out = aligned_empty((*gu.shape[:-1], gu.shape[-1] // 2), np.float32)  # (the down projection's input)
    _swiglu(gu.reshape(-1, gu.shape[-1]), out.reshape(-1, out.shape[-1]))
    return out


def silu_mul_(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU's ``silu(gate) * up`` in one pass, into ``gate`` (no temporaries); returns gate."""
    check_f32("silu_mul_ gate", gate)
    check_f32("silu_mul_ up", up)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul_: gate {gate.shape} and up {up.shape} differ; pass equal shapes")
    if not gate.flags.writeable:
        raise ValueError("silu_mul_: gate is read-only; pass a writable array")
    width = gate.shape[-1] if gate.ndim else 1
    _silu_mul(gate.reshape(-1, width), up.reshape(-1, width))
    return gate


@numba.njit(cache=True, parallel=PARALLEL)
def _rope(xt, cos, sin, out):  # xt (B, T, H, hs) C-contiguous (a projection's output) -> out (B, H, T, hs)
    B, T, H, hs = xt.shape
    half = hs // 2
    per_batch = cos.shape[0] > 1
    for bt in numba.prange(B * T):
        b, t = bt // T, bt % T
        c, s = (cos[b, t], sin[b, t]) if per_batch else (cos[0, t], sin[0, t])
        for h in range(H):
            x, o = xt[b, t, h], out[b, h, t]
            for d in range(half):  # contiguous rows in and out: this loop vectorises
                o[d] = x[d] * c[d] + (-x[d + half]) * s[d]
                o[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half]


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding (transformers' rotate-half layout) of x (B, H, T, hs), any strides.

    cos, sin: (T, hs) shared by the batch, or (B, T, hs) / (B, 1, T, hs) per sequence (tokens at
    their own positions). One pass over a projection's output (other layouts are copied first);
    the result is a new C-contiguous array, so a transposed projection output comes back in
    (B, H, T, hs) order for attention.
    """
    if x.ndim != 4 or x.dtype != np.float32:
        raise TypeError(f"rope: x must be a float32 (B, H, T, hs) array, got {x.dtype} {x.shape}")
    B, H, T, hs = x.shape
    cos, sin = np.asarray(cos, np.float32), np.asarray(sin, np.float32)
    if cos.ndim == 4 and cos.shape[1] == 1:
        cos, sin = cos[:, 0], sin[:, 0]
    elif cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    if hs % 2 or cos.shape[1:] != (T, hs) or cos.shape[0] not in (1, B) or sin.shape != cos.shape:
        raise ValueError(f"rope: cos {cos.shape} / sin {sin.shape} do not fit x {x.shape}; pass "
                         "(T, hs) or (B, 1, T, hs) tables with an even hs")
    out = np.empty((B, H, T, hs), np.float32)
    # the model's x is a projection's (B, T, H, hs) memory seen as (B, H, T, hs): no copy here;
    # any other layout is copied into that order first
    xt = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    _rope(xt, np.ascontiguousarray(cos), np.ascontiguousarray(sin), out)
    return out

