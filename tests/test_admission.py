"""The one admission path (`rlx_mpi.engine.admission`) without MPI: lookup, waiting on promised blocks,
attach/publish/release, and score's per-round plan (`plan_reuse`) replayed against a model of the
stages' pool: every ATTACH must read the tokens the row has at those positions, saved by an
earlier microbatch, however small the pool."""

import numpy as np
import pytest

from rlx_mpi.engine import admission
from rlx_mpi.engine.block_pool import BlockPool
from rlx_mpi.model.kv_cache import ATTACH, SAVE

B = 4  # positions per block: small numbers keep the cases readable


def test_lookup_attach_publish_release_round_trip():
    pool = BlockPool(8, B)
    a = tuple(range(10))  # 2 full blocks
    keys, ids, waits = admission.lookup(pool, a, cap=2)
    assert (ids, waits) == ([], None) and len(keys) == 2
    held, ops = admission.attach(pool, keys, ids, slot=3)
    assert ops == [] and pool.promised == {keys[0]: 1, keys[1]: 1}
    # a second prompt with the same start waits for the promised block
    assert admission.lookup(pool, a + (99,), cap=2)[2] == keys[0]
    saves = admission.publish(pool, held, a, 3, computed=5)  # block 0 done, block 1 not yet
    assert [op[:3] for op in saves] == [(SAVE, 3, 0)] and held.next_block == 1
    saves += admission.publish(pool, held, a, 3, computed=10)
    assert [op[:3] for op in saves] == [(SAVE, 3, 0), (SAVE, 3, 1)] and not pool.promised
    keys2, ids2, waits2 = admission.lookup(pool, a + (99,), cap=2)
    assert ids2 == [saves[0][3], saves[1][3]] and waits2 is None
    held2, ops2 = admission.attach(pool, keys2, ids2, slot=5)
    assert ops2 == [(ATTACH, 5, 0, ids2[0]), (ATTACH, 5, 1, ids2[1])] and pool.hits == 2 * B
    assert all(pool.referenced(b) == 1 for b in ids2)
    admission.release(pool, held2)
    assert all(pool.referenced(b) == 0 for b in ids2) and held2.blocks == []


def test_lookup_caps_what_is_attached_and_a_one_token_difference_misses():
    pool = BlockPool(8, B)
    a = tuple(range(12))
    held, _ = admission.attach(pool, *admission.lookup(pool, a, cap=3)[:2], slot=0)
    admission.publish(pool, held, a, 0, 12)
    assert admission.lookup(pool, a, cap=1)[1] == admission.lookup(pool, a, cap=3)[1][:1]
    b = (0, 1, 2, 3, 4, 5, 77) + a[7:]  # differs in block 1: only block 0 is shared
    assert len(admission.lookup(pool, b, cap=3)[1]) == 1


def _replay(plan, lines_of, capacity):
    """The stages' view: SAVE writes a row's block of tokens into the pool, ATTACH must read the
    row's own tokens there; returns the positions each line attached."""
    store = {}
    attached = {}
    for mb in plan:
        assert 0 <= mb.start and mb.width >= 1
        for op, slot, j, b in mb.ops:
            assert 0 <= b < capacity
            tokens = lines_of[mb.lines[slot]]
            if op == ATTACH:
                assert store.get(b) == tokens[j * B:(j + 1) * B], "an attach read another prefix's block"
                attached[mb.lines[slot]] = attached.get(mb.lines[slot], 0) + B
        for op, slot, j, b in mb.ops:
            if op == SAVE:
                tokens = lines_of[mb.lines[slot]]
                assert j * B >= mb.start  # a saved block is computed by this microbatch
                store[b] = tokens[j * B:(j + 1) * B]
        for slot, k in enumerate(mb.lines):
            assert attached.get(k, 0) == mb.start  # every row attaches up to the microbatch's start
    return attached


def _fewshot(rng, questions=3, answers=4, context=23):
    ctx = tuple(int(t) for t in rng.integers(0, 50, context))
    lines = []
    for q in range(questions):
        question = ctx + tuple(int(t) for t in rng.integers(0, 50, 5))
        for a in range(answers):
            lines.append((question + tuple(int(t) for t in rng.integers(0, 50, 2 + a)), len(question)))
    return lines


