"""``score`` with the prefix cache under a real mpiexec (the tiny preset): a few-shot file (one
shared context, questions, four answers each) gives bit-identical log-probs with and without
``--no-prefix-cache`` on 1 rank, 2 stages, TP 2 and 2 replicas; the final line and --json report
the line tokens reused; a job key turns it off; a job stopped after some rows resumes with it on
from a file written with it off."""

import json

import numpy as np
import pytest

from conftest import run_cli, write_job
from helpers import in_pairs, rows_of

pytestmark = pytest.mark.mpi

_rng = np.random.default_rng(11)
CONTEXT = _rng.integers(0, 512, 70).tolist()  # 4 full blocks of 16 and 6 more tokens
LINES = []
for _q in range(4):
    _question = CONTEXT + _rng.integers(0, 512, 10).tolist()  # 80 tokens: 4 blocks before token 79
    for _a in range(4):
        LINES.append({"id": f"q{_q}a{_a}", "context": _question, "continuation": _rng.integers(0, 512, 2 + _a).tolist()})
LINES.append({"id": "whole", "tokens": _rng.integers(0, 512, 40).tolist()})  # every token scored: nothing attached
# every context/continuation line but the first attaches the 4 blocks (64 positions) before its scored tokens
REUSED = (len(LINES) - 2) * 64
def _tokens(lines):
    return sum(len(x.get("tokens", [])) + len(x.get("context", [])) + len(x.get("continuation", [])) for x in lines)


TOTAL = _tokens(LINES)


def score(d, ckpt, ranks, out, *flags, name="job.toml", placement=None, score_sec=None):
    job = write_job(d, name, model={"checkpoint": str(ckpt)}, run={"timeout_s": 30.0},
                    placement={"reserve_ram_gb": 0.0, **(placement or {})}, **({"score": score_sec} if score_sec else {}))
    prompts = d / "p.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    return run_cli(["score", job, "--prompts", prompts, "--out", out, *flags], ranks=ranks, timeout=180)


@pytest.mark.parametrize("ranks, placement", [(1, {}), (2, {}), (2, {"tp": 2}), (2, {"replicas": 2})])
def test_logprobs_equal_without_the_prefix_cache(tmp_path, tiny_ckpt, ranks, placement):
    """Bit for bit: an attached prefix and a prefill of the rest give the numbers of the whole line
    (a row's numbers do not depend on its chunking: docs/invariance.md)."""
    on, off = in_pairs(
        lambda: score(tmp_path, tiny_ckpt, ranks, tmp_path / "on.jsonl", "--json", tmp_path / "on.json",
                      name="on.toml", placement=placement),
        lambda: score(tmp_path, tiny_ckpt, ranks, tmp_path / "off.jsonl", "--no-prefix-cache", "--json",
                      tmp_path / "off.json", name="off.toml", placement=placement))
    assert on.returncode == 0, on.stderr
    assert off.returncode == 0, off.stderr
    a, b = rows_of(tmp_path / "on.jsonl"), rows_of(tmp_path / "off.jsonl")
    assert [r["id"] for r in a] == [x["id"] for x in LINES]
    assert [r["logprobs"] for r in a] == [r["logprobs"] for r in b]
    assert [r["sum"] for r in a] == [r["sum"] for r in b]
    doc = json.loads((tmp_path / "on.json").read_text())
    if "replicas" in placement:  # each replica keeps its own pool: its first line computes the context
        assert REUSED - 64 <= doc["prefix_hits"][0] <= REUSED and doc["prefix_hits"][1] == TOTAL
    else:
        assert doc["prefix_hits"] == [REUSED, TOTAL]
        assert f"prefix cache: {REUSED} of {TOTAL} line tokens reused" in on.stdout
    assert doc["padded_tokens"] < json.loads((tmp_path / "off.json").read_text())["padded_tokens"] - REUSED // 2
    assert "prefix_hits" not in json.loads((tmp_path / "off.json").read_text())
    assert "prefix cache" not in off.stdout


def test_a_job_key_turns_it_off_and_a_resume_turns_it_on(tmp_path, tiny_ckpt):
    """[score] prefix_cache = false computes every line whole; the rows a later run adds with the
    cache on (resuming the file) are those of a run without it."""
    off = score(tmp_path, tiny_ckpt, 1, tmp_path / "off.jsonl", name="off.toml", score_sec={"prefix_cache": False})
    assert off.returncode == 0, off.stderr
    assert "prefix cache" not in off.stdout
    cut = tmp_path / "cut.jsonl"  # the first 6 rows, as a job stopped after its first round leaves them
    cut.write_text("".join((tmp_path / "off.jsonl").read_text().splitlines(keepends=True)[:6]))
    from rlx_mpi.io.identity import meta_path

    meta = meta_path(tmp_path / "off.jsonl")
    if meta.exists():
        meta_path(cut).write_text(meta.read_text())
    on = score(tmp_path, tiny_ckpt, 1, cut, "--json", tmp_path / "on.json", name="on.toml")
    assert on.returncode == 0, on.stderr
    assert rows_of(cut) == rows_of(tmp_path / "off.jsonl")
    doc = json.loads((tmp_path / "on.json").read_text())
    # the cache is rebuilt: the first resumed line computes the context, the 9 others after it attach it
    assert doc["done_before"] == 6 and doc["prefix_hits"] == [9 * 64, _tokens(LINES[6:])]
