"""Low-precision weights: bf16 / f16 / int8 / q4 formats (q4's kernels: quant.py), their decode matvecs and prefill tiles.

The fused matvecs split output rows over the rank's numba threads (compiled parallel); the
dequantise tiles and format conversions run on the calling thread.
"""

from __future__ import annotations

import numba
import numpy as np

from ._common import ERR, FAST, check_f32, pool_threads
from .bits import pack_bf16, unpack_bf16, unpack_f16
from .matvec import F32_MATVEC_ROWS, _matvec_float, matmul_float
from .q4gemm import _matvec_q4  # on a VNNI CPU the GEMM's kernel: one order at every row count (q4gemm's decode note)
from .quant import check_q4, dequant_tile_q4, dequantize_q4, pairs_f32
from .rowdot import (AHEAD_BYTES, I8_TILE_W, INT8_BLOCK, ROWS, row_dot_i8, row_dot_i8_16, row_dot_i8_32, row_dots_i8, row_dots_i8_16,
                     row_dots_i8_32, row_tile_i8, row_tile_i8_32)

__all__ = ["dequant_matmul", "fused_matvec", "kernel_weight", "check_weight", "dequantize", "to_bf16", "from_bf16", "quantize_int8",
           "int8_blocks", "int8_block", "INT8_BLOCK", "INT8_GROUPS", "WEIGHT_FORMATS", "matvec_rows"]

# Note: storage. bf16 is kept as its uint16 bit pattern (the top half of a float32: decoding
# is a shift), f16 as its uint16 bit pattern (numba has no float16 type on CPU): the tiles decode
# it with integer ops (bits.py; a 65536-entry table was measured 3x slower: a gather per weight
# does not vectorise), the fused matvec reads it as int16 (so typing tells it from bf16) and
# converts 8 weights per instruction in vector IR (rowdot.py: LLVM's fpext from half, F16C's
# vcvtph2ps on x86; exact for every half, Inf and NaN included), int8 as int8 with one float32 scale per block of INT8_BLOCK (64)
# consecutive weights of a row (see the int8 note below). Activations and accumulators stay
# float32, except inside the int8 decode product.
# Decode (a few activation rows) reads every weight once: the fused kernels below dequantise
# inside the dot product, ``numba.prange`` over output rows (the rank's pinned numba threads),
# so a bf16 matrix moves half the bytes of an f32 one and an int8 matrix a quarter. Prefill
# (many rows) is compute-bound: a tile of weight rows is dequantised into a reused float32
# buffer and handed to BLAS (measured faster than a numba GEMM, bench/bench_precision.py).


# Note: int8. A weight row is cut into blocks of INT8_BLOCK = 64 weights, each with its own
# float32 scale (max |w| / 127 over the block), like llama.cpp's q8_0 (blocks of 32 with an f16
# scale): on the medium shapes the matvec's error against float32 is 0.57-0.63% of the largest
# output, against 0.84-0.96% with one scale per row. At decode the activation row is quantised
# too, to int16 with one scale per block (q8_0 takes int8: 256x coarser), and each block's dot
# product is int8 x int16 -> int32, which LLVM turns into vpmaddwd (16 products and pairwise sums
# per instruction) only when the arithmetic is written in int32 (numba widens int arithmetic to
# int64 unless each step is cast back) and the block's trip count is at least 64 (at 32 the loop
# is unrolled to scalar multiplies, 10x slower). That loop, measured against the per-row kernel
# that converted each weight to float32 (medium shapes, 64 matrices, 200 MB, 1 thread): 1.03-1.05x
# at one activation row, 1.09x at 8. It is now vector IR (rowdot.py: 256-bit, the scales applied
# lane-wise, ROWS activation rows per weight load; its note has the measurements). Blocks are
# 64 wide, the last one of a row may be shorter (a numba loop); products stay below 2**31
# (64 * 127 * 32767).


