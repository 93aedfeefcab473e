"""Score's order of rounds as a pure loop (`rlx_mpi.engine.rounds`), without MPI."""

from __future__ import annotations

from rlx_mpi.engine.rounds import RoundClock, run_rounds


def test_rounds_run_in_order_and_a_stop_ends_after_the_current_one():
    ran = []
    assert run_rounds(5, ran.append, lambda: False) == (False, 5) and ran == [0, 1, 2, 3, 4]
    ran.clear()
    assert run_rounds(5, ran.append, lambda: len(ran) == 2) == (True, 2) and ran == [0, 1]


def test_replicas_run_the_rounds_they_claim_and_a_stop_waits_for_one_round():
    claims, ran = iter([(False, 1), (True, 3), (False, 9)]), []
    assert run_rounds(5, ran.append, lambda: False, lambda: next(claims)) == (True, 1) and ran == [1]
    claims = iter([(True, 0), (False, 4), (False, 5)])
    assert run_rounds(5, ran.append, lambda: False, lambda: next(claims)) == (False, 2)


def test_a_round_runs_fill_drain_and_rounds_do_not_overlap():
    clock = RoundClock(2, lambda mb, s: 1.0, hop_s=0.0)
    assert clock.run([0, 1, 2]) == 4.0  # 3 microbatches over 2 stages: 3 + 1
    assert clock.run([0]) == 6.0
    assert [(e.stage, e.start) for e in clock.events[:4]] == [(0, 0.0), (1, 1.0), (0, 1.0), (1, 2.0)]
