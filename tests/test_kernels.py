"""numba kernels against the naive numpy they replace."""

import os
import threading

import numpy as np
import pytest

from helpers import bf16_read
from rlx_mpi import kernels


def numpy_causal_softmax(scores, offset=0):
    t, s = scores.shape[-2:]
    mask = np.triu(np.full((t, s), -np.inf, dtype=np.float32), k=1 + offset)
    x = scores + mask
    x = np.exp(x - x.max(-1, keepdims=True))
    return x / x.sum(-1, keepdims=True)


@pytest.mark.parametrize("shape, offset", [((2, 3, 5, 5), 0), ((1, 4, 1, 1), 0), ((3, 7, 9), 2), ((2, 4, 6), 0)])
def test_causal_softmax(shape, offset):
    scores = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 5
    want = numpy_causal_softmax(scores, offset)
    got = kernels.causal_softmax_(scores.copy(), offset)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.allclose(got.sum(-1), 1.0, atol=1e-6)


def test_rms_norm():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 33)).astype(np.float32) * 3
    w = rng.standard_normal(33).astype(np.float32)
    want = w * (x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6))
    np.testing.assert_allclose(kernels.rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)


def test_wrappers_reject_bad_arrays():
    with pytest.raises(TypeError, match="C-contiguous float32"):
        kernels.causal_softmax_(np.zeros((2, 3, 3)))
    with pytest.raises(TypeError, match="non-contiguous"):
        kernels.rms_norm(np.zeros((4, 6), np.float32)[:, ::2], np.ones(3, np.float32), 1e-6)
    with pytest.raises(ValueError, match="weight shape"):
        kernels.rms_norm(np.zeros((4, 6), np.float32), np.ones(5, np.float32), 1e-6)
    ro = np.zeros((1, 2, 2), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernels.causal_softmax_(ro)


def naive_attend(q, k, v, q_pos, window=0):
    """Per query, per head, in float64: the definition `kernels.attend` documents."""
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    y = np.zeros((B, T, nh, hs))
    for b in range(B):
        for h in range(nh):
            kv = h // (nh // nkv)
            for t in range(T):
                p = q_pos[b, t]
                keys = [j for j in range(S) if j <= p and (window <= 0 or j > p - window)]
                s = np.array([q[b, h, t].astype(np.float64) @ k[b, kv, j] for j in keys]) / np.sqrt(hs)
                w = np.exp(s - s.max())
                w /= w.sum()
                y[b, t, h] = sum(wi * v[b, kv, j].astype(np.float64) for wi, j in zip(w, keys))
    return y


@pytest.mark.parametrize("B, nh, nkv, T, S, window, pos", [
    (2, 4, 2, 5, 5, 0, "causal"), (1, 4, 4, 1, 7, 0, "causal"), (2, 6, 2, 3, 9, 0, "causal"),
    (3, 4, 1, 4, 8, 0, "ragged"), (2, 4, 2, 6, 6, 3, "causal"), (2, 2, 1, 1, 10, 4, "ragged")])
def test_attend(B, nh, nkv, T, S, window, pos):
    rng = np.random.default_rng(2)
    hs = 8
    q = rng.standard_normal((B, nh, T, hs)).astype(np.float32)
    k = rng.standard_normal((B, nkv, S, hs)).astype(np.float32)
    v = rng.standard_normal((B, nkv, S, hs)).astype(np.float32)
    if pos == "causal":
        q_pos, given = np.broadcast_to(np.arange(S - T, S), (B, T)), None
    else:  # sequences of different lengths in one batch: each at its own positions
        last = rng.integers(T - 1, S, size=B)
        q_pos = given = (last[:, None] - np.arange(T)[::-1][None, :]).astype(np.int64)
    got = kernels.attend(q, k, v, given, window)
    assert got.shape == (B, T, nh, hs) and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, naive_attend(q, k, v, q_pos, window), atol=2e-6)


