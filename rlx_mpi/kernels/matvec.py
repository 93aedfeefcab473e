"""Decode's float matvec: ``x @ w.T`` for a few activation rows and float32, bfloat16 or float16
weights (lowp.py's bf16 and f16 decode is this kernel: bf16 as its uint16 bits, f16 as its bits
read as int16, so typing tells the two apart), output rows split over the rank's numba threads
(compiled parallel, unlike the element-wise kernels: see _common.py)."""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from ._common import ERR, aligned, aligned_empty, check_f32, pool_threads, run_parts
from .bits import as_f32, f16_exact, pack_bf16
from .rowdot import (AHEAD_BYTES, BF16_DOT, BF16_PANEL_PARTS, BF16_PANELS, BF16_TILES, DP_STEP, FLOAT_TILES, PANEL_ROWS, PANEL_SUMS, PANEL_W,
                     PANEL_PARTS, PANEL_STATE, PANELS, ROWS, STEP, TILE_W, WIDE_TILES, prefetch_l2)

__all__ = ["matvec_f32", "matmul_float", "float_product", "F32_MATVEC_ROWS", "BLOCK_ROWS"]

X_BLOCK_BYTES = 1 << 19  # activations a row block holds (the row blocks note)
COL_BLOCK_BYTES = 4096  # an activation row's bytes per column block (the column blocks note)
PF_BLOCK_BYTES = 1 << 18  # weight blocks up to this size have the next one prefetched into L2 (the panel note)
BLOCK_ROWS = 64  # weight rows a product walks for each group of activation rows (256 kB at K = 1024 f32: L2)


def _weight(w, n, k):
    """w[n, k] as float32: float32 weights as they are, bfloat16 bits (uint16) shifted, float16
    bits (int16) decoded; all exact."""


@overload(_weight, inline="always")
def _weight_typed(w, n, k):
    if w.dtype == types.float32:
        return lambda w, n, k: w[n, k]
    if w.dtype == types.uint16:
        return lambda w, n, k: as_f32(np.uint32(w[n, k]) << np.uint32(16))
    if w.dtype == types.int16:
        return lambda w, n, k: f16_exact(w[n, k])
    return None


def _tail(w, n, x, xb, r, k0):
    """w[n, k0:] . x[r, k0:], the columns past the tiles' steps, one at a time in order and
    rounded at each step (no fast-math: the same sum on every path; the invariance note). bf16
    weights on a BF16_DOT CPU take the bf16-rounded activations (xb), as their tiles do."""


@overload(_tail)
def _tail_typed(w, n, x, xb, r, k0):
    if w.dtype == types.uint16 and BF16_DOT:
        def dot(w, n, x, xb, r, k0):
            acc = np.float32(0.0)
            for k in range(k0, w.shape[1]):
                acc += xb[r, k] * _weight(w, n, k)
            return acc
        return dot

    def dot(w, n, x, xb, r, k0):
        acc = np.float32(0.0)
        for k in range(k0, w.shape[1]):
            acc += x[r, k] * _weight(w, n, k)
        return acc
    return dot


def _main_cols(w, k):
    """The columns the tiles take (the rest is `_tail`'s): whole steps of the tile's kind."""


@overload(_main_cols, inline="always")
def _main_cols_typed(w, k):
    step = DP_STEP if w.dtype == types.uint16 and BF16_DOT else STEP
    return lambda w, k: k - k % step


def _operand(x, w):
    """The activations as ``w``'s tiles read them: for bf16 weights on a BF16_DOT CPU, every row
    of x rounded to bf16 (nearest even, `bits.pack_bf16`; rowdot's bf16 dot note) as float32,
    each whole DP_STEP of columns laid out as its 16 odd columns, then its 16 even ones (rowdot's
    bf16 FMA note), the columns past them in order (`_tail`'s); else an empty array."""


