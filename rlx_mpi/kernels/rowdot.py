"""Decode's dot products written as LLVM vector IR (numba intrinsics): one weight row against a
few activation rows, for the matvecs of matvec.py (float32, bf16, f16) and lowp.py (int8).

``row_dots(w, n, x, r0, k, ahead)`` -> a tuple of ROWS float32: ``w[n, :k] . x[r, :k]`` for r in
r0 .. r0+ROWS-1, w (N, K) float32, bfloat16 bits (uint16) or float16 bits (read as int16: LLVM's
fpext from half, one vcvtph2ps per 8 weights with F16C), x (R, K) float32, k a multiple of
STEP (the caller adds the columns past it), ``ahead`` how many weights past the ones being read
to prefetch (the prefetch note; both kinds take it). Each weight
vector is loaded (and for bf16 widened) once and multiplied into ROWS x 2 float32 accumulators
of 8 lanes, 16 where the CPU has AVX-512 (the vector width note; fused multiply-adds; two per row
hide their latency). Written as numba loops, the
product over each activation row re-read the weight row and kept one accumulator chain per row,
which made a few-row matvec load-bound (measurements: bench/README.md, "Vector-IR dot products").

numba's on-disk cache keys a kernel on its own file: kernels/_fresh.py drops every kernel cache
when any kernel source changed, or lowp.py, matvec.py and decode_layer.py would keep the old IR.

``row_dots2(w, n, x, r0, k, ahead)``: the same for weight rows n and n+1 at once, a tuple of
2 x ROWS float32, ``sums[j * ROWS + i]`` = row n+j against activation row r0+i (the tile note).
``row_dot``: the same for one activation row (a 1-tuple; matvec.py uses it for f16 alone).

``row_dots_i8(w, n, x, r0, ws, xs, blocks, ahead)`` -> a tuple of ROWS float32: for each activation
row r0 .. r0+ROWS-1, the sum over the first ``blocks`` blocks of weight row n of
``((w[n, block] . x[r, block] in int32) * xs[r, b]) * ws[n, b]`` (lane-wise: the int8 tile note).
w (N, K) int8, x (R, K) int16, ws (N, nb) and xs (R, nb) float32, all C-contiguous (typing
refuses any other layout); the caller keeps n < N, r0 + ROWS <= R and blocks * INT8_BLOCK <= K
(no bounds checks here). ``row_tile_i8``: the same for weight rows n .. n+I8_TILE_W-1 at once,
``sums[j * ROWS + i]`` = row n+j against activation row r0+i.

Note: why IR and not a numba loop. Written as numba loops (lowp.py's history), LLVM vectorised
each 64-weight block to 128-bit ``vpmaddwd`` (it picks the width from the int32 multiply's cost)
and summed every block's lanes to one scalar before applying the block's scale. Here the block
is four 16-lane steps, ``sext`` to i32, multiply, and the sum of even and odd lanes: the pattern
LLVM's x86 back end turns into one 256-bit ``vpmaddwd`` on AVX2 (and into whatever the target
has elsewhere: nothing x86-specific is named). A block's 8 int32 lanes are converted to float32
and scaled lane-wise into 8 float32 accumulators; the horizontal sum is taken once per row. The
weights' sign-extension is shared by ROWS activation rows. Measured (2-core EPYC znver3,
1 thread, medium shapes, against the numba-loop kernel it replaced, same run): the compute rate
with the weights in L2 16 vs 13 GB/s at 1 row, 1.5x at 4 rows; from DRAM (115 MB) 1.0-1.1x at 1
row (both are then at the core's read bandwidth), 1.5x at 4 rows.

Note: the tile. From 4 activation rows on, the float matvecs take weight rows three at a time
(`FLOAT_TILES`, four where the vectors are AVX-512's: the vector width note; a chunk's last
rows a narrower tile of the same kind): each activation vector
loaded feeds three FMAs (7 loads per 12 FMAs; one weight row: 5 per 4), one accumulator per
(weight row, activation row), 12 chains, which with the 3 weight vectors and 1 activation vector
fill AVX2's 16 registers. Two weight rows (8 chains, 6 loads per 8 FMAs) against one, kernel
alone, weights from DRAM (30 x 11.5 MB), both with the prefetch: 1 thread 1.02x at 4 rows, 1.19x
at 8, 1.34x at 16, 1.45x at 24; 2 threads 1.11x, 1.19x, 1.39x, 1.41x. Three against two (the
medium decode step's matrices, 789 MB, f32): 1 thread 1.13x at 8 rows, 1.09x at 16, 1.18x at
32 (61 GFLOP/s, about 60 % of the core's FMA peak); 2 threads 1.02-1.13x at 4-48 rows; bf16
1.02-1.12x. Tiles of 2 x 6 rows (0.84-1.11x), 4 x 3 (0.66-0.75x: the 16 registers spill) and
4 x 2 (0.94-1.00x) were slower. Fewer than 4 activation rows keep numba's one-row loop (the
prefetch note).

Note: the vector width. The float dot products were written for AVX2 (8-lane vectors, 16
registers). Where numba compiles for AVX-512 (`target_has("avx512f")`) they take 16-lane vectors
and 32 columns a step (STEP), and prefetch each 64-byte line of a step; elsewhere nothing
changed. Measured on a 2-core Xeon VM with AVX-512 (medium, whole decode step, `ab_decode.py`
against 8 lanes, 5-7 rounds): f32 batch 4 1.00-1.01x, 8 1.04x, 16 1.07-1.09x, 32 1.09-1.10x, 64
1.02x (2 threads); bf16 batch 4 1.05-1.06x, 8 1.02-1.12x, 16 1.02-1.04x, 32 1.02-1.07x, 64 1.19x;
f16 batch 1 (its lone row is `row_dot`) 1.18x / 1.11x (1 / 2 threads); logits within 5e-6. With 32
registers the tile then takes four weight rows (TILE_W: 16 accumulators, 4 + 1
vectors loaded per 16 FMAs; the chunk's last three go to `row_dots3`), against 16-lane 3 x 4 in
the same runs: f32 batch 4-8 0.98-1.04x, 16 1.05x, 32 1.07-1.10x, 64 1.05x; bf16 8 1.00-1.02x,
16 1.02-1.03x, 32 1.06x.

Note: the prefetch. Every step of a dot product also asks for the weights ``ahead`` elements
further on (`llvm_ir.prefetch_line`, LLVM's ``llvm.prefetch``: a hint, never a fault); the callers pass
AHEAD_BYTES' worth for a weight row's first group of activation rows and 0 (the line already
being read) for the others. Timed with the weights in DRAM, a few-row matvec took the time of
its reads plus the time of its arithmetic, as if the two never overlapped (1 thread, 8 rows,
30 x 11.5 MB: 0.029 s of reads at the 1-row rate plus 0.047 s of products at the in-cache rate
= 0.076 s, measured 0.078): the hardware prefetcher does not run far enough ahead of a loop
that spends this long on each 4 kB row. 16-32 kB ahead was best (kernel alone, 1 thread: 4 rows
1.25x, 8 rows 1.1x, 16 rows 1.15x). The whole decode step against the code before the prefetch
and the tile (medium, in process, `bench/ab_decode.py --batch`, 9 rounds, caches built fresh):
int8 (prefetch alone) batch 1 1.13x (1 thread) / 1.18x (2 threads), batch 8 1.09x (2 threads);
f32 with the tile batch 4 1.15x (1 thread), batch 8 1.17x / 1.25x, batch 16 1.24x (2 threads);
bf16 batch 8 1.23x / 1.24x; f32 and bf16 batch 1 1.02x / 1.01x at 1 thread. The single-row
f32/bf16 loops stay numba's own: as IR with the prefetch they were still 0.96-0.98x.

Note: the bf16 dot. On a CPU with AVX512-BF16 (BF16_DOT: Zen 4, Sapphire Rapids, Cooper Lake)
1-3 activation rows against bf16 weights are rounded to bf16 once per matvec (nearest even,
`bits.pack_bf16`) and multiplied by ``vdpbf16ps`` (`BF16_TILES`): 32 products per instruction
summed in float32, where the widening path spends a shift and an FMA per 8 lanes. This is what
llama.cpp's bf16 GGUF does (it rounds the activations too). Measured on a 2-core EPYC znver4 VM
(read bandwidth 26 GB/s on 1 thread), against the widening path in the same run: the medium
model's matrices alone (411 MB) 1.26-1.41x on 1 thread (18.7 -> 23.5-24.5 GB/s), 1.09-1.12x on 2
(27.7 -> 31 GB/s); the whole decode step at batch 1 (`bench/ab_decode.py`, 7 rounds) 1.34x /
1.18x. Accuracy of bf16 decode against f32, teacher-forced over 1024 positions of the medium
model: top-1 agreement 0.989 (0.988 before), mean KL 4.4e-5 (2.9e-5 before; llama.cpp's bf16
4.5e-5 on its own 1016 positions). The tile (4+ rows) keeps float32 activations: the rows'
products are exact in the bf16 weights, as prefill's are.

Note: the bf16 FMA (issue 36). ``vdpbf16ps`` ran at ~2 cycles an instruction on the 2-core Xeon
VM, so prefill's bf16 panels topped out at ~114 GFLOP/s against the ~160 OpenBLAS made of
dequantised float32 tiles (0.69-0.70x at 512 rows). `_dp_steps` now takes the same operations
with float32 fused multiply-adds: a bf16 pair in a 32-bit lane is two exact float32 values (the
odd column: the lane AND 0xFFFF0000; the even one: the lane shifted left 16), a bf16 x bf16
product is exact in float32, so ``fma(odd_w, odd_x, acc)`` then ``fma(even_w, even_x, acc)`` is
``vdpbf16ps``'s lane, rounded as it rounds (nearest even, each add once), except that it keeps
subnormals where the instruction flushes them. The activations are laid out once per product
(matvec's `_operand`: per 32 columns the 16 odd, then the 16 even, as float32), so a step loads
them with no shuffle; each weight vector is split once for every activation row of the tile.
Every path (decode's tiles, prefill's panels and their column-block parts) takes these steps, so
a row's bits still do not depend on its neighbours. Measured (quiet, 1 thread, medium's four
products, old = dequantised tiles through OpenBLAS): 114 -> 133 GFLOP/s splitting the
activations in registers, 154-179 laid out beforehand: 1.38-1.48x at 128 rows, 0.97-1.20x at
512; whole model (`bench/bench_invariance.py`, old = before invariance): bf16 prefill 512 0.82 ->
0.98x (1 thread), 0.93 -> 1.10x (2), prefill 128 1.38x / 1.66x, decode 1.10-1.19x.

Note: invariance (issue 36, docs/invariance.md). A row's product must not depend on the rows
beside it, the row count's path or the threads. Every float tile (`FLOAT_TILES`, `WIDE_TILES`,
`BF16_TILES`; any rows x weight rows) computes each element the same way: one accumulator of
FLANES lanes (bf16 x bf16: 16), a fused multiply-add per step in column order (``llvm.fma``: not
left to contraction), the lanes summed by one tree (`reduce_lanes`, without fast-math flags, so
LLVM keeps it as written), the columns past the last step added one at a time after
(matvec.py's `_tail`). Which tile takes an element, which thread's chunk it falls in, and whether
it is decode's matvec or prefill's `matmul_float` then changes nothing. Before, a lone row took
LLVM's own loop (4 accumulators), 2-3 rows and a chunk's last weight row 2 accumulators, 4+ rows
one; prefill took our broadcast GEMM (one chain per element over all columns) or OpenBLAS, and bf16
rounded the activations for 1-3 rows only: one row's logits changed with the batch it shared.
bf16 on a BF16_DOT CPU now rounds every row's activations (the bf16 dot note). The int8 products
(`_make`) take the same fused multiply-add and lane tree for 1 and ROWS rows and the tile
(the int8 tile note). Measured: decode
unchanged (0.97-0.98x at batch 1, in process); prefill's products 0.79-0.93x the broadcast GEMM
they replace (128 rows, 64-byte aligned: _common's alignment note; docs/invariance.md) with the
6 x 4 wide tile, 1.03-1.07x (K = 1024) and 0.82x (K = 2816) at 128 rows, 0.86-0.95x / 0.79x
at 512 (against OpenBLAS) with the 8 x 3 panels that replaced it (matvec.py's panel note).

Note: the int8 tile (issue 36). Prefill's int8 products took `row_dots_i8`: 4 activation rows
against one weight row, 8 int32 lanes (256-bit ``vpmaddwd``), which re-read 2 bytes of activations
from L2 per multiply-add and ran at ~72 GFLOP/s on 1 thread at 512 rows against the 105-110 of
dequantised tiles through OpenBLAS it replaced (0.73x for a whole 512-token prefill). Now, on
AVX512BW, a block's int32 sums take 16 lanes (`_int_lanes`: one 512-bit ``vpmaddwd`` of 32 int16
per step, a 64-weight block in two steps, the second an ``llvm.x86.avx512.vpdpwssd`` where VNNI is
there: LLVM keeps it fused or splits it by its own cost model; the int32 sums are exact either
way), each lane is converted, multiplied by the activation row's block scale and added to its
float32 lane by one fused multiply-add with the weight row's scale; prefill takes ROWS x
I8_TILE_W (4 x 3) of these at once (12 accumulators; the weights' sign-extension shared by 4 rows,
each activation vector by 3 weight rows), decode the same elements 1 and ROWS rows at a time.
Every path computes a row's element by the same lanes, so a row's bits still do not depend on
its neighbours; they did change against the 8-lane kernel (a different lane split of the same
exact block sums: within the int16 rounding). The per-block work per (row, weight row) is now
6 vector operations per 64 multiply-adds (two ``vpmaddwd``, an add, a conversion, a multiply, an
FMA): the core's two vector ports bound it at ~21 multiply-adds a cycle. Measured (2-core Xeon,
AVX-512 VNNI, kernel alone, K = 1024 -> 2048 / 5632, 2816 -> 1024, 512 rows): 1 thread 72 -> 97-107
GFLOP/s (OpenBLAS tiles 104-112), 2 threads ~178 (OpenBLAS ~150-164); the activations' int16
rounding is split over the pool from _ACT_BLOCK rows (it took 1.5-4 ms serially). Whole model
(`bench/bench_invariance.py`, int8, old = before invariance, old / new time): prefill 512 0.73 ->
0.98 (1 thread), 0.91 -> 1.26 (2 threads); prefill 128 1.64 / 1.47; decode at batch 1 1.03 / 1.03,
8 prompts 1.05 / 1.10.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .llvm_ir import FLANES, I32, fma, idx, prefetch_line, reduce_lanes, reduce_vectors, rows_of, splat, target_has

INT8_BLOCK = 64  # weights per scale (lowp.INT8_BLOCK re-exports this one)
_LANES = 16  # int16 products per vector step: one 256-bit vpmaddwd
_HALF = _LANES // 2  # int32 / float32 accumulator lanes
AHEAD_BYTES = 16384  # how far past the weights being read row_dots asks for the next ones (the prefetch note)


def _int_lanes(block: int) -> int:
    """int32 (and float32) lanes of the int8 products' accumulators for blocks of ``block``
    weights: 16 where numba compiles for AVX512BW (one 512-bit ``vpmaddwd`` of 32 int16), else 8,
    never more than half a block (the int8 tile note)."""
    return min(16 if target_has("avx512bw") else _HALF, block // 2)


def _make(rows: int, block: int = INT8_BLOCK, wrows: int = 1):
    @intrinsic
    def row_dots(typingctx, w, n, x, r0, ws, xs, blocks, ahead):
        arrays = (w, x, ws, xs)
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
            return None
        if (w.dtype, x.dtype, ws.dtype, xs.dtype) != (types.int8, types.int16, types.float32, types.float32):
            return None
        sig = types.UniTuple(types.float32, rows * wrows)(w, n, x, r0, ws, xs, blocks, ahead)

        def codegen(context, builder, signature, args):
            wt, nt, xt, rt, wst, xst, bt, at = signature.args
            w_, n_, x_, r_, ws_, xs_, b_, a_ = args
            intp, row, n_, r_ = rows_of(context, builder, n_, nt, r_, rt)
            a_ = context.cast(builder, a_, at, types.intp)
            half = _int_lanes(block)  # int32 / float32 lanes; 2 * half int16 products a step
            lanes = 2 * half
            wps = [row(wt, w_, builder.add(n_, intp(j))) for j in range(wrows)]
            wsps = [row(wst, ws_, builder.add(n_, intp(j))) for j in range(wrows)]
            xps = [row(xt, x_, builder.add(r_, intp(i))) for i in range(rows)]
            xsps = [row(xst, xs_, builder.add(r_, intp(i))) for i in range(rows)]
            vi8, vi16 = ir.VectorType(ir.IntType(8), lanes), ir.VectorType(ir.IntType(16), lanes)
            vi32, hi32 = ir.VectorType(I32, lanes), ir.VectorType(I32, half)
            hf32 = ir.VectorType(ir.FloatType(), half)
            even, odd = idx(range(0, lanes, 2)), idx(range(1, lanes, 2))
            dpw = None
            if half == 16 and target_has("avx512vnni"):  # vpdpwssd: int16 pairs summed into int32, no saturation
                dpw = cgutils.get_or_insert_function(builder.module, ir.FunctionType(hi32, [hi32, vi16, vi16]),
                                                     "llvm.x86.avx512.vpdpwssd.512")
                madd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(hi32, [vi16, vi16]),
                                                      "llvm.x86.avx512.pmaddw.d.512")
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(hf32, [0.0] * half)) for _ in range(rows)]
                    for _ in range(wrows)]
            nb = context.cast(builder, b_, bt, types.intp)
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                base = builder.mul(b, intp(block))
                for wp in wps:
                    prefetch_line(builder, wp, builder.add(base, a_))  # a block is one 64-byte line (or less)
                isums = [[ir.Constant(hi32, [0] * half)] * rows for _ in range(wrows)]
                for j in range(block // lanes):
                    off = builder.add(base, intp(j * lanes))
                    wvs = [builder.sext(builder.load(builder.bitcast(builder.gep(wp, [off]), vi8.as_pointer()), align=1),
                                        vi16 if dpw else vi32) for wp in wps]
                    for i in range(rows):
                        xv = builder.load(builder.bitcast(builder.gep(xps[i], [off]), vi16.as_pointer()), align=2)
                        x32 = xv if dpw else builder.sext(xv, vi32)
                        for m in range(wrows):
                            if dpw:  # the same exact int32 sums, the add fused (the int8 tile note)
                                isums[m][i] = (builder.call(dpw, [isums[m][i], wvs[m], xv]) if j else
                                               builder.call(madd, [wvs[m], xv]))
                                continue
                            p = builder.mul(wvs[m], x32)
                            pair = builder.add(builder.shuffle_vector(p, p, even), builder.shuffle_vector(p, p, odd))
                            isums[m][i] = builder.add(isums[m][i], pair)
                xsvs = [splat(builder, builder.load(builder.gep(xsps[i], [b])), half) for i in range(rows)]
                for m in range(wrows):
                    wsv = splat(builder, builder.load(builder.gep(wsps[m], [b])), half)
                    for i in range(rows):
                        f = builder.fmul(builder.sitofp(isums[m][i], hf32), xsvs[i])  # (the int8 tile note)
                        builder.store(fma(builder, f, wsv, builder.load(accs[m][i])), accs[m][i])  # (the invariance note)
            sums = reduce_lanes(builder, [builder.load(accs[m][i]) for m in range(wrows) for i in range(rows)], half)
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return row_dots


ROWS = 4  # activation rows per call of row_dots_i8: 4 float and 4 int accumulators fit 16 ymm registers
row_dots_i8 = _make(ROWS)
row_dot_i8 = _make(1)  # the rows left over after steps of ROWS
# Blocks of 32 and 16 with their own scales: a checkpoint's q8 groups (GGUF's Q8_0 and Q6_K) held
# as they are (lowp's int8 note)
row_dots_i8_32, row_dot_i8_32 = _make(ROWS, 32), _make(1, 32)
row_dots_i8_16, row_dot_i8_16 = _make(ROWS, 16), _make(1, 16)
I8_TILE_W = 3  # weight rows of prefill's int8 tile (ROWS x I8_TILE_W; the int8 tile note)
row_tile_i8, row_tile_i8_32 = _make(ROWS, INT8_BLOCK, I8_TILE_W), _make(ROWS, 32, I8_TILE_W)


STEP = 2 * FLANES  # float32 columns per step of row_dots: two vectors


def _float_tile_types(w, x) -> bool:
    """Whether (w, x) are what the float tiles take: 2-D C arrays, w float32, bf16 bits (uint16)
    or f16 bits (int16), x float32."""
    return (all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (w, x))
            and w.dtype in (types.float32, types.uint16, types.int16) and x.dtype == types.float32)


def _dp_tile_types(w, x) -> bool:
    """Whether (w, x) are what the bf16 x bf16 tiles take: 2-D C arrays, w bf16 bits (uint16), x
    bf16 values as float32 in matvec's `_operand` layout."""
    return (all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (w, x))
            and (w.dtype, x.dtype) == (types.uint16, types.float32))


