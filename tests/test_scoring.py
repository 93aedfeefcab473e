"""Scoring maths (rlx-mpi score): against transformers' log-likelihood (a committed fixture),
naive numpy, and the prompt file's rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rlx_mpi.errors import InputError
from rlx_mpi.io.identity import prompt_digest
from rlx_mpi.io.journal import Journal
from rlx_mpi.io.scoring import (ScorePrompt, gather_logprobs, read_score_prompts, read_summary, score_row, summarize,
                             targets, token_logprobs)

FIX = Path(__file__).parent / "fixtures"
LIMITS = dict(vocab_size=100, max_positions=32)


@pytest.fixture(scope="module")
def hf():
    """transformers' tiny Llama: its logits, input ids and the log-likelihood torch computed."""
    with np.load(FIX / "score_hf_tiny_llama.npz", allow_pickle=False) as f:  # tests/make_score_fixture.py
        ref = {k: f[k] for k in f.files}
    ref["logits"] = np.load(FIX / "hf_tiny_llama" / "logits.npy", allow_pickle=False)
    ref["ids"] = np.load(FIX / "hf_tiny_llama" / "input_ids.npy", allow_pickle=False)
    return ref


def test_whole_lines_equal_transformers_log_likelihood_and_loss(hf):
    B, T = hf["ids"].shape
    lps = token_logprobs(hf["logits"], hf["ids"], [1] * B, [T] * B)
    for b in range(B):
        np.testing.assert_allclose(lps[b], hf["token_logprobs"][b], atol=2e-6, rtol=0)
    prompts = [ScorePrompt(b, f"r{b}", tuple(hf["ids"][b].tolist()), 1) for b in range(B)]
    s = summarize(score_row(p, lp) for p, lp in zip(prompts, lps))
    assert s.rows == B and s.tokens == B * (T - 1)
    # transformers' own loss for labels=input_ids: the mean NLL of the same tokens
    assert abs(-s.mean_logprob - float(hf["loss"])) < 1e-4
    assert math.isclose(s.perplexity, math.exp(float(hf["loss"])), rel_tol=1e-4)


def test_a_continuation_scores_only_its_tokens(hf):
    B, T = hf["ids"].shape
    lps = token_logprobs(hf["logits"], hf["ids"], [4, 2], [T, T - 1])
    np.testing.assert_allclose(lps[0], hf["token_logprobs"][0, 3:], atol=2e-6)
    np.testing.assert_allclose(lps[1], hf["token_logprobs"][1, 1:T - 2], atol=2e-6)


def test_targets_of_a_right_padded_batch_against_a_loop():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 50, (3, 9))
    starts, lengths = [1, 5, 2], [9, 7, 3]
    rows, pos, tgt = targets(ids, starts, lengths)
    want = [(b, t - 1, ids[b, t]) for b in range(3) for t in range(starts[b], lengths[b])]
    assert list(zip(rows.tolist(), pos.tolist(), tgt.tolist())) == want
    logits = rng.standard_normal((3, 9, 50)).astype(np.float32)
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x).sum(-1))
    got = token_logprobs(logits, ids, starts, lengths)
    for b in range(3):
        naive = [x[b, t - 1, ids[b, t]] - lse[b, t - 1] for t in range(starts[b], lengths[b])]
        np.testing.assert_allclose(got[b], naive, atol=2e-6)
    flat = gather_logprobs(logits[rows, pos], tgt, chunk_rows=2)  # chunks change nothing
    np.testing.assert_array_equal(flat, np.concatenate(got))
    for bad in ([0, 5, 2], [1, 7, 2], [1, 5, 4]):
        with pytest.raises(ValueError, match="need 1 <= start < length"):
            targets(ids, bad, lengths)


