"""Reliability II (issue 7) through the real CLI: never hang, never destroy a file, never exit 0
without the result, bad input is exit 2, one accurate line.

Every case runs ``rlx-mpi`` as a user would (``run``/``probe`` under ``mpiexec``, the other
commands as plain processes) on inputs made in a fresh folder, and asserts: the exit code,
exactly one ``rlx-mpi: error:`` line containing the expected words, no traceback, a time
bound, that no input file changed (sha256 of every file in the folder and of the checkpoint,
before and after) and that no temporary file was left behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest

from conftest import MPIEXEC, TESTS, _env, finish_cli, run_cli
from helpers import LaunchAhead, job_builder, leftovers_killed

pytestmark = pytest.mark.mpi

OK, BAD_INPUT, NO_FIT, FAULT, TIMEOUT, LAUNCHER_KILL = 0, 2, 3, 4, 5, 9
HOST = socket.gethostname()
STARTUP_S = 4.0  # [run] startup_timeout_s of the jobs whose start-up is made to stall
RUN = {"seq": 8, "timeout_s": 3.0, "startup_timeout_s": 15.0}  # others: room for a cold numba cache on a loaded box
SHORT = {"startup_timeout_s": STARTUP_S}
PLACE = {"reserve_ram_gb": 0.0}


@dataclass
class Case:
    id: str
    make: Callable  # (folder, checkpoint) -> argv after "rlx-mpi", or (argv, env)
    code: int | tuple  # a tuple: any of these (a launcher's race decides which)
    needle: str  # must appear in the one error line ("" with code 0: no error line at all)
    ranks: int | None = 2
    limit_s: float = 20.0


# -- builders ----------------------------------------------------------------------------------


job = job_builder(RUN)


def run_job(d, ckpt, *flags, **kw) -> list:
    return ["run", job(d, ckpt, **kw), *flags]


def copy_ckpt(d: Path, ckpt: Path, edit: Callable | None = None) -> Path:
    path = d / "model.h5"
    shutil.copy(ckpt, path)
    if edit is not None:
        with h5py.File(path, "r+", locking=False) as f:
            edit(f)
    return path


def set_config(**changes) -> Callable:
    import json

    def edit(f):
        cfg = json.loads(f.attrs["config"])
        cfg.update(changes)
        f.attrs["config"] = json.dumps(cfg)
    return edit


def fifo(d: Path, name: str) -> Path:
    path = d / name
    os.mkfifo(path)
    return path


def preinit(kind: str, rank: int = 1) -> Callable:
    def make(d, ckpt):
        return run_job(d, ckpt, run=SHORT), {"RLX_MPI_TEST_PREINIT": kind, "RLX_MPI_TEST_PREINIT_RANK": str(rank)}
    return make


_BROKEN_NUMPY = """\
# a numpy that is broken on rank 1 only (a node's bad site-packages or hung file system);
# elsewhere it steps aside and loads the real one in its place
import os, sys
if os.environ.get("PMI_RANK") == "1":
    if {kind!r} == "hang":
        import time
        time.sleep(3600)
    raise ImportError("numpy: a broken installation on this node (test)")
_here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["numpy"]
import numpy  # the real one: the import system hands it to whoever imported us
"""


def broken_numpy(kind: str) -> Callable:
    """Rank 1's numpy hangs or raises at import: before the lazy package __init__, that import
    ran before the supervisor's fork and hung the launcher for ever."""
    def make(d, ckpt):
        shadow = d / "shadow" / "numpy"
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text(_BROKEN_NUMPY.format(kind=kind))
        return run_job(d, ckpt, run=SHORT), {"PYTHONPATH": f"{d / 'shadow'}{os.pathsep}{_env(None)['PYTHONPATH']}",
                                             "RLX_MPI_STARTUP_TIMEOUT_S": str(STARTUP_S)}  # (before the job is read)
    return make


def hanging_plugin(d, ckpt):
    (d / "hang_plugin.py").write_text("import time\ntime.sleep(3600)\n")
    return run_job(d, ckpt, run=SHORT, model={"plugins": ["hang_plugin"]}), {"PYTHONPATH": f"{d}{os.pathsep}{_env(None)['PYTHONPATH']}"}