def _tile_rows(context, builder, signature, args, rows: int, wrows: int):
    """What every tile's codegen starts with (args w, n, x, r0 first): the intp maker, pointers
    to the wrows weight rows from n and the rows activation rows from r0."""
    wt, nt, xt, rt = signature.args[:4]
    w_, n_, x_, r_ = args[:4]
    intp, row, n_, r_ = rows_of(context, builder, n_, nt, r_, rt)
    wps = [row(wt, w_, builder.add(n_, intp(j))) for j in range(wrows)]
    xps = [row(xt, x_, builder.add(r_, intp(i))) for i in range(rows)]
    return intp, row, wps, xps


def _float_steps(builder, intp, wdtype, wps, xps, accs, k0, k1, ahead, prefetch: bool) -> None:
    """The float tiles' loop over columns k0 .. k1 (both multiples of STEP): each step two vectors
    of FLANES columns, each weight vector widened once and fused-multiply-added into the
    accumulator of every (weight row, activation row) in column order (the invariance note).
    ``accs[j][i]`` are allocas of <FLANES x float>; with ``prefetch`` every step also asks for
    the weights ``ahead`` elements further on (the prefetch note)."""
    bf16, f16 = wdtype == types.uint16, wdtype == types.int16
    f8 = ir.VectorType(ir.FloatType(), FLANES)
    w8 = ir.VectorType(ir.IntType(16), FLANES) if bf16 or f16 else f8
    steps = builder.sdiv(builder.sub(k1, k0), intp(STEP))
    with cgutils.for_range(builder, steps) as loop:
        base = builder.add(k0, builder.mul(loop.index, intp(STEP)))
        for wp in wps if prefetch else ():  # a step is 2 * FLANES weights of each row: 64 or 128 bytes
            for line in range(0, STEP, 16 if wdtype == types.float32 else 32):  # (f32), 32 or 64 (16-bit): each line
                prefetch_line(builder, wp, builder.add(base, builder.add(ahead, intp(line))))
        for u in range(2):
            off = builder.add(base, intp(u * FLANES))
            wvs = []
            for wp in wps:
                wv = builder.load(builder.bitcast(builder.gep(wp, [off]), w8.as_pointer()),
                                  align=2 if bf16 or f16 else 4)
                if bf16:  # the float32 with these top 16 bits: exact
                    wide = builder.zext(wv, ir.VectorType(I32, FLANES))
                    wide = builder.shl(wide, ir.Constant(ir.VectorType(I32, FLANES), [16] * FLANES))
                    wv = builder.bitcast(wide, f8)
                elif f16:  # IEEE half -> float32, exact for every pattern (x86: one vcvtph2ps, F16C)
                    wv = builder.fpext(builder.bitcast(wv, ir.VectorType(ir.HalfType(), FLANES)), f8)
                wvs.append(wv)
            for i, xp in enumerate(xps):
                xv = builder.load(builder.bitcast(builder.gep(xp, [off]), f8.as_pointer()), align=4)
                for j, wv in enumerate(wvs):
                    a = accs[j][i]
                    builder.store(fma(builder, wv, xv, builder.load(a)), a)


