"""``rlx-mpi score`` under a real mpiexec: log-probs equal transformers' on 1 rank, 2 stages,
TP 2 and 2 stages x TP 2; context/continuation lines score only the continuation; a plug-in family through the
contract; stop signal and resume to the identical file; another checkpoint refused on resume;
a NaN checkpoint and bad lines end in one line and write nothing."""

import json
import math
import shutil
import signal
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import kill_tree, run_cli, start_cli, write_job
from helpers import LaunchAhead, rows_of
from rlx_mpi.io.identity import meta_path
from rlx_mpi.io.journal import REQUEUE_EXIT

pytestmark = pytest.mark.mpi
FIXTURES = Path(__file__).parent / "fixtures"


def job_of(d: Path, ckpt, name="job.toml", **model) -> Path:
    return write_job(d, name, model={"checkpoint": str(ckpt), **model}, run={"timeout_s": 30.0},
                     placement={"reserve_ram_gb": 0.0})


def score(job, prompts, out, *flags, ranks=2, timeout=120, tp=None):
    return run_cli(["score", job, "--prompts", prompts, "--out", out, *flags], ranks=ranks, timeout=timeout)


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def errors_of(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("rlx-mpi: error:")]


def summary_of(stdout: str) -> tuple[int, int, float]:
    """(rows, scored tokens, perplexity) of the summary line the command prints last."""
    line = [x for x in stdout.splitlines() if x.startswith("score: ")][-1]
    words = line.split()
    return int(words[words.index("rows,") - 1]), int(words[words.index("scored") - 1]), float(words[-1])


