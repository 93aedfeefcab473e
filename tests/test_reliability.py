"""Reliability II, pure tier: output-path rules, bounded start-up steps, config bounds, the
supervisor's verdicts on a plain child process (no MPI). The same rules are exercised through
the real CLI under mpiexec in test_reliability_mpi.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import toml_text
from rlx_mpi.config import parse_job
from rlx_mpi.errors import CheckpointError, ConfigError, DeadlineExpired, RankFault, WriteFailed
from rlx_mpi.lifecycle.faults import RankContext, bounded, check_finite
from rlx_mpi.families.llama import PRESETS
from rlx_mpi.families.decoder.arch import Arch as LlamaConfig
from rlx_mpi.outputs import check_output, check_outputs, write_output

CTX = RankContext(rank=0, size=1, host="h")


# -- output paths ------------------------------------------------------------------------------


def test_output_may_not_be_an_input_even_through_a_symlink(tmp_path):
    src = tmp_path / "model.h5"
    src.write_bytes(b"weights")
    (tmp_path / "link.h5").symlink_to(src)
    for path in (src, tmp_path / "link.h5", tmp_path / "." / "model.h5"):
        with pytest.raises(ConfigError, match="is the checkpoint"):
            check_output("--out", path, {"the checkpoint": src})
    assert src.read_bytes() == b"weights"


def test_two_outputs_may_not_be_one_file(tmp_path):
    with pytest.raises(ConfigError, match="is also the --out output"):
        check_outputs([("--out", tmp_path / "r"), ("--json", tmp_path / "r")])
    assert len(check_outputs([("--out", "/dev/null"), ("--json", "/dev/null")])) == 2  # streams may share


@pytest.mark.parametrize("path, match", [
    ("DIR", "is a directory"),
    ("DIR/missing/x.json", "does not exist"),
    ("/proc/x.json", "cannot create a file in /proc"),
    ("", "empty output path"),
])
def test_bad_output_paths(tmp_path, path, match):
    with pytest.raises(ConfigError, match=match):
        check_output("--json", path.replace("DIR", str(tmp_path)))


def test_regular_file_is_replaced_atomically_and_a_symlink_kept(tmp_path):
    target = tmp_path / "old.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    out = check_output("--json", link)
    assert not out.stream
    write_output(out, lambda tmp: tmp.write_text("new"))
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "old.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(WriteFailed, match="no space left"):
        write_output(check_output("--json", target), fail)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_devices_and_fifos_are_written_through(tmp_path):
    assert check_output("--json", "/dev/null").stream
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = check_output("--json", fifo)
    assert out.stream
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    write_output(out, lambda tmp: tmp.write_text("through the pipe"))
    assert reader.communicate(timeout=10)[0] == b"through the pipe"
    assert fifo.exists() and not fifo.is_file()  # still a FIFO, not replaced by a file
    with pytest.raises(WriteFailed, match="no space left"):
        write_output(check_output("--json", "/dev/full"), lambda tmp: tmp.write_text("x" * 10000))
    with pytest.raises(ConfigError, match="not a regular file"):
        check_output("init-model OUT", "/dev/null", stream_ok=False)


def test_unreadable_checkpoint_says_permission_denied(tmp_path, monkeypatch):
    """Not "cannot open as HDF5 ... copy it again" (root cannot be denied, so open() is faked)."""
    from rlx_mpi.model import checkpoint

    path = tmp_path / "m.h5"
    path.write_bytes(b"x")

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint, "open", denied, raising=False)
    with pytest.raises(CheckpointError, match=r"cannot open the checkpoint \(permission denied\)"):
        checkpoint.read_header(path)


# -- bounded start-up steps and finite outputs -------------------------------------------------


def test_bounded_returns_raises_or_expires():
    assert bounded(lambda: 7, 5, CTX, "x") == 7
    with pytest.raises(KeyError):
        bounded(lambda: {}["k"], 5, CTX, "x")
    t0 = time.monotonic()
    with pytest.raises(DeadlineExpired, match=r"opening a FIFO did not finish within 0.3 s.*startup_timeout_s"):
        bounded(lambda: time.sleep(30), 0.3, CTX, "opening a FIFO")
    assert time.monotonic() - t0 < 3


def test_a_start_up_wait_names_startup_timeout_s():
    from rlx_mpi.lifecycle.faults import wait

    class Never:
        def Test(self):  # noqa: N802
            return False

    ctx = RankContext(rank=1, size=2, host="h")
    with pytest.raises(DeadlineExpired, match=r"raise \[run\] timeout_s$"):
        wait(Never(), 0.05, ctx, lambda: "x")
    ctx.extra["deadline_setting"] = "[run] startup_timeout_s"
    with pytest.raises(DeadlineExpired, match=r"raise \[run\] startup_timeout_s$"):
        wait(Never(), 0.05, ctx, lambda: "the probe of every rank")


def test_check_finite():
    check_finite(np.ones((2, 3), np.float32), "x", CTX)
    with pytest.raises(RankFault, match="2 non-finite values"):
        check_finite(np.array([1.0, np.nan, np.inf], np.float32), "the output of stage 0", CTX)


# -- validation at load ------------------------------------------------------------------------


@pytest.mark.parametrize("change, match", [
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps = -1e-06"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps = '1e-6'"),
    ({"rope_theta": 0.0}, "rope_theta = 0.0"),
    ({"rope_theta": float("nan")}, "rope_theta = nan"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings = 'false'"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings = 0"),
    ({"hidden_size": 64.0}, "hidden_size = 64.0 must be a positive integer"),
])
def test_llama_config_fields_are_typed(change, match):
    raw = {**dataclasses.asdict(PRESETS["tiny"]), **change}
    with pytest.raises(CheckpointError, match=match.replace("(", r"\(").replace(".", r"\.")):
        LlamaConfig.from_json(json.dumps(raw), "m.h5")


@pytest.mark.parametrize("text", ["null", "[]", "3", '"x"'])
def test_llama_config_must_be_an_object(text):
    with pytest.raises(CheckpointError, match="not a JSON object"):
        LlamaConfig.from_json(text, "m.h5")


@pytest.mark.parametrize("sections, match", [
    ({"placement": {"reserve_ram_gb": 1e300}}, "reserve_ram_gb: got 1e\\+300"),
    ({"run": {"timeout_s": 1e300, "startup_timeout_s": 1e300}}, "timeout_s: got 1e\\+300"),
    ({"run": {"batch": 2**40}}, "batch: got"),
    ({"rank": [{"rank": 0, "device": "cuda"}]}, "expected one of \\['cpu'\\]"),
    ({"rank": [{"rank": 0, "kv_cache": "fullest"}]}, "expected \"none\", \"full\" or \"window:W\""),
])
def test_absurd_or_unimplemented_job_values(tmp_path, sections, match):
    from rlx_mpi.config import tomllib

    raw = tomllib.loads(toml_text(model={"checkpoint": "m.h5"}, **sections))
    with pytest.raises(ConfigError, match=match):
        parse_job(raw, tmp_path / "job.toml")


def test_job_file_with_a_byte_order_mark_loads(tmp_path):
    from rlx_mpi.config import load_job

    path = tmp_path / "job.toml"
    path.write_bytes(b"\xef\xbb\xbf" + toml_text(model={"checkpoint": "m.h5"}).encode())
    assert load_job(path).model.checkpoint == tmp_path / "m.h5"


def test_planner_refuses_absurd_layer_counts():
    from rlx_mpi.cluster.caps import NodeCaps
    from rlx_mpi.config import PlacementPolicy
    from rlx_mpi.cluster.placement import plan_placement

    cfg = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=10**7)
    caps = [NodeCaps(rank=0, host="h", local_rank=0, local_size=1, cpus=None, ram_total_bytes=None,
                     ram_available_bytes=None, gflops=None)]
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="10000000 layers"):
        plan_placement(cfg.cost(1, 16), caps, PlacementPolicy.BALANCED)
    assert time.monotonic() - t0 < 1


# -- the supervisor on a plain process ---------------------------------------------------------

CHILD = """
import os, sys, time
from rlx_mpi.lifecycle import supervisor
supervisor.supervise()
what = sys.argv[1]
if what != "silent":
    supervisor.watch(1.0, "startup_timeout_s")
