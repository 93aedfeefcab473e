"""Prefix reuse in the scheduler (`Scheduler` with a `BlockPool`), pure, no MPI: a simulated
stage runs every step's block ops on real arrays and checks that each position a step reads was
written with the right prefix; rows equal a run without the cache; a shared prefix is computed
once; a full pool evicts without breaking a row. The real-stage and MPI runs are in
test_prefix_cache_mpi.py."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from rlx_mpi.engine.block_pool import BlockPool
from rlx_mpi.model.kv_cache import ATTACH, SAVE
from rlx_mpi.engine.records import Request
from rlx_mpi.engine.scheduler import DECODE, MIXED, Scheduler, as_request


def _kv(seq) -> int:
    """What a real stage's K/V at the last position of ``seq`` depends on: every token up to it."""
    return zlib.crc32(np.asarray(seq, np.int64).tobytes()) + 1  # (0: never written)


class FakeStage:
    """A stage's slots and pool as arrays of `_kv` values, running a step as `DecodeRing._compute`
    runs it: the block ops' attaches, the step (reading every earlier position, which must hold
    the right value), then its saves. Counts the positions it computes."""

    def __init__(self, slots: int, max_seq: int, blocks: int, size: int):
        self.cache = np.zeros((slots, max_seq), np.int64)
        self.pool = np.zeros((max(blocks, 1), size), np.int64)
        self.size = size
        self.computed = 0

    def _check(self, slot: int, seq, upto: int) -> None:
        want = [_kv(seq[:p + 1]) for p in range(upto)]
        assert self.cache[slot, :upto].tolist() == want, f"slot {slot} holds the wrong prefix before {upto}"

    def run(self, step, ops) -> np.ndarray:
        B = self.size
        for op, slot, j, b in ops.tolist() if ops is not None else ():
            if op == ATTACH:
                self.cache[slot, j * B:(j + 1) * B] = self.pool[b]
        tokens = []
        for i, r in enumerate(step.rows):
            seq = r.prompt + tuple(r.new)
            if step.kind == DECODE or (step.kind == MIXED and i < step.n_decode):
                p = len(seq) - 1
                self._check(r.slot, seq, p)
                self.cache[r.slot, p] = _kv(seq)
                self.computed += 1
            else:
                end = min(step.start + step.T, len(seq))
                self._check(r.slot, seq, step.start)
                for p in range(step.start, end):
                    self.cache[r.slot, p] = _kv(seq[:p + 1])
                self.computed += end - step.start
            tokens.append(100 + _kv(seq) % 50)  # the next token depends on the whole sequence
        for op, slot, j, b in ops.tolist() if ops is not None else ():
            if op == SAVE:
                self.pool[b] = self.cache[slot, j * B:(j + 1) * B]
        return np.array(tokens, np.int64)


def run(prompts, *, pool: BlockPool | None, groups=1, batch=3, chunk=4, mixed=True, stages=1, new=3):
    """Stage 0's loop (`DecodeRing.drive`) over a `FakeStage`: (rows by id, positions computed, scheduler)."""
    s = Scheduler(prompts, groups=groups, batch=batch, max_new_tokens=new, eos_ids=frozenset(), recompute=False,
                  prefill_chunk=chunk, mixed=mixed, stages=stages, pool=pool)
    max_seq = max(len(as_request(p).tokens) for p in prompts) + new
    stage = FakeStage(groups * batch, max_seq, pool.capacity if pool else 0, pool.size if pool else 1)
    return drive(s, stage, groups), stage.computed, s


def drive(s, stage, groups: int) -> dict:
    """Issue every group's steps to ``stage`` (stage 0 computes as it issues) and complete them in
    order until the scheduler is idle: the rows' new tokens by (id, sample)."""
    from collections import deque

    fifo, done = deque(), []

    def issue(g):
        if (step := s.next_step(g)) is not None:
            step.tokens = stage.run(step, step.ops)
            fifo.append(step)

    for g in range(groups):
        issue(g)
    while fifo:
        step = fifo.popleft()
        done += s.complete(step, step.tokens)
        for g in [step.group, *range(groups)]:
            issue(g)
    assert s.idle, "the loop ended with prompts left"
    return {(r.id, r.sample): r.new for r in done}


def _prompts(n, shared, rng, extra=(2, 9)):
    pre = rng.integers(0, 500, shared).tolist()
    return [(i, f"p{i}", tuple(pre + rng.integers(0, 500, int(rng.integers(*extra))).tolist())) for i in range(n)]


@pytest.mark.parametrize("groups, batch, chunk, mixed, stages", [(1, 3, 4, True, 1), (2, 2, 4, True, 2),
                                                                  (3, 1, 2, True, 2), (1, 4, 0, False, 1),
                                                                  (2, 3, 5, False, 2)])
