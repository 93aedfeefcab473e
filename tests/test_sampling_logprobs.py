"""Log-probabilities for --logprobs K: against torch (a committed fixture) and numpy float64."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlx_mpi.engine.sampling import (SamplingParams, log_softmax, logprob_entries, logprobs, pack_sampled, sample,
                              unpack_sampled)

FIXTURE = Path(__file__).parent / "fixtures" / "logprobs_torch.npz"  # tests/make_logprobs_fixture.py


def naive(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax, the textbook way: the independent reference."""
    x = logits.astype(np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURE, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def test_log_softmax_equals_torch_and_float64(ref):
    got = log_softmax(ref["logits"])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref["log_softmax"], rtol=0, atol=2e-6)
    np.testing.assert_allclose(got, naive(ref["logits"]), rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("k", [0, 1, 5, 16])
def test_top_k_and_chosen_equal_torch_sort_with_ties_by_id(ref, k):
    logits = ref["logits"]
    chosen = sample(logits, np.arange(4), np.zeros(4), SamplingParams())  # greedy
    c_lp, ids, lp = logprobs(logits, chosen, k)
    assert ids.shape == (4, k) and ids.dtype == np.int64 and lp.dtype == np.float32
    np.testing.assert_array_equal(ids, ref["sorted_ids"][:, :k])  # ties (rows 1, 2) by lower id
    np.testing.assert_allclose(lp, ref["sorted_lp"][:, :k], atol=2e-6, rtol=0)
    np.testing.assert_allclose(c_lp, ref["log_softmax"][np.arange(4), chosen], atol=2e-6, rtol=0)
    if k:
        assert list(ids[1, :4]) == [7, 9, 300, 301][:k] and list(ids[2, :k]) == list(range(k))


def test_sampled_tokens_get_their_own_log_prob_not_the_tempered_one():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((3, 50)) * 3).astype(np.float32)
    params = SamplingParams(temperature=2.0, top_k=10, seed=5)
    chosen = sample(logits, np.array([11, 12, 13]), np.array([0, 1, 2]), params)
    c_lp, _, _ = logprobs(logits, chosen, 3)
    np.testing.assert_allclose(c_lp, naive(logits)[np.arange(3), chosen], atol=2e-6)


def test_random_rows_against_float64_at_a_large_vocabulary():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((2, 32_000)) * 5).astype(np.float32)
    c_lp, ids, lp = logprobs(logits, np.array([5, 31_999]), 8)
    ref = naive(logits)
    want = np.argsort(-ref, axis=1, kind="stable")[:, :8]
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_allclose(lp, np.take_along_axis(ref, want, 1), atol=5e-6)
    np.testing.assert_allclose(c_lp, ref[[0, 1], [5, 31_999]], atol=5e-6)


def test_row_entries_round_trip_float32_and_json():
    logits = np.array([[0.0, 1.0, -np.inf, 2.0]], np.float32)
    c_lp, ids, lp = logprobs(logits, np.array([3]), 4)
    entries = logprob_entries([3], c_lp, ids, lp)
    assert entries[0]["id"] == 3 and [i for i, _ in entries[0]["top"]] == [3, 1, 0, 2]
    assert entries[0]["top"][-1][1] is None  # log(0): null in JSON, never -Infinity
    text = json.dumps(entries, allow_nan=False)
    back = json.loads(text)[0]
    assert np.float32(back["logprob"]) == c_lp[0]
    assert [np.float32(v) for _, v in back["top"][:3]] == list(lp[0, :3])
    assert logprob_entries([3], c_lp, ids[:, :0], lp[:, :0]) == [{"id": 3, "logprob": entries[0]["logprob"], "top": []}]


def test_bad_arguments_are_refused():
    x = np.zeros((2, 5), np.float32)
    for args, words in [((x.astype(np.float64), np.array([0, 1]), 1), "float32"),
                        ((x, np.array([0, 5]), 1), r"in \[0, 5\)"),
                        ((x, np.array([0]), 1), "chosen must be"),
                        ((x, np.array([0, 1]), 6), "k must be"),
                        ((x[0], np.array([0]), 1), r"\(B, V\)")]:
        with pytest.raises(ValueError, match=words):
            logprobs(*args)


@pytest.mark.parametrize("k", [0, 3])
def test_packed_for_the_ring_round_trips_exactly(k):
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal((5, 300)) * 6).astype(np.float32)
    logits[0, 4] = -np.inf
    tokens = np.array([4, 0, 299, 7, 150])
    c_lp, ids, lp = logprobs(logits, tokens, k)
    packed = pack_sampled(tokens, c_lp, ids, lp)
    assert packed.dtype == np.int64 and packed.shape == (5, 2 + 2 * k)
    t2, c2, i2, l2 = unpack_sampled(packed)
    np.testing.assert_array_equal(t2, tokens)
    np.testing.assert_array_equal(i2, ids)
    assert c2.dtype == l2.dtype == np.float32 and c2[0] == -np.inf
    np.testing.assert_array_equal(c2.view(np.uint32), c_lp.view(np.uint32))  # bit for bit
    np.testing.assert_array_equal(l2.view(np.uint32), lp.view(np.uint32))
