"""LLVM-IR building blocks of the kernels written as numba intrinsics (rowdot's dot products, quant's
and q4gemm's q4 products, attention's value sums): the target's features and vector width, index
vectors, a prefetch, an array row's pointer, a splat, a fused multiply-add and lane sums.

Named ``llvm_ir``, not ``ir``: the modules that use it also import llvmlite's ``ir``. Plain Python
that emits IR at compile time; nothing here runs in a kernel by itself.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types

__all__ = ["I32", "FAST_FLAGS", "FLANES", "target_has", "idx", "hsum", "prefetch_line", "rows_of", "splat", "fma",
           "reduce_vectors", "reduce_lanes"]

I32 = ir.IntType(32)
FAST_FLAGS = ("reassoc", "contract")  # an fadd / fmul LLVM may reassociate (never on an invariant row's path)


def target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with ``feature`` (an LLVM feature name): the host's
    features, unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name another target."""
    from llvmlite import binding
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return f"+{feature}" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME not in (None, "host"):
        return False
    return bool(binding.get_host_cpu_features().get(feature))


FLANES = 16 if target_has("avx512f") else 8  # float32 lanes of the float vectors: a zmm or a ymm (rowdot's vector width note)


def idx(values) -> ir.Constant:
    """<n x i32> holding ``values`` (a shuffle's lane indices)."""
    return ir.Constant(ir.VectorType(I32, len(values)), list(values))


def hsum(builder, v, width: int):  # <width x float> -> float, pairwise, reassociable (FAST_FLAGS)
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(v, v, idx(range(width)))
        hi = builder.shuffle_vector(v, v, idx(range(width, 2 * width)))
        v = builder.fadd(lo, hi, flags=FAST_FLAGS)
    return builder.extract_element(v, ir.Constant(I32, 0))


def prefetch_line(builder, ptr, index, locality: int = 3) -> None:
    """Ask for the cache line holding ptr[index] (a read; ``locality`` 3: kept in every level,
    2: from L2 on, ``prefetcht1``): a hint that never faults, so an index past the array's end is
    harmless."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(builder.gep(ptr, [index]), i8p), ir.Constant(I32, 0), ir.Constant(I32, locality),
                      ir.Constant(I32, 1)])


def rows_of(context, builder, n, n_type, r, r_type):
    """What both kinds of intrinsic start with: an intp constant maker, ``row(array type, array,
    i)`` -> a pointer to ``array[i, 0]``, and the weight row n and first activation row r as intp."""
    def intp(v):
        return context.get_constant(types.intp, v)

    def row(aty, a, i):
        arr = context.make_array(aty)(context, builder, a)
        return cgutils.get_item_pointer(context, builder, aty, arr, [i, intp(0)], wraparound=False)

    return intp, row, context.cast(builder, n, n_type, types.intp), context.cast(builder, r, r_type, types.intp)


def splat(builder, value, lanes: int):
    """<lanes x float> holding ``value`` in every lane."""
    t = ir.VectorType(value.type, lanes)
    v = builder.insert_element(ir.Constant(t, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, idx([0] * lanes))


def fma(builder, a, b, c):
    """a * b + c rounded once (``llvm.fma``): the same bits on every path, where contraction of an
    fmul and an fadd is the optimiser's choice (rowdot's invariance note)."""
    t = a.type
    name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]), name)
    return builder.call(fn, [a, b, c])


def reduce_vectors(builder, vectors: list, lanes: int) -> list:
    """The lane sums of ``vectors`` (each <lanes x float>), every one by `hsum`'s tree (lane i
    with i + lanes/2, then i + lanes/4, ...), taken for many vectors at once: each level pairs two
    vectors' halves into one vector (2 shuffles and 1 add per pair), so 16 sums cost 45 operations,
    not 16 x 12. Returns ceil(len / lanes) vectors: the sum of input m in lane m % lanes of
    vector m // lanes."""
    f = ir.VectorType(ir.FloatType(), lanes)
    vs = list(vectors)
    group = lanes  # lanes per vector of the list that still belong to one input
    while group > 1:
        if len(vs) % 2:
            vs.append(ir.Constant(f, [0.0] * lanes))
        half = group // 2
        lo_idx = [b + i for b in range(0, lanes, group) for i in range(half)]
        hi_idx = [b + half + i for b in range(0, lanes, group) for i in range(half)]
        nxt = []
        for a, b in zip(vs[0::2], vs[1::2]):
            lo = builder.shuffle_vector(a, b, idx(lo_idx + [lanes + i for i in lo_idx]))
            hi = builder.shuffle_vector(a, b, idx(hi_idx + [lanes + i for i in hi_idx]))
            nxt.append(builder.fadd(lo, hi))  # (no fast-math flags: this tree, as written)
        vs, group = nxt, half
    # vs[m] lane l holds input m * lanes + l (each level keeps pairs in order)
    return vs


def reduce_lanes(builder, vectors: list, lanes: int) -> list:
    """The lane sums of ``vectors`` (`reduce_vectors`), one float per vector, in order."""
    vs = reduce_vectors(builder, vectors, lanes)
    return [builder.extract_element(vs[i // lanes], ir.Constant(I32, i % lanes)) for i in range(len(vectors))]
