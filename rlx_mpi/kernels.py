"""numba kernels for the element-wise parts of a forward (BLAS does the matmuls).

Each fuses what numpy does in several passes over memory with a temporary per pass
(measured in bench/bench_kernels.py). The ``_`` kernels do no validation and no allocation;
the public wrappers check dtype, shape and contiguity and allocate; a caller with other
dtypes gets an error that says what to pass. Kernels run on the calling thread (see the
threads note below): the rank's cores belong to its BLAS threads.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

# Note: threads. The kernels are written with `numba.prange` but compiled serial: measured on a
# 2-core host with 2 BLAS threads, alternating numba's OpenMP pool with OpenBLAS's threads (each
# spins after its region) made blocked attention 5.5x slower than the serial kernels, which
# match the old materialising attention's time. BLAS threads are the rank's parallelism; flip
# this to try again (`set_threads` pins numba's pool with BLAS's in `cluster._pin_threads`).
_PARALLEL = False

# Note: exp. numba's np.exp is a scalar libm call, and a float division carries a zero check
# unless ``error_model="numpy"``: either keeps LLVM from vectorising a loop (SiLU measured 10x
# slower). `_exp` is Cephes' expf (range reduction by ln 2, degree-6 polynomial, 2^n built in
# the exponent bits): max error under 1 ulp on [-87, 88.72] (tests/test_kernels.py), NaN stays
# NaN, above ~88.72 it is Inf, below -87 it saturates at exp(-87) (1.6e-38, ~0 beside any term).
_ERR = "numpy"  # IEEE division (Inf/NaN, no ZeroDivisionError check): vectorisable loops


@intrinsic
def _as_f32(typingctx, bits):
    """Reinterpret a uint32 as float32 (a register bitcast: lets the decode sit inside the dot)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen


@numba.njit(cache=True, inline="always")
def _exp(x):  # float32 -> float32, vectorisable (see the note above)
    x = np.float32(89.0) if x > np.float32(89.0) else x  # (NaN passes both clamps)
    x = np.float32(-87.0) if x < np.float32(-87.0) else x
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))  # x = n ln2 + r, |r| <= ln2 / 2
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # ln 2 in two parts
    p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    half = np.int32(n) >> np.int32(1)  # 2^n as 2^half * 2^(n - half): n = 128 stays finite
    return (p * _as_f32(np.uint32((half + np.int32(127)) << np.int32(23)))
            * _as_f32(np.uint32((np.int32(n) - half + np.int32(127)) << np.int32(23))))


__all__ = ["causal_softmax_", "rms_norm", "silu_mul_", "rope", "attend", "attend_workspace_bytes", "set_threads",
           "warm_up"]


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


@numba.njit(cache=True, error_model=_ERR, fastmath={"reassoc", "contract"})
def _rms_norm(x, weight, eps, out):  # x (N, C) float32; reassoc: the float64 sum in SIMD lanes
    n, c = x.shape
    for i in range(n):
        acc = 0.0  # float64: as accurate as numpy's pairwise float32 mean
        for j in range(c):
            acc += np.float64(x[i, j]) * x[i, j]
        scale = np.float32(1.0 / np.sqrt(acc / c + eps))
        for j in range(c):
            out[i, j] = weight[j] * (x[i, j] * scale)


@numba.njit(cache=True, parallel=_PARALLEL, error_model=_ERR)
def _silu_mul(gate, up):  # gate, up (N, I) float32, any row stride: gate <- silu(gate) * up
    n, width = gate.shape
    for i in numba.prange(n):
        g, u = gate[i], up[i]
        for j in range(width):
            x = g[j]
            g[j] = x / (np.float32(1.0) + _exp(-x)) * u[j]


def _check(name: str, a: np.ndarray) -> None:
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise TypeError(f"{name}: expected a C-contiguous float32 array, got {a.dtype} "
                        f"({'contiguous' if a.flags.c_contiguous else 'non-contiguous'}); "
                        "pass np.ascontiguousarray(x, dtype=np.float32)")


