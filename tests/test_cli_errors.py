"""Bad input through the real CLI: one ``rlx-mpi: error:`` line, the documented exit code, fast.

Each case builds its inputs in a fresh folder and runs the CLI as a user would: ``run`` and
``probe`` under ``mpiexec -n 2`` (so the error must be agreed and printed once, not once per
rank), ``plan``, ``convert`` and ``init-model`` as plain processes. Every case checks the exit
code, a specific part of the error line (the file, key or value at fault), that the line is
printed exactly once, that no traceback is shown, that it ended in under 10 s and that no
``--out`` file was left behind.

"Under 10 s" guards against an error that is agreed only when a deadline runs out: the jobs'
``startup_timeout_s`` is 20 s (and run_cli's timeout, 30 s, fails a case that hangs for good).
On a loaded machine a launch alone can take 10 s: a case slower than that is compared with a
good run launched the same way just after it, and fails if it took 10 s more than that run.

The cases' runs are started ahead of their tests, two at a time (helpers.LaunchAhead: they are
start-up bound); the tests check each run as before.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest

from conftest import run_cli, toml_text
from helpers import LaunchAhead, job_builder
from rlx_mpi.families.llama import PRESETS
from rlx_mpi.families.decoder.arch import Arch as LlamaConfig
from rlx_mpi.families.llama import FAMILY as _LLAMA
init_random = _LLAMA.init_random

BAD_INPUT, NO_FIT = 2, 3
FAST_S = 10.0  # an error ends the job in seconds; waiting out startup_timeout_s (20 s) is not that
TINY = PRESETS["tiny"]


@dataclass
class Case:
    id: str
    make: Callable  # (folder, tiny checkpoint) -> argv after "rlx-mpi"
    code: int
    needle: str  # must appear in the error line
    ranks: int | None = 2  # None: a single process, no mpiexec


# -- builders ----------------------------------------------------------------------------------

RUN = {"seq": 8, "timeout_s": 5.0, "startup_timeout_s": 20.0}


job = job_builder(RUN)


def run_args(d: Path, ckpt, ids=None, **kw) -> list:
    """``run JOB --out d/out.h5`` (plus ``--input-ids``) for a job of ``ckpt`` and ``kw``."""
    args = ["run", job(d, ckpt, **kw), "--out", d / "out.h5"]
    if ids is not None:
        np.save(d / "ids.npy", ids, allow_pickle=True)
        args += ["--input-ids", d / "ids.npy"]
    return args


def raw_job(text: str) -> Callable:
    def make(d, ckpt):
        (d / "job.toml").write_text(text.replace("CKPT", str(ckpt)))
        return ["run", d / "job.toml", "--out", d / "out.h5"]
    return make


def ckpt_of(cfg: LlamaConfig, d: Path) -> Path:
    path = d / "model.h5"
    init_random(path, cfg, seed=1)
    return path


def edited_ckpt(d: Path, ckpt: Path, edit: Callable) -> Path:
    """A copy of ``ckpt`` changed by ``edit(h5py.File)``."""
    path = d / "edited.h5"
    shutil.copy(ckpt, path)
    with h5py.File(path, "r+", locking=False) as f:
        edit(f)
    return path


def truncated(d: Path, ckpt: Path) -> Path:
    path = d / "truncated.h5"
    data = ckpt.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


def set_nan(f):
    w = f["layers/5/up_proj"][()]
    w[3, 7] = np.nan
    f["layers/5/up_proj"][...] = w


def wrong_shape(f):
    del f["layers/2/k_proj"]
    f.create_dataset("layers/2/k_proj", data=np.zeros((TINY.kv_dim + 1, TINY.hidden_size), np.float32))


def text_file(path: Path) -> Path:
    path.write_text("1 2 3\n")
    return path


def one_layer_ckpt(d: Path) -> Path:
    return ckpt_of(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), d)


def odd_heads_ckpt(d: Path) -> Path:
    """3 attention heads (and 3 kv heads): tp = 2 cannot split them."""
    return ckpt_of(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=64), d)


SHAPE_70B = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--intermediate", "28672",
             "--vocab", "128256", "--dtype", "bfloat16"]


CASES = [
    # -- the job file ------------------------------------------------------------------------
    Case("job-missing", lambda d, c: ["run", d / "nope.toml", "--out", d / "out.h5"], BAD_INPUT,
         "nope.toml: job file not found"),
    Case("toml-invalid", raw_job('[model]\ncheckpoint = "CKPT"\n[run\nseq = 8\n'), BAD_INPUT,
         "job.toml: not valid TOML"),
    Case("unknown-section", lambda d, c: run_args(d, c, extra={"x": 1}), BAD_INPUT, "unknown section [extra]"),
    Case("unknown-key", lambda d, c: run_args(d, c, run={"seqlen": 8}), BAD_INPUT, "[run] seqlen: unknown key"),
    Case("wrong-type", lambda d, c: run_args(d, c, run={"seq": "8"}), BAD_INPUT,
         "[run] seq: got '8', expected an integer"),
    Case("negative-seq", lambda d, c: run_args(d, c, run={"seq": -1}), BAD_INPUT,
         "[run] seq: got -1, expected a value > 0"),
    Case("zero-timeout", lambda d, c: run_args(d, c, run={"timeout_s": 0.0}), BAD_INPUT,
         "[run] timeout_s: got 0.0, expected a value > 0"),
    Case("bad-policy", lambda d, c: run_args(d, c, placement={"policy": "fastest"}), BAD_INPUT,
         "[placement] policy: got 'fastest'"),
    Case("microbatches-vs-batch", lambda d, c: run_args(d, c, run={"batch": 3, "microbatches": 4}), BAD_INPUT,
         "[run] microbatches: 4 microbatches for batch = 3"),
    Case("missing-model", raw_job("[run]\nseq = 8\n"), BAD_INPUT, "missing section [model]"),
    # -- placement against the launched ranks and the model ---------------------------------------
    Case("manual-gap", lambda d, c: run_args(d, c, placement={"policy": "manual", "manual": ["0:3", "4:8"]}),
         BAD_INPUT, "[placement] manual: gap: layers 3:4 are in no stage"),
    Case("manual-overlap", lambda d, c: run_args(d, c, placement={"policy": "manual", "manual": ["0:5", "4:8"]}),
         BAD_INPUT, "[placement] manual: overlap: layers 4:5"),
    Case("manual-count", lambda d, c: run_args(d, c, placement={"policy": "manual", "manual": ["0:2", "2:5", "5:8"]}),
         BAD_INPUT, "[placement] manual: 3 ranges for 2 stages"),
    Case("manual-short", lambda d, c: run_args(d, c, placement={"policy": "manual", "manual": ["0:3", "3:7"]}),
         BAD_INPUT, "[placement] manual: the ranges stop at layer 7 but the model has 8 layers"),
    Case("manual-without-ranges", lambda d, c: run_args(d, c, placement={"policy": "manual"}), BAD_INPUT,
         '[placement] manual: policy = "manual" needs manual ranges'),
    Case("tp-vs-ranks", lambda d, c: run_args(d, c, placement={"tp": 4}), BAD_INPUT,
         "[placement] tp: tp = 4 does not divide the 2 launched ranks"),
    Case("tp-vs-heads", lambda d, c: run_args(d, odd_heads_ckpt(d), placement={"tp": 2}), BAD_INPUT,
         "[placement] tp: tp = 2 does not divide the model's 3 attention heads"),
    Case("stages-vs-layers", lambda d, c: run_args(d, one_layer_ckpt(d)), BAD_INPUT,
         "2 stages (2 ranks / tp 1) but the model has only 1 layer"),
    Case("rank-override-range", lambda d, c: run_args(d, c, rank=[{"rank": 5}]), BAD_INPUT,
         "[[rank]] rank: rank = 5 but only 2 ranks were launched"),
    Case("does-not-fit", lambda d, c: run_args(d, c, placement={"reserve_ram_gb": 1e6}), NO_FIT, "short"),
    Case("plugin-missing", lambda d, c: run_args(d, c, model={"plugins": ["no_such_plugin"]}), BAD_INPUT,
         "[model] plugins: cannot import 'no_such_plugin'"),
    # -- the checkpoint ------------------------------------------------------------------------
    Case("ckpt-missing", lambda d, c: run_args(d, d / "absent.h5"), BAD_INPUT, "absent.h5: checkpoint not found"),
    Case("ckpt-is-dir", lambda d, c: run_args(d, d), BAD_INPUT, "is a directory, not an HDF5 file"),
    Case("ckpt-not-hdf5", lambda d, c: run_args(d, text_file(d / "text.h5")), BAD_INPUT, "text.h5: not an HDF5 file"),
    Case("ckpt-truncated", lambda d, c: run_args(d, truncated(d, c)), BAD_INPUT,
         "truncated.h5: truncated: the file is shorter than its HDF5 header says"),
    Case("ckpt-not-ours", lambda d, c: run_args(d, edited_ckpt(d, c, lambda f: f.attrs.__delitem__("format"))),
         BAD_INPUT, "edited.h5: not an rlx_mpi checkpoint"),
    Case("ckpt-bad-config", lambda d, c: run_args(d, edited_ckpt(d, c, lambda f: f.attrs.__setitem__("config", "{"))),
         BAD_INPUT, "edited.h5: model config is not valid JSON"),
    Case("ckpt-tensor-missing", lambda d, c: run_args(d, edited_ckpt(d, c, lambda f: f.__delitem__("layers/6/v_proj"))),
         BAD_INPUT, "edited.h5: /layers/6/v_proj: tensor missing"),
    Case("ckpt-wrong-shape", lambda d, c: run_args(d, edited_ckpt(d, c, wrong_shape)), BAD_INPUT,
         "/layers/2/k_proj: shape (33, 64) disagrees with the model config, which implies (32, 64)"),
    Case("ckpt-nan", lambda d, c: run_args(d, edited_ckpt(d, c, set_nan), model={"check_finite": True}),
         BAD_INPUT, "/layers/5/up_proj: contains NaN or Inf"),
    # -- the input ids --------------------------------------------------------------------------
    Case("ids-missing", lambda d, c: run_args(d, c) + ["--input-ids", d / "none.npy"], BAD_INPUT,
         "none.npy: input ids file not found"),
    Case("ids-float", lambda d, c: run_args(d, c, ids=np.ones((1, 4), np.float32)), BAD_INPUT,
         "input ids have dtype float32"),
    Case("ids-1d", lambda d, c: run_args(d, c, ids=np.arange(4)), BAD_INPUT, "input ids have shape (4,)"),
    Case("ids-empty", lambda d, c: run_args(d, c, ids=np.zeros((1, 0), np.int64)), BAD_INPUT,
         "input ids are empty (shape (1, 0))"),
    Case("ids-out-of-vocab", lambda d, c: run_args(d, c, ids=np.array([[1, 2, 512]])), BAD_INPUT,
         "token id 512 is outside the vocabulary [0, 512)"),
    Case("ids-negative", lambda d, c: run_args(d, c, ids=np.array([[1, -3, 2]])), BAD_INPUT,
         "token id -3 is outside the vocabulary"),
    Case("ids-too-long", lambda d, c: run_args(d, c, ids=np.zeros((1, 300), np.int64)), BAD_INPUT,
         "sequence length 300 exceeds the model's maximum 256 positions"),
    Case("ids-pickle", lambda d, c: run_args(d, c, ids=np.array([[1, "x"]], dtype=object)), BAD_INPUT,
         "ids.npy: holds Python objects (pickled data), not integers"),
    Case("ids-not-npy", lambda d, c: run_args(d, c) + ["--input-ids", text_file(d / "ids.txt")], BAD_INPUT,
         "ids.txt: not a .npy file (no NUMPY header)"),
    Case("ids-vs-microbatches", lambda d, c: run_args(d, c, ids=np.zeros((1, 4), np.int64),
                                                      run={"batch": 2, "microbatches": 2}),
         BAD_INPUT, "ids.npy: 2 microbatches for batch = 1"),
    # -- output files ---------------------------------------------------------------------------
    Case("out-folder-missing", lambda d, c: ["run", job(d, c), "--out", d / "no" / "out.h5"], BAD_INPUT,
         "/no/out.h5: folder"),
    Case("json-folder-missing", lambda d, c: ["run", job(d, c), "--json", d / "no" / "s.json"], BAD_INPUT,
         "/no/s.json: folder"),
    # -- probe ----------------------------------------------------------------------------------
    Case("probe-bad-job", lambda d, c: ["probe", job(d, c, run={"seq": 0})], BAD_INPUT, "[run] seq: got 0"),
    # -- plan (no MPI) --------------------------------------------------------------------------
    Case("plan-shape-incomplete", lambda d, c: ["plan", "--ranks", "2", "--layers", "4", "--hidden", "64"], BAD_INPUT,
         "model shape incomplete: missing --heads, --intermediate, --vocab", ranks=None),
    Case("plan-ranks-zero", lambda d, c: ["plan", "--ranks", "0", "--preset", "tiny"], BAD_INPUT,
         "plan --ranks: got 0", ranks=None),
    Case("plan-70b-no-fit", lambda d, c: ["plan", "--ranks", "2", "--mem-gb", "64", *SHAPE_70B], NO_FIT,
         "GB short", ranks=None),
    Case("plan-tp-vs-heads", lambda d, c: ["plan", "--ranks", "6", "--tp", "3", "--preset", "tiny"], BAD_INPUT,
         "plan --tp: tp = 3 does not divide the model's 8 attention heads", ranks=None),
    Case("plan-tp-vs-ranks", lambda d, c: ["plan", "--ranks", "3", "--tp", "2", "--preset", "tiny"], BAD_INPUT,
         "tp = 2 does not divide the 3 ranks", ranks=None),
    Case("plan-job-missing", lambda d, c: ["plan", d / "nope.toml", "--ranks", "2"], BAD_INPUT,
         "nope.toml: job file not found", ranks=None),
    Case("plan-preset-unknown", lambda d, c: ["plan", "--ranks", "2", "--preset", "huge"], BAD_INPUT,
         "plan --preset: got 'huge'", ranks=None),
    # -- convert / init-model / the command line ------------------------------------------------
    Case("convert-missing-dir", lambda d, c: ["convert", d / "hf", d / "out.h5"], BAD_INPUT,
         "hf: not a directory", ranks=None),
    Case("convert-out-folder", lambda d, c: ["convert", d, d / "no" / "out.h5"], BAD_INPUT,
         "/no/out.h5: folder", ranks=None),
    Case("init-unknown-preset", lambda d, c: ["init-model", d / "out.h5", "--preset", "huge"], BAD_INPUT,
         "init-model --preset: got 'huge'", ranks=None),
    Case("init-out-folder", lambda d, c: ["init-model", d / "no" / "out.h5"], BAD_INPUT,
         "/no/out.h5: folder", ranks=None),
    Case("unknown-flag", lambda d, c: ["plan", "--ranks", "2", "--bogus"], BAD_INPUT,
         "unrecognized arguments: --bogus", ranks=None),
]


def good_run_elapsed(d: Path, ckpt, ranks: int | None) -> float:
    """Wall time of a good ``run`` of ``ckpt`` launched as the case was, now: what a launch costs
    at this moment's load (start-up, imports, numba cache loads, a forward)."""
    p = run_cli(["run", job(d, ckpt)], ranks=ranks, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.elapsed


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_ckpt):
    """Each selected case's run, in a fresh folder, started ahead: (CompletedProcess, folder, the
    --out / --json files that did not exist before the run)."""
    def launch(item):
        case = item.callspec.params["case"]
        d = tmp_path_factory.mktemp(case.id)
        args = case.make(d, tiny_ckpt)
        outs = [Path(a) for a in args[1:] if str(a).endswith((".h5", ".json")) and not Path(a).exists()]
        return run_cli(args, ranks=case.ranks, timeout=30), d, outs

    ahead = LaunchAhead(LaunchAhead.fixture_items(request, "test_bad_input"), launch)
    yield ahead
    ahead.close()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.mpi] if c.ranks else [])
                                  for c in CASES])
