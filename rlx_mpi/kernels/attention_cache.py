"""Decode attention read in place from a KV cache: one query per head of each row over the row's
keys, slot rows (slots, nkv, L, hs) or a paged row's blocks through its table (the paged-rows note),
both by attention.py's one-query arithmetic (`_attend_one`'s runs), so a row's bits do not depend on the
layout, the step or the threads (attention.py's invariance note). `attend_cache` takes q as it is;
`decode_attention` applies RoPE (and the per-head norms) to the fused q|k|v projection, stores k
and v, then attends. A small step's (row, kv head) pairs go to numba's pool (`_attend_kernel`).
"""

from __future__ import annotations

import numba
import numpy as np

from ._common import ERR, FAST, check_f32, pool_threads
from .attention import _attend_one, _score_run, _sinks, _softmax_row, _value_run
from .matvec import F32_MATVEC_ROWS, _main_cols

__all__ = ["attend_cache", "decode_attention", "check_cache_rows"]


# Note: decode. One query per head (T = 1) over a cache takes `attend_cache`: one numba pass
# per (row, kv head) (split over the rank's numba threads for small steps: `_attend_kernel`) that scores the visible keys of all g query heads of the group while each
# key row is in registers, takes the softmax and sums g value rows at once. No BLAS call, no
# block bookkeeping, no temporary but one (g, S) score buffer, and the cache rows are read in
# place by slot (no gather copy when the step's slots are not consecutive). The blocked path's
# ~10 numpy/BLAS calls per layer cost more than a decode step's arithmetic. Keys are read from
# the cache array itself: numba indexing a strided view of it kept the dot products scalar
# (5-6x slower, measured).


# Note: paged rows (`kv_cache` block-table note). A full-attention layer's cache may be a pool of
# blocks, (1, nkv, blocks x size, hs) (4-D so that the fused decode layer takes either layout), and
# a row's position p lives in pool column table[slot, p // size] * size + p % size. A decode query
# reads its keys and values where they are, block by block through the table (`_attend_one_paged`):
# the same rows of the same values in the same order as a slot row, so a row's numbers are bit for
# bit those of the slot cache (the invariance note). Measured (bench/bench_prefix.py, 16 shared
# prompts, 1 rank): 5.67x against the slot cache's --no-prefix-cache run, where gathering each
# row's blocks into a contiguous scratch at every layer first gave 4.64x.