def causal_softmax_(scores: np.ndarray, offset: int = 0) -> np.ndarray:
    """Softmax over the last axis with a causal mask, in place: query t sees keys <= t + offset."""
    _check("causal_softmax_", scores)
    if not scores.flags.writeable:
        raise ValueError("causal_softmax_: scores is read-only; pass a writable array")
    _causal_softmax(scores.reshape(-1, scores.shape[-2], scores.shape[-1]), offset)
    return scores


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, into a new array."""
    _check("rms_norm", x)
    _check("rms_norm weight", weight)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {weight.shape} does not match x's last axis {x.shape[-1]}")
    out = np.empty_like(x)
    _rms_norm(x.reshape(-1, x.shape[-1]), weight, np.float32(eps), out.reshape(-1, x.shape[-1]))
    return out


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
    return _as_f32(np.uint32(best ^ ((best >> np.int32(31)) & np.int32(0x7FFFFFFF))))


@numba.njit(cache=True, error_model=_ERR, fastmath={"reassoc", "contract"})
def _exp_row(row, scale, peak):  # row <- exp(row * scale - peak); returns the sum (SIMD lanes)
    total = np.float32(0.0)
    for j in range(row.shape[0]):
        e = _exp(row[j] * scale - peak)
        row[j] = e
        total += e
    return total


@numba.njit(cache=True, parallel=_PARALLEL, error_model=_ERR, fastmath={"reassoc", "contract"})
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


@numba.njit(cache=True, parallel=_PARALLEL, error_model=_ERR)
def _finish(acc, l, y, t0):  # acc (B, H, bq, hs) / l -> y[:, t0:t0+bq] (B, T, H, hs)
    B, H, bq, hs = acc.shape
    for bh in numba.prange(B * H):
        b, h = bh // H, bh % H
        for i in range(bq):
            inv = np.float32(1.0) / l[b, h, i] if l[b, h, i] > 0 else np.float32(0.0)
            for d in range(hs):
                y[b, t0 + i, h, d] = acc[b, h, i, d] * inv


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


def silu_mul_(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU's ``silu(gate) * up`` in one pass, into ``gate`` (no temporaries); returns gate."""
    _check("silu_mul_ gate", gate)
    _check("silu_mul_ up", up)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul_: gate {gate.shape} and up {up.shape} differ; pass equal shapes")
    if not gate.flags.writeable:
        raise ValueError("silu_mul_: gate is read-only; pass a writable array")
    width = gate.shape[-1] if gate.ndim else 1
    _silu_mul(gate.reshape(-1, width), up.reshape(-1, width))
    return gate


