"""Resident block formats and their matvecs: ``q4``, 4-bit codes in groups of 32 with a scale and
a minimum per group (the on-disk contract's q4 groups, and llama.cpp's Q4_0 / Q4_1 / Q4_K blocks,
land in it exactly).

A q4 weight W (N, K), K a multiple of GROUP, is held as

    codes (N, K // 2) uint8   byte j of a row: column 2j in its low nibble, 2j+1 in its high one
    sm    (N, 2 * K // 32)    per group b: sm[n, 2b] = scale, sm[n, 2b + 1] = minimum; float16 bit
                              patterns (uint16: our own quantizer, Q4_0, Q4_1) or float32 (Q4_K,
                              whose d * sc needs more than a half's 11 bits)

with ``W[n, k] = scale * code + minimum`` of the group, in float32. That is the checkpoint's
layout (checkpoint.py) as it is, with scale and minimum interleaved so that a group's pair is
one 4- or 8-byte read; nothing is repacked at load.

q4gemm's ``matvec_q4(x, codes, sm, out)`` is decode's product (few rows), ``dequantize_q4`` expands rows
to float32 (prefill's tiles, embedding lookups, tests), ``quantize_q4`` makes the format from
float32. On a CPU with AVX-512 VNNI the product runs q4gemm.py's kernel at every row count (its
decode note: one float order per element, issue 36); the lane-wise kernels here take it on other
CPUs, and each row of a MoE layer's experts (experts.py) everywhere.

Note: the nibble order. The contract puts columns 2j and 2j+1 in one byte (GGUF puts j and j+16
of a block). Rather than repack the weights, the decode kernel permutes the activation row once
per call (per group: the 16 even columns, then the 16 odd ones), so a group's low nibbles
multiply its first 16 activations and its high nibbles the next 16: the same two instructions
(an ``and`` and a shift) either way, and a repack at load would have to be undone for TP slices
and writes.

Note: the activations. As llama.cpp's Q4 x Q8 dot does, decode rounds the activation row to int8
per group of 32 (scale max|x| / 127) and takes each group's products in int32: on AVX-512 VNNI
one ``vpdpbusd`` multiplies a group's 32 unsigned codes by its 32 signed activations and sums
them by fours (`VNNI`); elsewhere the same sum is generic vector IR (codes and activations
widened, multiplied, pairs added: LLVM's ``vpmaddwd`` on AVX2). The minimum's part needs no
products: ``sum_k (s q_k + m) x_k = s * sum_k q_k x_k + m * sum_k x_k``, with sum_k x_k taken
once per group from the float32 activations. Each row is rounded on its own, so a row's result
never depends on the rows beside it. Against int16 activations (the int8 kernel's choice: the
same IR with vpmaddwd on 32 int16 lanes), measured 2026-12-03 on a loaded 2-core Xeon VM with
AVX512-VNNI (in process, interleaved rounds, medium's 64 decode matrices, 118 MB): int8 1.18x
faster at 1 row, 1.39x at 8 rows (1 thread); teacher-forced accuracy (small preset, 508
positions, every product through the decode kernel): mean KL against f32 0.0318 with int8
activations, 0.0310 with int16 (= the exact products of prefill's tiles); Q4_0's weights in the
same kernels 0.070. The 3 % of KL buys 18-39 % of speed: int8 kept.

Note: the pairs. Where the CPU has AVX-512 (BW, VNNI: `PAIRS`), the decode kernel takes two
groups a step: 32 bytes of codes become one 64-byte vector (both groups' low nibbles, then
their high ones), multiplied by the activations laid out to match (per pair of groups: the
first group's 16 even columns, the second's, then their odd columns) in one 512-bit
``vpdpbusd``; the two groups' scales are spread over its lanes and their minimum terms kept as
one 4-lane product (s0 d0, m0 sum0, s1 d1, m1 sum1). A row with an odd number of groups takes
its last one alone. Against one group a step (256-bit), whole decode step of the medium preset
in q4 (bench/ab_decode.py, 1 thread, in process, interleaved rounds, on a loaded 2-core Xeon VM:
a decision, not a figure): batch 1 0.95x and 1.06x in two runs, batch 8 1.28x. Elsewhere
(AVX2) one group a step, generic IR.

Note: scale and minimum (why not symmetric). Measured on 512 x 1024 Gaussian and Student-t
(3 dof) weights, groups of 32, relative RMS error of the dequantized weights: llama.cpp's Q4_0
(symmetric, code - 8, f16 scale max / -8) 0.0862 / 0.1261; min/max groups with an f16 scale and
minimum 0.0783 / 0.0999 (0.91x / 0.79x); then least-squares refits of the pair on the codes
(`_quantize_group`, kept per group only where the error falls) 1 pass 0.0750 / 0.0945, 2 passes 0.0735 /
0.0925, 4 passes 0.0726 / 0.0912 (0.84x / 0.72x of Q4_0). The minimum costs 0.5 bit per weight
(5.0 against 4.5: 0.156 of float32's bytes, within the issue's 0.16).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._common import ERR, FAST, check_f32, pool_threads
from .bits import f16_bits, f16_exact
from .llvm_ir import FAST_FLAGS, I32, hsum, idx, prefetch_line, rows_of, target_has
from .rowdot import AHEAD_BYTES, ROWS

__all__ = ["GROUP", "VNNI", "PAIRS", "check_q4", "q4_groups", "quantize_q4", "dequantize_q4", "pairs_f32",
           "q4_nbytes"]

GROUP = 32  # weights per scale and minimum (the contract's G)
VNNI = target_has("avx512vnni") and target_has("avx512vl")  # vpdpbusd on 256-bit vectors
PAIRS = VNNI and target_has("avx512bw")  # two groups a step in 512-bit vectors (the pairs note)


def q4_groups(k: int) -> int:
    """Groups per row of a q4 weight with ``k`` input columns (k a multiple of GROUP)."""
    return k // GROUP


def q4_nbytes(n: int, k: int, scale_bytes: int = 2) -> int:
    """Resident bytes of an (n, k) q4 weight: packed codes plus a scale and a minimum per group."""
    return n * (k // 2 + 2 * scale_bytes * q4_groups(k))


def check_q4(codes: np.ndarray, sm: np.ndarray | None) -> None:
    """TypeError / ValueError saying what to pass unless (codes, sm) is a q4 weight."""
    if codes.ndim != 2 or codes.dtype != np.uint8 or not codes.flags.c_contiguous:
        raise TypeError(f"q4 weight: expected C-contiguous 2-D uint8 codes, got {codes.ndim}-D {codes.dtype}; "
                        "build it with kernels.quantize_q4")
    k = 2 * codes.shape[1]
    want = (codes.shape[0], 2 * q4_groups(k))
    if sm is None or sm.shape != want or sm.dtype not in (np.uint16, np.float32) or not sm.flags.c_contiguous:
        got = None if sm is None else f"{sm.shape} {sm.dtype}"
        raise ValueError(f"q4 weight: scale/minimum must be C-contiguous {want} float16 bits (uint16) or float32 "
                         f"(a pair per {GROUP} weights of a row), got {got}; build it with kernels.quantize_q4")
    if k % GROUP:
        raise ValueError(f"q4 weight: {k} input columns are not a multiple of {GROUP}; hold this matrix as int8")


# -- from float32 and back ---------------------------------------------------------------------

def quantize_q4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, sm) of float32 ``w`` (N, K), K a multiple of GROUP: per group of 32 weights of a row
    the minimum and (max - min) / 15, both rounded to float16, each code the nearest of 0..15 under
    the rounded pair; then _REFITS least-squares refits of the pair (the scale note). A group
    holding NaN or Inf gets a non-finite pair (it stays visible). Rows over the pool's threads.

    Note: the speed. The same arithmetic in numpy (tests/test_quant.py keeps it as the reference,
    bit for bit: a group's sums are numpy's, eight running sums then pairs) took ~50 ns a weight
    in a job, 11 of the medium model's 12.7 s start-up at q4 from an f32 checkpoint (1 rank, the
    2-core AMD EPYC VM). On medium's 2816 x 1024 gate matrix there, the same runs: numpy 69-89 ns
    a weight, this kernel 10.2-12.0 at 1 thread (6-7x), 5.9-7.0 at 2. Each refit is ~2.5 ns of
    it: a group's sums stay scalar (their order is numpy's) and half its divisions too."""
    check_f32("quantize_q4 w", w)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"quantize_q4: expected a 2-D weight (out, in) with in a multiple of {GROUP}, got {w.shape}")
    n, k = w.shape
    codes = np.empty((n, k // 2), np.uint8)
    sm = np.empty((n, 2 * q4_groups(k)), np.uint16)
    if n:
        _quantize_q4(w, codes, sm, _REFITS, max(1, min(pool_threads(), n)))
    return codes, sm


_REFITS = 4  # least-squares passes after min/max (the scale note)


@numba.njit(cache=True, inline="always")
def _sum32(a):  # a (32,) float32 -> numpy's sum of it: eight running sums, then pairs (its pairwise_sum)
    r0, r1, r2, r3, r4, r5, r6, r7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
    for i in range(8, GROUP, 8):
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
    return ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))