def _make_float(rows: int, wrows: int = 1, prefetch: bool = True):
    @intrinsic
    def row_dots(typingctx, w, n, x, r0, k, ahead):
        if not _float_tile_types(w, x):
            return None
        sig = types.UniTuple(types.float32, wrows * rows)(w, n, x, r0, k, ahead)

        def codegen(context, builder, signature, args):
            intp, _, wps, xps = _tile_rows(context, builder, signature, args, rows, wrows)
            k_ = context.cast(builder, args[4], signature.args[4], types.intp)
            a_ = context.cast(builder, args[5], signature.args[5], types.intp)
            f8 = ir.VectorType(ir.FloatType(), FLANES)
            # one accumulator per (weight row, activation row): the order of every element is the
            # same whatever the tile (the invariance note)
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(f8, [0.0] * FLANES)) for _ in range(rows)]
                    for _ in range(wrows)]
            _float_steps(builder, intp, signature.args[0].dtype, wps, xps, accs, intp(0), k_, a_, prefetch)
            sums = reduce_lanes(builder, [builder.load(accs[j][i]) for j in range(wrows) for i in range(rows)],
                                 FLANES)
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return row_dots


TILE_W = 4 if FLANES == 16 else 3  # weight rows per tile: four where AVX-512's 32 registers hold 16 accumulators
# The float products' tiles: FLOAT_TILES[(rows, wrows)] takes weight rows n..n+wrows-1 against activation
# rows r0..r0+rows-1, ``sums[j * rows + i]`` (the tile note); rows ROWS or 1, wrows 1..TILE_W. Each
# element of every one is the same chain of fused multiply-adds and the same lane tree.
FLOAT_TILES = {(r, w): _make_float(r, w) for r in (1, ROWS) for w in range(1, 5)}  # (4 on AVX2 too: compiled, never taken)
WIDE_ROWS = 6 if FLANES == 16 else 3  # prefill's tile: 6 x 4 accumulators of AVX-512's 32 registers (3 x 3 of AVX2's 16)
# (the first group of a weight block prefetches the weights from memory; the others read them from cache)
WIDE_TILES = {(p, w): _make_float(WIDE_ROWS, w, prefetch=p) for p in (True, False) for w in range(1, 5)}


