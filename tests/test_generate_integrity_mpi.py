"""``rlx-mpi generate`` under a real mpiexec: the integrity findings of issue 17.

Each case runs the real CLI and checks the exit code, one error line, the inputs and earlier
output bytes unchanged, and nothing left behind (no file, no process):

* non-finite logits end the job (exit 4) naming the stage and the prompt; no row made from
  them is written (finding 1: the job used to write token 0 everywhere and exit 0);
* a resume into rows made another way (max new tokens, temperature, checkpoint, a changed
  prompt) is refused naming what differs (finding 2: the job used to append silently); a
  layout change (ranks, batch) is not a difference;
* a job that fails before its first row leaves no file nor sidecar, an ``--eos-id`` outside
  the vocabulary is refused (finding 3); rows end at any of the checkpoint's eos ids;
* ``--logprobs K`` equals transformers' log-softmax of its own greedy logits on 1 and 2 ranks
  and under tensor parallelism.
"""

import json
import shutil
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import run_cli, write_job
from helpers import LaunchAhead, in_pairs, pids_matching, rows_of
from rlx_mpi.io.identity import meta_path
from rlx_mpi.families import convert_hf
from rlx_mpi.families.llama import FAMILY as _LLAMA
from rlx_mpi.families.llama import PRESETS

init_random = _LLAMA.init_random

pytestmark = pytest.mark.mpi
FIXTURES = Path(__file__).parent / "fixtures"
PROMPTS = [(f"m{i}", np.random.default_rng(i).integers(0, 512, n).tolist()) for i, n in enumerate([3, 11, 6])]


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"id": pid, "tokens": list(map(int, t))}) + "\n" for pid, t in prompts))
    return path


def without_ms(rows):
    return [{k: v for k, v in r.items() if k != "ms"} for r in rows]


def generate(d, ckpt, ranks, prompts, out, *flags, placement=None, generate_section=None, timeout=120, run=None):
    sections = {"model": {"checkpoint": str(ckpt)}, "run": {"timeout_s": 30.0, **(run or {})},
                "placement": {"reserve_ram_gb": 0.0, **(placement or {})}}
    if generate_section:
        sections["generate"] = generate_section
    job = write_job(d, "job.toml", **sections)
    return run_cli(["generate", job, "--prompts", prompts, "--out", out, *flags], ranks=ranks, timeout=timeout)


