"""Scaled dot-product attention (grouped-query, causal or windowed, soft-cap, sinks), each query in
one fixed order (the invariance note): one query's arithmetic (`_attend_one`, its runs of a row's
keys read in place shared with a paged row's) and a prefill chunk's (`attend`: WIDE_ROWS queries at a
time, the block note). A decode step read in place from a KV cache is attention_cache.py's
(`attend_cache`, `decode_attention`), on the same runs.

A prefill's kv heads go to the rank's threads in parts (`run_parts`, the team note in
_common.py). `causal_softmax_` is a plain reference softmax for tests and benches, compiled on
first use only.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .blocks import _gather_run
from ._common import ERR, check_f32, run_parts, team_size
from .matvec import _main_cols, _tail, _tile_stub
from .llvm_ir import FLANES, rows_of
from .rowdot import TILE_W, WIDE_ROWS
from .bits import as_f32, bits_of_f32
from .elementwise import _exp

__all__ = ["attend", "attend_workspace_bytes", "causal_softmax_"]


_TEAM_WORK = 16384  # queries x keys from which `attend` splits its kv heads over the rank's threads
# (run_parts, the team note in _common.py; measured with the blocked BLAS attention before the
# invariance note: 2 threads, medium heads, 128 x 128 1.04-2.3x, 512 x 512 1.43x, 1024^2 1.71x)


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


# Note: invariance. A query's attention has one arithmetic, `_attend_one`'s, whatever the step: a
# decode row alone or beside others, on the calling thread or the pool, inside the fused decode
# layer or not, its cache a slot row or a paged row's blocks; a prefill query in a chunk of 16 or of
# 256, beside padded rows or not, run or score or generate. Decode runs `_attend_one` itself (a paged
# row the same runs of keys a block at a time: attention_cache.py); prefill runs `_attend_block`,
# the same operations for WIDE_ROWS queries at once (the block note). Each score is rowdot's float
# tile over hs (one order: the invariance note there), the softmax's sum and the value sums run
# over the keys in position order, one float32 rounding at a time (no fast-math here, so LLVM
# cannot reorder them whatever it inlines into), and the values are summed lane-wise over the
# head's width (independent lanes: vectorised without reordering). Before, prefill took BLAS's
# blocked products and an online softmax whose rounding depended on the chunk (its query blocks,
# the key block's length) and decode a fast-math loop: a row's logits depended on the batch and the
# prefill chunk it shared.
#
# Note: float32. `_attend_one` started its running max at ``-np.inf``, a float64: numba then typed
# the peak, `_exp`'s argument, the softmax's sum and each p_j as float64, so the value sums were
# taken in float64 and rounded to float32 at every key (scalar float64 exp, 8-lane double vectors).
# Now every step is float32 (the peak starts at float32 -inf; the sink's term is `_exp`, not libm's
# exp, whose bits may vary between hosts' libms). Rows changed by float32 rounding (test_kernels.py's
# bounds against float64 hold); decode and prefill still give one query the same bits.
#
# Note: the block. Prefill attends WIDE_ROWS (6 on AVX-512, 3 on AVX2) consecutive queries of a head
# at once, each through `_attend_one`'s operations in its order: the scores by the wide tile
# (WIDE_ROWS queries x TILE_W keys: each key vector loaded once feeds every query, the same chain of
# fused multiply-adds and lane tree per score), over the keys some query sees (scores of keys a
# query does not see are computed and never read); each query's scaled scores, peak and exp(s -
# peak) in element-wise loops that vectorise (`_exp` is our polynomial: the same bits in a vector
# lane as in a scalar; the peak an integer max: equal to the serial max but for the sign of a zero,
# which exp(s - peak) does not see); the serial softmax sums of the block's queries interleaved
# (`_sums_block`: each still one add at a time in key order); the value sums with the block's
# accumulators in registers across the keys (`_values_block`: a multiply then an add per key, as
# `_attend_one`); a key only some queries see (the causal triangle, a window's first keys) goes
# through each query alone, before or after the keys all of them see, so every sum keeps key order.
# A block whose sums hold a NaN is redone one query at a time (NaN bits as `_attend_one`'s); the
# last T % WIDE_ROWS queries of a head take `_attend_one`. tests/test_attention.py checks the bits.
# Measured (bench/bench_attention.py, medium heads 16 / 8 x 64, 1 thread, one process, alternating
# rounds, minima; a 2-core AVX-512 Xeon shared with other jobs, load 2-8: ratios, not figures):
# against the one-query kernel it replaces (float64 softmax), prefill 128 tokens 7.0x, 512 tokens
# 4.2x (the lead's profile: 0.89 s of a 512-token medium prefill); thread CPU time of a 512-token
# call 52 -> 13 ms (x 16 layers: 0.84 -> 0.21 s); decode (float32 now) 1.3-1.4x at batch 1, 1.1-1.3x
# at batch 8. Against the blocked BLAS attention before the invariance note (e304325): prefill 128
# 0.86x, 512 1.19x (wall, load 6-8); thread CPU time at 512 11 vs 13 ms (0.86x). By phase, a 512-token
# call at 1 thread (thread CPU time): scores 3.1 ms, softmax 2.5, value sums 2.5, the rest (per-block
# setup, the last queries, copies) ~4. Tried and dropped: the scores from the keys transposed (lanes
# = 16 keys, rowdot's lane tree as adds of whole vectors, the same bits) 0.83x (6 queries a call:
# registers spill) and 1.01x (3) at 512 tokens, 0.94-0.95x at 128, against the wide tile.


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _softmax_row(srow, n, scale, softcap, sink):
    """A query's softmax over its n scores in srow, in place and unnormalised: srow[j] <-
    exp(capped(srow[j] * scale) - peak); returns 1 / (their sum in key order + the sink's share)."""
    peak = np.float32(-np.inf)  # (float32: a float64 -inf made the softmax and value sums float64: the float32 note)
    for j in range(n):
        v = srow[j] * scale
        if softcap > 0:  # cap * tanh(s / cap), the scale already applied (transformers' order)
            v = softcap * np.tanh(v / softcap)
        srow[j] = v
        peak = v if v > peak or v != v else peak  # (a NaN wins and stays)
    total = np.float32(0.0)
    for j in range(n):
        e = _exp(srow[j] - peak)
        srow[j] = e
        total += e
    if sink == sink:
        total += _exp(sink - peak)
    return np.float32(1.0) / total


_score_tile = _tile_stub(1, TILE_W)  # TILE_W keys against one query: a query's scores (the invariance note)
_score_tile1 = _tile_stub(1, 1)


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _score_tail(keys, j, q, i, k0):  # keys[j, k0:] . q[i, k0:], one column at a time (matvec's `_tail`)
    return _tail(keys, j, q, q, i, k0)


@numba.njit(cache=True, nogil=True, error_model=ERR, inline="always")
def _score_run(keys, r0, n, q, i, k, srow, s0):
    """srow[s0 + t] <- q[i] . keys[r0 + t] for t < n: a run of a row's keys read in place, TILE_W a
    call (the tile's order for each: the invariance note), then the columns past k."""
    t = 0
    while t + TILE_W <= n:
        s = _score_tile(keys, r0 + t, q, q, i, k, 0)  # (xb unused: float keys)
        for u in range(TILE_W):
            srow[s0 + t + u] = s[u]
        t += TILE_W
    while t < n:
        srow[s0 + t] = _score_tile1(keys, r0 + t, q, q, i, k, 0)[0]
        t += 1
    if k < keys.shape[1]:
        for t in range(n):
            srow[s0 + t] += _score_tail(keys, r0 + t, q, i, k)


@numba.njit(cache=True, nogil=True, error_model=ERR, inline="always")
def _value_run(srow, s0, inv, values, r0, n, y):
    """y += (srow[s0 + t] * inv) * values[r0 + t] for t < n in order: a multiply then an add per
    element (no fused multiply-add, no reordering: the invariance note)."""
    for t in range(n):
        pj = srow[s0 + t] * inv
        for d in range(y.shape[0]):
            y[d] += pj * values[r0 + t, d]


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _attend_one(q, i, keys, values, lo, hi, scale, softcap, sink, srow, y):
    """One query: q[i] (q (n, hs) C-contiguous) over keys / values (L, hs) / (L, hv) rows lo..hi-1
    into y (hv,); sink: the head's sink logit or NaN for none; srow (>= hi - lo,) scratch. A paged
    row's query (attention_cache's `_attend_one_paged`) takes the same runs, a block at a time."""
    for d in range(y.shape[0]):
        y[d] = 0.0
    if hi <= lo:  # nothing visible: zeros, as before
        return
    k = _main_cols(keys, keys.shape[1])
    _score_run(keys, lo, hi - lo, q, i, k, srow, 0)
    inv = _softmax_row(srow, hi - lo, scale, softcap, sink)
    _value_run(srow, 0, inv, values, lo, hi - lo, y)


# -- prefill: WIDE_ROWS queries of a head at once, each query the bits of `_attend_one` ----------

_QB = WIDE_ROWS  # consecutive queries of one head per block (the block note)
_score_block = _tile_stub(_QB, TILE_W, 2)  # _QB queries x TILE_W keys: the tile's order for each score
_score_block1 = _tile_stub(_QB, 1, 2)
_VVEC = 4 if FLANES == 16 else 3  # value vectors a key per pass: _QB x _VVEC accumulators in registers


def _make_value_sums(rows: int, nvec: int):
    @intrinsic
    def value_sums(typingctx, p, c0, n, values, j0, d0, acc):
        """acc[r, d0:d0 + nvec * FLANES] += p[r, c0 + c] * values[j0 + c, d0:...] for c = 0..n-1 in
        order, r < rows, each term a multiply then an add (as `_attend_one`'s value loop: no fused
        multiply-add, no reordering), the accumulators in registers across the keys. p, values and
        acc float32 2-D C-contiguous; the caller keeps every index in bounds (none checked here)."""
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32
                   for a in (p, values, acc)):
            return None
        sig = types.void(p, c0, n, values, j0, d0, acc)

        def codegen(context, builder, signature, args):
            pt, c0t, nt, vt, j0t, d0t, at = signature.args
            p_, c0_, n_, v_, j0_, d0_, a_ = args
            intp, row, c0_, j0_ = rows_of(context, builder, c0_, c0t, j0_, j0t)
            n_, d0_ = context.cast(builder, n_, nt, types.intp), context.cast(builder, d0_, d0t, types.intp)
            f = ir.VectorType(ir.FloatType(), FLANES)
            pps = [builder.gep(row(pt, p_, intp(r)), [c0_]) for r in range(rows)]
            aps = [builder.gep(row(at, a_, intp(r)), [d0_]) for r in range(rows)]
            accs = [[cgutils.alloca_once_value(builder, builder.load(
                builder.bitcast(builder.gep(aps[r], [intp(u * FLANES)]), f.as_pointer()), align=4))
                for u in range(nvec)] for r in range(rows)]
            with cgutils.for_range(builder, n_) as loop:
                c = loop.index
                vp = builder.gep(row(vt, v_, builder.add(j0_, c)), [d0_])
                vvs = [builder.load(builder.bitcast(builder.gep(vp, [intp(u * FLANES)]), f.as_pointer()), align=4)
                       for u in range(nvec)]
                for r in range(rows):
                    pj = builder.load(builder.gep(pps[r], [c]))
                    pb = builder.insert_element(ir.Constant(f, ir.Undefined), pj, ir.Constant(ir.IntType(32), 0))
                    pb = builder.shuffle_vector(pb, pb, ir.Constant(ir.VectorType(ir.IntType(32), FLANES),
                                                                    [0] * FLANES))
                    for u in range(nvec):
                        a = accs[r][u]
                        builder.store(builder.fadd(builder.load(a), builder.fmul(pb, vvs[u])), a)  # (no flags)
            for r in range(rows):
                for u in range(nvec):
                    builder.store(builder.load(accs[r][u]),
                                  builder.bitcast(builder.gep(aps[r], [intp(u * FLANES)]), f.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return value_sums


_values_block = _make_value_sums(_QB, _VVEC)
_values_block1 = _make_value_sums(_QB, 1)


@intrinsic
def _sums_block(typingctx, p, c0, n, tot):
    """tot[r] += p[r, c0 + c] for c = 0..n-1 in order, r < _QB: _QB serial sums interleaved (each
    one add at a time, its own order; the latency of one hides behind the others). p (_QB, m) and
    tot (_QB,) float32 C-contiguous; indices unchecked."""
    if not (isinstance(p, types.Array) and p.ndim == 2 and p.layout == "C" and p.dtype == types.float32
            and isinstance(tot, types.Array) and tot.ndim == 1 and tot.layout == "C" and tot.dtype == types.float32):
        return None
    sig = types.void(p, c0, n, tot)

    def codegen(context, builder, signature, args):
        pt, c0t, nt, tt = signature.args
        p_, c0_, n_, t_ = args
        intp, row, c0_, _ = rows_of(context, builder, c0_, c0t, c0_, c0t)
        n_ = context.cast(builder, n_, nt, types.intp)
        tarr = context.make_array(tt)(context, builder, t_)
        tps = [cgutils.get_item_pointer(context, builder, tt, tarr, [intp(r)], wraparound=False) for r in range(_QB)]
        pps = [builder.gep(row(pt, p_, intp(r)), [c0_]) for r in range(_QB)]
        sums = [cgutils.alloca_once_value(builder, builder.load(tp)) for tp in tps]
        with cgutils.for_range(builder, n_) as loop:
            for r in range(_QB):
                builder.store(builder.fadd(builder.load(sums[r]), builder.load(builder.gep(pps[r], [loop.index]))),
                              sums[r])  # (no flags: in order)
        for r in range(_QB):
            builder.store(builder.load(sums[r]), tps[r])
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True, error_model=ERR, inline="always")
def _values_one(p, r, c0, values, j0, j1, d0, acc):  # acc[r, d0:] += p[r, c0 + j - j0] * values[j, d0:], j in order
    for j in range(j0, j1):
        pj = p[r, c0 + j - j0]
        for d in range(d0, acc.shape[1]):
            acc[r, d] += pj * values[j, d]


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _scaled_exp(row, scale, softcap):
    """`_attend_one`'s softmax numerators of one query's raw scores, in place: scaled (and capped)
    scores, their peak, exp(score - peak), element-wise loops that vectorise (the block note)."""
    n = row.shape[0]
    if softcap > 0:
        for j in range(n):
            v = row[j] * scale
            row[j] = softcap * np.tanh(v / softcap)
    else:
        for j in range(n):
            row[j] = row[j] * scale
    # the peak as `_row_max` takes it (an integer max vectorises): the same as `_attend_one`'s
    # serial max but for ±0 (exp(v - 0) and exp(v + 0) are the same bits) and NaN (the caller
    # then redoes the query with `_attend_one`)
    best = np.int32(-2147483648)
    for j in range(n):
        b = np.int32(bits_of_f32(row[j]))
        kk = b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))
        best = kk if kk > best else best
    peak = as_f32(np.uint32(best ^ ((best >> np.int32(31)) & np.int32(0x7FFFFFFF))))
    for j in range(n):
        row[j] = _exp(row[j] - peak)
    return peak


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _attend_block(q, t0, keys, values, lo, hi, scale, softcap, sink, sc, acc, peaks, tot):
    """Queries q[t0..t0 + _QB - 1] (q (n, hs) C-contiguous) over keys / values (L, hs) / (L, hv),
    query r seeing keys lo[r]..hi[r]-1, into acc (_QB, hv); sc (_QB, >= L), peaks and tot (_QB,)
    scratch. Each query gets the bits `_attend_one` gives it (the block note)."""
    hv = acc.shape[1]
    acc[:, :] = 0.0
    a0, a1 = keys.shape[0], 0  # the keys some query sees
    m0, m1 = 0, keys.shape[0]  # the keys every query sees
    for r in range(_QB):
        if hi[r] > lo[r]:
            a0, a1 = min(a0, lo[r]), max(a1, hi[r])
        m0, m1 = max(m0, lo[r]), min(m1, hi[r])
    if a1 <= a0:
        return
    k = _main_cols(keys, keys.shape[1])
    j = a0
    while j + TILE_W <= a1:  # every query's scores of keys a0..a1-1 (those it does not see unused)
        s = _score_block(keys, j, q, q, t0, k, 0)
        for m in range(TILE_W):
            for r in range(_QB):
                sc[r, j - a0 + m] = s[m * _QB + r]
        j += TILE_W
    while j < a1:
        s1 = _score_block1(keys, j, q, q, t0, k, 0)
        for r in range(_QB):
            sc[r, j - a0] = s1[r]
        j += 1
    tot[:] = 0.0
    for r in range(_QB):
        if hi[r] > lo[r]:
            if k < keys.shape[1]:
                for j in range(lo[r], hi[r]):
                    sc[r, j - a0] += _score_tail(keys, j, q, t0 + r, k)
            peaks[r] = _scaled_exp(sc[r, lo[r] - a0:hi[r] - a0], scale, softcap)
    shared = m0 < m1  # (then every query sees a key)
    for r in range(_QB):  # each query's softmax sum in key order: the keys before the shared ones,
        if hi[r] > lo[r]:  # then those (interleaved), then the keys after
            for j in range(lo[r], m0 if shared else hi[r]):
                tot[r] += sc[r, j - a0]
    if shared:
        _sums_block(sc, m0 - a0, m1 - m0, tot)
        for r in range(_QB):
            for j in range(m1, hi[r]):
                tot[r] += sc[r, j - a0]
    for r in range(_QB):
        if hi[r] > lo[r]:
            total = tot[r]
            if sink == sink:
                total += _exp(sink - peaks[r])
            if total != total:  # a NaN: every query as `_attend_one` gives it, NaN bits and all
                for rr in range(_QB):
                    _attend_one(q, t0 + rr, keys, values, lo[rr], hi[rr], scale, softcap, sink, sc[rr], acc[rr])
                return
            inv = np.float32(1.0) / total
            for j in range(lo[r] - a0, hi[r] - a0):
                sc[r, j] = sc[r, j] * inv
    if not shared:  # each alone
        for r in range(_QB):
            if hi[r] > lo[r]:
                _values_one(sc, r, lo[r] - a0, values, lo[r], hi[r], 0, acc)
        return
    for r in range(_QB):  # the keys before the shared ones, then those, then the keys after
        _values_one(sc, r, lo[r] - a0, values, lo[r], m0, 0, acc)
    wide = _VVEC * FLANES
    d = 0
    while d + wide <= hv:
        _values_block(sc, m0 - a0, m1 - m0, values, m0, d, acc)
        d += wide
    while d + FLANES <= hv:
        _values_block1(sc, m0 - a0, m1 - m0, values, m0, d, acc)
        d += FLANES
    if d < hv:
        for r in range(_QB):
            _values_one(sc, r, m0 - a0, values, m0, m1, d, acc)
    for r in range(_QB):
        _values_one(sc, r, m1 - a0, values, m1, hi[r], 0, acc)


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
           sinks: np.ndarray | None = None, before: tuple | None = None) -> np.ndarray:
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

    ``before`` = (pool_k, pool_v, table, slots, size, start): paged rows (attention_cache's paged-rows note), whose
    positions 0..start-1 are in the pools (nkv, blocks x size, hs / hv) through table[slots[b]]
    (int32), and k, v hold positions start.. only (S = start + their length). Each (row, kv head)
    is gathered into a scratch of the thread where it is attended (`blocks`: the same keys in the
    same order, so the bits of the gathered arrays'), not into (B, nkv, S, hs) arrays first.
    """
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    if k.shape != (B, nkv, S, hs) or v.ndim != 4 or v.shape[:3] != k.shape[:3] or nh % nkv:
        raise ValueError(f"attend: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                         "(B, nh, T, hs) / (B, nkv, S, hs) / (B, nkv, S, hv) with nh a multiple of nkv")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.dtype != np.float32:
            raise TypeError(f"attend: {name} is {a.dtype}; pass float32 (a.astype(np.float32))")
    pk, pv, table, slots, size, start = _NO_PAGES if before is None else _paged_before(before, k, v)
    S += max(start, 0)
    pos = _positions(q_pos, B, T, S)
    window, scale = int(max(window, 0)), np.float32(hs ** -0.5 if scale is None else scale)
    y = np.empty((B, T, nh, v.shape[3]), np.float32)
    sinks = _sinks(sinks, nh, "attend")
    q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))  # (the kernels read rows of (T, hs) / (S, hs))
    n = team_size(nkv if T * S >= _TEAM_WORK else 1)  # kv heads over the rank's threads (the team note)
    cuts = [nkv * i // n for i in range(n + 1)]
    run_parts(_attend_heads, [(q, k, v, pk, pv, table, slots, size, start, np.ascontiguousarray(pos), window, scale,
                               np.float32(softcap), sinks, a, b, y) for a, b in zip(cuts, cuts[1:])])
    return y


_NO_PAGES = (np.empty((0, 0, 0), np.float32), np.empty((0, 0, 0), np.float32), np.empty((0, 0), np.int32),
             np.empty(0, np.int64), 1, -1)  # `attend` without ``before``


def _paged_before(before: tuple, k: np.ndarray, v: np.ndarray) -> tuple:
    """`attend`'s ``before``, checked: what `_attend_heads` takes."""
    pk, pv, table, slots, size, start = before
    B, nkv = k.shape[:2]
    slots = np.ascontiguousarray(slots, np.int64)
    if (pk.dtype != np.float32 or pv.dtype != np.float32 or pk.shape[::2] != (nkv, k.shape[3])
            or pv.shape[::2] != (nkv, v.shape[3]) or pk.shape[1] != pv.shape[1] or table.dtype != np.int32
            or table.ndim != 2 or slots.shape != (B,) or not 0 < start <= size * table.shape[1]
            or not (pk.flags.c_contiguous and pv.flags.c_contiguous and table.flags.c_contiguous)):
        raise ValueError(f"attend: before must be float32 pools ({nkv}, positions, width) of k and v, an int32 "
                         f"table, {B} slots, a block size and 0 < start <= the table's positions; got pools "
                         f"{pk.dtype} {pk.shape} / {pv.shape}, table {table.dtype} {table.shape}, slots {slots.shape}, "
                         f"size {size}, start {start}")
    return pk, pv, table, slots, int(size), int(start)


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _attend_heads(q, k, v, pk, pv, table, slots, size, start, pos, window, scale, softcap, sinks, kv0, kv1, y):
    """Every query of kv heads kv0..kv1-1's groups, one at a time (`_attend_one`): q (B, nh, T, hs),
    k (B, nkv, S, hs), v (B, nkv, S, hv), pos (B, T) -> y (B, T, nh, hv). ``start`` >= 0: paged rows
    (`attend`'s ``before``), whose keys and values are positions 0..start-1 through the table, then
    k and v's (S = start + their length), gathered into a scratch per (row, kv head)."""
    B, nh, T, _ = q.shape
    nkv, S = k.shape[1], k.shape[2] + max(start, 0)
    g = nh // nkv
    srow = np.empty(max(S, 1), np.float32)
    sc = np.empty((_QB, max(S, 1)), np.float32)
    acc = np.empty((_QB, y.shape[3]), np.float32)
    los, his = np.empty(_QB, np.int64), np.empty(_QB, np.int64)
    peaks, tot = np.empty(_QB, np.float32), np.empty(_QB, np.float32)
    rows = S if start >= 0 else 0
    kbuf, vbuf = np.empty((rows, k.shape[3]), np.float32), np.empty((rows, v.shape[3]), np.float32)
    for b in range(B):
        for kh in range(kv0, kv1):
            if start >= 0:  # a paged row: its blocks, then the chunk, in order (`blocks`)
                _gather_run(pk[kh], table[slots[b]], size, start, k[b, kh], kbuf)
                _gather_run(pv[kh], table[slots[b]], size, start, v[b, kh], vbuf)
                keys, values = kbuf, vbuf
            else:
                keys, values = k[b, kh], v[b, kh]
            for i in range(g):
                h = kh * g + i
                sink = sinks[h] if sinks.shape[0] > 0 else np.float32(np.nan)
                t = 0
                while t + _QB <= T:  # blocks of _QB queries (the block note)
                    for r in range(_QB):
                        p = pos[b, t + r]
                        los[r] = max(0, p - window + 1) if window > 0 else 0
                        his[r] = min(S, p + 1)
                    _attend_block(q[b, h], t, keys, values, los, his, scale, softcap, sink, sc, acc, peaks, tot)
                    for r in range(_QB):
                        for d in range(acc.shape[1]):  # (a loop: numba's slice assignment cost 6 % of the call)
                            y[b, t + r, h, d] = acc[r, d]
                    t += _QB
                for t in range(t, T):  # the last few one at a time
                    p = pos[b, t]
                    lo = max(0, p - window + 1) if window > 0 else 0
                    hi = min(S, p + 1)
                    _attend_one(q[b, h], t, keys, values, lo, hi, scale, softcap, sink, srow, y[b, t, h])


def attend_workspace_bytes(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Bytes `attend` holds besides its inputs and output (the planner's estimate): kept at what the
    blocked attention before the invariance note held, 64 queries x up to 1024 keys of scores per
    head, an accumulator and running max / sum; today's (a contiguous copy of v, the one view among
    q, k, v, and WIDE_ROWS + 1 rows of scores per thread) is of the same order (B x nkv x seq x hs floats): to
    re-derive with the planner's pages (tests/test_docs.py shows their plans)."""
    bq, bk = min(seq, 64), min(seq, 1024)
    return batch * heads * bq * (bk + 2 * head_dim + 2) * 4


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
