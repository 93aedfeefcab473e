"""One model per job file (issue 36): under ``[run] kv_cache = "window:W"``, ``score`` and
``run`` compute the sliding-window model ``generate`` decodes with, not the full-attention one.

The reference is generate's own log-probs (``--logprobs``) of its greedy tokens, made through
the KV cache's ring (`kv_cache.py`), a different path from the forward's windowed mask; and the
full-attention scores differ, so the comparison can fail.
"""

import json

import h5py
import numpy as np
import pytest

from conftest import run_cli, write_job
from helpers import rows_of

pytestmark = pytest.mark.mpi

PROMPT = np.random.default_rng(5).integers(1, 512, 10).tolist()  # longer than the window
W = 4


def job(d, ckpt, kv: str, **run):
    return write_job(d, f"job-{kv.replace(':', '')}.toml", model={"checkpoint": str(ckpt)},
                     run={"timeout_s": 30.0, "kv_cache": kv, **run},
                     placement={"reserve_ram_gb": 0.0, "replicas": 1})


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_ckpt):
    d = tmp_path_factory.mktemp("window")
    prompts = d / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "tokens": PROMPT}) + "\n")
    proc = run_cli(["generate", job(d, tiny_ckpt, f"window:{W}"), "--prompts", prompts, "--out", d / "g.jsonl",
                    "--max-new-tokens", 4, "--logprobs", 1], ranks=1, timeout=120)
    assert proc.returncode == 0, proc.stderr
    row = rows_of(d / "g.jsonl")[0]
    return row["tokens"], [e["logprob"] for e in row["logprobs"]]


@pytest.mark.parametrize("ranks", [1, 2])
def test_score_applies_the_window_as_generate_does(tmp_path, tiny_ckpt, generated, ranks):
    tokens, want = generated
    lines = tmp_path / "s.jsonl"
    lines.write_text(json.dumps({"id": "a", "context": PROMPT, "continuation": tokens}) + "\n")
    got = {}
    for kv in (f"window:{W}", "full"):
        out = tmp_path / f"{kv.replace(':', '')}.jsonl"
        proc = run_cli(["score", job(tmp_path, tiny_ckpt, kv), "--prompts", lines, "--out", out], ranks=ranks,
                       timeout=120)
        assert proc.returncode == 0, proc.stderr
        got[kv] = rows_of(out)[0]["logprobs"]
    np.testing.assert_allclose(got[f"window:{W}"], want, rtol=0, atol=2e-4)
    assert np.max(np.abs(np.subtract(got["full"], want))) > 1e-2  # the window is a different model


def test_run_applies_the_window_as_generate_does(tmp_path, tiny_ckpt, generated):
    tokens, want = generated
    seq = PROMPT + tokens[:-1]
    ids = tmp_path / "ids.npy"
    np.save(ids, np.asarray([seq], np.int64))
    logp = {}
    for kv in (f"window:{W}", "full"):
        out = tmp_path / f"{kv.replace(':', '')}.h5"
        proc = run_cli(["run", job(tmp_path, tiny_ckpt, kv, batch=1, seq=len(seq)), "--input-ids", ids,
                        "--out", out], ranks=2, timeout=120)
        assert proc.returncode == 0, proc.stderr
        with h5py.File(out, "r") as f:
            logits = f["logits"][0].astype(np.float64)  # (T, V)
        z = logits - logits.max(axis=1, keepdims=True)
        lsm = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        logp[kv] = [lsm[len(PROMPT) - 1 + i, t] for i, t in enumerate(tokens)]
    np.testing.assert_allclose(logp[f"window:{W}"], want, rtol=0, atol=2e-4)
    assert np.max(np.abs(np.subtract(logp["full"], want))) > 1e-2


def test_a_score_resume_under_another_window_is_refused_and_the_rows_stay(tmp_path, tiny_ckpt):
    lines = tmp_path / "s.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "tokens": PROMPT}) + "\n" for i in "ab"))
    out = tmp_path / "o.jsonl"
    proc = run_cli(["score", job(tmp_path, tiny_ckpt, f"window:{W}"), "--prompts", lines, "--out", out], ranks=1,
                   timeout=120)
    assert proc.returncode == 0, proc.stderr
    out.write_bytes(out.read_bytes().split(b"\n")[0] + b"\n")  # as a stopped job leaves it
    before = out.read_bytes()
    proc = run_cli(["score", job(tmp_path, tiny_ckpt, "full"), "--prompts", lines, "--out", out], ranks=2,
                   timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f'kv_cache "window:{W}", this run has kv_cache "full"' in proc.stderr, proc.stderr
    assert out.read_bytes() == before
    proc = run_cli(["score", job(tmp_path, tiny_ckpt, f"window:{W}"), "--prompts", lines, "--out", out], ranks=2,
                   timeout=120)  # another layout, the same model: resumed
    assert proc.returncode == 0, proc.stderr
    assert [r["id"] for r in rows_of(out)] == ["a", "b"]
