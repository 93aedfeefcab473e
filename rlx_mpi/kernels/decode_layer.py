"""One decoder layer's decode step in one numba call: the kernels of the layer-by-layer path
(`rms_norm`, the decode matvecs, `decode_attention`, `swiglu`) called from compiled code.

``decode_layer(h, ...)`` computes, for a few rows h (B, C) of one new token each,

    a = h + o(attention(rms_norm(h) @ qkv.T + bias))          attention: per-head q/k norm?, RoPE,
    out = a + down(silu(gate(x)) * up(x)),  x = rms_norm(a)    cache write, cached keys

with the weights in f32, bf16 bits as uint16, f16 bits as int16, int8 + block scales, or q4
codes (uint8) + scale / minimum pairs (typing picks each product's matvec).
It is what `decoder.model.block` does at decode for a dense SwiGLU layer under no tensor
parallelism, with the same kernels in the same order: the logits are bit-for-bit those of the
layer-by-layer path (tests/test_families.py, every dense family at f32, bf16, f16 and int8). Other layers (MoE, GeGLU, sandwich norms, a TP
shard whose partial sums need an all-reduce in between) keep that path.

Note: why. A decode step at batch 1 is memory-bound in the matvecs, and the layer-by-layer path
spent ~90-110 us of Python and dispatch per layer around them (about 2 ms of a 17 ms int8 token
on 2 threads, medium preset): 4 `Linear` calls with their checks and allocations, 2 norms, the
attention wrapper, the activation and 2 residual adds. Here the layer is one dispatch; the
matvecs and the attention still fork onto numba's pool (parallel regions of their own).
Measured (bench/ab_decode.py, medium, batch 1, interleaved rounds, old ms/token over new, logits
identical): 2 threads int8 1.12x, bf16 1.14x, f32 1.19x; 1 thread 1.10x, 1.11x, 1.03x. At 2
threads that is more than the ~2 ms of Python it removes; a likely cause, not measured, is that
numba's workers no longer idle (and sleep) through Python between two parallel regions.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from ._common import ERR
from .attention import _NO_SINKS
from .attention_cache import _NO_TABLE, _attend_cache, _attend_cache_par, _decode_qkv
from .elementwise import _rms_norm, _swiglu
from .lowp import _matvec_int8
from .matvec import _matvec_float
from .q4gemm import _matvec_q4  # q4: the GEMM's order at every row count (q4gemm's decode note)

__all__ = ["decode_layer", "FORMATS"]

FORMATS = ("f32", "bf16", "f16", "int8", "q4")  # weight formats the fused layer takes (f16: its bits as int16)


def _matvec(x, w, scale, out, chunks):
    """x (R, K) @ w.T into out (R, N) with the decode matvec of w's storage (see the overload)."""


@overload(_matvec)
def _matvec_typed(x, w, scale, out, chunks):
    if w.dtype in (types.float32, types.uint16, types.int16):  # f32, bf16 bits or f16 bits
        return lambda x, w, scale, out, chunks: _matvec_float(x, w, out, chunks)
    if w.dtype == types.int8:
        return lambda x, w, scale, out, chunks: _matvec_int8(x, w, scale, out, chunks)
    if w.dtype == types.uint8:  # q4 codes
        return lambda x, w, scale, out, chunks: _matvec_q4(x, w, scale, out, chunks)
    return None


