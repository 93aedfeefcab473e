"""The executor under a real mpiexec: uneven microbatches x wire formats against a one-
microbatch f32 run, a plug-in family written only to the documented Protocol, and the trace."""

import json

import h5py
import numpy as np
import pytest

from conftest import run_cli, write_job
from rlx_mpi.families.llama import PRESETS

pytestmark = pytest.mark.mpi

RANKS = 3
BATCH, SEQ = 5, 11  # 5 rows: M = 2 -> 3 + 2, M = 3 -> 2 + 2 + 1


def run(tmp_path, name, ckpt, ids, ranks=RANKS, plugins=(), extra_args=(), **run_keys):
    d = tmp_path / name
    d.mkdir()
    np.save(d / "ids.npy", ids)
    model = {"checkpoint": str(ckpt)}
    if plugins:
        model["plugins"] = list(plugins)
    job = write_job(d, model=model, run={"timeout_s": 30.0, "batch": ids.shape[0], **run_keys},
                    placement={"reserve_ram_gb": 0.0})
    proc = run_cli(["run", job, "--input-ids", d / "ids.npy", "--out", d / "out.h5", "--json", d / "stats.json",
                    *extra_args], ranks=ranks, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(d / "out.h5", "r") as f:
        logits = f["logits"][()]
    return logits, json.loads((d / "stats.json").read_text()), proc


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(8).integers(0, PRESETS["tiny"].vocab_size, (BATCH, SEQ))


@pytest.fixture(scope="module")
def f32_one(tmp_path_factory, tiny_ckpt, ids):
    """The reference: f32 wire, one microbatch."""
    return run(tmp_path_factory.mktemp("ref"), "ref", tiny_ckpt, ids, microbatches=1)[0]


def test_uneven_microbatches_f32_equal_one_microbatch(tmp_path, tiny_ckpt, ids, f32_one):
    for m in (2, 3):
        logits, stats, proc = run(tmp_path, f"m{m}", tiny_ckpt, ids, microbatches=m, wire="f32")
        assert logits.shape == f32_one.shape
        # not bit for bit: each projection is one (rows, C) @ W.T GEMM and OpenBLAS picks its
        # kernel (and summation order) by the row count, which the microbatch size changes
        assert np.abs(logits - f32_one).max() <= 1e-5
        assert stats["microbatches"] == m and stats["wire"] == "f32"
        # f32 sends the stage's own output: no packing time, and the hidden bytes exactly
        hidden = PRESETS["tiny"].hidden_size
        for r in stats["timings"]:
            if r["stage"] < RANKS - 1:
                assert r["bytes_sent"] == BATCH * SEQ * hidden * 4
                assert r["pack_ms"] == 0.0
        assert "bubble" in proc.stdout


def test_protocol_only_family_runs(tmp_path):
    from protocol_family import reference, write_checkpoint

    ckpt = tmp_path / "proto.h5"
    cfg = write_checkpoint(ckpt)
    ids = np.random.default_rng(1).integers(0, cfg["vocab"], (3, 7))
    logits, stats, _ = run(tmp_path, "proto", ckpt, ids, plugins=["protocol_family"], microbatches=2)
    ref = reference(cfg, ids)
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()
    assert len(stats["timings"]) == RANKS


@pytest.mark.parametrize("wire", ["bf16", "f16"])
def test_half_wire_within_bound(tmp_path, tiny_ckpt, ids, f32_one, wire):
    from rlx_mpi.executor import wire_error_bound
    from rlx_mpi.wire import get_codec

    bound = wire_error_bound(get_codec(wire), hops=RANKS - 1)
    for m in (1, 2, 3):
        logits, stats, _ = run(tmp_path, f"{wire}{m}", tiny_ckpt, ids, microbatches=m, wire=wire)
        err = np.abs(logits - f32_one).max() / np.abs(f32_one).max()
        assert 0 < err <= bound, (wire, m, err, bound)  # > 0: the codec really ran
        assert stats["wire"] == wire
        hidden = PRESETS["tiny"].hidden_size
        for r in stats["timings"]:
            if r["stage"] < RANKS - 1:
                assert r["bytes_sent"] == BATCH * SEQ * hidden * 2  # half the bytes of f32


def test_trace_one_lane_per_rank_and_gantt(tmp_path, tiny_ckpt, ids):
    from conftest import run_cli
    from rlx_mpi.trace import bubble, load_trace, spans_from_trace, validate_trace

    path = tmp_path / "trace.json"
    _, stats, _ = run(tmp_path, "tr", tiny_ckpt, ids, extra_args=["--trace", path], microbatches=3, wire="bf16")
    doc = json.loads(path.read_text())
    validate_trace(doc)
    lanes = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert lanes == set(range(RANKS))
    spans = spans_from_trace(load_trace(path))
    for r in range(RANKS):
        mine = [s for s in spans if s.rank == r]
        computes = sorted(s.args["microbatch"] for s in mine if s.cat == "compute")
        assert computes == [0, 1, 2]
        assert {"build", "probe"} <= {s.name for s in mine if s.cat == "startup"}
        if r > 0:
            assert sorted(s.args["microbatch"] for s in mine if s.cat == "recv_wait") == [0, 1, 2]
            assert sum(s.cat == "unpack" for s in mine) == 3
        if r < RANKS - 1:
            assert sum(s.cat == "pack" for s in mine) == 3
            assert sorted(s.args["microbatch"] for s in mine if s.cat == "send_wait") == [0, 1, 2]
    # on one clock: a stage computes microbatch m only after the previous stage did
    first = {(s.rank, s.args["microbatch"]): s for s in spans if s.cat == "compute"}
    for r in range(1, RANKS):
        for m in range(3):
            assert first[(r, m)].start_s >= first[(r - 1, m)].start_s + first[(r - 1, m)].dur_s - 1e-3
    b = bubble(spans, RANKS, 3)
    assert b["ideal_bubble"] == pytest.approx(2 / 5)
    # the trace subcommand: a summary, and a clear answer about the picture
    png = tmp_path / "gantt.png"
    proc = run_cli(["trace", path, "--png", png], timeout=60)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert proc.returncode == 2 and "matplotlib is not installed" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bubble" in proc.stdout and "rank 2" in proc.stdout
