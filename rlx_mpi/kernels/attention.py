"""Blocked scaled dot-product attention (grouped-query, causal or windowed, online softmax).

BLAS does the two products of a block; the numba kernels here do masking, exponentials and
bookkeeping, serial on the calling thread (threads note in _common.py); a prefill's kv heads go to
the rank's threads in parts (`run_parts`, the team note there). `causal_softmax_` is a
plain reference softmax for tests and benches, compiled on first use only.
"""

from __future__ import annotations

import numba
import numpy as np

from ._common import ERR, FAST, PARALLEL, check_f32, pool_threads, run_parts, team_size
from .matvec import F32_MATVEC_ROWS
from .bits import as_f32
from .elementwise import _exp

__all__ = ["attend", "attend_cache", "decode_attention", "check_cache_rows", "attend_workspace_bytes", "causal_softmax_"]


# Note: blocked attention. `attend` never holds a (B, nh, T, S) score matrix: queries go in
# blocks of `_Q_BLOCK` rows per head and keys in blocks of `_K_BLOCK`, with an online softmax
# (running row max m, running sum l, the output accumulator rescaled by exp(m_old - m_new) when
# the max grows), so the working set is O(block x block) per head however long the sequence.
# BLAS does the two products of a block (q @ k.T, p @ v: most of the FLOPs); numba does the
# masking, exponentials and bookkeeping in one pass over the block's scores. Key blocks wholly
# in a query block's causal future (or before its window) are skipped (close to half
# the FLOPs of a long causal prefill). A decode step (one query per head) takes the same path: measured at S = 512
# to 4096, it beat both a numba pass per (b, head) (2-4x: strided K/V views do not vectorise)
# and one key block spanning the whole cache (3x at 4096).
_Q_BLOCK = 64  # queries per head per block: g * 64 rows per GEMM under grouped-query
_TEAM_WORK = 16384  # queries x keys from which `attend` splits its kv heads over the rank's threads
# (run_parts, the team note in _common.py). Measured at 2 threads, medium heads, team / one thread
# with BLAS's 2: T x S = 2 x 64 0.16x, 4 x 512 0.86x, 8 x 1024 1.04x, 16 x 256 0.90x, 32 x 2048
# 1.39x, 128 x 128 1.04-2.3x (one thread's small GEMMs on 2 BLAS threads vary), 512 x 512 1.43x,
# 1024^2 1.71x, 2048^2 1.64x; outputs identical.
_K_BLOCK = 1024  # keys per block: a block's scores are B * nh * 64 * 1024 * 4 B (4 MB at B nh = 16)
# Measured (bench/bench_kernels.py, medium heads, medium shapes, 1 and 2 threads): 64-query
# blocks beat 512 by 1.4-1.8x at seq 512 and 1.1-1.5x at 128-2048, since a query block only
# multiplies the keys up to its own position (the causal triangle in 64-row steps, not
# 512); 16-32 rows are slower again (BLAS calls too small). Was 512 before the exp kernel
# made the numba pass cheap.


@numba.njit(cache=True)
def _row_max(row):  # max of a non-empty C-contiguous float32 row
    # as integers: LLVM vectorises an int max but not a float one (that needs function-wide
    # no-NaN attributes). The map flips a negative float's magnitude bits, so float order is
    # int order (-0 < +0; NaN beyond Inf: a NaN score stays NaN) and is its own inverse.
    bits = row.view(np.int32)
    best = np.int32(-2147483648)
    for j in range(bits.shape[0]):
        b = bits[j]
        k = b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))
        best = k if k > best else best
    return as_f32(np.uint32(best ^ ((best >> np.int32(31)) & np.int32(0x7FFFFFFF))))


@numba.njit(cache=True, error_model=ERR, fastmath=FAST)
def _exp_row(row, scale, peak):  # row <- exp(row * scale - peak); returns the sum (SIMD lanes)
    total = np.float32(0.0)
    for j in range(row.shape[0]):
        e = _exp(row[j] * scale - peak)
        row[j] = e
        total += e
    return total


