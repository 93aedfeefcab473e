"""Prefill attention in blocks (kernels/attention.py, the block note): every query the same bits as
`_attend_one`, the kernel decode runs, computed one query at a time as the reference; and a
decode step (`attend_cache`) the same bits as prefill's row for the same query. The values
themselves against numpy: test_kernels.py (``naive_attend``)."""

import numba
import numpy as np
import pytest

from rlx_mpi import kernels
from rlx_mpi.kernels import attention
from rlx_mpi.kernels.attention import _NO_SINKS, _QB, _attend_one


def one_at_a_time(q, k, v, pos, window, scale, softcap, sinks):
    """y (B, T, nh, hv): `_attend_one` per query, as decode calls it (`_attend_group`)."""
    B, nh, T, _ = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nh // nkv
    y = np.empty((B, T, nh, v.shape[3]), np.float32)
    srow = np.empty(max(S, 1), np.float32)
    for b in range(B):
        for h in range(nh):
            sink = sinks[h] if sinks.shape[0] else np.float32(np.nan)
            for t in range(T):
                p = pos[b, t]
                lo, hi = (max(0, p - window + 1) if window > 0 else 0), min(S, p + 1)
                _attend_one(q[b, h], t, k[b, h // g], v[b, h // g], lo, hi, scale, softcap, sink, srow, y[b, t, h])
    return y


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


# (B, nkv, g, T, S, hs, hv, window, softcap, sinks, positions): hs past the tile's steps (24, 40, 80),
# g 1..8 (GQA), hv != hs (MLA), a chunk after earlier keys (S > T), windows shorter and longer
# than a block, positions in any order and past the keys (queries that see nothing), T not a
# multiple of the block
CASES = [
    (1, 2, 2, 64, 64, 64, 64, 0, 0.0, False, "causal"),
    (2, 1, 8, 29, 45, 24, 24, 0, 0.0, True, "causal"),
    (1, 2, 3, 40, 40, 40, 72, 7, 0.0, False, "causal"),
    (1, 1, 1, 50, 83, 80, 48, 0, 30.0, True, "causal"),
    (2, 2, 4, 13, 20, 96, 128, 3, 5.0, False, "causal"),
    (1, 1, 5, 37, 37, 32, 16, 0, 0.0, False, "random"),
    (1, 2, 2, 31, 31, 16, 16, 9, 0.0, True, "random"),
    (1, 1, 2, 3, 10, 64, 64, 0, 0.0, False, "causal"),  # fewer queries than a block
]


@pytest.mark.parametrize("B, nkv, g, T, S, hs, hv, window, softcap, sinks, positions", CASES)
def test_prefill_gives_every_query_the_bits_of_the_one_query_kernel(B, nkv, g, T, S, hs, hv, window, softcap,
                                                                     sinks, positions):
    rng = np.random.default_rng(T * 1000 + S)
    nh = nkv * g
    q = rng.standard_normal((B, nh, T, hs)).astype(np.float32) * 2
    k = rng.standard_normal((B, nkv, S, hs)).astype(np.float32) * 2
    v = rng.standard_normal((B, nkv, S, hv)).astype(np.float32)
    s = rng.standard_normal(nh).astype(np.float32) if sinks else None
    pos = (np.broadcast_to(np.arange(S - T, S), (B, T)) if positions == "causal"
           else rng.integers(0, S + window + 3, (B, T)))
    pos = np.ascontiguousarray(pos, np.int64)
    got = kernels.attend(q, k, v, pos, window, softcap=softcap, sinks=s)
    want = one_at_a_time(q, k, v, pos, window, np.float32(hs ** -0.5), np.float32(softcap),
                         _NO_SINKS if s is None else s)
    assert (bits(got) == bits(want)).all()
    if T >= _QB:  # the blocks ran (not only the last queries one at a time)
        assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_a_nan_in_a_block_gives_the_bits_of_the_one_query_kernel():
    """A block holding a NaN score is redone one query at a time: NaN bits and all."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 20, 32)).astype(np.float32)
    k = rng.standard_normal((1, 1, 20, 32)).astype(np.float32)
    v = rng.standard_normal((1, 1, 20, 32)).astype(np.float32)
    q[0, 1, 8, 3] = np.nan
    k[0, 0, 3, 5] = -np.nan  # (a NaN of the other sign: the integer peak ranks it below -Inf)
    got = kernels.attend(q, k, v)
    want = one_at_a_time(q, k, v, np.arange(20)[None], 0, np.float32(32 ** -0.5), np.float32(0.0), _NO_SINKS)
    assert (bits(got) == bits(want)).all()
    assert np.isnan(got[0, 3:]).all() and np.isfinite(got[0, :3]).all()


@pytest.mark.parametrize("window, softcap, sinks, hs", [(0, 0.0, False, 64), (6, 0.0, True, 40), (0, 4.0, False, 24)])
def test_decode_gives_the_bits_of_prefill_for_the_same_query(window, softcap, sinks, hs):
    """`attend_cache` of query t over a cache row holding the prompt's keys equals prefill's row t,
    at 1 and 2 threads (decode's pool kernel too)."""
    rng = np.random.default_rng(hs)
    nh, nkv, T, L = 6, 2, 23, 32
    q = rng.standard_normal((1, nh, T, hs)).astype(np.float32) * 2
    k = rng.standard_normal((1, nkv, T, hs)).astype(np.float32) * 2
    v = rng.standard_normal((1, nkv, T, hs)).astype(np.float32)
    s = rng.standard_normal(nh).astype(np.float32) if sinks else None
    prefill = kernels.attend(q, k, v, None, window, softcap=softcap, sinks=s)
    ck = rng.standard_normal((3, nkv, L, hs)).astype(np.float32)  # other slots hold other rows
    cv = rng.standard_normal((3, nkv, L, hs)).astype(np.float32)
    ck[1, :, :T], cv[1, :, :T] = k[0], v[0]
    before = kernels.pool_threads()
    try:
        for threads in (1, 2):
            kernels.set_threads(threads)
            for t in range(T):
                qt = np.ascontiguousarray(q[:, :, t:t + 1])
                rows = np.concatenate([qt, rng.standard_normal(qt.shape).astype(np.float32)])  # beside another row
                y = kernels.attend_cache(rows, ck, cv, np.array([1, 2]), np.array([t, 30]), window,
                                         softcap=softcap, sinks=s)
                assert (bits(y[0, 0]) == bits(prefill[0, t])).all(), (threads, t)
    finally:
        kernels.set_threads(before)


def test_value_and_sum_kernels_against_numpy():
    """The block's value sums and softmax sums: each element one multiply then one add per key in
    key order, float32 (numpy float32 arrays round each operation the same way)."""
    rng = np.random.default_rng(3)
    n, hv = 37, 2 * attention._VVEC * attention.FLANES
    p = rng.random((_QB, n + 5)).astype(np.float32)
    vals = rng.standard_normal((n + 9, hv)).astype(np.float32)
    acc = rng.standard_normal((_QB, hv)).astype(np.float32)
    want = acc.copy()
    for c in range(n):
        want = want + p[:, 2 + c, None] * vals[4 + c]
    values = numba.njit(lambda p, n, vals, d, acc: attention._values_block(p, 2, n, vals, 4, d, acc))
    values(p, n, vals, 0, acc)
    values(p, n, vals, attention._VVEC * attention.FLANES, acc)
    assert (bits(acc) == bits(want)).all()
    tot = rng.random(_QB).astype(np.float32)
    want = tot.copy()
    for c in range(n):
        want = want + p[:, 2 + c]
    numba.njit(lambda p, n, tot: attention._sums_block(p, 2, n, tot))(p, n, tot)
    assert (bits(tot) == bits(want)).all()
