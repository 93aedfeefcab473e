"""Which Python the shipped sbatch scripts run (issue 17, finding 5), without a Slurm.

The scripts run under bash with a stand-in ``srun`` that prints its command line, so what is
checked is the script's own choice: RLX_PYTHON, else ./.venv of the submit folder, else the
environment activated before sbatch (VIRTUAL_ENV), else python3 on PATH; the log names it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["run", "generate"]


def shim(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def python_at(folder: Path) -> Path:
    """A Python at ``folder``/python that is this test's (which has rlx_mpi)."""
    return shim(folder, "python", f'exec "{sys.executable}" "$@"')


def sbatch(script: str, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    tools = tmp_path / "tools"
    shim(tools, "srun", 'echo "srun $*"')
    shim(tools, "scontrol", "true")
    args = ["job.toml"] if script == "run" else ["job.toml", "p.jsonl", "c.jsonl"]
    base = {"PATH": f"{tools}:/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(tmp_path / "submit"), "SLURM_JOB_ID": "7",
            "HOME": str(tmp_path)}
    (tmp_path / "submit").mkdir(exist_ok=True)
    return subprocess.run([shutil.which("bash"), str(REPO / "slurm" / f"{script}.sbatch"), *args], env={**base, **env},
                          capture_output=True, text=True, timeout=60)


def ran_with(p: subprocess.CompletedProcess) -> str:
    line = next(x for x in p.stdout.splitlines() if x.startswith("srun "))
    return line.split()[3]  # srun --kill-on-bad-exit=N --mpi=M PY -m rlx_mpi ...


@pytest.fixture(autouse=True)
def _bash():
    if shutil.which("bash") is None:
        pytest.skip("no bash")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_activated_environment_is_used(tmp_path, script):
    venv = tmp_path / "env"
    py = python_at(venv / "bin")
    p = sbatch(script, tmp_path, {"VIRTUAL_ENV": str(venv)})
    assert p.returncode == 0, p.stderr
    assert ran_with(p) == str(py) and f"rlx-mpi: python {py} (the activated environment, VIRTUAL_ENV)" in p.stdout


def test_python3_on_path_then_dot_venv_first(tmp_path):
    bin_ = tmp_path / "bin"
    shim(bin_, "python3", f'exec "{sys.executable}" "$@"')
    p = sbatch("run", tmp_path, {"PATH": f"{tmp_path / 'tools'}:{bin_}:/usr/bin:/bin"})
    assert p.returncode == 0 and ran_with(p) == str(bin_ / "python3"), p.stdout + p.stderr
    assert "(python3 on PATH)" in p.stdout
    dot = python_at(tmp_path / "submit" / ".venv" / "bin")
    venv = tmp_path / "env"
    python_at(venv / "bin")
    p = sbatch("run", tmp_path, {"VIRTUAL_ENV": str(venv)})
    assert p.returncode == 0 and ran_with(p) == str(dot) and "(./.venv of the submit folder)" in p.stdout, p.stdout


def test_a_wrong_rlx_python_is_one_line_and_no_fallback(tmp_path):
    venv = tmp_path / "env"
    python_at(venv / "bin")  # would work, but RLX_PYTHON was asked for
    p = sbatch("generate", tmp_path, {"RLX_PYTHON": str(tmp_path / "nope" / "python"), "VIRTUAL_ENV": str(venv)})
    errors = [x for x in p.stderr.splitlines() if x.startswith("rlx-mpi: error:")]
    assert p.returncode == 2 and len(errors) == 1 and "srun" not in p.stdout, p.stdout + p.stderr
    assert f"tried {tmp_path / 'nope' / 'python'})" in errors[0] and "set RLX_PYTHON" in errors[0]


def test_no_python_with_rlx_mpi_is_one_line(tmp_path):
    bin_ = tmp_path / "bin"
    shim(bin_, "python3", "exit 1")  # a python3 without rlx_mpi
    p = sbatch("run", tmp_path, {"PATH": f"{tmp_path / 'tools'}:{bin_}"})
    errors = [x for x in p.stderr.splitlines() if x.startswith("rlx-mpi: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stdout + p.stderr
    assert f"tried {tmp_path}/submit/.venv/bin/python {bin_}/python3)" in errors[0]
    assert "activate the environment before sbatch" in errors[0]