@numba.njit(cache=True, inline="always")
def _fit(g, s32, m32, q):  # g (32,) f32, the rounded pair as float32 -> q (32,) the nearest codes 0..15
    for i in range(GROUP):
        c = np.rint((g[i] - m32) / s32) if s32 > 0 else np.float32(0.0)
        c = np.float32(0.0) if c != c else c  # (NaN -> 0, as np.nan_to_num; +-Inf clipped below)
        q[i] = np.uint8(min(max(c, np.float32(0.0)), np.float32(15.0)))


@numba.njit(cache=True, inline="always")
def _err(g, s32, m32, q, t):  # squared error of the group under (s32, m32, q); t (32,) scratch
    for i in range(GROUP):
        d = s32 * np.float32(q[i]) + m32 - g[i]
        t[i] = d * d
    return _sum32(t)


@numba.njit(cache=True, error_model="numpy", inline="always")
def _quantize_group(g, refits, q, q2, t, u):  # g (32,) f32 -> (scale bits, minimum bits); codes in q
    lo, hi, nan = g[0], g[0], False
    for i in range(GROUP):
        v = g[i]
        nan = nan or v != v
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    if nan:  # (np.min / np.max propagate NaN)
        lo, hi = np.float32(np.nan), np.float32(np.nan)
    sb, mb = f16_bits((hi - lo) / np.float32(15.0)), f16_bits(lo)
    s32, m32 = f16_exact(sb), f16_exact(mb)
    _fit(g, s32, m32, q)
    gm = _sum32(g) / np.float32(GROUP)
    for _ in range(refits):  # least squares of (scale, minimum) on the codes, codes again: kept where better
        for i in range(GROUP):
            t[i] = np.float32(q[i])
        qm = _sum32(t) / np.float32(GROUP)
        for i in range(GROUP):
            d = np.float32(q[i]) - qm
            t[i] = d * d
            u[i] = d * (g[i] - gm)
        var, cov = _sum32(t), _sum32(u)
        s_new = cov / var if var > 0 else s32
        s_new = s_new if s_new > 0 else s32  # codes stay 0..15 ascending
        m_new = gm - s_new * qm
        sb2, mb2 = f16_bits(s_new), f16_bits(m_new)
        s2, m2 = f16_exact(sb2), f16_exact(mb2)
        _fit(g, s2, m2, q2)
        if _err(g, s2, m2, q2, t) < _err(g, s32, m32, q, u):
            sb, mb, s32, m32 = sb2, mb2, s2, m2
            for i in range(GROUP):
                q[i] = q2[i]
    return sb, mb