def test_rows_and_the_file_summary(tmp_path):
    p = ScorePrompt(0, "c", (1, 5, 6, 7), 2)
    row = score_row(p, np.array([-1.5, -0.25], np.float32))
    assert row == {"id": "c", "tokens": [6, 7], "logprobs": [-1.5, -0.25], "sum": -1.75, "n": 2, "prompt_tokens": 4}
    with pytest.raises(ValueError, match="not finite"):
        score_row(p, np.array([-np.inf, 0.0], np.float32))
    q = ScorePrompt(1, "d", (1, 2), 1)
    out = tmp_path / "S.jsonl"
    with Journal(out, [p, q]) as j:  # the journal takes score prompts as they are
        j.complete(0, row)
        j.complete(1, score_row(q, np.array([-0.25], np.float32)))
    s = read_summary(out)
    assert (s.rows, s.tokens, s.sum_logprob) == (2, 3, -2.0)
    assert math.isclose(s.perplexity, math.exp(2.0 / 3)) and "perplexity 1.94773" in s.line()
    assert math.isnan(summarize([]).perplexity)
    assert p.digest != ScorePrompt(0, "c", (1, 5, 6, 7), 1).digest == prompt_digest((1, 5, 6, 7), 1)


def test_the_four_line_forms(tmp_path):
    path = tmp_path / "P.jsonl"
    path.write_text('{"id": "a", "tokens": [1, 2, 3]}\n\n{"id": 7, "context": [1, 2], "continuation": [3, 4]}\n')
    a, b = read_score_prompts(path, **LIMITS)
    assert a == ScorePrompt(0, "a", (1, 2, 3), 1) and a.scored == (2, 3)
    assert b == ScorePrompt(1, "7", (1, 2, 3, 4), 2) and b.scored == (3, 4)


@pytest.mark.parametrize("line, where, words", [
    ('{"id": "a", "tokens": [1, 2], "context": [1]}', ":1", 'both "tokens" and "context"'),
    ('{"id": "a", "context": [1, 2]}', ":1", '"context" without "continuation"'),
    ('{"id": "a", "continuation": [1, 2]}', ":1", '"continuation" without "context"'),
    ('{"id": "a", "tokens": [1]}', ":1", "a single token: nothing to score"),
    ('{"id": "a", "context": [], "continuation": [1]}', ':1 "context"', "no tokens"),
    ('{"id": "a", "context": [1], "continuation": 3}', ':1 "continuation"', "is 3, a integer"),
    ('{"id": "a", "context": [1], "continuation": [100]}', ':1 "continuation"', "outside [0, 100)"),
    ('{"id": "a", "tokens": [1, 2], "score": 1}', ":1", "unknown key 'score'"),
    ('{"id": "a", "tokens": ' + json.dumps(list(range(33))) + "}", ":1", "has 33 tokens but the model has 32"),
    ('{"id": "a", "context": "the", "continuation": "capital"}', ':1 "context"', "the checkpoint has no tokenizer"),
])
def test_bad_lines_are_named(tmp_path, line, where, words):
    path = tmp_path / "P.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InputError) as e:
        read_score_prompts(path, **LIMITS)
    assert e.value.where == f"{path}{where}" and words in e.value.line(), e.value.line()


def test_duplicate_ids_and_an_empty_file(tmp_path):
    path = tmp_path / "P.jsonl"
    path.write_text('{"id": "a", "tokens": [1, 2]}\n{"id": "a", "tokens": [1, 2]}\n')
    with pytest.raises(InputError, match="already used on line 1"):
        read_score_prompts(path, **LIMITS)
    path.write_text("\n")
    with pytest.raises(InputError, match="no lines to score"):
        read_score_prompts(path, **LIMITS)


def test_text_context_gets_the_bos_and_the_continuation_does_not(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors

    from rlx_mpi.io.tokenizer import load_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "capital": 4, "of": 5, "france": 6, "is": 7, "paris": 8}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(tmp_path / "model.h5")
    path = tmp_path / "P.jsonl"
    path.write_text('{"id": "q", "context": "the capital of france is", "continuation": " paris"}\n'
                    '{"id": "w", "text": "the capital"}\n{"id": "m", "context": "is", "continuation": [8, 2]}\n')
    q, w, m = read_score_prompts(path, tokenizer=t, **LIMITS)
    assert q.tokens == (1, 3, 4, 5, 6, 7, 8) and q.scored == (8,) and q.text == " paris"
    assert w.tokens == (1, 3, 4) and w.scored == (3, 4) and w.text == "the capital"
    assert m.tokens == (1, 7, 8, 2) and m.scored == (8, 2) and m.text is None