def stopping_plugin(rank: int) -> Callable:
    """A plug-in that stops (SIGSTOP) rank ``rank`` while it is imported, mid start-up."""
    def make(d, ckpt):
        (d / "stop_plugin.py").write_text(f"import os, signal\nif os.environ.get('PMI_RANK') == '{rank}':\n"
                                          "    os.kill(os.getpid(), signal.SIGSTOP)\n")
        return (run_job(d, ckpt, run=SHORT, model={"plugins": ["stop_plugin"]}),
                {"PYTHONPATH": f"{d}{os.pathsep}{_env(None)['PYTHONPATH']}"})
    return make


def raising_plugin(d, ckpt):
    (d / "bad_plugin.py").write_text("raise RuntimeError('plug-in bug')\n")
    return run_job(d, ckpt, model={"plugins": ["bad_plugin"]}), {"PYTHONPATH": f"{d}{os.pathsep}{_env(None)['PYTHONPATH']}"}


def faulty(kind: str, rank: int = 1) -> Callable:
    def make(d, ckpt):
        import faulty_family

        model = faulty_family.write_checkpoint(d / "faulty.h5")
        return (run_job(d, model, "--out", d / "out.h5", model={"plugins": ["faulty_family"]}),
                {"RLX_TEST_FAULT": kind, "RLX_TEST_FAULT_RANK": str(rank)})
    return make


def ids_file(write: Callable) -> Callable:
    def make(d, ckpt):
        path = d / "ids.npy"
        write(path)
        return run_job(d, ckpt, "--input-ids", path)
    return make


def forged_npy(path: Path) -> None:
    """A .npy whose header claims 4e9 x 8 int64 (256 GB) over 64 bytes of data."""
    header = np.lib.format.header_data_from_array_1_0(np.zeros((1, 8), np.int64))
    header["shape"] = (4_000_000_000, 8)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(np.zeros(8, np.int64).tobytes())


def npz(path: Path) -> None:
    with open(path, "wb") as f:
        np.savez(f, ids=np.zeros((1, 8), np.int64))


def h5_ids(path: Path) -> None:
    with h5py.File(path, "w") as f:
        f["ids"] = np.zeros((1, 8), np.int64)


def other_job_on_rank_1(d, ckpt):
    a = job(d, ckpt, name="a.toml")
    b = job(d, ckpt, name="b.toml", run={"seed": 7})
    return ["MPMD", a, b], None


def stale_checkpoint_on_rank_1(d, ckpt):
    """Node-local copies: the same job text in two folders, rank 1's checkpoint a different model."""
    for name, theta in (("a", None), ("b", 500000.0)):
        (d / name).mkdir()
        copy_ckpt(d / name, ckpt, None if theta is None else set_config(rope_theta=theta))
        (d / name / "job.toml").write_text(toml_text_of_job())
    return ["MPMD", d / "a" / "job.toml", d / "b" / "job.toml"], None


def toml_text_of_job() -> str:
    from conftest import toml_text

    return toml_text(model={"checkpoint": "model.h5"}, run=RUN, placement=PLACE)


def symlink_to(target_of: Callable) -> Callable:
    def make(d, ckpt):
        local = copy_ckpt(d, ckpt)
        (d / "link.h5").symlink_to(target_of(d, local))
        return run_job(d, local, "--out", d / "link.h5")
    return make


def convert_onto_source(d, ckpt):
    from conftest import TESTS

    src = d / "hf"
    shutil.copytree(TESTS / "fixtures" / "hf_tiny_llama", src)
    return ["convert", src, src / "model.safetensors"]


# -- the table ---------------------------------------------------------------------------------

TESTS_FIXTURE = TESTS / "fixtures" / "hf_tiny_llama"
PRE = STARTUP_S + 8  # pre-MPI cases: the deadline, the supervisor's grace, the launcher's clean-up

