"""``on_rank_failure`` without MPI: the key, the tolerant supervisor, the test hook, and the
bookkeeping that returns a dead replica's rows to the pool (`comm.recovery`, on a fake counter).
The real thing under Open MPI with ULFM: tests/test_ulfm_mpi.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlx_mpi.comm.recovery import RecoveringCollector, RefillFeed
from rlx_mpi.config import OnRankFailure, parse_job
from rlx_mpi.errors import ConfigError
from rlx_mpi.lifecycle.faults import RankContext
from rlx_mpi.lifecycle.hooks import TestHooks

JOB = Path("/tmp/j.toml")


def test_on_rank_failure_key():
    assert parse_job({"model": {"checkpoint": "m.h5"}}, JOB).run.on_rank_failure is OnRankFailure.ABORT
    job = parse_job({"model": {"checkpoint": "m.h5"}, "run": {"on_rank_failure": "continue"}}, JOB)
    assert job.run.on_rank_failure is OnRankFailure.CONTINUE
    with pytest.raises(ConfigError) as e:
        parse_job({"model": {"checkpoint": "m.h5"}, "run": {"on_rank_failure": "retry"}}, JOB)
    assert "[run] on_rank_failure" in e.value.line() and "'retry'" in e.value.line() and "'continue'" in e.value.line()


def test_kill_hook_parses():
    hooks = TestHooks.from_env({"RLX_MPI_TEST_KILL": "3:1.5,1:4:stop"})
    assert hooks.kill_after == ((3, 1.5, "KILL"), (1, 4.0, "STOP"))
    assert TestHooks.from_env({}).kill_after == ()


CHILD = """
import os, sys
from rlx_mpi.lifecycle import supervisor
supervisor.supervise()
supervisor.watch(30.0, "startup_timeout_s")
if sys.argv[1] != "before-ready":
    supervisor.ready()
supervisor.tolerate()
import time; time.sleep(0.2)
os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("when, status", [("after-ready", 0), ("before-ready", -9)])
def test_a_tolerant_supervisor_exits_0_quietly_when_its_rank_dies(when, status):
    """Under ULFM the launcher tells the survivors only of an exit 0 or a death by signal; before
    MPI is up a death still ends the job, named."""
    env = {**os.environ, "PMI_RANK": "3"}
    p = subprocess.run([sys.executable, "-c", CHILD, when], capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == status, p.stderr
    errors = [x for x in p.stderr.splitlines() if x.startswith("rlx-mpi: error:")]
    assert (errors == []) if status == 0 else (len(errors) == 1 and "died of SIGKILL" in errors[0]), p.stderr


class FakeCounter:
    """`RefillCounter`'s calls on plain lists (one process)."""

    def __init__(self):
        self.count, self.ret = 0, []

    def post(self, n):
        start, self.count = self.count, self.count + n
        return start

    def take(self, claim):
        return claim

    def filled(self):
        return len(self.ret)

    def returned(self, start, count):
        return np.array(self.ret[start:start + count], np.int64)

    def read(self, slot, count=1):
        return np.array([self.count if slot == 0 else len(self.ret)], np.int64)

    def append(self, at, rows):
        assert at == len(self.ret)
        self.ret += rows


def test_a_feed_holds_its_claim_past_the_end_until_rows_come_back():
    counter, claims = FakeCounter(), []
    feed = RefillFeed(counter, list("abcdefghij"), 4, lambda lo, hi: claims.append((lo, hi)))
    assert feed() == list("abcd") and feed() == list("efgh") and feed() == list("ij")
    assert feed() == [] and feed.held == [10, 12]  # positions 10, 11: nothing returned yet
    counter.append(0, [-1, 5])  # position 10 skipped (a dead replica held it), 11 is row 5 again
    assert feed() == ["f"] and feed.held is None
    assert claims == [(0, 4), (4, 8), (8, 12)]


def test_a_dead_replicas_unwritten_rows_and_unreported_claims_go_back(capsys):
    counter = FakeCounter()
    c = RecoveringCollector(None, RankContext(0, 6), 10.0, [[0, 1], [2, 3], [4, 5]], counter, list(range(10)),
                            lambda src, doc: None, lambda item: item)
    assert all(c.fresh(i) for i in (0, 1, 2, 4)) and not c.fresh(2)  # written (once)
    for replica, lo, hi in ((0, 0, 2), (1, 2, 4), (0, 4, 6), (1, 6, 8), (2, 10, 12)):
        c.took(replica, lo, hi)
    counter.count = 12  # positions 8, 9: claimed, not reported yet (a replica's claim in flight)
    c.failed([3])
    # replica 1's 3, 6, 7 and the unreported 8, 9; position 10, 11 (past the rows, replica 2's) stay
    assert counter.ret == [3, 6, 7, 8, 9] and c.broken == {1}
    line = capsys.readouterr().err.strip()
    assert line == ("rlx-mpi: warning: rank 3 died (replica 1); 5 unfinished prompt rows go back to the pool; "
                    "replicas 0, 2 left")
    assert c._has_work([10, 12])  # replica 2's held positions now hold rows 3 and 6
    # replica 2 dies holding positions 10, 11 (rows 3, 6), 12, 13 (rows 7, 8) and 16, 17 (not filled
    # yet: skipped when they are); 14 and 15 were claimed, not reported (row 9; 15 not filled yet)
    c.took(2, 12, 14)
    c.took(2, 16, 18)
    counter.count = 18
    c.fresh(7)
    c.failed([4, 5])
    assert counter.ret == [3, 6, 7, 8, 9, -1, -1, -1, 3, 6, 8, 9] and c.broken == {1, 2}
    assert "ranks 4, 5 died (replica 2); 4 unfinished prompt rows go back to the pool; replica 0 left" in \
        capsys.readouterr().err
    c.failed([3])  # known: nothing again
    assert len(counter.ret) == 12


def test_which_deaths_end_the_layout():
    """One death ends a layout whose replicas do not refill; with refilling replicas, rank 0 or
    a death in every replica does (`ulfm.deadly`: the watch and the restart agree on it)."""
    from rlx_mpi.lifecycle.ulfm import deadly

    assert not deadly([], None) and deadly([2], None)
    reps = [[0, 1], [2, 3], [4, 5]]
    assert not deadly([3], reps) and not deadly([3, 5], reps)
    assert deadly([0], reps) and deadly([1, 3, 4], reps)


def test_the_job_for_the_survivors():
    """A fixed replicas is cut to the most that divide the survivors; [[rank]] sections refuse."""
    from rlx_mpi.cluster.restart import job_on_survivors

    job = parse_job({"model": {"checkpoint": "m.h5"}, "placement": {"replicas": 2}}, JOB)
    assert job_on_survivors(job, 3).placement.replicas == 1
    assert job_on_survivors(job, 2).placement.replicas == 2
    auto = parse_job({"model": {"checkpoint": "m.h5"}, "placement": {"replicas": "auto"}}, JOB)
    assert job_on_survivors(auto, 3) is auto
    pinned = parse_job({"model": {"checkpoint": "m.h5"}, "rank": [{"rank": 1, "precision": "bf16"}]}, JOB)
    with pytest.raises(ConfigError) as e:
        job_on_survivors(pinned, 3)
    assert "[[rank]]" in e.value.line() and "numbered again" in e.value.line()