if what == "ready-exit0":
    supervisor.ready(); os._exit(0)
if what == "done-exit3":
    supervisor.ready(); supervisor.done(); os._exit(3)
if what.endswith("-term"):  # the launcher ends the job: SIGTERM to the supervisor, passed on
    supervisor.ready()
    if what == "code2-term":
        supervisor.exiting(2)
    elif what == "keep2-term":
        from rlx_mpi.lifecycle import launch
        launch._keep_exit_code(2)
    os.kill(os.getppid(), 15); time.sleep(20)
if what in ("stop", "silent"):
    os.kill(os.getpid(), 19)
if what == "in-mpi":
    supervisor.entering_mpi(); time.sleep(60)
os._exit(0)
"""


@pytest.mark.parametrize("what, status, line", [
    ("exit0", -9, "ended with exit status 0 before MPI start-up finished"),  # SIGKILL: the launcher must see it
    ("ready-exit0", -9, "ended with exit status 0 (pid"),  # after MPI_Init too: an exit code is not enough
    ("done-exit3", 3, None),
    ("ready-term", 128 + 15, None),  # a launcher's SIGTERM is not the rank's fault, and says so
    ("code2-term", 2, None),  # a rank dying of it after its failure code was decided keeps the code
    ("keep2-term", 2, None),  # and a rank in Python leaves with it at once (srun --kill-on-bad-exit)
    ("stop", -9, "stopped (SIGSTOP or SIGTSTP) during start-up and still stopped after 1 s ([run] startup_timeout_s)"),
    ("in-mpi", -9, "MPI start-up did not finish within 1 s"),
    ("silent", -9, "RLX_MPI_STARTUP_TIMEOUT_S, the start-up deadline before the job file is read"),
])
def test_supervisor_verdicts(what, status, line):
    env = {**os.environ, "PMI_RANK": "3", "RLX_MPI_STARTUP_TIMEOUT_S": "1.5"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", CHILD, what], capture_output=True, text=True, timeout=30, env=env)
    errors = [x for x in p.stderr.splitlines() if x.startswith("rlx-mpi: error:")]
    assert p.returncode == status, p.stderr
    if line is None:
        assert errors == [], p.stderr
    else:
        assert len(errors) == 1 and errors[0].startswith("rlx-mpi: error: rank 3 (") and line in errors[0], p.stderr
    assert time.monotonic() - t0 < 10


def test_the_launch_path_imports_no_numpy():
    """Everything a rank runs before and around its supervisor's fork, and the code that
    reports a failure, must work on a node whose numpy (numba, h5py) is broken or hangs on
    import: the package __init__ is lazy (PEP 562), faults imports numpy where it uses it."""
    code = ("import sys, rlx_mpi, rlx_mpi.cli, rlx_mpi.lifecycle.supervisor, rlx_mpi.lifecycle.faults, rlx_mpi.errors\n"
            "print(sorted(m for m in ('numpy', 'numba', 'h5py', 'mpi4py') if m in sys.modules))\n"
            "from rlx_mpi import Cluster, all_reduce, RlxError, plan_placement\n"
            "print(sorted(n for n in rlx_mpi.__all__ if not hasattr(rlx_mpi, n)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]", out  # nothing heavy imported
    assert out[1] == "[]", out  # and every public name still resolves


def test_a_launched_rank_lets_openblas_threads_sleep_soon():
    """launch.run sets OPENBLAS_THREAD_TIMEOUT before numpy loads (OpenBLAS reads it then; see
    launch.py's note: its spinning threads slowed the decode steps after a prefill), keeps a
    value the user set, and leaves the variable alone once numpy is loaded (it would be a lie)."""
    code = ("import os, sys, rlx_mpi.lifecycle.launch as l\n"
            "l._quiet_blas_threads(); print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))\n")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}

    def child(src, **extra):
        return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, check=True,
                              env={**env, **extra}).stdout.strip()

    assert child(code) == "20"
    assert child(code, OPENBLAS_THREAD_TIMEOUT="26") == "26"
    assert child("import numpy\n" + code) == "None"