def dense_attend(q, k, v, q_pos, window=0):
    """The same definition in float64, vectorised per (b, head) (for shapes too big for the loop)."""
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    j = np.arange(S)
    visible = j[None, None, :] <= q_pos[:, :, None]  # (B, T, S)
    if window > 0:
        visible &= j[None, None, :] > q_pos[:, :, None] - window
    y = np.zeros((B, T, nh, hs))
    for b in range(B):
        for h in range(nh):
            kv = h // (nh // nkv)
            s = q[b, h].astype(np.float64) @ k[b, kv].astype(np.float64).T / np.sqrt(hs)
            s = np.where(visible[b], s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            y[b, :, h] = (w / w.sum(-1, keepdims=True)) @ v[b, kv].astype(np.float64)
    return y


def _qkv(rng, B, nh, nkv, T, S, hs, scale=1.0):
    q = (rng.standard_normal((B, nh, T, hs)) * scale).astype(np.float32)
    k = (rng.standard_normal((B, nkv, S, hs)) * scale).astype(np.float32)
    v = rng.standard_normal((B, nkv, S, hs)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("B, nh, nkv, T, S, window, pos", [
    (1, 3, 1, 7, 7, 0, "causal"), (2, 4, 2, 13, 21, 0, "causal"), (2, 2, 2, 11, 11, 5, "causal"),
    (3, 4, 2, 9, 30, 7, "ragged"), (1, 2, 1, 17, 17, 1, "causal"), (2, 6, 3, 5, 40, 0, "ragged")])
def test_attend_gives_each_query_the_same_bits_whatever_shares_its_call(B, nh, nkv, T, S, window, pos):
    """Against the definition, and every query bit for bit the same when it is attended alone, in
    a smaller chunk of its sequence or beside another row (the invariance note in attention.py)."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, B, nh, nkv, T, S, 6, scale=2.0)  # large logits
    if pos == "causal":
        q_pos = np.broadcast_to(np.arange(S - T, S), (B, T)).astype(np.int64)
    else:
        last = rng.integers(T - 1, S, size=B)
        q_pos = (last[:, None] - np.arange(T)[::-1][None, :]).astype(np.int64)
    got = kernels.attend(q, k, v, q_pos, window)
    np.testing.assert_allclose(got, naive_attend(q, k, v, q_pos, window), atol=3e-6)
    for b in range(B):
        for t0, t1 in ((0, 1), (T // 2, T), (T - 1, T)):  # a chunk's queries, the rest of the batch gone
            alone = kernels.attend(np.ascontiguousarray(q[b:b + 1, :, t0:t1]), k[b:b + 1], v[b:b + 1],
                                   q_pos[b:b + 1, t0:t1], window)
            assert (alone[0] == got[b, t0:t1]).all(), (b, t0, t1)


@pytest.mark.parametrize("B, nh, nkv, T, S, window, pos", [
    (2, 6, 3, 13, 21, 0, "causal"), (3, 4, 2, 9, 30, 7, "ragged"), (1, 10, 5, 17, 17, 1, "causal")])
def test_attend_splits_kv_heads_over_the_team(monkeypatch, B, nh, nkv, T, S, window, pos):
    """Above _TEAM_WORK, `attend` gives its kv heads' groups to the rank's threads (uneven
    splits included); each part writes its own heads of y, and the result is the definition's."""
    monkeypatch.setattr(kernels.attention, "_TEAM_WORK", 1)
    monkeypatch.setattr(kernels._common, "_threads", [2])  # as set_threads(2) on a 2-core rank
    parts, heads = [], kernels.attention._attend_heads

    def recording(*args):
        kv0, kv1 = args[-3:-1]
        parts.append((threading.current_thread().name, kv1 - kv0))
        heads(*args)

    monkeypatch.setattr(kernels.attention, "_attend_heads", recording)
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, B, nh, nkv, T, S, 6, scale=2.0)
    if pos == "causal":
        q_pos, given = np.broadcast_to(np.arange(S - T, S), (B, T)), None
    else:
        last = rng.integers(T - 1, S, size=B)
        q_pos = given = (last[:, None] - np.arange(T)[::-1][None, :]).astype(np.int64)
    got = kernels.attend(q, k, v, given, window)
    np.testing.assert_allclose(got, naive_attend(q, k, v, q_pos, window), atol=3e-6)
    assert sorted(n for _, n in parts) == sorted([nkv // 2, nkv - nkv // 2])  # every kv head once, in two parts
    assert len({name for name, _ in parts}) == 2 and any(name.startswith("rlx-team") for name, _ in parts)
    assert kernels._common._blas_controllers()  # numpy's OpenBLAS, which the parts ran on one thread
    threads_after = [c.get_num_threads() for c in kernels._common._blas_controllers()]
    with kernels._common.blas_on_one_thread():
        assert all(c.get_num_threads() == 1 for c in kernels._common._blas_controllers())
    assert [c.get_num_threads() for c in kernels._common._blas_controllers()] == threads_after  # restored


@pytest.mark.parametrize("B, nh, nkv, T, S, window", [
    (1, 4, 2, 1100, 1100, 0),  # 3 query blocks x 2 key blocks, causal prefill
    (2, 2, 1, 130, 2500, 0),  # 3 key blocks, queries at the end of a long prefix
    (1, 2, 2, 600, 1300, 300),  # sliding window across block edges
    (1, 8, 2, 1, 3000, 0),  # decode: one query, long cache
    (3, 4, 4, 2, 777, 100)])  # decode of 2 tokens with a window
def test_attend_long(B, nh, nkv, T, S, window):
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, B, nh, nkv, T, S, 16)
    q_pos = np.broadcast_to(np.arange(S - T, S), (B, T))
    got = kernels.attend(q, k, v, None, window)
    np.testing.assert_allclose(got, dense_attend(q, k, v, q_pos, window), atol=2e-6)


@pytest.mark.parametrize("T", [1, 3, 40])
def test_attend_strided_cache_view(T):
    """k/v as a prefix of a bigger cache (strided along S and B), q from a transposed projection."""
    rng = np.random.default_rng(5)
    B, nh, nkv, hs, S, cap = 2, 4, 2, 8, 37, 64
    cache_k = rng.standard_normal((B, nkv, cap, hs)).astype(np.float32)
    cache_v = rng.standard_normal((B, nkv, cap, hs)).astype(np.float32)
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]
    q = rng.standard_normal((B, T, nh, hs)).astype(np.float32).transpose(0, 2, 1, 3)  # (B, nh, T, hs) view
    q_pos = np.stack([np.arange(S - T, S) % S, np.arange(T) * 7 % S]).astype(np.int64)  # any order
    got = kernels.attend(q, k, v, q_pos)
    assert got.flags.c_contiguous and got.shape == (B, T, nh, hs)
    np.testing.assert_allclose(got, dense_attend(q, k, v, q_pos), atol=2e-6)


def test_attend_matches_materialised_scores():
    """Within float32 rounding of the old (B, nh, T, S) implementation at a model-like shape."""
    rng = np.random.default_rng(6)
    B, nh, nkv, T, hs = 2, 8, 4, 600, 64
    q, k, v = _qkv(rng, B, nh, nkv, T, T, hs)
    g = nh // nkv
    scores = (q.reshape(B, nkv, g * T, hs) @ k.transpose(0, 1, 3, 2)).reshape(B, nkv, g, T, T) * np.float32(hs ** -0.5)
    probs = kernels.causal_softmax_(np.ascontiguousarray(scores), 0)
    old = (probs.reshape(B, nkv, g * T, T) @ v).reshape(B, nh, T, hs).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(kernels.attend(q, k, v), old, atol=1e-6, rtol=1e-5)


def test_attend_rejects_bad_input():
    q, kv = np.zeros((1, 2, 3, 4), np.float32), np.zeros((1, 1, 3, 4), np.float32)
    with pytest.raises(TypeError, match="float32"):
        kernels.attend(q.astype(np.float64), kv, kv)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.attend(q, kv[..., :2], kv)
    with pytest.raises(ValueError, match="negative"):
        kernels.attend(q, kv, kv, np.array([[-1, 0, 1]]))
    with pytest.raises(ValueError, match="q_pos"):
        kernels.attend(q, kv, kv, np.zeros((1, 2), np.int64))


def naive_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def test_rope():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 7, 5, 10)).astype(np.float32).transpose(0, 2, 1, 3)  # (3, 5, 7, 10) strided
    cos, sin = (rng.standard_normal((7, 10)).astype(np.float32) for _ in range(2))
    got = kernels.rope(x, cos, sin)
    assert got.flags.c_contiguous and got.shape == x.shape
    np.testing.assert_array_equal(got, naive_rope(x, cos, sin))  # same float32 operations
    cos_b, sin_b = (rng.standard_normal((3, 1, 7, 10)).astype(np.float32) for _ in range(2))
    np.testing.assert_array_equal(kernels.rope(x, cos_b, sin_b), naive_rope(x, cos_b, sin_b))
    # x above is (B, T, H, hs) memory (a projection's output): the contiguous-row kernel; any
    # other layout is first copied into that order, and must agree
    for other in (np.ascontiguousarray(x), x[:, :, ::-1], np.repeat(x, 2, axis=-1)[..., ::2]):
        np.testing.assert_array_equal(kernels.rope(other, cos, sin), naive_rope(other, cos, sin))
        np.testing.assert_array_equal(kernels.rope(other, cos_b, sin_b), naive_rope(other, cos_b, sin_b))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.rope(x, cos[:6], sin[:6])
    with pytest.raises(TypeError, match="float32"):
        kernels.rope(x.astype(np.float64), cos, sin)