CASES = [
    # 1. hangs: every start-up wait, before MPI too, has a deadline
    Case("preinit-exit0", preinit("exit0"), LAUNCHER_KILL, "rank 1 (" + HOST + "): ended with exit status 0 before MPI",
         limit_s=PRE),
    Case("preinit-exit3", preinit("exit3"), LAUNCHER_KILL, "ended with exit status 3 before MPI start-up", limit_s=PRE),
    Case("preinit-kill", preinit("kill"), LAUNCHER_KILL, "rank 1 (" + HOST + "): died of SIGKILL", limit_s=PRE),
    Case("preinit-stop", preinit("stop"), LAUNCHER_KILL, "rank 1 (" + HOST + "): stopped (SIGSTOP",
         ranks=3, limit_s=PRE),
    Case("numpy-import-hangs-rank1", broken_numpy("hang"), TIMEOUT, "rank 1 did not finish reading the job file",
         limit_s=PRE),
    Case("numpy-import-fails-rank1", broken_numpy("raise"), FAULT, "rank 1 (" + HOST + "): cannot import numpy: ImportError: numpy: a broken"),
    Case("preinit-hang-rank0", preinit("hang", rank=0), LAUNCHER_KILL, "rank 0 (" + HOST + "): stuck for 4 s",
         limit_s=PRE),
    Case("plugin-import-hangs", hanging_plugin, TIMEOUT, "reading the checkpoint header did not finish within 4 s",
         limit_s=PRE),
    Case("startup-stop-rank1", stopping_plugin(1), TIMEOUT,
         f"rank 0 ({HOST}): rank 1 did not finish reading the checkpoint header within", ranks=3, limit_s=PRE),
    Case("startup-stop-rank0", stopping_plugin(0), TIMEOUT, f"rank 1 ({HOST}): waited", ranks=3, limit_s=PRE + 4),
    Case("job-is-fifo", lambda d, c: ["run", fifo(d, "job.toml")], BAD_INPUT, "is not a regular file"),
    Case("checkpoint-is-fifo", lambda d, c: run_job(d, fifo(d, "model.h5")), BAD_INPUT,
         "is not a regular file (a pipe or device)"),
    Case("ids-are-fifo", lambda d, c: run_job(d, c, "--input-ids", fifo(d, "ids.npy")), BAD_INPUT,
         "is not a regular file"),
    Case("plan-absurd-layers", lambda d, c: ["plan", "--ranks", "4", "--layers", "10000000", "--hidden", "64",
                                             "--heads", "8", "--intermediate", "128", "--vocab", "100"],
         BAD_INPUT, "the model has 10000000 layers", ranks=None, limit_s=10),
    # 2. destroyed files: an output is never an input, a directory, or half-written
    Case("out-is-checkpoint", lambda d, c: run_job(d, copy_ckpt(d, c), "--out", d / "model.h5"), BAD_INPUT,
         "is the checkpoint"),
    Case("json-is-job", lambda d, c: run_job(d, c, "--json", d / "job.toml"), BAD_INPUT, "is the job file"),
    Case("out-is-ids", lambda d, c: run_job(d, c, "--input-ids", d / "ids.npy", "--out", d / "ids.npy")
         if np.save(d / "ids.npy", np.zeros((1, 8), np.int64)) is None else None, BAD_INPUT, "is the input ids"),
    Case("out-equals-json", lambda d, c: run_job(d, c, "--out", d / "r.h5", "--json", d / "r.h5"), BAD_INPUT,
         "is also the --out output"),
    Case("out-symlink-to-checkpoint", symlink_to(lambda d, local: local), BAD_INPUT, "is the checkpoint"),
    Case("out-is-directory", lambda d, c: run_job(d, c, "--out", d), BAD_INPUT, "is a directory"),
    Case("preset-folder-unwritable", lambda d, c: ["run", job(d, "/proc/rlx/tiny.h5", model={"preset": "tiny"})],
         BAD_INPUT, "cannot create folder /proc/rlx"),
    Case("out-folder-missing", lambda d, c: run_job(d, c, "--out", d / "no" / "out.h5"), BAD_INPUT,
         "does not exist"),
    Case("out-folder-unwritable", lambda d, c: run_job(d, c, "--json", "/proc/rlx.json"), BAD_INPUT,
         "cannot create a file in /proc"),
    Case("json-to-full-device", lambda d, c: run_job(d, c, "--json", "/dev/full"), FAULT,
         "--json /dev/full: no space left"),
    Case("convert-onto-source", convert_onto_source, BAD_INPUT, "is the source file model.safetensors", ranks=None),
    Case("init-model-onto-device", lambda d, c: ["init-model", "/dev/null"], BAD_INPUT,
         "is a device or pipe, not a regular file", ranks=None),
    # 3. exit 0 means the complete, finite result
    Case("rank-exits-0-mid-run", faulty("exit0"), (FAULT, LAUNCHER_KILL), f"rank 1 ({HOST}, stage 1, layers 4:8, microbatch 0): "
         "ended with exit status 0"),
    Case("nan-weights", lambda d, c: run_job(d, copy_ckpt(d, c, lambda f: f["layers/5/down_proj"].__setitem__(
        (0, 0), np.nan)), "--out", d / "out.h5"), FAULT, "stage 1's logits for row 0 of the batch (microbatch 0) has"),
    Case("negative-eps", lambda d, c: run_job(d, copy_ckpt(d, c, set_config(rms_norm_eps=-1e-6))), BAD_INPUT,
         "rms_norm_eps = -1e-06 must be a finite number > 0"),
    Case("negative-theta", lambda d, c: run_job(d, copy_ckpt(d, c, set_config(rope_theta=-5.0))), BAD_INPUT,
         "rope_theta = -5.0"),
    Case("string-eps", lambda d, c: run_job(d, copy_ckpt(d, c, set_config(rms_norm_eps="1e-6"))), BAD_INPUT,
         "rms_norm_eps = '1e-6'"),
    Case("tie-as-string", lambda d, c: run_job(d, copy_ckpt(d, c, set_config(tie_word_embeddings="false"))),
         BAD_INPUT, "tie_word_embeddings = 'false' must be true or false"),
    Case("null-config", lambda d, c: run_job(d, copy_ckpt(d, c, lambda f: f.attrs.__setitem__("config", "null"))),
         BAD_INPUT, "model config is NoneType"),
    # 4. bad input is exit 2 (or 3 for no fit), never an internal error or a fault
    Case("ids-npz", ids_file(npz), BAD_INPUT,
         "a .npz archive"),
    Case("ids-forged-header", ids_file(forged_npy), BAD_INPUT, "the header says shape (4000000000, 8)"),
    Case("ids-hdf5", ids_file(h5_ids), BAD_INPUT, "an HDF5 file, not a .npy array"),
    Case("batch-too-large", lambda d, c: run_job(d, c, run={"batch": 2**31}, placement={"reserve_ram_gb": 0.0}),
         NO_FIT, "GB short); add ranks, lower reserve_ram_gb"),  # no "raise --mem-gb": a flag of plan
    Case("reserve-1e300", lambda d, c: run_job(d, c, placement={"reserve_ram_gb": 1e300}), BAD_INPUT,
         "reserve_ram_gb: got 1e+300, expected a value <= 1e+06"),
    Case("plugin-raises", raising_plugin, BAD_INPUT, "importing 'bad_plugin' raised RuntimeError: plug-in bug"),
    Case("ranks-see-other-job", other_job_on_rank_1, BAD_INPUT, "ranks [1] see a different job file than rank 0"),
    Case("ranks-see-other-checkpoint", stale_checkpoint_on_rank_1, BAD_INPUT,
         "ranks [1] see a different checkpoint (header or size) than rank 0"),
    Case("format-version-string", lambda d, c: run_job(d, copy_ckpt(d, c, lambda f: f.attrs.__setitem__(
        "format_version", "1"))), BAD_INPUT, "format_version '1' (str) is not supported"),
    # 5. one accurate line
    Case("usage-error-once", lambda d, c: ["run"], BAD_INPUT, "rlx-mpi: error: rlx-mpi run: the following arguments"),
    Case("device-gpu", lambda d, c: run_job(d, c, rank=[{"rank": 0, "device": "gpu"}]), BAD_INPUT,
         "device: got 'gpu'; expected one of ['cpu']"),
    Case("kv-cache-window-0", lambda d, c: run_job(d, c, rank=[{"rank": 1, "kv_cache": "window:0"}]), BAD_INPUT,
         "kv_cache: got 'window:0'; expected \"none\", \"full\" or \"window:W\""),
    Case("plan-seq-past-positions", lambda d, c: ["plan", job(d, c), "--ranks", "2", "--seq", "100000"], BAD_INPUT,
         "sequence length 100000 exceeds the model's maximum 256 positions", ranks=None),
    Case("manual-ranges-count", lambda d, c: run_job(d, c, placement={"policy": "manual", "manual": ["0:4", "4:8"]}),
         BAD_INPUT, "2 ranges for 1 stage (1 rank / tp 1)", ranks=1),
    Case("bom-job-runs", lambda d, c: ["run", bom(job(d, c))], OK, ""),
    Case("json-through-symlink-to-device", lambda d, c: run_job(d, c, "--json", link(d / "tty", "/dev/null")), OK, ""),
    Case("json-to-stdout-runs", lambda d, c: run_job(d, c, "--json", "/dev/stdout"), OK, ""),
]


