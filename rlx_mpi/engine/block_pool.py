"""The prefix cache's bookkeeping: a pool of fixed-size KV blocks keyed by a hash chain.

Pure data, testable without MPI; stage 0's `scheduler.Scheduler` keeps one and every stage holds
the blocks' contents (`families.decoder.stage.DecoderStage.reset_prefix`), indexed by the block
ids this pool hands out, so the stages never decide anything about the cache themselves.

Note: keys. A full block of ``size`` positions is keyed by its tokens and the key of the block
before it (`chain_keys`): the key of block j names the whole prompt prefix 0..(j+1)*size-1, so a
one-token difference anywhere before misses every block from there on. The key is 16 bytes of
blake2b over (previous key, tokens); a block also keeps its tokens, and `match` compares them,
so even a hash collision cannot hand a row another prompt's keys.

Note: reference counts and eviction. A row that attaches cached blocks holds a reference to
each while it lives (`acquire` / `release`); `publish` fills a free block, or else the least
recently used block that no row references, and never one that is referenced: when every block
is referenced, nothing is published (the prompt is then simply not cached). Within a chain the
tail goes first: a block is always less recent than the blocks before it (`publish`, `touch`
and `release` keep that order), because a block is only reachable through its whole chain, so
evicting a chain's head would strand the rest (as vLLM frees a request's blocks tail first).
A block whose parent is not cached, or that could only be stored by evicting its own chain, is
not published. A
block's contents are copied into the row's own cache slot when it attaches (the rows' slots stay
contiguous, so the attention kernels read them as before), so a reference keeps a prefix that
live rows use in the pool for the next rows, not the row's own attention correct.

Note: paged rows (a job whose full-attention layers read through a block table: `kv_cache`'s
block-table note). The pool then holds every row's blocks, not only cached prefixes: a row
admitted takes its own blocks for the rest of its prompt and its new tokens (`allocate`: free
blocks, else unreferenced cached ones, least recently used first), a prompt block it completes
becomes the cached block as it is (`adopt`: no copy; the row references it, so it is never
evicted while the row reads it), and the row's other blocks return to the free list when it
ends (`give_back`). A reference is then what keeps the row's own attention correct.

Note: promised blocks. A row that is prefilling promises the keys of its prompt's full blocks
that are not cached yet (`promise`), until the step that computes them is issued and they are
published (or the row ends). The scheduler does not admit a prompt whose next uncached block is
promised: it waits for the row computing it, then attaches it, so a prefix shared by the rows
admitted at once is computed once (as SGLang's cache-aware scheduling does).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["BlockPool", "chain_keys", "BLOCK_SIZE", "PREFIX_POOL_ROWS"]

# Note: 16 positions, as vLLM's default: a chat template's ~20-token system text already fills a
# block, and an attach copies a row's consecutive blocks in one strided copy per layer whatever
# their size (`kv_cache.PoolLayer`). Not measured against other sizes on this code yet.
BLOCK_SIZE = 16

# Note: the prefix cache's pool holds as many positions as this many cache slots (2: a shared
# prefix of the longest prompt's length and room for the prompts' own blocks to churn, LRU);
# the planner prices it as that many more slots (generate's and score's ``cost``).
PREFIX_POOL_ROWS = 2


def chain_keys(tokens, size: int, salt: bytes = b"") -> list[bytes]:
    """The hash-chain keys of the full blocks of ``tokens``: key j covers tokens 0..(j+1)*size-1.

    The chain starts from ``salt``: everything besides the tokens that changes a row's KV (an
    adapter: `records.Request.kv_salt`), so rows of different salts never share a block. The
    empty salt keeps the keys of before (the chain's root is empty)."""
    prev = b"" if not salt else hashlib.blake2b(b"rlx-kv-salt\x00" + salt, digest_size=16).digest()
    keys = []
    for j in range(len(tokens) // size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens[j * size:(j + 1) * size]))
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclass
class _Block:
    key: bytes
    tokens: tuple[int, ...]
    parent: bytes
    refs: int = 0


class BlockPool:
    """``blocks`` cache blocks of ``size`` positions: which holds which prefix, who reads it."""

    def __init__(self, blocks: int, size: int = BLOCK_SIZE):
        if blocks < 0 or size < 1:
            raise ValueError(f"BlockPool: blocks {blocks} must be >= 0 and size {size} >= 1")
        self.size = size
        self.capacity = blocks
        self.free = list(range(blocks - 1, -1, -1))  # (popped from the end: block 0 first)
        self.by_key: dict[bytes, int] = {}
        self.blocks: dict[int, _Block] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recent first
        self.promised: dict[bytes, int] = {}  # key -> rows that will compute it
        self.hits = 0  # positions attached from the pool
        self.evictions = 0

    def keys(self, tokens, salt: bytes = b"") -> list[bytes]:
        return chain_keys(tokens, self.size, salt)

    def match(self, tokens, keys: list[bytes] | None = None) -> list[int]:
        """Ids of the cached blocks that begin ``tokens``, in order (the longest cached prefix)."""
        keys = self.keys(tokens) if keys is None else keys
        ids, parent = [], b""
        for j, key in enumerate(keys):
            b = self.by_key.get(key)
            if b is None:
                break
            blk = self.blocks[b]
            if blk.parent != parent or blk.tokens != tuple(tokens[j * self.size:(j + 1) * self.size]):
                break  # (a hash collision: treated as a miss)
            ids.append(b)
            parent = key
        return ids

    def acquire(self, ids: list[int]) -> None:
        """A row reads blocks ``ids``: they are not evicted until it releases them."""
        for b in ids:
            blk = self.blocks[b]
            blk.refs += 1
            self.lru.pop(b, None)

    def release(self, ids: list[int]) -> None:
        """The row is done with ``ids`` (a chain, head first); a block nobody references joins the LRU
        list as the most recent, the head last (the tail-first note)."""
        for b in reversed(ids):
            blk = self.blocks[b]
            if blk.refs <= 0:
                raise ValueError(f"BlockPool.release: block {b} is not referenced")
            blk.refs -= 1
            if blk.refs == 0:
                self.lru[b] = None

    def touch(self, ids: list[int]) -> None:
        """Matched again (a chain, head first): the unreferenced ones become the most recently used."""
        for b in reversed(ids):
            if b in self.lru:
                self.lru.move_to_end(b)

    def publish(self, key: bytes, tokens, parent: bytes) -> int | None:
        """A block for ``key`` (its ``tokens``, after the block keyed ``parent``; b"" for the first),
        taken from the free list or by evicting the least recently used unreferenced block; None
        when the key is cached already or every block is referenced."""
        if key in self.by_key or (parent and parent not in self.by_key):  # (unreachable without its parent)
            return None
        chain = self._chain(parent)
        if self.free:
            b = self.free.pop()
        elif self.lru and next(iter(self.lru)) not in chain:
            b, _ = self.lru.popitem(last=False)
            del self.by_key[self.blocks.pop(b).key]
            self.evictions += 1
        else:
            return None
        self.by_key[key] = b
        self.blocks[b] = _Block(key, tuple(int(t) for t in tokens), parent)
        self.lru[b] = None  # unreferenced until a row attaches it
        for a in chain:  # its ancestors more recent than it, the head last (the tail-first note)
            if a in self.lru:
                self.lru.move_to_end(a)
        return b

    # -- paged rows (`kv_cache`'s block-table note): a row's own blocks come from this pool too ----

    def available(self, keep: list[int] = ()) -> int:
        """Blocks `allocate` can hand out once the cached blocks ``keep`` are acquired: the free ones
        and the unreferenced cached ones (evicted least recently used first)."""
        return len(self.free) + len(self.lru) - sum(b in self.lru for b in keep)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for a row's own positions, free ones first, then by evicting the least
        recently used unreferenced cached blocks (tail first: the tail-first note); the caller
        checked `available`. They belong to the row until it `adopt`s or `give_back`s them."""
        if n > self.available():
            raise ValueError(f"BlockPool.allocate: {n} blocks asked, {self.available()} available")
        out = []
        for _ in range(n):
            if self.free:
                out.append(self.free.pop())
            else:
                b, _ = self.lru.popitem(last=False)
                del self.by_key[self.blocks.pop(b).key]
                self.evictions += 1
                out.append(b)
        return out

    def adopt(self, key: bytes, tokens, parent: bytes, b: int) -> bool:
        """A row's own block ``b``, now holding the prompt block ``key`` (after ``parent``), becomes
        the cached block for it, referenced by the row (released with its other blocks): no copy.
        False (``b`` stays the row's own) when ``key`` is cached already or its parent is not."""
        if key in self.by_key or (parent and parent not in self.by_key):
            return False
        self.by_key[key] = b
        self.blocks[b] = _Block(key, tuple(int(t) for t in tokens), parent, refs=1)
        return True

    def give_back(self, ids: list[int]) -> None:
        """A row's own blocks (not adopted) back to the free list."""
        for b in ids:
            if b in self.blocks:
                raise ValueError(f"BlockPool.give_back: block {b} is a cached block")
        self.free.extend(reversed(ids))

    def _chain(self, key: bytes) -> list[int]:
        """The blocks of the chain ending at ``key``, tail first."""
        out = []
        while key:
            b = self.by_key.get(key)
            if b is None:
                break
            out.append(b)
            key = self.blocks[b].parent
        return out

    def promise(self, keys: list[bytes]) -> None:
        for k in keys:
            self.promised[k] = self.promised.get(k, 0) + 1

    def unpromise(self, keys: list[bytes]) -> None:
        for k in keys:
            n = self.promised.get(k, 0) - 1
            if n > 0:
                self.promised[k] = n
            else:
                self.promised.pop(k, None)

    def referenced(self, b: int) -> int:
        blk = self.blocks.get(b)
        return blk.refs if blk is not None else 0

    @property
    def cached(self) -> int:
        """Blocks holding a prefix."""
        return len(self.blocks)