@overload(_operand)
def _operand_typed(x, w):
    if w.dtype == types.uint16 and BF16_DOT:
        def pack(x, w):
            R, K = x.shape
            xb = np.empty((R, K), np.float32)
            bits = np.empty(K, np.uint16)
            main = K - K % DP_STEP
            half = DP_STEP // 2
            for r in range(R):
                pack_bf16(x[r], bits)
                for c in range(0, main, DP_STEP):
                    for l in range(half):
                        xb[r, c + l] = as_f32(np.uint32(bits[c + 2 * l + 1]) << np.uint32(16))
                        xb[r, c + half + l] = as_f32(np.uint32(bits[c + 2 * l]) << np.uint32(16))
                for k in range(main, K):
                    xb[r, k] = as_f32(np.uint32(bits[k]) << np.uint32(16))
            return xb
        return pack
    return lambda x, w: np.empty((0, 0), np.float32)


def _tile_stub(rows: int, wrows: int, wide: int = 0):
    """``t(w, n, x, xb, r, k, ahead)``: rowdot's tile of this shape for w's kind (the bf16 one
    against xb on a BF16_DOT CPU, the float one against x otherwise; ``wide``: WIDE_ROWS rows, 1 with
    the prefetch, 2 without)."""
    flt = WIDE_TILES[(wide == 1, wrows)] if wide else FLOAT_TILES[(rows, wrows)]
    bf = BF16_TILES.get((rows, wrows))  # (wide: the bf16 tile of WIDE_ROWS rows, which always prefetches)

    def t(w, n, x, xb, r, k, ahead):
        pass

    @overload(t, inline="always")
    def typed(w, n, x, xb, r, k, ahead):
        if bf is not None and w.dtype == types.uint16:
            return lambda w, n, x, xb, r, k, ahead: bf(w, n, xb, r, k, ahead)
        return lambda w, n, x, xb, r, k, ahead: flt(w, n, x, r, k, ahead)

    return t