@numba.njit(cache=True, parallel=True, error_model="numpy")
def _quantize_q4(w, codes, sm, refits, chunks):  # w (N, K) f32 -> codes (N, K/2) u8, sm (N, 2 K/32) u16 bits
    n_len, k_len = w.shape
    for c in numba.prange(chunks):
        q, q2 = np.empty(GROUP, np.uint8), np.empty(GROUP, np.uint8)
        g, t, u = np.empty(GROUP, np.float32), np.empty(GROUP, np.float32), np.empty(GROUP, np.float32)
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for b in range(k_len // GROUP):
                for i in range(GROUP):
                    g[i] = w[n, b * GROUP + i]
                sb, mb = _quantize_group(g, refits, q, q2, t, u)
                sm[n, 2 * b], sm[n, 2 * b + 1] = np.uint16(sb), np.uint16(mb)
                for j in range(GROUP // 2):
                    codes[n, b * (GROUP // 2) + j] = q[2 * j] | (q[2 * j + 1] << 4)


def pairs_f32(sm: np.ndarray) -> np.ndarray:
    """A q4 weight's scale / minimum pairs as float32 (float16 bits widened, exactly)."""
    return sm.view(np.float16).astype(np.float32) if sm.dtype == np.uint16 else sm


def dequantize_q4(codes: np.ndarray, sm: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """float32 ``W`` (or its ``rows``): ``scale * code + minimum`` per group, in float32."""
    check_q4(codes, sm)
    if rows is not None:
        rows = np.asarray(rows).reshape(-1)
        codes, sm = codes[rows], sm[rows]
    out = np.empty((codes.shape[0], 2 * codes.shape[1]), np.float32)
    _dequant_q4(codes, pairs_f32(np.ascontiguousarray(sm)), 0, out)
    return out


@numba.njit(cache=True, error_model=ERR)
def _dequant_q4(codes, sm, start, out):  # rows start.. of codes (N, K/2) u8, sm (N, 2nb) f32 -> out (n, K) f32
    for i in range(out.shape[0]):
        for j in range(codes.shape[1]):
            b = 2 * (j * 2 // 32)
            c = codes[start + i, j]
            s, m = sm[start + i, b], sm[start + i, b + 1]
            out[i, 2 * j] = s * np.float32(c & 15) + m
            out[i, 2 * j + 1] = s * np.float32(c >> 4) + m


def dequant_tile_q4(codes: np.ndarray, sm32: np.ndarray, start: int, out: np.ndarray) -> None:
    """Rows start.. of a q4 weight into ``out`` (n, K) float32; ``sm32`` its pairs as float32
    (`pairs_f32`, once per product): prefill's tile, as lowp's int8 one."""
    _dequant_q4(codes, sm32, start, out)



# -- decode: the activation row in int8 groups, the dot product as vector IR --------------------


@numba.njit(cache=True, error_model=ERR)
def _quantize_rows_q8(x, xq, xs):
    """x (R, K) f32 -> xq (R, K) int8, each group's 16 even columns then its 16 odd ones (the
    nibble-order note), or with PAIRS two groups' even columns then their odd ones (the pairs
    note); xs (R, 2nb) f32: per group the scale max|x| / 127 and the sum of x."""
    groups = xs.shape[1] // 2
    paired = groups - groups % 2 if PAIRS else 0
    for r in range(x.shape[0]):
        for g in range(groups):
            lo = g * 32
            peak = np.float32(0.0)
            total = np.float32(0.0)
            for k in range(lo, lo + 32):
                a = abs(x[r, k])
                total += x[r, k]
                if a > peak or a != a:  # a NaN must win and stay (lowp's int16 rounding does the same)
                    peak = a
            d = peak / np.float32(127.0)
            xs[r, 2 * g] = d
            xs[r, 2 * g + 1] = total
            inv = np.float32(1.0) / d if d > 0 and d < np.inf else np.float32(0.0)
            even, odd = lo, lo + 16
            if g < paired:  # (g // 2) * 64 + (g % 2) * 16 = lo - (g % 2) * 16
                even = lo - (g % 2) * 16
                odd = even + 32
            for j in range(16):
                xq[r, even + j] = np.int8(np.rint(x[r, lo + 2 * j] * inv))
                xq[r, odd + j] = np.int8(np.rint(x[r, lo + 2 * j + 1] * inv))


def _q4_operands(w, x, sm, xs) -> bool:
    """The operand types the q4 row-dot intrinsics compile for: C-contiguous 2-D w uint8 codes,
    x int8 activations, sm uint16 (f16 bits) or float32 scale/minimum pairs, xs float32."""
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (w, x, sm, xs)):
        return False
    return (w.dtype, x.dtype, xs.dtype) == (types.uint8, types.int8, types.float32) and \
        sm.dtype in (types.uint16, types.float32)


def _make_q4(rows: int):
    @intrinsic
    def row_dots_q4(typingctx, w, n, x, r0, sm, xs, first, groups, ahead):
        """For activation rows r0 .. r0+rows-1: sum over groups ``first`` .. ``groups`` - 1 of weight row n of
        ``sm_s * xs_d * (codes . xq in int32) + sm_m * xs_sum``. w (N, K/2) uint8, x (R, K) int8 (the
        permuted groups), sm (N, 2nb) uint16 (f16 bits) or float32, xs (R, 2nb) float32."""
        if not _q4_operands(w, x, sm, xs):
            return None
        half = sm.dtype == types.uint16
        sig = types.UniTuple(types.float32, rows)(w, n, x, r0, sm, xs, first, groups, ahead)

        def codegen(context, builder, signature, args):
            wt, nt, xt, rt, smt, xst, ft, gt, at = signature.args
            w_, n_, x_, r_, sm_, xs_, f_, g_, a_ = args
            intp, row, n_, r_ = rows_of(context, builder, n_, nt, r_, rt)
            a_ = context.cast(builder, a_, at, types.intp)
            wp, smp = row(wt, w_, n_), row(smt, sm_, n_)
            xps = [row(xt, x_, builder.add(r_, intp(i))) for i in range(rows)]
            xsps = [row(xst, xs_, builder.add(r_, intp(i))) for i in range(rows)]
            v16, v32 = ir.VectorType(ir.IntType(8), 16), ir.VectorType(ir.IntType(8), 32)
            i8x8, f8 = ir.VectorType(I32, 8), ir.VectorType(ir.FloatType(), 8)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(f8, [0.0] * 8)) for _ in range(rows)]
            maccs = [cgutils.alloca_once_value(builder, ir.Constant(ir.FloatType(), 0.0)) for _ in range(rows)]
            if VNNI:
                dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i8x8, [i8x8, v32, v32]),
                                                    "llvm.x86.avx512.vpdpbusd.256")
            first_ = context.cast(builder, f_, ft, types.intp)
            ng = builder.sub(context.cast(builder, g_, gt, types.intp), first_)
            with cgutils.for_range(builder, ng) as loop:
                g = builder.add(loop.index, first_)
                base = builder.mul(g, intp(16))  # a group's 32 codes are 16 bytes
                prefetch_line(builder, wp, builder.add(base, a_))
                cv = builder.load(builder.bitcast(builder.gep(wp, [base]), v16.as_pointer()), align=1)
                lo = builder.and_(cv, ir.Constant(v16, [15] * 16))
                hi = builder.lshr(cv, ir.Constant(v16, [4] * 16))
                codes = builder.shuffle_vector(lo, hi, idx(range(32)))  # even columns' codes, then odd ones'
                two = builder.mul(g, intp(2))
                if half:
                    pair = builder.load(builder.bitcast(builder.gep(smp, [two]),
                                                        ir.VectorType(ir.HalfType(), 2).as_pointer()), align=2)
                    pair = builder.fpext(pair, ir.VectorType(ir.FloatType(), 2))
                else:
                    pair = builder.load(builder.bitcast(builder.gep(smp, [two]),
                                                        ir.VectorType(ir.FloatType(), 2).as_pointer()), align=4)
                s = builder.extract_element(pair, ir.Constant(I32, 0))
                m = builder.extract_element(pair, ir.Constant(I32, 1))
                if not VNNI:
                    c32 = builder.zext(codes, ir.VectorType(I32, 32))
                for i in range(rows):
                    xoff = builder.mul(g, intp(32))
                    xv = builder.load(builder.bitcast(builder.gep(xps[i], [xoff]), v32.as_pointer()), align=1)
                    if VNNI:  # unsigned codes x signed activations, summed by fours into 8 int32 lanes
                        isum = builder.call(dp, [ir.Constant(i8x8, [0] * 8), codes, xv])
                    else:  # the same sums, generic: products in int32, pairs added twice (vpmaddwd on AVX2)
                        p = builder.mul(c32, builder.sext(xv, ir.VectorType(I32, 32)))
                        p = builder.add(builder.shuffle_vector(p, p, idx(range(0, 32, 2))),
                                        builder.shuffle_vector(p, p, idx(range(1, 32, 2))))
                        isum = builder.add(builder.shuffle_vector(p, p, idx(range(0, 16, 2))),
                                           builder.shuffle_vector(p, p, idx(range(1, 16, 2))))
                    d = builder.load(builder.gep(xsps[i], [two]))
                    xsum = builder.load(builder.gep(xsps[i], [builder.add(two, intp(1))]))
                    f = builder.fmul(s, d, flags=FAST_FLAGS)
                    fv = builder.insert_element(ir.Constant(f8, ir.Undefined), f, ir.Constant(I32, 0))
                    fv = builder.shuffle_vector(fv, fv, idx([0] * 8))
                    acc = builder.fadd(builder.load(accs[i]), builder.fmul(builder.sitofp(isum, f8), fv, flags=FAST_FLAGS),
                                       flags=FAST_FLAGS)
                    builder.store(acc, accs[i])
                    builder.store(builder.fadd(builder.load(maccs[i]), builder.fmul(m, xsum, flags=FAST_FLAGS), flags=FAST_FLAGS),
                                  maccs[i])
            sums = [builder.fadd(hsum(builder, builder.load(a), 8), builder.load(ma), flags=FAST_FLAGS)
                    for a, ma in zip(accs, maccs)]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return row_dots_q4


row_dots_q4 = _make_q4(ROWS)  # ROWS activation rows share each group's unpacked codes
row_dot_q4 = _make_q4(1)  # the rows left over after steps of ROWS


def _make_q4_pairs(rows: int):
    @intrinsic
    def row_dots_q4_pairs(typingctx, w, n, x, r0, sm, xs, pairs, ahead):
        """`row_dots_q4` over the first 2 * ``pairs`` groups, two groups a step in 512-bit vectors
        (PAIRS only: x in the pairs layout, the pairs note)."""
        if not _q4_operands(w, x, sm, xs):
            return None
        half = sm.dtype == types.uint16
        sig = types.UniTuple(types.float32, rows)(w, n, x, r0, sm, xs, pairs, ahead)

        def codegen(context, builder, signature, args):
            wt, nt, xt, rt, smt, xst, pt, at = signature.args
            w_, n_, x_, r_, sm_, xs_, p_, a_ = args
            intp, row, n_, r_ = rows_of(context, builder, n_, nt, r_, rt)
            a_ = context.cast(builder, a_, at, types.intp)
            wp, smp = row(wt, w_, n_), row(smt, sm_, n_)
            xps = [row(xt, x_, builder.add(r_, intp(i))) for i in range(rows)]
            xsps = [row(xst, xs_, builder.add(r_, intp(i))) for i in range(rows)]
            v32, v64 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(8), 64)
            i16, f16, f4 = ir.VectorType(I32, 16), ir.VectorType(ir.FloatType(), 16), ir.VectorType(ir.FloatType(), 4)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(f16, [0.0] * 16)) for _ in range(rows)]
            maccs = [cgutils.alloca_once_value(builder, ir.Constant(f4, [0.0] * 4)) for _ in range(rows)]
            dp = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16, [i16, v64, v64]),
                                                "llvm.x86.avx512.vpdpbusd.512")
            spread = idx([0] * 4 + [2] * 4 + [0] * 4 + [2] * 4)  # lanes' groups: g, g+1 even columns, g, g+1 odd
            with cgutils.for_range(builder, context.cast(builder, p_, pt, types.intp)) as loop:
                p = loop.index
                base = builder.mul(p, intp(32))  # two groups' codes: 32 bytes
                prefetch_line(builder, wp, builder.add(base, a_))
                cv = builder.load(builder.bitcast(builder.gep(wp, [base]), v32.as_pointer()), align=1)
                lo = builder.and_(cv, ir.Constant(v32, [15] * 32))
                hi = builder.lshr(cv, ir.Constant(v32, [4] * 32))
                codes = builder.shuffle_vector(lo, hi, idx(range(64)))  # both groups' even columns, then odd
                four = builder.mul(p, intp(4))
                if half:
                    pairs = builder.load(builder.bitcast(builder.gep(smp, [four]),
                                                         ir.VectorType(ir.HalfType(), 4).as_pointer()), align=2)
                    pairs = builder.fpext(pairs, f4)
                else:
                    pairs = builder.load(builder.bitcast(builder.gep(smp, [four]), f4.as_pointer()), align=4)
                for i in range(rows):
                    xv = builder.load(builder.bitcast(builder.gep(xps[i], [builder.mul(p, intp(64))]),
                                                      v64.as_pointer()), align=1)
                    isum = builder.call(dp, [ir.Constant(i16, [0] * 16), codes, xv])
                    xs4 = builder.load(builder.bitcast(builder.gep(xsps[i], [four]), f4.as_pointer()), align=4)
                    prod = builder.fmul(pairs, xs4, flags=FAST_FLAGS)  # s0 d0, m0 sum0, s1 d1, m1 sum1
                    scale = builder.shuffle_vector(prod, prod, spread)
                    acc = builder.fadd(builder.load(accs[i]), builder.fmul(builder.sitofp(isum, f16), scale, flags=FAST_FLAGS),
                                       flags=FAST_FLAGS)
                    builder.store(acc, accs[i])
                    builder.store(builder.fadd(builder.load(maccs[i]), prod, flags=FAST_FLAGS), maccs[i])
            sums = []
            for a, ma in zip(accs, maccs):
                m = builder.load(ma)
                mins = builder.fadd(builder.extract_element(m, ir.Constant(I32, 1)),
                                    builder.extract_element(m, ir.Constant(I32, 3)), flags=FAST_FLAGS)
                sums.append(builder.fadd(hsum(builder, builder.load(a), 16), mins, flags=FAST_FLAGS))
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return row_dots_q4_pairs


