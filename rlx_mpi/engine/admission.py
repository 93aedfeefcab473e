"""One admission path for ``generate`` and ``score``: prefix lookup, waiting, block ops.

Pure data, testable without MPI. Both commands admit a queued sequence (a prompt, a line to
score) the same way: look up the cached blocks its tokens begin with (`BlockPool.match`), wait
while the next block it could attach is being computed by a sequence admitted before it
(promised), else attach them (ATTACH ops, references held) and promise the rest; as its prefill
completes blocks, publish them (SAVE ops); when it is done, drop its references and promises.
`generate`'s `scheduler.Scheduler` takes these steps per cache slot as slots free (``_admit``,
``_block_ops``, ``_release``); `score` per round (`plan_reuse`: waves of microbatches, each
computed after the ones it attaches from).

Note: the score plan. Score keeps no row past its microbatch, so every rank plans the same
microbatches from the same rounds with its own `BlockPool` (pure, the same on every rank of a
replica: the ops never travel). A round's lines are taken in waves: a line whose next block is
promised by a line of an earlier wave waits for the next wave, so a context shared by a round's
lines is computed once, by its first line (as generate's promised blocks). A wave is sorted by
blocks attached (most first), then packed into microbatches of at most the round's budget of
computed positions (rows x widest suffix) of lines that attach as many blocks (a prefill chunk
starts at one position for all its rows: a row that attached less would make the others compute
what they attached). Every stage computes a round's microbatches in order
(`schedule.forward_schedule`), so a block saved by microbatch m is in the pool before microbatch
m' > m attaches it, and the references a microbatch holds are dropped once it is planned
(nothing computed later reads its slots). A line attaches at most the blocks before its first
scored token's previous position (whose logits score it), and its log-probs are the same bits
whatever it attached (`docs/invariance.md`: a row's numbers do not depend on its chunking), so
the plan is free to depend on the pool, and so on the replica count, while the rounds
(`drivers.score.plan_rounds`) do not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_pool import BlockPool
from ..model.kv_cache import ATTACH, SAVE

__all__ = ["Held", "lookup", "attach", "publish", "release", "row_blocks", "admit_blocks", "ReuseMicrobatch",
           "plan_reuse"]


@dataclass
class Held:
    """What one admitted sequence holds of the pool: its blocks' keys, the blocks it attached
    (a reference each) and the first block it has not published (those after it are promised)."""

    keys: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    next_block: int = 0


def lookup(pool: BlockPool, tokens: tuple, cap: int, keys: list | None = None,
           salt: bytes = b"") -> tuple[list, list, bytes | None]:
    """(keys, ids, waits_for): the hash-chain ``keys`` of ``tokens``' full blocks (from ``salt``: a
    row's `records.Request.kv_salt`), the ``ids`` of the cached blocks they begin with (at most
    ``cap``), and the promised key of the next block when a sequence admitted before is computing it
    (then wait for it: None otherwise)."""
    keys = pool.keys(tokens, salt) if keys is None else keys
    ids = pool.match(tokens, keys)[:cap]
    waits = keys[len(ids)] if len(ids) < cap and keys[len(ids)] in pool.promised else None
    return keys, ids, waits


def attach(pool: BlockPool, keys: list, ids: list, slot: int, acquired: bool = False) -> tuple[Held, list]:
    """Admit a sequence into ``slot`` with cached blocks ``ids``: references taken (unless
    ``acquired``: `admit_blocks` took them), the rest of its blocks promised; (what it holds, its
    ATTACH ops). ``pool.hits`` counts the positions."""
    if not acquired:
        pool.touch(ids)
        pool.acquire(ids)
    pool.promise(keys[len(ids):])
    pool.hits += len(ids) * pool.size
    return Held(keys, list(ids), len(ids)), [(ATTACH, slot, j, b) for j, b in enumerate(ids)]


def publish(pool: BlockPool, held: Held, tokens: tuple, slot: int, computed: int, table: list | None = None,
            own: list | None = None) -> list:
    """A prefill has computed positions 0..computed-1 of ``tokens``: its blocks complete by then are
    published (promises kept), each into a block the pool hands out; their SAVE ops. A paged row
    (its block ``table``, the blocks it ``own``s) publishes its own block instead: adopted as the
    cached one, no copy (a ring layer still copies it), moved from ``own`` to what it holds."""
    ops = []
    done = min(computed // pool.size, len(held.keys))
    for j in range(held.next_block, done):
        block, parent = tokens[j * pool.size:(j + 1) * pool.size], held.keys[j - 1] if j else b""
        if table is not None:
            b = table[j] if pool.adopt(held.keys[j], block, parent, table[j]) else None
            if b is not None:
                own.remove(b)
                held.blocks.append(b)
        else:
            b = pool.publish(held.keys[j], block, parent)
        pool.unpromise(held.keys[j:j + 1])
        if b is not None:
            ops.append((SAVE, slot, j, b))
    held.next_block = max(held.next_block, done)
    return ops


def release(pool: BlockPool, held: Held, own: list = ()) -> None:
    """The sequence is done: its references dropped, its promises withdrawn, the blocks it ``own``s
    (a paged row's, not published) back to the pool."""
    pool.release(held.blocks)
    pool.unpromise(held.keys[held.next_block:])
    if own:
        pool.give_back(own)
    held.blocks, held.next_block = [], len(held.keys)


def row_blocks(prompt: int, max_new: int, size: int) -> int:
    """Blocks a paged row needs: every position it writes, its prompt's and all but its last new
    token's (the last is sampled, never fed back), rounded up to whole blocks."""
    return -(-(prompt + max(max_new, 1) - 1) // size)


def admit_blocks(pool: BlockPool, ids: list[int], prompt: int, max_new: int) -> list[int] | None:
    """The block-budget admission of a paged row (`scheduler`'s paged-rows note; the call any admission path
    makes before it takes a slot for a row): with the cached blocks
    ``ids`` it attaches, does the rest of its `row_blocks` fit the pool? If so they are acquired
    and its own blocks allocated (returned, for its positions after ``ids``); None (nothing taken)
    when they do not fit: it waits for rows to end. Short rows take few blocks, so more of them
    decode at once under the same budget."""
    need = row_blocks(prompt, max_new, pool.size) - len(ids)
    if pool.available(ids) < need:
        return None
    pool.touch(ids)
    pool.acquire(ids)
    return pool.allocate(max(need, 0))


@dataclass(frozen=True)
class ReuseMicrobatch:
    """One microbatch of a score round under the prefix cache: its lines (positions in the pending
    list), each line's cache slot is its row; positions ``start``..``start + width - 1`` are
    computed (0..start-1 are attached), ``ops`` (m, 4) the block ops of `kv_cache.copy_blocks`."""

    lines: tuple[int, ...]
    start: int
    width: int
    ops: tuple[tuple[int, int, int, int], ...] = ()


def plan_reuse(lines: list[tuple[int, tuple, int]], pool: BlockPool, budget: int,
               per_round: int, max_rows: int, min_tokens: int = 0) -> list[ReuseMicrobatch]:
    """A score round's microbatches under the prefix cache (the score-plan note): ``lines`` are
    (pending position, tokens, first scored token), in file order; at most ``max_rows`` rows (the
    cache's slots) and ``budget`` computed positions (rows x width) a microbatch, and the round
    cut into ``per_round`` microbatches where its positions allow (a pipeline's stages all get
    work) while they keep ``min_tokens`` positions. Updates ``pool`` as the stages will."""
    if budget < 1 or per_round < 1 or max_rows < 1:
        raise ValueError(f"budget, per_round and max_rows must be >= 1, got {budget}, {per_round}, {max_rows}")
    out: list[ReuseMicrobatch] = []
    left, keys = list(lines), {}
    while left:
        wave, wait = [], []
        for k, tokens, s in left:
            # the logits of position s-1 score token s: at most the blocks before it are attached
            ks, ids, waits = lookup(pool, tokens, (s - 1) // pool.size, keys.get(k))
            keys[k] = ks
            if waits is not None:  # (promised by a line of this wave: the earlier waves are published)
                wait.append((k, tokens, s))
                continue
            held, _ = attach(pool, ks, ids, -1)  # referenced until packed: no save of the wave evicts them
            wave.append((k, tokens, held))
        out += _pack(wave, pool, budget, per_round, max_rows, min_tokens)
        left = wait
    return out


def _pack(wave: list, pool: BlockPool, budget: int, per_round: int, max_rows: int,
          min_tokens: int) -> list[ReuseMicrobatch]:
    """A wave's lines, most attached first (then longest suffix), cut into microbatches; each line's
    blocks published and its references dropped as its microbatch is planned."""
    B = pool.size

    def have(w: tuple) -> int:  # positions a line attaches
        return len(w[2].blocks) * B

    wave = sorted(wave, key=lambda w: (-have(w), -(len(w[1]) - have(w)), w[0]))
    total = sum(len(w[1]) - have(w) for w in wave)
    widest = max(len(w[1]) - have(w) for w in wave)
    # (a few rows run the decode products, one pass over the weights each: a round of short
    # suffixes cut per_round ways would read the weights per_round times for little compute)
    cap = min(budget, max(widest, -(-total // per_round), min_tokens))
    out, i = [], 0
    while i < len(wave):
        j, start = i + 1, have(wave[i])
        # (a row that attached less would make its microbatch's rows compute what they attached)
        while j < len(wave) and j - i < max_rows and have(wave[j]) == start:
            if (j + 1 - i) * (max(len(w[1]) for w in wave[i:j + 1]) - start) > cap:
                break
            j += 1
        rows, ops = wave[i:j], []
        for slot, (k, tokens, held) in enumerate(rows):
            ops += [(ATTACH, slot, j_, b) for j_, b in enumerate(held.blocks)]  # (start // B of them)
            ops += publish(pool, held, tokens, slot, len(tokens))
            release(pool, held)  # (every stage computes the microbatches in order: the planning note)
        out.append(ReuseMicrobatch(tuple(r[0] for r in rows), start, max(len(r[1]) for r in rows) - start, tuple(ops)))
        i = j
    return out
