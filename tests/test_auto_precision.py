"""``precision = "auto"`` (issue 41 section 4), the default: a job runs at the checkpoint's stored
format (q4 for a Q4 GGUF's conversion or ``--dtype q4``, int8 for Q8_0's, bf16 / f16 / f32 for
floats), read from the root attribute ``stored_precision`` (a bounded look at the tensors of a file
written before it), resolved once where the job meets the checkpoint (the start-up, ``plan``), and
what ran is what the table's precision column and the run identity say."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from conftest import run_cli, write_job
from rlx_mpi import cli
from rlx_mpi.cluster.start import resolve_precision
from rlx_mpi.config import Precision, parse_job
from rlx_mpi.families.llama import FAMILY, PRESETS
from rlx_mpi.model import checkpoint
from rlx_mpi.model.checkpoint import stored_precision

TINY = PRESETS["tiny"]


def _older(path):
    """``path`` as a file written before the stored_precision attribute."""
    with h5py.File(path, "r+") as f:
        del f.attrs["stored_precision"]
    return path


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The tiny preset written by the package's own writer at each storage dtype."""
    d = tmp_path_factory.mktemp("stored")
    for dtype in ("float32", "float16", "bfloat16", "q4"):
        FAMILY.init_random(d / f"{dtype}.h5", TINY, seed=1, dtype=dtype)
    return d


@pytest.mark.parametrize("dtype, want", [("float32", "f32"), ("float16", "f16"), ("bfloat16", "bf16"), ("q4", "q4")])
def test_the_writer_records_the_stored_format_and_older_files_are_looked_at(tmp_path, stored, dtype, want):
    path = stored / f"{dtype}.h5"
    with h5py.File(path, "r") as f:
        assert f.attrs["stored_precision"] == want
    assert stored_precision(path) == (want, "its stored_precision attribute")
    old = tmp_path / "old.h5"
    old.write_bytes(path.read_bytes())
    got, how = stored_precision(_older(old))
    assert got == want and "predates the stored_precision attribute" in how
    # layer 0's first 2-D tensor tells a float file (down_proj); a q4 file, its first q4 group
    assert how.startswith("1 of its tensors" if dtype != "q4" else "2 of its tensors"), how