def link(path: Path, target: str) -> Path:
    path.symlink_to(target)
    return path


def bom(path: Path) -> Path:
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    return path


# -- the check ---------------------------------------------------------------------------------


def checksums(*places: Path) -> dict[str, str]:
    sums = {}
    for place in places:
        files = [place] if place.is_file() else [p for p in place.rglob("*") if p.is_file() and not p.is_symlink()]
        for p in files:
            sums[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return sums


def launch(argv: list, ranks: int | None, env: dict | None, timeout: float):
    if argv[0] == "MPMD":  # rank 0 and rank 1 given different job files
        cmd = [MPIEXEC, "-n", "1", sys.executable, "-m", "rlx_mpi", "run", str(argv[1]), ":",
               "-n", "1", sys.executable, "-m", "rlx_mpi", "run", str(argv[2])]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env),
                                start_new_session=True)
        return finish_cli(proc, timeout, t0)
    return run_cli(argv, ranks=ranks, timeout=timeout, env=env)


def timed_alone(case: Case) -> bool:
    """The cases about a start-up deadline (their limit_s is the deadline plus a grace) and
    plan's 10 s: launched by their test alone, nothing else in flight. The others (limit_s 20 s,
    far above a run's few seconds) are started ahead, two at a time (helpers.LaunchAhead)."""
    return case.limit_s < 20.0


