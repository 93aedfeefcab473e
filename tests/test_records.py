"""The row as a record (`rlx_mpi.engine.records`): a `Request` through the broadcast, the step
header read by name, and the row lifecycle: the headers' admitted / ended events create and free
each row's state on a stage, in step order, so nothing is left after any number of rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlx_mpi.engine.block_pool import BlockPool, chain_keys
from rlx_mpi.engine.records import ADMITTED, Request, RowState, RowTable, StepHeader
from rlx_mpi.engine.sampling import SamplingParams, prompt_key, sample_id
from rlx_mpi.engine.scheduler import DECODE, MIXED, PREFILL, Scheduler


def test_a_request_survives_the_broadcast_as_plain_json():
    r = Request(3, "q", (5, 6, 7), sample=2, draw_id=sample_id("q", 2), max_new_tokens=9, stop=("\n",),
                sampling=SamplingParams(0.7, 40, 0.9, 1), adapter="math")
    back = Request.from_wire(json.loads(json.dumps(r.to_wire())))
    assert back == r and back.key == prompt_key(sample_id("q", 2))
    plain = Request(0, "a", (1,))
    assert plain.to_wire() == {"index": 0, "id": "a", "tokens": [1]} and Request.from_wire(plain.to_wire()) == plain
    assert plain.key == prompt_key("a") and plain.kv_salt == b"" and r.kv_salt != b""
    # a constraint inline, or through the broadcast's table (a schema shared by many rows travels once)
    from rlx_mpi.engine.constraints import Constraint

    c = Constraint("json", {"type": "object", "properties": {"b": {}, "a": {}}})
    with_c = Request(1, "c", (2,), constraint=c)
    assert Request.from_wire(json.loads(json.dumps(with_c.to_wire()))) == with_c
    table = {c.key: 0}
    wire = [with_c.to_wire(table), Request(2, "d", (3,), constraint=c).to_wire(table)]
    assert [w["constraint"] for w in wire] == [0, 0]
    back = [Request.from_wire(w, [Constraint.from_json(json.loads(json.dumps(c.to_json())))]) for w in wire]
    assert back[0] == with_c and list(back[1].constraint.value["properties"]) == ["b", "a"]  # (order kept)


def test_the_header_is_read_by_name():
    h = StepHeader.make(MIXED, 1, 4, [3, 5], [9, 2], [11, 12], [4, 0], StepHeader.size(2, 3), start=4, n_decode=1,
                        n_ops=2, admitted=[False, True], ended=[77, 78])
    v = StepHeader(h)
    assert (v.kind, v.group, v.n, v.T, v.start, v.n_decode, v.n_ops, v.n_ended) == (MIXED, 1, 2, 4, 4, 1, 2, 2)
    assert v.slots.tolist() == [3, 5] and v.lengths.tolist() == [9, 2] and v.keys.tolist() == [11, 12]
    assert v.index.tolist() == [4, 0] and v.admitted.tolist() == [12] and v.ended.tolist() == [77, 78]
    with pytest.raises(ValueError, match="does not fit"):
        StepHeader.make(DECODE, 0, 1, [1, 2], [0, 0], [1, 2], [0, 0], StepHeader.size(2, 0), ended=[5])


def _drive(sched: Scheduler, stages: list[RowTable], vocab: int = 50, seen: list | None = None) -> int:
    """Stage 0's loop over a pure scheduler: every issued header goes through each stage's table
    in issue order (as the ring delivers them); the last table samples. Returns the steps run."""
    steps = 0
    in_flight = []
    for g in range(sched.groups):
        if (s := sched.next_step(g)) is not None:
            in_flight.append(s)
    while in_flight:
        step = in_flight.pop(0)
        h = StepHeader(step.header)
        for t in stages:
            t.on_header(h)
        last = stages[-1]
        for k in h.keys.tolist():  # every row of a step has its state on the stage that samples it
            assert last.get(k) is not None, f"row {k} sampled without its state"
        if seen is not None:
            seen.append(len(last))
        logits = np.zeros((h.n, vocab), np.float32)
        logits[np.arange(h.n), (h.keys % vocab)] = 1.0
        tokens = last.sample(logits, h, SamplingParams())
        sched.complete(step, tokens)
        steps += 1
        for g in range(sched.groups):
            if (s := sched.next_step(g)) is not None:
                in_flight.append(s)
    stop = StepHeader(sched.stop_header())
    for t in stages:
        t.on_header(stop)
    return steps


def test_ten_thousand_rows_leave_no_state_on_any_stage():
    """Rows born and freed by the header events on every stage: after 10,000 rows (mixed steps,
    chunked prefill, two groups, rows ending at different steps) no stage holds a row."""
    rng = np.random.default_rng(0)
    prompts = [Request(i, f"p{i}", tuple(rng.integers(1, 40, int(rng.integers(1, 9)))),
                       max_new_tokens=int(rng.integers(1, 4))) for i in range(10_000)]
    sched = Scheduler(prompts, groups=2, batch=8, max_new_tokens=3, eos_ids=frozenset(), recompute=False,
                      prefill_chunk=4, mixed=True, stages=2)
    tables = [RowTable(), RowTable()]
    seen: list[int] = []
    _drive(sched, tables, seen=seen)
    assert sched.idle and max(seen) <= 2 * 8 * 2  # (a rider's rows beside a group's own)
    for t in tables:
        assert len(t) == 0 and t.admitted == t.ended == 10_000 and t.own_sampling == {}


def test_a_rows_own_sampling_and_processor_live_with_it():
    """The last stage's state of a row is made from its record when admitted: its own sampling
    and a logits processor (the hook a grammar mask fills) apply to it alone, and go when it ends."""
    own = {prompt_key("b"): SamplingParams(0.9, 0, 1.0, 3)}
    forced = {}

    def make(key):
        state = RowState(key, own.get(key))
        if key == prompt_key("c"):  # a processor that allows only token 7
            def mask(row, index):
                forced[index] = True
                keep = row[7]
                row[:] = -np.inf
                row[7] = keep
            state.processor = mask
        return state

    table = RowTable(make)
    sched = Scheduler([Request(0, "a", (1, 2)), Request(1, "b", (3,)), Request(2, "c", (4, 5))], groups=1, batch=3,
                      max_new_tokens=3, eos_ids=frozenset(), recompute=False)
    rows = {}
    while not sched.idle:
        step = sched.next_step(0)
        h = StepHeader(step.header)
        table.on_header(h)
        if h.kind == PREFILL:
            assert set(h.admitted.tolist()) == {prompt_key(x) for x in "abc"}
            assert set(table.own_sampling) == {prompt_key("b")}
        logits = np.tile(np.arange(20, dtype=np.float32), (h.n, 1))  # argmax 19 for a greedy row
        for r in sched.complete(step, table.sample(logits, h, SamplingParams())):
            rows[r.id] = r.new
    table.on_header(StepHeader(sched.stop_header()))
    assert rows["a"] == [19, 19, 19] and rows["c"] == [7, 7, 7] and sorted(forced) == [0, 1, 2]
    assert len(table) == 0 and table.own_sampling == {}


def test_an_end_without_an_admission_is_an_error():
    t = RowTable()
    t.admit(5)
    t.admit(5)  # two live rows of one key: freed with the second end
    t.end(5)
    assert t.get(5) is not None
    t.end(5)
    assert t.get(5) is None
    with pytest.raises(KeyError, match="never admitted"):
        t.end(5)


def test_ended_keys_beyond_a_headers_room_ride_in_the_next():
    """Rows ending together are told in the next headers, none dropped: a header has room for one
    key per slot, so the keys go out in order over as many headers as it takes."""
    sched = Scheduler([Request(i, f"r{i}", (1,)) for i in range(6)], groups=1, batch=2, max_new_tokens=1,
                      eos_ids=frozenset(), recompute=False)
    told = []
    while not sched.idle:
        step = sched.next_step(0)
        h = StepHeader(step.header)
        told += h.ended.tolist()
        assert h.n_ended <= sched.ended_room and (h.rows[:, 4] & ADMITTED).all()  # each row's only step
        sched.complete(step, np.zeros(h.n, np.int64))
    told += StepHeader(sched.stop_header()).ended.tolist()
    assert told == [prompt_key(f"r{i}") for i in range(6)]


def test_prefix_keys_start_from_the_rows_salt():
    """Two rows of the same tokens and different salts (an adapter) share no cached block; the
    empty salt keeps the keys of before."""
    tokens = tuple(range(1, 17))
    a, b = chain_keys(tokens, 4, b"adapter\x00x"), chain_keys(tokens, 4, b"adapter\x00y")
    assert not set(a) & set(b) and chain_keys(tokens, 4) == chain_keys(tokens, 4, b"")
    pool = BlockPool(8, 4)
    plain = Request(0, "p", tokens)
    salted = Request(1, "q", tokens, adapter="x")
    sched = Scheduler([plain, salted], groups=1, batch=1, max_new_tokens=1, eos_ids=frozenset(), recompute=False,
                      prefill_chunk=4, pool=pool)
    while not sched.idle:
        step = sched.next_step(0)
        sched.complete(step, np.zeros(StepHeader(step.header).n, np.int64))
    assert sched.reused == 0  # the second row attached nothing of the first's blocks
    again = Scheduler([Request(2, "r", tokens, adapter="x")], groups=1, batch=1, max_new_tokens=1,
                      eos_ids=frozenset(), recompute=False, prefill_chunk=4, pool=pool)
    while not again.idle:
        step = again.next_step(0)
        again.complete(step, np.zeros(StepHeader(step.header).n, np.int64))
    assert again.reused == 12  # the same salt shares the blocks (all but the last position's)


def test_a_stage_gets_the_step_as_one_record():
    """`run_step` hands a `Stage` the whole `StepBatch` (a family may override `Stage.step`); its
    default, and a stage written only to the Protocol, get the same calls by the step's kind."""
    from rlx_mpi.model.stage import Stage, StepBatch, run_step

    calls = []

    class Rec:  # only the Protocol's methods (no Stage base)
        def decode(self, x, slots, pos):
            calls.append(("decode", slots.tolist(), pos.tolist()))
            return x

        def prefill(self, x, slots, lengths, start=0):
            calls.append(("prefill", slots.tolist(), lengths.tolist(), start))
            return x

        def block_ops(self, ops, before):
            calls.append(("ops", before))

    class Whole(Stage):
        layers, first, last, weight_bytes = range(0, 1), True, True, 0

        def forward(self, x):
            return x

        def step(self, x, batch):
            calls.append(("whole", batch.kind, batch.keys.tolist()))
            return x

    h = StepHeader(StepHeader.make(PREFILL, 0, 4, [2, 3], [9, 6], [11, 12], [0, 0], 64, start=4))
    x = np.zeros((2, 4))
    run_step(Rec(), x, h.batch(np.zeros((1, 4), np.int64)))
    assert calls == [("ops", True), ("prefill", [2, 3], [9, 6], 4), ("ops", False)]
    calls.clear()
    run_step(Rec(), x, StepHeader(StepHeader.make(DECODE, 0, 1, [5], [7], [1], [3], 64)).batch())
    assert calls == [("decode", [5], [7])]
    calls.clear()
    run_step(Whole(), x, h.batch())
    assert calls == [("whole", "prefill", [11, 12])] and isinstance(h.batch(), StepBatch)
