"""``rlx-mpi generate`` under a real mpiexec: greedy tokens across rank counts and tensor
parallelism against transformers and the single-process loop, KV policies, sampling
reproducibility, and stop signals / kill -9 followed by a resume."""

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import kill_tree, run_cli, start_cli, write_job
from helpers import LaunchAhead, faulty_ckpt, in_pairs, rows_of  # noqa: F401 (a fixture)
from rlx_mpi.model.checkpoint import H5ParamSource
from rlx_mpi.io.journal import REQUEUE_EXIT
from rlx_mpi.model.kv_cache import KvSpec
from rlx_mpi.families.llama import PRESETS
from rlx_mpi.families.decoder.stage import DecoderStage as LlamaStage
from rlx_mpi.families import convert_hf
from test_generation import cached_greedy, forward_greedy

pytestmark = pytest.mark.mpi
FIXTURES = Path(__file__).parent / "fixtures"


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"id": pid, "tokens": list(map(int, t))}) + "\n" for pid, t in prompts))
    return path


def without_ms(rows):
    return [{k: v for k, v in r.items() if k != "ms"} for r in rows]


def generate(tmp_path, ckpt, ranks, prompts_path, out, *flags, run=None, placement=None, ranks_cfg=None,
             timeout=120, name="job.toml"):
    sections = {"model": {"checkpoint": str(ckpt)}, "run": {"timeout_s": 30.0, **(run or {})},
                "placement": {"reserve_ram_gb": 0.0, **(placement or {})}}
    if ranks_cfg:
        sections["rank"] = ranks_cfg
    job = write_job(tmp_path, name, **sections)
    return run_cli(["generate", job, "--prompts", prompts_path, "--out", out, *flags], ranks=ranks, timeout=timeout)


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "m.h5"
    convert_hf(FIXTURES / "hf_tiny_llama", out)
    return out


MIXED = [(f"m{i}", np.random.default_rng(i).integers(0, 512, n)) for i, n in enumerate([3, 11, 6, 1, 8, 4, 9])]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, hf_ckpt, tiny_ckpt):
    """The runs of the two parametrized tests below, started ahead of them two at a time
    (helpers.LaunchAhead: they are start-up bound): (CompletedProcess, completions path); and
    last the uninterrupted reference run of `long_run` (checked for results only)."""
    def launch(item):
        if item == "long_run":
            return _long_run(tmp_path_factory.mktemp("long"), tiny_ckpt)
        p = item.callspec.params
        d = tmp_path_factory.mktemp(item.name.replace("[", "_").replace("]", ""))
        out = d / "c.jsonl"
        if item.originalname == "test_greedy_equals_transformers_across_ranks":
            ref = json.loads((FIXTURES / "hf_tiny_llama" / "generate.json").read_text())
            prompts = write_prompts(d / "p.jsonl", [(f"r{i}", t) for i, t in enumerate(ref["prompts"])])
            return generate(d, hf_ckpt, p["ranks"], prompts, out, "--max-new-tokens", ref["max_new_tokens"],
                            placement={"tp": p["tp"]}), out
        prompts = write_prompts(d / "p.jsonl", MIXED)
        return generate(d, tiny_ckpt, p["ranks"], prompts, out, "--max-new-tokens", 7, "--batch", p["batch"],
                        "--prefill-chunk", p["chunk"], "--groups", p["groups"], run={"kv_cache": p["kv"]}), out

    items = LaunchAhead.fixture_items(request, "test_greedy_equals_transformers_across_ranks",
                                      "test_continuous_batching_equals_single_process")
    ahead = LaunchAhead([*items, "long_run"], launch, key=lambda item: item if item == "long_run" else item.nodeid)
    yield ahead
    ahead.close()