def prepare_and_launch(case: Case, d: Path, ckpt: Path):
    """Make the case's inputs in ``d``, run it, and look at once at what it left: (the
    CompletedProcess, the checksums before and after, temporary files left, processes left)."""
    d.mkdir()
    made = case.make(d, ckpt)
    argv, env = made if isinstance(made, tuple) else (made, None)
    before = checksums(d, ckpt)
    p = launch(argv, case.ranks, env, timeout=case.limit_s + 30)
    after = checksums(d, ckpt)
    left = [f for f in d.rglob(".*tmp*")] + [f for f in d.rglob(".rlx-mpi-check*")]
    return p, before, after, left, leftovers_killed(d)


@pytest.fixture(scope="module")
def ahead(request, tmp_path_factory, tiny_ckpt):
    items = [i for i in LaunchAhead.fixture_items(request, "test_reliability")
             if not timed_alone(i.callspec.params["case"])]

    def run_ahead(item):
        d = tmp_path_factory.mktemp(item.callspec.params["case"].id) / "work"
        return prepare_and_launch(item.callspec.params["case"], d, tiny_ckpt)

    runs = LaunchAhead(items, run_ahead)
    yield runs
    runs.close()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reliability(case: Case, request, ahead, tmp_path, tiny_ckpt):
    if timed_alone(case):
        ahead.drain()
        p, before, after, left, leftovers = prepare_and_launch(case, tmp_path / "work", tiny_ckpt)
    else:
        p, before, after, left, leftovers = ahead.result(request)
    report = f"exit {p.returncode} after {p.elapsed:.1f} s\n--- stdout\n{p.stdout[-2000:]}\n--- stderr\n{p.stderr}"
    errors = [line for line in p.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert p.returncode in (case.code if isinstance(case.code, tuple) else (case.code,)), report
    if case.code == OK:
        assert errors == [], report
    else:
        assert len(errors) == 1, report
        assert case.needle in errors[0], report
    assert "Traceback" not in p.stderr, report
    assert p.elapsed < case.limit_s, report
    changed = [f for f, s in before.items() if after.get(f) != s]
    assert not changed, f"inputs changed: {changed}\n{report}"
    assert not left, f"temporary files left: {left}\n{report}"
    assert not leftovers, f"processes left behind\n{report}"




# -- a full disk: a 8 KB tmpfs --------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    """A tmpfs of 8 KB (mounting needs root; the suite runs as root in CI and on the dev VM)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root: the full-disk cases cannot run here")
    where = tmp_path_factory.mktemp("full")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(where)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")
    yield where
    subprocess.run(["umount", str(where)], check=False)


@pytest.fixture(scope="module")
def read_only(tmp_path_factory):
    """A read-only tmpfs (root only, like `full_disk`): root's writes are refused only here."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a read-only tmpfs needs root")
    where = tmp_path_factory.mktemp("ro")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=8k", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")
    yield where
    subprocess.run(["umount", str(where)], check=False)


def test_output_on_a_read_only_mount_is_refused_before_the_forward(tmp_path, tiny_ckpt, read_only):
    d = tmp_path / "work"
    d.mkdir()
    argv = run_job(d, tiny_ckpt, "--out", read_only / "out.h5")
    before = checksums(d, tiny_ckpt)
    p = launch(argv, 2, None, timeout=60)
    errors = [line for line in p.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert p.returncode == BAD_INPUT and len(errors) == 1, p.stderr
    assert f"--out {read_only}/out.h5: cannot create a file in {read_only} (read-only filesystem)" in errors[0], p.stderr
    assert "Traceback" not in p.stderr and p.elapsed < 20 and checksums(d, tiny_ckpt) == before, p.stderr
    assert "total forward" not in p.stdout  # refused before the forward, not after it


FULL = [
    Case("convert", lambda d, c, full: ["convert", TESTS_FIXTURE, full / "c.h5"], FAULT, "no space left", ranks=None),
    Case("init-model", lambda d, c, full: ["init-model", full / "m.h5"], FAULT, "no space left", ranks=None),
    Case("run-out", lambda d, c, full: run_job(d, c, "--out", full / "out.h5"), FAULT, "--out " ),
    Case("preset-checkpoint", lambda d, c, full: ["run", job(d, full / "tiny.h5", model={"preset": "tiny"})], FAULT,
         "no space left"),
]


@pytest.mark.parametrize("case", FULL, ids=[c.id for c in FULL])
def test_full_disk(case: Case, tmp_path, tiny_ckpt, full_disk):
    d = tmp_path / "work"
    d.mkdir()
    argv = case.make(d, tiny_ckpt, full_disk)
    before = checksums(d, tiny_ckpt)
    p = launch(argv, case.ranks, None, timeout=case.limit_s + 30)
    report = f"exit {p.returncode} after {p.elapsed:.1f} s\n--- stderr\n{p.stderr}"
    errors = [line for line in p.stderr.splitlines() if line.startswith("rlx-mpi: error:")]
    assert p.returncode == case.code, report
    assert len(errors) == 1 and case.needle in errors[0] and "no space left" in errors[0], report
    assert "Traceback" not in p.stderr and p.elapsed < case.limit_s, report
    assert checksums(d, tiny_ckpt) == before, report
    assert list(full_disk.iterdir()) == [], f"left in the full folder: {list(full_disk.iterdir())}\n{report}"