def int8_blocks(k: int) -> int:
    """Scales per row of an int8 weight with ``k`` input columns: ceil(k / INT8_BLOCK)."""
    return -(-k // INT8_BLOCK)


# Note: q8 groups. A checkpoint's q8 groups (the contract in checkpoint.py: GGUF's Q8_0, 32 weights
# a scale, and Q6_K, 16) are int8 weights with blocks of 32 or 16: held as they are (no second
# quantization), their scales as float32 (an f16 scale, or Q6_K's d * sc, is exact in float32).
# The block is the row's width over its scales: ``int8_block``. The decode product takes the same
# vector IR with one or two 16-lane steps a block (rowdot's row_dots_i8_32 / _16) and rounds the
# activations to int16 per block of the same width; the blocks of 64 (our own quantizer) are the
# ones the notes here measured.
INT8_GROUPS = (INT8_BLOCK, 32, 16)  # block widths an int8 weight may have


def int8_block(k: int, scales: int) -> int:
    """Weights per scale of an int8 weight of ``k`` columns and ``scales`` scales a row: INT8_BLOCK
    when there are ceil(k / INT8_BLOCK) of them (the last block may be shorter), else k / scales
    (32 or 16, whole blocks); 0 when it is neither."""
    if scales == int8_blocks(k):
        return INT8_BLOCK
    block = k // scales if scales else 0
    return block if block in INT8_GROUPS and block * scales == k else 0


@numba.njit(cache=True, error_model=ERR)
def _quantize_rows_i16(x, xq, xs, block):  # x (R, K) f32 -> xq (R, K) int16, xs (R, nb) f32: per block
    _quantize_span_i16(x, xq, xs, block, 0, x.shape[0])


@numba.njit(cache=True, error_model=ERR)
def _quantize_span_i16(x, xq, xs, block, r0, r1):  # `_quantize_rows_i16` for rows r0 .. r1-1
    k_len = x.shape[1]
    for r in range(r0, r1):
        for b in range(xs.shape[1]):
            lo, hi = b * block, min(k_len, (b + 1) * block)
            peak = np.float32(0.0)
            for k in range(lo, hi):
                a = abs(x[r, k])
                if a > peak or a != a:  # (not max(): a NaN must win and stay, so the output is NaN too)
                    peak = a
            s = peak / np.float32(32767.0)  # NaN / Inf carried to the block's scale
            xs[r, b] = s
            inv = np.float32(1.0) / s if s > 0 and s < np.inf else np.float32(0.0)
            for k in range(lo, hi):
                xq[r, k] = np.int16(np.rint(x[r, k] * inv))


@numba.njit(cache=True)
def _dot_i8_i16_tail(w, n, x, r, ws, xs, b):  # the shorter last block b (of 64) of row n (by index: no views)
    isum = np.int32(0)
    for k in range(np.uint64(b * INT8_BLOCK), np.uint64(w.shape[1])):
        isum = np.int32(isum + np.int32(w[n, k]) * np.int32(x[r, k]))
    return np.float32(isum) * (ws[n, b] * xs[r, b])


@numba.njit(cache=True, inline="always")
def _one_row_i8(w, n, xq, r, scale, xs, full, ahead, block):  # one activation row's whole blocks of row n
    if block == INT8_BLOCK:
        return row_dot_i8(w, n, xq, r, scale, xs, full, ahead)[0]
    if block == 32:
        return row_dot_i8_32(w, n, xq, r, scale, xs, full, ahead)[0]
    return row_dot_i8_16(w, n, xq, r, scale, xs, full, ahead)[0]


@numba.njit(cache=True, parallel=True)
def _matvec_int8(x, w, scale, out, chunks):  # x (R, K) f32; w (N, K) int8, scale (N, nb); out (R, N) f32
    r_len, k_len = x.shape
    n_len = w.shape[0]
    nb = scale.shape[1]
    block = INT8_BLOCK if nb == (k_len + INT8_BLOCK - 1) // INT8_BLOCK else k_len // nb  # (int8_block)
    xq = np.empty((r_len, k_len), np.int16)  # x rounded to int16 per block, on the calling thread
    xs = np.empty((r_len, nb), np.float32)
    if r_len < _ACT_BLOCK:  # (decode: one thread's work)
        _quantize_rows_i16(x, xq, xs, block)
    else:  # prefill: each row on its own, split over the pool (serial, 10-15 % of a 512-row product on 2 threads)
        parts = max(1, min(chunks, r_len // 8))
        for c in numba.prange(parts):
            _quantize_span_i16(x, xq, xs, block, c * r_len // parts, (c + 1) * r_len // parts)
    full = k_len // block
    wide = block != 16  # the int8 tile's kinds (rowdot's int8 tile note)
    for c in numba.prange(chunks):
        n_lo, n_hi = c * n_len // chunks, (c + 1) * n_len // chunks
        tiled = n_hi - (n_hi - n_lo) % I8_TILE_W if wide else n_lo
        for a0 in range(0, r_len, _ACT_BLOCK):  # (many rows: a block of them against each weight row)
            a1 = min(r_len, a0 + _ACT_BLOCK)
            grouped = a1 - (a1 - a0) % ROWS
            for n in range(n_lo, tiled, I8_TILE_W):  # I8_TILE_W weight rows x ROWS activation rows a call
                for r in range(a0, grouped, ROWS):
                    ahead = AHEAD_BYTES if r == 0 else 0
                    if block == INT8_BLOCK:
                        tile = row_tile_i8(w, n, xq, r, scale, xs, full, ahead)
                    else:
                        tile = row_tile_i8_32(w, n, xq, r, scale, xs, full, ahead)
                    for m in range(I8_TILE_W):
                        for i in range(ROWS):
                            out[r + i, n + m] = tile[m * ROWS + i]
                for m in range(I8_TILE_W):
                    _rest_i8(w, n + m, xq, scale, xs, out, a0, a1, grouped, full, block)
            for n in range(tiled, n_hi):
                for r in range(a0, grouped, ROWS):  # ROWS activation rows share each weight load
                    ahead = AHEAD_BYTES if r == 0 else 0
                    if block == INT8_BLOCK:
                        sums = row_dots_i8(w, n, xq, r, scale, xs, full, ahead)
                    elif block == 32:  # a checkpoint's q8 groups (the q8 groups note)
                        sums = row_dots_i8_32(w, n, xq, r, scale, xs, full, ahead)
                    else:
                        sums = row_dots_i8_16(w, n, xq, r, scale, xs, full, ahead)
                    for i in range(ROWS):
                        out[r + i, n] = sums[i]
                _rest_i8(w, n, xq, scale, xs, out, a0, a1, grouped, full, block)


@numba.njit(cache=True, inline="always")
def _rest_i8(w, n, xq, scale, xs, out, a0, a1, grouped, full, block):  # weight row n: the rows past the groups, the short block
    for r in range(grouped, a1):  # the same element sums one row at a time (the invariance note)
        ahead = AHEAD_BYTES if r == 0 else 0
        out[r, n] = _one_row_i8(w, n, xq, r, scale, xs, full, ahead, block)
    if full < scale.shape[1]:  # a shorter last block
        for r in range(a0, a1):
            out[r, n] += _dot_i8_i16_tail(w, n, xq, r, scale, xs, full)


_ACT_BLOCK = 64  # activation rows (int16: 128 kB at K = 1024) walked against each weight row of a chunk


@numba.njit(cache=True)
def _dequant_bf16(w, start, out):  # rows start.. of w (N, K) uint16 -> out (n, K) f32
    bits = out.view(np.uint32)
    for i in range(out.shape[0]):
        unpack_bf16(w[start + i], bits[i])


@numba.njit(cache=True)
def _dequant_f16(w, start, out):
    bits = out.view(np.uint32)
    for i in range(out.shape[0]):
        unpack_f16(w[start + i], bits[i])


@numba.njit(cache=True)
def _dequant_int8(w, scale, start, out, block):  # scale (N, nb): one per ``block`` weights of a row
    for i in range(out.shape[0]):
        for k in range(out.shape[1]):
            out[i, k] = np.float32(w[start + i, k]) * scale[start + i, k // block]


@numba.njit(cache=True, parallel=True)
def _quantize_int8(w, q, scale):  # w (N, K) f32 -> q (N, K) int8, scale (N, nb) f32, symmetric per block
    k_len = w.shape[1]
    for n in numba.prange(w.shape[0]):
        for b in range(scale.shape[1]):
            lo, hi = b * INT8_BLOCK, min(k_len, (b + 1) * INT8_BLOCK)
            peak = np.float32(0.0)
            for k in range(lo, hi):
                peak = max(peak, abs(w[n, k]))
            s = peak / np.float32(127.0)
            scale[n, b] = s
            inv = np.float32(0.0) if s == 0 else np.float32(1.0) / s
            for k in range(lo, hi):
                q[n, k] = np.int8(np.rint(w[n, k] * inv))


WEIGHT_FORMATS = ("bf16", "f16", "int8", "q4")
_TILE_BYTES = 1 << 20  # f32 bytes of one dequantised tile: fits L2 beside BLAS's own panels


def check_weight(fmt: str, w: np.ndarray, scale: np.ndarray | None) -> None:
    """TypeError / ValueError saying what to pass unless ``w`` (and int8's ``scale``, q4's scale /
    minimum pairs) is a weight of ``fmt``."""
    if fmt == "q4":
        return check_q4(w, scale)
    want = {"bf16": np.uint16, "f16": np.uint16, "int8": np.int8}.get(fmt)
    if want is None:
        raise ValueError(f"weight format {fmt!r} is not one of {WEIGHT_FORMATS}")
    if w.ndim != 2 or w.dtype != want or not w.flags.c_contiguous:
        raise TypeError(f"{fmt} weight: expected a C-contiguous 2-D {np.dtype(want)} array, got "
                        f"{w.ndim}-D {w.dtype}; build it with kernels.to_bf16 / quantize_int8 "
                        "or np.float16(...).view(np.uint16)")
    if fmt == "int8":
        want_scale = (w.shape[0], int8_blocks(w.shape[1]))
        if scale is None or scale.ndim != 2 or scale.shape[0] != w.shape[0] or \
                not int8_block(w.shape[1], scale.shape[1]):
            raise ValueError(f"int8 weight: scale must have shape {want_scale} (one per {INT8_BLOCK} "
                             f"weights of a row; or one per 32 or 16, a checkpoint's q8 groups), got "
                             f"{None if scale is None else scale.shape}; build it with kernels.quantize_int8")
        check_f32("int8 scale", scale)


def kernel_weight(fmt: str, w: np.ndarray) -> np.ndarray:
    """``w`` as the fused kernels take it: f16 bits read as int16 (numba's typing then tells them
    from bf16's uint16 bits; see the storage note), every other format as stored. A view."""
    return w.view(np.int16) if fmt == "f16" else w


def fused_matvec(x: np.ndarray, w: np.ndarray, fmt: str, scale: np.ndarray | None, out: np.ndarray) -> np.ndarray:
    """`dequant_matmul`'s decode kernel into ``out`` (R, N) without its checks, for a caller that
    checked ``w`` once (`check_weight`; a `Linear` does at construction) and passes a float32
    C-contiguous x (R <= `matvec_rows`, R, K) and out. Per call the checks cost more than a small
    matrix's product (65 calls per token on the medium preset)."""
    chunks = min(w.shape[0], 4 * pool_threads())  # a few per thread: balanced
    if fmt == "int8":
        _matvec_int8(x, w, scale, out, chunks)
    elif fmt == "q4":
        _matvec_q4(x, w, scale, out, chunks)
    elif x.shape[0] > F32_MATVEC_ROWS:  # bf16 / f16 prefill: the team's tiles, the same values
        out[:] = matmul_float(x, kernel_weight(fmt, w))
    else:  # bf16 (uint16 bits: a shift) or f16 (int16 bits: a conversion), matvec.py's kernel
        _matvec_float(x, kernel_weight(fmt, w), out, chunks)
    return out


def dequant_matmul(x: np.ndarray, w: np.ndarray, fmt: str, scale: np.ndarray | None = None,
                   out: np.ndarray | None = None, fused: bool = True) -> np.ndarray:
    """``x @ W.T`` for a low-precision weight ``W`` (N, K) stored as ``fmt``: x (R, K) -> (R, N) f32.

    Every row count runs the fused dequantise-dot kernel (a row's value never depends on the
    rows beside it: the invariance note in rowdot.py); ``fused=False`` dequantises a tile of W
    at a time into a reused float32 buffer and calls BLAS. Either way no float32 copy of the
    whole of W exists. The fused int8 kernel also rounds x to int16 per block of
    INT8_BLOCK (a relative error of at most 1/65534 of the block's largest value; see the int8
    note); a non-finite x gives a non-finite output, as the float32 product would. ``fused=False`` forces the tiled path (tests,
    benches); both are exact for every f16 pattern, Inf and NaN included.
    """
    check_f32("dequant_matmul x", x)
    check_weight(fmt, w, scale)
    K = 2 * w.shape[1] if fmt == "q4" else w.shape[1]  # q4: two codes a byte
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"dequant_matmul: x {x.shape} does not fit W ({w.shape[0]}, {K}); expected (R, {K})")
    R, N = x.shape[0], w.shape[0]
    if out is None:
        out = np.empty((R, N), np.float32)
    if fused:  # every row count (the invariance note in rowdot.py; q4: q4gemm's decode note)
        return fused_matvec(x, w, fmt, scale, out)
    if fmt == "q4":
        scale = pairs_f32(scale)  # the tiles read float32 pairs: one conversion per product, not per tile
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
        elif fmt == "q4":
            dequant_tile_q4(w, scale, a, t)
        else:
            _dequant_int8(w, scale, a, t, int8_block(K, scale.shape[1]))
        p = part[:, :b - a]
        np.matmul(x, t.T, out=p)
        out[:, a:b] = p
    return out


# Note: the fused kernels' row limit. Up to `matvec_rows` activation rows a low-precision product
# takes the fused matvec (every weight read once, output rows split over numba's pool), above it
# dequantise + BLAS (the tiles are dequantised on the calling thread, so that path gains less from
# a second thread than the fused one, which splits all its work). Measured on the medium preset
# (2026-12-02, 2-core EPYC, in process, interleaved rounds), fused over dequantise + BLAS; a
# decode step of B rows (with the fused layer, which takes the same limit) | a prefill of B tokens:
#   bf16, 1 thread:  48 rows 1.04x | 0.94x;  64 0.90x;  96 0.83x
#   bf16, 2 threads: 40 2.4x;  48 1.95x;  64 1.47x | 1.13x;  96 1.05x;  128 1.08x | 0.87x
#   int8, 1 thread:  48 1.43x;  64 - | 1.38x;  96 1.11x | 1.12x;  128 1.00x
#   int8, 2 threads: 40 3.1x;  64 1.77x;  96 1.50x;  128 1.38x | 1.20x;  192 1.16x | 0.98x
#   f16, 1 thread:   16 1.39x;  32 1.09x | 1.04x;  48 0.99x | 0.88x
#   f16, 2 threads:  32 2.44x | 1.96x;  48 2.09x | 1.13x;  56 - | 0.99x;  64 1.08x | 0.92x
# (f16 since its matvec converts in vector IR, 2026-12-02; before, a numba loop of integer decodes
# and no fused layer, it took 8 / 32 rows.) A limit is the largest row count measured at >= 1.0x
# both ways (bf16 on 1 thread keeps 32, its old value, as 48 lost in prefill). It replaced one limit of 32 for every format and
# thread count, under which bf16 and int8 steps of 40-64 rows ran 1.5-3x slower on 2
# threads than they could. More threads than 2 likely favour the fused kernel further (not measured).
# With the 3-row tile (rowdot's tile note; 2026-12-02 10:40, same method, the limit's rows fused
# against one row fewer, which takes dequantise + BLAS), decode | prefill:
#   bf16, 1 thread:  33 1.37x;  48 1.10x | 1.09x;  64 0.94x
#   bf16, 2 threads: 65 1.41x;  80 1.48x;  96 1.17x | 1.14x;  128 1.06x | 0.99x;  160 1.01x
#   f16, 1 thread:   48 1.00x;  64 0.95x
#   f16, 2 threads:  64 1.53x | 1.12x;  96 1.08x | 0.86x
# so bf16 32 / 64 -> 48 / 96 and f16 48 -> 64 on 2 threads (int8 has a kernel of its own, unchanged).
# q4 (quant.py's kernel, medium's 4 matrices of a layer, kernel alone, in process, interleaved rounds,
# 2026-12-03 on a 2-core Xeon VM at load 6-7: a decision, not a figure), dequantise + BLAS time over
# the fused kernel's: 1 thread 16 rows 5.0x, 48 2.2x, 96 1.28x, 128 0.98x, 192 1.12x, 256 0.90x;
# 2 threads 32 2.8x, 96 3.1x, 128 4.0x, 192 2.2x, 256 6.2x, 384 2.7x (BLAS's threads suffer more
# from the load than numba's: to re-measure on a quiet host).
_MATVEC_ROWS = {"bf16": (48, 96), "f16": (32, 64), "int8": (96, 128), "q4": (128, 256)}  # (1 thread, 2 or more threads)


def matvec_rows(fmt: str, threads: int | None = None) -> int:
    """Up to how many activation rows a product with ``fmt`` weights runs the fused decode kernel
    rather than dequantise + BLAS, on ``threads`` (default: numba's pool's; see the note)."""
    one, more = _MATVEC_ROWS[fmt]
    return one if (threads or pool_threads()) <= 1 else more


def dequantize(w: np.ndarray, fmt: str, scale: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
    """float32 copy of ``W`` (or of its ``rows``): for embedding lookups and tests."""
    check_weight(fmt, w, scale)
    if fmt == "q4":
        return dequantize_q4(w, scale, rows)
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
        _dequant_int8(w, scale, 0, out, int8_block(w.shape[1], scale.shape[1]))
    return out


def to_bf16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16, same shape) of float32 ``x``, rounded to nearest even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16)
    pack_bf16(x.reshape(-1), out.reshape(-1))
    return out


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"from_bf16: expected uint16 bit patterns, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric block-wise int8: ``W[n, k] ~= scale[n, k // INT8_BLOCK] * q[n, k]`` with
    ``max|q| = 127`` in each block of INT8_BLOCK weights of a row (the last may be shorter)."""
    check_f32("quantize_int8 w", w)
    if w.ndim != 2:
        raise ValueError(f"quantize_int8: expected a 2-D weight (out, in), got shape {w.shape}")
    q = np.empty(w.shape, np.int8)
    scale = np.empty((w.shape[0], int8_blocks(w.shape[1])), np.float32)
    pool_threads()  # (the rank's share in this thread: `pool_threads`' note)
    _quantize_int8(w, q, scale)
    return q, scale

