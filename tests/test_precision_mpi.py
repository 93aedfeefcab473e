"""Mixed precision across real mpiexec ranks, bf16 checkpoints from the CLI, and `plan --precision`."""

import json

import h5py
import numpy as np
import pytest

from conftest import run_cli, write_job
from rlx_mpi.model.checkpoint import H5ParamSource
from rlx_mpi.families.llama import PRESETS
from rlx_mpi.families.decoder.stage import DecoderStage as LlamaStage

BOUNDS = {"bf16": 0.02, "f16": 0.005, "int8": 0.08}  # as tests/test_precision.py and README


def stage_logits(ckpt, ids, parts):
    """An in-process pipeline: ``parts`` = [(layers, precision), ...] run one after the other."""
    cfg = PRESETS["tiny"]
    h = ids
    for i, (layers, precision) in enumerate(parts):
        with H5ParamSource(ckpt) as src:
            stage = LlamaStage(cfg, src, layers, i == 0, i == len(parts) - 1, precision=precision)
        h = stage.forward(h)
    return h


def run(tmp_path, ckpt, ranks, ids, placement, run_section=None, rank=None, timeout=120):
    np.save(tmp_path / "ids.npy", ids)
    sections = dict(model={"checkpoint": str(ckpt)}, run={"timeout_s": 30.0, **(run_section or {})},
                    placement={"reserve_ram_gb": 0.0, **placement})
    if rank:
        sections["rank"] = rank
    job = write_job(tmp_path, **sections)
    out, stats = tmp_path / "out.h5", tmp_path / "stats.json"
    proc = run_cli(["run", job, "--input-ids", tmp_path / "ids.npy", "--out", out, "--json", stats],
                   ranks=ranks, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        logits = f["logits"][()]
    return logits, json.loads(stats.read_text())["timings"], proc.stdout


def rel_err(a, ref):
    return np.abs(a - ref).max() / np.abs(ref).max()


@pytest.mark.mpi
def test_pipeline_f32_then_bf16(tmp_path, tiny_ckpt):
    cfg = PRESETS["tiny"]
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 12))
    logits, rows, table = run(tmp_path, tiny_ckpt, 2, ids, {"policy": "manual", "manual": ["0:4", "4:8"]},
                              rank=[{"rank": 1, "precision": "bf16"}])
    mixed = stage_logits(tiny_ckpt, ids, [(range(0, 4), "f32"), (range(4, 8), "bf16")])
    f32 = stage_logits(tiny_ckpt, ids, [(range(8), "f32")])
    assert np.abs(logits - mixed).max() <= 1e-5  # the wire adds nothing to the precision's error
    assert 0 < rel_err(logits, f32) <= BOUNDS["bf16"]
    by_rank = {r["rank"]: r for r in rows}
    assert by_rank[0]["precision"] == "f32" and by_rank[1]["precision"] == "bf16"
    head = table.splitlines()[0].split()
    assert "precision" in head
    col = head.index("precision")
    assert [line.split()[col] for line in table.splitlines()[1:3]] == ["f32", "bf16"]
    # stage 1's 4 layers + head in bf16 hold half the bytes of stage 0's 4 layers + embedding in f32
    assert by_rank[1]["weight_bytes"] < 0.55 * by_rank[0]["weight_bytes"]


@pytest.mark.mpi
def test_tp_group_in_int8_after_mixed_tp_group(tmp_path, tiny_ckpt):
    """Stage 0 = ranks 0 (f32) and 1 (bf16) as one TP group; stage 1 = ranks 2, 3 in int8
    (the job's [run] precision), so the all-reduce sums partials of different precisions."""
    cfg = PRESETS["tiny"]
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (1, 16))
    logits, rows, _ = run(tmp_path, tiny_ckpt, 4, ids, {"tp": 2, "policy": "manual", "manual": ["0:4", "4:8"]},
                          run_section={"precision": "int8"},
                          rank=[{"rank": 0, "precision": "f32"}, {"rank": 1, "precision": "bf16"}])
    f32 = stage_logits(tiny_ckpt, ids, [(range(8), "f32")])
    assert 0 < rel_err(logits, f32) <= BOUNDS["int8"]
    assert {r["rank"]: r["precision"] for r in rows} == {0: "f32", 1: "bf16", 2: "int8", 3: "int8"}


@pytest.mark.mpi
def test_bf16_checkpoint_from_init_model_runs(tmp_path):
    ckpt = tmp_path / "tiny_bf16.h5"
    proc = run_cli(["init-model", ckpt, "--preset", "tiny", "--dtype", "bfloat16"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(ckpt, "r") as f:
        assert f["layers/0/q_proj"].dtype == np.uint16 and f["layers/0/q_proj"].attrs["dtype"] == "bfloat16"
    cfg = PRESETS["tiny"]
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (1, 9))
    logits, rows, _ = run(tmp_path, ckpt, 1, ids, {}, run_section={"precision": "bf16"})
    np.testing.assert_allclose(logits, stage_logits(ckpt, ids, [(range(8), "bf16")]), rtol=0, atol=1e-5)
    assert rows[0]["precision"] == "bf16"


def test_plan_precision_column_and_more_layers_on_bf16(tmp_path):
    args = ["plan", "--preset", "medium", "--ranks", "2", "--seq", "128", "--mem-gb", "0.42", "--reserve-gb", "0"]
    f32 = run_cli(args, timeout=60)
    assert f32.returncode == 3, f32.stderr  # two f32 ranks of 0.42 GB cannot hold 0.88 GB of weights
    mixed = run_cli(args + ["--precision", "f32,bf16"], timeout=60)
    assert mixed.returncode == 0, mixed.stderr
    lines = mixed.stdout.splitlines()
    head = lines[1].split()
    rows = [dict(zip(head, line.split())) for line in lines[2:4]]
    assert [r["precision"] for r in rows] == ["f32", "bf16"]
    assert int(rows[1]["n_layers"]) > int(rows[0]["n_layers"])
    bad = run_cli(args + ["--precision", "f32,bf16,int8"], timeout=60)
    assert bad.returncode == 2 and "3 precisions for 2 ranks" in bad.stderr