@pytest.mark.parametrize("ranks, tp", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_greedy_equals_transformers_across_ranks(request, runs, ranks, tp):
    ref = json.loads((FIXTURES / "hf_tiny_llama" / "generate.json").read_text())
    proc, out = runs.result(request)
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(out)
    assert [r["tokens"] for r in rows] == ref["tokens"]
    assert [r["id"] for r in rows] == ["r0", "r1"]
    assert all(r["finish_reason"] == "length" and r["new_tokens"] == ref["max_new_tokens"] for r in rows)
    assert [r["prompt_tokens"] for r in rows] == [len(p) for p in ref["prompts"]]
    assert "prefill_ms" in proc.stdout and "kv_MB" in proc.stdout  # the per-stage summary


@pytest.fixture(scope="module")
def tiny_stage(tiny_ckpt):
    with H5ParamSource(tiny_ckpt) as src:
        return LlamaStage(PRESETS["tiny"], src, range(8), True, True)


@pytest.mark.parametrize("kv, ranks, batch, chunk, groups", [("full", 2, 2, 4, 0), ("none", 2, 3, 4, 0),
                                                             ("full", 3, 1, 3, 0), ("full", 2, 3, 0, 0),
                                                             ("full", 2, 1, 3, 3)])
def test_continuous_batching_equals_single_process(request, runs, tiny_stage, kv, ranks, batch, chunk, groups):
    """7 prompts of mixed lengths through groups of `batch` slots: slots are reused as rows end;
    every row equals that prompt generated alone by a plain forward per token. With
    ``--prefill-chunk`` a new group's prompts (up to 11 tokens) go through the pipeline a few
    positions per step, the other groups decoding in between (kv none: never chunked); rows
    admitted beside decoding rows are prefilled in MIXED steps (batch 2: 9 of them), and with 3
    groups of 1 on 2 stages a new group's chunks ride in the other two's decode steps (9 of them;
    the schedule is deterministic: both counts are the scheduler's in `test_generation.drive_in_order`)."""
    proc, out = runs.result(request)  # MIXED, --max-new-tokens 7 --batch `batch`, kv_cache = `kv`
    assert proc.returncode == 0, proc.stderr
    assert [r["tokens"] for r in rows_of(out)] == [forward_greedy(tiny_stage, t, 7) for _, t in MIXED]


def test_window_and_per_rank_override(tmp_path, tiny_ckpt, tiny_stage):
    """window:4 on every rank equals the single-process windowed loop; a [[rank]] override
    gives the stages different policies (window on stage 0, full on stage 1 = a mixed model),
    which must differ from both uniform ones."""
    prompts = write_prompts(tmp_path / "p.jsonl", MIXED[:3])
    want = cached_greedy(tiny_stage, [t for _, t in MIXED[:3]], 9, KvSpec("window", 4))
    window, proc = in_pairs(  # independent runs, two at once
        lambda: generate(tmp_path, tiny_ckpt, 2, prompts, tmp_path / "w.jsonl", "--max-new-tokens", 9,
                         run={"kv_cache": "window:4"}, name="w.toml"),
        lambda: generate(tmp_path, tiny_ckpt, 2, prompts, tmp_path / "mix.jsonl", "--max-new-tokens", 9,
                         ranks_cfg=[{"rank": 0, "kv_cache": "window:4"}], name="mix.toml"))
    assert window.returncode == 0, window.stderr
    assert [r["tokens"] for r in rows_of(tmp_path / "w.jsonl")] == want
    assert proc.returncode == 0, proc.stderr
    assert "window:4" in proc.stdout and " full " in proc.stdout
    mixed = [r["tokens"] for r in rows_of(tmp_path / "mix.jsonl")]
    assert mixed != want and mixed != [forward_greedy(tiny_stage, t, 9) for _, t in MIXED[:3]]


def test_sampled_run_reproduces_across_layouts(tmp_path, tiny_ckpt):
    prompts = write_prompts(tmp_path / "p.jsonl", MIXED)
    flags = ("--max-new-tokens", 6, "--temperature", 0.9, "--top-k", 40, "--top-p", 0.95, "--seed", 11)
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    greedy = tmp_path / "g.jsonl"

    def sampled(out, ranks, batch):
        return lambda: generate(tmp_path, tiny_ckpt, ranks, prompts, out, *flags, "--batch", batch,
                                name=f"{out.stem}.toml")
    *procs, _ = in_pairs(sampled(a, 2, 2), sampled(b, 2, 2), sampled(c, 1, 5),  # independent runs, two at once
                         lambda: generate(tmp_path, tiny_ckpt, 1, prompts, greedy, "--max-new-tokens", 6, name="g.toml"))
    for proc in procs:
        assert proc.returncode == 0, proc.stderr
    assert without_ms(rows_of(a)) == without_ms(rows_of(b)) == without_ms(rows_of(c))
    assert without_ms(rows_of(a)) != without_ms(rows_of(greedy))  # it did sample


# -- stop and resume --------------------------------------------------------------------------

LONG = [(f"q{i}", np.random.default_rng(100 + i).integers(0, 512, int(2 + i % 13))) for i in range(40)]
LONG_FLAGS = ("--max-new-tokens", 30, "--batch", 2)


@pytest.fixture(scope="module")
def long_run(runs):
    """The uninterrupted run the stop and kill tests resume to (started ahead in `runs`)."""
    return runs.get("long_run")


def _long_run(d, tiny_ckpt):
    prompts = write_prompts(d / "p.jsonl", LONG)
    proc = generate(d, tiny_ckpt, 2, prompts, d / "full.jsonl", *LONG_FLAGS)
    assert proc.returncode == 0, proc.stderr
    return d, prompts, without_ms(rows_of(d / "full.jsonl"))


def start_and_wait_rows(job, prompts, out, rows: int, timeout: float = 60.0):
    # a few ms a step: 40 prompts of 30 tokens last seconds on any host, so the signal or kill
    # lands mid-run (a fast host finished them before the first row was seen)
    proc = start_cli(["generate", job, "--prompts", prompts, "--out", out, *LONG_FLAGS], ranks=2,
                     env={"RLX_MPI_TEST_STEP_DELAY_S": "0.005"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= rows:
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    kill_tree(proc.pid)
    o, e = proc.communicate()
    pytest.fail(f"no {rows} rows in {out} in time (exit {proc.returncode})\n{e}")


def check_lines(out):
    """Every line but possibly a torn last one (kill -9) is a whole JSON row."""
    data = out.read_bytes()
    lines = data.split(b"\n")
    for line in lines[:-1]:
        json.loads(line)
    return len(lines) - 1


@pytest.mark.parametrize("sig, after_rows", [(signal.SIGTERM, 1), (signal.SIGUSR1, 15)])
def test_stop_signal_finishes_the_step_and_resume_equals_uninterrupted(tmp_path, tiny_ckpt, long_run, sig,
                                                                        after_rows):
    d, prompts, want = long_run
    out = tmp_path / "c.jsonl"
    job = write_job(tmp_path, model={"checkpoint": str(tiny_ckpt)}, run={"timeout_s": 30.0},
                    placement={"reserve_ram_gb": 0.0})
    proc = start_and_wait_rows(job, prompts, out, after_rows)
    proc.send_signal(sig)  # to mpiexec, which passes it to every rank (as Slurm's --signal does)
    o, e = proc.communicate(timeout=60)
    assert proc.returncode == REQUEUE_EXIT, e
    assert f"stopped by {signal.Signals(sig).name}" in e and "resume" in e
    assert "Traceback" not in e
    first = check_lines(out)
    assert out.read_bytes().endswith(b"\n") and after_rows <= first < len(LONG)
    proc = run_cli(["generate", job, "--prompts", prompts, "--out", out, *LONG_FLAGS], ranks=2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert without_ms(rows_of(out)) == want
    # a third run finds everything done and leaves the file alone
    before = out.read_bytes()
    proc = run_cli(["generate", job, "--prompts", prompts, "--out", out, *LONG_FLAGS], ranks=2, timeout=60)
    assert proc.returncode == 0 and out.read_bytes() == before, proc.stderr


@pytest.mark.parametrize("after_rows", [2, 20])
def test_kill_9_loses_only_rows_in_flight(tmp_path, tiny_ckpt, long_run, after_rows):
    d, prompts, want = long_run
    out = tmp_path / "c.jsonl"
    job = write_job(tmp_path, model={"checkpoint": str(tiny_ckpt)}, run={"timeout_s": 30.0},
                    placement={"reserve_ram_gb": 0.0})
    proc = start_and_wait_rows(job, prompts, out, after_rows)
    kill_tree(proc.pid)
    proc.communicate(timeout=30)
    assert check_lines(out) >= after_rows
    proc = run_cli(["generate", job, "--prompts", prompts, "--out", out, *LONG_FLAGS], ranks=2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(out)
    assert len({r["id"] for r in rows}) == len(rows)  # no duplicates
    assert without_ms(rows) == want


def test_text_prompts_through_the_converted_tokenizer_and_eos(tmp_path):
    """convert copies tokenizer.json beside the checkpoint; text prompts are encoded with it,
    completions decoded; an end-of-sequence id ends a row early with finish_reason "stop"."""
    tokenizers = pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package (extra 'text') "
                                     "is not installed")
    from tokenizers import models, pre_tokenizers

    hf = tmp_path / "hf"
    hf.mkdir()
    for f in (FIXTURES / "hf_tiny_llama").iterdir():
        if f.name in ("config.json", "model.safetensors"):
            (hf / f.name).symlink_to(f)
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 256)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(hf / "tokenizer.json"))
    ckpt = tmp_path / "m.h5"
    proc = run_cli(["convert", hf, ckpt], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "m.tokenizer.json").is_file()

    ref = json.loads((FIXTURES / "hf_tiny_llama" / "generate.json").read_text())
    texts = [" ".join(f"w{t}" if t else "<unk>" for t in p) for p in ref["prompts"]]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    eos = ref["tokens"][0][2]  # the third greedy token of the first prompt
    out = tmp_path / "c.jsonl"
    proc = generate(tmp_path, ckpt, 2, prompts, out, "--max-new-tokens", ref["max_new_tokens"], "--eos-id", eos)
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(out)
    assert rows[0]["tokens"] == ref["tokens"][0][:3] and rows[0]["finish_reason"] == "stop"
    n1 = ref["tokens"][1].index(eos) + 1 if eos in ref["tokens"][1] else len(ref["tokens"][1])
    assert rows[1]["tokens"] == ref["tokens"][1][:n1]
    for r in rows:
        assert r["text"] == tok.decode(r["tokens"]) and r["text"].startswith("w")


@pytest.mark.parametrize("case, needle", [
    ("dup", "p.jsonl:2"), ("bad_token", "p.jsonl:1"), ("out_is_input", "is the input file"),
    ("no_prompts", "--prompts"), ("bad_kv", "kv_cache"), ("bad_top_p", "top_p"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_ckpt, case, needle):
    prompts = tmp_path / "p.jsonl"
    lines = ['{"id": "a", "tokens": [1, 2]}', '{"id": "b", "tokens": [3]}']
    if case == "dup":
        lines[1] = '{"id": "a", "tokens": [3]}'
    if case == "bad_token":
        lines[0] = '{"id": "a", "tokens": [1, 99999]}'
    prompts.write_text("\n".join(lines) + "\n")
    out = prompts if case == "out_is_input" else tmp_path / "c.jsonl"
    run = {"kv_cache": "window:0"} if case == "bad_kv" else None
    job = write_job(tmp_path, model={"checkpoint": str(tiny_ckpt)}, run={"timeout_s": 30.0, **(run or {})})
    args = ["generate", job, "--out", out] + ([] if case == "no_prompts" else ["--prompts", prompts])
    if case == "bad_top_p":
        args += ["--temperature", 1.0, "--top-p", 1.5]
    before = prompts.read_bytes()
    proc = run_cli(args, ranks=2, timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert prompts.read_bytes() == before


# -- faults during generation -------------------------------------------------------------------


@pytest.mark.parametrize("fault, code", [("raise", 4), ("hang", 5)])
def test_fault_in_a_decode_step_names_the_rank(tmp_path, faulty_ckpt, fault, code):
    prompts = write_prompts(tmp_path / "p.jsonl", MIXED[:2])
    job = write_job(tmp_path, model={"checkpoint": str(faulty_ckpt), "plugins": ["faulty_family"]},
                    run={"timeout_s": 3.0, "startup_timeout_s": 60.0})
    env = {"RLX_TEST_FAULT": fault, "RLX_TEST_FAULT_RANK": "1", "RLX_TEST_FAULT_MICROBATCH": "1",
           "RLX_TEST_FAULT_DECODE": "1"}
    t0 = time.monotonic()
    proc = run_cli(["generate", job, "--prompts", prompts, "--out", tmp_path / "c.jsonl", "--batch", 1,
                    "--max-new-tokens", 5], ranks=2, timeout=90, env=env)
    assert proc.returncode == code, proc.stderr
    if fault == "raise":  # the rank that raised reports itself, with its context
        assert "rank 1 (" in proc.stderr and "stage 1" in proc.stderr and "injected fault" in proc.stderr
    else:  # a stuck rank says nothing: the rank waiting for it names it
        assert "rank 1 is stuck or dead" in proc.stderr
    assert time.monotonic() - t0 < 60


def test_family_without_generation_is_one_line(tmp_path, faulty_ckpt):
    prompts = write_prompts(tmp_path / "p.jsonl", MIXED[:2])
    job = write_job(tmp_path, model={"checkpoint": str(faulty_ckpt), "plugins": ["faulty_family"]})
    proc = run_cli(["generate", job, "--prompts", prompts, "--out", tmp_path / "c.jsonl"], ranks=2, timeout=60,
                   env={"RLX_TEST_NO_GENERATE": "1"})
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert len(errors) == 1 and "does not support generation" in errors[0], proc.stderr


def test_json_stats_are_written_and_checked_before_compute(tmp_path, tiny_ckpt):
    """`generate --json` writes the run's stats (it once failed after the work, exit 4, with
    a NameError); a --json that is an input is refused before any token is made."""
    prompts = write_prompts(tmp_path / "p.jsonl", MIXED[:3])
    out, stats = tmp_path / "c.jsonl", tmp_path / "stats.json"
    proc = generate(tmp_path, tiny_ckpt, 2, prompts, out, "--max-new-tokens", 4, "--json", stats)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(stats.read_text())
    assert doc["total"] == 3 and doc["new_tokens"] == sum(len(r["tokens"]) for r in rows_of(out)) > 0
    assert len(doc["rows"]) == 2  # one per stage
    before = prompts.read_bytes()
    again = tmp_path / "c2.jsonl"
    bad = generate(tmp_path, tiny_ckpt, 2, prompts, again, "--max-new-tokens", 4, "--json", prompts)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert bad.returncode == 2 and len(errors) == 1 and "is the prompt file" in errors[0], bad.stderr
    assert prompts.read_bytes() == before and not again.exists()


def test_few_prompts_are_split_so_every_stage_has_a_group(tmp_path, tiny_ckpt):
    """4 prompts, the default batch 4 and one group per stage: 2 ranks made one group of 4 and the
    two stages took turns (issue #34); now two groups of 2 (two prefill steps), rows unchanged
    against one rank, where one group of 4 holds them all."""
    prompts = write_prompts(tmp_path / "p.jsonl", [(f"q{i}", np.random.default_rng(40 + i).integers(0, 512, 4 + i))
                                                   for i in range(4)])

    def launch(ranks):
        return lambda: generate(tmp_path, tiny_ckpt, ranks, prompts, tmp_path / f"o{ranks}.jsonl", "--max-new-tokens",
                                "6", "--json", tmp_path / f"s{ranks}.json", name=f"job{ranks}.toml")
    one, two = in_pairs(launch(1), launch(2))
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "4 rows for 2 groups of 4: 2 per group" in two.stderr, two.stderr
    assert "rows for" not in one.stderr  # one group of 4 slots for 4 rows: as given
    steps = {r: json.loads((tmp_path / f"s{r}.json").read_text())["prefill_steps"] for r in (1, 2)}
    assert steps == {1: 1, 2: 2}, steps
    rows = {r: without_ms(rows_of(tmp_path / f"o{r}.jsonl")) for r in (1, 2)}
    assert len(rows[2]) == 4 and rows[1] == rows[2]