# -- bf16 x bf16 dot products (AVX512-BF16) ------------------------------------------------------


# The bf16 x bf16 products of every row (the bf16 dot and bf16 FMA notes), on CPUs with AVX512-BF16:
# where llama.cpp's bf16 rounds the activations too. The steps are float32 FMAs (any AVX-512 CPU could
# take them); other CPUs keep the widening path, float32 activations.
BF16_DOT = target_has("avx512bf16")
DP_STEP = 32  # bf16 columns per step of the bf16 tiles: 16 lanes of bf16 pairs


def _dp_steps(builder, intp, wps, xps, accs, k0, k1, ahead, prefetch: bool) -> None:
    """The bf16 x bf16 tiles' loop over columns k0 .. k1 (both multiples of DP_STEP): each step
    32 columns, as ``vdpbf16ps`` orders them (lane l: columns 2l + 1, then 2l) but by two fused
    multiply-adds per (weight row, activation row) into the 16 float32 lanes of ``accs[j][i]``
    (allocas; the bf16 FMA note); with ``prefetch`` each weight row's line ``ahead`` elements
    further on is asked for (the prefetch note)."""
    i32 = ir.VectorType(I32, 16)
    f16 = ir.VectorType(ir.FloatType(), 16)
    high = ir.Constant(i32, [-65536] * 16)  # 0xFFFF0000: the odd column's bf16, as a float32
    sixteen = ir.Constant(i32, [16] * 16)

    def halves(v):  # <16 x i32> of bf16 pairs -> (odd columns, even columns) as float32, exact
        return builder.bitcast(builder.and_(v, high), f16), builder.bitcast(builder.shl(v, sixteen), f16)

    steps = builder.sdiv(builder.sub(k1, k0), intp(DP_STEP))
    with cgutils.for_range(builder, steps) as loop:
        off = builder.add(k0, builder.mul(loop.index, intp(DP_STEP)))
        wvs = []
        for wp in wps:  # a step is one 64-byte line of each weight row
            if prefetch:
                prefetch_line(builder, wp, builder.add(off, ahead))
            wvs.append(halves(builder.load(builder.bitcast(builder.gep(wp, [off]), i32.as_pointer()), align=2)))
        for i, xp in enumerate(xps):  # the activations: a step's 16 odd columns, then its 16 even ones
            xo = builder.load(builder.bitcast(builder.gep(xp, [off]), f16.as_pointer()), align=4)
            xe = builder.load(builder.bitcast(builder.gep(xp, [builder.add(off, intp(16))]), f16.as_pointer()), align=4)
            for j, (wo, we) in enumerate(wvs):
                a = accs[j][i]
                builder.store(fma(builder, we, xe, fma(builder, wo, xo, builder.load(a))), a)