_t4_4, _t4_3, _t4_2, _t4_1 = (_tile_stub(ROWS, m) for m in (4, 3, 2, 1))
_t1_4, _t1_3, _t1_2, _t1_1 = (_tile_stub(1, m) for m in (4, 3, 2, 1))


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _put(out, sums, rows, w, x, xb, n, r, k):
    """A tile's sums into out: ``sums[j * rows + i]`` is weight row n+j against activation row
    r+i over the first k columns; the columns past k added after."""
    tail = k < w.shape[1]
    for j in range(len(sums) // rows):
        for i in range(rows):
            s = sums[j * rows + i]
            out[r + i, n + j] = s + _tail(w, n + j, x, xb, r + i, k) if tail else s


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _span(x, xb, w, out, n0, n1, ahead, r0=0):
    """out[:, n0:n1] = x @ w[n0:n1].T: blocks of BLOCK_ROWS weight rows (read from memory once,
    then from cache for each group of ROWS activation rows), each in tiles of TILE_W weight rows
    (the block's last ones in a narrower tile), the rows past the groups of ROWS one at a time.
    Which tile computes an element never changes its value (the invariance note). Rows from r0."""
    r_len = x.shape[0]
    k = _main_cols(w, x.shape[1])
    grouped = r_len - (r_len - r0) % ROWS
    for b0 in range(n0, n1, BLOCK_ROWS):
        b1 = min(n1, b0 + BLOCK_ROWS)
        for r in range(r0, r_len, ROWS):
            a = ahead if r == r0 else 0  # (the prefetch: once a weight row)
            n = b0
            while n < b1:
                m = min(TILE_W, b1 - n)
                if r < grouped:
                    if m == 4:
                        _put(out, _t4_4(w, n, x, xb, r, k, a), ROWS, w, x, xb, n, r, k)
                    elif m == 3:
                        _put(out, _t4_3(w, n, x, xb, r, k, a), ROWS, w, x, xb, n, r, k)
                    elif m == 2:
                        _put(out, _t4_2(w, n, x, xb, r, k, a), ROWS, w, x, xb, n, r, k)
                    else:
                        _put(out, _t4_1(w, n, x, xb, r, k, a), ROWS, w, x, xb, n, r, k)
                else:
                    for i in range(r, r_len):
                        ai = a if i == r else 0
                        if m == 4:
                            _put(out, _t1_4(w, n, x, xb, i, k, ai), 1, w, x, xb, n, i, k)
                        elif m == 3:
                            _put(out, _t1_3(w, n, x, xb, i, k, ai), 1, w, x, xb, n, i, k)
                        elif m == 2:
                            _put(out, _t1_2(w, n, x, xb, i, k, ai), 1, w, x, xb, n, i, k)
                        else:
                            _put(out, _t1_1(w, n, x, xb, i, k, ai), 1, w, x, xb, n, i, k)
                n += m


# Note: the panel. Prefill's products (`matmul_float`) take rowdot's panels, PANEL_ROWS (8)
# activation rows x PANEL_W (3) weight rows on AVX-512 (the 3 x 3 tile on AVX2): each element the
# chain of decode's tiles (the invariance note in rowdot.py), the sums stored as vectors (rowdot's
# `_make_panel`). Measured (2026-12-03, a 2-core Sapphire Rapids VM shared with other jobs, load
# 7-13: in process, thread CPU time, 1 thread, the minimum of 5 alternating rounds, the medium
# model's four products, 3 copies of each weight so that they come from memory) against the code
# before the invariance kernels (the broadcast GEMM up to 192 rows, OpenBLAS above), old / new
# time: the 6 x 4 wide tile this replaces 0.86-0.89x at 128 rows and 0.88-0.91x at 512 (K = 1024),
# 0.72-0.81x / 0.82-0.85x at K = 2816; this panel 0.95-1.00x at 128 rows (K = 1024), 0.88-0.93x at
# 512, K = 2816 0.85x / 0.79x. The tile alone in L1 runs at 172-176 GFLOP/s (the core's peak is
# ~200): what is lost is the operands' way from L2 and memory. Whole prefill (medium, 1 thread,
# `bench/ab_decode.py --prefill-only`, 5 rounds, against the 6 x 4 tile in process; logits the same
# bits): f32 128 tokens 1.21x, 512 tokens 0.99x; bf16 128 tokens 1.04x. Against the code before
# the invariance kernels, one 128-token f32 prefill's thread CPU time 415 -> 512 ms (0.81x), of
# which these products ~85 %.
# While a weight block runs, the next one is prefetched into L2 (`rowdot.prefetch_l2`, its lines
# spread over the block's panels) where a block is at most PF_BLOCK_BYTES (f32 K <= 1024, bf16 /
# f16 K <= 2048): 128 rows, weights from memory (20 copies), f32 K = 1024 1.06-1.10x of none
# (1.03-1.07x the code before), bf16 1.01x; at K = 2816 (720 kB blocks) it cost 13 %, so off there.
# Tried and not taken (same runs): blocking the columns (256-1024 a block, the accumulators kept
# in a buffer between blocks: a store and a load per accumulator and block, 45-60 cycles a tile;
# 0.74-0.85x of no blocking at K = 1024, no gain at K = 2816, activation blocks of 60-120 rows,
# weight blocks of 32-64); the next tile's weights prefetched into L1 by every group
# (0.88-0.92x); 12 x 2 panels (0.80-0.88x of 6 x 4); weight blocks of 33 or 96 rows (within noise).
# Part of the 6 x 4 tile's loss was its rows past the last whole group (128 = 21 x 6 + 2): they
# took decode's narrow tiles, which read the weight block again for two rows; the last group now
# overlaps the one before instead.
# Column blocks (issue 36): with rows longer than 1.5 x 4 kB of activations (f32 K > 1536: the
# 2816-column down projection) a group's 8 activation rows (90 kB at K = 2816) no longer fit L1
# beside the panel's weights, and every step read them from L2: 105-131 GFLOP/s against ~160 at
# K = 1024. `_span_cols` takes 1024 columns at a time through every panel of the weight block,
# the panels' accumulators parked in a small buffer between column blocks (rowdot's
# `_make_panel_part`: the same fused multiply-adds in the same order, so the same bits; tested).
# Measured (quiet, 1 thread, 512 rows, 6 copies of the weight): K = 2816 125-128 -> 162-167
# GFLOP/s (0.79x -> 0.88x of OpenBLAS); 2 kB blocks were slower (153 against 163 at K = 1024 when
# blocked), so K = 1024 stays unblocked.
# Row blocks (issue 36): each weight block runs against every group of activation rows, so at
# 512 rows x 1024 columns (2 MB of activations beside a 256 kB weight block in a 2 MB L2) every
# block streamed them from L3: 160 GFLOP/s against 173-178 at 128-256 rows. `matmul_float` now
# hands the team X_BLOCK_BYTES of activation rows at a time (128 rows at K = 1024; weights read
# once per row block, from L3), where column blocks leave the rows whole (K <= 1536). Every
# element is still one panel's chain, so the same bits (tested). Measured (quiet, in process,
# alternating, 4 copies of each weight, old = whole rows): 1 thread, 512 rows, K = 1024 160 ->
# 175-177 GFLOP/s (256 kB blocks: 165-167); 256 rows 173 -> 176; 2 threads 316-319 -> 319-337;
# at K = 2816 row blocks cost 9-17 % on top of column blocks, so none there.
# bf16 on an AVX512-BF16 CPU was bound by vdpbf16ps (the tile alone in L1: 105 GFLOP/s, about 2
# cycles an instruction on this CPU), below what OpenBLAS made of dequantized float32 tiles at
# 512 rows (110-115): the 6 x 4 tile 0.82-0.83x at 512 rows, 0.93-1.21x at 128. Its steps are
# now float32 fused multiply-adds in the same order (rowdot's bf16 FMA note).


def _panel_stub(wrows: int):
    """``p(w, n, x, xb, r, k, sums, ahead)``: rowdot's panel of PANEL_ROWS x wrows for w's kind
    (the bf16 one against xb on a BF16_DOT CPU, the float one against x otherwise)."""
    flt, bf = PANELS[wrows], BF16_PANELS.get(wrows)

    def p(w, n, x, xb, r, k, sums, ahead):
        pass

    @overload(p, inline="always")
    def typed(w, n, x, xb, r, k, sums, ahead):
        if bf is not None and w.dtype == types.uint16:
            return lambda w, n, x, xb, r, k, sums, ahead: bf(w, n, xb, r, k, sums, ahead)
        return lambda w, n, x, xb, r, k, sums, ahead: flt(w, n, x, r, k, sums, ahead)

    return p


_pn_1, _pn_2, _pn_3 = (_panel_stub(m) for m in (1, 2, 3))  # PANEL_W is 3 on every target


@numba.njit(cache=True, nogil=True, error_model=ERR, inline="always")
def _panel(m, w, n, x, xb, r, k, sums, ahead):
    """The panel of m (1 .. PANEL_W) weight rows from n: one dispatch for every width."""
    if m == 3:
        _pn_3(w, n, x, xb, r, k, sums, ahead)
    elif m == 2:
        _pn_2(w, n, x, xb, r, k, sums, ahead)
    else:
        _pn_1(w, n, x, xb, r, k, sums, ahead)


def _part_stub(wrows: int):
    """``p(w, n, x, xb, r, k0, k1, state, sums, first, last, ahead)``: rowdot's panel part of
    PANEL_ROWS x wrows for w's kind (as `_panel_stub`)."""
    flt, bf = PANEL_PARTS[wrows], BF16_PANEL_PARTS.get(wrows)

    def p(w, n, x, xb, r, k0, k1, state, sums, first, last, ahead):
        pass

    @overload(p, inline="always")
    def typed(w, n, x, xb, r, k0, k1, state, sums, first, last, ahead):
        if bf is not None and w.dtype == types.uint16:
            return lambda w, n, x, xb, r, k0, k1, state, sums, first, last, ahead: bf(
                w, n, xb, r, k0, k1, state, sums, first, last, ahead)
        return lambda w, n, x, xb, r, k0, k1, state, sums, first, last, ahead: flt(
            w, n, x, r, k0, k1, state, sums, first, last, ahead)

    return p


_pp_1, _pp_2, _pp_3 = (_part_stub(m) for m in (1, 2, 3))


@numba.njit(cache=True, nogil=True, error_model=ERR, inline="always")
def _part(m, w, n, x, xb, r, k0, k1, state, sums, first, last, ahead):
    """The panel part of m (1 .. PANEL_W) weight rows from n: one dispatch for every width."""
    if m == 3:
        _pp_3(w, n, x, xb, r, k0, k1, state, sums, first, last, ahead)
    elif m == 2:
        _pp_2(w, n, x, xb, r, k0, k1, state, sums, first, last, ahead)
    else:
        _pp_1(w, n, x, xb, r, k0, k1, state, sums, first, last, ahead)


def _col_block(w):
    """Columns of a column block (the column blocks note): 4 kB of an activation row."""


@overload(_col_block, inline="always")
def _col_block_typed(w):
    cols = COL_BLOCK_BYTES // 4  # (float32 activations on every path)
    return lambda w: cols


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _span_cols(x, xb, w, out, n0, n1, ahead, k, cb):
    """`_span_wide` in column blocks of cb (the column blocks note): per weight block, per group
    of PANEL_ROWS activation rows, per column block, every panel of the block, its accumulators
    parked between blocks (rowdot's `_make_panel_part`: the panel's bits)."""
    r_len = x.shape[0]
    groups = -(-r_len // PANEL_ROWS)
    tail = k < w.shape[1]
    sums = np.empty(PANEL_SUMS, np.float32)
    state = np.empty((-(-BLOCK_ROWS // PANEL_W), PANEL_STATE), np.float32)
    nkb = -(-k // cb)
    for b0 in range(n0, n1, BLOCK_ROWS):
        b1 = min(n1, b0 + BLOCK_ROWS)
        for g in range(groups):
            r = min(g * PANEL_ROWS, r_len - PANEL_ROWS)
            for c in range(nkb):
                k0 = c * cb
                k1 = min(k, k0 + cb)
                last = c == nkb - 1
                n = b0
                p = 0
                while n < b1:
                    m = min(PANEL_W, b1 - n)
                    _part(m, w, n, x, xb, r, k0, k1, state[p], sums, c == 0, last, ahead if g == 0 else 0)
                    if last:
                        for j in range(m):
                            for i in range(PANEL_ROWS):
                                s = sums[j * PANEL_ROWS + i]
                                out[r + i, n + j] = s + _tail(w, n + j, x, xb, r + i, k) if tail else s
                    n += m
                    p += 1


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _span_wide(x, xb, w, out, n0, n1, ahead):
    """`_span` for many rows: blocks of BLOCK_ROWS weight rows (read from memory once, prefetched
    by the first group, then from cache), each against groups of PANEL_ROWS activation rows in
    panels of PANEL_W weight rows (the block's last ones narrower). Rows past the last whole
    group are the last PANEL_ROWS rows taken again as one more group: its first rows get the
    same bits a second time (the invariance note), where `_span`'s narrow tiles would read the
    block again for a few rows (the panel note). Fewer rows than a group: `_span`."""
    r_len = x.shape[0]
    if r_len < PANEL_ROWS:
        _span(x, xb, w, out, n0, n1, ahead)
        return
    groups = -(-r_len // PANEL_ROWS)
    k = _main_cols(w, x.shape[1])
    cb = _col_block(w)
    if k > cb + cb // 2:  # long rows: column blocks (the column blocks note)
        _span_cols(x, xb, w, out, n0, n1, ahead, k, cb)
        return
    tail = k < w.shape[1]
    sums = np.empty(PANEL_SUMS, np.float32)
    K = w.shape[1]
    for b0 in range(n0, n1, BLOCK_ROWS):
        b1 = min(n1, b0 + BLOCK_ROWS)
        # the next block's weights into L2, a few lines after each of this block's panels (the panel note)
        nxt, end = b1 * K, min(n1, b1 + BLOCK_ROWS) * K
        per = 0
        if BLOCK_ROWS * K * w.itemsize <= PF_BLOCK_BYTES:
            per = -(-((end - nxt) * w.itemsize // 64) // (groups * -(-(b1 - b0) // PANEL_W)))  # lines a panel
        for g in range(groups):
            r = min(g * PANEL_ROWS, r_len - PANEL_ROWS)
            n = b0
            while n < b1:
                m = min(PANEL_W, b1 - n)
                _panel(m, w, n, x, xb, r, k, sums, ahead if g == 0 else 0)
                if per > 0 and nxt < end:
                    prefetch_l2(w, nxt, per)
                    nxt += per * 64 // w.itemsize
                for j in range(m):
                    for i in range(PANEL_ROWS):
                        s = sums[j * PANEL_ROWS + i]
                        out[r + i, n + j] = s + _tail(w, n + j, x, xb, r + i, k) if tail else s
                n += m


@numba.njit(cache=True, parallel=True, error_model=ERR)
def _matvec_float(x, w, out, chunks):  # x (R, K) f32, w (N, K) f32, bf16 or f16 bits, out (R, N) f32: decode's product
    n_len = w.shape[0]
    xb = _operand(x, w)  # bf16 activations for bf16 x bf16 products, where the CPU has them
    ahead = AHEAD_BYTES // w.itemsize
    for c in numba.prange(chunks):
        _span(x, xb, w, out, c * n_len // chunks, (c + 1) * n_len // chunks, ahead)


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _operand_nogil(x, w):  # `_operand` for the team's product (`matmul_float`)
    return _operand(x, w)


def matmul_float(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` (M, N) for float32 x (M, K) and w (N, K) float32, bf16 bits (uint16) or f16 bits
    (int16), unchecked, for many rows (prefill): the weight rows split over the rank's threads as
    the team does (`run_parts`: no numba pool spinning beside attention's team), each element the
    same as `_matvec_float` gives (the invariance note)."""
    x = aligned(x)  # (the alignment note in _common.py; w is its owner's to align)
    out = aligned_empty((x.shape[0], w.shape[0]), np.float32)  # (often the next product's input)
    xb = aligned(_operand_nogil(x, w))
    N = w.shape[0]
    parts = max(1, min(pool_threads(), N // (2 * TILE_W)))
    cuts = [N * p // parts for p in range(parts + 1)]
    ahead = AHEAD_BYTES // w.itemsize
    R = x.shape[0]
    span = R  # row blocks for rows that column blocks leave whole (the row blocks note)
    if 4 * x.shape[1] <= COL_BLOCK_BYTES + COL_BLOCK_BYTES // 2:
        span = max(4 * PANEL_ROWS, X_BLOCK_BYTES // (4 * x.shape[1]) // PANEL_ROWS * PANEL_ROWS)
    r0 = 0
    while r0 < R:
        r1 = R if R - r0 < span + span // 2 else r0 + span
        run_parts(_span_wide, [(x[r0:r1], xb[r0:r1] if xb.size else xb, w, out[r0:r1], a, b, ahead)
                               for a, b in zip(cuts, cuts[1:]) if b > a])
        r0 = r1
    return out


def matvec_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for float32 rows x (R, K) and float32 w (N, K), on the rank's numba threads
    (few rows: decode) or its team (many: `matmul_float`); every element the same whatever R and
    the threads (the invariance note). For weights in DRAM it reads them 1.7-1.8x faster than
    OpenBLAS's GEMV (measured over the small preset's decode step, 101 MB, 1 and 2 threads)."""
    check_f32("matvec_f32 x", x)
    check_f32("matvec_f32 w", w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matvec_f32: x {x.shape} and w {w.shape} do not fit (R, K) @ (N, K).T")
    return float_product(x, w)


def float_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`matvec_f32` without its checks (x float32 C-contiguous (R, K), w checked once by its
    owner): the pool's kernel up to F32_MATVEC_ROWS rows, the team's above; the same values."""
    if x.shape[0] > F32_MATVEC_ROWS:
        return matmul_float(x, w)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _matvec_float(x, w, out, min(w.shape[0], 4 * pool_threads()))
    return out


F32_MATVEC_ROWS = 64  # up to this many rows a decode step's f32 projections run on matvec_f32, not BLAS.
# In the model the step is what counts: with numba's matvecs the step runs as one call per layer
# (kernels.decode_layer) and its attention on the pool, with BLAS neither. With the 2-row tiles (rowdot's
# tile note), whole decode step at this threshold against BLAS's path (medium, 2 threads, in process,
# bench/ab_decode.py against the code before the tiles, where these rows took BLAS): 28 rows 1.54x,
# 32 rows 1.27x (1.32x on 1 thread), 48 rows 1.23x, 64 rows 0.96x; logits within 6e-6. Before the tiles
# the crossover was 24-32 rows (step time BLAS / numba: 24 rows 1.32, 32 rows 1.02). The 3-row tile made
# the numba side 1.1-1.2x faster from 16 rows (rowdot's tile note), and the limit moved 48 -> 64: the
# limit's rows on numba against one row fewer on BLAS (in process, 5 interleaved rounds), decode step
# 2 threads 48 rows 1.23x, 64 1.11x, 80 1.13x, 96 0.90x; 1 thread 48 1.16x, 64 1.09x, 80 1.02x, 96 0.98x;
# a prefill of 64 / 80 tokens 0.98x / 1.02x (2 threads), 1.03x / 1.00x (1 thread).