_NO_TABLE = np.zeros((0, 0), np.int32)  # slot rows: what the kernels below take for ``table``


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _attend_one_paged(q, i, keys, values, trow, size, hi, scale, softcap, sink, srow, y):
    """`_attend_one` (lo = 0) over a paged row: position j's key and value are rows
    trow[j // size] * size + j % size of keys / values (one kv head of the pool: (blocks x size,
    hs) / (.., hv)). The same runs of keys and values as `_attend_one`'s, a block at a time, so the
    bits are the slot cache's (tests/test_paged.py); the keys are read where they are, where a
    gather into a scratch row first copied every visible position of every row at every layer
    (the paged-rows note)."""
    for d in range(y.shape[0]):
        y[d] = 0.0
    if hi <= 0:
        return
    k = _main_cols(keys, keys.shape[1])
    for blk in range((hi + size - 1) // size):
        _score_run(keys, trow[blk] * size, min(size, hi - blk * size), q, i, k, srow, blk * size)
    inv = _softmax_row(srow, hi, scale, softcap, sink)
    for blk in range((hi + size - 1) // size):
        _value_run(srow, blk * size, inv, values, trow[blk] * size, min(size, hi - blk * size), y)


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _attend_group(q, keys, values, trow, size, h0, lo, hi, scale, softcap, sinks, scores, y):
    """One row's kv group: q (nh, hs) heads h0..h0+g-1 over keys/values positions lo..hi-1 into y
    (nh, hv): a slot row's (L, hs) / (L, hv) rows (trow empty), or a paged row's blocks trow of
    the pool's (blocks x size, ..) (lo 0); scores (g, >= hi - lo) is scratch; sinks (nh,) or
    empty: each head's sink logit in its denominator (GPT-OSS)."""
    g = scores.shape[0]
    for i in range(g):
        h = h0 + i
        sink = sinks[h] if sinks.shape[0] > 0 else np.float32(np.nan)
        if trow.shape[0] > 0:
            _attend_one_paged(q, h, keys, values, trow, size, hi, scale, softcap, sink, scores[i], y[h])
        else:
            _attend_one(q, h, keys, values, lo, hi, scale, softcap, sink, scores[i], y[h])


_NO_ROW = np.empty(0, np.int32)  # a slot row's "table row" (`_attend_group`)


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _visible(ck, table, pos, window, b):
    """Row b's visible positions lo..hi-1: a paged row's 0..pos[b] (full attention), a slot row's
    up to column pos[b] (window > 0: its last ``window``)."""
    if table.shape[0] > 0:
        return 0, pos[b] + 1
    lo = max(0, pos[b] - window + 1) if window > 0 else 0
    return lo, min(ck.shape[2], pos[b] + 1)


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _attend_pair(q, ck, cv, table, size, slots, b, kh, lo, hi, scale, softcap, sinks, scores, y):
    """Row b's kv head kh over positions lo..hi-1 (`_attend_group`): slot row slots[b] of ck, cv
    (slots, nkv, L, hs), or with a table (table (0, 0): none) the table's row slots[b] of blocks in
    the pool (1, nkv, blocks x size, hs)."""
    g = scores.shape[0]
    if table.shape[0] > 0:
        _attend_group(q[b], ck[0, kh], cv[0, kh], table[slots[b]], size, kh * g, lo, hi, scale, softcap, sinks,
                      scores, y[b])
    else:
        _attend_group(q[b], ck[slots[b], kh], cv[slots[b], kh], _NO_ROW, size, kh * g, lo, hi, scale, softcap, sinks,
                      scores, y[b])


@numba.njit(cache=True, error_model=ERR)
def _attend_cache(q, ck, cv, table, size, slots, pos, window, scale, softcap, sinks, y):
    """q (B, nh, hs) -> y (B, nh, hs) over the cache (`_attend_pair`; table (0, 0): slot rows
    ``slots``, keys 0..pos[b], window > 0: the last ``window``; else the table's rows ``slots``,
    keys 0..pos[b]); on the calling thread."""
    B, nh, _ = q.shape
    nkv = ck.shape[1]
    S = ck.shape[2]
    if table.shape[0] > 0:
        S = 1
        for b in range(B):
            S = max(S, pos[b] + 1)
    scores = np.empty((nh // nkv, S), np.float32)
    for bk in range(B * nkv):
        b, kh = bk // nkv, bk % nkv
        lo, hi = _visible(ck, table, pos, window, b)
        _attend_pair(q, ck, cv, table, size, slots, b, kh, lo, hi, scale, softcap, sinks, scores, y)


@numba.njit(cache=True, parallel=True, error_model=ERR)
def _attend_cache_par(q, ck, cv, table, size, slots, pos, window, scale, softcap, sinks, y):  # as _attend_cache,
    B, nh, _ = q.shape  # (row, kv head) pairs split over the rank's numba threads
    nkv = ck.shape[1]
    for bk in numba.prange(B * nkv):
        b, kh = bk // nkv, bk % nkv
        lo, hi = _visible(ck, table, pos, window, b)
        scores = np.empty((nh // nkv, max(hi - lo, 1)), np.float32)
        _attend_pair(q, ck, cv, table, size, slots, b, kh, lo, hi, scale, softcap, sinks, scores, y)


def _attend_kernel(rows: int, nkv: int):
    """The decode attention for a step of ``rows`` rows: on numba's pool when the rank has more
    than one thread and the step is small enough that its projections ran there too (at most
    F32_MATVEC_ROWS rows: the numba matvecs, no BLAS), else on the calling thread, since
    numba's pool right after OpenBLAS's made kernels slower (the threads note in _common.py).
    Measured at 2 threads, medium heads, quiet host: 1.5-1.75x faster at S 64-2048, B 1 and 8.
    Note: a MIXED step (7 decode rows beside a 64-token chunk, medium f32, 2 threads) took 577
    ms with its 7 rows' attention on the pool, 390 ms on the calling thread: the pool's spinning
    workers slowed each OpenBLAS product that followed; ``rows`` is the step's token rows."""
    par = pool_threads() > 1 and rows * nkv > 1 and rows <= F32_MATVEC_ROWS
    return _attend_cache_par if par else _attend_cache


@numba.njit(cache=True, error_model=ERR, fastmath=FAST)
def _rope_row(x, c, sn, eps, norm, out):  # one head: out <- rope(rms_norm?(x)); norm empty: none
    hs = x.shape[0]
    half = hs // 2
    normed = norm.shape[0] > 0
    scale = np.float32(1.0)
    if normed:  # Qwen3's per-head RMSNorm, as `_rms_norm` computes it, applied as rope reads x
        acc = 0.0
        for d in range(hs):
            acc += np.float64(x[d]) * x[d]
        scale = np.float32(1.0 / np.sqrt(acc / hs + eps))
    for d in range(half):  # as `_rope`
        a, b = x[d], x[d + half]
        if normed:
            a, b = norm[d] * (a * scale), norm[d + half] * (b * scale)
        out[d] = a * c[d] + (-b) * sn[d]
        out[d + half] = b * c[d + half] + a * sn[d + half]


@numba.njit(cache=True, error_model=ERR)
def _decode_qkv(qkv, q_dim, cos, sin, q_norm, k_norm, eps, ck, cv, table, size, slots, positions, q):
    """Per row: rope (after the optional per-head norms) into q (B, nh, hs) and into the cache,
    v as is: slot rows (table (0, 0)) at column positions % L of row slots[b]; a paged cache (1,
    nkv, blocks x size, hs) at column table[slots[b], p // size] * size + p % size (the paged-rows
    note)."""
    B = qkv.shape[0]
    nh, hs = q.shape[1], q.shape[2]
    nkv, L = ck.shape[1], ck.shape[2]
    for b in range(B):
        p = positions[b]
        if table.shape[0] > 0:
            row, col = 0, table[slots[b], p // size] * size + p % size
        else:
            row, col = slots[b], p % L
        for h in range(nh):
            _rope_row(qkv[b, h * hs:(h + 1) * hs], cos[b], sin[b], eps, q_norm, q[b, h])
        for kh in range(nkv):
            k0 = q_dim + kh * hs
            v0 = q_dim + (nkv + kh) * hs
            _rope_row(qkv[b, k0:k0 + hs], cos[b], sin[b], eps, k_norm, ck[row, kh, col])
            cv[row, kh, col, :] = qkv[b, v0:v0 + hs]


def check_cache_rows(slots, positions, rows: int, n_slots: int, where: str,
                     max_positions: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """slots and positions as 1-D int64 arrays of ``rows`` entries, each slot in 0..n_slots-1 and
    each position >= 0 (and < ``max_positions`` when given: a block table's reach); ValueError
    naming ``where`` otherwise."""
    slots, positions = np.asarray(slots, np.int64).reshape(-1), np.asarray(positions, np.int64).reshape(-1)
    top = max_positions if max_positions is not None else np.iinfo(np.int64).max
    if slots.shape != (rows,) or positions.shape != (rows,) or (rows and (
            slots.min() < 0 or slots.max() >= n_slots or positions.min() < 0 or positions.max() >= top)):
        raise ValueError(f"{where}: slots {slots.tolist()} must lie in 0..{n_slots - 1} and "
                         f"positions {positions.tolist()} be >= 0" + (f" and < {top}" if max_positions is not None
                                                                      else "") + f", one each per row ({rows})")
    return slots, positions


def decode_attention(qkv: np.ndarray, q_dim: int, cos: np.ndarray, sin: np.ndarray, cache_k: np.ndarray,
                     cache_v: np.ndarray, slots: np.ndarray, positions: np.ndarray, *,
                     q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None, eps: float = 1e-6,
                     scale: float | None = None, softcap: float = 0.0, rows_checked: bool = False,
                     step_rows: int | None = None, sinks: np.ndarray | None = None,
                     table: np.ndarray | None = None, size: int = 0) -> np.ndarray:
    """A decode step's attention from the fused q|k|v projection, in two numba passes.

    qkv (B, q_dim + 2 * kv_dim): one new token per row (bias already added); cos, sin (B, hs) at
    each row's position; cache_k, cache_v (slots, nkv, L, hs). Applies the optional per-head
    RMSNorms (``q_norm``, ``k_norm`` (hs,), Qwen3) and RoPE to q and k, writes k and v into
    column ``positions[b] % L`` of cache row ``slots[b]`` (a ring when L is a window: see
    `kv_cache.decode_store`), then attends as `attend_cache` over columns 0..min(p, L - 1).
    Returns y (B, nh * hs), o_proj's input. The same values as rope + `decode_store` +
    `attend_cache` in numpy, without their ~25 array operations per layer. ``rows_checked``:
    slots and positions are what `check_cache_rows` returned (a step checks them once, not per
    layer: the reductions cost more than a small layer's attention). ``step_rows``: the token rows
    the step's projections took (default B; more in a MIXED step, whose prefill chunk rides
    along), which picks the attention's threads (`_attend_kernel`). ``sinks`` (nh,): as `attend`.
    ``table`` (rows, max blocks) int32 and ``size``: a paged cache (the paged-rows note), cache_k and
    cache_v (1, nkv, blocks x size, hs), ``slots`` the table's rows; full attention only.
    """
    check_f32("decode_attention qkv", qkv)
    check_f32("decode_attention cache_k", cache_k)
    check_f32("decode_attention cache_v", cache_v)
    B, width = qkv.shape
    nkv, L, hs = cache_k.shape[1:]
    nh = q_dim // hs
    if (cache_v.shape != cache_k.shape or q_dim % hs or width != q_dim + 2 * nkv * hs or nh % nkv
            or cos.shape != (B, hs) or sin.shape != (B, hs)):
        raise ValueError(f"decode_attention: qkv {qkv.shape} (q_dim {q_dim}), cache {cache_k.shape} / "
                         f"{cache_v.shape} and cos/sin {cos.shape} / {sin.shape} do not fit")
    if table is not None:
        _check_table(table, size, cache_k, "decode_attention")
    if not rows_checked:
        slots, positions = check_cache_rows(slots, positions, B, cache_k.shape[0] if table is None else table.shape[0],
                                            "decode_attention", None if table is None else table.shape[1] * size)
    none = np.empty(0, np.float32)
    q = np.empty((B, nh, hs), np.float32)
    cos, sin = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
    q_norm, k_norm = none if q_norm is None else q_norm, none if k_norm is None else k_norm
    y = np.empty((B, nh, hs), np.float32)
    scale, softcap = np.float32(hs ** -0.5 if scale is None else scale), np.float32(softcap)
    rows = B if step_rows is None else step_rows
    tbl = _NO_TABLE if table is None else table
    _decode_qkv(qkv, q_dim, cos, sin, q_norm, k_norm, np.float32(eps), cache_k, cache_v, tbl, size, slots, positions, q)
    last = np.minimum(positions, L - 1) if table is None else positions  # (slot rows: a ring's columns)
    _attend_kernel(rows, nkv)(q, cache_k, cache_v, tbl, size, slots, last, 0, scale, softcap,
                              _sinks(sinks, nh, "decode_attention"), y)
    return y.reshape(B, nh * hs)


def _check_table(table: np.ndarray, size: int, cache_k: np.ndarray, where: str) -> None:
    """A block table as the paged kernels take it: (rows, max blocks) int32 C-contiguous, ids in the pool."""
    if (not isinstance(table, np.ndarray) or table.dtype != np.int32 or table.ndim != 2 or not table.flags.c_contiguous
            or size < 1 or cache_k.shape[0] != 1 or cache_k.shape[2] % size
            or (table.size and (table.min() < 0 or table.max() >= cache_k.shape[2] // size))):
        raise ValueError(f"{where}: a block table must be (rows, blocks) int32 C-contiguous with ids in "
                         f"0..{cache_k.shape[2] // max(size, 1) - 1} of a pool (1, nkv, blocks x {size}, hs); got "
                         f"{getattr(table, 'dtype', type(table))} {getattr(table, 'shape', '')}, pool {cache_k.shape}")


def attend_cache(q: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray, slots: np.ndarray,
                 q_pos: np.ndarray, window: int = 0, *, scale: float | None = None,
                 softcap: float = 0.0, sinks: np.ndarray | None = None, table: np.ndarray | None = None,
                 size: int = 0) -> np.ndarray:
    """One decode step's attention, read in place from a KV cache (see the decode note).

    q (B, nh, 1, hs): one query per head of each row; cache_k, cache_v (slots, nkv, L, hs)
    C-contiguous float32; row b reads cache row ``slots[b]``, keys 0..q_pos[b] (with
    ``window > 0`` only the last ``window`` of them). ``scale`` and ``softcap`` as `attend`.
    Returns y (B, 1, nh, hs) float32 C-contiguous, as `attend` does for T = 1. ``table`` and
    ``size``: a paged cache, as `decode_attention` takes it (no window).
    """
    B, nh, T, hs = q.shape
    if T != 1 or cache_k.ndim != 4 or cache_v.shape != cache_k.shape or cache_k.shape[3] != hs \
            or nh % cache_k.shape[1]:
        raise ValueError(f"attend_cache: q {q.shape}, cache {cache_k.shape} / {cache_v.shape} do not fit "
                         "(B, nh, 1, hs) / (slots, nkv, L, hs) with nh a multiple of nkv")
    check_f32("attend_cache cache_k", cache_k)
    check_f32("attend_cache cache_v", cache_v)
    y = np.empty((B, 1, nh, hs), np.float32)
    rows, reach = cache_k.shape[0], None
    if table is not None:
        _check_table(table, size, cache_k, "attend_cache")
        if window > 0:
            raise ValueError("attend_cache: a paged cache holds full-attention layers only (window 0)")
        rows, reach = table.shape[0], table.shape[1] * size
    slots, pos = check_cache_rows(slots, q_pos, B, rows, "attend_cache", reach)
    _attend_kernel(B, cache_k.shape[1])(
        np.ascontiguousarray(q, dtype=np.float32).reshape(B, nh, hs), cache_k, cache_v,
        _NO_TABLE if table is None else table, size, slots, pos, int(max(window, 0)),
        np.float32(hs ** -0.5 if scale is None else scale), np.float32(softcap), _sinks(sinks, nh, "attend_cache"),
        y.reshape(B, nh, hs))
    return y