def _make_bf16(rows: int, wrows: int):
    @intrinsic
    def row_dots_bf16(typingctx, w, n, x, r0, k, ahead):
        """`FLOAT_TILES`' tile for bf16 weights (uint16 bits) against `_operand`'s bf16-rounded
        activations, k a multiple of DP_STEP: `_dp_steps` (the bf16 FMA note). Only where BF16_DOT."""
        if not _dp_tile_types(w, x):
            return None
        sig = types.UniTuple(types.float32, wrows * rows)(w, n, x, r0, k, ahead)

        def codegen(context, builder, signature, args):
            intp, _, wps, xps = _tile_rows(context, builder, signature, args, rows, wrows)
            k_ = context.cast(builder, args[4], signature.args[4], types.intp)
            a_ = context.cast(builder, args[5], signature.args[5], types.intp)
            f16 = ir.VectorType(ir.FloatType(), 16)
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(f16, [0.0] * 16)) for _ in range(rows)]
                    for _ in range(wrows)]
            _dp_steps(builder, intp, wps, xps, accs, intp(0), k_, a_, True)
            sums = reduce_lanes(builder, [builder.load(accs[j][i]) for j in range(wrows) for i in range(rows)], 16)
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return row_dots_bf16


# bf16 weights' tiles against activations rounded to bf16, FLOAT_TILES' shapes (BF16_DOT only)
BF16_TILES = {(r, w): _make_bf16(r, w) for r in (1, ROWS, WIDE_ROWS) for w in range(1, 5)} if BF16_DOT else {}


