"""Every family under a real mpiexec through ``rlx-mpi run --out``: one rank, a two-stage
pipeline and TP = 2 (expert parallelism for Mixtral), against transformers' logits
(tests/fixtures/families).

Each family is converted once (``convert_hf``, as before in every test) and the runs are
started ahead of their tests, two at a time (helpers.LaunchAhead): they are start-up bound,
and every test still checks its own run's exit code and numbers."""

import json
import threading

import h5py
import numpy as np
import pytest

from conftest import TESTS, run_cli, write_job
from helpers import LaunchAhead
from rlx_mpi.families import convert_hf

pytestmark = pytest.mark.mpi

FAMILIES = TESTS / "fixtures" / "families"
CASES = ["llama3", "llama_linear", "mistral", "qwen2", "qwen3", "phi3", "phi3_longrope", "gemma2", "mixtral",
         "gemma3", "olmo2", "granite", "qwen3_moe",  # OLMo 2 at TP 2: its q/k norm's sums all-reduced
         "deepseek_v3", "deepseek_v2", "gpt_oss"]
LAYOUTS = [(1, 1), (2, 1), (2, 2)]  # (ranks, tp)


def reference(case):
    return np.load(FAMILIES / case / "reference.npz", allow_pickle=False)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Each selected test's run, launched ahead: (CompletedProcess, output path)."""
    lock, ckpts = threading.Lock(), {}

    def checkpoint(case):
        with lock:  # one conversion per family, shared by its runs (read-only)
            if case not in ckpts:
                ckpts[case] = tmp_path_factory.mktemp(f"ckpt_{case}") / "m.h5"
                convert_hf(FAMILIES / case, ckpts[case], tokenizer=False)
            return ckpts[case]

    def launch(item):
        p = item.callspec.params
        case, ranks, tp = p["case"], p["ranks"], p["tp"]
        d = tmp_path_factory.mktemp(f"{item.originalname[5:13]}_{case}_{ranks}_{tp}")
        ref = reference(case)
        ckpt = checkpoint(case)
        if item.originalname == "test_run_matches_transformers":
            ids = ref["input_ids"]
            np.save(d / "ids.npy", ids)
            job = write_job(d, model={"checkpoint": str(ckpt)},
                            run={"timeout_s": 30.0, "batch": ids.shape[0], "seq": ids.shape[1]},
                            placement={"reserve_ram_gb": 0.0, "tp": tp})
            out = d / "out.h5"
            return run_cli(["run", job, "--input-ids", d / "ids.npy", "--out", out], ranks=ranks, timeout=120), out
        prompts = d / "p.jsonl"
        rows = [{"id": "p0", "tokens": ref["prompt_ids"][0].tolist()}]
        if ranks > 1:  # a 2-token prompt beside it decodes while p0 is prefilled in MIXED steps
            rows.append({"id": "short", "tokens": rows[0]["tokens"][:2]})
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        job = write_job(d, model={"checkpoint": str(ckpt)}, run={"timeout_s": 30.0},
                        placement={"reserve_ram_gb": 0.0, "tp": tp})
        out = d / "c.jsonl"
        chunk = 3 if ranks > 1 else 0  # the prompt is prefilled 3 positions per step
        return run_cli(["generate", job, "--prompts", prompts, "--out", out, "--max-new-tokens",
                        len(ref["greedy_ids"][0]), "--prefill-chunk", chunk, "--json", d / "stats.json"],
                       ranks=ranks, timeout=120), out

    ahead = LaunchAhead(LaunchAhead.fixture_items(request, "test_run_matches_transformers",
                                                  "test_generate_greedy_equals_transformers"), launch)
    yield ahead
    ahead.close()


@pytest.mark.parametrize("ranks, tp", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_run_matches_transformers(request, runs, case, ranks, tp):
    proc, out = runs.result(request)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        logits = f["logits"][()]
    assert np.abs(logits - reference(case)["logits"]).max() <= 1e-4


@pytest.mark.parametrize("ranks, tp", [(1, 1), (2, 2)])
@pytest.mark.parametrize("case", CASES)
def test_generate_greedy_equals_transformers(request, runs, case, ranks, tp):
    """``rlx-mpi generate`` (prefill + cached decode over the pipeline) gives the tokens of
    transformers' ``generate(do_sample=False)``; on 2 ranks (TP) the prompt is prefilled in
    chunks of 3 (``--prefill-chunk``), each after the first reading the cache, and beside it a
    2-token prompt decodes from the second step on: p0's chunks ride in MIXED steps (one pass
    over the weights for both rows, `Stage.mixed`, experts and all-reduces included)."""
    proc, out = runs.result(request)
    assert proc.returncode == 0, proc.stderr
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["p0"]["tokens"] == reference(case)["greedy_ids"][0].tolist()
    stats = json.loads((out.parent / "stats.json").read_text())
    prompt = reference(case)["prompt_ids"].shape[1]
    assert stats["prefill_steps"] == (-(-prompt // 3) if ranks > 1 else 1)
    assert stats["token_gap_ms"]["max"] >= stats["token_gap_ms"]["median"] > 0
