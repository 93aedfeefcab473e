"""A MoE layer's experts at decode in one numba call: each expert some row chose runs once, on
the rows that chose it, and each row's products go through one activation row's dot product.

``experts_decode(x, index, weight, first, gate_up, ..., down, ...)`` computes, for rows x (N, C)
routed to experts ``index`` (N, k) with weights ``weight`` (N, k) (`decoder.moe.route`),

    out[r] = sum over j (ascending expert)  weight[r, j] * down_e(act(gate_up_e(x[r]) + b_gu) ) + b_d,  e = index[r, j]

for the experts ``first .. first + E - 1`` this rank holds (stacked: ``gate_up`` (E, 2I, C) and
``down`` (E, C, I) in one storage format, `decode_layer`'s: float32, bf16 bits as uint16, f16
bits as int16, int8 + block scales, q4 codes + scale / minimum pairs), zeros for the others (a
TP rank's share, summed by the layer's all-reduce). ``activation`` 0: SwiGLU (Mixtral, Qwen3-MoE,
DeepSeek), 1: GPT-OSS's clamped SwiGLU, ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha g)``
with g = min(gate, limit).

Note: rows are independent of their batch. The decode matvecs take 4 activation rows at a time
(rowdot's tile note) and a lone row another way, so an expert's product for a row would depend
on how many other rows chose that expert in the step. Here every row of every group takes the
lone row's dot product (the one a batch of 1 takes, `matvec._t1_1`, lowp's `row_dot_i8*`,
quant's `_q4_dot`; on a VNNI CPU q4 takes q4gemm's kernel, whose order is the same at every row
count: its decode note): a row's output is bit-for-bit the same alone or in any batch, and at batch 1
the same as the layer-by-layer path's `Linear` products. Each weight row is still read from
memory once per step for the whole group (its 4-16 kB stay in L1 while the group's rows use
it), so a step reads each chosen expert once: between k and min(E, N k) experts' bytes.

Note: why one call. At decode the layer-by-layer MoE spent, per expert, a gather, two `Linear`
calls with their checks, the activation and a scatter in Python; a dense layer is one call
(`decode_layer`). Measured under load (2 shared cores, 1 thread, `bench_moe.py` shapes at
--scale 0.5, whole decode steps, in process, kernel against the per-expert path with the same
routing, best of 5 interleaved): batch 1 Mixtral 1.17-1.22x, DeepSeek 1.16x, GPT-OSS 1.10x,
Qwen3-MoE (top 8 of 64) 1.28-1.41x; batch 8 1.15x, 1.20x, 1.18x, 1.53x; logits within 2e-6 of
it (the prefill's groups now take the lone-row products too). The routing moved to numba with
it (`route`): 5-7 us a layer where the numpy rules made ~10 calls.
Then the products of all chosen experts became one parallel region for the gate/ups and one for
the downs (two per expert before; not measured apart): Qwen3-MoE's layer at --scale 0.5, batch 1,
quiet moment, 1 thread: experts 84-87 us, routing 7.5 us, the whole `model.mlp` 96-100 us
against 74-80 us for the dense peer's MLP of the same active width.

Note: each row as a lone row, not the tile. Rows grouped on an expert could share each weight
load across 4 rows (rowdot's tile: 1.1-1.5x the compute rate at 4-16 rows); that tile sums in
another order than a lone row, so the row's bits would depend on its group. Where a step is
bound by reading weights (a real model's experts are 10-300 MB each) the lone rows cost little:
each weight row is read from memory once for the group either way. These loops repeat the
lone-row branches of `_matvec_float`, `_matvec_int8` and `_matvec_q4` over a list of rows;
if those kernels become row-independent themselves (#36), they can take this place.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from ._common import ERR, FAST, check_f32, pool_threads
from .elementwise import _swiglu
from .lowp import _dot_i8_i16_tail, _one_row_i8, _quantize_rows_i16, check_weight, kernel_weight
from .matvec import _main_cols, _operand, _t1_1, _tail
from .q4gemm import Q4_GEMM, _rows_q4_gemm
from .quant import _q4_dot, _quantize_rows_q8
from .rowdot import AHEAD_BYTES, INT8_BLOCK

__all__ = ["experts_decode", "lone_rows", "route", "ROUTINGS", "fused_experts", "check_stack", "ACTIVATIONS"]

ACTIVATIONS = {"silu": 0, "silu_clamped": 1}  # the experts' activations the kernel computes


@numba.njit(cache=True, error_model=ERR)
def _swiglu_clamped(gate, up, limit, alpha):  # gate, up (N, I) float32: gate <- GPT-OSS's clamped SwiGLU
    one = np.float32(1.0)
    for r in range(gate.shape[0]):
        for j in range(gate.shape[1]):
            g = min(gate[r, j], limit)
            u = min(max(up[r, j], -limit), limit)
            gate[r, j] = (u + one) * (g / (one + np.float32(math.exp(-alpha * g))))


# The products below take a list of groups: rows groups[i] .. groups[i+1]-1 of x against expert
# experts[i] of the stack w (E, N, K). One parallel region for every group (chunks of each
# expert's output rows as the tasks), so a layer's experts cost two regions, not two per expert.


@numba.njit(cache=True, parallel=True, error_model=ERR)
def _rows_float(x, w, experts, groups, out, chunks):  # w (E, N, K) f32 / bf16 / f16 bits
    n_len = w.shape[1]
    k = _main_cols(w[0], x.shape[1])
    tail = k < x.shape[1]
    ahead = AHEAD_BYTES // w.itemsize
    xb = _operand(x, w[0])  # bf16 activations where the CPU multiplies bf16 pairs (every row, as matvec's)
    for t in numba.prange(len(experts) * chunks):
        i, c = t // chunks, t % chunks
        we = w[experts[i]]
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(groups[i], groups[i + 1]):
                # matvec's one-row tile and its in-order tail (no fast-math): the value any
                # Linear gives this element, whatever its batch (rowdot's invariance note)
                s = _t1_1(we, n, x, xb, r, k, ahead if r == groups[i] else 0)[0]
                out[r, n] = s + _tail(we, n, x, xb, r, k) if tail else s


@numba.njit(cache=True, parallel=True, fastmath=FAST)
def _rows_int8(x, w, scale, experts, groups, out, chunks):  # as lowp._matvec_int8's rows past its groups of 4
    r_len, k_len = x.shape
    n_len = w.shape[1]
    nb = scale.shape[2]
    block = INT8_BLOCK if nb == (k_len + INT8_BLOCK - 1) // INT8_BLOCK else k_len // nb  # (lowp.int8_block)
    xq = np.empty((r_len, k_len), np.int16)
    xs = np.empty((r_len, nb), np.float32)
    _quantize_rows_i16(x, xq, xs, block)  # per row
    full = k_len // block
    for t in numba.prange(len(experts) * chunks):
        i, c = t // chunks, t % chunks
        we, se = w[experts[i]], scale[experts[i]]
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(groups[i], groups[i + 1]):
                ahead = AHEAD_BYTES if r == groups[i] else 0
                out[r, n] = _one_row_i8(we, n, xq, r, se, xs, full, ahead, block)
                if full < nb:  # a shorter last block
                    out[r, n] += _dot_i8_i16_tail(we, n, xq, r, se, xs, full)


@numba.njit(cache=True, parallel=True, fastmath=FAST)
def _rows_q4_lanes(x, w, sm, experts, groups, out, chunks):  # as quant._matvec_q4's rows past its groups of 4
    r_len, k_len = x.shape
    n_len = w.shape[1]
    n_groups = sm.shape[2] // 2
    xq = np.empty((r_len, k_len), np.int8)
    xs = np.empty((r_len, 2 * n_groups), np.float32)
    _quantize_rows_q8(x, xq, xs)  # per row
    for t in numba.prange(len(experts) * chunks):
        i, c = t // chunks, t % chunks
        we, se = w[experts[i]], sm[experts[i]]
        for n in range(c * n_len // chunks, (c + 1) * n_len // chunks):
            for r in range(groups[i], groups[i + 1]):
                out[r, n] = _q4_dot(we, n, xq, r, se, xs, n_groups, AHEAD_BYTES if r == groups[i] else 0)


# a VNNI CPU's q4 products take q4gemm's kernel, as a `Linear`'s do (its decode note: one order)
_rows_q4 = _rows_q4_gemm if Q4_GEMM else _rows_q4_lanes


def _rows(x, w, s, experts, groups, out, chunks):
    """Each group's rows of x (R, K) @ w[e].T into out (R, N), each row as a lone row, by w's storage."""


@overload(_rows)
def _rows_typed(x, w, s, experts, groups, out, chunks):
    if w.dtype in (types.float32, types.uint16, types.int16):
        return lambda x, w, s, experts, groups, out, chunks: _rows_float(x, w, experts, groups, out, chunks)
    if w.dtype == types.int8:
        return lambda x, w, s, experts, groups, out, chunks: _rows_int8(x, w, s, experts, groups, out, chunks)
    if w.dtype == types.uint8:
        return lambda x, w, s, experts, groups, out, chunks: _rows_q4(x, w, s, experts, groups, out, chunks)
    return None


@numba.njit(cache=True, error_model=ERR)
def _experts(x, index, weight, first, gu, sgu, bgu, dn, sdn, bdn, activation, limit, alpha, threads, out):
    n_rows, k = index.shape
    C = x.shape[1]
    E, two_i = gu.shape[0], gu.shape[1]
    width = two_i // 2
    experts = np.empty(E, np.int64)  # the experts some row chose, ascending
    groups = np.zeros(E + 1, np.int64)  # their rows' pairs are groups[i] .. groups[i+1]-1
    rows = np.empty(n_rows * k, np.int64)
    slots = np.empty(n_rows * k, np.int64)
    touched, g = 0, 0
    for e in range(E):  # ascending: a row sums its experts in the order the numpy path did
        g0 = g
        for r in range(n_rows):
            for j in range(k):
                if index[r, j] == first + e:  # a row picks an expert at most once
                    rows[g] = r
                    slots[g] = j
                    g += 1
        if g > g0:
            experts[touched] = e
            touched += 1
            groups[touched] = g
    if g == 0:
        return
    experts, groups = experts[:touched], groups[:touched + 1]
    xg = np.empty((g, C), np.float32)
    for i in range(g):
        xg[i] = x[rows[i]]
    h2 = np.empty((g, two_i), np.float32)
    _rows(xg, gu, sgu, experts, groups, h2, min(two_i, 4 * threads))
    if bgu.shape[0]:
        for i in range(touched):
            for p in range(groups[i], groups[i + 1]):
                for j in range(two_i):
                    h2[p, j] += bgu[experts[i], j]
    if activation == 0:
        h = np.empty((g, width), np.float32)
        _swiglu(h2, h)
    else:
        h = np.ascontiguousarray(h2[:, :width])
        _swiglu_clamped(h, h2[:, width:], limit, alpha)
    y = np.empty((g, C), np.float32)
    _rows(h, dn, sdn, experts, groups, y, min(C, 4 * threads))
    for i in range(touched):  # expert by expert, ascending
        for p in range(groups[i], groups[i + 1]):
            r, wgt = rows[p], weight[rows[p], slots[p]]
            for c in range(C):
                v = y[p, c]
                if bdn.shape[0]:
                    v += bdn[experts[i], c]
                out[r, c] += v * wgt


def lone_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for float32 x (R, K) and w (N, K), each row through one activation row's dot
    product: a row's result is bitwise the same whatever rows are beside it (a BLAS product's
    reduction order changes with the row count: a MoE router's logits, and so its weights,
    would depend on the batch)."""
    check_f32("lone_rows x", x)
    check_f32("lone_rows w", w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"lone_rows: x {x.shape} and w {w.shape} do not fit (R, K) @ (N, K).T")
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _rows_float(np.ascontiguousarray(x), np.ascontiguousarray(w)[None], np.zeros(1, np.int64),
                np.array([0, x.shape[0]], np.int64), out, min(w.shape[0], 4 * pool_threads()))
    return out