@numba.njit(cache=True, parallel=PARALLEL, error_model=ERR, fastmath=FAST, nogil=True)
def _online_block(s, pos, j0, window, scale, m, l, acc):  # s (B, H, bq, bk) scores -> probs
    """Mask, scale and exponentiate one key block in place; update m, l and rescale acc.

    m holds each query's running max of the scaled scores. Each loop is branch-free so LLVM
    vectorises it (reassoc: the row sum in SIMD lanes)."""
    B, H, bq, bk = s.shape
    for bh in numba.prange(B * H):
        b, h = bh // H, bh % H
        for i in range(bq):
            p = pos[b, i]
            lo = max(0, p - window + 1 - j0) if window > 0 else 0  # visible: lo <= j - j0 < hi
            hi = max(lo, min(bk, p + 1 - j0))
            row = s[b, h, i]
            old = m[b, h, i]
            peak = old
            if hi > lo:
                top = _row_max(row[lo:hi]) * scale  # scale > 0; NaN if any visible score is NaN
                peak = old if old > top else top  # (not max(): that drops a NaN, and the row with it)
            if peak == -np.inf:  # nothing visible yet for this query
                row[:] = 0.0
                continue
            total = _exp_row(row[lo:hi], scale, peak)  # (a slice: with bounds
            # inside, LLVM was seen to leave the loop scalar, 4x slower)
            row[:lo] = 0.0
            row[hi:] = 0.0
            if peak != old:  # the max grew: earlier blocks' terms shrink by alpha
                alpha = _exp(old - peak) if old != -np.inf else np.float32(0.0)
                l[b, h, i] *= alpha
                a = acc[b, h, i]
                for d in range(a.shape[0]):
                    a[d] *= alpha
                m[b, h, i] = peak
            l[b, h, i] += total


@numba.njit(cache=True, parallel=PARALLEL, error_model=ERR, nogil=True)
def _finish(acc, l, m, sinks, y, t0, h0):  # acc (B, H, bq, hv) / l -> y[:, t0:t0+bq, h0:h0+H] of y (B, T, nh, hv)
    B, H, bq, hs = acc.shape
    sunk = sinks.shape[0] > 0  # GPT-OSS: head h0+h's sink logit joins each denominator (no value)
    for bh in numba.prange(B * H):
        b, h = bh // H, bh % H
        for i in range(bq):
            total = l[b, h, i]
            if sunk and total > 0:  # l is relative to the running max m (scaled scores, as the sink)
                total += np.exp(sinks[h0 + h] - m[b, h, i])
            inv = np.float32(1.0) / total if total > 0 else np.float32(0.0)
            for d in range(hs):
                y[b, t0 + i, h0 + h, d] = acc[b, h, i, d] * inv


# Note: decode. One query per head (T = 1) over a cache takes `attend_cache`: one numba pass
# per (row, kv head) (split over the rank's numba threads for small steps: `_attend_kernel`) that scores the visible keys of all g query heads of the group while each
# key row is in registers, takes the softmax and sums g value rows at once. No BLAS call, no
# block bookkeeping, no temporary but one (g, S) score buffer, and the cache rows are read in
# place by slot (no gather copy when the step's slots are not consecutive). The blocked path's
# ~10 numpy/BLAS calls per layer cost more than a decode step's arithmetic. Keys are read from
# the cache array itself: numba indexing a strided view of it kept the dot products scalar
# (5-6x slower, measured).