# -- equal to transformers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The tiny HF Llama converted with the real ``rlx-mpi convert``, and transformers' log-probs."""
    d = tmp_path_factory.mktemp("hf")
    proc = run_cli(["convert", FIXTURES / "hf_tiny_llama", d / "m.h5"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    with np.load(FIXTURES / "score_hf_tiny_llama.npz", allow_pickle=False) as f:  # tests/make_score_fixture.py
        ref = f["token_logprobs"]
    return d / "m.h5", np.load(FIXTURES / "hf_tiny_llama" / "input_ids.npy", allow_pickle=False), ref


def lines_of(ids) -> list[dict]:
    a, b = ids[0].tolist(), ids[1].tolist()
    return [{"id": "a", "tokens": a}, {"id": "b", "tokens": b},
            {"id": "ca", "context": a[:4], "continuation": a[4:]},  # only the continuation is scored
            {"id": "pb", "tokens": b[:5]},  # shorter: padded beside a longer line in its microbatch
            {"id": "cb", "context": b[:1], "continuation": b[1:3]}]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, hf, tiny_ckpt):
    """test_log_probs_equal_transformers' runs, started ahead of the tests two at a time
    (helpers.LaunchAhead: they are start-up bound): (CompletedProcess, folder); and last the
    uninterrupted reference run of `long_run` (checked for results only)."""
    ckpt, ids, _ = hf

    def launch(item):
        if item == "long_run":
            return _long_run(tmp_path_factory.mktemp("long"), tiny_ckpt)
        p = item.callspec.params
        d = tmp_path_factory.mktemp(f"logprobs_{p['ranks']}_{p['tp']}")
        prompts = write_lines(d / "p.jsonl", lines_of(ids))
        job = write_job(d, model={"checkpoint": str(ckpt)}, run={"timeout_s": 30.0},
                        placement={"reserve_ram_gb": 0.0, "tp": p["tp"]})
        # 14 tokens per microbatch: two lines of 7, or a line of 7 with the 5-token one padded to 7
        return score(job, prompts, d / "s.jsonl", "--batch", 14, "--json", d / "stats.json", ranks=p["ranks"]), d

    items = LaunchAhead.fixture_items(request, "test_log_probs_equal_transformers")
    ahead = LaunchAhead([*items, "long_run"], launch, key=lambda item: item if item == "long_run" else item.nodeid)
    yield ahead
    ahead.close()


@pytest.mark.parametrize("ranks, tp", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_log_probs_equal_transformers(request, runs, hf, ranks, tp):
    ckpt, ids, ref = hf
    a, b = ids[0].tolist(), ids[1].tolist()
    lines = lines_of(ids)
    proc, tmp_path = runs.result(request)
    out = tmp_path / "s.jsonl"
    assert proc.returncode == 0, proc.stderr
    rows = {r["id"]: r for r in rows_of(out)}
    assert [r["id"] for r in rows_of(out)] == [x["id"] for x in lines]  # prompt order
    want = {"a": (a[1:], ref[0]), "b": (b[1:], ref[1]), "ca": (a[4:], ref[0, 3:]), "pb": (b[1:5], ref[1, :4]),
            "cb": (b[1:3], ref[1, :2])}
    for pid, (tokens, lps) in want.items():
        r = rows[pid]
        assert r["tokens"] == tokens and r["n"] == len(tokens), pid
        np.testing.assert_allclose(r["logprobs"], lps, atol=1e-4, rtol=0, err_msg=pid)
        assert abs(r["sum"] - float(np.sum(lps, dtype=np.float64))) < 1e-3, pid
    assert rows["ca"]["prompt_tokens"] == 7 and rows["cb"]["prompt_tokens"] == 3
    n, tokens, ppl = summary_of(proc.stdout)
    total = sum(r["sum"] for r in rows.values())
    assert n == 5 and tokens == sum(len(t) for t, _ in want.values())
    assert math.isclose(ppl, math.exp(-total / tokens), rel_tol=1e-5)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["done_now"] == 5 and stats["summary"]["tokens"] == tokens and len(stats["timings"]) == ranks


def test_a_plug_in_family_through_the_contract(tmp_path):
    """The protocol family (forward only, no attention) on 3 stages, against its numpy reference;
    the job's [score] section instead of flags."""
    import protocol_family as proto

    ckpt = tmp_path / "proto.h5"
    cfg = proto.write_checkpoint(ckpt)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, cfg["vocab"], n).tolist() for n in (4, 9, 2, 6)]
    prompts = write_lines(tmp_path / "p.jsonl", [{"id": f"p{i}", "tokens": t} for i, t in enumerate(seqs)])
    out = tmp_path / "s.jsonl"
    job = write_job(tmp_path, model={"checkpoint": str(ckpt), "plugins": ["protocol_family"]},
                    run={"timeout_s": 30.0}, placement={"reserve_ram_gb": 0.0},
                    score={"prompts": str(prompts), "out": str(out), "batch": 12})  # no flags: the [score] section
    proc = run_cli(["score", job], ranks=3, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "3 microbatches" in proc.stdout  # lines of 9, 6 and 4 + 2 tokens
    for t, row in zip(seqs, rows_of(out)):
        x = proto.reference(cfg, np.array([t])).astype(np.float64)[0]
        lp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
        np.testing.assert_allclose(row["logprobs"], [lp[i - 1, t[i]] for i in range(1, len(t))], atol=1e-5)


# -- stop, resume, identity --------------------------------------------------------------------

LONG = [{"id": f"q{i}", "tokens": np.random.default_rng(200 + i).integers(0, 512, 20 + (i * 37) % 90).tolist()}
        for i in range(240)]
LONG_FLAGS = ("--batch", 32)  # every line its own microbatch, ~2 lines a round: many rounds


@pytest.fixture(scope="module")
def long_run(runs):
    """The uninterrupted run the stop and resume tests compare with (started ahead in `runs`)."""
    return runs.get("long_run")


def _long_run(d, tiny_ckpt):
    prompts = write_lines(d / "p.jsonl", LONG)
    job = job_of(d, tiny_ckpt)
    proc = score(job, prompts, d / "full.jsonl", *LONG_FLAGS)
    assert proc.returncode == 0, proc.stderr
    return job, prompts, (d / "full.jsonl").read_bytes(), proc.stdout


def test_sigterm_mid_file_then_resume_gives_the_identical_file(tmp_path, long_run):
    job, prompts, want, full_stdout = long_run
    out = tmp_path / "s.jsonl"
    proc = start_cli(["score", job, "--prompts", prompts, "--out", out, *LONG_FLAGS], ranks=2)
    deadline = time.monotonic() + 90
    while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc.pid)
            pytest.fail(f"no rows in time (exit {proc.returncode})\n{proc.communicate()[1]}")
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # to mpiexec, which passes it to every rank
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == REQUEUE_EXIT, err
    assert "stopped by SIGTERM" in err and "resume" in err and "Traceback" not in err
    part = out.read_bytes()
    assert part.endswith(b"\n") and 2 <= part.count(b"\n") < len(LONG) and want.startswith(part)
    proc = score(job, prompts, out, *LONG_FLAGS)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == want
    assert summary_of(proc.stdout) == summary_of(full_stdout)  # the summary is of the whole file
    proc = score(job, prompts, out, *LONG_FLAGS)  # all done: the file is left alone, the summary printed
    assert proc.returncode == 0 and out.read_bytes() == want, proc.stderr
    assert summary_of(proc.stdout) == summary_of(full_stdout)


