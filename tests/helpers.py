"""Helpers shared by several test files (conftest.py has the CLI runners and `write_job`).

    job_builder(run_defaults)  a ``job(d, ckpt, run=None, placement=None, model=None, name=..., **sections)``
                               that writes a job of checkpoint ``ckpt``: ``run_defaults`` under
                               ``run``, ``reserve_ram_gb = 0`` under ``placement``
    faulty_ckpt                module fixture: a checkpoint of tests/faulty_family.py (import it
                               into the test module: ``from helpers import faulty_ckpt``)
    rows_of(path)              the JSON rows of a JSON-lines file (completions), blank lines skipped
    pids_matching(needle)      pids whose command line contains ``needle`` (pgrep -f), not this one
    gone_within(needle, s)     [] once no such process is left, else the pids still there after ``s``
                               seconds (the launcher's SIGKILLs are asynchronous: poll, don't sleep)
    LaunchAhead                a module's CLI runs started ahead of the tests that check them, two at
                               a time (see its docstring); the tests still make every assertion
    in_pairs(*thunks)          one test's independent runs, two at a time: their results in order
    bf16_read(x)               float64 x as the bf16 products read it: rounded to bf16 on a CPU with
                               AVX512-BF16, every row and column (rowdot's bf16 dot note); otherwise
                               x as it is
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Callable

import pytest

from conftest import write_job

__all__ = ["job_builder", "faulty_ckpt", "rows_of", "pids_matching", "gone_within", "LaunchAhead", "in_pairs"]

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


def gone_within(needle: str, grace_s: float) -> list[int]:
    """[] as soon as no process's command line contains ``needle``; else, after ``grace_s``
    seconds of polling, the pids still there (a process that outlives the grace is a leftover,
    as it was after the fixed sleep this replaces; an empty list no longer waits the grace out)."""
    deadline = time.monotonic() + grace_s
    while (pids := pids_matching(needle)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pids


def leftovers_killed(folder, grace_s: float = 0.3) -> list[int]:
    """Processes (ranks, supervisors, the launcher) whose command line names a case's ``folder``
    after a polled grace (the launcher's SIGKILLs are asynchronous): killed, and returned so
    the test fails naming them."""
    pids = gone_within(str(folder), grace_s)
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return pids


class LaunchAhead:
    """The CLI runs of a module's tests, started ahead of the tests, ``workers`` at a time.

    A run under ``mpiexec`` spends most of its ~2 s starting up (interpreter, imports, numba
    cache loads, MPI wire-up), mostly on one core per rank: two runs at once finish sooner than
    one after the other on 2 cores. Only for runs whose tests check results, never times or
    deadlines (those stay in the tests, launched alone). ``launch(item)`` is called in a worker
    thread, in the session's order of the selected tests, and returns whatever its test needs
    (typically the CompletedProcess and the paths); ``result(request)`` waits for the test's
    own run and returns that, or raises what the launch raised (a timeout fails that test).
    """

    def __init__(self, items, launch: Callable, workers: int = 2, key: Callable = lambda item: item.nodeid):
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="launch-ahead")
        self._futures = {key(item): self._pool.submit(launch, item) for item in items}

    def result(self, request):
        return self._futures[request.node.nodeid].result()

    def get(self, key):
        """The result of the run started for ``key`` (with ``key=`` other than the node id)."""
        return self._futures[key].result()

    def drain(self) -> None:
        """Wait until no run is in flight (before a test that times a run of its own)."""
        futures_wait(list(self._futures.values()))

    def close(self) -> None:
        for f in self._futures.values():
            f.cancel()
        self._pool.shutdown(wait=True)

    @classmethod
    def fixture_items(cls, request, *names: str) -> list:
        """The selected tests of ``request``'s module whose function is one of ``names``."""
        return [i for i in request.session.items if i.module is request.module and i.originalname in names]


def in_pairs(*thunks: Callable) -> list:
    """Call ``thunks`` two at a time (independent CLI runs, start-up bound, of one test whose
    checks are of results, not times); their results in order, or the first exception raised.
    Runs at once must not share a file they write (give each its own job file and output)."""
    with ThreadPoolExecutor(2, thread_name_prefix="in-pairs") as pool:
        futures = [pool.submit(t) for t in thunks]
        return [f.result() for f in futures]


def bf16_read(x):
    """float64 ``x`` (R, K) as the bf16 products multiply it (rowdot's bf16 dot note)."""
    import numpy as np

    from rlx_mpi.kernels import from_bf16, to_bf16
    from rlx_mpi.kernels.rowdot import BF16_DOT

    if BF16_DOT:
        return from_bf16(to_bf16(np.ascontiguousarray(x, dtype=np.float32))).astype(np.float64)
    return x.astype(np.float64)
