"""Helpers shared by several test files (conftest.py has the CLI runners and `write_job`).

    job_builder(run_defaults)  a ``job(d, ckpt, run=None, placement=None, model=None, name=..., **sections)``
                               that writes a job of checkpoint ``ckpt``: ``run_defaults`` under
                               ``run``, ``reserve_ram_gb = 0`` under ``placement``
    faulty_ckpt                module fixture: a checkpoint of tests/faulty_family.py (import it
                               into the test module: ``from helpers import faulty_ckpt``)
    rows_of(path)              the JSON rows of a JSON-lines file (completions), blank lines skipped
    pids_matching(needle)      pids whose command line contains ``needle`` (pgrep -f), not this one
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from conftest import write_job

__all__ = ["job_builder", "faulty_ckpt", "rows_of", "pids_matching"]

PLACE = {"reserve_ram_gb": 0.0}


def job_builder(run_defaults: dict) -> Callable[..., Path]:
    def job(d: Path, ckpt, run=None, placement=None, model=None, name: str = "job.toml", **extra) -> Path:
        return write_job(d, name, model={"checkpoint": str(ckpt), **(model or {})}, run={**run_defaults, **(run or {})},
                         placement={**PLACE, **(placement or {})}, **extra)

    return job


@pytest.fixture(scope="module")
def faulty_ckpt(tmp_path_factory) -> Path:
    import faulty_family

    return faulty_family.write_checkpoint(tmp_path_factory.mktemp("faulty") / "faulty.h5")


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_bytes().split(b"\n") if line.strip()]


def pids_matching(needle: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", str(needle)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]
