"""The paged KV cache (kv_cache's block-table note): full-attention layers read and write through a
per-row block table into one pool of blocks. A row's numbers are bit for bit those of the slot
cache (same keys, same order: attention's invariance note), at the kernel, for a real stage
(fused decode, MLA's latents, a family's own window layers beside paged ones), and a cached block
attached by table entry (no copy) gives the row the same bits as computing it."""

import json

import numpy as np
import pytest

from rlx_mpi.kv_cache import ATTACH, SAVE, SET, KvSpec

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


@pytest.mark.parametrize("pool", [False, True])
def test_paged_decode_kernels_equal_the_slot_kernels_bitwise(pool, monkeypatch):
    """`attend_cache` and `decode_attention` (RoPE, the store through the table, attention) on a
    paged cache give the slot cache's bits, on the calling thread and on numba's pool, and the
    stored key lands in the row's block."""
    from rlx_mpi.kernels import attention
    from rlx_mpi.kernels import attend_cache, decode_attention

    monkeypatch.setattr(attention, "pool_threads", lambda: 2 if pool else 1)
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
    from rlx_mpi.checkpoint import H5ParamSource
    from rlx_mpi.families.decoder.stage import DecoderStage
    from rlx_mpi.families.llama import PRESETS
    from rlx_mpi.kv_cache import PagedCache

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
    from rlx_mpi.kv_cache import LayerCache, PagedCache

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
