"""Schedules as data, without MPI: the overlapped GPipe forward is deadlock-free under
rendezvous sends, posts receives ahead, and never reuses a buffer still in flight."""

import pytest

from rlx_mpi.comm.schedule import (COMPUTE, POST_RECV, POST_SEND, WAIT_RECV, WAIT_SEND, Action, ScheduleError,
                              forward_schedule, format_grid, simulate)


def forward(n_stages, microbatches, slots=2):
    return [forward_schedule(s, n_stages, microbatches, slots) for s in range(n_stages)]


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_forward_runs_and_every_microbatch_crosses_once(n_stages, microbatches, slots):
    steps = simulate(forward(n_stages, microbatches, slots))
    done = [a for step in steps for a in step]
    for s in range(n_stages):
        mine = [a for a in done if a.stage == s]
        assert [a.microbatch for a in mine if a.kind == COMPUTE] == list(range(microbatches))
        for kind, present in ((POST_RECV, s > 0), (WAIT_RECV, s > 0), (POST_SEND, s < n_stages - 1),
                              (WAIT_SEND, s < n_stages - 1)):
            assert sorted(a.microbatch for a in mine if a.kind == kind) == (list(range(microbatches)) if present else [])


@pytest.mark.parametrize("n_stages, microbatches", [(2, 4), (3, 3), (4, 8)])
def test_receives_posted_ahead_and_sends_waited_late(n_stages, microbatches):
    sched = forward_schedule(1, n_stages, microbatches)
    order = {(a.kind, a.microbatch): i for i, a in enumerate(sched)}
    for m in range(microbatches - 1):  # the next input is already posted while computing m
        assert order[(POST_RECV, m + 1)] < order[(COMPUTE, m)]
    if n_stages > 2:  # a send is waited only when its slot is needed again (or at the end)
        for m in range(microbatches - 2):
            assert order[(WAIT_SEND, m)] > order[(COMPUTE, m + 2)]
    # every receive is posted before the neighbour waits on the matching send: in the simulated
    # order, the receiver's post comes in an earlier or the same step as the sender's wait
    steps = simulate(forward(n_stages, microbatches))
    when = {(a.stage, a.kind, a.microbatch): t for t, step in enumerate(steps) for a in step}
    for s in range(n_stages - 1):
        for m in range(microbatches):
            assert when[(s + 1, POST_RECV, m)] <= when[(s, WAIT_SEND, m)]


def test_no_slot_reused_in_flight():
    # three receives in flight with two slots must be refused
    bad = [Action(1, POST_RECV, 0, 0, 0), Action(1, POST_RECV, 1, 1, 0), Action(1, POST_RECV, 2, 0, 0)]
    with pytest.raises(ScheduleError, match="slot 0 still holds"):
        simulate([[Action(0, COMPUTE, m) for m in range(3)], bad])
    # packing into a send slot whose previous send was not waited
    sends = [Action(0, COMPUTE, 0), Action(0, POST_SEND, 0, 0, 1), Action(0, COMPUTE, 1), Action(0, POST_SEND, 1, 0, 1)]
    with pytest.raises(ScheduleError, match="still in flight"):
        simulate([sends, forward_schedule(1, 2, 2)])


def test_deadlock_detected():
    # the receiver waits for microbatch 1 before posting 0's receive; the sender blocks on 0
    sender = [Action(0, COMPUTE, 0), Action(0, POST_SEND, 0, 0, 1), Action(0, WAIT_SEND, 0, 0, 1),
              Action(0, COMPUTE, 1), Action(0, POST_SEND, 1, 0, 1), Action(0, WAIT_SEND, 1, 0, 1)]
    receiver = [Action(1, POST_RECV, 1, 1, 0), Action(1, WAIT_RECV, 1, 1, 0), Action(1, POST_RECV, 0, 0, 0),
                Action(1, WAIT_RECV, 0, 0, 0)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([sender, receiver])


def test_compute_before_input_refused():
    recv = [Action(1, POST_RECV, 0, 0, 0), Action(1, COMPUTE, 0, 0), Action(1, WAIT_RECV, 0, 0, 0)]
    with pytest.raises(ScheduleError, match="before its input"):
        simulate([forward_schedule(0, 2, 1), recv])


def test_decode_ring_is_just_another_schedule():
    # last stage -> first stage carries tokens: a ring of 3 stages, 2 groups in flight, 3 steps;
    # stage 0 receives group g's token as microbatch m - groups and computes step m from it
    n, groups, steps = 3, 2, 3
    scheds = []
    for s in range(n):
        prev, nxt, acts, in_flight = (s - 1) % n, (s + 1) % n, [], {}
        for step in range(steps):
            for g in range(groups):
                m = step * groups + g
                if s > 0 or step > 0:
                    got = m if s > 0 else m - groups
                    acts += [Action(s, POST_RECV, got, g, prev), Action(s, WAIT_RECV, got, g, prev)]
                acts.append(Action(s, COMPUTE, m, g))
                if s < n - 1 or step < steps - 1:
                    if g in in_flight:  # the slot's previous send, waited only now
                        acts.append(Action(s, WAIT_SEND, in_flight.pop(g), g, nxt))
                    acts.append(Action(s, POST_SEND, m, g, nxt))
                    in_flight[g] = m
        acts += [Action(s, WAIT_SEND, m, g, nxt) for g, m in in_flight.items()]
        scheds.append(acts)
    steps_done = simulate(scheds)  # raises on deadlock or buffer misuse
    assert sum(a.kind == COMPUTE for st in steps_done for a in st) == n * groups * steps


def test_grid_shows_overlap():
    grid = format_grid(3, 4, slots=2)
    rows = grid.splitlines()
    assert len(rows) == 3 and rows[1].split()[2] == "1pR0,1pR1"
    # stage 0 computes microbatch 1 while stage 1 waits for / computes microbatch 0
    assert "0pS0,0F1" in rows[0]