def test_a_shared_context_is_computed_once():
    lines = _fewshot(np.random.default_rng(0))
    pool = BlockPool(64, B)
    items = [(k, t, s) for k, (t, s) in enumerate(lines)]
    plan = admission.plan_reuse(items, pool, budget=64, per_round=2, max_rows=8)
    assert sorted(k for mb in plan for k in mb.lines) == list(range(len(lines)))  # each line once
    attached = _replay(plan, {k: t for k, t, _ in items}, 64)
    # the first line computes the 5 context blocks (23 tokens + 5 of its question: 7 blocks before
    # its scored tokens); its 3 siblings attach all 6 blocks before their scored token, the other
    # questions' lines the 5 blocks of the context
    assert attached.get(0, 0) == 0
    assert [attached[k] for k in (1, 2, 3)] == [6 * B] * 3
    assert all(attached[k] >= 5 * B for k in range(4, len(lines)))
    assert plan[0].lines[0] == 0 and plan[0].start == 0
    # a line never attaches a block holding its scored tokens' context after its first scored one
    assert all(attached.get(k, 0) <= s - 1 for k, (_, s) in enumerate(lines))


def test_lines_scoring_every_token_attach_nothing_but_publish():
    rng = np.random.default_rng(1)
    t = tuple(int(x) for x in rng.integers(0, 50, 20))
    pool = BlockPool(16, B)
    plan = admission.plan_reuse([(0, t, 1), (1, t + (3,), 1), (2, t + (4, 5), 18)], pool, 64, 2, 8)
    attached = _replay(plan, {0: t, 1: t + (3,), 2: t + (4, 5)}, 16)
    assert attached.get(0, 0) == attached.get(1, 0) == 0  # (start 1: position 0's logits are scored)
    assert attached[2] == 16  # (17 // 4 = 4 blocks before its first scored token)


@pytest.mark.parametrize("capacity", [1, 3, 7, 200])
def test_any_pool_size_plans_every_line_and_attaches_only_what_was_saved(capacity):
    rng = np.random.default_rng(capacity)
    pool = BlockPool(capacity, B)
    seen = []
    for r in range(4):  # rounds after rounds: the pool carries over
        lines = _fewshot(rng, questions=2, answers=3, context=int(rng.integers(4, 30)))
        items = [(100 * r + k, t, s) for k, (t, s) in enumerate(lines)]
        plan = admission.plan_reuse(items, pool, budget=int(rng.integers(8, 80)), per_round=3, max_rows=4)
        assert sorted(k for mb in plan for k in mb.lines) == [k for k, _, _ in items]
        assert all(len(mb.lines) <= 4 for mb in plan)
        seen.append(plan)
        _replay(plan, {k: t for k, t, _ in items}, capacity)
        assert not pool.promised and all(pool.referenced(b) == 0 for b in list(pool.blocks))


def test_the_round_budget_bounds_a_microbatch():
    lines = _fewshot(np.random.default_rng(3), questions=4, answers=4, context=40)
    plan = admission.plan_reuse([(k, t, s) for k, (t, s) in enumerate(lines)], BlockPool(128, B), budget=40,
                                per_round=2, max_rows=16)
    for mb in plan:
        assert len(mb.lines) == 1 or len(mb.lines) * mb.width <= 40


def test_bad_arguments():
    with pytest.raises(ValueError):
        admission.plan_reuse([(0, (1, 2), 1)], BlockPool(4, B), 0, 1, 1)


def test_short_suffixes_are_not_cut_below_min_tokens():
    """A round of short suffixes is not cut per_round ways into microbatches of a few rows each
    (each would read every weight once for little compute)."""
    lines = _fewshot(np.random.default_rng(4), questions=4, answers=4, context=40)
    items = [(k, t, s) for k, (t, s) in enumerate(lines)]
    pool = BlockPool(128, B)
    admission.plan_reuse(items[:1], pool, budget=1000, per_round=8, max_rows=16)  # the context is cached
    cut = admission.plan_reuse(items[1:], BlockPool(0, B), budget=1000, per_round=8, max_rows=16)
    whole = admission.plan_reuse(items[1:], pool, budget=1000, per_round=8, max_rows=16, min_tokens=1000)
    assert len(cut) >= 8
    # wave 1: question 0's 3 other answers (its blocks cached: 11 blocks), the first answer of
    # questions 1-3 (the context's 10 blocks: they compute their question's block); wave 2: the
    # 9 others, which attach it. A microbatch per attach level, none cut smaller
    assert [(len(mb.lines), mb.start) for mb in whole] == [(3, 44), (3, 40), (9, 44)]