@numba.njit(cache=True, error_model=ERR)
def _decode_layer(h, ln1, ln2, eps, wqkv, sqkv, bqkv, q_dim, cos, sin, q_norm, k_norm, ck, cv, table, size, slots, pos,
                  scale, softcap, wo, so, wgu, sgu, wd, sd, threads, out):  # table (0, 0): slot rows, else paged
    B, C = h.shape
    nkv, L, hs = ck.shape[1], ck.shape[2], ck.shape[3]
    nh = q_dim // hs
    x = np.empty((B, C), np.float32)
    _rms_norm(h, ln1, eps, x)
    qkv = np.empty((B, wqkv.shape[0]), np.float32)
    _matvec(x, wqkv, sqkv, qkv, min(wqkv.shape[0], 4 * threads))
    if bqkv.shape[0]:
        for b in range(B):
            for j in range(qkv.shape[1]):
                qkv[b, j] += bqkv[j]
    q = np.empty((B, nh, hs), np.float32)
    y = np.empty((B, nh, hs), np.float32)
    _decode_qkv(qkv, q_dim, cos, sin, q_norm, k_norm, eps, ck, cv, table, size, slots, pos, q)
    last = pos if table.shape[0] > 0 else np.minimum(pos, L - 1)  # (slot rows: a ring's columns)
    if threads > 1 and B * nkv > 1:  # as attention_cache._attend_kernel (rows here are few: the pool's side)
        _attend_cache_par(q, ck, cv, table, size, slots, last, 0, scale, softcap, _NO_SINKS, y)
    else:
        _attend_cache(q, ck, cv, table, size, slots, last, 0, scale, softcap, _NO_SINKS, y)
    a = np.empty((B, C), np.float32)
    _matvec(y.reshape(B, nh * hs), wo, so, a, min(C, 4 * threads))
    for b in range(B):  # a = h + o(...), as model._add_to
        for j in range(C):
            a[b, j] += h[b, j]
    _rms_norm(a, ln2, eps, x)
    gu = np.empty((B, wgu.shape[0]), np.float32)
    _matvec(x, wgu, sgu, gu, min(wgu.shape[0], 4 * threads))
    act = np.empty((B, wgu.shape[0] // 2), np.float32)
    _swiglu(gu, act)
    _matvec(act, wd, sd, out, min(C, 4 * threads))
    for b in range(B):
        for j in range(C):
            out[b, j] += a[b, j]


def decode_layer(h: np.ndarray, ln1: np.ndarray, ln2: np.ndarray, eps: float, qkv, qkv_scale, qkv_bias, q_dim: int,
                 cos: np.ndarray, sin: np.ndarray, q_norm, k_norm, cache_k: np.ndarray, cache_v: np.ndarray,
                 slots: np.ndarray, positions: np.ndarray, scale: float, softcap: float, o, o_scale, gate_up,
                 gate_up_scale, down, down_scale, threads: int, table: np.ndarray | None = None,
                 size: int = 0) -> np.ndarray:
    """One decode step of a dense SwiGLU layer (see the module note): h (B, C) -> (B, C).

    For a caller that checked everything once: h (B, C), cos, sin (B, hs) and the norms float32
    C-contiguous; each weight checked at load (`lowp.check_weight`; float32 for f32, its scale
    None; f16 bits viewed as int16: `lowp.kernel_weight`) and all of one format; slots and positions from `check_cache_rows` (int64, in range);
    ``scale`` the attention's score scale; ``threads`` the pool's (`pool_threads`). ``table`` and
    ``size``: a paged cache, checked by the caller (`attention_cache.decode_attention` takes the same)."""
    none = np.empty(0, np.float32)
    nosc = np.empty((0, 0), np.float32)
    out = np.empty_like(h)
    _decode_layer(h, ln1, ln2, np.float32(eps), qkv, nosc if qkv_scale is None else qkv_scale,
                  none if qkv_bias is None else qkv_bias, q_dim, cos, sin, none if q_norm is None else q_norm,
                  none if k_norm is None else k_norm, cache_k, cache_v, _NO_TABLE if table is None else table, size,
                  slots, positions, np.float32(scale),
                  np.float32(softcap), o, nosc if o_scale is None else o_scale, gate_up,
                  nosc if gate_up_scale is None else gate_up_scale, down, nosc if down_scale is None else down_scale,
                  threads, out)
    return out


def warm_up(fmt: str, kinds: tuple[str, str, str, str] | None = None) -> None:
    """Load (or compile) the fused layer for weights in ``fmt``, or with ``kinds`` for qkv, o,
    gate_up and down each its own (`Linear.kind`: a format, or "q4f" for q4 with float32 pairs, as
    a converted GGUF mixes them; numba types the layer on every product's storage). Tiny shapes:
    C 4, 2 heads of 2; with any q4 product 32 columns: C 32, 2 heads of 16."""
    from .lowp import kernel_weight, quantize_int8, to_bf16
    from .quant import pairs_f32, quantize_q4

    kinds = kinds or (fmt,) * 4
    c, hs = (32, 16) if any(k.startswith("q4") for k in kinds) else (4, 2)

    def weight(n: int, k: int, fmt: str):
        w = np.full((n * c // 4, k * c // 4), 0.5, np.float32)
        if fmt.startswith("q4"):
            codes, sm = quantize_q4(w)
            return codes, (pairs_f32(sm) if fmt == "q4f" else sm)
        if fmt == "int8":
            return quantize_int8(w)
        if fmt == "f16":
            return kernel_weight(fmt, w.astype(np.float16).view(np.uint16)), None
        return (to_bf16(w) if fmt == "bf16" else w), None

    ones = np.ones(c, np.float32)
    (wqkv, sqkv), (wo, so), (wgu, sgu), (wd, sd) = (weight(n, k, f) for (n, k), f in
                                                      zip(((8, 4), (4, 4), (8, 4), (4, 4)), kinds))
    cache = np.zeros((1, 1, 4, hs), np.float32)
    trig = np.ones((1, hs), np.float32)
    decode_layer(np.ones((1, c), np.float32), ones, ones, 1e-6, wqkv, sqkv, None, c, trig, trig, None, None,
                 cache, cache.copy(), np.zeros(1, np.int64), np.ones(1, np.int64), 0.7, 0.0, wo, so, wgu, sgu, wd, sd, 1)
