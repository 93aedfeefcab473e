"""The executor under a real mpiexec: uneven microbatches x wire formats against a one-
microbatch f32 run, a plug-in family written only to the documented Protocol, and the trace.

The module's runs (11 of them, 3 ranks each) are started ahead of the tests, two at a time
(helpers.LaunchAhead: they are start-up bound); each test checks its runs as before."""

import json

import h5py
import numpy as np
import pytest

from conftest import run_cli, write_job
from helpers import LaunchAhead
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


def _proto_run(d, ckpt_unused, ids_unused):
    from protocol_family import write_checkpoint

    ckpt = d / "proto.h5"
    cfg = write_checkpoint(ckpt)
    ids = np.random.default_rng(1).integers(0, cfg["vocab"], (3, 7))
    return cfg, ids, run(d, "proto", ckpt, ids, plugins=["protocol_family"], microbatches=2)


# test -> {key: (name, run keys, extra args)} of the runs it checks; the reference serves three
RUNS = {
    "test_uneven_microbatches_f32_equal_one_microbatch": {
        ("f32", m): (f"m{m}", {"microbatches": m, "wire": "f32"}, ()) for m in (2, 3)},
    "test_half_wire_within_bound": {
        (w, m): (f"{w}{m}", {"microbatches": m, "wire": w}, ()) for w in ("bf16", "f16") for m in (1, 2, 3)},
    "test_trace_one_lane_per_rank_and_gantt": {
        "trace": ("tr", {"microbatches": 3, "wire": "bf16"}, ("--trace", "TRACE"))},
}
NEEDS_REF = ("test_uneven_microbatches_f32_equal_one_microbatch", "test_half_wire_within_bound")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_ckpt, ids):
    """Every run the selected tests check, started ahead: key -> run()'s (logits, stats, proc),
    "proto" -> (cfg, ids, run()'s); "trace" runs with --trace into its own folder."""
    wanted = {i.originalname for i in LaunchAhead.fixture_items(request, *RUNS, "test_protocol_only_family_runs")}
    todo = [("ref", ("ref", {"microbatches": 1}, ()))] if wanted & set(NEEDS_REF) else []
    todo += [kv for name in RUNS if name in wanted for kv in RUNS[name].items()]
    if "test_protocol_only_family_runs" in wanted:
        todo.append(("proto", None))

    def launch(entry):
        key, spec = entry
        d = tmp_path_factory.mktemp(str(key).replace(" ", "").replace("'", ""))
        if key == "proto":
            return _proto_run(d, tiny_ckpt, ids)
        name, keys, extra = spec
        extra = tuple(str(d / "trace.json") if a == "TRACE" else a for a in extra)
        return (*run(d, name, tiny_ckpt, ids, extra_args=extra, **keys), d)

    ahead = LaunchAhead(todo, launch, key=lambda entry: entry[0])
    yield ahead
    ahead.close()


@pytest.fixture(scope="module")
def f32_one(runs):
    """The reference: f32 wire, one microbatch."""
    return runs.get("ref")[0]


def test_uneven_microbatches_f32_equal_one_microbatch(runs, ids, f32_one):
    for m in (2, 3):
        logits, stats, proc, _ = runs.get(("f32", m))
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


def test_protocol_only_family_runs(runs):
    from protocol_family import reference

    cfg, ids, (logits, stats, _) = runs.get("proto")  # rng(1) ids (3, 7), microbatches = 2
    ref = reference(cfg, ids)
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()
    assert len(stats["timings"]) == RANKS


@pytest.mark.parametrize("wire", ["bf16", "f16"])
def test_half_wire_within_bound(runs, ids, f32_one, wire):
    from rlx_mpi.comm.executor import wire_error_bound
    from rlx_mpi.comm.wire import get_codec

    bound = wire_error_bound(get_codec(wire), hops=RANKS - 1)
    for m in (1, 2, 3):
        logits, stats, _, _ = runs.get((wire, m))
        err = np.abs(logits - f32_one).max() / np.abs(f32_one).max()
        assert 0 < err <= bound, (wire, m, err, bound)  # > 0: the codec really ran
        assert stats["wire"] == wire
        hidden = PRESETS["tiny"].hidden_size
        for r in stats["timings"]:
            if r["stage"] < RANKS - 1:
                assert r["bytes_sent"] == BATCH * SEQ * hidden * 2  # half the bytes of f32


def test_trace_one_lane_per_rank_and_gantt(tmp_path, runs):
    from conftest import run_cli
    from rlx_mpi.io.trace import bubble, load_trace, spans_from_trace, validate_trace

    _, stats, _, d = runs.get("trace")  # --trace d/trace.json, microbatches = 3, wire = bf16
    path = d / "trace.json"
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
