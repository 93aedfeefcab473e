"""numba kernels against the naive numpy they replace."""

import numpy as np
import pytest

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