@numba.njit(cache=True, error_model=ERR, fastmath=FAST)
def _attend_group(q, keys, values, h0, lo, hi, scale, softcap, sinks, scores, y):
    """One row's kv group: q (nh, hs) heads h0..h0+g-1 over keys/values (L, hs) columns lo..hi-1
    into y (nh, hs); scores (g, >= hi - lo) is scratch; sinks (nh,) or empty: each head's sink
    logit in its denominator (GPT-OSS)."""
    g, hs = scores.shape[0], q.shape[1]
    for j in range(lo, hi):  # each key row once for the g query heads that read it
        for i in range(g):  # (2-D indexing, no row views: a view per key costs a refcount)
            acc = np.float32(0.0)
            for d in range(hs):
                acc += q[h0 + i, d] * keys[j, d]
            scores[i, j - lo] = acc * scale
    for i in range(g):
        h = h0 + i
        for d in range(hs):
            y[h, d] = 0.0
        if hi <= lo:  # nothing visible: zeros, as `attend` gives
            continue
        row = scores[i, :hi - lo]
        if softcap > 0:  # cap * tanh(s / cap), the scale already applied (transformers' order)
            for j in range(row.shape[0]):
                row[j] = softcap * np.tanh(row[j] / softcap)
        peak = _row_max(row)
        total = _exp_row(row, np.float32(1.0), peak)
        if sinks.shape[0] > 0:
            total += np.exp(sinks[h] - peak)
        inv = np.float32(1.0) / total
        for j in range(lo, hi):
            pj = scores[i, j - lo] * inv
            for d in range(hs):
                y[h, d] += pj * values[j, d]


