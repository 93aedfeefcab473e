"""The key/value cache a stage keeps for its own layers and its tensor-parallel shard.

Note: three policies (``[run] kv_cache``, per-rank ``[[rank]] kv_cache``).
* ``none``: nothing is kept; every decode step recomputes the whole prefix (a prefill of the
  sequence so far). Slow, exact, and the reference the cached policies are tested against.
* ``full``: every position up to the job's longest sequence, ``[slots, nkv, S_max, hs]`` per
  layer, preallocated at `reset` so memory is known (and planned) up front.
* ``window:W``: sliding-window attention: a query at position p sees keys p-W+1..p. This is a
  *different model* from the checkpoint's (as Mistral's window is), not an approximation of
  it: tokens differ from ``full`` once a sequence is longer than W. The cache is a ring of W
  positions (position p lives in column p % W), so memory does not grow with the sequence.
  A decode step writes position p at column p % L and its query reads columns 0..min(p, L-1)
  with a plain causal mask: once a row has written L positions all L columns are in its window,
  before that only 0..p are, whatever order the ring is in (`kernels.decode_attention`).

Note: the prefix cache. Beside its slots a stage may keep a pool of blocks of B positions per
layer (`block_pool_caches`, the same entry widths as the layer's slots: a latent layer's pool
holds latents). Stage 0's `block_pool.BlockPool` decides which block holds which prompt prefix;
each step carries its block ops: an ATTACH copies a cached block into a row's slot before the
step (`copy_blocks`; the row's prefill then starts after it, as a later chunk does), a SAVE
copies a block the step's prefill completes into the pool, layer by layer as the chunk is
stored (`prefill_kv`'s ``saves``: a window layer's ring would lose its early positions after).
A slot stays one contiguous row, so every attention kernel reads it as before and a row's
numbers are those of a chunked prefill without the cache. A window layer's ring takes part: an
attach writes the blocks' positions in order into columns p % L, which leaves the ring as a
prefill of them would (the pool keeps whole blocks for every layer).

Note: the block table (paged rows). With the prefix cache and ``full`` caches (`drivers.generate`
decides, for every rank alike), a stage's full-attention layers keep no slots: each is a
`PagedCache`, a pool of blocks of B positions (per layer; a latent layer's of latents), and the
stage keeps one block table (rows, max blocks) int32 that all of them share: position p of row s
is pool column table[s, p // B] * B + p % B. Stage 0's `block_pool.BlockPool` hands out every
block: a row admitted takes its own blocks for its prompt and new tokens (SET ops: a table entry),
a cached prefix is attached by table entry (ATTACH: no copy), and a prompt block the row completes
becomes the cached block as it is (SAVE names the row's own block: nothing to copy). So rows of
different lengths share the pool by what they use. Reads go through the table: a decode step's
kernels read a row's blocks in place, in the slot row's order (`kernels.attention_cache`'s paged-rows
note: bit for bit the slot cache's numbers), and so do a prefill chunk's, gathering each (row, kv
head) where it is attended (`kernels.attend`'s ``before``); MLA's latents are gathered whole
(`_prefill_paged`, by `kernels.blocks`). Window layers (``window:W``, a
model's sliding layers) keep their rings and copy blocks as the prefix-cache note says: their
memory is bounded by the window, but their pool uses the same block ids (as many blocks), so the
driver pages only models without them (`GenerateDriver._paged`).

A cache row ("slot") holds one sequence; a finished sequence's slot is reused by the next
prompt without clearing: a prefill writes positions 0..len-1 and every read is masked to the
positions the sequence has written, so stale keys are never visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import KvSpec  # the parsed setting; re-exported: the cache is where it acts
from ..errors import ConfigError

__all__ = ["KvSpec", "LayerCache", "PagedCache", "PoolLayer", "prefill_kv", "block_pool_caches", "copy_blocks",
           "prefix_cacheable", "paged_caches", "paged_before", "ATTACH", "SAVE", "SET"]

# block ops (the prefix-cache and block-table notes): ATTACH a cached block to a row (a table entry; a
# ring layer copies it into the slot), SAVE a row's block as the cached block (a ring layer copies it
# into the pool), SET a row's own fresh block (a table entry only)
ATTACH, SAVE, SET = 1, 2, 3


class _Entries:
    """What a layer's cache says of its size, whatever its layout (slot rows or a block pool)."""

    k: np.ndarray
    v: np.ndarray

    @property
    def entry_floats(self) -> int:
        """Floats one position holds: every kv head's k and v entries."""
        return self.k.shape[1] * (self.k.shape[3] + self.v.shape[3])

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class LayerCache(_Entries):
    """One layer's cache: ``k`` (slots, heads, L, k_width) and ``v`` (slots, heads, L, v_width)
    float32, allocated once. The entry width is the layer's own (`entry_floats`): K and V of its
    kv heads (k_width = v_width = head_dim), or a latent-attention layer's one shared entry (the
    latent in ``k``, the RoPE key in ``v``: `families.decoder.mla`); the ring, the chunked
    prefill's reads and the slot bookkeeping do not depend on it."""

    def __init__(self, slots: int, heads: int, length: int, k_width: int, v_width: int | None = None):
        self.k = np.zeros((slots, heads, length, k_width), np.float32)
        self.v = np.zeros((slots, heads, length, k_width if v_width is None else v_width), np.float32)


