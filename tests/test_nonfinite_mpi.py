"""The one non-finite rule under a real mpiexec (issue 36): every stage checks its output before
sending it, so a NaN made on stage 1 of 3 is blamed on stage 1 (not on the last stage it
reached), with the prompt, line or batch row it belongs to, in generate, score and run alike.
The NaN comes from `faulty_family` (``RLX_TEST_FAULT=nan``: rank 1's output of microbatch 0)."""

import json

import pytest

from conftest import run_cli, write_job
from helpers import faulty_ckpt  # noqa: F401 (a fixture)

pytestmark = pytest.mark.mpi

ENV = {"RLX_TEST_FAULT": "nan", "RLX_TEST_FAULT_RANK": "1", "RLX_TEST_FAULT_MICROBATCH": "0"}


@pytest.mark.parametrize("command, named", [
    ("generate", "stage 1's hidden state for new token 0 of prompt 'a' (prompt 1 of p.jsonl)"),
    ("score", "stage 1's hidden state for line 'a' (line 1 of the prompt file)"),
    ("run", "stage 1's output for row 0 of the batch (microbatch 0)"),
])
def test_a_nan_made_on_stage_1_of_3_is_blamed_on_stage_1(tmp_path, faulty_ckpt, command, named):  # noqa: F811
    job = write_job(tmp_path, model={"checkpoint": str(faulty_ckpt), "plugins": ["faulty_family"]},
                    run={"timeout_s": 30.0, "batch": 2, "seq": 4, "microbatches": 1},
                    placement={"reserve_ram_gb": 0.0, "replicas": 1})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "tokens": [1, 2, 3, 4]}) + "\n" for i in "ab"))
    args = {"generate": ["--prompts", prompts, "--out", tmp_path / "c.jsonl", "--max-new-tokens", 2, "--batch", 1],
            "score": ["--prompts", prompts, "--out", tmp_path / "c.jsonl"], "run": []}[command]
    proc = run_cli([command, job, *args], ranks=3, timeout=120, env=ENV)
    assert proc.returncode == 4, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "rank 1 (" in errors[0] and named in errors[0] and "non-finite" in errors[0], errors[0]
    assert not (tmp_path / "c.jsonl").exists()