def test_silu_mul():
    rng = np.random.default_rng(8)
    gate = (rng.standard_normal((3, 4, 37)) * 6).astype(np.float32)
    up = rng.standard_normal((3, 4, 37)).astype(np.float32)
    g64 = gate.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * up
    got = kernels.silu_mul_(gate.copy(), up)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="differ"):
        kernels.silu_mul_(gate, up[..., :5].copy())


def test_swiglu_reads_a_fused_gate_up_output():
    """swiglu(gu) == silu(gate) * up of gu = [gate | up] (float64 numpy), bit-equal to silu_mul_."""
    rng = np.random.default_rng(9)
    gu = (rng.standard_normal((3, 4, 74)) * 6).astype(np.float32)
    gate, up = gu[..., :37], gu[..., 37:]
    g64 = gate.astype(np.float64)
    got = kernels.swiglu(gu)
    assert got.shape == (3, 4, 37) and got.flags.c_contiguous
    np.testing.assert_allclose(got, g64 / (1 + np.exp(-g64)) * up, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got, kernels.silu_mul_(gate.copy(), up.copy()))
    with pytest.raises(ValueError, match="even"):
        kernels.swiglu(gu[..., :73].copy())


def test_attend_memory_follows_the_planner_estimate():
    """The peak numpy allocation of a prefill is the block workspace, not the (B, nh, T, S) scores."""
    import tracemalloc

    from rlx_mpi.families.llama import PRESETS

    B, nh, nkv, T, hs = 1, 4, 2, 3000, 32
    q, k, v = _qkv(np.random.default_rng(9), B, nh, nkv, T, T, hs)
    kernels.attend(q[:, :, :200], k[:, :, :200], v[:, :, :200])  # warm
    tracemalloc.start()
    y = kernels.attend(q, k, v)
    peak = tracemalloc.get_traced_memory()[1] - y.nbytes
    tracemalloc.stop()
    estimate = kernels.attend_workspace_bytes(B, nh, T, hs)
    assert peak <= 1.5 * estimate, (peak, estimate)
    assert estimate < B * nh * T * T * 4 / 10  # far below the materialised scores
    cfg = PRESETS["medium"]  # and the planner's activation estimate grows linearly in seq now
    act = [cfg.cost(1, s).act_bytes for s in (2048, 4096, 8192)]
    assert act[2] - act[1] == 2 * (act[1] - act[0])