row_dots_q4_pairs = _make_q4_pairs(ROWS)
row_dot_q4_pairs = _make_q4_pairs(1)


@numba.njit(cache=True, fastmath=FAST)
def _q4_dots(w, n, xq, r, sm, xs, groups, ahead):  # ROWS rows' sums over every group (the pairs note)
    if PAIRS:
        pairs = groups // 2
        sums = row_dots_q4_pairs(w, n, xq, r, sm, xs, pairs, ahead)
        if groups % 2:
            tail = row_dots_q4(w, n, xq, r, sm, xs, groups - 1, groups, 0)
            return (sums[0] + tail[0], sums[1] + tail[1], sums[2] + tail[2], sums[3] + tail[3])
        return sums
    return row_dots_q4(w, n, xq, r, sm, xs, 0, groups, ahead)


@numba.njit(cache=True, fastmath=FAST)
def _q4_dot(w, n, xq, r, sm, xs, groups, ahead):  # one row's sum over every group
    if PAIRS:
        total = row_dot_q4_pairs(w, n, xq, r, sm, xs, groups // 2, ahead)[0]
        if groups % 2:
            total += row_dot_q4(w, n, xq, r, sm, xs, groups - 1, groups, 0)[0]
        return total
    return row_dot_q4(w, n, xq, r, sm, xs, 0, groups, ahead)[0]


@numba.njit(cache=True, parallel=True, fastmath=FAST)
def _matvec_q4(x, w, sm, out, chunks):  # x (R, K) f32; w (N, K/2) u8, sm (N, 2nb); out (R, N) f32
    r_len, k_len = x.shape
    n_len = w.shape[0]
    groups = sm.shape[1] // 2
    xq = np.empty((r_len, k_len), np.int8)  # x in int8 groups, on the calling thread
    xs = np.empty((r_len, 2 * groups), np.float32)
    _quantize_rows_q8(x, xq, xs)
    grouped = r_len - r_len % ROWS
    for c in numba.prange(chunks):
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(0, grouped, ROWS):
                sums = _q4_dots(w, n, xq, r, sm, xs, groups, AHEAD_BYTES if r == 0 else 0)
                for i in range(ROWS):
                    out[r + i, n] = sums[i]
            for r in range(grouped, r_len):
                out[r, n] = _q4_dot(w, n, xq, r, sm, xs, groups, AHEAD_BYTES if r == 0 else 0)
