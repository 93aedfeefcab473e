"""Every family under a real mpiexec through ``rlx-mpi run --out``: one rank, a two-stage
pipeline and TP = 2 (expert parallelism for Mixtral), against transformers' logits
(tests/fixtures/families)."""

import json

import h5py
import numpy as np
import pytest

from conftest import TESTS, run_cli, write_job
from rlx_mpi.families import convert_hf

pytestmark = pytest.mark.mpi

FAMILIES = TESTS / "fixtures" / "families"
CASES = ["llama3", "llama_linear", "mistral", "qwen2", "qwen3", "phi3", "phi3_longrope", "gemma2", "mixtral"]
LAYOUTS = [(1, 1), (2, 1), (2, 2)]  # (ranks, tp)


@pytest.mark.parametrize("ranks, tp", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_run_matches_transformers(tmp_path, case, ranks, tp):
    ref = np.load(FAMILIES / case / "reference.npz", allow_pickle=False)
    ckpt = tmp_path / "m.h5"
    convert_hf(FAMILIES / case, ckpt, tokenizer=False)
    ids = ref["input_ids"]
    np.save(tmp_path / "ids.npy", ids)
    job = write_job(tmp_path, model={"checkpoint": str(ckpt)},
                    run={"timeout_s": 30.0, "batch": ids.shape[0], "seq": ids.shape[1]},
                    placement={"reserve_ram_gb": 0.0, "tp": tp})
    out = tmp_path / "out.h5"
    proc = run_cli(["run", job, "--input-ids", tmp_path / "ids.npy", "--out", out], ranks=ranks, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        logits = f["logits"][()]
    assert np.abs(logits - ref["logits"]).max() <= 1e-4


@pytest.mark.parametrize("ranks, tp", [(1, 1), (2, 2)])
@pytest.mark.parametrize("case", CASES)
def test_generate_greedy_equals_transformers(tmp_path, case, ranks, tp):
    """``rlx-mpi generate`` (prefill + cached decode over the pipeline) gives the tokens of
    transformers' ``generate(do_sample=False)``."""
    ref = np.load(FAMILIES / case / "reference.npz", allow_pickle=False)
    ckpt = tmp_path / "m.h5"
    convert_hf(FAMILIES / case, ckpt, tokenizer=False)
    want = ref["greedy_ids"][0].tolist()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "tokens": ref["prompt_ids"][0].tolist()}) + "\n")
    job = write_job(tmp_path, model={"checkpoint": str(ckpt)}, run={"timeout_s": 30.0},
                    placement={"reserve_ram_gb": 0.0, "tp": tp})
    out = tmp_path / "c.jsonl"
    proc = run_cli(["generate", job, "--prompts", prompts, "--out", out, "--max-new-tokens", len(want)],
                   ranks=ranks, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["tokens"] == want