# -- prefill's panels: the tiles with their sums stored as vectors ------------------------------


def _panel_steps(builder, intp, wdtype, wps, xps, accs, k0, k1, a_, dp: bool) -> None:
    """A panel's steps over columns k0 .. k1: with the weights prefetched ``a_`` on where a_ > 0,
    without where 0 (`_dp_steps` for bf16 x bf16, else `_float_steps`)."""
    with builder.if_else(builder.icmp_signed(">", a_, intp(0))) as (far, near):
        for block, prefetch in ((far, True), (near, False)):
            with block:
                if dp:
                    _dp_steps(builder, intp, wps, xps, accs, k0, k1, a_, prefetch)
                else:
                    _float_steps(builder, intp, wdtype, wps, xps, accs, k0, k1, a_, prefetch)


def _panel_sums(context, builder, intp, accs, aty, arr, lanes: int) -> None:
    """Reduce a panel's accumulators (`reduce_vectors`) and store the vectors as they are into
    the 1-D float32 array ``arr`` (of type ``aty``): sum j * rows + i at that index."""
    vecs = reduce_vectors(builder, [builder.load(a) for row_accs in accs for a in row_accs], lanes)
    out = context.make_array(aty)(context, builder, arr)
    vp = ir.VectorType(ir.FloatType(), lanes).as_pointer()
    for m, v in enumerate(vecs):
        builder.store(v, builder.bitcast(builder.gep(out.data, [intp(m * lanes)]), vp), align=4)