@numba.njit(cache=True, error_model=ERR)
def _attend_cache(q, ck, cv, slots, pos, window, scale, softcap, sinks, y):
    """q (B, nh, hs) -> y (B, nh, hs) over ck, cv (slots, nkv, L, hs) rows ``slots``, keys
    0..pos[b] (window > 0: pos[b] - window + 1..pos[b]); on the calling thread."""
    B, nh, _ = q.shape
    nkv = ck.shape[1]
    scores = np.empty((nh // nkv, ck.shape[2]), np.float32)
    for bk in range(B * nkv):
        b, kh = bk // nkv, bk % nkv
        lo = max(0, pos[b] - window + 1) if window > 0 else 0
        hi = min(ck.shape[2], pos[b] + 1)
        _attend_group(q[b], ck[slots[b], kh], cv[slots[b], kh], kh * (nh // nkv), lo, hi, scale, softcap, sinks,
                      scores, y[b])


@numba.njit(cache=True, parallel=True, error_model=ERR)
def _attend_cache_par(q, ck, cv, slots, pos, window, scale, softcap, sinks, y):  # as _attend_cache, (row, kv head)
    B, nh, _ = q.shape  # pairs split over the rank's numba threads
    nkv = ck.shape[1]
    for bk in numba.prange(B * nkv):
        b, kh = bk // nkv, bk % nkv
        lo = max(0, pos[b] - window + 1) if window > 0 else 0
        hi = min(ck.shape[2], pos[b] + 1)
        scores = np.empty((nh // nkv, max(hi - lo, 1)), np.float32)
        _attend_group(q[b], ck[slots[b], kh], cv[slots[b], kh], kh * (nh // nkv), lo, hi, scale, softcap, sinks,
                      scores, y[b])


def _attend_kernel(rows: int, nkv: int):
    """The decode attention for a step of ``rows`` rows: on numba's pool when the rank has more
    than one thread and the step is small enough that its projections ran there too (at most
    F32_MATVEC_ROWS rows: the numba matvecs, no BLAS), else on the calling thread, since
    numba's pool right after OpenBLAS's made kernels slower (the threads note in _common.py).
    Measured at 2 threads, medium heads, quiet host: 1.5-1.75x faster at S 64-2048, B 1 and 8.
    Note: a MIXED step (7 decode rows beside a 64-token chunk, medium f32, 2 threads) took 577
    ms with its 7 rows' attention on the pool, 390 ms on the calling thread: the pool's spinning
    workers slowed each OpenBLAS product that followed; ``rows`` is the step's token rows."""
    return _attend_cache_par if pool_threads() > 1 and rows * nkv > 1 and rows <= F32_MATVEC_ROWS else _attend_cache


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
def _decode_qkv(qkv, q_dim, cos, sin, q_norm, k_norm, eps, ck, cv, slots, positions, q):
    """Per row: rope (after the optional per-head norms) into q (B, nh, hs) and into the
    cache's column positions % L of row slots[b], v as is."""
    B = qkv.shape[0]
    nh, hs = q.shape[1], q.shape[2]
    nkv, L = ck.shape[1], ck.shape[2]
    for b in range(B):
        col, slot = positions[b] % L, slots[b]
        for h in range(nh):
            _rope_row(qkv[b, h * hs:(h + 1) * hs], cos[b], sin[b], eps, q_norm, q[b, h])
        for kh in range(nkv):
            k0 = q_dim + kh * hs
            v0 = q_dim + (nkv + kh) * hs
            _rope_row(qkv[b, k0:k0 + hs], cos[b], sin[b], eps, k_norm, ck[slot, kh, col])
            cv[slot, kh, col, :] = qkv[b, v0:v0 + hs]


def check_cache_rows(slots, positions, rows: int, n_slots: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """slots and positions as 1-D int64 arrays of ``rows`` entries, each slot in 0..n_slots-1 and
    each position >= 0; ValueError naming ``where`` otherwise."""
    slots, positions = np.asarray(slots, np.int64).reshape(-1), np.asarray(positions, np.int64).reshape(-1)
    if slots.shape != (rows,) or positions.shape != (rows,) or (rows and (
            slots.min() < 0 or slots.max() >= n_slots or positions.min() < 0)):
        raise ValueError(f"{where}: slots {slots.tolist()} must lie in 0..{n_slots - 1} and "
                         f"positions {positions.tolist()} be >= 0, one each per row ({rows})")
    return slots, positions


def decode_attention(qkv: np.ndarray, q_dim: int, cos: np.ndarray, sin: np.ndarray, cache_k: np.ndarray,
                     cache_v: np.ndarray, slots: np.ndarray, positions: np.ndarray, *,
                     q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None, eps: float = 1e-6,
                     scale: float | None = None, softcap: float = 0.0, rows_checked: bool = False,
                     step_rows: int | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
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
    if not rows_checked:
        slots, positions = check_cache_rows(slots, positions, B, cache_k.shape[0], "decode_attention")
    none = np.empty(0, np.float32)
    q = np.empty((B, nh, hs), np.float32)
    _decode_qkv(qkv, q_dim, np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32),
                none if q_norm is None else q_norm, none if k_norm is None else k_norm, np.float32(eps),
                cache_k, cache_v, slots, positions, q)
    y = np.empty((B, nh, hs), np.float32)
    _attend_kernel(B if step_rows is None else step_rows, nkv)(q, cache_k, cache_v, slots, np.minimum(positions, L - 1), 0,
                  np.float32(hs ** -0.5 if scale is None else scale), np.float32(softcap),
                  _sinks(sinks, nh, "decode_attention"), y)
    return y.reshape(B, nh * hs)


def attend_cache(q: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray, slots: np.ndarray,
                 q_pos: np.ndarray, window: int = 0, *, scale: float | None = None,
                 softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
    """One decode step's attention, read in place from a KV cache (see the decode note).

    q (B, nh, 1, hs): one query per head of each row; cache_k, cache_v (slots, nkv, L, hs)
    C-contiguous float32; row b reads cache row ``slots[b]``, keys 0..q_pos[b] (with
    ``window > 0`` only the last ``window`` of them). ``scale`` and ``softcap`` as `attend`.
    Returns y (B, 1, nh, hs) float32 C-contiguous, as `attend` does for T = 1.
    """
    B, nh, T, hs = q.shape
    if T != 1 or cache_k.ndim != 4 or cache_v.shape != cache_k.shape or cache_k.shape[3] != hs \
            or nh % cache_k.shape[1]:
        raise ValueError(f"attend_cache: q {q.shape}, cache {cache_k.shape} / {cache_v.shape} do not fit "
                         "(B, nh, 1, hs) / (slots, nkv, L, hs) with nh a multiple of nkv")
    check_f32("attend_cache cache_k", cache_k)
    check_f32("attend_cache cache_v", cache_v)
    slots, pos = check_cache_rows(slots, q_pos, B, cache_k.shape[0], "attend_cache")
    y = np.empty((B, 1, nh, hs), np.float32)
    kernel = _attend_kernel(B, cache_k.shape[1])
    kernel(np.ascontiguousarray(q, dtype=np.float32).reshape(B, nh, hs), cache_k, cache_v, slots, pos,
           int(max(window, 0)), np.float32(hs ** -0.5 if scale is None else scale), np.float32(softcap),
           _sinks(sinks, nh, "attend_cache"), y.reshape(B, nh, hs))
    return y


def _positions(q_pos, B: int, T: int, S: int) -> np.ndarray:
    if q_pos is None:
        return np.broadcast_to(np.arange(S - T, S, dtype=np.int64), (B, T))
    q_pos = np.asarray(q_pos)
    if q_pos.shape != (B, T) or not np.issubdtype(q_pos.dtype, np.integer):
        raise ValueError(f"attend: q_pos must be an integer array of shape {(B, T)}, got "
                         f"{q_pos.dtype} {q_pos.shape}")
    if q_pos.size and q_pos.min() < 0:
        raise ValueError(f"attend: q_pos has a negative position ({q_pos.min()}); positions start at 0")
    return q_pos.astype(np.int64, copy=False)


def _sinks(sinks, nh: int, where: str) -> np.ndarray:
    """The sink logits as the kernels take them: (nh,) float32, or empty for none."""
    if sinks is None:
        return _NO_SINKS
    sinks = np.ascontiguousarray(sinks, np.float32)
    if sinks.shape != (nh,):
        raise ValueError(f"{where}: sinks has shape {sinks.shape}, expected ({nh},): one logit per query head")
    return sinks


_NO_SINKS = np.empty(0, np.float32)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray | None = None,
           window: int = 0, *, scale: float | None = None, softcap: float = 0.0,
           sinks: np.ndarray | None = None) -> np.ndarray:
    """Scaled dot-product attention of ``q`` over the keys ``k``/values ``v`` (grouped-query).

    q (B, nh, T, hs); k, v (B, nkv, S, hs) with nh a multiple of nkv (query head h reads kv
    head h // (nh // nkv)); key j sits at position j (k, v may be a prefix view of a cache).
    q_pos (B, T) int: the position of each query; key j is visible to query (b, t) when
    ``j <= q_pos[b, t]`` and, with ``window > 0``, ``j > q_pos[b, t] - window``. None means
    the last T positions of every sequence (q_pos[b, t] = S - T + t: plain causal prefill,
    or a decode step). A query that sees no key gets zeros. Returns y (B, T, nh, hs) float32,
    C-contiguous, so that ``y.reshape(B, T, nh * hs)`` feeds o_proj without a copy.
    Computed in blocks (see the note above): memory O(block^2) per head, not O(T * S).
    ``scale`` multiplies the scores (default hs ** -0.5); ``softcap > 0`` then maps each
    scaled score s to softcap * tanh(s / softcap) (Gemma 2). ``sinks`` (nh,): a logit per query
    head that joins every softmax denominator of the head and carries no value (GPT-OSS's
    attention sinks: softmax over [scores, sink], the sink's share dropped). v may be narrower or
    wider than q and k (B, nkv, S, hv): y is then (B, T, nh, hv) (MLA's value heads).
    """
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    if k.shape != (B, nkv, S, hs) or v.ndim != 4 or v.shape[:3] != k.shape[:3] or nh % nkv:
        raise ValueError(f"attend: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                         "(B, nh, T, hs) / (B, nkv, S, hs) / (B, nkv, S, hv) with nh a multiple of nkv")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.dtype != np.float32:
            raise TypeError(f"attend: {name} is {a.dtype}; pass float32 (a.astype(np.float32))")
    pos = _positions(q_pos, B, T, S)
    window, scale = int(max(window, 0)), np.float32(hs ** -0.5 if scale is None else scale)
    y = np.empty((B, T, nh, v.shape[3]), np.float32)
    sinks = _sinks(sinks, nh, "attend")
    g = nh // nkv
    n = team_size(nkv if T * S >= _TEAM_WORK else 1)  # kv heads over the rank's threads (the team note)
    cuts = [nkv * i // n for i in range(n + 1)]
    run_parts(_heads, [(q[:, g * a:g * b], k[:, a:b], v[:, a:b], pos, window, scale, y, g * a, np.float32(softcap),
                        sinks) for a, b in zip(cuts, cuts[1:])])
    return y


def _heads(q, k, v, pos, window, scale, y, h0, softcap, sinks) -> None:
    """The query blocks of some kv heads' groups: q (B, g * n, T, hs), k, v (B, n, S, hs) into
    y[:, :, h0:h0 + g * n]."""
    for t0 in range(0, q.shape[2], _Q_BLOCK):
        t1 = min(q.shape[2], t0 + _Q_BLOCK)
        _query_block(q[:, :, t0:t1], k, v, np.array(pos[:, t0:t1], order="C"), window, scale, y, t0, h0,
                     softcap, sinks)  # (a copy:
        # always writable, so numba sees one type; a read-only view made a second compile mid-forward)


def attend_workspace_bytes(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Bytes `attend` holds besides its inputs and output: one block's scores, the query-block
    copy, the accumulator and the running max/sum (the planner's estimate; O(seq^0) per head)."""
    bq, bk = min(seq, _Q_BLOCK), min(seq, _K_BLOCK)
    return batch * heads * bq * (bk + 2 * head_dim + 2) * 4


def _query_block(q, k, v, pos, window, scale, y, t0, h0, softcap, sinks) -> None:
    """One block of queries (B, nh, bq, hs) over the key blocks it can see, into y[:, t0:, h0:]."""
    B, nh, bq, hs = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    lo = max(0, int(pos.min()) - window + 1) if window > 0 else 0  # keys any query here sees
    hi = min(k.shape[2], int(pos.max()) + 1)
    qb = np.ascontiguousarray(q).reshape(B, nkv, g * bq, hs)  # g heads of a kv head: one GEMM
    m = np.full((B, nh, bq), -np.inf, np.float32)
    l = np.zeros((B, nh, bq), np.float32)
    acc = np.zeros((B, nh, bq, v.shape[3]), np.float32)
    acc_g = acc.reshape(B, nkv, g * bq, v.shape[3])
    for j0 in range(lo - lo % _K_BLOCK, hi, _K_BLOCK):
        j1 = min(hi, j0 + _K_BLOCK)
        s = qb @ k[:, :, j0:j1].transpose(0, 1, 3, 2)  # (B, nkv, g*bq, bk)
        if softcap > 0:  # cap * tanh(s * scale / cap) in transformers' order; then already scaled
            np.multiply(s, scale, out=s)
            np.multiply(np.tanh(np.divide(s, softcap, out=s), out=s), softcap, out=s)
        _online_block(s.reshape(B, nh, bq, j1 - j0), pos, j0, window,
                      np.float32(1.0) if softcap > 0 else scale, m, l, acc)
        acc_g += s @ v[:, :, j0:j1]  # (B, nkv, g*bq, hs)
        del s  # before the next block's scores are allocated: one block alive at a time
    _finish(acc, l, m, sinks, y, t0, h0)


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


def causal_softmax_(scores: np.ndarray, offset: int = 0) -> np.ndarray:
    """Softmax over the last axis with a causal mask, in place: query t sees keys <= t + offset."""
    check_f32("causal_softmax_", scores)
    if not scores.flags.writeable:
        raise ValueError("causal_softmax_: scores is read-only; pass a writable array")
    _causal_softmax(scores.reshape(-1, scores.shape[-2], scores.shape[-1]), offset)
    return scores