class PagedCache(_Entries):
    """A full-attention layer's cache as a pool of blocks (the block-table note): ``k`` (1, heads,
    blocks x size, k width), ``v`` likewise (4-D: the decode kernels take either layout), and the
    stage's block ``table`` (rows, max blocks) int32, shared by its paged layers: position p of
    cache row s is column table[s, p // size] * size + p % size."""

    def __init__(self, table: np.ndarray, blocks: int, size: int, heads: int, k_width: int, v_width: int):
        self.table, self.size = table, size
        self.k = np.zeros((1, heads, blocks * size, k_width), np.float32)
        self.v = np.zeros((1, heads, blocks * size, v_width), np.float32)

    def columns(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Pool columns of ``positions`` (..., n) of cache rows ``slots`` (one per leading row)."""
        slots = np.asarray(slots).reshape(-1, *([1] * (np.ndim(positions) - 1)))
        return self.table[slots, positions // self.size].astype(np.int64) * self.size + positions % self.size


def paged_caches(caches: list[LayerCache], specs: list[KvSpec], rows: int, max_seq: int, blocks: int,
                 size: int) -> tuple[list, np.ndarray]:
    """``caches`` with each full-attention layer's slots replaced by a `PagedCache` of ``blocks``
    blocks (window layers keep their rings: bounded by their window), and the block table they share."""
    table = np.zeros((rows, -(-max_seq // size)), np.int32)
    out = [PagedCache(table, blocks, size, c.k.shape[1], c.k.shape[3], c.v.shape[3]) if s.policy == "full" else c
           for c, s in zip(caches, specs)]
    return out, table


def prefill_kv(cache: LayerCache | PagedCache | None, spec: KvSpec, k: np.ndarray, v: np.ndarray, slots: np.ndarray,
               lengths: np.ndarray, start: int = 0, saves: np.ndarray | None = None,
               pool: "PoolLayer | None" = None, gather: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Store a prefill chunk's keys and say what its queries attend to.

    k, v (B, nkv, T, hs) at positions start..start+T-1; row b's real tokens are the first
    ``lengths[b] - start`` (its whole prompt is ``lengths[b]`` long; it is right-padded past
    that). Returns (keys, values, q_pos, window) for `kernels.attend`: with ``start = 0`` the
    chunk itself, causal; a later chunk (chunked prefill) also sees the positions before it that
    the cache still holds (all of them, or a ring's last L), read before the chunk is written.
    Windowed under ``window:W``; padded queries see only real keys before them and are ignored.
    ``saves`` (m, 3): (row b, block j, pool id): block j of row b, complete once this chunk is in,
    is copied into ``pool`` first (the prefix-cache note), before the chunk can overwrite a ring.
    A `PagedCache` with ``gather=False``: keys and values are the chunk's alone, and the positions
    before it are left in the blocks for `kernels.attend`'s ``before`` (`paged_before`).
    """
    B, _, T, _ = k.shape
    if isinstance(cache, PagedCache):  # through the block table; a saved block is the row's own already
        return _prefill_paged(cache, k, v, slots, lengths, start, gather)
    if saves is not None and len(saves) and pool is not None:
        _save_blocks(cache, pool, k, v, slots, start, saves)
    keys, values, q_pos = k, v, np.broadcast_to(np.arange(T), (B, T))
    if start:
        if cache is None:
            raise ValueError("prefill_kv: a chunk after position 0 needs a KV cache (kv_cache = none recomputes)")
        prev = min(start, cache.k.shape[2])  # the positions start-prev..start-1
        keys = np.concatenate([_before(cache.k, slots, start, prev), k], axis=2)  # (B, nkv, prev + T, hs)
        values = np.concatenate([_before(cache.v, slots, start, prev), v], axis=2)
        q_pos = np.broadcast_to(prev + np.arange(T), (B, T))  # key j sits at position start - prev + j
    if cache is not None:
        L = cache.k.shape[2]
        for b in range(B):
            n = min(T, int(lengths[b]) - start)  # this row's real tokens in the chunk
            first = max(0, n - L)  # a ring keeps only the last L positions
            cols = (start + np.arange(first, n)) % L
            cache.k[slots[b], :, cols] = k[b, :, first:n].transpose(1, 0, 2)  # (n', nkv, hs)
            cache.v[slots[b], :, cols] = v[b, :, first:n].transpose(1, 0, 2)
    return keys, values, q_pos, spec.window if spec.policy == "window" else 0


def _prefill_paged(cache: PagedCache, k: np.ndarray, v: np.ndarray, slots: np.ndarray, lengths: np.ndarray,
                   start: int, gather: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """`prefill_kv` of a paged full-attention layer: positions 0..start-1 gathered through the
    table (the same keys in the same order as a slot row's, so `kernels.attend` sums them alike;
    not with ``gather=False``), then the chunk's real positions written to the row's blocks."""
    from ..kernels.blocks import gather_blocks, scatter_blocks

    B, _, T, _ = k.shape
    k, v = np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32)  # (one copy, attend's too)
    keys, values, q_pos = k, v, np.broadcast_to(start + np.arange(T), (B, T))
    if start and gather:  # (B, nkv, start + T, hs)
        keys = gather_blocks(cache.k[0], cache.table, slots, cache.size, start, k)
        values = gather_blocks(cache.v[0], cache.table, slots, cache.size, start, v)
    counts = np.asarray(lengths, np.int64)[:B] - start  # each row's real tokens in the chunk
    scatter_blocks(cache.k[0], cache.table, slots, cache.size, start, counts, k)
    scatter_blocks(cache.v[0], cache.table, slots, cache.size, start, counts, v)
    return keys, values, q_pos, 0


def paged_before(cache: LayerCache | PagedCache | None, slots: np.ndarray, start: int) -> tuple | None:
    """`kernels.attend`'s ``before`` for a chunk from ``start`` of a paged layer's rows (None: a
    slot cache, or the chunk is the rows' beginning)."""
    if not isinstance(cache, PagedCache) or not start:
        return None
    return cache.k[0], cache.v[0], cache.table, slots, cache.size, start


def _save_blocks(cache: LayerCache, pool: "PoolLayer", k: np.ndarray, v: np.ndarray, slots: np.ndarray, start: int,
                 saves: np.ndarray) -> None:
    """Block j of row b into pool block ``id`` for each (b, j, id): its positions before ``start``
    from the cache (a ring holds them: a block straddling the chunk's start is within the last B
    positions, and a ring is at least a block long where the pool is kept), the rest from the chunk."""
    Bk, L = pool.size, cache.k.shape[2]
    for b, j, i in saves.tolist():
        lo, hi, at = j * Bk, (j + 1) * Bk, i * Bk  # the block's positions; its first column in the pool
        if lo < start:  # the part computed by earlier chunks (or attached)
            cols = np.arange(lo, start) % L
            pool.k[:, at:at + start - lo] = cache.k[slots[b]][:, cols]
            pool.v[:, at:at + start - lo] = cache.v[slots[b]][:, cols]
        first = max(lo, start)
        pool.k[:, at + first - lo:at + Bk] = k[b, :, first - start:hi - start]
        pool.v[:, at + first - lo:at + Bk] = v[b, :, first - start:hi - start]


def _before(cache: np.ndarray, slots: np.ndarray, start: int, prev: int) -> np.ndarray:
    """Positions start-prev..start-1 of cache rows ``slots``, in order: (B, nkv, prev, hs). Column
    p % L holds position p; a slice of each row unless the ring wraps inside the range."""
    L = cache.shape[2]
    lo = (start - prev) % L
    if lo + prev <= L:
        return np.stack([cache[s, :, lo:lo + prev] for s in slots])
    cols = np.arange(start - prev, start) % L
    return np.stack([cache[s][:, cols] for s in slots])


def prefix_cacheable(specs: list[KvSpec], block: int) -> bool:
    """Can these layers' caches take part in the prefix cache? Not without a cache, nor with a
    ring shorter than a block (a block straddling a chunk's start must still be in it)."""
    return all(s.policy != "none" and (s.policy != "window" or s.window >= block) for s in specs)


@dataclass
class PoolLayer:
    """One layer's prefix-cache pool: ``k`` (heads, blocks x size, k width), ``v`` likewise; block
    b is columns b*size..(b+1)*size-1, so a prefix published block after block (consecutive ids)
    is one slice: an attach copies it into the slot in one strided copy per layer (measured
    against a copy per block: 22 ms against 42 ms a row of 64 blocks x 16 layers, medium
    preset's widths, 1 thread, loaded host; a gather of the blocks into slot order took 260 ms)."""

    k: np.ndarray
    v: np.ndarray
    size: int

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def block_pool_caches(caches: list, blocks: int, size: int) -> list[PoolLayer | None]:
    """A pool of ``blocks`` blocks of ``size`` positions per slot layer, each layer's entry as its
    slots'; None for a paged layer (its blocks are the pool)."""
    return [None if isinstance(c, PagedCache) else
            PoolLayer(np.zeros((c.k.shape[1], blocks * size, c.k.shape[3]), np.float32),
                      np.zeros((c.v.shape[1], blocks * size, c.v.shape[3]), np.float32), size) for c in caches]


def copy_blocks(caches: list, pool: list[PoolLayer | None], ops: np.ndarray) -> None:
    """The ATTACH ops of ``ops`` (m, 4): (kind, slot, block index j, pool id): pool block -> the
    slot's positions j*B..(j+1)*B-1, in order (a ring's column p % L then holds the last of them,
    as a prefill leaves it). The SAVE ops are made during the prefill (`prefill_kv`'s ``saves``).
    Runs of consecutive blocks and ids are one copy (`PoolLayer`). Paged layers copy nothing (their
    table entries are set by the stage)."""
    pairs = [(c, p) for c, p in zip(caches, pool) if p is not None]
    if not pairs:
        return
    B = pairs[0][1].size
    runs: list[list[int]] = []  # [slot, first j, first id, blocks]
    for op, slot, j, b in ops.tolist():
        if op != ATTACH:
            continue
        if runs and runs[-1][0] == slot and runs[-1][1] + runs[-1][3] == j and runs[-1][2] + runs[-1][3] == b:
            runs[-1][3] += 1
        else:
            runs.append([slot, j, b, 1])
    for slot, j, b, n in runs:
        for c, p in pairs:
            L = c.k.shape[2]
            lo = j * B % L
            cols = slice(lo, lo + n * B) if lo + n * B <= L else np.arange(lo, lo + n * B) % L  # (a ring may wrap)
            if isinstance(cols, np.ndarray) and n * B > L:  # longer than the ring: only the last L positions stay
                cols, first = cols[-L:], n * B - L
            else:
                first = 0
            c.k[slot][:, cols] = p.k[:, b * B + first:(b + n) * B]
            c.v[slot][:, cols] = p.v[:, b * B + first:(b + n) * B]