def test_an_older_file_is_not_walked_whole(tmp_path, stored, monkeypatch):
    """Only q8 groups in the first nodes: the look stops at its bound (int8), not at the file's end."""
    path = tmp_path / "q8.h5"
    path.write_bytes((stored / "float32.h5").read_bytes())
    with h5py.File(path, "r+") as f:
        del f.attrs["stored_precision"]
        f.attrs["quantized"] = True
        w = f["layers/0/q_proj"][()]
        del f["layers/0/q_proj"]
        g = f.create_group("layers/0/q_proj")
        g.attrs["quant"], g.attrs["shape"], g.attrs["group_size"] = "q8", np.array(w.shape, np.int64), 32
        g.create_dataset("codes", data=np.zeros(w.shape, np.int8))
        g.create_dataset("scale", data=np.ones((w.shape[0], w.shape[1] // 32), np.float16))
    monkeypatch.setattr(checkpoint, "_STORED_LOOK", 8)  # (q_proj is layer 0's 7th node)
    assert stored_precision(path) == ("int8", "8 of its tensors (the file predates the stored_precision attribute)")


def test_an_attribute_that_disagrees_with_quantized_is_not_trusted(tmp_path, stored):
    """A float file whose tensors were made q4 groups by hand keeps its old attribute: looked at."""
    path = tmp_path / "edited.h5"
    path.write_bytes((stored / "float32.h5").read_bytes())
    with h5py.File(stored / "q4.h5", "r") as q4, h5py.File(path, "r+") as f:
        del f["layers/3/up_proj"]
        q4.copy("layers/3/up_proj", f["layers/3"])
        f.attrs["quantized"] = True
    assert stored_precision(path)[0] == "q4"


def test_init_model_cli_q4_is_auto_q4(tmp_path):
    assert cli.main(["init-model", str(tmp_path / "r.h5"), "--preset", "tiny", "--dtype", "q4"]) == 0
    assert stored_precision(tmp_path / "r.h5")[0] == "q4"


# -- GGUF conversions -------------------------------------------------------------------------------


def _gguf(tmp_path, types: dict):
    """A llama GGUF (tests/test_gguf.py's writer) with the linear weights in ``types`` (short
    name -> GGML type) quantized, converted to a checkpoint; the path of the checkpoint."""
    gguf = pytest.importorskip("gguf")
    from test_gguf import _LAYER, base_meta, gguf_tensors, source_model, write_gguf

    from rlx_mpi.families.gguf import convert_gguf

    _, cfg, ours, _ = source_model("llama")
    tensors = {}
    for name, data in gguf_tensors("llama", cfg, ours).items():
        short = next((k for k, v in _LAYER.items() if name.endswith("." + v)), None)
        qtype = types.get(short)
        tensors[name] = (data, None) if qtype is None else (gguf.quants.quantize(data, qtype), qtype)
    out = tmp_path / "g.h5"
    convert_gguf(write_gguf(tmp_path / "g.gguf", "llama", base_meta(cfg), tensors), out)
    return out


def _types(**by):
    gguf = pytest.importorskip("gguf")
    return {k: getattr(gguf.GGMLQuantizationType, v) for k, v in by.items()}


@pytest.mark.parametrize("name, types, want", [
    ("F32", {}, "f32"),
    ("Q8_0", dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), "Q8_0"),
     "int8"),
    # as Q4_K_M: 4-bit most, 8-bit groups (there Q6_K) for v and down: the file is q4
    ("Q4 mixed", {**dict.fromkeys(("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"), "Q4_0"),
                  "v_proj": "Q8_0", "down_proj": "Q8_0"}, "q4"),
])
def test_a_gguf_conversion_runs_at_its_stored_format(tmp_path, name, types, want):
    path = _gguf(tmp_path, _types(**types))
    assert stored_precision(path) == (want, "its stored_precision attribute")
    assert stored_precision(_older(path))[0] == want


# -- resolving a job ---------------------------------------------------------------------------------


def _job(tmp_path, ckpt, run=None, rank=()):
    raw = {"model": {"checkpoint": str(ckpt)}, "run": run or {}}
    if rank:
        raw["rank"] = list(rank)
    return parse_job(raw, tmp_path / "job.toml")


def test_resolve_makes_every_auto_the_stored_format_and_says_so(tmp_path, stored):
    job, note = resolve_precision(_job(tmp_path, stored / "q4.h5", rank=[{"rank": 1, "precision": "int8"}]), FAMILY)
    assert [job.precision_for(r).value for r in range(3)] == ["q4", "int8", "q4"] and not job.asks_auto
    assert note == f"precision auto -> q4 (the checkpoint's stored format: {stored / 'q4.h5'})"
    same = _job(tmp_path, stored / "q4.h5", {"precision": "f32"})
    assert resolve_precision(same, FAMILY) == (same, None)  # a concrete precision: nothing read, nothing said

    class FloatOnly:  # a family that builds float32 stages only (its declared precisions)
        name, precisions = "float-only", ("f32",)

    job, note = resolve_precision(_job(tmp_path, stored / "bfloat16.h5"), FloatOnly())
    assert job.run.precision is Precision.F32 and "stores bf16, which model family 'float-only' does not build" in note


# -- plan ----------------------------------------------------------------------------------------------


def test_plan_resolves_auto_from_the_jobs_checkpoint(tmp_path, stored, capsys):
    job = write_job(tmp_path, model={"checkpoint": str(stored / "q4.h5")}, run={"seq": 64})
    assert cli.main(["plan", str(job), "--ranks", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"precision auto -> q4 (the checkpoint's stored format: {stored / 'q4.h5'})"
    assert "; q4 weights;" in out[1]
    head = out[2].split()
    assert [dict(zip(head, line.split()))["precision"] for line in out[3:5]] == ["q4", "q4"]
    # --precision says what to price: no auto to resolve
    assert cli.main(["plan", str(job), "--ranks", "2", "--precision", "int8"]) == 0
    out = capsys.readouterr().out
    assert "precision auto" not in out and "; int8 weights;" in out


def test_plan_without_a_checkpoint_to_read_says_auto_is_f32(tmp_path, capsys):
    job = write_job(tmp_path, model={"checkpoint": str(tmp_path / "later.h5"), "preset": "tiny"}, run={"seq": 64})
    assert cli.main(["plan", str(job), "--ranks", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"precision auto -> f32 (no checkpoint to read: {tmp_path / 'later.h5'} does not exist yet)"
    assert "; f32 weights;" in out[1]
    assert cli.main(["plan", str(job), "--ranks", "2", "--preset", "small"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "precision auto -> f32 (the model comes from the flags, not the job's checkpoint)"
    assert cli.main(["plan", "--ranks", "2", "--preset", "tiny"]) == 0  # no job: no auto, f32 as before
    out = capsys.readouterr().out
    assert "precision auto" not in out and "; f32 weights;" in out


# -- real ranks ------------------------------------------------------------------------------------------


@pytest.mark.mpi
def test_a_q4_checkpoint_with_no_precision_runs_at_q4(tmp_path, stored):
    """2 ranks, a q4 checkpoint, no precision in the job: the table's precision column, the JSON
    rows and the start-up's log line all say q4, and the logits are a q4 stage's."""
    from rlx_mpi.families.decoder.stage import DecoderStage
    from rlx_mpi.model.checkpoint import H5ParamSource

    ckpt = stored / "q4.h5"
    ids = np.random.default_rng(3).integers(0, TINY.vocab_size, (1, 8))
    np.save(tmp_path / "ids.npy", ids)
    job = write_job(tmp_path, model={"checkpoint": str(ckpt)}, run={"timeout_s": 60.0},
                    placement={"reserve_ram_gb": 0.0, "policy": "manual", "manual": ["0:4", "4:8"]})
    out, stats = tmp_path / "out.h5", tmp_path / "stats.json"
    proc = run_cli(["run", job, "--input-ids", tmp_path / "ids.npy", "--out", out, "--json", stats], ranks=2,
                   timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert f"precision auto -> q4 (the checkpoint's stored format: {ckpt})" in proc.stderr
    lines = proc.stdout.splitlines()
    head = lines[0].split()
    col = head.index("precision")
    assert [line.split()[col] for line in lines[1:3]] == ["q4", "q4"], proc.stdout
    assert {r["precision"] for r in json.loads(stats.read_text())["timings"]} == {"q4"}
    with H5ParamSource(ckpt) as src:
        want = DecoderStage(TINY, src, range(8), True, True, precision="q4").forward(ids)
    with h5py.File(out, "r") as f:
        np.testing.assert_allclose(f["logits"][()], want, rtol=0, atol=1e-3 * np.abs(want).max())


def test_the_run_identity_records_what_ran_never_auto(tmp_path, stored):
    """A resume is judged by the precision that ran: the identity's settings take the resolved
    job, and refuse one whose "auto" was never resolved."""
    from rlx_mpi.io.identity import unplaced_settings

    job = _job(tmp_path, stored / "q4.h5")
    with pytest.raises(ValueError, match="not resolved"):
        unplaced_settings(job)
    assert unplaced_settings(resolve_precision(job, FAMILY)[0])["precision"] == "q4"
