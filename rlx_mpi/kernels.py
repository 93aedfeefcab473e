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
from numba.core import types
from numba.extending import intrinsic

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


# -- low-precision weights (issue 10 sections 1-2) ---------------------------------------------
# Note: storage. bf16 is kept as its uint16 bit pattern (the top half of a float32: decoding
# is a shift), f16 as its uint16 bit pattern decoded with integer ops and one multiply (numba
# has no float16 arithmetic on CPU; a 65536-entry table was measured 3x slower: a gather per
# weight does not vectorise), int8 as int8 with one float32 scale per output row.
# Activations and accumulators stay float32.
# Decode (a few activation rows) reads every weight once: the fused kernels below dequantise
# inside the dot product, ``numba.prange`` over output rows (the rank's pinned numba threads),
# so a bf16 matrix moves half the bytes of an f32 one and an int8 matrix a quarter. Prefill
# (many rows) is compute-bound: a tile of weight rows is dequantised into a reused float32
# buffer and handed to BLAS (measured faster than a numba GEMM, bench/bench_precision.py).

_FAST = {"reassoc", "contract"}  # lets LLVM vectorise the float32 dot-product reductions
_F16_TO_F32 = np.float32(2.0 ** 112)  # rebias a half's exponent (15) to a float's (127); renormalises subnormals


@numba.njit(cache=True, inline="always", fastmath=_FAST)
def _decode_f16(h, bits):  # h (K,) uint16 f16 bits -> bits (K,) uint32 of the exact float32 values
    special = np.uint32(0)
    for k in range(h.shape[0]):  # sign in place, exponent and mantissa shifted into a float's
        x = np.uint32(h[k])
        bits[k] = ((x & np.uint32(0x8000)) << np.uint32(16)) | ((x & np.uint32(0x7FFF)) << np.uint32(13))
        special |= np.uint32(1) if (x & np.uint32(0x7C00)) == np.uint32(0x7C00) else np.uint32(0)
    vals = bits.view(np.float32)
    for k in range(h.shape[0]):
        vals[k] = vals[k] * _F16_TO_F32
    if special:  # Inf / NaN halves (a corrupt weight): exponent all ones, mantissa kept
        for k in range(h.shape[0]):
            x = np.uint32(h[k])
            if (x & np.uint32(0x7C00)) == np.uint32(0x7C00):
                bits[k] = ((x & np.uint32(0x8000)) << np.uint32(16)) | np.uint32(0x7F800000) | (
                    (x & np.uint32(0x3FF)) << np.uint32(13))


