"""The decode ring's order as a pure loop (`rlx_mpi.engine.ring`) and the price of a step
(`rlx_mpi.model.cost.step_cost`), without MPI: the same loop the MPI driver runs, under a clock."""

from __future__ import annotations

import numpy as np
import pytest

from rlx_mpi.engine.records import Request, StepHeader
from rlx_mpi.engine.ring import ClockPipe, contexts, grid, priced, run_ring
from rlx_mpi.engine.scheduler import DECODE, MIXED, PREFILL, Scheduler
from rlx_mpi.families import get_family
from rlx_mpi.model.cost import Machine, step_cost


def _requests(n: int, seed: int = 0, longest: int = 12) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(i, f"p{i}", tuple(rng.integers(1, 40, int(rng.integers(1, longest)))),
                    max_new_tokens=int(rng.integers(1, 6))) for i in range(n)]


def _sched(reqs, groups=2, batch=4, stages=2):
    return Scheduler(reqs, groups=groups, batch=batch, max_new_tokens=5, eos_ids=frozenset(), recompute=False,
                     prefill_chunk=4, mixed=True, stages=stages)


def test_the_loop_finishes_every_row_in_issue_order_and_closes_with_the_stop_header():
    reqs = _requests(200)
    sched, order, closed = _sched(reqs), [], []

    class Fifo:  # a pipe that checks the ring's FIFO: tokens are asked in the order steps were issued
        def __init__(self):
            self.issued = []

        def issue(self, step):
            self.issued.append(step)

        def tokens(self, step):
            assert step is self.issued.pop(0), "a step completed out of issue order"
            order.append(StepHeader(step.header).kind)
            return np.array([7 + len(r.new) for r in step.rows], np.int64), None

        def close(self, stop):
            closed.append(StepHeader(stop))

    done = []
    assert run_ring(sched, Fifo(), done.extend, lambda: False) is False
    assert sorted(r.index for r in done) == list(range(200)) and sched.idle
    assert all(len(r.new) == r.request.max_new_tokens for r in done)
    assert {PREFILL, DECODE, MIXED} <= set(order) and len(closed) == 1 and closed[0].kind == 3  # STOP


def test_a_stop_request_drains_the_steps_in_flight_and_issues_no_more():
    sched, calls = _sched(_requests(50)), {"n": 0}
    pipe = ClockPipe(2, lambda h, s: 1.0)

    def stop_now():
        calls["n"] += 1
        return calls["n"] == 3

    done = []
    assert run_ring(sched, pipe, done.extend, stop_now) is True
    assert 0 < len(done) < 50 and sched.stopping


def test_the_clock_shows_the_pipeline_filled_by_groups():
    """Two stages of equal price: one group leaves each stage idle half the time (a step must come
    back before the group's next one); two groups keep both busy (the ring's reason for groups)."""
    def busy(groups: int) -> list[float]:
        sched = Scheduler(_requests(64, longest=3), groups=groups, batch=4, max_new_tokens=5, eos_ids=frozenset(),
                          recompute=False, stages=2)
        pipe = ClockPipe(2, lambda h, s: 1.0)
        run_ring(sched, pipe, lambda rows: None, lambda: False)
        return pipe.busy()

    one, two = busy(1), busy(2)
    assert max(one) <= 0.55 and min(two) >= 0.9, (one, two)


def test_a_steps_price_follows_the_model():
    """Decode reads every weight once whatever the rows (memory-bound at batch 1, its bytes the
    same at batch 8); FLOPs grow with the positions and attention with the context."""
    fam = get_family("llama")
    cfg = fam.presets["small"]
    c = fam.cost(cfg, 1, 512)
    L = cfg.num_hidden_layers
    one = step_cost(c, L, [(1, 100)], last=True)
    eight = step_cost(c, L, [(1, 100)] * 8, last=True)
    assert one.weight_bytes == eight.weight_bytes == L * c.layer_bytes + c.head_bytes
    dense = 2.0 * cfg.layer_params(active=True)
    assert one.flops == pytest.approx(L * (dense + 101 * c.attn_flops_per_pos) + c.head_flops_per_token)
    far = step_cost(c, L, [(1, 400)], last=True)
    assert far.flops - one.flops == pytest.approx(L * 300 * c.attn_flops_per_pos)
    assert far.kv_bytes == pytest.approx(one.kv_bytes * 401 / 101)
    prefill = step_cost(c, L, [(512, 0)], last=False)
    assert prefill.send_bytes == 512 * cfg.hidden_size * 4 and prefill.flops > 400 * one.flops
    m = Machine(gflops=100, gbps=20)
    assert one.seconds(m) == pytest.approx((one.weight_bytes + one.kv_bytes) / 20e9 + 8 / 5e9)  # bound by memory
    assert prefill.seconds(m) == pytest.approx(prefill.flops / 100e9 + prefill.send_bytes / 5e9)


def test_a_simulated_job_prices_each_step_by_its_rows():
    fam = get_family("llama")
    cfg = fam.presets["small"]
    L = cfg.num_hidden_layers
    cost = fam.cost(cfg, 1, 64)
    sched = _sched(_requests(32), stages=2)
    pipe = ClockPipe(2, priced(cost, [L // 2, L - L // 2], Machine()))
    run_ring(sched, pipe, lambda rows: None, lambda: False)
    assert sched.idle and pipe.now > 0 and len(pipe.events) % 2 == 0
    for e in pipe.events:  # each event priced as its step (a prefill chunk costs more than a decode of as many rows)
        assert e.end > e.start
    text = grid(pipe.events, 2)
    assert text.count("stage") == 2 and "0" in text and "1" in text


def test_contexts_read_the_header():
    h = StepHeader(StepHeader.make(MIXED, 0, 4, [0, 1, 2], [9, 6, 3], [1, 2, 3], [0, 0, 0], 64, start=4, n_decode=1))
    assert contexts(h) == [(1, 9), (2, 4), (1, 4)]  # (a row of 3 positions has none left: priced as one)