ROUTINGS = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2}  # the routers' rules (`decoder.moe.route`)


@numba.njit(cache=True, error_model=ERR)
def _top(choice, k, out):  # out[:k] <- indices of the k largest of choice, largest first, ties to the lower index
    taken = np.zeros(choice.shape[0], np.bool_)
    for j in range(k):
        best = -1
        for e in range(choice.shape[0]):
            if not taken[e] and (best < 0 or choice[e] > choice[best]):
                best = e
        taken[best] = True
        out[j] = best


@numba.njit(cache=True, error_model=ERR)
def _route(logits, mode, k, bias, n_group, topk_group, norm, scaling, index, weight):
    n_rows, E = logits.shape
    one = np.float32(1.0)
    size = E // n_group
    scores = np.empty(E, np.float32)
    choice = np.empty(E, np.float32)
    group_score = np.empty(n_group, np.float32)
    best_groups = np.empty(n_group, np.int64)
    top = np.empty(k, np.int64)
    for r in range(n_rows):
        row = logits[r]
        if mode == 0:  # softmax over all E
            peak = row.max()
            total = np.float32(0.0)
            for e in range(E):
                scores[e] = np.float32(math.exp(row[e] - peak))
                total += scores[e]
            for e in range(E):
                scores[e] /= total
                choice[e] = scores[e]
        elif mode == 1:  # sigmoid; the bias steers the choice only
            for e in range(E):
                scores[e] = one / (one + np.float32(math.exp(-row[e])))
                choice[e] = scores[e] + (bias[e] if bias.shape[0] else np.float32(0.0))
        else:  # top-k of the (biased) logits
            for e in range(E):
                choice[e] = row[e] + (bias[e] if bias.shape[0] else np.float32(0.0))
        if mode != 2 and n_group > 1 and topk_group < n_group:  # only the topk_group best groups compete
            for g in range(n_group):
                part = choice[g * size:(g + 1) * size]
                if mode == 0:
                    group_score[g] = part.max()
                else:  # a group scored by its two best
                    a = np.sort(part)
                    group_score[g] = a[-2] + a[-1]
            _top(group_score, topk_group, best_groups)
            for g in range(n_group):
                kept = False
                for j in range(topk_group):
                    kept = kept or best_groups[j] == g
                if not kept:
                    for e in range(g * size, (g + 1) * size):
                        choice[e] = -np.inf
        _top(choice, k, top)
        total = np.float32(0.0)
        if mode == 2:  # softmax over the k chosen logits
            peak = choice[top[0]]
            for j in range(k):
                weight[r, j] = np.float32(math.exp(choice[top[j]] - peak))
                total += weight[r, j]
        else:
            for j in range(k):
                weight[r, j] = scores[top[j]]
                total += weight[r, j]
        if mode == 2 or norm:
            if mode == 1:
                total += np.float32(1e-20)
            for j in range(k):
                weight[r, j] /= total
        for j in range(k):
            index[r, j] = top[j]
            if scaling != one:
                weight[r, j] *= scaling