def _make_panel(rows: int, wrows: int, dp: bool = False):
    """Prefill's tile (matvec.py's panel note): ``panel(w, n, x, r0, k, sums, ahead)`` runs the
    steps of `_make_float` (``dp``: `_make_bf16`) over the first k columns of weight rows
    n .. n+wrows-1 and activation rows r0 .. r0+rows-1 and reduces each accumulator by the tiles'
    tree (`reduce_vectors`): the same bits as those tiles' sums (the invariance note). The tree
    leaves the sums lane by lane in a few vectors, which are stored as they are into ``sums`` (1-D
    float32, PANEL_SUMS long): element ``j * rows + i`` at ``sums[j * rows + i]``, where taking
    24 floats out of registers one by one and returning them as a tuple cost about a quarter of
    a 1024-column tile's time (measured in L1, 1 thread). ``ahead`` > 0: the steps prefetch the
    weights that far on; 0: no prefetch."""
    lanes = 16 if dp else FLANES

    @intrinsic
    def panel(typingctx, w, n, x, r0, k, sums, ahead):
        if not (_dp_tile_types(w, x) if dp else _float_tile_types(w, x)):
            return None
        if not (isinstance(sums, types.Array) and sums.ndim == 1 and sums.layout == "C" and sums.dtype == types.float32):
            return None
        sig = types.none(w, n, x, r0, k, sums, ahead)

        def codegen(context, builder, signature, args):
            intp, _, wps, xps = _tile_rows(context, builder, signature, args, rows, wrows)
            k_, a_ = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (4, 6))
            zero = ir.Constant(ir.VectorType(ir.FloatType(), lanes), [0.0] * lanes)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(rows)] for _ in range(wrows)]
            _panel_steps(builder, intp, signature.args[0].dtype, wps, xps, accs, intp(0), k_, a_, dp)
            _panel_sums(context, builder, intp, accs, signature.args[5], args[5], lanes)
            return context.get_dummy_value()

        return sig, codegen

    return panel


