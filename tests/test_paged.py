"""The paged KV cache (kv_cache's block-table note): full-attention layers read and write through a
per-row block table into one pool of blocks. A row's numbers are bit for bit those of the slot
cache (same keys, same order: attention's invariance note), at the kernel, for a real stage
(fused decode, MLA's latents, a family's own window layers beside paged ones), and a cached block
attached by table entry (no copy) gives the row the same bits as computing it."""

import json

import numpy as np
import pytest

from rlx_mpi.model.kv_cache import ATTACH, SAVE, SET, KvSpec

BS = 16  # block size of these tests (block_pool.BLOCK_SIZE)


def _pool_of(ck: np.ndarray, cv: np.ndarray, size: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A slot cache (slots, nkv, L, hs) scattered into a pool (1, nkv, blocks x size, hs) through a
    random block table (slots, L / size), with spare blocks of noise."""
    S, nkv, L, hs = ck.shape
    nb = L // size
    table = rng.permutation(S * nb + 3)[:S * nb].reshape(S, nb).astype(np.int32)
    pk = rng.standard_normal((1, nkv, (S * nb + 3) * size, hs)).astype(np.float32)
    pv = rng.standard_normal(pk.shape).astype(np.float32)
    for s in range(S):
        for j in range(nb):
            b = table[s, j]
            pk[0, :, b * size:(b + 1) * size] = ck[s, :, j * size:(j + 1) * size]
            pv[0, :, b * size:(b + 1) * size] = cv[s, :, j * size:(j + 1) * size]
    return pk, pv, table


@pytest.mark.parametrize("size, start, T", [(16, 0, 5), (16, 32, 7), (16, 37, 16), (4, 9, 3), (3, 1, 1)])
def test_block_copies_equal_numpy_fancy_indexing(size, start, T):
    """`gather_blocks` / `scatter_blocks` against numpy's indexing through the table (the copies a
    paged prefill chunk makes): rows in any order, a start inside a block, a chunk crossing blocks,
    rows with fewer real tokens than the chunk (and none)."""
    from rlx_mpi.kernels import gather_blocks, scatter_blocks

    rng = np.random.default_rng(size * 100 + start)
    S, nkv, hs, nb = 4, 3, 5, -(-(start + T) // size) + 1
    table = rng.permutation(S * nb + 2)[:S * nb].reshape(S, nb).astype(np.int32)
    pool = rng.standard_normal((nkv, (S * nb + 2) * size, hs)).astype(np.float32)
    slots = np.array([2, 0, 3])
    chunk = rng.standard_normal((3, nkv, T, hs)).astype(np.float32)

    def cols(s, pos):
        return table[s, pos // size].astype(np.int64) * size + pos % size

    want = np.concatenate([np.stack([pool[:, cols(s, np.arange(start))] for s in slots]), chunk], axis=2)
    np.testing.assert_array_equal(gather_blocks(pool, table, slots, size, start, chunk), want)
    counts = np.array([T, T - 1, -2])  # the last row has no real token in this chunk
    ref = pool.copy()
    for b, s in enumerate(slots):
        n = max(0, counts[b])
        ref[:, cols(s, start + np.arange(n))] = chunk[b, :, :n]
    scatter_blocks(pool, table, slots, size, start, counts, chunk)
    np.testing.assert_array_equal(pool, ref)
    with pytest.raises(ValueError, match="one cache row"):
        gather_blocks(pool, table, np.array([0, 1, 9]), size, start, chunk)
    with pytest.raises(ValueError, match="chunk must be float32"):
        gather_blocks(pool, table, slots, size, start, chunk[:, :2])


@pytest.mark.parametrize("start, T, threads", [(16, 7, 1), (37, 13, 2), (100, 1, 2)])
def test_prefill_attention_through_the_table_equals_the_gathered_keys_bitwise(start, T, threads, monkeypatch):
    """`attend(..., before=...)` (a paged chunk's earlier positions read per (row, kv head) from
    the blocks) gives the bits of `attend` over the keys gathered first, with sinks, on 1 and 2
    threads (kv heads split between them)."""
    from rlx_mpi.kernels import attend, gather_blocks
    from rlx_mpi.kernels import attention

    monkeypatch.setattr(attention, "_TEAM_WORK", 1)  # (the team takes even these small shapes)
    monkeypatch.setattr(attention, "team_size", lambda n: min(n, threads))
    rng = np.random.default_rng(start)
    S, nkv, g, hs, size = 3, 2, 3, 8, 16
    nb = -(-(start + T) // size)
    table = rng.permutation(S * nb + 2)[:S * nb].reshape(S, nb).astype(np.int32)
    pk = rng.standard_normal((nkv, (S * nb + 2) * size, hs)).astype(np.float32)
    pv = rng.standard_normal((nkv, (S * nb + 2) * size, hs + 2)).astype(np.float32)
    slots = np.array([2, 0])
    q = rng.standard_normal((2, nkv * g, T, hs)).astype(np.float32)
    k = rng.standard_normal((2, nkv, T, hs)).astype(np.float32)
    v = rng.standard_normal((2, nkv, T, hs + 2)).astype(np.float32)
    q_pos = np.broadcast_to(start + np.arange(T), (2, T))
    sinks = rng.standard_normal(nkv * g).astype(np.float32)
    keys, values = gather_blocks(pk, table, slots, size, start, k), gather_blocks(pv, table, slots, size, start, v)
    want = attend(q, keys, values, q_pos, sinks=sinks)
    got = attend(q, k, v, q_pos, sinks=sinks, before=(pk, pv, table, slots, size, start))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="before must be"):
        attend(q, k, v, q_pos, before=(pk, pv, table, slots, size, 0))


@pytest.mark.parametrize("pool", [False, True])
def test_paged_decode_kernels_equal_the_slot_kernels_bitwise(pool, monkeypatch):
    """`attend_cache` and `decode_attention` (RoPE, the store through the table, attention) on a
    paged cache give the slot cache's bits, on the calling thread and on numba's pool, and the
    stored key lands in the row's block."""
    from rlx_mpi.kernels import attention_cache
    from rlx_mpi.kernels import attend_cache, decode_attention

    monkeypatch.setattr(attention_cache, "pool_threads", lambda: 2 if pool else 1)
    rng = np.random.default_rng(1)
    S, nkv, nh, hs, L, size = 3, 2, 6, 8, 48, 4
    ck = rng.standard_normal((S, nkv, L, hs)).astype(np.float32)
    cv = rng.standard_normal((S, nkv, L, hs)).astype(np.float32)
    pk, pv, table = _pool_of(ck, cv, size, rng)
    slots, pos = np.array([2, 0, 1]), np.array([47, 5, 17])
    q = rng.standard_normal((3, nh, 1, hs)).astype(np.float32)
    assert np.array_equal(attend_cache(q, ck, cv, slots, pos), attend_cache(q, pk, pv, slots, pos, table=table, size=size))
    qkv = rng.standard_normal((3, (nh + 2 * nkv) * hs)).astype(np.float32)
    cos, sin = (rng.standard_normal((3, hs)).astype(np.float32) for _ in range(2))
    pos = np.array([40, 6, 30])
    a = decode_attention(qkv, nh * hs, cos, sin, ck, cv, slots, pos)
    b = decode_attention(qkv, nh * hs, cos, sin, pk, pv, slots, pos, table=table, size=size)
    assert np.array_equal(a, b)
    for s, p in zip(slots, pos):
        col = table[s, p // size] * size + p % size
        assert np.array_equal(pk[0, :, col], ck[s, :, p]) and np.array_equal(pv[0, :, col], cv[s, :, p])
    with pytest.raises(ValueError, match="< 48"):  # past the table's reach: an error, not a wild write
        decode_attention(qkv, nh * hs, cos, sin, pk, pv, slots, np.array([48, 0, 0]), table=table, size=size)


def _paged_equals_slots(make, ids: np.ndarray, kv: KvSpec, steps: int) -> None:
    """Two stages of the same weights: ``slot`` with slot rows, ``paged`` with its full layers in a
    pool of scrambled blocks. Row 0 prefills ``ids`` in chunks 0..19, 20..; row 1 (a shorter prompt)
    in one chunk; then both decode ``steps`` tokens together. Then row 2 attaches row 0's first
    two blocks (table entries, SAVE published them) and prefills the rest: every logit equal."""
    slot, paged = make(), make()
    L, n1 = ids.shape[1], ids.shape[1] - 7
    max_seq = L + steps + 1
    slot.reset(3, max_seq, kv)
    slot.reset_prefix(12, BS)
    paged.reset(3, max_seq, kv)
    assert paged.reset_prefix(3 * (-(-max_seq // BS)) + 2, BS, paged=True) > 0
    nb = -(-max_seq // BS)
    own = np.random.default_rng(5).permutation(3 * nb + 2)[:2 * nb].reshape(2, nb)
    sets = np.array([[SET, r, j, own[r, j]] for r in range(2) for j in range(nb)], np.int64)
    out = [[], []]
    for j, (a, b) in enumerate(((0, 20), (20, L))):  # block j completes in chunk j: saved (published) there
        ops = np.concatenate([sets[:0 if j else len(sets)], [[SAVE, 0, j, own[0, j]]]])
        slot_ops = np.concatenate([sets[:0 if j else len(sets)], [[SAVE, 0, j, j]]])  # (its pool's ids; SET: no-op)
        for o, st, op in zip(out, (slot, paged), (slot_ops, ops)):
            st.block_ops(op, before=True)
            o.append(st.prefill(ids[:, a:b], np.array([0]), np.array([L]), start=a))
            st.block_ops(op, before=False)
    for o, st in zip(out, (slot, paged)):
        o.append(st.prefill(ids[:, :n1], np.array([1]), np.array([n1])))
    assert all(np.array_equal(a, b) for a, b in zip(*out))
    x = np.array([[int(out[0][1][0].argmax())], [int(out[0][2][0].argmax())]])
    for t in range(steps):
        p = np.array([L + t, n1 + t])
        a, b = slot.decode(x, np.array([0, 1]), p), paged.decode(x, np.array([0, 1]), p)
        assert np.array_equal(a, b), t
        x = a.argmax(-1)[:, None]
    spare = sorted(set(range(3 * nb + 2)) - set(own.ravel().tolist()))
    rest = [[SET, 2, j, spare[j]] for j in range(2, nb)]
    paged.block_ops(np.array([[ATTACH, 2, 0, own[0, 0]], [ATTACH, 2, 1, own[0, 1]], *rest], np.int64), before=True)
    slot.block_ops(np.array([[ATTACH, 2, 0, 0], [ATTACH, 2, 1, 1]], np.int64), before=True)
    a = slot.prefill(ids[:, 32:], np.array([2]), np.array([L]), start=32)
    b = paged.prefill(ids[:, 32:], np.array([2]), np.array([L]), start=32)
    assert np.array_equal(a, b)


def test_a_real_stage_is_bitwise_the_same_paged(tiny_ckpt):
    """The tiny Llama (its decode steps take the fused one-call layer)."""
    from rlx_mpi.model.checkpoint import H5ParamSource
    from rlx_mpi.families.decoder.stage import DecoderStage
    from rlx_mpi.families.llama import PRESETS
    from rlx_mpi.model.kv_cache import PagedCache

    cfg = PRESETS["tiny"]

    def make():
        with H5ParamSource(tiny_ckpt) as src:
            return DecoderStage(cfg, src, range(cfg.num_hidden_layers), True, True)

    ids = np.random.default_rng(2).integers(0, 512, (1, 45))
    _paged_equals_slots(make, ids, KvSpec("full"), 6)
    st = make()
    st.reset(2, 64, KvSpec("full"))
    st.reset_prefix(9, BS, paged=True)
    assert all(isinstance(c, PagedCache) for c in st.caches) and st.table.shape == (2, 4)


@pytest.mark.parametrize("case", ["deepseek_v3", "gemma3"])
def test_latent_and_window_layers_paged(tmp_path, case):
    """DeepSeek-V3's latent layers (the pool holds latents) and Gemma 3's sliding layers (their
    rings stay slots, copied to and from their own pool) beside paged full layers."""
    from test_families import FAMILIES, build
    from rlx_mpi.families import family_for_model_type
    from rlx_mpi.model.kv_cache import LayerCache, PagedCache

    raw = json.loads((FAMILIES / case / "config.json").read_text())
    if case == "gemma3":  # a window of a block or more keeps a pool (kv_cache.prefix_cacheable); the fixture's is 8
        raw["sliding_window"] = 24
    family = family_for_model_type(raw["model_type"])
    cfg = family.convert_hf(FAMILIES / case, tmp_path / "m.h5", dtype="float32", hf_config=raw)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 43))
    _paged_equals_slots(lambda: build(family, cfg, tmp_path / "m.h5"), ids, KvSpec("full"), 5)
    st = build(family, cfg, tmp_path / "m.h5")
    st.reset(2, 64, KvSpec("full"))
    st.reset_prefix(9, BS, paged=True)
    kinds = {type(c) for c in st.caches}
    assert kinds == ({PagedCache} if case == "deepseek_v3" else {PagedCache, LayerCache})
    if case == "deepseek_v3":
        assert st.caches[0].k.shape == (1, 1, 9 * BS, cfg.kv_lora_rank)


# -- the scheduler's side: rows' blocks from the pool, admission by blocks (pure, no MPI) ----------

class PagedFakeStage:
    """test_prefix_cache's FakeStage with paged rows: one pool of blocks of `_kv` values read and
    written through a block table that the ATTACH and SET ops fill; a SAVE must name the row's own
    block (no copy). Every read checks the row's earlier positions hold its own prefix, so a block
    handed to two rows at once, or evicted while read, fails."""

    def __init__(self, slots: int, max_seq: int, blocks: int, size: int):
        self.pool = np.zeros((blocks, size), np.int64)
        self.table = np.full((slots, -(-max_seq // size)), -1, np.int64)
        self.size, self.computed = size, 0

    def _col(self, slot: int, p: int) -> tuple[int, int]:
        b = self.table[slot, p // self.size]
        assert b >= 0, f"slot {slot} has no block for position {p}"
        return b, p % self.size

    def run(self, step, ops) -> np.ndarray:
        from test_prefix_cache import _kv

        for op, slot, j, b in ops.tolist() if ops is not None else ():
            if op in (ATTACH, SET):
                self.table[slot, j] = b
        tokens = []
        for i, r in enumerate(step.rows):
            seq = r.prompt + tuple(r.new)
            decode = step.kind == 2 or (step.kind == 4 and i < step.n_decode)  # DECODE, MIXED's decode rows
            lo = len(seq) - 1 if decode else step.start
            hi = len(seq) if decode else min(step.start + step.T, len(seq))
            for p in range(lo):
                assert self.pool[self._col(r.slot, p)] == _kv(seq[:p + 1]), f"slot {r.slot}: wrong key at {p}"
            for p in range(lo, hi):
                self.pool[self._col(r.slot, p)] = _kv(seq[:p + 1])
            self.computed += hi - lo
            tokens.append(100 + _kv(seq) % 50)
        for op, slot, j, b in ops.tolist() if ops is not None else ():
            if op == SAVE:
                assert self.table[slot, j] == b, "a paged SAVE publishes the row's own block"
        return np.array(tokens, np.int64)


def run_paged(prompts, *, blocks: int | None, size=4, groups=1, batch=3, chunk=4, new=3, mixed=True):
    """Stage 0's loop over a `PagedFakeStage` (``blocks`` None: no pool, slot rows, test_prefix_cache's
    FakeStage): (rows by id, positions computed, scheduler)."""
    from rlx_mpi.engine.block_pool import BlockPool
    from rlx_mpi.engine.scheduler import Scheduler
    from test_prefix_cache import drive, run

    if blocks is None:
        return run(prompts, pool=None, groups=groups, batch=batch, chunk=chunk, new=new, mixed=mixed)
    s = Scheduler(prompts, groups=groups, batch=batch, max_new_tokens=new, eos_ids=frozenset(), recompute=False,
                  prefill_chunk=chunk, mixed=mixed, stages=1, pool=BlockPool(blocks, size), paged=True)
    stage = PagedFakeStage(groups * batch, max(len(p[2]) for p in prompts) + new, blocks, size)
    rows = drive(s, stage, groups)
    assert len(s.pool.free) + len(s.pool.lru) == blocks, "a block was not given back"
    return rows, stage.computed, s


@pytest.mark.parametrize("groups, batch, chunk, mixed", [(1, 3, 4, True), (2, 2, 4, True), (1, 4, 0, False)])
def test_paged_rows_equal_slot_rows_and_a_shared_prefix_is_computed_once(groups, batch, chunk, mixed):
    from test_prefix_cache import _prompts

    prompts = _prompts(9, 13, np.random.default_rng(4))  # 3 full blocks of 4 shared
    ref, computed_ref, _ = run_paged(prompts, blocks=None, groups=groups, batch=batch, chunk=chunk, mixed=mixed)
    rows, computed, s = run_paged(prompts, blocks=60, groups=groups, batch=batch, chunk=chunk, mixed=mixed)
    assert rows == ref
    assert s.reused >= 8 * 12 - (groups * batch - 1) * 12 and computed == computed_ref - s.reused


def test_a_full_pool_evicts_only_unreferenced_blocks_and_rows_stay_right():
    """A pool of 12 blocks of 4 (a row of 10-18 positions takes 3-5, its attached blocks shared): the
    rows wait for blocks and cached prefixes are evicted (least recently used) for them; every read
    still checks its own prefix, and the rows equal slot rows'."""
    from test_prefix_cache import _prompts

    rng = np.random.default_rng(8)
    prompts = _prompts(6, 8, rng) + [(6 + i, f"u{i}", tuple(rng.integers(0, 500, 12).tolist())) for i in range(4)]
    ref, _, _ = run_paged(prompts, blocks=None, batch=3)
    rows, _, s = run_paged(prompts, blocks=12, batch=3)
    assert rows == ref and s.pool.evictions > 0


def test_mixed_lengths_admit_more_rows_under_the_same_budget():
    """Prompts of 4-64 tokens, 3 new each, the memory of 8 full-length slot rows (68 positions: 17
    blocks of 4) and the prefix pool's 2 rows beside them (the driver's PREFIX_POOL_ROWS): slot rows
    decode 8 at once (--batch 8); paged rows with --batch 32 take all 170 blocks by what they use,
    twice as many at once (the mean row takes ~9 blocks), with the same rows."""
    rng = np.random.default_rng(11)
    lengths = [64] + rng.integers(4, 65, 47).tolist()
    prompts = [(i, f"m{i}", tuple(rng.integers(0, 500, n).tolist())) for i, n in enumerate(lengths)]
    ref, _, slots = run_paged(prompts, blocks=None, batch=8, chunk=16)
    rows, _, paged = run_paged(prompts, blocks=(8 + 2) * 17, batch=32, chunk=16)
    assert rows == ref
    assert slots.peak_rows == 8 and paged.peak_rows >= 16, (slots.peak_rows, paged.peak_rows)


def test_admission_is_by_blocks():
    from rlx_mpi.engine.block_pool import BlockPool
    from rlx_mpi.engine.scheduler import admit_blocks, row_blocks

    assert row_blocks(16, 1, 16) == 1 and row_blocks(16, 2, 16) == 2 and row_blocks(1, 16, 16) == 1
    pool = BlockPool(5, 4)
    assert admit_blocks(pool, [], 10, 3) == [0, 1, 2]  # 12 positions: 3 blocks
    assert admit_blocks(pool, [], 8, 2) is None and len(pool.free) == 2  # 3 more do not fit: nothing taken
    assert pool.adopt(b"k", (1, 2, 3, 4), b"", 0) and not pool.adopt(b"k", (1, 2, 3, 4), b"", 1)
    pool.give_back([1, 2])
    pool.release([0])  # the cached block, unreferenced: evictable
    assert pool.available() == 5 and admit_blocks(pool, [], 17, 4) == [1, 2, 3, 4, 0] and pool.evictions == 1
