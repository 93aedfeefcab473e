"""Prefill's float32 products of a few dozen to a few hundred rows, ``x @ W.T``, as LLVM vector
IR on AVX-512: our GEMM where it is measured faster than OpenBLAS's (`F32_GEMM_ROWS`).

``gemm_f32(x, w)`` -> ``x @ w.T`` (M, N) float32, x (M, K) and w (N, K) float32 C-contiguous.
The activations are packed once per call (`_pack`: 16 rows' columns interleaved, ``xp[j, k, l]
= x[16 j + l, k]``, zero past M), and W is read as it is stored (decode's (N, K) rows: no
second copy of any weight). The tile (`_make_tile`) keeps TILE_R weight rows x TILE_V vectors
of 16 activation rows in 24 zmm accumulators: each step k broadcasts ``w[n, k]`` of each weight
row (vbroadcastss) and multiplies it into the TILE_V vectors ``xp[j, k, :]`` (vfmadd231ps), so
3 vector loads and 8 broadcasts feed 24 FMAs. At the end each activation row's 8 sums go to
``out[t, n:n+8]`` (one 32-byte run per row, rows in turn: walking a weight row's 16 activation
rows instead made every store a conflict miss where N * 4 bytes is a multiple of 4 kB).
`_rows` walks weight rows in blocks of BLOCK_ROWS (256 kB of W at K = 1024: read from DRAM
once, then from L2 for the other activation vectors), and the rank's threads take disjoint
ranges of weight rows (`run_parts`: the team note in _common.py).

Note: why our own GEMM. On a 2-core Xeon VM with AVX-512 (2026-12-02), a 128-token prefill of
the medium preset spent 221-232 of its ~255 ms in OpenBLAS's sgemm (SkylakeX kernels), which
ran at 105-130 GFLOP/s a core at 128 rows, 60-70 % of the core's measured FMA peak (178-201),
against 155-162 at 512-2048 rows: its packing costs show at this shape. This tile, with the
weights cold (69-95 different matrices, 800 MB, each product once), 1 thread, against OpenBLAS in
the same run: 128 x 1024 -> 2816 1.22x (134 vs 110 GFLOP/s), 128 x 2816 -> 1024 1.26x, 128 x 1024
-> 2048 1.19x, 256 x 1024 -> 2816 1.08x; 2 threads: 1.16x, 1.08x, 1.13x at 128 rows, but 0.93x
at 256 (254 vs 237 GFLOP/s: OpenBLAS's packing pays off there), so `F32_GEMM_ROWS` stops at 192.
Tried and slower: 6 x 4, 12 x 2, 4 x 6, 3 x 8 and 4 x 4 tiles (0.5-1.0x of 8 x 3 at most shapes);
blocking K (64-256 columns, partial sums in a (N, M) buffer: 0.75-0.95x); walking all weight
rows for each activation vector (1.0-1.1x with the weights in cache, but W then comes from DRAM
once per 48 activation rows); software prefetch of the weights, 256 floats ahead or the next
tile's rows (0.92-0.97x of none, whole prefill); threads claiming 32-512-row chunks from an atomic
counter instead of a half each (0.99x); numba's OpenMP pool for the split (the GEMMs 0-6 %
faster, attention's team then 20 % slower beside its spinning workers). AVX2 targets (8 lanes,
16 registers) keep OpenBLAS: unmeasured.

Whole prefill of 128 tokens (medium f32, `bench/ab_decode.py --prefill-only`, 7 rounds, against
OpenBLAS's products in the same process): 1 thread 497 -> 424 ms (1.17x), 2 threads 292 -> 254 ms
(1.15x); logits within 1.1e-5. Of the 2-thread prefill's ~240 ms, these products take ~200
(240 GFLOP/s: each thread's half alone runs in ~170 ms; together they lose ~15 %, not to the
hand-off), attention 25, SwiGLU 7, norms, RoPE, cache writes and adds ~10.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._common import ERR, check_f32, pool_threads, run_parts
from .rowdot import _FAST, _I32, _FLANES, _idx

__all__ = ["gemm_f32", "F32_GEMM", "F32_GEMM_ROWS", "LANES", "TILE_R", "TILE_V"]

LANES = 16  # activation rows per vector: a zmm of float32
TILE_R, TILE_V = 8, 3  # weight rows x activation vectors per tile: 24 accumulators of AVX-512's 32
BLOCK_ROWS = 64  # weight rows per block of `_rows` (read from DRAM once, reused from L2)
F32_GEMM = _FLANES == 16  # numba compiles for AVX-512 (rowdot's vector width note)
F32_GEMM_ROWS = 192  # up to this many rows a prefill's f32 product runs here (fewer than 65: matvec_f32; more: OpenBLAS)


def _make_tile(rows: int, vecs: int):
    """The intrinsic ``tile(w, n, xp, j, out)``: ``out[16 j' + l, n + i] = w[n + i] . x[16 j' + l]``
    for i < rows, j' in j .. j+vecs-1, every l < 16 (out has a row for each packed one)."""
    @intrinsic
    def tile(typingctx, w, n, xp, j, out):
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C" and w.dtype == types.float32
                and isinstance(xp, types.Array) and xp.ndim == 3 and xp.layout == "C" and xp.dtype == types.float32
                and isinstance(out, types.Array) and out.ndim == 2 and out.layout == "C" and out.dtype == types.float32):
            return None
        sig = types.void(w, n, xp, j, out)

        def codegen(context, builder, signature, args):
            wt, nt, xt, jt, ot = signature.args
            w_, n_, x_, j_, o_ = args

            def intp(v):
                return context.get_constant(types.intp, v)

            n_, j_ = context.cast(builder, n_, nt, types.intp), context.cast(builder, j_, jt, types.intp)
            wa, xa, oa = (context.make_array(t)(context, builder, a) for t, a in ((wt, w_), (xt, x_), (ot, o_)))
            K, N = builder.extract_value(wa.shape, 1), builder.extract_value(oa.shape, 1)
            wps = [cgutils.get_item_pointer(context, builder, wt, wa, [builder.add(n_, intp(i)), intp(0)],
                                            wraparound=False) for i in range(rows)]
            xps = [cgutils.get_item_pointer(context, builder, xt, xa, [builder.add(j_, intp(v)), intp(0), intp(0)],
                                            wraparound=False) for v in range(vecs)]
            f16 = ir.VectorType(ir.FloatType(), LANES)
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(f16, [0.0] * LANES)) for _ in range(vecs)]
                    for _ in range(rows)]
            with cgutils.for_range(builder, K) as loop:
                k = loop.index
                xvs = [builder.load(builder.bitcast(builder.gep(p, [builder.mul(k, intp(LANES))]), f16.as_pointer()),
                                    align=4) for p in xps]  # xp[j + v, k, :]
                for i in range(rows):
                    s = builder.insert_element(ir.Constant(f16, ir.Undefined), builder.load(builder.gep(wps[i], [k])),
                                               ir.Constant(_I32, 0))
                    b = builder.shuffle_vector(s, s, _idx([0] * LANES))  # w[n + i, k] in every lane
                    for v in range(vecs):
                        a = accs[i][v]
                        builder.store(builder.fadd(builder.load(a), builder.fmul(b, xvs[v], flags=_FAST), flags=_FAST), a)
            base = cgutils.get_item_pointer(context, builder, ot, oa, [intp(0), intp(0)], wraparound=False)
            for v in range(vecs):
                sums = [builder.load(accs[i][v]) for i in range(rows)]
                for lane in range(LANES):  # activation row t: its `rows` sums side by side in out[t, n:]
                    t = builder.add(builder.mul(j_, intp(LANES)), intp(v * LANES + lane))
                    at = builder.add(builder.mul(t, N), n_)
                    for i in range(rows):
                        builder.store(builder.extract_element(sums[i], ir.Constant(_I32, lane)),
                                      builder.gep(base, [builder.add(at, intp(i))]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


_t8_3, _t8_2, _t8_1 = _make_tile(TILE_R, 3), _make_tile(TILE_R, 2), _make_tile(TILE_R, 1)
_t1_3, _t1_2, _t1_1 = _make_tile(1, 3), _make_tile(1, 2), _make_tile(1, 1)  # a block's last rows


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _pack(x, xp):  # x (M, K) -> xp (ceil(M / 16), K, 16), zero past M
    M, K = x.shape
    for j in range(xp.shape[0]):
        if (j + 1) * LANES <= M:
            for k in range(K):
                for lane in range(LANES):
                    xp[j, k, lane] = x[j * LANES + lane, k]
        else:
            for k in range(K):
                for lane in range(LANES):
                    t = j * LANES + lane
                    xp[j, k, lane] = x[t, k] if t < M else np.float32(0.0)


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _rows(w, xp, out, n0, n1):  # out[:, n0:n1] = x @ w[n0:n1].T, out (16 * xp.shape[0], N)
    nv = xp.shape[0]
    for b0 in range(n0, n1, BLOCK_ROWS):
        b1 = min(n1, b0 + BLOCK_ROWS)
        j = 0
        while j < nv:
            v = min(TILE_V, nv - j)
            n = b0
            while n < b1:  # 8-row tiles, then the block's last rows one at a time
                full = n + TILE_R <= b1
                if full and v == 3:
                    _t8_3(w, n, xp, j, out)
                elif full and v == 2:
                    _t8_2(w, n, xp, j, out)
                elif full:
                    _t8_1(w, n, xp, j, out)
                elif v == 3:
                    _t1_3(w, n, xp, j, out)
                elif v == 2:
                    _t1_2(w, n, xp, j, out)
                else:
                    _t1_1(w, n, xp, j, out)
                n += TILE_R if full else 1
            j += v


def gemm_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` (M, N) float32 for x (M, K) and w (N, K), C-contiguous float32: the weight
    rows split over the rank's threads. Any M works; `F32_GEMM_ROWS` is where it is the fast one."""
    check_f32("gemm_f32 x", x)
    check_f32("gemm_f32 w", w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm_f32: x {x.shape} and w {w.shape} do not fit (M, K) @ (N, K).T")
    (M, K), N = x.shape, w.shape[0]
    nv = -(-M // LANES)
    xp = np.empty((nv, K, LANES), np.float32)
    _pack(x, xp)
    out = np.empty((nv * LANES, N), np.float32)  # a row per packed row: the tile writes all 16
    parts = max(1, min(pool_threads(), N // (2 * TILE_R)))
    cuts = [N * p // parts // TILE_R * TILE_R for p in range(parts)] + [N]
    run_parts(_rows, [(w, xp, out, a, b) for a, b in zip(cuts, cuts[1:]) if b > a])
    return out[:M]