def test_a_file_scored_in_two_parts_equals_one_run_and_another_checkpoint_is_refused(tmp_path, tiny_ckpt,
                                                                                     long_run):
    job, prompts, want, _ = long_run
    first = write_lines(tmp_path / "first.jsonl", LONG[:50])
    out = tmp_path / "s.jsonl"
    # the same --batch: with 32, every line is a microbatch of its own whatever the rounds, so
    # the bits do not depend on where the file was cut (another batching differs in float32 rounding)
    proc = score(job, first, out, *LONG_FLAGS)
    assert proc.returncode == 0, proc.stderr
    done = out.read_bytes()
    assert done.count(b"\n") == 50
    other = tmp_path / "other.h5"
    shutil.copy(tiny_ckpt, other)
    with h5py.File(other, "r+", locking=False) as f:
        f["layers/5/down_proj"][0, 0] += 0.5
    proc = score(job_of(tmp_path, other, name="other.toml"), prompts, out, *LONG_FLAGS)
    errs = errors_of(proc)
    assert proc.returncode == 2 and len(errs) == 1 and "checkpoint tensors_sha256" in errs[0], proc.stderr
    assert "to start afresh remove" in errs[0] and out.read_bytes() == done
    proc = score(job, prompts, out, *LONG_FLAGS)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == want


# -- faults and bad input ----------------------------------------------------------------------


def test_a_nan_checkpoint_is_exit_4_naming_the_stage_and_line_with_no_rows(tmp_path, tiny_ckpt):
    ckpt = tmp_path / "nan.h5"
    shutil.copy(tiny_ckpt, ckpt)
    with h5py.File(ckpt, "r+", locking=False) as f:  # layer 5 is on stage 1 of 2
        f["layers/5/down_proj"][0, 0] = np.nan
    prompts = write_lines(tmp_path / "p.jsonl", LONG[:6])
    out = tmp_path / "s.jsonl"
    proc = score(job_of(tmp_path, ckpt), prompts, out, ranks=2, timeout=90)
    errs = errors_of(proc)
    assert proc.returncode == 4 and len(errs) == 1, proc.stderr
    assert "stage 1" in errs[0] and "line 'q" in errs[0] and "non-finite" in errs[0], errs
    assert not out.exists() and not meta_path(out).exists()


@pytest.mark.parametrize("case, needle", [
    ("no_context", "p.jsonl:2: \"continuation\" without \"context\""),
    ("too_long", "p.jsonl:3: line 'long' has 300 tokens but the model has 256 positions"),
    ("bad_token", "p.jsonl:1 \"continuation\": "),
    ("batch_0", "score --batch"),
    ("out_is_input", "is the input file"),
])
def test_bad_input_is_one_line_exit_2_before_compute(tmp_path, tiny_ckpt, case, needle):
    lines = ['{"id": "a", "context": [1, 2], "continuation": [3]}', '{"id": "b", "tokens": [4, 5, 6]}',
             '{"id": "c", "tokens": [7, 8]}']
    if case == "no_context":
        lines[1] = '{"id": "b", "continuation": [4, 5]}'
    if case == "too_long":
        lines[2] = json.dumps({"id": "long", "tokens": [1] * 300})
    if case == "bad_token":
        lines[0] = '{"id": "a", "context": [1, 2], "continuation": [3, 512]}'
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    before = prompts.read_bytes()
    out = prompts if case == "out_is_input" else tmp_path / "s.jsonl"
    flags = ("--batch", 0) if case == "batch_0" else ()
    proc = score(job_of(tmp_path, tiny_ckpt), prompts, out, *flags, timeout=90)
    errs = errors_of(proc)
    assert proc.returncode == 2 and len(errs) == 1 and needle in errs[0], proc.stderr
    assert "Traceback" not in proc.stderr and prompts.read_bytes() == before
    assert case == "out_is_input" or not out.exists()
    assert "forward_ms" not in proc.stdout  # nothing was computed


def test_plan_rounds_packs_every_line_once_within_the_budget():
    from rlx_mpi.drivers.score import plan_rounds

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 120, 300).tolist() + [500]  # the last one longer than the budget
    rounds = plan_rounds(lengths, 128, 4)
    seen = [k for r in rounds for mb in r for k in mb.lines]
    assert sorted(seen) == list(range(len(lengths)))  # every line once
    flat = [k for r in rounds for k in sorted(k for mb in r for k in mb.lines)]
    assert flat == list(range(len(lengths)))  # rounds are consecutive runs of the file
    for r in rounds:
        for mb in r:
            assert mb.length == max(lengths[k] for k in mb.lines)
            assert len(mb.lines) * mb.length <= 128 or len(mb.lines) == 1
    assert any(mb.lines == (300,) and mb.length == 500 for r in rounds for mb in r)
    # a short file still fills a pipeline of 4 microbatches
    assert [len(mb.lines) for mb in plan_rounds([7] * 8, 2048, 4)[0]] == [2, 2, 2, 2]