def test_rows_equal_a_run_without_the_cache_and_the_shared_prefix_is_computed_once(groups, batch, chunk, mixed,
                                                                                   stages):
    rng = np.random.default_rng(groups * 10 + batch)
    prompts = _prompts(10, 24, rng)
    want, computed_without, _ = run(prompts, pool=None, groups=groups, batch=batch, chunk=chunk, mixed=mixed,
                                    stages=stages)
    got, computed, s = run(prompts, pool=BlockPool(64, 4), groups=groups, batch=batch, chunk=chunk, mixed=mixed,
                           stages=stages)
    assert got == want
    # the 24 shared positions (6 blocks) are computed by the first row only: 9 x 24 fewer
    assert computed == computed_without - 9 * 24
    assert s.reused == 9 * 24 and s.prompt_tokens == sum(len(p[2]) for p in prompts)
    assert not s.pool.promised and all(s.pool.referenced(b) == 0 for b in s.pool.blocks)  # every row released


def test_n_samples_of_one_prompt_share_its_prefill():
    """A batch request's n samples are n rows of the same tokens: one prefills, the others attach
    every full block of it but the last position's (its logits are sampled per row)."""
    tokens = tuple(range(1, 19))  # 18 tokens: 4 full blocks of 4
    prompts = [Request(0, "r", tokens, sample=j, draw_id=f"r/{j}") for j in range(4)]
    _, computed, s = run(prompts, pool=BlockPool(16, 4), batch=4)
    assert s.reused == 3 * 16
    prompts = [Request(0, "r", tokens[:16], sample=j, draw_id=f"r/{j}") for j in range(3)]  # a whole number of blocks
    _, computed, s = run(prompts, pool=BlockPool(16, 4), batch=4)
    assert s.reused == 2 * 12  # the last block is recomputed: the last position must be


def test_a_small_pool_evicts_least_recent_blocks_and_rows_stay_right():
    """Two prefixes take turns through a pool too small for both: blocks no row references are
    evicted (the stage's checks would catch a row reading an overwritten block)."""
    rng = np.random.default_rng(3)
    a, b = _prompts(4, 16, rng), _prompts(4, 16, rng)
    prompts = [(i, f"x{i}", t) for i, (_, _, t) in enumerate([a[0], b[0], a[1], b[1], a[2], b[2], a[3], b[3]])]
    want, _, _ = run(prompts, pool=None, batch=2)
    pool = BlockPool(6, 4)
    got, _, s = run(prompts, pool=pool, batch=2)
    assert got == want
    assert pool.evictions > 0 and s.reused > 0


def test_a_pool_whose_blocks_are_all_referenced_publishes_nothing():
    rng = np.random.default_rng(4)
    prompts = _prompts(6, 12, rng)
    want, _, _ = run(prompts, pool=None, batch=3)
    got, _, s = run(prompts, pool=BlockPool(2, 4), batch=3)  # 3 shared blocks do not fit: 2 are cached
    assert got == want and s.reused == 5 * 8


def test_prompts_without_a_shared_prefix_compute_everything():
    rng = np.random.default_rng(5)
    prompts = [(i, f"r{i}", tuple(rng.integers(0, 500, 13).tolist())) for i in range(6)]
    want, computed_without, _ = run(prompts, pool=None)
    got, computed, s = run(prompts, pool=BlockPool(8, 4))
    assert got == want and computed == computed_without and s.reused == 0


def test_unrelated_prompts_are_not_held_behind_one_waiting_for_a_prefix():
    """p1 waits for p0's shared blocks (p0 prefills 40 positions, chunk 4: 10 steps); the unrelated
    p2 and p3 take the free slots meanwhile (out of file order), and p1 attaches once p0's blocks
    are in; rows still equal a run without the cache."""
    rng = np.random.default_rng(8)
    shared = tuple(rng.integers(0, 500, 40).tolist())
    prompts = [(0, "p0", shared + (1,)), (1, "p1", shared + (2,)),
               (2, "p2", tuple(rng.integers(0, 500, 6).tolist())), (3, "p3", tuple(rng.integers(0, 500, 5).tolist()))]
    want, _, _ = run(prompts, pool=None, batch=3, chunk=4)
    s = Scheduler(prompts, groups=1, batch=3, max_new_tokens=3, eos_ids=frozenset(), recompute=False,
                  prefill_chunk=4, mixed=True, pool=BlockPool(16, 4))
    s.next_step(0)
    assert [r.id if r else None for r in s.rows[0]] == ["p0", "p2", "p3"]  # p1 waits, p2 and p3 do not
    got, _, s = run(prompts, pool=BlockPool(16, 4), batch=3, chunk=4)
    assert got == want and s.reused == 40
