"""The prefix cache's bookkeeping (`rlx_mpi.engine.block_pool`): hash-chain keys, reference counts,
LRU eviction under a full pool. Pure, no MPI."""

from __future__ import annotations

import pytest

from rlx_mpi.engine.block_pool import BlockPool, chain_keys


def _fill(pool: BlockPool, tokens) -> list[int]:
    """Publish every full block of ``tokens`` (as a row's prefill does); their ids."""
    keys, out, parent = pool.keys(tokens), [], b""
    for j, k in enumerate(keys):
        b = pool.publish(k, tokens[j * pool.size:(j + 1) * pool.size], parent)
        out.append(b)
        parent = k
    return out


def test_chain_keys_name_the_whole_prefix():
    a = list(range(40))
    ka = chain_keys(a, 8)
    assert len(ka) == 5 and len(set(ka)) == 5  # only full blocks; every key distinct
    assert chain_keys(a[:39], 8) == ka[:4]  # a partial block has no key
    b = a.copy()
    b[3] = 99  # one token of block 0 differs: every key from block 0 on differs
    assert all(x != y for x, y in zip(chain_keys(b, 8), ka))
    c = a.copy()
    c[17] = 99  # a token of block 2: blocks 0, 1 still equal, 2.. differ
    kc = chain_keys(c, 8)
    assert kc[:2] == ka[:2] and all(x != y for x, y in zip(kc[2:], ka[2:]))
    # the same tokens of a block after another prefix do not share its key (the chain)
    assert chain_keys([7] * 16, 8)[1] != chain_keys([8] * 8 + [7] * 8, 8)[1]


def test_match_finds_the_longest_cached_prefix_and_a_one_token_difference_misses():
    pool = BlockPool(8, 4)
    prompt = list(range(100, 114))  # 3 full blocks + 2
    ids = _fill(pool, prompt)
    assert ids == [0, 1, 2]
    assert pool.match(prompt) == [0, 1, 2]
    assert pool.match(prompt[:9]) == [0, 1]
    assert pool.match(prompt[:3]) == []
    other = prompt.copy()
    other[5] = 0  # block 1 differs: only block 0 is shared
    assert pool.match(other) == [0]
    first = prompt.copy()
    first[0] = 0
    assert pool.match(first) == []


def test_match_checks_the_tokens_as_well_as_the_key():
    pool = BlockPool(4, 2)
    keys = pool.keys([1, 2, 3, 4])
    pool.publish(keys[0], (1, 2), b"")
    pool.publish(keys[1], (9, 9), keys[0])  # a block stored under a key its tokens do not give (a collision)
    assert pool.match([1, 2, 3, 4]) == [0]


def test_referenced_blocks_are_never_evicted_and_the_least_recent_goes_first():
    pool = BlockPool(4, 2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ia, ib = _fill(pool, a), _fill(pool, b)  # the pool is full: 4 blocks
    assert sorted(ia + ib) == [0, 1, 2, 3] and not pool.free
    pool.acquire(ia)  # a row reads prompt a's blocks
    c = [9, 10, 11, 12]
    ic = _fill(pool, c)  # evicts b's two blocks (unreferenced), never a's
    assert sorted(ic) == sorted(ib) and pool.evictions == 2
    assert pool.match(a) == ia and pool.match(b) == []
    d = [13, 14]
    assert _fill(pool, d) == [ic[1]]  # c's tail goes before its head (a chain is evicted tail first)
    assert pool.match(c) == [ic[0]]
    pool.acquire([ic[0], ic[1]])  # rows read c's head and d's block
    assert _fill(pool, [20, 21]) == [None]  # every block referenced: nothing published, nothing freed
    assert pool.match(a) == ia and pool.referenced(ia[0]) == 1
    pool.release(ia)
    assert _fill(pool, [20, 21]) == [ia[1]]  # released: evictable again, a's tail first
    assert pool.match(a) == ia[:1]
    with pytest.raises(ValueError):
        pool.release([ia[0], ia[0]])


def test_a_block_is_not_published_without_its_parent_nor_by_evicting_its_own_chain():
    pool = BlockPool(2, 1)
    assert _fill(pool, [1, 2, 3, 4]) == [0, 1, None, None]  # block 2 would evict block 1, its parent
    assert pool.match([1, 2, 3, 4]) == [0, 1]
    keys = pool.keys([7, 8])
    assert pool.publish(keys[1], (8,), keys[0]) is None  # its parent [7] is not cached: unreachable


def test_touch_makes_a_matched_block_the_most_recent():
    pool = BlockPool(2, 1)
    ia, ib = _fill(pool, [1]), _fill(pool, [2])
    pool.touch(ia)  # [1] was used again: [2] is now the least recent
    assert _fill(pool, [3]) == ib
    assert pool.match([1]) == ia


def test_publish_of_a_cached_key_and_promises():
    pool = BlockPool(2, 2)
    keys = pool.keys([1, 2])
    assert pool.publish(keys[0], (1, 2), b"") == 0
    assert pool.publish(keys[0], (1, 2), b"") is None  # cached already
    pool.promise(keys)
    pool.promise(keys)
    pool.unpromise(keys)
    assert keys[0] in pool.promised
    pool.unpromise(keys)
    assert not pool.promised