@intrinsic
def _as_f32(typingctx, bits):
    """Reinterpret a uint32 as float32 (a register bitcast: lets the decode sit inside the dot)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen


@numba.njit(cache=True, parallel=True, fastmath=_FAST)
def _matvec_bf16(x, w, out, chunks):  # x (R, K) f32, w (N, K) uint16 bf16 bits, out (R, N) f32
    r_len, k_len = x.shape
    n_len = w.shape[0]
    for c in numba.prange(chunks):
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(r_len):
                acc = np.float32(0.0)
                for k in range(k_len):  # bf16 -> f32 is a shift: exact, and vectorises with the FMA
                    acc += x[r, k] * _as_f32(np.uint32(w[n, k]) << np.uint32(16))
                out[r, n] = acc


@numba.njit(cache=True, parallel=True, fastmath=_FAST)
def _matvec_f16(x, w, out, chunks):  # w (N, K) uint16 f16 bits, none Inf/NaN (the wrapper's caller checks)
    r_len, k_len = x.shape
    n_len = w.shape[0]
    for c in numba.prange(chunks):
        wv = np.empty(k_len, np.float32)  # with several rows, decode each weight row once
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            if r_len == 1:
                acc = np.float32(0.0)
                for k in range(k_len):
                    acc += x[0, k] * _f16_value(w[n, k])
                out[0, n] = acc
                continue
            for k in range(k_len):
                wv[k] = _f16_value(w[n, k])
            for r in range(r_len):
                acc = np.float32(0.0)
                for k in range(k_len):
                    acc += x[r, k] * wv[k]
                out[r, n] = acc


@numba.njit(cache=True, inline="always", fastmath=_FAST)
def _f16_value(bits):  # finite float16 bits -> float32: sign, exponent, mantissa moved, exponent rebiased
    h = np.uint32(bits)
    return _as_f32(((h & np.uint32(0x8000)) << np.uint32(16)) | ((h & np.uint32(0x7FFF)) << np.uint32(13))) * _F16_TO_F32


@numba.njit(cache=True, parallel=True, fastmath=_FAST)
def _matvec_int8(x, w, scale, out, chunks):  # w (N, K) int8, scale (N,) f32: W = scale[:, None] * w
    r_len, k_len = x.shape
    n_len = w.shape[0]
    for c in numba.prange(chunks):
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(r_len):
                acc = np.float32(0.0)
                for k in range(k_len):
                    acc += x[r, k] * np.float32(w[n, k])
                out[r, n] = acc * scale[n]


@numba.njit(cache=True)
def _dequant_bf16(w, start, out):  # rows start.. of w (N, K) uint16 -> out (n, K) f32
    bits = out.view(np.uint32)
    for i in range(out.shape[0]):
        for k in range(out.shape[1]):
            bits[i, k] = np.uint32(w[start + i, k]) << np.uint32(16)


@numba.njit(cache=True)
def _dequant_f16(w, start, out):
    bits = out.view(np.uint32)
    for i in range(out.shape[0]):
        _decode_f16(w[start + i], bits[i])


@numba.njit(cache=True)
def _dequant_int8(w, scale, start, out):
    for i in range(out.shape[0]):
        s = scale[start + i]
        for k in range(out.shape[1]):
            out[i, k] = np.float32(w[start + i, k]) * s


@numba.njit(cache=True, parallel=True)
def _to_bf16(x, out):  # x (N,) f32 -> out (N,) uint16, round to nearest even; NaN stays NaN
    bits = x.view(np.uint32)
    for i in numba.prange(x.shape[0]):
        b = bits[i]
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep it quiet, not Inf
            out[i] = np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
        else:
            out[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(cache=True, parallel=True)
def _quantize_int8(w, q, scale):  # w (N, K) f32 -> q (N, K) int8, scale (N,) f32, symmetric per row
    for n in numba.prange(w.shape[0]):
        peak = np.float32(0.0)
        for k in range(w.shape[1]):
            peak = max(peak, abs(w[n, k]))
        s = peak / np.float32(127.0)
        scale[n] = s
        inv = np.float32(0.0) if s == 0 else np.float32(1.0) / s
        for k in range(w.shape[1]):
            q[n, k] = np.int8(np.rint(w[n, k] * inv))


WEIGHT_FORMATS = ("bf16", "f16", "int8")
_TILE_BYTES = 1 << 20  # f32 bytes of one dequantised tile: fits L2 beside BLAS's own panels


def _check_weight(fmt: str, w: np.ndarray, scale: np.ndarray | None) -> None:
    want = {"bf16": np.uint16, "f16": np.uint16, "int8": np.int8}.get(fmt)
    if want is None:
        raise ValueError(f"weight format {fmt!r} is not one of {WEIGHT_FORMATS}")
    if w.ndim != 2 or w.dtype != want or not w.flags.c_contiguous:
        raise TypeError(f"{fmt} weight: expected a C-contiguous 2-D {np.dtype(want)} array, got "
                        f"{w.ndim}-D {w.dtype}; build it with kernels.to_bf16 / quantize_int8 "
                        "or np.float16(...).view(np.uint16)")
    if fmt == "int8":
        if scale is None or scale.shape != (w.shape[0],):
            raise ValueError(f"int8 weight: scale must have shape ({w.shape[0]},), got "
                             f"{None if scale is None else scale.shape}")
        _check("int8 scale", scale)


def dequant_matmul(x: np.ndarray, w: np.ndarray, fmt: str, scale: np.ndarray | None = None,
                   out: np.ndarray | None = None, fused: bool = True) -> np.ndarray:
    """``x @ W.T`` for a low-precision weight ``W`` (N, K) stored as ``fmt``: x (R, K) -> (R, N) f32.

    Few rows (decode) run the fused dequantise-dot kernel; many rows (prefill) dequantise a
    tile of W at a time into a reused float32 buffer and call BLAS. Either way no float32
    copy of the whole of W exists. ``fused=False`` forces the tiled path: the fused f16 kernel
    assumes no Inf/NaN weights (`f16_has_special` tells; a Linear checks once at load).
    """
    _check("dequant_matmul x", x)
    _check_weight(fmt, w, scale)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dequant_matmul: x {x.shape} does not fit W {w.shape}; expected (R, {w.shape[1]})")
    R, N = x.shape[0], w.shape[0]
    if out is None:
        out = np.empty((R, N), np.float32)
    if R <= MATVEC_ROWS and fused:
        chunks = min(N, 4 * numba.get_num_threads())  # a few per thread: balanced, one scratch row each
        if fmt == "bf16":
            _matvec_bf16(x, w, out, chunks)
        elif fmt == "f16":
            _matvec_f16(x, w, out, chunks)
        else:
            _matvec_int8(x, w, scale, out, chunks)
        return out
    K = w.shape[1]
    tile = max(16, min(N, _TILE_BYTES // (4 * K)))
    buf = np.empty((tile, K), np.float32)
    part = np.empty((R, tile), np.float32)
    for a in range(0, N, tile):
        b = min(N, a + tile)
        t = buf[:b - a]
        if fmt == "bf16":
            _dequant_bf16(w, a, t)
        elif fmt == "f16":
            _dequant_f16(w, a, t)
        else:
            _dequant_int8(w, scale, a, t)
        p = part[:, :b - a]
        np.matmul(x, t.T, out=p)
        out[:, a:b] = p
    return out


MATVEC_ROWS = 16  # up to this many activation rows the fused kernel beats dequantise + BLAS (measured: 1.5x at 16 and 32 rows, 1 thread)


@numba.njit(cache=True)
def _f16_any_special(flat):  # no temporaries: this runs on every f16 matrix at load
    for i in range(flat.shape[0]):
        if (flat[i] & np.uint16(0x7C00)) == np.uint16(0x7C00):
            return True
    return False


def f16_has_special(w: np.ndarray) -> bool:
    """Whether any float16 bit pattern in ``w`` is Inf or NaN (exponent bits all ones)."""
    if w.dtype != np.uint16:
        raise TypeError(f"f16_has_special: expected uint16 bit patterns, got {w.dtype}")
    return bool(_f16_any_special(np.ascontiguousarray(w).reshape(-1)))


def dequantize(w: np.ndarray, fmt: str, scale: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
    """float32 copy of ``W`` (or of its ``rows``): for embedding lookups and tests."""
    _check_weight(fmt, w, scale)
    if rows is not None:
        rows = np.asarray(rows).reshape(-1)
        w = np.ascontiguousarray(w[rows])
        scale = None if scale is None else np.ascontiguousarray(scale[rows])
    out = np.empty(w.shape, np.float32)
    if fmt == "bf16":
        _dequant_bf16(w, 0, out)
    elif fmt == "f16":
        _dequant_f16(w, 0, out)
    else:
        _dequant_int8(w, scale, 0, out)
    return out


def to_bf16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16, same shape) of float32 ``x``, rounded to nearest even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16)
    _to_bf16(x.reshape(-1), out.reshape(-1))
    return out


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"from_bf16: expected uint16 bit patterns, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-row int8: ``W ~= scale[:, None] * q`` with ``max|q| = 127`` per row."""
    _check("quantize_int8 w", w)
    if w.ndim != 2:
        raise ValueError(f"quantize_int8: expected a 2-D weight (out, in), got shape {w.shape}")
    q = np.empty(w.shape, np.int8)
    scale = np.empty(w.shape[0], np.float32)
    _quantize_int8(w, q, scale)
    return q, scale


def warm_up_lowp() -> None:
    """Load (or compile) the low-precision kernels at build time."""
    x1, x2 = np.ones((1, 4), np.float32), np.ones((MATVEC_ROWS + 1, 4), np.float32)
    w = np.ones((2, 4), np.float32)
    q, s = quantize_int8(w)
    b = to_bf16(w)
    for fmt, ww, sc in (("bf16", b, None), ("f16", w.astype(np.float16).view(np.uint16), None), ("int8", q, s)):
        dequant_matmul(x1, ww, fmt, sc)
        dequant_matmul(x2, ww, fmt, sc)


__all__ += ["dequant_matmul", "dequantize", "f16_has_special", "to_bf16", "from_bf16", "quantize_int8", "warm_up_lowp",
            "WEIGHT_FORMATS", "MATVEC_ROWS"]