def route(logits: np.ndarray, routing: str, k: int, bias: np.ndarray | None = None, n_group: int = 1,
          topk_group: int = 1, norm_topk_prob: bool = True, scaling: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """A MoE router's choice from its logits (N, E) float32: (index (N, k) int64, largest first,
    ties to the lower expert; weight (N, k) float32), each row alone (`decoder.moe.route` says
    the rules: ``routing`` softmax | sigmoid | topk_softmax, groups, ``norm_topk_prob``, scaling)."""
    check_f32("route logits", logits)
    if routing not in ROUTINGS:
        raise ValueError(f"route: routing {routing!r} is not one of {tuple(ROUTINGS)}")
    N, E = logits.shape
    if not 0 < k <= E or n_group < 1 or E % n_group or not 0 < topk_group <= n_group:
        raise ValueError(f"route: top {k} of {E} experts in {n_group} groups (best {topk_group}) does not fit")
    if bias is not None and (bias.shape != (E,) or bias.dtype != np.float32):
        raise ValueError(f"route: bias must be float32 ({E},), got {bias.dtype} {bias.shape}")
    index, weight = np.empty((N, k), np.int64), np.empty((N, k), np.float32)
    _route(np.ascontiguousarray(logits), ROUTINGS[routing], k, np.empty(0, np.float32) if bias is None else bias,
           n_group, topk_group, bool(norm_topk_prob), np.float32(scaling), index, weight)
    return index, weight


def experts_decode(x: np.ndarray, index: np.ndarray, weight: np.ndarray, first: int, fmt: str, gate_up: np.ndarray,
                   gate_up_scale: np.ndarray | None, gate_up_bias: np.ndarray | None, down: np.ndarray,
                   down_scale: np.ndarray | None, down_bias: np.ndarray | None, activation: str = "silu",
                   limit: float = 7.0, alpha: float = 1.702, down_fmt: str | None = None) -> np.ndarray:
    """The weighted outputs (N, C) of experts ``first .. first + E - 1`` for the rows x (N, C)
    routed to them by ``index`` (N, k) int64 with ``weight`` (N, k) float32 (the module note).
    gate_up (E, 2I, C) / down (E, C, I) stored as ``fmt`` (`lowp.WEIGHT_FORMATS`: q4 holds
    (E, n, K/2) codes) with their scales (E, n, blocks) for int8 / q4; biases (E, 2I) / (E, C);
    ``down_fmt``: down's own format when it differs (a Q4_K_M file's Q6_K down held as int8)."""
    down_fmt = down_fmt or fmt
    check_f32("experts_decode x", x)
    check_f32("experts_decode weight", weight)
    if x.ndim != 2 or index.ndim != 2 or weight.shape != index.shape or index.shape[0] != x.shape[0]:
        raise ValueError(f"experts_decode: x {x.shape}, index {index.shape}, weight {weight.shape} "
                         "do not fit (N, C), (N, k), (N, k)")
    check_stack(fmt, gate_up, gate_up_scale, gate_up_bias, down, down_scale, down_bias, down_fmt)
    if gate_up.shape[2] * (1 + (fmt == "q4")) != x.shape[1]:
        raise ValueError(f"experts_decode: gate_up {gate_up.shape} ({fmt}) does not take x {x.shape}")
    return fused_experts(np.ascontiguousarray(x), np.ascontiguousarray(index, dtype=np.int64),
                         np.ascontiguousarray(weight), first, fmt, gate_up, gate_up_scale, gate_up_bias, down,
                         down_scale, down_bias, activation, limit, alpha, down_fmt)


def check_stack(fmt: str, gate_up: np.ndarray, gate_up_scale: np.ndarray | None, gate_up_bias: np.ndarray | None,
                down: np.ndarray, down_scale: np.ndarray | None, down_bias: np.ndarray | None,
                down_fmt: str | None = None) -> None:
    """TypeError / ValueError saying what to pass unless the stacks fit `experts_decode`."""
    down_fmt = down_fmt or fmt
    if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[0] != down.shape[0] or not len(gate_up):
        raise ValueError(f"experts_decode: gate_up {gate_up.shape} and down {down.shape} are not (E, ., .) stacks")
    for e in range(len(gate_up)):
        for f, w, s in ((fmt, gate_up, gate_up_scale), (down_fmt, down, down_scale)):
            if f == "f32":
                check_f32("experts_decode weight", w)
                if s is not None or not w.flags.c_contiguous:
                    raise ValueError("experts_decode: f32 experts are C-contiguous float32 stacks without scales")
            else:
                check_weight(f, w[e], None if s is None else s[e])
    E, two_i, C = gate_up.shape[0], gate_up.shape[1], down.shape[1]
    if down.shape[2] * (1 + (down_fmt == "q4")) != two_i // 2 or two_i % 2:
        raise ValueError(f"experts_decode: gate_up {gate_up.shape} ({fmt}) and down {down.shape} ({down_fmt}) "
                         "are not (E, 2I, C) and (E, C, I)")
    for name, b, shape in (("gate_up_bias", gate_up_bias, (E, two_i)), ("down_bias", down_bias, (E, C))):
        if b is not None:
            check_f32(f"experts_decode {name}", b)
            if b.shape != shape or not b.flags.c_contiguous:
                raise ValueError(f"experts_decode: {name} {b.shape}, expected C-contiguous {shape}")


def fused_experts(x: np.ndarray, index: np.ndarray, weight: np.ndarray, first: int, fmt: str, gate_up: np.ndarray,
                  gate_up_scale: np.ndarray | None, gate_up_bias: np.ndarray | None, down: np.ndarray,
                  down_scale: np.ndarray | None, down_bias: np.ndarray | None, activation: str = "silu",
                  limit: float = 7.0, alpha: float = 1.702, down_fmt: str | None = None) -> np.ndarray:
    """`experts_decode` without its checks, for a caller that checked the stacks once (`check_stack`)
    and passes C-contiguous float32 x and weight and int64 index (per call the checks cost about
    as much as a small expert's product)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"experts_decode: activation {activation!r} is not one of {tuple(ACTIVATIONS)}")
    no3, no2 = np.empty((0, 0, 0), np.float32), np.empty((0, 0), np.float32)
    out = np.zeros(x.shape, np.float32)
    _experts(x, index, weight, int(first), kernel_weight(fmt, gate_up), no3 if gate_up_scale is None else gate_up_scale,
             no2 if gate_up_bias is None else gate_up_bias, kernel_weight(down_fmt or fmt, down),
             no3 if down_scale is None else down_scale, no2 if down_bias is None else down_bias,
             ACTIVATIONS[activation], np.float32(limit), np.float32(alpha), pool_threads(), out)
    return out


def warm_up(fmt: str) -> None:
    """Load (or compile) the kernel for ``fmt`` weights, both activations, with and without biases."""
    from .lowp import quantize_int8, to_bf16
    from .quant import quantize_q4

    c = 32 if fmt == "q4" else 4

    def weight(n: int, k: int):
        w = np.full((n, k), 0.5, np.float32)
        if fmt == "q4":
            return quantize_q4(w)
        if fmt == "int8":
            return quantize_int8(w)
        if fmt == "f16":
            return w.astype(np.float16).view(np.uint16), None
        return (to_bf16(w) if fmt == "bf16" else w), None

    (gu, sgu), (dn, sdn) = weight(2 * c, c), weight(c, c)
    gu, dn = gu[None], dn[None]
    sgu, sdn = (None, None) if sgu is None else (sgu[None], sdn[None])
    x, index, wgt = np.ones((1, c), np.float32), np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32)
    logits = lone_rows(x, np.ones((4, c), np.float32))  # the routers' product and rules
    for routing in ROUTINGS:
        route(logits, routing, 2, np.zeros(4, np.float32), 2, 1)
    for act, biased in (("silu", False), ("silu_clamped", True)):
        b1, b2 = (np.zeros((1, 2 * c), np.float32), np.zeros((1, c), np.float32)) if biased else (None, None)
        experts_decode(x, index, wgt, 0, fmt, gu, sgu, b1, dn, sdn, b2, act)