def _make_panel_part(rows: int, wrows: int, dp: bool = False):
    """`_make_panel` over the columns k0 .. k1 only (matvec.py's column blocks note):
    ``part(w, n, x, r0, k0, k1, state, sums, first, last, ahead)`` starts its accumulators at zero
    (``first``) or from ``state`` (1-D float32, wrows * rows * lanes: where the part before left
    them), runs the same steps, and then reduces them into ``sums`` as the panel does (``last``) or
    stores them back into ``state``. The parts of k0 = 0 .. k in order give the panel's bits: the
    same fused multiply-adds in the same order, the accumulators only parked in memory between."""
    lanes = 16 if dp else FLANES

    @intrinsic
    def part(typingctx, w, n, x, r0, k0, k1, state, sums, first, last, ahead):
        if not (_dp_tile_types(w, x) if dp else _float_tile_types(w, x)):
            return None
        for a in (state, sums):
            if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.float32):
                return None
        sig = types.none(w, n, x, r0, k0, k1, state, sums, first, last, ahead)

        def codegen(context, builder, signature, args):
            intp, _, wps, xps = _tile_rows(context, builder, signature, args, rows, wrows)
            k0_, k1_, a_ = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (4, 5, 10))
            first_, last_ = (context.cast(builder, args[i], signature.args[i], types.boolean) for i in (8, 9))
            vt = ir.VectorType(ir.FloatType(), lanes)
            zero = ir.Constant(vt, [0.0] * lanes)
            st = context.make_array(signature.args[6])(context, builder, args[6])
            vp = vt.as_pointer()
            slots = [[builder.bitcast(builder.gep(st.data, [intp((j * rows + i) * lanes)]), vp) for i in range(rows)]
                     for j in range(wrows)]
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(rows)] for _ in range(wrows)]
            with builder.if_then(builder.not_(first_)):
                for j in range(wrows):
                    for i in range(rows):
                        builder.store(builder.load(slots[j][i], align=4), accs[j][i])
            _panel_steps(builder, intp, signature.args[0].dtype, wps, xps, accs, k0_, k1_, a_, dp)
            with builder.if_else(last_) as (done, park):
                with done:
                    _panel_sums(context, builder, intp, accs, signature.args[7], args[7], lanes)
                with park:
                    for j in range(wrows):
                        for i in range(rows):
                            builder.store(builder.load(accs[j][i]), slots[j][i], align=4)
            return context.get_dummy_value()

        return sig, codegen

    return part


# Prefill's panels (matvec.py's panel note): PANEL_ROWS activation rows x 1..PANEL_W weight rows
PANEL_ROWS, PANEL_W = (8, 3) if FLANES == 16 else (WIDE_ROWS, TILE_W)  # AVX-512: 24 of 32 registers; AVX2: the 3 x 3 tile
PANEL_SUMS = -(-PANEL_ROWS * PANEL_W // FLANES) * FLANES  # floats a panel stores: whole vectors
PANELS = {w: _make_panel(PANEL_ROWS, w) for w in range(1, PANEL_W + 1)}
BF16_PANELS = {w: _make_panel(PANEL_ROWS, w, dp=True) for w in range(1, PANEL_W + 1)} if BF16_DOT else {}
PANEL_PARTS = {w: _make_panel_part(PANEL_ROWS, w) for w in range(1, PANEL_W + 1)}
BF16_PANEL_PARTS = {w: _make_panel_part(PANEL_ROWS, w, dp=True) for w in range(1, PANEL_W + 1)} if BF16_DOT else {}
PANEL_STATE = PANEL_W * PANEL_ROWS * 16  # floats of a part's parked accumulators (16 lanes at most)


@intrinsic
def prefetch_l2(typingctx, a, start, lines):
    """Ask for ``lines`` 64-byte lines of C-contiguous ``a`` from its flat element ``start`` on, into
    L2 (``prefetcht1``; a hint that never faults)."""
    if not (isinstance(a, types.Array) and a.layout == "C"):
        return None
    sig = types.none(a, start, lines)

    def codegen(context, builder, signature, args):
        at, st, lt = signature.args
        arr = context.make_array(at)(context, builder, args[0])
        base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        first = builder.mul(context.cast(builder, args[1], st, types.intp), context.get_constant(types.intp, at.dtype.bitwidth // 8))
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]),
                                            "llvm.prefetch.p0i8")
        with cgutils.for_range(builder, context.cast(builder, args[2], lt, types.intp)) as loop:
            off = builder.add(first, builder.mul(loop.index, context.get_constant(types.intp, 64)))
            builder.call(fn, [builder.gep(base, [off]), ir.Constant(I32, 0), ir.Constant(I32, 2), ir.Constant(I32, 1)])
        return context.get_dummy_value()

    return sig, codegen