@numba.njit(cache=True, parallel=_PARALLEL)
def _rope(xt, cos, sin, out):  # xt (B, T, H, hs) C-contiguous (a projection's output) -> out (B, H, T, hs)
    B, T, H, hs = xt.shape
    half = hs // 2
    per_batch = cos.shape[0] > 1
    for bt in numba.prange(B * T):
        b, t = bt // T, bt % T
        c, s = (cos[b, t], sin[b, t]) if per_batch else (cos[0, t], sin[0, t])
        for h in range(H):
            x, o = xt[b, t, h], out[b, h, t]
            for d in range(half):  # contiguous rows in and out: this loop vectorises
                o[d] = x[d] * c[d] + (-x[d + half]) * s[d]
                o[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half]


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding (transformers' rotate-half layout) of x (B, H, T, hs), any strides.

    cos, sin: (T, hs) shared by the batch, or (B, T, hs) / (B, 1, T, hs) per sequence (tokens at
    their own positions). One pass over a projection's output (other layouts are copied first);
    the result is a new C-contiguous array, so a transposed projection output comes back in
    (B, H, T, hs) order for attention.
    """
    if x.ndim != 4 or x.dtype != np.float32:
        raise TypeError(f"rope: x must be a float32 (B, H, T, hs) array, got {x.dtype} {x.shape}")
    B, H, T, hs = x.shape
    cos, sin = np.asarray(cos, np.float32), np.asarray(sin, np.float32)
    if cos.ndim == 4 and cos.shape[1] == 1:
        cos, sin = cos[:, 0], sin[:, 0]
    elif cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    if hs % 2 or cos.shape[1:] != (T, hs) or cos.shape[0] not in (1, B) or sin.shape != cos.shape:
        raise ValueError(f"rope: cos {cos.shape} / sin {sin.shape} do not fit x {x.shape}; pass "
                         "(T, hs) or (B, 1, T, hs) tables with an even hs")
    out = np.empty((B, H, T, hs), np.float32)
    # the model's x is a projection's (B, T, H, hs) memory seen as (B, H, T, hs): no copy here;
    # any other layout is copied into that order first
    xt = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    _rope(xt, np.ascontiguousarray(cos), np.ascontiguousarray(sin), out)
    return out


def set_threads(n: int | None) -> None:
    """Run the parallel kernels on ``n`` threads (the rank's share of its host, like BLAS)."""
    if n:
        numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray | None = None,
           window: int = 0, *, scale: float | None = None, softcap: float = 0.0) -> np.ndarray:
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
    scaled score s to softcap * tanh(s / softcap) (Gemma 2).
    """
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    if k.shape != (B, nkv, S, hs) or v.shape != k.shape or nh % nkv:
        raise ValueError(f"attend: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                         "(B, nh, T, hs) / (B, nkv, S, hs) with nh a multiple of nkv")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.dtype != np.float32:
            raise TypeError(f"attend: {name} is {a.dtype}; pass float32 (a.astype(np.float32))")
    pos = _positions(q_pos, B, T, S)
    window, scale = int(max(window, 0)), np.float32(hs ** -0.5 if scale is None else scale)
    y = np.empty((B, T, nh, hs), np.float32)
    g = nh // nkv
    for t0 in range(0, T, _Q_BLOCK):
        t1 = min(T, t0 + _Q_BLOCK)
        _query_block(q[:, :, t0:t1], k, v, np.array(pos[:, t0:t1], order="C"), window, scale, y, t0,
                     np.float32(softcap))  # (a copy:
        # always writable, so numba sees one type; a read-only view made a second compile mid-forward)
    return y


def attend_workspace_bytes(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Bytes `attend` holds besides its inputs and output: one block's scores, the query-block
    copy, the accumulator and the running max/sum (the planner's estimate; O(seq^0) per head)."""
    bq, bk = min(seq, _Q_BLOCK), min(seq, _K_BLOCK)
    return batch * heads * bq * (bk + 2 * head_dim + 2) * 4


def _query_block(q, k, v, pos, window, scale, y, t0, softcap=np.float32(0.0)) -> None:
    """One block of queries (B, nh, bq, hs) over the key blocks it can see, into y[:, t0:]."""
    B, nh, bq, hs = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    lo = max(0, int(pos.min()) - window + 1) if window > 0 else 0  # keys any query here sees
    hi = min(k.shape[2], int(pos.max()) + 1)
    qb = np.ascontiguousarray(q).reshape(B, nkv, g * bq, hs)  # g heads of a kv head: one GEMM
    m = np.full((B, nh, bq), -np.inf, np.float32)
    l = np.zeros((B, nh, bq), np.float32)
    acc = np.zeros((B, nh, bq, hs), np.float32)
    acc_g = acc.reshape(B, nkv, g * bq, hs)
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
    _finish(acc, l, y, t0)


def warm_up() -> None:
    """Load (or compile) every kernel now, at build time, not inside the first timed forward."""
    causal_softmax_(np.zeros((1, 1, 1), np.float32))
    rms_norm(np.ones((1, 2), np.float32), np.ones(2, np.float32), 1e-6)
    silu_mul_(np.ones((1, 2), np.float32), np.ones((1, 2), np.float32))
    x = np.ones((1, 2, 1, 2), np.float32)
    rope(x, np.ones((1, 2), np.float32), np.ones((1, 2), np.float32))
    for t in (1, 9):  # the decode path and the blocked path
        q, kv = np.ones((1, 2, t, 2), np.float32), np.ones((1, 1, 9, 2), np.float32)
        attend(q, kv, kv)
    matvec_f32(np.ones((1, 2), np.float32), np.ones((3, 2), np.float32))


# -- low-precision weights (issue 10 sections 1-2) ---------------------------------------------
# Note: storage. bf16 is kept as its uint16 bit pattern (the top half of a float32: decoding
# is a shift), f16 as its uint16 bit pattern decoded with integer ops and one multiply (numba
# has no float16 arithmetic on CPU; a 65536-entry table was measured 3x slower: a gather per
# weight does not vectorise), int8 as int8 with one float32 scale per output row.
# Activations and accumulators stay float32.
# Decode (a few activation rows) reads every weight once: the fused kernels below dequantise
# inside the dot product, ``numba.prange`` over output rows (the rank's pinned numba threads),
# so a bf16 matrix moves half the bytes of an f32 one and an int8 matrix a quarter. Prefill
# (many rows) is compute-bound: a tile of weight rows is dequantised into a reused float32
# buffer and handed to BLAS (measured faster than a numba GEMM, bench/bench_precision.py).

_FAST = {"reassoc", "contract"}  # lets LLVM vectorise the float32 dot-product reductions
_F16_TO_F32 = np.float32(2.0 ** 112)  # rebias a half's exponent (15) to a float's (127); renormalises subnormals


@numba.njit(cache=True, inline="always", fastmath=_FAST)
def _decode_f16(h, bits):  # h (K,) uint16 f16 bits -> bits (K,) uint32 of the exact float32 values
    special = np.uint32(0)
    for k in range(h.shape[0]):  # sign in place, exponent and mantissa shifted into a float's
        x = np.uint32(h[k])
        bits[k] = ((x & np.uint32(0x8000)) << np.uint32(16)) | ((x & np.uint32(0x7FFF)) << np.uint32(13))
        special |= np.uint32(1) if (x & np.uint32(0x7C00)) == np.uint32(0x7C00) else np.uint32(0)
    vals = bits.view(np.float32)
    for k in range(h.shape[0]):
        vals[k] = vals[k] * _F16_TO_F32
    if special:  # Inf / NaN halves (a corrupt weight): exponent all ones, mantissa kept
        for k in range(h.shape[0]):
            x = np.uint32(h[k])
            if (x & np.uint32(0x7C00)) == np.uint32(0x7C00):
                bits[k] = ((x & np.uint32(0x8000)) << np.uint32(16)) | np.uint32(0x7F800000) | (
                    (x & np.uint32(0x3FF)) << np.uint32(13))


@numba.njit(cache=True, parallel=True, fastmath=_FAST)
def _matvec_f32(x, w, out, chunks):  # x (R, K) f32, w (N, K) f32, out (R, N) f32: decode's f32 product
    r_len, k_len = x.shape
    n_len = w.shape[0]
    for c in numba.prange(chunks):
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(r_len):
                acc = np.float32(0.0)
                for k in range(k_len):
                    acc += x[r, k] * w[n, k]
                out[r, n] = acc


@numba.njit(cache=True, parallel=True, fastmath=_FAST)
def _matvec_bf16(x, w, out, chunks):  # x (R, K) f32, w (N, K) uint16 bf16 bits, out (R, N) f32
    r_len, k_len = x.shape
    n_len = w.shape[0]
    for c in numba.prange(chunks):
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(r_len):
                acc = np.float32(0.0)
                for k in range(k_len):  # bf16 -> f32 is a shift: exact, and vectorises with the FMA
                    acc += x[r, k] * _as_f32(np.uint32(w[n, k]) << np.uint32(16))
                out[r, n] = acc


@numba.njit(cache=True, parallel=True, fastmath=_FAST)
def _matvec_f16(x, w, out, chunks):  # w (N, K) uint16 f16 bits, none Inf/NaN (the wrapper's caller checks)
    r_len, k_len = x.shape
    n_len = w.shape[0]
    for c in numba.prange(chunks):
        wv = np.empty(k_len, np.float32)  # with several rows, decode each weight row once
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            if r_len == 1:
                acc = np.float32(0.0)
                for k in range(k_len):
                    acc += x[0, k] * _f16_value(w[n, k])
                out[0, n] = acc
                continue
            for k in range(k_len):
                wv[k] = _f16_value(w[n, k])
            for r in range(r_len):
                acc = np.float32(0.0)
                for k in range(k_len):
                    acc += x[r, k] * wv[k]
                out[r, n] = acc


@numba.njit(cache=True, inline="always", fastmath=_FAST)
def _f16_value(bits):  # finite float16 bits -> float32: sign, exponent, mantissa moved, exponent rebiased
    h = np.uint32(bits)
    return _as_f32(((h & np.uint32(0x8000)) << np.uint32(16)) | ((h & np.uint32(0x7FFF)) << np.uint32(13))) * _F16_TO_F32


@numba.njit(cache=True, parallel=True, fastmath=_FAST)
def _matvec_int8(x, w, scale, out, chunks):  # w (N, K) int8, scale (N,) f32: W = scale[:, None] * w
    r_len, k_len = x.shape
    n_len = w.shape[0]
    for c in numba.prange(chunks):
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(r_len):
                acc = np.float32(0.0)
                for k in range(k_len):
                    acc += x[r, k] * np.float32(w[n, k])
                out[r, n] = acc * scale[n]


@numba.njit(cache=True)
def _dequant_bf16(w, start, out):  # rows start.. of w (N, K) uint16 -> out (n, K) f32
    bits = out.view(np.uint32)
    for i in range(out.shape[0]):
        for k in range(out.shape[1]):
            bits[i, k] = np.uint32(w[start + i, k]) << np.uint32(16)


@numba.njit(cache=True)
def _dequant_f16(w, start, out):
    bits = out.view(np.uint32)
    for i in range(out.shape[0]):
        _decode_f16(w[start + i], bits[i])


@numba.njit(cache=True)
def _dequant_int8(w, scale, start, out):
    for i in range(out.shape[0]):
        s = scale[start + i]
        for k in range(out.shape[1]):
            out[i, k] = np.float32(w[start + i, k]) * s


@numba.njit(cache=True, parallel=True)
def _to_bf16(x, out):  # x (N,) f32 -> out (N,) uint16, round to nearest even; NaN stays NaN
    bits = x.view(np.uint32)
    for i in numba.prange(x.shape[0]):
        b = bits[i]
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep it quiet, not Inf
            out[i] = np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
        else:
            out[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(cache=True, parallel=True)
def _quantize_int8(w, q, scale):  # w (N, K) f32 -> q (N, K) int8, scale (N,) f32, symmetric per row
    for n in numba.prange(w.shape[0]):
        peak = np.float32(0.0)
        for k in range(w.shape[1]):
            peak = max(peak, abs(w[n, k]))
        s = peak / np.float32(127.0)
        scale[n] = s
        inv = np.float32(0.0) if s == 0 else np.float32(1.0) / s
        for k in range(w.shape[1]):
            q[n, k] = np.int8(np.rint(w[n, k] * inv))


WEIGHT_FORMATS = ("bf16", "f16", "int8")
_TILE_BYTES = 1 << 20  # f32 bytes of one dequantised tile: fits L2 beside BLAS's own panels


def _check_weight(fmt: str, w: np.ndarray, scale: np.ndarray | None) -> None:
    want = {"bf16": np.uint16, "f16": np.uint16, "int8": np.int8}.get(fmt)
    if want is None:
        raise ValueError(f"weight format {fmt!r} is not one of {WEIGHT_FORMATS}")
    if w.ndim != 2 or w.dtype != want or not w.flags.c_contiguous:
        raise TypeError(f"{fmt} weight: expected a C-contiguous 2-D {np.dtype(want)} array, got "
                        f"{w.ndim}-D {w.dtype}; build it with kernels.to_bf16 / quantize_int8 "
                        "or np.float16(...).view(np.uint16)")
    if fmt == "int8":
        if scale is None or scale.shape != (w.shape[0],):
            raise ValueError(f"int8 weight: scale must have shape ({w.shape[0]},), got "
                             f"{None if scale is None else scale.shape}")
        _check("int8 scale", scale)


def dequant_matmul(x: np.ndarray, w: np.ndarray, fmt: str, scale: np.ndarray | None = None,
                   out: np.ndarray | None = None, fused: bool = True) -> np.ndarray:
    """``x @ W.T`` for a low-precision weight ``W`` (N, K) stored as ``fmt``: x (R, K) -> (R, N) f32.

    Few rows (decode) run the fused dequantise-dot kernel; many rows (prefill) dequantise a
    tile of W at a time into a reused float32 buffer and call BLAS. Either way no float32
    copy of the whole of W exists. ``fused=False`` forces the tiled path: the fused f16 kernel
    assumes no Inf/NaN weights (`f16_has_special` tells; a Linear checks once at load).
    """
    _check("dequant_matmul x", x)
    _check_weight(fmt, w, scale)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dequant_matmul: x {x.shape} does not fit W {w.shape}; expected (R, {w.shape[1]})")
    R, N = x.shape[0], w.shape[0]
    if out is None:
        out = np.empty((R, N), np.float32)
    if R <= MATVEC_ROWS and fused:
        chunks = min(N, 4 * numba.get_num_threads())  # a few per thread: balanced, one scratch row each
        if fmt == "bf16":
            _matvec_bf16(x, w, out, chunks)
        elif fmt == "f16":
            _matvec_f16(x, w, out, chunks)
        else:
            _matvec_int8(x, w, scale, out, chunks)
        return out
    K = w.shape[1]
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
        else:
            _dequant_int8(w, scale, a, t)
        p = part[:, :b - a]
        np.matmul(x, t.T, out=p)
        out[:, a:b] = p
    return out


def matvec_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for a few float32 rows x (R, K) and float32 w (N, K), on the rank's numba
    threads: for weights in DRAM it reads them 1.7-1.8x faster than OpenBLAS's GEMV (measured
    over the small preset's decode step, 101 MB, 1 and 2 threads; F32_MATVEC_ROWS)."""
    _check("matvec_f32 x", x)
    _check("matvec_f32 w", w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matvec_f32: x {x.shape} and w {w.shape} do not fit (R, K) @ (N, K).T")
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _matvec_f32(x, w, out, min(w.shape[0], 4 * numba.get_num_threads()))
    return out


F32_MATVEC_ROWS = 8  # up to this many rows matvec_f32 beats BLAS on a decode step (2 rows 1.8x, 8 rows
# 1.26x; at 16 BLAS is 1.45x faster), 1 thread, weights read from DRAM
MATVEC_ROWS = 16  # up to this many activation rows the fused kernel beats dequantise + BLAS (measured: 1.5x at 16 and 32 rows, 1 thread)


@numba.njit(cache=True)
def _f16_any_special(flat):  # no temporaries: this runs on every f16 matrix at load
    for i in range(flat.shape[0]):
        if (flat[i] & np.uint16(0x7C00)) == np.uint16(0x7C00):
            return True
    return False


def f16_has_special(w: np.ndarray) -> bool:
    """Whether any float16 bit pattern in ``w`` is Inf or NaN (exponent bits all ones)."""
    if w.dtype != np.uint16:
        raise TypeError(f"f16_has_special: expected uint16 bit patterns, got {w.dtype}")
    return bool(_f16_any_special(np.ascontiguousarray(w).reshape(-1)))


def dequantize(w: np.ndarray, fmt: str, scale: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
    """float32 copy of ``W`` (or of its ``rows``): for embedding lookups and tests."""
    _check_weight(fmt, w, scale)
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
        _dequant_int8(w, scale, 0, out)
    return out


def to_bf16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16, same shape) of float32 ``x``, rounded to nearest even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16)
    _to_bf16(x.reshape(-1), out.reshape(-1))
    return out


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"from_bf16: expected uint16 bit patterns, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-row int8: ``W ~= scale[:, None] * q`` with ``max|q| = 127`` per row."""
    _check("quantize_int8 w", w)
    if w.ndim != 2:
        raise ValueError(f"quantize_int8: expected a 2-D weight (out, in), got shape {w.shape}")
    q = np.empty(w.shape, np.int8)
    scale = np.empty(w.shape[0], np.float32)
    _quantize_int8(w, q, scale)
    return q, scale


def warm_up_lowp() -> None:
    """Load (or compile) the low-precision kernels at build time."""
    x1, x2 = np.ones((1, 4), np.float32), np.ones((MATVEC_ROWS + 1, 4), np.float32)
    w = np.ones((2, 4), np.float32)
    q, s = quantize_int8(w)
    b = to_bf16(w)
    for fmt, ww, sc in (("bf16", b, None), ("f16", w.astype(np.float16).view(np.uint16), None), ("int8", q, s)):
        dequant_matmul(x1, ww, fmt, sc)
        dequant_matmul(x2, ww, fmt, sc)


__all__ += ["dequant_matmul", "dequantize", "f16_has_special", "to_bf16", "from_bf16", "quantize_int8", "warm_up_lowp",
            "WEIGHT_FORMATS", "MATVEC_ROWS"]
