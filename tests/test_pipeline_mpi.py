"""End to end under a real mpiexec: pipeline and tensor-parallel logits against a
single-process run, and a transformers-made model against transformers' own logits.

The runs of the two parametrized tests are started ahead of them, two at a time
(helpers.LaunchAhead: they are start-up bound); each test checks its own run as before. Each
transformers fixture is converted once, not once per layout."""

import json

import h5py
import numpy as np
import pytest

import threading

from conftest import TESTS, run_cli, write_job
from helpers import LaunchAhead
from rlx_mpi.model.checkpoint import H5ParamSource
from rlx_mpi.families.llama import PRESETS
from rlx_mpi.families.decoder.stage import DecoderStage as LlamaStage
from rlx_mpi.families import convert_hf

pytestmark = pytest.mark.mpi


def single_process_logits(ckpt, cfg, ids):
    with H5ParamSource(ckpt) as src:
        return LlamaStage(cfg, src, range(cfg.num_hidden_layers), True, True).forward(ids)


def run_job(tmp_path, ckpt, ranks, ids, placement=None, run=None, timeout=90):
    ids_path = tmp_path / "ids.npy"
    np.save(ids_path, ids)
    job = write_job(tmp_path, model={"checkpoint": str(ckpt)},
                    run={"timeout_s": 30.0, **(run or {})}, placement={"reserve_ram_gb": 0.0, **(placement or {})})
    out, stats = tmp_path / "out.h5", tmp_path / "stats.json"
    proc = run_cli(["run", job, "--input-ids", ids_path, "--out", out, "--json", stats], ranks=ranks, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        logits = f["logits"][()]
    return logits, json.loads(stats.read_text()), proc


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_ckpt):
    """Each selected parametrized test's ``run_job``, launched ahead: (logits, stats, proc, ids)."""
    lock, converted = threading.Lock(), {}

    def hf_ckpt(fixture):
        with lock:
            if fixture not in converted:
                converted[fixture] = tmp_path_factory.mktemp(f"hf_{fixture}") / "hf.h5"
                convert_hf(TESTS / "fixtures" / fixture, converted[fixture])
            return converted[fixture]

    def launch(item):
        p = item.callspec.params
        d = tmp_path_factory.mktemp(item.name.replace("[", "_").replace("]", ""))
        if item.originalname == "test_logits_equal_single_process":
            ids = np.random.default_rng(p["ranks"]).integers(0, PRESETS["tiny"].vocab_size, (2, 13))
            return (*run_job(d, tiny_ckpt, p["ranks"], ids, {"tp": p["tp"]},
                             {"batch": 2, "microbatches": p["microbatches"]}), ids)
        src = TESTS / "fixtures" / p["fixture"]
        ids = np.load(src / "input_ids.npy")
        return (*run_job(d, hf_ckpt(p["fixture"]), p["ranks"], ids, {"tp": p["tp"]}), ids)

    ahead = LaunchAhead(LaunchAhead.fixture_items(request, "test_logits_equal_single_process",
                                                  "test_transformers_model_matches_transformers"), launch)
    yield ahead
    ahead.close()


@pytest.mark.parametrize("ranks, tp, microbatches", [
    (1, 1, 1), (2, 1, 1), (3, 1, 2), (4, 1, 1),  # pipeline only
    (2, 2, 1), (4, 2, 2), (4, 4, 1),  # TP=2; TP=2 x PP=2; TP=4
])
def test_logits_equal_single_process(request, runs, tiny_ckpt, ranks, tp, microbatches):
    cfg = PRESETS["tiny"]
    logits, stats, proc, ids = runs.result(request)  # ids: rng(ranks) integers of shape (2, 13)
    ref = single_process_logits(tiny_ckpt, cfg, ids)
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() <= 1e-5
    rows = stats["timings"]
    assert sorted(r["rank"] for r in rows) == list(range(ranks))
    stages = ranks // tp
    covered = sorted({tuple(r["layers"]) for r in rows})
    assert len(covered) == stages and covered[0][0] == 0 and covered[-1][1] == cfg.num_hidden_layers
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert all(len(r["tp_ranks"]) == tp for r in rows)
    # the table: one row per rank, then the totals line
    table = [line for line in proc.stdout.splitlines() if line.strip()]
    assert table[0].split()[:3] == ["stage", "rank", "host"]
    assert len(table) == 1 + ranks + 1 and "tokens/s" in table[-1]


@pytest.mark.parametrize("fixture, ranks, tp", [
    ("hf_tiny_llama", 1, 1), ("hf_tiny_llama", 2, 1), ("hf_tiny_llama", 3, 1), ("hf_tiny_llama", 4, 1),
    ("hf_tiny_llama", 4, 2), ("hf_tiny_llama_tied", 3, 1), ("hf_tiny_llama_tied", 2, 2),  # tied: 3 layers, 2 kv heads
])
def test_transformers_model_matches_transformers(request, runs, fixture, ranks, tp):
    src = TESTS / "fixtures" / fixture
    logits, _, _, _ = runs.result(request)
    assert np.abs(logits - np.load(src / "logits.npy")).max() <= 1e-4


def test_sharded_weights_and_peak_rss(tmp_path):
    """A rank holding a quarter of the layers holds a quarter of the weights, and its peak RSS
    stays well under half the model's bytes: it never reads the other layers. The model is
    1.8 GB so that the interpreter's own ~0.2 GB (numpy, MPI, numba) does not dominate."""
    from rlx_mpi.families.decoder.arch import Arch as LlamaConfig
    from rlx_mpi.families.llama import FAMILY as _LLAMA
    init_random = _LLAMA.init_random

    cfg = LlamaConfig(vocab_size=16384, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=64)
    ckpt = tmp_path / "big.h5"
    init_random(ckpt, cfg, seed=0)
    model_bytes = ckpt.stat().st_size
    assert model_bytes > 1.7e9
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 4))
    _, stats, _ = run_job(tmp_path, ckpt, 4, ids, {"policy": "uniform"}, timeout=240)
    for row in stats["timings"]:
        assert row["weight_bytes"] < 0.3 * model_bytes, row
        assert row["peak_rss_bytes"] < 0.45 * model_bytes, row
    # tensor parallel: each of 2 ranks of one stage holds about half the weights
    _, stats, _ = run_job(tmp_path, ckpt, 2, ids, {"tp": 2}, timeout=240)
    for row in stats["timings"]:
        assert row["weight_bytes"] < 0.56 * model_bytes, row
        assert row["peak_rss_bytes"] < 0.7 * model_bytes, row