def one_error(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return errors[0]


def nothing_left(d, grace_s: float = 5.0):
    """No process of the job is left once the launcher has returned (a killed rank's supervisor
    may take a moment to be reaped: poll briefly, as the other leftover checks do)."""
    deadline = time.monotonic() + grace_s
    while pids_matching(str(d)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_matching(str(d)) == [], "a rank outlived the job"


def copy_with_nan(src, dst, name, index):
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        w = f[name][...]
        w[index] = np.nan
        f[name][...] = w
    return dst


# -- finding 1: non-finite logits ------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2])
def test_nan_weight_ends_the_job_naming_the_stage_and_prompt(tmp_path, tiny_ckpt, ranks):
    """One NaN weight (layer 5, down_proj[0, 0]) poisons every logit: exit 4, the last stage and
    the first prompt named, no completions file and no sidecar (it wrote token 0 and exit 0)."""
    ckpt = copy_with_nan(tiny_ckpt, tmp_path / "nan.h5", "layers/5/down_proj", (0, 0))
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    before = prompts.read_bytes()
    out = tmp_path / "c.jsonl"
    proc = generate(tmp_path, ckpt, ranks, prompts, out, "--max-new-tokens", 4, "--batch", 1)
    assert proc.returncode == 4, proc.stderr
    error = one_error(proc)
    assert f"stage {ranks - 1}" in error and "'m0'" in error and "non-finite" in error, error
    assert not out.exists() and not meta_path(out).exists()
    assert prompts.read_bytes() == before
    nothing_left(tmp_path)


def test_nan_in_one_prompt_keeps_the_rows_before_it_and_resume_refuses_again(tmp_path, tiny_ckpt):
    """A NaN in one token's embedding poisons only the prompt that holds it: the rows before it
    are written (equal to a clean model's), its row never is, and a resume stops at it again
    with the earlier bytes untouched."""
    bad = 300  # in no prompt but the last, and in none of their greedy tokens (checked below)
    prompts_list = [*PROMPTS[:2], ("m2", [5, 6, bad, 7])]
    assert all(bad not in t for _, t in PROMPTS[:2])
    ckpt = copy_with_nan(tiny_ckpt, tmp_path / "nan.h5", "embed_tokens", (bad, 3))
    prompts = write_prompts(tmp_path / "p.jsonl", prompts_list)
    out, clean = tmp_path / "c.jsonl", tmp_path / "clean.jsonl"
    flags = ("--max-new-tokens", 4, "--batch", 1, "--groups", 1)
    proc = generate(tmp_path, ckpt, 2, prompts, out, *flags)
    assert proc.returncode == 4, proc.stderr
    error = one_error(proc)
    assert "stage 0's hidden state" in error and "'m2'" in error and "'m0'" not in error, error  # (made there)
    proc = generate(tmp_path, tiny_ckpt, 1, write_prompts(tmp_path / "p2.jsonl", PROMPTS[:2]), clean, *flags)
    assert proc.returncode == 0, proc.stderr
    assert without_ms(rows_of(out)) == without_ms(rows_of(clean))  # m0, m1; no m2
    assert all(bad not in r["tokens"] for r in rows_of(clean))
    written, meta = out.read_bytes(), meta_path(out).read_bytes()
    proc = generate(tmp_path, ckpt, 1, prompts, out, *flags)  # resume: the same fault, nothing appended
    assert proc.returncode == 4, proc.stderr
    assert "'m2'" in one_error(proc)
    assert out.read_bytes() == written and meta_path(out).read_bytes() == meta
    nothing_left(tmp_path)


def test_nan_at_a_decode_step_is_caught_there(tmp_path, tiny_ckpt, full_run):
    """The logits are checked at every decode step too: a NaN in the embedding of the second
    token m0 generates first poisons new token 2 of m0 (its prefill and first decode are fine)."""
    _, rows = full_run
    t0, t1 = rows[0]["tokens"][:2]
    assert t1 != t0 and all(t1 not in t for _, t in PROMPTS)
    ckpt = copy_with_nan(tiny_ckpt, tmp_path / "nan.h5", "embed_tokens", (t1, 0))
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "c.jsonl"
    proc = generate(tmp_path, ckpt, 2, prompts, out, *FLAGS, "--groups", 1)
    assert proc.returncode == 4, proc.stderr
    error = one_error(proc)
    assert "stage 0's hidden state for new token 2 of prompt 'm0'" in error, error  # the embedding's stage
    assert not out.exists() and not meta_path(out).exists()
    nothing_left(tmp_path)


# -- finding 2: one run per file --------------------------------------------------------------

FLAGS = ("--max-new-tokens", 5, "--batch", 1)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_ckpt):
    """Three prompts generated on one rank: the uninterrupted file and its sidecar."""
    d = tmp_path_factory.mktemp("full")
    prompts = write_prompts(d / "p.jsonl", PROMPTS)
    proc = generate(d, tiny_ckpt, 1, prompts, d / "full.jsonl", *FLAGS)
    assert proc.returncode == 0, proc.stderr
    return d / "full.jsonl", rows_of(d / "full.jsonl")


def half_done(full, d) -> Path:
    """The first row of the full run, with its sidecar: what a stopped job leaves."""
    out = d / "c.jsonl"
    out.write_bytes(full.read_bytes().split(b"\n")[0] + b"\n")
    if meta_path(full).exists():  # (before run identities there was none)
        shutil.copyfile(meta_path(full), meta_path(out))
    return out


@pytest.mark.parametrize("case, needle", [
    ("max_new_tokens", "max_new_tokens 5, this run has max_new_tokens 6"),
    ("temperature", "temperature 0.0, this run has temperature 0.7"),
    ("checkpoint", "checkpoint tensors_sha256"),
    ("prompt", "prompt 'm0'"),
    ("precision", 'precision "f32", this run has precision "int8"'),
    ("window", 'kv_cache "full", this run has kv_cache "window:4"'),
    ("wire", 'wire "f32", this run has wire "bf16 before layers '),
])
def test_resume_with_other_settings_is_refused(tmp_path, tiny_ckpt, full_run, case, needle):
    """Issue 36: precision, the KV-cache window and a lossy wire (it rounds only where stages are
    cut: 2 ranks) make other rows, so a resume under them is refused and the file is untouched."""
    full, _ = full_run
    out = half_done(full, tmp_path)
    prompts = list(PROMPTS)
    flags = list(FLAGS)
    ckpt = tiny_ckpt
    run, ranks = {}, 1
    if case == "precision":
        run = {"precision": "int8"}
    elif case == "window":
        run = {"kv_cache": "window:4"}
    elif case == "wire":
        run, ranks = {"wire": "bf16"}, 2
    elif case == "max_new_tokens":
        flags[1] = 6
    elif case == "temperature":
        flags += ["--temperature", 0.7]
    elif case == "checkpoint":  # the same preset, other weights
        ckpt = tmp_path / "other.h5"
        init_random(ckpt, PRESETS["tiny"], seed=1)
    else:
        prompts[0] = ("m0", [*PROMPTS[0][1], 7])
    prompts = write_prompts(tmp_path / "p.jsonl", prompts)
    before = out.read_bytes()
    proc = generate(tmp_path, ckpt, ranks, prompts, out, *flags, run=run)
    assert proc.returncode == 2, proc.stderr
    meta = meta_path(full).read_bytes()
    error = one_error(proc)
    assert needle in error and "to start afresh remove" in error, error
    if case == "checkpoint":  # both digests are named
        old = json.loads(meta)["model"]["tensors_sha256"]
        assert error.count("tensors_sha256") == 2 and old in error, error
    assert out.read_bytes() == before and meta_path(out).read_bytes() == meta
    nothing_left(tmp_path)


def test_resume_on_another_layout_equals_the_uninterrupted_run(tmp_path, tiny_ckpt, full_run):
    """Ranks and batch are not part of what made the rows: 1 rank -> 2 ranks, batch 1 -> 2."""
    full, want = full_run
    out = half_done(full, tmp_path)
    proc = generate(tmp_path, tiny_ckpt, 2, write_prompts(tmp_path / "p.jsonl", PROMPTS), out,
                    "--max-new-tokens", 5, "--batch", 2)
    assert proc.returncode == 0, proc.stderr
    assert without_ms(rows_of(out)) == without_ms(want)
    assert all("logprobs" not in r for r in want)  # no --logprobs: rows as they always were
    assert list(want[0]) == ["id", "tokens", "finish_reason", "prompt_tokens", "new_tokens", "ms", "identity"]


def test_a_lossless_wire_or_one_stage_is_no_difference(tmp_path, tiny_ckpt, full_run):
    """wire = "bf16" on one stage never rounds anything: the rows of a f32 run resume under it."""
    full, want = full_run
    out = half_done(full, tmp_path)
    proc = generate(tmp_path, tiny_ckpt, 1, write_prompts(tmp_path / "p.jsonl", PROMPTS), out, *FLAGS,
                    run={"wire": "bf16"})
    assert proc.returncode == 0, proc.stderr
    assert without_ms(rows_of(out)) == without_ms(want)


# -- issue 34 part 2: the file alone resumes ------------------------------------------------------


def test_the_file_alone_resumes_without_its_record(tmp_path, tiny_ckpt, full_run):
    """out.jsonl copied without out.jsonl.meta.json: each row's identity says what made it."""
    full, want = full_run
    out = half_done(full, tmp_path)
    meta_path(out).unlink()
    proc = generate(tmp_path, tiny_ckpt, 2, write_prompts(tmp_path / "p.jsonl", PROMPTS), out, *FLAGS)
    assert proc.returncode == 0, proc.stderr
    assert without_ms(rows_of(out)) == without_ms(want) and meta_path(out).exists()


def test_the_file_alone_made_another_way_is_refused_before_resuming(tmp_path, tiny_ckpt, full_run):
    """Refused (nothing said about resuming first), and the advice, followed as written, works."""
    full, want = full_run
    out = half_done(full, tmp_path)
    record = meta_path(out).read_bytes()
    meta_path(out).unlink()
    before = out.read_bytes()
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    proc = generate(tmp_path, tiny_ckpt, 1, prompts, out, *FLAGS, run={"precision": "int8"})
    assert proc.returncode == 2, proc.stderr
    error = one_error(proc)
    assert "row 1 ('m0') was made with other settings" in error and "put its record" in error, error
    assert "resuming" not in proc.stderr and out.read_bytes() == before and not meta_path(out).exists()
    meta_path(out).write_bytes(record)  # "put its record back": now the setting is named
    proc = generate(tmp_path, tiny_ckpt, 1, prompts, out, *FLAGS, run={"precision": "int8"})
    assert proc.returncode == 2, proc.stderr
    error = one_error(proc)
    assert 'to resume, rerun with precision "f32"' in error, error
    proc = generate(tmp_path, tiny_ckpt, 1, prompts, out, *FLAGS, run={"precision": "f32"})  # as it says
    assert proc.returncode == 0, proc.stderr
    assert without_ms(rows_of(out)) == without_ms(want)


def test_an_older_file_is_adopted_only_with_the_flag(tmp_path, tiny_ckpt, full_run):
    """Rows with no identity and no record (an older rlx-mpi's): refused with advice naming
    --adopt-output; with it the job resumes into the file."""
    full, want = full_run
    out = tmp_path / "c.jsonl"
    first = {k: v for k, v in want[0].items() if k != "identity"}
    out.write_text(json.dumps(first, separators=(",", ":")) + "\n")
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    proc = generate(tmp_path, tiny_ckpt, 1, prompts, out, *FLAGS)
    assert proc.returncode == 2, proc.stderr
    error = one_error(proc)
    assert "carries no identity" in error and "add --adopt-output" in error, error
    proc = generate(tmp_path, tiny_ckpt, 1, prompts, out, *FLAGS, "--adopt-output")
    assert proc.returncode == 0, proc.stderr
    assert without_ms(rows_of(out))[1:] == without_ms(want)[1:]


# -- finding 3 and eos ids --------------------------------------------------------------------


def test_a_plan_that_does_not_fit_leaves_no_file(tmp_path, tiny_ckpt):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "c.jsonl"
    proc = generate(tmp_path, tiny_ckpt, 2, prompts, out, "--batch", 1000000000)
    assert proc.returncode == 3, proc.stderr
    one_error(proc)
    assert not out.exists() and not meta_path(out).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml", "p.jsonl"]
    nothing_left(tmp_path)


@pytest.mark.parametrize("where", ["flag", "job"])
def test_eos_id_outside_the_vocabulary_is_refused(tmp_path, tiny_ckpt, where):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "c.jsonl"
    flags = ("--eos-id", 100000) if where == "flag" else ()
    proc = generate(tmp_path, tiny_ckpt, 2, prompts, out, *flags,
                    generate_section={"eos_id": 100000} if where == "job" else None)
    assert proc.returncode == 2, proc.stderr
    error = one_error(proc)
    name = "--eos-id" if where == "flag" else "[generate] eos_id"
    assert name in error and "100000" in error and "512 tokens" in error, error
    assert not out.exists() and not meta_path(out).exists()
    nothing_left(tmp_path)


def test_rows_end_at_any_of_the_checkpoints_eos_ids(tmp_path, tiny_ckpt, full_run):
    """generation_config.json beside the checkpoint names two eos ids: each row ends at the
    first of either (it used to stop at the tokenizer's one id, or at none)."""
    _, rows = full_run
    a, b = rows[0]["tokens"][1], rows[2]["tokens"][2]
    ckpt = tmp_path / "m.h5"
    ckpt.symlink_to(tiny_ckpt)
    (tmp_path / "m.generation_config.json").write_text(json.dumps({"eos_token_id": [a, b]}))
    out = tmp_path / "c.jsonl"
    proc = generate(tmp_path, ckpt, 2, write_prompts(tmp_path / "p.jsonl", PROMPTS), out, *FLAGS)
    assert proc.returncode == 0, proc.stderr

    def cut(tokens):
        n = next((i + 1 for i, t in enumerate(tokens) if t in (a, b)), len(tokens))
        return tokens[:n], "stop" if n < len(tokens) or tokens[-1] in (a, b) else "length"

    got = rows_of(out)
    assert [(r["tokens"], r["finish_reason"]) for r in got] == [cut(r["tokens"]) for r in rows]
    assert got[0]["finish_reason"] == got[2]["finish_reason"] == "stop"
    assert json.loads(meta_path(out).read_text())["settings"]["eos_ids"] == sorted({a, b})


# -- --logprobs K -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "m.h5"
    convert_hf(FIXTURES / "hf_tiny_llama", out)
    return out


@pytest.fixture(scope="module")
def logprobs_runs(request, tmp_path_factory, hf_ckpt):
    """test_logprobs_equal_transformers' runs, started ahead of the tests two at a time
    (helpers.LaunchAhead: they are start-up bound): (CompletedProcess, completions path)."""
    ref = json.loads((FIXTURES / "hf_tiny_llama" / "generate.json").read_text())
    K = np.load(FIXTURES / "logprobs_generate_hf_tiny_llama.npz")["top_ids"].shape[2]

    def launch(item):
        p = item.callspec.params
        d = tmp_path_factory.mktemp(f"logprobs_{p['ranks']}_{p['tp']}")
        prompts = write_prompts(d / "p.jsonl", [(f"r{i}", t) for i, t in enumerate(ref["prompts"])])
        out = d / "c.jsonl"
        return generate(d, hf_ckpt, p["ranks"], prompts, out, "--max-new-tokens", ref["max_new_tokens"],
                        "--logprobs", K, placement={"tp": p["tp"]}), out

    ahead = LaunchAhead(LaunchAhead.fixture_items(request, "test_logprobs_equal_transformers"), launch)
    yield ahead
    ahead.close()


@pytest.mark.parametrize("ranks, tp", [(1, 1), (2, 1), (2, 2)])
def test_logprobs_equal_transformers(request, logprobs_runs, ranks, tp):
    """Each row's "logprobs": the chosen token's and the top 5, as transformers' log_softmax of
    its own greedy logits (tests/make_logprobs_generate_fixture.py), within 1e-4 in float32."""
    want = np.load(FIXTURES / "logprobs_generate_hf_tiny_llama.npz")
    K = want["top_ids"].shape[2]
    proc, out = logprobs_runs.result(request)  # --max-new-tokens of generate.json, --logprobs K, tp
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(out)
    assert [r["tokens"] for r in rows] == want["tokens"].tolist()
    for b, r in enumerate(rows):
        lp = r["logprobs"]
        assert [e["id"] for e in lp] == r["tokens"]
        np.testing.assert_allclose([e["logprob"] for e in lp], want["chosen_lp"][b], atol=1e-4, rtol=0)
        assert [[i for i, _ in e["top"]] for e in lp] == want["top_ids"][b].tolist()
        np.testing.assert_allclose([[v for _, v in e["top"]] for e in lp], want["top_lp"][b], atol=1e-4, rtol=0)
    assert json.loads(meta_path(out).read_text())["settings"]["logprobs"] == K


def test_sampled_logprobs_change_no_draw_and_reproduce_across_layouts(tmp_path, tiny_ckpt):
    """With temperature the log-probs are still the model's own (temperature-free) ones: asking
    for them changes no token, and they are the same on 1 rank and on 2 ranks at another batch."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    flags = ("--max-new-tokens", 5, "--temperature", 0.9, "--top-k", 40, "--seed", 11)
    runs = {}
    layouts = (("plain", 1, ()), ("one", 1, ("--logprobs", 3)), ("two", 2, ("--logprobs", 3, "--batch", 2)))

    def run_in_own_folder(name, ranks, extra):  # each its own job file: the runs go two at once
        (tmp_path / name).mkdir()
        return lambda: generate(tmp_path / name, tiny_ckpt, ranks, prompts, tmp_path / f"{name}.jsonl", *flags,
                                *extra)
    for (name, _, _), proc in zip(layouts, in_pairs(*(run_in_own_folder(*x) for x in layouts))):
        assert proc.returncode == 0, proc.stderr
        runs[name] = without_ms(rows_of(tmp_path / f"{name}.jsonl"))
    tokens = [r["tokens"] for r in runs["plain"]]
    assert [r["tokens"] for r in runs["one"]] == [r["tokens"] for r in runs["two"]] == tokens
    for one, two in zip(runs["one"], runs["two"]):  # float32 sums in another order: not bit for bit
        assert [[i for i, _ in e["top"]] for e in one["logprobs"]] == [[i for i, _ in e["top"]] for e in two["logprobs"]]
        flat = lambda r: [[e["logprob"], *(v for _, v in e["top"])] for e in r["logprobs"]]  # noqa: E731
        np.testing.assert_allclose(flat(one), flat(two), atol=1e-5, rtol=0)
    for r in runs["one"]:
        for e in r["logprobs"]:
            best = e["top"][0][1]
            assert len(e["top"]) == 3 and e["logprob"] <= best + 1e-7
            assert all(v == e["logprob"] for i, v in e["top"] if i == e["id"])  # one value per token


def test_a_finished_file_is_not_called_done_under_another_precision(tmp_path, tiny_ckpt, full_run):
    """Every prompt done: nothing to compute, but a rerun under int8 is told the rows are f32's."""
    full, _ = full_run
    out = tmp_path / "c.jsonl"
    shutil.copyfile(full, out)
    shutil.copyfile(meta_path(full), meta_path(out))
    before = out.read_bytes()
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    proc = generate(tmp_path, tiny_ckpt, 1, prompts, out, *FLAGS, run={"precision": "int8"})
    assert proc.returncode == 2, proc.stderr
    assert 'made with precision "f32"; this run has precision "int8"' in one_error(proc)
    proc = generate(tmp_path, tiny_ckpt, 1, prompts, out, *FLAGS)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == before
