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