def test_bad_input(case: Case, request, runs, tmp_path_factory, tiny_ckpt):
    p, tmp_path, outs = runs.result(request)
    errors = [line for line in p.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    report = f"exit {p.returncode} in {p.elapsed:.1f} s\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    assert p.returncode == case.code, report
    assert len(errors) == 1, report
    assert case.needle in errors[0], report
    assert "Traceback" not in p.stdout + p.stderr, report
    assert not [o for o in outs if o.exists()], report
    assert not [f for f in tmp_path.rglob("*") if ".tmp" in f.name], report
    if p.elapsed >= FAST_S:  # slow, or a loaded machine: against a good launch made now
        good = good_run_elapsed(tmp_path_factory.mktemp("good_run"), tiny_ckpt, case.ranks)
        assert p.elapsed < good + FAST_S, f"a good run took {good:.1f} s\n{report}"


@pytest.mark.mpi
def test_debug_shows_the_traceback(tmp_path, tiny_ckpt):
    args = run_args(tmp_path, tiny_ckpt, ids=np.ones((1, 4), np.float32))
    p = run_cli(["--debug", *args], ranks=2, timeout=30)
    assert p.returncode == BAD_INPUT, p.stderr
    assert "Traceback" in p.stderr and "InputError" in p.stderr
    assert sum(line.startswith("rlx-mpi: error:") for line in p.stderr.splitlines()) == 1, p.stderr


def test_debug_shows_the_traceback_single_process(tmp_path):
    p = run_cli(["--debug", "init-model", tmp_path / "out.h5", "--preset", "huge"], timeout=30)
    assert p.returncode == BAD_INPUT and "Traceback" in p.stderr and "ConfigError" in p.stderr, p.stderr


def test_job_paths_are_relative_to_the_job_file(tmp_path, tiny_ckpt):
    """A relative checkpoint path is found from the job's folder, whatever the working directory."""
    (tmp_path / "jobs").mkdir()
    shutil.copy(tiny_ckpt, tmp_path / "model.h5")
    (tmp_path / "jobs" / "job.toml").write_text(toml_text(model={"checkpoint": "../model.h5"}, run=RUN))
    p = run_cli(["plan", "jobs/job.toml", "--ranks", "2"], cwd=tmp_path, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "8 layers" in p.stdout