def test_exp_kernel_within_an_ulp_of_float64_exp():
    """The vectorisable exp behind SiLU and the online softmax (kernels._exp)."""
    import numba

    @numba.njit
    def fill(x, out):
        for i in range(x.shape[0]):
            out[i] = kernels._exp(x[i])

    x = np.concatenate([np.linspace(-87, 88.72, 2_000_001, dtype=np.float32),
                        np.float32([0.0, -0.0, 1e-30, -1e-30, np.log(2), -np.log(2)])])
    got = np.empty_like(x)
    fill(x, got)
    want = np.exp(x.astype(np.float64))
    ulp = np.abs(got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulp.max() <= 1.0, f"max error {ulp.max():.2f} ulp at x = {x[ulp.argmax()]}"
    special = np.float32([np.nan, np.inf, -np.inf, 100.0, -100.0, -1e30])
    out = np.empty_like(special)
    fill(special, out)
    assert np.isnan(out[0]) and out[1] == np.inf and out[3] == np.inf  # exp(100) overflows float32 too
    assert np.all((out[[2, 4, 5]] >= 0) & (out[[2, 4, 5]] < 2e-38))  # ~0: invisible beside any term


def test_row_max_orders_floats_as_numpy_does():
    rng = np.random.default_rng(11)
    for n in (1, 2, 15, 16, 17, 511, 1024):
        for scale in (1.0, 1e-30, 1e30):
            row = (rng.standard_normal(n) * scale).astype(np.float32)
            assert kernels._row_max(row) == row.max()
            assert kernels._row_max(-np.abs(row)) == (-np.abs(row)).max()  # all negative
    assert kernels._row_max(np.float32([-np.inf, -3.0])) == -3.0
    assert kernels._row_max(np.float32([-np.inf, -np.inf])) == -np.inf
    assert kernels._row_max(np.float32([1.0, np.inf])) == np.inf
    top = kernels._row_max(np.float32([-0.0, 0.0]))
    assert top == 0 and not np.signbit(top)
    assert np.isnan(kernels._row_max(np.float32([1.0, np.nan, 2.0])))  # a NaN score reaches the output


@pytest.mark.parametrize("nh, nkv, hs, window, softcap", [(4, 2, 8, 0, 0.0), (6, 1, 16, 0, 0.0), (4, 4, 64, 3, 0.0),
                                                     (8, 2, 32, 0, 5.0)])
def test_attend_cache_against_naive(nh, nkv, hs, window, softcap):
    """Decode attention read in place from a cache: rows in any slot order (one slot read twice),
    GQA, a window, Gemma 2's soft-cap; against the float64 definition on gathered keys."""
    rng = np.random.default_rng(13)
    slots_total, L = 5, 11
    ck = rng.standard_normal((slots_total, nkv, L, hs)).astype(np.float32)
    cv = rng.standard_normal((slots_total, nkv, L, hs)).astype(np.float32)
    slots, q_pos = np.array([3, 0, 4, 3]), np.array([10, 0, 5, 2])
    q = rng.standard_normal((4, nh, 1, hs)).astype(np.float32) * 3
    got = kernels.attend_cache(q, ck, cv, slots, q_pos, window, scale=0.3 if softcap else None, softcap=softcap)
    assert got.shape == (4, 1, nh, hs) and got.dtype == np.float32 and got.flags.c_contiguous
    want = np.zeros((4, 1, nh, hs))
    for b, (slot, p) in enumerate(zip(slots, q_pos)):
        for h in range(nh):
            kh = h // (nh // nkv)
            keys = [j for j in range(L) if j <= p and (window <= 0 or j > p - window)]
            s = np.array([q[b, h, 0].astype(np.float64) @ ck[slot, kh, j] for j in keys])
            s *= 0.3 if softcap else hs ** -0.5
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            want[b, 0, h] = (w / w.sum()) @ cv[slot, kh, keys].astype(np.float64)
    np.testing.assert_allclose(got, want, atol=3e-6)
    from rlx_mpi.kernels import attention, attention_cache  # both variants `_attend_kernel` picks from: equal values
    ys = [np.empty((4, nh, hs), np.float32) for _ in range(2)]
    for kernel, y in zip((attention_cache._attend_cache, attention_cache._attend_cache_par), ys):
        kernel(np.ascontiguousarray(q[:, :, 0]), ck, cv, attention_cache._NO_TABLE, 0, slots, q_pos, window,
               np.float32(0.3 if softcap else hs ** -0.5), np.float32(softcap), attention._NO_SINKS, y)
    np.testing.assert_array_equal(ys[0], ys[1])
    np.testing.assert_allclose(ys[0].reshape(got.shape), want, atol=3e-6)
    if not window and not softcap:  # and the same as `attend` over the gathered prefix views
        for b in range(4):
            view = (ck[slots[b:b + 1], :, :q_pos[b] + 1], cv[slots[b:b + 1], :, :q_pos[b] + 1])
            np.testing.assert_allclose(got[b:b + 1], kernels.attend(q[b:b + 1], *view), atol=2e-6)
    q[2, 1, 0, 0] = np.nan  # a NaN query comes out NaN in its own head only
    y = kernels.attend_cache(q, ck, cv, slots, q_pos, window)
    assert np.isnan(y[2, 0, 1]).all() and np.isfinite(np.delete(y.reshape(4 * nh, hs), 2 * nh + 1, axis=0)).all()
    with pytest.raises(ValueError, match=r"slots \[0, 1, 2, 5\] must lie in 0\.\."):
        kernels.attend_cache(q, ck, cv, np.array([0, 1, 2, 5]), q_pos)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.attend_cache(q[:, :, :0], ck, cv, slots, q_pos)


@pytest.mark.parametrize("qk_norm, softcap, L", [(False, 0.0, 12), (True, 0.0, 12), (False, 4.0, 5)])
def test_decode_attention_against_numpy(qk_norm, softcap, L):
    """The fused decode step (norms, RoPE, cache write, attention) against the numpy sequence it
    replaces: rms_norm, rope, the cache write at p % L, attention over columns 0..min(p, L-1)."""
    rng = np.random.default_rng(14)
    B, nh, nkv, hs, slots_total = 3, 4, 2, 16, 4
    qd, kd = nh * hs, nkv * hs
    qkv = rng.standard_normal((B, qd + 2 * kd)).astype(np.float32)
    cos, sin = rng.standard_normal((2, B, hs)).astype(np.float32)
    ck = rng.standard_normal((slots_total, nkv, L, hs)).astype(np.float32)
    cv = rng.standard_normal((slots_total, nkv, L, hs)).astype(np.float32)
    slots, pos = np.array([2, 0, 3]), np.array([7, 0, 11])  # L = 5: a ring that has wrapped
    norm = rng.uniform(0.5, 1.5, hs).astype(np.float32) if qk_norm else None
    want_k, want_v = ck.copy(), cv.copy()
    q = qkv[:, :qd].reshape(B, nh, hs)
    k = qkv[:, qd:qd + kd].reshape(B, nkv, hs)
    if qk_norm:
        q = kernels.rms_norm(np.ascontiguousarray(q), norm, 1e-5)
        k = kernels.rms_norm(np.ascontiguousarray(k), norm, 1e-5)
    q = kernels.rope(q[:, :, None], cos[:, None, None], sin[:, None, None])  # (B, nh, 1, hs)
    k = kernels.rope(k[:, :, None], cos[:, None, None], sin[:, None, None])
    for b in range(B):
        want_k[slots[b], :, pos[b] % L] = k[b, :, 0]
        want_v[slots[b], :, pos[b] % L] = qkv[b, qd + kd:].reshape(nkv, hs)
    want = kernels.attend_cache(q, want_k, want_v, slots, np.minimum(pos, L - 1), scale=0.2, softcap=softcap)
    got = kernels.decode_attention(qkv, qd, cos, sin, ck, cv, slots, pos, q_norm=norm, k_norm=norm, eps=1e-5,
                                   scale=0.2, softcap=softcap)
    np.testing.assert_allclose(ck, want_k, atol=1e-6)
    np.testing.assert_array_equal(cv, want_v)
    np.testing.assert_allclose(got, want.reshape(B, qd), atol=2e-6)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.decode_attention(np.ascontiguousarray(qkv[:, 1:]), qd, cos, sin, ck, cv, slots, pos)
    with pytest.raises(ValueError, match=r"decode_attention: slots \[2, 0, 4\] must lie in 0\.\.3"):
        kernels.decode_attention(qkv, qd, cos, sin, ck, cv, np.array([2, 0, 4]), pos)


def test_a_decode_step_checks_its_rows_once_for_every_layer():
    """The slots and positions of a decode step are checked when the step is made (the layers'
    attention then skips the reductions): a bad slot or position is refused there, named."""
    from rlx_mpi.families.decoder.model import KvStep
    from rlx_mpi.model.kv_cache import KvSpec, LayerCache

    caches = [LayerCache(3, 2, 8, 4) for _ in range(2)]
    specs = [KvSpec("full")] * 2
    step = KvStep(specs, [0, 2], False, positions=[5, 0], caches=caches)
    assert step.slots.dtype == np.int64 and step.positions.tolist() == [5, 0]
    with pytest.raises(ValueError, match=r"decode step: slots \[0, 3\] must lie in 0\.\.2"):
        KvStep(specs, [0, 3], False, positions=[5, 0], caches=caches)
    with pytest.raises(ValueError, match=r"positions \[-1, 0\] be >= 0"):
        KvStep(specs, [0, 1], False, positions=[-1, 0], caches=caches)


def test_attend_propagates_nan():
    """A NaN query must come out NaN (the stage's finite check names it), not be masked away."""
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    kv = rng.standard_normal((1, 1, 70, 8)).astype(np.float32)
    q[0, 1, 66, 3] = np.nan
    y = kernels.attend(q, kv, kv)
    assert np.isnan(y[0, 66, 1]).all() and np.isfinite(np.delete(y[0], 66, axis=0)).all()


@pytest.mark.parametrize("R, N, K", [(1, 1, 1), (1, 37, 65), (3, 129, 300), (8, 1376, 512), (5, 20, 100), (4, 7, 8),
                                     (9, 33, 200), (12, 3, 48)])  # 4-row groups, weight-row pairs, odd rows, tails
def test_matvec_f32_against_numpy(R, N, K):
    """Decode's f32 product (llama/weights.py takes it up to F32_MATVEC_ROWS rows)."""
    rng = np.random.default_rng(R * N + K)
    x = rng.standard_normal((R, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    got = kernels.matvec_f32(x, w)
    assert got.shape == (R, N) and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.matvec_f32(x, w[:, :-1].copy() if K > 1 else np.ones((N, 2), np.float32))
    with pytest.raises(TypeError, match="C-contiguous float32"):
        kernels.matvec_f32(x.astype(np.float64), w)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16"])
def test_float_matvec_tiles_cover_every_chunk_remainder(fmt):
    """The float matvec takes weight rows TILE_W at a time, then three, two or one (rowdot's tile
    note), in each chunk of rows a thread owns: chunks of 3-7 rows leave every remainder, against
    numpy on the decoded weights (bf16: on the activations as read, `bf16_read`), for activation
    rows in groups of 4 and beside them."""
    from rlx_mpi.kernels import lowp
    from rlx_mpi.kernels.matvec import _matvec_float

    rng = np.random.default_rng(31)
    for n in (3, 4, 5, 6, 7):
        for r in (4, 5, 8, 11):
            x = rng.standard_normal((r, 40)).astype(np.float32)
            w = rng.standard_normal((n, 40)).astype(np.float32)
            if fmt == "bf16":
                stored = lowp.to_bf16(w)
                w = lowp.from_bf16(stored)
            elif fmt == "f16":
                stored = lowp.kernel_weight(fmt, w.astype(np.float16).view(np.uint16))
                w = w.astype(np.float16).astype(np.float32)
            else:
                stored = w
            for chunks in (1, 2):
                out = np.full((r, n), np.nan, np.float32)
                _matvec_float(x, stored, out, chunks)
                xr = bf16_read(x) if fmt == "bf16" else x.astype(np.float64)
                np.testing.assert_allclose(out, xr @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5 * 40 ** 0.5)


def test_bf16_products_round_the_activations_on_every_row_where_the_cpu_has_bf16_dot():
    """bf16 weights: on a CPU with AVX512-BF16 every activation row and column is rounded to bf16
    (nearest even) and multiplied by vdpbf16ps, whatever the row count, decode or prefill (rowdot's
    bf16 dot note; the invariance note); elsewhere every product is float32. Against numpy in
    float64 on the activations so read (`helpers.bf16_read`)."""
    from rlx_mpi.kernels import lowp
    from rlx_mpi.kernels.matvec import _matvec_float, matmul_float
    from rlx_mpi.kernels.rowdot import BF16_DOT, DP_STEP

    rng = np.random.default_rng(37)
    for k in (DP_STEP, 3 * DP_STEP + 17, 1024):
        for r in (1, 2, 3, 4, 70):
            x = (rng.standard_normal((r, k)) * 3).astype(np.float32)
            stored = lowp.to_bf16(rng.standard_normal((9, k)).astype(np.float32))
            w = lowp.from_bf16(stored).astype(np.float64)
            for chunks in (1, 3):
                out = np.full((r, 9), np.nan, np.float32)
                _matvec_float(x, stored, out, chunks)
                np.testing.assert_allclose(out, bf16_read(x) @ w.T, rtol=1e-5, atol=1e-5 * k ** 0.5)
                assert (matmul_float(x, stored) == out).all()
                if BF16_DOT:  # the rounding is there: the exact activations give another product
                    assert np.abs(out - x.astype(np.float64) @ w.T).max() > 1e-5 * k ** 0.5


def _run_on_haswell(code: str, cache) -> str:
    """stdout of ``python -c code`` with numba compiling for Haswell (AVX2: no AVX-512, no
    AVX512-BF16) into the cache directory ``cache``, so the host's own kernels stay untouched."""
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_bf16_matvec_widens_exactly_on_a_cpu_without_bf16_dot(tmp_path):
    """Compiled for a CPU without AVX512-BF16 (NUMBA_CPU_NAME, a cache of its own), the bf16
    matvec of one row keeps float32 activations: exact products of the bf16 weights."""
    code = (
        "import numpy as np\n"
        "from rlx_mpi import kernels\n"
        "from rlx_mpi.kernels.rowdot import BF16_DOT\n"
        "rng = np.random.default_rng(5)\n"
        "x = rng.standard_normal((1, 256)).astype(np.float32) * 3\n"
        "bits = kernels.to_bf16(rng.standard_normal((7, 256)).astype(np.float32))\n"
        "got = kernels.dequant_matmul(x, bits, 'bf16')\n"
        "want = x.astype(np.float64) @ kernels.from_bf16(bits).T.astype(np.float64)\n"
        "print(BF16_DOT, float(np.abs(got - want).max()))\n")
    flag, err = _run_on_haswell(code, tmp_path).split()
    assert flag == "False" and float(err) < 1e-4, (flag, err)


def test_float_matvec_on_a_cpu_without_avx512_takes_8_lane_vectors(tmp_path):
    """Compiled for a CPU without AVX-512 (NUMBA_CPU_NAME=haswell, a cache of its own), rowdot's
    float dot products take 8-lane vectors (16 columns a step, as before AVX-512's 16 lanes), and
    the f32, bf16 and f16 matvecs still give numpy's products on one row, the tile's rows and the
    rows beside them, with columns past the last step, and prefill's tiles (WIDE_ROWS rows: 3) the
    same values, bit for bit (the invariance note)."""
    code = (
        "import numpy as np\n"
        "from rlx_mpi import kernels\n"
        "from rlx_mpi.kernels import lowp, rowdot\n"
        "from rlx_mpi.kernels.matvec import _matvec_float\n"
        "rng = np.random.default_rng(8)\n"
        "worst = 0.0\n"
        "for fmt in ('f32', 'bf16', 'f16'):\n"
        "    for r in (1, 4, 5, 9):\n"
        "        x = rng.standard_normal((r, 100)).astype(np.float32)\n"
        "        w = rng.standard_normal((37, 100)).astype(np.float32)\n"
        "        if fmt == 'bf16':\n"
        "            stored = lowp.to_bf16(w); w = lowp.from_bf16(stored)\n"
        "        elif fmt == 'f16':\n"
        "            stored = lowp.kernel_weight(fmt, w.astype(np.float16).view(np.uint16)); w = w.astype(np.float16).astype(np.float32)\n"
        "        else:\n"
        "            stored = w\n"
        "        out = np.full((r, 37), np.nan, np.float32)\n"
        "        _matvec_float(x, stored, out, 2)\n"
        "        worst = max(worst, float(np.abs(out - x.astype(np.float64) @ w.T.astype(np.float64)).max()))\n"
        "        assert (kernels.matmul_float(x, stored) == out).all()\n"
        "print(rowdot.FLANES, rowdot.STEP, rowdot.WIDE_ROWS, worst)\n")
    out = _run_on_haswell(code, tmp_path)
    lanes, step, wide, err = out.split()
    assert (lanes, step, wide) == ("8", "16", "3") and float(err) < 1e-4, out


def test_linear_takes_the_same_values_on_every_row_count_path():
    """Linear takes the pool's matvec up to F32_MATVEC_ROWS rows and the team's tiles above: numpy's
    products, and each row bit for bit the same on either path (the invariance note)."""
    from rlx_mpi.families.decoder.weights import make_linear

    rng = np.random.default_rng(5)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    lin = make_linear(w, "f32")
    x = rng.standard_normal((200, 200)).astype(np.float32)
    full = x.astype(np.float64) @ w.T.astype(np.float64)
    for rows in (1, kernels.F32_MATVEC_ROWS, kernels.F32_MATVEC_ROWS + 1, 63, 64, 200):
        got = lin(x[:rows])
        np.testing.assert_allclose(got, full[:rows], rtol=1e-5, atol=1e-4)
        assert (got == lin(x)[:rows]).all()


def test_set_threads_sizes_the_matvec_pool_and_is_remembered():
    """set_threads pins numba's pool and the count the matvec wrappers split rows by (kept, so
    a decode step does not ask numba 113 times); the products stay right at either count."""
    import numba

    from rlx_mpi.kernels._common import pool_threads

    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 96)).astype(np.float32), rng.standard_normal((70, 96)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    before = numba.get_num_threads()
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            kernels.set_threads(n)
            assert pool_threads() == numba.get_num_threads() == n
            np.testing.assert_allclose(kernels.matvec_f32(x, w), want, rtol=1e-5, atol=1e-4)
            bits = kernels.to_bf16(w)
            np.testing.assert_allclose(kernels.dequant_matmul(x, bits, "bf16"),
                                       bf16_read(x) @ kernels.from_bf16(bits).T.astype(np.float64),
                                       rtol=1e-5, atol=1e-4)
        kernels.set_threads(10 ** 6)  # capped at numba's pool size
        assert pool_threads() == numba.config.NUMBA_NUM_THREADS
    finally:
        kernels.set_threads(before)


def test_numba_caches_are_dropped_when_any_kernel_source_changes(tmp_path):
    """numba keys a cache on its own file only (kernels/_fresh.py's note): a change to any source
    of the folder deletes every cache file once (other files stay), and nothing else does."""
    from rlx_mpi.kernels._fresh import drop_stale

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()

    def fill():
        for name in ("b._f-3.py311.nbi", "b._f-3.py311.1.nbc"):
            (cache / name).write_bytes(b"compiled")
        (cache / "a.cpython-311.pyc").write_bytes(b"bytecode")

    fill()
    assert drop_stale(tmp_path)  # no stamp yet: built from unknown sources
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith("rlx-")) == ["a.cpython-311.pyc"]
    fill()
    assert not drop_stale(tmp_path) and len(list(cache.glob("*.nb?"))) == 2  # same sources: kept
    (tmp_path / "a.py").write_text("x = 3\n")  # only a.py changed: b's caches go too
    assert drop_stale(tmp_path) and not list(cache.glob("*.nb?"))
    fill()
    assert not drop_stale(tmp_path)
    (tmp_path / "c.py").write_text("")  # a new source file counts as a change
    assert drop_stale(tmp_path) and (cache / "a.cpython-311.pyc").exists()


def test_numba_cache_lock_held_elsewhere_is_given_up_on_not_waited_for(tmp_path):
    """A process stopped while holding the cache lock must not hang every rank's import."""
    import fcntl
    import time

    from rlx_mpi.kernels._fresh import STAMP, drop_stale

    (tmp_path / "a.py").write_text("x = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    (cache / "a._f-1.py311.nbi").write_bytes(b"compiled")
    with open(cache / (STAMP + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        assert not drop_stale(tmp_path, wait_s=0.3)
        assert time.monotonic() - t0 < 3 and (cache / "a._f-1.py311.nbi").exists()
    assert drop_stale(tmp_path, wait_s=0.3)  # released: done


@pytest.mark.parametrize("parts", [1, 3])
def test_matmul_float_matches_numpy_and_the_matvec_at_every_tile_remainder(monkeypatch, parts):
    """kernels.matmul_float (prefill's float products) against float64 numpy: rows that are and are
    not multiples of WIDE_ROWS and ROWS, weight rows past the TILE_W tiles and the BLOCK_ROWS blocks,
    K of 1, odd and past whole steps; split over 1 and 3 parts of the weight rows (uneven cuts);
    every element bit for bit the decode matvec's (the invariance note)."""
    from rlx_mpi.kernels import matvec

    monkeypatch.setattr(matvec, "pool_threads", lambda: parts)
    rng = np.random.default_rng(11)
    worst = 0.0
    for m in (1, 5, 6, 7, 13, 65, 130):
        for n in (1, 7, 8, 17, 64 + 8 + 3, 150):
            for k in (1, 37, 100):
                x = rng.standard_normal((m, k)).astype(np.float32)
                w = rng.standard_normal((n, k)).astype(np.float32)
                got = kernels.matmul_float(x, w)
                assert got.shape == (m, n) and got.flags.c_contiguous
                want = x.astype(np.float64) @ w.T.astype(np.float64)
                worst = max(worst, float(np.abs(got - want).max() / (1 + np.abs(want).max())))
                out = np.empty((m, n), np.float32)
                matvec._matvec_float(x, w, out, 2)
                assert (got == out).all(), (m, n, k)
    assert worst < 1e-6, worst


def test_the_ranks_thread_share_holds_in_every_thread():
    """numba's thread count is per thread: a thread other than set_threads' (the start-up's,
    which builds the stage) starts at NUMBA_NUM_THREADS. The load-time quantizers run on the
    rank's share there too (a q4 job of 2 ranks on 2 cores quantized on 4 threads before)."""
    import subprocess
    import sys

    code = (
        "import threading, numba, numpy as np\n"
        "from rlx_mpi import kernels\n"
        "kernels.set_threads(1)\n"
        "seen = {}\n"
        "def work(name, fn):\n"
        "    seen[name + ' before'] = numba.get_num_threads()\n"
        "    fn(np.ones((4, 64), np.float32))\n"
        "    seen[name] = numba.get_num_threads()\n"
        "for name, fn in (('q4', kernels.quantize_q4), ('int8', kernels.quantize_int8)):\n"
        "    t = threading.Thread(target=work, args=(name, fn)); t.start(); t.join()\n"
        "print(sorted(seen.items()))\n")
    env = dict(os.environ, NUMBA_NUM_THREADS="2")  # (the premise on any host: a new thread's count is 2)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str([("int8", 1), ("int8 before", 2), ("q4", 1), ("q4 before", 2)])
