"""The q4 product on AVX-512 VNNI: ``x @ W.T`` for float32 rows x and a q4 weight W (quant.py's
format), as int8 x 4-bit products (llama.cpp's way for Q4_0 x Q8_0); prefill's (`gemm_q4`) and,
in tiles of 4 and 1 rows, decode's (`_matvec_q4`, the decode note).

``gemm_q4(x, codes, sm)`` -> (M, N) float32. Each activation row is rounded to int8 per group of
32 exactly as the decode kernel rounds it (scale max|x| / 127, the group's sum of x kept in
float32: quant.py's activations note), so a group's product is an integer sum, taken by
``vpdpbusd`` (64 unsigned codes x signed activations a step, summed by fours into 16 int32
lanes), then ``out += (scale * d) * isum + minimum * sum_x`` in float32.

Layout. The lanes of a vector are 16 weight rows (an output block); an activation row's four
int8 values are broadcast to every lane from memory (an embedded broadcast, no shuffle), so
one ``vpdpbusd`` is 16 rows x 4 columns of one activation row, and TILE_M activation rows share
each weight vector. For that, a block's 16 weight rows are interleaved once per call into a
scratch buffer (`_repack`: dword i of each row's group side by side, by 16 x 16 transposes in
registers, `_transpose16`: 3.6x faster than copying dwords one by one, which took ~10 % of a
5632 x 1024 product at 128 rows), and the activations are laid out per call to match (`_quantize_rows`: in each
8 columns of a group the 4 even ones, then the 4 odd ones, for the low and the high nibbles of
the same 4 bytes). Nothing is repacked at load: decode reads the weight as stored.

Note: rounding and rows. Each output (m, n) is one lane of one accumulator; its sum is taken
group after group in one order whatever the row count, the tile's position or the threads
(``fma`` by intrinsic, no reassociation), so a row's result never depends on the rows beside
it. The activations are rounded as decode's are (the same int8 values, scale and sum).

Note: decode (issue 36: a row's bits never depend on the rows beside it). Per output element
the two kernels took these float operations:

- quant.py's decode kernel (`_q4_dots`): per pair of groups one ``vpdpbusd`` of 16 int32 lanes,
  each the sum of 4 columns' products (lanes: group, even / odd columns, quad); each lane kept
  its own float32 sum ``acc[lane] += isum[lane] * (s * d)`` over the pairs, the minimum terms
  ``m * sum_x`` a 4-lane sum beside it; at the end the 16 lanes added by a tree, then the
  minimum terms, then an odd last group's 8-lane sum (LLVM free to reassociate: fast-math).
- the GEMM (`_tile`): per group the exact int32 total of its 32 products (integer sums do not
  depend on their order), then ``acc = fma(isum, s * d, acc)``, ``acc = fma(m, sum_x, acc)``,
  group after group in one lane, no reassociation.

So a row's q4 product moved by float32 rounding (~1e-6 relative, and then by whole int8 steps
where that moved an activation across a rounding boundary in the next layer) when its step
reached Q4_GEMM_ROWS rows. The GEMM's order is the one that costs decode nothing to take: on a
VNNI CPU decode runs this kernel too, in tiles of 4 and 1 activation rows (`_make_tile`: each
row the same operations whatever the tile's height, so the same bits), over blocks of 16
weight rows repacked per call as the GEMM's are, with the next block's rows prefetched while
one is repacked (`_transpose16`'s ``ahead``). The lane-wise kernel stays for CPUs without VNNI,
where it takes every row count (nothing else runs q4 there), so it too is one order; a MoE
layer's experts take this kernel too (`_rows_q4_gemm`), as a `Linear` of one expert does.
Decode's 1-3 rows read a block as stored (`_direct`) rather than repacking it for so few rows.
Measured (medium's q4 file, 1 thread, in process, interleaved rounds, a loaded shared host;
old / new, > 1 faster): whole decode step batch 1 0.85x, 8 prompts 1.34x; prefill 128 1.44x,
512 1.03x; the 66 q4 matrices of a batch-1 step alone (128 MB, from memory) 0.89-0.95x, and
1.3-2x faster on matrices that stay in cache. Prefetch variants for `_direct` (none, the next
block, two or four blocks, into L2 only) did not close the streamed batch-1 gap (none: 0.79x;
on a quiet moment, 1 thread: the 66 matrices 0.90-0.92x at 1 row, 1.5x at 8 rows).
Then (issue 36: batch 1 still paid 7-10 %) `_direct` takes two passes over a block: the first
reads its 16 rows one after the other, as stored (one stream, where reading 64 bytes of each
row a step made 16 short streams of 512-1408 bytes), and keeps each step's ``vpdpbusd`` sums in
``pbuf`` (L1); the second turns them into the 16 rows' lanes group by group as before (the same
int32 sums: the same bits). The first pass asks for the next block's line into L2
(``prefetcht1``): into L1 the requests queued behind each other while the second pass ran.
Measured (2-core Xeon, quiet, 24 copies of medium's four q4 matrices, 177 MB, 1 row, 1 thread,
old = the lane-wise kernel before invariance; old / new time): one pass 0.86x; two passes with the
L1 prefetch 0.90-0.91x; with the L2 prefetch one block ahead 0.97-1.09x (two or four blocks ahead
1.01-1.05x). The whole batch-1 decode step (`bench/ab_decode.py`, 7 rounds): 1.06x / 1.10x on 1
thread, 1.19x on 2 (0.89x / 0.93x before).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from ._common import ERR, check_f32, pool_threads, run_parts
from .bits import f16_exact
from .quant import GROUP, _matvec_q4 as _matvec_q4_lanes, check_q4
from .llvm_ir import I32, idx, prefetch_line, target_has

__all__ = ["matvec_q4", "fused_matvec_q4", "gemm_q4", "fused_gemm_q4", "Q4_GEMM", "Q4_GEMM_ROWS", "TILE_M", "LANES"]

Q4_GEMM = target_has("avx512vnni") and target_has("avx512bw")  # 512-bit vpdpbusd
LANES = 16  # weight rows per block: a zmm of int32 / float32 lanes
TILE_M = 12  # activation rows per tile: 12 int32 and 12 float32 accumulators of AVX-512's 32 registers
Q4_GEMM_ROWS = 16  # from this many rows a q4 product runs here (fewer: quant.py's decode kernel)


def _make_tile(rows: int):
    @intrinsic
    def _tile(typingctx, wp, sdm, xq, xs, m0, tout):
        """``tout[i, l] = sum over groups of W[n0 + l] . x[m0 + i]`` for i < ``rows``, l < LANES: wp
        (4G, 16) uint32, one block's interleaved codes (`_repack`); sdm (2G, 16) float32, its scales
        and minimums per group; xq (M', K) int8 in `_quantize_rows`' layout; xs (M', 2G) float32 per
        group d and the sum of x; tout (>= rows, 16) float32. Each row takes the same operations
        whatever ``rows``: a tile of any height gives it the same bits."""
        if not (isinstance(wp, types.Array) and wp.ndim == 2 and wp.layout == "C" and wp.dtype == types.uint32
                and isinstance(sdm, types.Array) and sdm.ndim == 2 and sdm.layout == "C" and sdm.dtype == types.float32
                and isinstance(xq, types.Array) and xq.ndim == 2 and xq.layout == "C" and xq.dtype == types.int8
                and isinstance(xs, types.Array) and xs.ndim == 2 and xs.layout == "C" and xs.dtype == types.float32
                and isinstance(tout, types.Array) and tout.ndim == 2 and tout.layout == "C"
                and tout.dtype == types.float32):
            return None
        sig = types.void(wp, sdm, xq, xs, m0, tout)

        def codegen(context, builder, signature, args):
            wt, st, xt, xst, mt, ot = signature.args
            wp_, sdm_, xq_, xs_, m_, to_ = args

            def intp(v):
                return context.get_constant(types.intp, v)

            def row(aty, a, i):
                arr = context.make_array(aty)(context, builder, a)
                return cgutils.get_item_pointer(context, builder, aty, arr, [i, intp(0)], wraparound=False)

            m_ = context.cast(builder, m_, mt, types.intp)
            sa = context.make_array(st)(context, builder, sdm_)
            groups = builder.udiv(builder.extract_value(sa.shape, 0), intp(2))
            wbase = builder.bitcast(row(wt, wp_, intp(0)), ir.IntType(8).as_pointer())
            sbase = row(st, sdm_, intp(0))
            xps = [row(xt, xq_, builder.add(m_, intp(i))) for i in range(rows)]
            xsps = [row(xst, xs_, builder.add(m_, intp(i))) for i in range(rows)]
            v64, i16 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(I32, LANES)
            f16 = ir.VectorType(ir.FloatType(), LANES)
            dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16, v64, v64]),
                                                "llvm.x86.avx512.vpdpbusd.512")
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f16, [f16, f16, f16]), "llvm.fma.v16f32")
            zero_i = ir.Constant(i16, [0] * LANES)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(f16, [0.0] * LANES)) for _ in range(rows)]
            low = ir.Constant(v64, [15] * 64)
            four = ir.Constant(v64, [4] * 64)
            splat16 = idx([0] * LANES)

            def bcast_i32(ptr):  # four int8 at ptr in every lane, as 64 bytes
                v = builder.load(builder.bitcast(ptr, I32.as_pointer()), align=1)
                v = builder.insert_element(ir.Constant(i16, ir.Undefined), v, ir.Constant(I32, 0))
                return builder.bitcast(builder.shuffle_vector(v, v, splat16), v64)

            def bcast_f32(ptr):
                v = builder.insert_element(ir.Constant(f16, ir.Undefined), builder.load(ptr), ir.Constant(I32, 0))
                return builder.shuffle_vector(v, v, splat16)

            with cgutils.for_range(builder, groups) as loop:
                g = loop.index
                isums = [zero_i] * TILE_M
                for i in range(4):  # dword i of the group's 16 bytes a row: columns 8i .. 8i+7
                    off = builder.mul(builder.add(builder.mul(g, intp(4)), intp(i)), intp(64))
                    pv = builder.load(builder.bitcast(builder.gep(wbase, [off]), v64.as_pointer()), align=4)
                    lo = builder.and_(pv, low)  # columns 8i, 8i+2, 8i+4, 8i+6 of each row
                    hi = builder.lshr(pv, four)  # columns 8i+1, 8i+3, 8i+5, 8i+7
                    xoff = builder.add(builder.mul(g, intp(GROUP)), intp(8 * i))
                    for m in range(rows):
                        xlo = bcast_i32(builder.gep(xps[m], [xoff]))
                        xhi = bcast_i32(builder.gep(xps[m], [builder.add(xoff, intp(4))]))
                        isums[m] = builder.call(dp, [isums[m], lo, xlo])
                        isums[m] = builder.call(dp, [isums[m], hi, xhi])
                two = builder.mul(g, intp(2))
                s = builder.load(builder.bitcast(builder.gep(sbase, [builder.mul(two, intp(LANES))]), f16.as_pointer()),
                                 align=4)
                mn = builder.load(builder.bitcast(builder.gep(sbase, [builder.mul(builder.add(two, intp(1)), intp(LANES))]),
                                                  f16.as_pointer()), align=4)
                for m in range(rows):
                    d = bcast_f32(builder.gep(xsps[m], [two]))
                    xsum = bcast_f32(builder.gep(xsps[m], [builder.add(two, intp(1))]))
                    sd = builder.fmul(s, d)  # (scale * d) per lane: one rounding, then one fma each term
                    a = builder.call(fma, [builder.sitofp(isums[m], f16), sd, builder.load(accs[m])])
                    builder.store(builder.call(fma, [mn, xsum, a]), accs[m])
            obase = row(ot, to_, intp(0))
            for m in range(rows):
                builder.store(builder.load(accs[m]),
                              builder.bitcast(builder.gep(obase, [intp(m * LANES)]), f16.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _tile


_tile = _make_tile(TILE_M)  # the GEMM's 12 rows a weight load
_tile4 = _make_tile(4)  # decode's fewer rows (the decode note)
_tile1 = _make_tile(1)


def _shuffle_to(builder, a, b, la, lb, want):
    """The vector holding labels ``want`` (in that lane order) from vectors a, b labelled la, lb."""
    where = {lab: i for i, lab in enumerate(la)}
    where.update({lab: len(la) + i for i, lab in enumerate(lb)})
    return builder.shuffle_vector(a, b, idx([where[w] for w in want]))


def _pair_add(builder, a, b, la, lb, want):
    """Lane t = (the lanes labelled want[t][0]) + (want[t][1]) of a, b: two shuffles and an add."""
    return builder.add(_shuffle_to(builder, a, b, la, lb, [w[0] for w in want]),
                       _shuffle_to(builder, a, b, la, lb, [w[1] for w in want]))


@intrinsic
def _direct(typingctx, w, sm, xq, xs, n0, m0, tout, ahead, pbuf):
    """``_tile`` of one activation row m0 for a whole block of 16 weight rows n0.. (w: the codes
    as uint32), read as stored (no `_repack`; ``ahead``: bytes past each code read to ask for, the
    next block's), per 4 groups each row's 64 bytes of codes take two ``vpdpbusd`` (lanes: group,
    dword), the 16 rows' int32 lanes are added and transposed into one vector per group (lanes:
    weight rows), the scales and minimums transposed likewise; then per group the tile's float
    operations in its order, so the same bits (the decode note). The codes are read in a first
    pass row by row, their ``vpdpbusd`` sums kept in ``pbuf`` (int32, (16 x groups / 4, 16)).
    Needs groups % 4 == 0."""
    if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C" and w.dtype == types.uint32
            and isinstance(sm, types.Array) and sm.ndim == 2 and sm.layout == "C"
            and sm.dtype in (types.uint16, types.float32)
            and isinstance(xq, types.Array) and xq.ndim == 2 and xq.layout == "C" and xq.dtype == types.int8
            and isinstance(xs, types.Array) and xs.ndim == 2 and xs.layout == "C" and xs.dtype == types.float32
            and isinstance(tout, types.Array) and tout.ndim == 2 and tout.layout == "C"
            and tout.dtype == types.float32
            and isinstance(pbuf, types.Array) and pbuf.ndim == 2 and pbuf.layout == "C" and pbuf.dtype == types.int32):
        return None
    half = sm.dtype == types.uint16
    sig = types.void(w, sm, xq, xs, n0, m0, tout, ahead, pbuf)

    def codegen(context, builder, signature, args):
        wt, st, xt, xst, nt, mt, ot, at = signature.args[:8]
        w_, sm_, xq_, xs_, n_, m_, to_, a_ = args[:8]

        def intp(v):
            return context.get_constant(types.intp, v)

        def row(aty, a, i):
            arr = context.make_array(aty)(context, builder, a)
            return cgutils.get_item_pointer(context, builder, aty, arr, [i, intp(0)], wraparound=False)

        n_, m_ = context.cast(builder, n_, nt, types.intp), context.cast(builder, m_, mt, types.intp)
        a_ = context.cast(builder, a_, at, types.intp)
        i8p = ir.IntType(8).as_pointer()
        sps = [row(st, sm_, builder.add(n_, intp(l))) for l in range(LANES)]
        xp, xsp = row(xt, xq_, m_), row(xst, xs_, m_)
        sa = context.make_array(st)(context, builder, sm_)
        sahead = builder.mul(builder.extract_value(sa.strides, 0), intp(LANES))  # the next block's pairs
        steps = builder.udiv(builder.extract_value(sa.shape, 1), intp(8))  # 4 groups a step
        v64, i16 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(I32, LANES)
        f16, f8 = ir.VectorType(ir.FloatType(), LANES), ir.VectorType(ir.FloatType(), 8)
        dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16, v64, v64]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f16, [f16, f16, f16]), "llvm.fma.v16f32")
        zero_i = ir.Constant(i16, [0] * LANES)
        acc = cgutils.alloca_once_value(builder, ir.Constant(f16, [0.0] * LANES))
        low, four = ir.Constant(v64, [15] * 64), ir.Constant(v64, [4] * 64)
        splat16 = idx([0] * LANES)

        def bcast_f32(ptr):
            v = builder.insert_element(ir.Constant(f16, ir.Undefined), builder.load(ptr), ir.Constant(I32, 0))
            return builder.shuffle_vector(v, v, splat16)

        pb = context.make_array(signature.args[8])(context, builder, args[8])
        pbase = builder.bitcast(pb.data, i16.as_pointer())  # pbuf[l * steps + q]: row l's step q, 16 int32
        with cgutils.for_range(builder, intp(LANES)) as rows_loop:  # pass 1: the block row by row, as stored
            l = rows_loop.index
            wrow = builder.bitcast(row(wt, w_, builder.add(n_, l)), i8p)
            with cgutils.for_range(builder, steps) as loop:
                q = loop.index
                boff = builder.mul(q, intp(64))
                prefetch_line(builder, wrow, builder.add(boff, a_), 2)
                cv = builder.load(builder.bitcast(builder.gep(wrow, [boff]), v64.as_pointer()), align=1)
                # the activations: dword 2k of the 4 groups' 128 bytes pairs with lane k's low nibbles, 2k+1 high
                xoff = builder.mul(q, intp(128))
                xa = builder.load(builder.bitcast(builder.gep(xp, [xoff]), i16.as_pointer()), align=1)
                xb = builder.load(builder.bitcast(builder.gep(xp, [builder.add(xoff, intp(64))]), i16.as_pointer()),
                                  align=1)
                xlo = builder.bitcast(builder.shuffle_vector(xa, xb, idx(range(0, 32, 2))), v64)
                xhi = builder.bitcast(builder.shuffle_vector(xa, xb, idx(range(1, 32, 2))), v64)
                # lanes (group, dword): its 4 even columns' codes, then its 4 odd columns'
                pv = builder.call(dp, [builder.call(dp, [zero_i, builder.and_(cv, low), xlo]),
                                       builder.lshr(cv, four), xhi])
                builder.store(pv, builder.gep(pbase, [builder.add(builder.mul(l, steps), q)]), align=4)
        with cgutils.for_range(builder, steps) as loop:  # pass 2: per 4 groups, the 16 rows' sums as lanes
            q = loop.index
            p = [builder.load(builder.gep(pbase, [builder.add(builder.mul(intp(l), steps), q)]), align=4)
                 for l in range(LANES)]
            # int32 sums, exact in any order: (row, group, dword) -> (row, group) -> lanes = rows per group
            lab = [[(l, k // 4, k % 4) for k in range(LANES)] for l in range(LANES)]
            v, vl = [], []
            for a in range(0, LANES, 2):
                want = [((l, g, 2 * j), (l, g, 2 * j + 1)) for l in (a, a + 1) for g in range(4) for j in range(2)]
                v.append(_pair_add(builder, p[a], p[a + 1], lab[a], lab[a + 1], want))
                vl.append([(l, g, (2 * j, 2 * j + 1)) for l in (a, a + 1) for g in range(4) for j in range(2)])
            r, rl = [], []
            for a in range(0, len(v), 2):
                rows_ = sorted({x[0] for x in vl[a] + vl[a + 1]})
                want = [((l, g, (0, 1)), (l, g, (2, 3))) for l in rows_ for g in range(4)]
                r.append(_pair_add(builder, v[a], v[a + 1], vl[a], vl[a + 1], want))
                rl.append([(l, g) for l in rows_ for g in range(4)])
            t = [_shuffle_to(builder, r[a], r[a + 1], rl[a], rl[a + 1],
                             [(l, g) for g in gs for l in range(4 * a, 4 * a + 8)])
                 for a in (0, 2) for gs in ((0, 1), (2, 3))]  # rows 0-7 groups 0,1; 0-7 2,3; 8-15 0,1; 8-15 2,3
            tl = [[(l, g) for g in gs for l in range(4 * a, 4 * a + 8)] for a in (0, 2) for gs in ((0, 1), (2, 3))]
            isum = [_shuffle_to(builder, t[g // 2], t[2 + g // 2], tl[g // 2], tl[2 + g // 2],
                                [(l, g) for l in range(LANES)]) for g in range(4)]
            # the 4 groups' scales and minimums of the 16 rows, transposed likewise (float32)
            soff = builder.mul(q, intp(8))
            sv = []
            for l in range(LANES):
                prefetch_line(builder, builder.bitcast(builder.gep(sps[l], [soff]), i8p), sahead)
                if half:
                    h = builder.load(builder.bitcast(builder.gep(sps[l], [soff]), ir.VectorType(ir.HalfType(), 8)
                                                     .as_pointer()), align=2)
                    sv.append(builder.fpext(h, f8))
                else:
                    sv.append(builder.load(builder.bitcast(builder.gep(sps[l], [soff]), f8.as_pointer()), align=4))
            cur = [builder.shuffle_vector(sv[2 * a], sv[2 * a + 1], idx(range(16))) for a in range(8)]
            cl = [[(2 * a + t_ // 8, t_ % 8) for t_ in range(16)] for a in range(8)]
            for bit, pairs in ((4, [(a, a + 4) for a in range(4)]), (2, [(a, a + 2) for a in (0, 1, 4, 5)]),
                               (1, [(a, a + 1) for a in (0, 2, 4, 6)])):
                nxt, nl = list(cur), list(cl)
                for i, j in pairs:
                    both = cl[i] + cl[j]
                    for dst, keep in ((i, 0), (j, bit)):
                        want = sorted((x for x in both if x[1] & bit == keep), key=lambda x: (x[1], x[0]))
                        nxt[dst] = _shuffle_to(builder, cur[i], cur[j], cl[i], cl[j], want)
                        nl[dst] = want
                cur, cl = nxt, nl
            for g in range(4):  # the tile's operations, in its order
                gg = builder.add(builder.mul(q, intp(4)), intp(g))
                two = builder.mul(gg, intp(2))
                d = bcast_f32(builder.gep(xsp, [two]))
                xsum = bcast_f32(builder.gep(xsp, [builder.add(two, intp(1))]))
                sd = builder.fmul(cur[2 * g], d)
                a = builder.call(fma, [builder.sitofp(isum[g], f16), sd, builder.load(acc)])
                builder.store(builder.call(fma, [cur[2 * g + 1], xsum, a]), acc)
        obase = row(ot, to_, intp(0))
        builder.store(builder.load(acc), builder.bitcast(obase, f16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen



@numba.njit(cache=True, nogil=True, error_model=ERR)
def _quantize_rows(x, xq, xs):
    """x (M, K) f32 -> xq (M', K) int8, xs (M', 2G) f32, rows past M zero. Per group of 32: d =
    max|x| / 127 and the sum of x (quant._quantize_rows_q8's arithmetic, each group's sum in column
    order: the same bits; tested), codes rint(x / d); in each 8 columns c .. c+7 of a group the
    even ones first, then the odd ones.

    Note: the groups' sums are taken side by side (column j of every group, then column j+1), not
    one group after the other: the same additions in the same order per group, but independent
    chains for the CPU to overlap; 2.9x faster at 128 x 1024 and 128 x 2816 (1 thread, in process,
    loaded host), where one chain of 32 dependent additions per group had made this 6 % of a
    product at 5632 x 1024 and ~25 % at 1024 x 1024."""
    groups = xs.shape[1] // 2
    total = np.empty(groups, np.float32)
    peak = np.empty(groups, np.float32)
    for r in range(xq.shape[0]):
        if r >= x.shape[0]:
            xq[r, :] = 0
            xs[r, :] = 0
            continue
        total[:] = 0.0
        peak[:] = 0.0
        for j in range(32):
            for g in range(groups):
                v = x[r, g * 32 + j]
                total[g] += v
                a = abs(v)
                if a > peak[g] or a != a:  # a NaN must win and stay (as decode's rounding)
                    peak[g] = a
        for g in range(groups):
            d = peak[g] / np.float32(127.0)
            xs[r, 2 * g] = d
            xs[r, 2 * g + 1] = total[g]
            inv = np.float32(1.0) / d if d > 0 and d < np.inf else np.float32(0.0)
            for c in range(g * 32, g * 32 + 32, 8):
                for t in range(4):
                    xq[r, c + t] = np.int8(np.rint(x[r, c + 2 * t] * inv))
                    xq[r, c + 4 + t] = np.int8(np.rint(x[r, c + 2 * t + 1] * inv))


def _pair(sm, n, j):
    """sm[n, j] as float32: float16 bits (uint16) decoded, float32 as it is; both exact."""


@overload(_pair)
def _pair_typed(sm, n, j):
    if sm.dtype == types.uint16:
        return lambda sm, n, j: f16_exact(sm[n, j])
    return lambda sm, n, j: sm[n, j]


@intrinsic
def _transpose16(typingctx, src, n0, j0, dst, ahead):
    """``dst[j0 + j, l] = src[n0 + l, j0 + j]`` for j, l < 16, as float32 / uint32 (float16 bits
    widened, exactly): 16 row loads, a 16 x 16 transpose in four rounds of two-vector shuffles
    (64 in all), 16 stores; instead of 256 scalar copies (`_repack`). Each row load asks for
    the same columns ``ahead`` rows further on (the next block's: the prefetch note)."""
    if not (isinstance(src, types.Array) and src.ndim == 2 and src.dtype in (types.uint32, types.float32, types.uint16)
            and isinstance(dst, types.Array) and dst.ndim == 2 and dst.layout == "C"
            and dst.dtype in (types.uint32, types.float32)):
        return None
    sig = types.void(src, n0, j0, dst, ahead)

    def codegen(context, builder, signature, args):
        st, nt, jt, dt, at = signature.args
        s_, n_, j_, d_, a_ = args

        def intp(v):
            return context.get_constant(types.intp, v)

        n_, j_ = context.cast(builder, n_, nt, types.intp), context.cast(builder, j_, jt, types.intp)
        sa, da = context.make_array(st)(context, builder, s_), context.make_array(dt)(context, builder, d_)
        i32x16 = ir.VectorType(I32, LANES)
        skip = builder.mul(context.cast(builder, a_, at, types.intp), builder.extract_value(sa.strides, 0))
        rows = []
        for l in range(LANES):
            p = cgutils.get_item_pointer(context, builder, st, sa, [builder.add(n_, intp(l)), j_], wraparound=False)
            prefetch_line(builder, builder.bitcast(p, ir.IntType(8).as_pointer()), skip)
            if st.dtype == types.uint16:  # float16 bits: widened to float32 on load (vcvtph2ps)
                h = builder.load(builder.bitcast(p, ir.VectorType(ir.HalfType(), LANES).as_pointer()), align=2)
                v = builder.bitcast(builder.fpext(h, ir.VectorType(ir.FloatType(), LANES)), i32x16)
            else:
                v = builder.load(builder.bitcast(p, i32x16.as_pointer()), align=4)
            rows.append(v)
        h = LANES // 2
        while h:  # swap the off-diagonal h x h blocks of every 2h x 2h block
            for i in range(LANES):
                if i & h:
                    continue
                a, b = rows[i], rows[i + h]
                rows[i] = builder.shuffle_vector(a, b, idx([c if not c & h else LANES + c - h for c in range(LANES)]))
                rows[i + h] = builder.shuffle_vector(a, b, idx([c + h if not c & h else LANES + c for c in range(LANES)]))
            h //= 2
        for j in range(LANES):
            p = cgutils.get_item_pointer(context, builder, dt, da, [builder.add(j_, intp(j)), intp(0)], wraparound=False)
            builder.store(rows[j], builder.bitcast(p, i32x16.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _repack_block(c32, sm, n0, wp, sdm):
    """`_repack` for a whole block (n0 + 16 <= N): runs of 16 columns by `_transpose16` (the
    layout note), the columns left over one by one."""
    whole = wp.shape[0] - wp.shape[0] % LANES
    for j in range(0, whole, LANES):
        _transpose16(c32, n0, j, wp, LANES)
    for j in range(whole, wp.shape[0]):
        for l in range(LANES):
            wp[j, l] = c32[n0 + l, j]
    whole = sdm.shape[0] - sdm.shape[0] % LANES
    for j in range(0, whole, LANES):
        _transpose16(sm, n0, j, sdm, LANES)
    for j in range(whole, sdm.shape[0]):
        for l in range(LANES):
            sdm[j, l] = _pair(sm, n0 + l, j)


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _repack(c32, sm, n0, wp, sdm):
    """Rows n0 .. n0+15 of a q4 weight (c32: its codes as uint32, (N, K/8)) into wp (4G, 16): wp[4g
    + i, l] = dword i of row n0+l's group g; sdm (2G, 16): its scales, then its minimums, float32.
    Rows past N get zero codes, scales and minimums."""
    groups = sdm.shape[0] // 2
    for l in range(LANES):
        n = n0 + l
        if n < c32.shape[0]:
            for j in range(4 * groups):
                wp[j, l] = c32[n, j]
            for g in range(groups):
                sdm[2 * g, l] = _pair(sm, n, 2 * g)
                sdm[2 * g + 1, l] = _pair(sm, n, 2 * g + 1)
        else:
            for j in range(4 * groups):
                wp[j, l] = 0
            for g in range(groups):
                sdm[2 * g, l] = 0.0
                sdm[2 * g + 1, l] = 0.0


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _blocks(c32, sm, xq, xs, out, b0, b1, r0, r1):  # out[r0:r1, 16 b0 : 16 b1] (clipped to N) = x @ W[...].T
    groups = xs.shape[1] // 2
    N = out.shape[1]
    wp = np.empty((4 * groups, LANES), np.uint32)
    sdm = np.empty((2 * groups, LANES), np.float32)
    tout = np.empty((TILE_M, LANES), np.float32)
    direct = r1 - r0 < 4 and groups % 4 == 0  # decode's 1-3 rows (the decode note)
    pbuf = np.empty((LANES * (groups // 4 if direct else 0), LANES), np.int32)  # `_direct`'s row-by-row sums
    for b in range(b0, b1):
        n0 = b * LANES
        nv = min(LANES, N - n0)
        if direct and nv == LANES:
            for m in range(r0, r1):
                _direct(c32, sm, xq, xs, n0, m, tout, LANES * 4 * c32.shape[1], pbuf)
                for l in range(LANES):
                    out[m, n0 + l] = tout[0, l]
            continue
        if nv == LANES:
            _repack_block(c32, sm, n0, wp, sdm)
        else:
            _repack(c32, sm, n0, wp, sdm)
        m0 = r0
        while m0 < r1:  # tiles of TILE_M rows (past r1 into xq's padding: the GEMM's), then of 4 and 1
            if m0 + TILE_M <= xq.shape[0] and r1 - m0 > 8:
                _tile(wp, sdm, xq, xs, m0, tout)
                h = min(TILE_M, r1 - m0)
            elif m0 + 4 <= r1:
                _tile4(wp, sdm, xq, xs, m0, tout)
                h = 4
            else:
                _tile1(wp, sdm, xq, xs, m0, tout)
                h = 1
            for i in range(h):
                for l in range(nv):
                    out[m0 + i, n0 + l] = tout[i, l]
            m0 += h


@numba.njit(cache=True, parallel=True, error_model=ERR)
def _matvec_q4_gemm(x, w, sm, out, chunks):  # x (R, K) f32; w (N, K/2) u8, sm (N, 2G); out (R, N) f32
    R, K = x.shape
    groups = K // GROUP
    xq = np.empty((R, K), np.int8)  # unpadded: _blocks takes tiles of 4 and 1 rows
    xs = np.empty((R, 2 * groups), np.float32)
    _quantize_rows(x, xq, xs)
    blocks = (w.shape[0] + LANES - 1) // LANES
    chunks = max(1, min(chunks, blocks))
    c32 = w.view(np.uint32)
    for c in numba.prange(chunks):
        _blocks(c32, sm, xq, xs, out, c * blocks // chunks, (c + 1) * blocks // chunks, 0, R)


@numba.njit(cache=True, parallel=True, error_model=ERR)
def _rows_q4_gemm(x, w, sm, experts, groups, out, chunks):  # experts.py's _rows_q4 in this kernel's order
    R, K = x.shape
    xq = np.empty((R, K), np.int8)
    xs = np.empty((R, 2 * (K // GROUP)), np.float32)
    _quantize_rows(x, xq, xs)  # per row
    blocks = (w.shape[1] + LANES - 1) // LANES
    for t in numba.prange(len(experts) * chunks):
        i, c = t // chunks, t % chunks
        if groups[i + 1] > groups[i] and (c + 1) * blocks // chunks > c * blocks // chunks:
            _blocks(w[experts[i]].view(np.uint32), sm[experts[i]], xq, xs, out, c * blocks // chunks,
                    (c + 1) * blocks // chunks, groups[i], groups[i + 1])


# decode's q4 product (quant._matvec_q4's signature, for lowp and decode_layer): this kernel on a
# VNNI CPU, so that every row count adds a row's terms in one order (the decode note)
_matvec_q4 = _matvec_q4_gemm if Q4_GEMM else _matvec_q4_lanes


def fused_matvec_q4(x: np.ndarray, codes: np.ndarray, sm: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`matvec_q4` without its checks, for a caller that checked the weight once (a `Linear`)."""
    _matvec_q4(x, codes, sm, out, min(codes.shape[0], 4 * pool_threads()))
    return out


def matvec_q4(x: np.ndarray, codes: np.ndarray, sm: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ W.T`` for a few float32 rows x (R, K) and a q4 weight W (codes, sm): decode's product,
    output rows split over the rank's numba threads; x is rounded to int8 per group of 32
    (quant.py's activations note), so the result is within that rounding of the float32
    product; on a VNNI CPU this module's kernel (the decode note), else quant.py's."""
    check_f32("matvec_q4 x", x)
    check_q4(codes, sm)
    if x.ndim != 2 or x.shape[1] != 2 * codes.shape[1]:
        raise ValueError(f"matvec_q4: x {x.shape} does not fit W ({codes.shape[0]}, {2 * codes.shape[1]})")
    if out is None:
        out = np.empty((x.shape[0], codes.shape[0]), np.float32)
    return fused_matvec_q4(x, codes, sm, out)


def gemm_q4(x: np.ndarray, codes: np.ndarray, sm: np.ndarray) -> np.ndarray:
    """``x @ W.T`` (M, N) float32 for float32 x (M, K) and a q4 weight W (codes, sm) of K
    columns, on a CPU with AVX-512 VNNI (`Q4_GEMM`); the output blocks split over the rank's
    threads. x is rounded to int8 per group of 32 as decode's kernel rounds it (the module's
    note), so the result is within that rounding of the float32 product."""
    if not Q4_GEMM:
        raise RuntimeError("gemm_q4: needs AVX-512 VNNI and BW (kernels.Q4_GEMM); use dequant_matmul")
    check_f32("gemm_q4 x", x)
    check_q4(codes, sm)
    N, K = codes.shape[0], 2 * codes.shape[1]
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"gemm_q4: x {x.shape} does not fit W ({N}, {K}); expected (M, {K})")
    return fused_gemm_q4(x, codes, sm)


def fused_gemm_q4(x: np.ndarray, codes: np.ndarray, sm: np.ndarray) -> np.ndarray:
    """`gemm_q4` without its checks, for a caller that checked the weight once (a `Linear`)."""
    M, N, K = x.shape[0], codes.shape[0], x.shape[1]
    groups = K // GROUP
    rows = -(-M // TILE_M) * TILE_M
    xq = np.empty((rows, K), np.int8)
    xs = np.empty((rows, 2 * groups), np.float32)
    _quantize_rows(x, xq, xs)
    out = np.empty((M, N), np.float32)
    blocks = -(-N // LANES)
    parts = max(1, min(pool_threads(), blocks))
    cuts = [blocks * p // parts for p in range(parts + 1)]
    c32 = codes.view(np.uint32)
    run_parts(_blocks, [(c32, sm, xq, xs, out, a, b, 0, M) for a, b in zip(cuts, cuts[1:]) if b > a])
    return out
