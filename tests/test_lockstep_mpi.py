"""TP lockstep checked (issue 36): the first stage's tensor-parallel ranks each run a scheduler;
a digest of every step's header and sampled tokens rides on the stop all-reduce, and a mismatch
ends the job naming the ranks. The mismatch is forced with ``RLX_MPI_TEST_TP_DIVERGE=RANK:STEP``
(rank RANK flips a bit of a token of its STEP-th step, as a diverged scheduler would)."""

import json

import numpy as np
import pytest

from conftest import run_cli, write_job
from helpers import rows_of
from rlx_mpi.drivers.decode_ring import lockstep_fold

pytestmark = pytest.mark.mpi


def test_the_fold_sees_the_header_the_tokens_and_the_past():
    h, t = np.arange(8, dtype=np.int64), np.array([5, 6], np.int64)
    d = lockstep_fold(0, h, t)
    assert d == lockstep_fold(0, h.copy(), t.copy()) and 0 <= d < 2**62
    t2 = t.copy()
    t2[0] ^= 1
    assert len({d, lockstep_fold(0, h, t2), lockstep_fold(1, h, t), lockstep_fold(0, h + 1, t)}) == 4


@pytest.mark.parametrize("diverge", [None, "1:2"])
def test_a_tp_rank_out_of_lockstep_ends_the_job_naming_the_ranks(tmp_path, tiny_ckpt, diverge):
    job = write_job(tmp_path, model={"checkpoint": str(tiny_ckpt)}, run={"timeout_s": 30.0},
                    placement={"reserve_ram_gb": 0.0, "tp": 2, "replicas": 1})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [1 + i, 2, 3]}) + "\n" for i in range(3)))
    out = tmp_path / "c.jsonl"
    env = {"RLX_MPI_TEST_TP_DIVERGE": diverge} if diverge else None
    proc = run_cli(["generate", job, "--prompts", prompts, "--out", out, "--max-new-tokens", 4, "--batch", 1],
                   ranks=2, timeout=120, env=env)
    if diverge is None:  # the check itself never trips on ranks in lockstep
        assert proc.returncode == 0, proc.stderr
        assert len(rows_of(out)) == 3
        return
    assert proc.returncode == 4, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "left lockstep at step 2" in errors[0] and "world rank 0 " in errors[0] and "world rank 1 " in errors[0], \
        errors[0]
