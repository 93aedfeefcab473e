"""The plan of a ``generate`` run, as stage 0 keeps it: pure data, testable without MPI.

Note: continuous batching. Prompts are cut into ``groups`` groups of ``batch`` cache slots; a
group's next step (`Scheduler.next_step`) is either a *prefill* of the prompts that just took
a free slot (positions 0..len-1, right-padded) or a *decode* of all its rows (one token each,
at each row's own position). A row that ends (``max_new_tokens``, or an end-of-sequence id)
frees its slot for the next prompt at the group's next turn. With ``recompute`` (kv_cache
"none" on some stage) every step is a prefill of each row's whole sequence so far. A step
travels the pipeline as a small int64 header (`make_header`/`read_header`: kind, group, rows,
T, start, decode rows; per row: slot, length|position, prompt key, token index); the decode ring
that moves it is `rlx_mpi.drivers.generate`.

Note: chunked prefill (``prefill_chunk`` C > 0). A group whose rows are all new prefills them C
positions per turn (steps with ``start`` 0, C, 2C, ...; each row's length in the header is its
whole prompt's, so a stage knows which chunk ends which row), and the other groups' decode steps
run between its chunks: in a pipeline a whole prompt's prefill held every stage behind it for
its full length (the other stages idled), a chunk costs about what a decode step does. A row's
token is sampled from the chunk that holds its prompt's last position; a row whose prompt ended
in an earlier chunk waits for the group's longer ones. No chunking under ``recompute``.

Note: MIXED steps. New rows admitted beside rows already decoding (a row ended, the next prompt
took its slot) are prefilled a chunk per turn *in the same step* as the decoding rows' next
token: the step's token rows are the decode rows' tokens, then each new row's chunk, and every
weight matrix is read once for both (`Stage.mixed`). Before, the new rows were prefilled whole
in a step of their own and the group's decoding rows waited for it. Rows admitted in the same
turn (a cohort) still start decoding together: one whose prompt ended in an earlier chunk waits
for the cohort's longer ones. Measured (bench_join, one rank, batch 8, prompts of 32-256
tokens, chunk 64): letting it decode meanwhile made the group's rows end at different steps,
so later prompts joined one by one and were prefilled in many small chunks instead of a few
wide ones, 0.92x the tokens/s on 2 cores where prefill is compute-bound. A Stage without
chunked prefill gets no MIXED step (its new rows are prefilled whole, as before).

Note: the step budget. A MIXED step carries at most ``prefill_chunk`` prefill positions in all
(as vLLM's ``max_num_batched_tokens`` bounds a step): the rows furthest behind take the chunk
one or more at a time (at least one), so a decoding row waits at most one decode step plus one
chunk's compute for its next token, however many rows joined at once. Before, each new row
brought a chunk of its own: 7 rows joining a group of 8 made a step of 7 x 64 positions, and the
decoding row waited 1.2 s against a median of 0.1 s (bench_join, one rank, chunk 64, rows
ending at their EOS; 0.56 s with the budget, at 0.95x the tokens/s).

Note: per-row limits and stop strings. A queued item may carry a fourth element, the row's own
``{"key", "max_new_tokens", "stop", "sample"}`` (a line's own settings, `batch_io`): ``key``
the id its draws are keyed by (`sampling.sample_id`: the n samples of one request draw apart),
``max_new_tokens`` its limit, ``stop`` strings that end it (finish_reason "stop") as soon as its
decoded text holds one. The text is decoded on stage 0 by ``decode`` (every rank of the first
stage decodes the same tokens the same way, so they agree on when a row ends); only the row's
last tokens are decoded each step (`Scheduler._stopped`).

Note: riding. A group whose rows are all new (all of them ended together, or at start-up) has no
decoding rows of its own to mix with: while at least ``stages`` other groups decode, it issues no
step (parked) and its chunks ride in their decode steps instead, one chunk in flight at a time
(`Scheduler.riding`), so each chunk shares a pass over the weights with a decode step. With
fewer decoding groups than stages it prefills in steps of its own, which keep the stages busy
(a parked group would leave a stage idle). The driver offers every group without a step in flight
a turn after each completed step, so a parked group starts decoding once its rows are prefilled.

Note: the prefix cache (``pool``, a `block_pool.BlockPool`; docs/prefix-cache.md). A prompt
admitted attaches the cached full blocks it begins with (up to its last position, whose logits
are sampled): its ``filled`` starts there, so its prefill is a later chunk from the first
uncached position, and the step carries ATTACH ops (pool block -> slot, before the step). A
step whose prefill completes prompt blocks publishes them and carries their SAVE ops (slot ->
pool block, made during the step): a step issued later may attach them, as every stage runs the
steps in the order stage 0 issues them. A prompt whose next block is being computed by a row
admitted before (promised) waits for it; the unrelated prompts behind it take the free slots
meanwhile (`_admit_next`). The ops travel after the header in a message of their own
(header[6] = their count): the stages copy blocks and never decide anything about the cache.

Note: paged rows (``paged``: the stages' full layers read through block tables, `block_pool`'s
paged-rows note). A prompt is admitted when the blocks of its prompt and new tokens fit the pool
besides the cached blocks it attaches (`admit_blocks`: the KV budget in blocks, not slots), so
``batch`` bounds the rows of a group and the pool bounds them by what they use; its step carries
SET ops (its own blocks: table entries) beside the ATTACH ones, and a completed prompt block is
adopted as the cached block (its SAVE names the row's own block: a ring layer copies it).
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import admission
from .admission import admit_blocks, row_blocks  # noqa: F401 (the block budget: admission's)
from .block_pool import BlockPool
from ..model.kv_cache import ATTACH, SAVE, SET
from .records import Request, StepHeader

__all__ = ["PREFILL", "DECODE", "STOP", "MIXED", "ATTACH", "SAVE", "Seq", "Step", "Scheduler", "make_header",
           "read_header", "chunk_start", "decode_rows", "block_ops", "split_batch", "row_blocks", "admit_blocks",
           "as_request"]

PREFILL, DECODE, STOP, MIXED = 1, 2, 3, 4
# the step header's fields and its per-row columns: `records.StepHeader` (the row lifecycle note there)
_LOOKAHEAD = 64  # queued prompts looked at for a free slot while those before them wait (`Scheduler._admit_next`)


@dataclass
class Seq:
    """One prompt while it holds a cache slot."""

    index: int  # position in the prompt file
    id: str
    prompt: tuple[int, ...]
    slot: int
    key: int  # its request's key (`records.Request.key`): seeds its draws, names it in step headers
    new: list[int] = field(default_factory=list)
    logprobs: list[tuple] = field(default_factory=list)  # per new token (chosen_lp, top_ids, top_lp) with --logprobs
    prefilled: bool = False
    filled: int = 0  # positions in the cache so far, while a chunked prefill is under way
    cohort: int = 0  # rows admitted in the same turn share it and start decoding together (the MIXED note)
    start: float = 0.0  # perf_counter when it took the slot
    last: float = 0.0  # perf_counter when its latest token came back
    finish_reason: str | None = None
    max_new_tokens: int = 0  # its own limit (a batch request's max_tokens); 0: the scheduler's
    stop: tuple[str, ...] = ()  # strings that end it when its decoded text holds one (the stop note)
    sample: int = 0  # which of its request's n samples it is
    keys: list = field(default_factory=list)  # the hash-chain keys of its prompt's full blocks (prefix cache)
    blocks: list[int] = field(default_factory=list)  # cached blocks it attached or adopted (it references each)
    next_block: int = 0  # its prompt's blocks before this one are cached or published (the rest it promised)
    table: list[int] = field(default_factory=list)  # paged: the pool block of each of its positions' blocks
    own: list[int] = field(default_factory=list)  # paged: its blocks not (yet) cached, given back when it ends
    request: Request | None = None  # the record it was admitted from
    announced: bool = False  # a step header has told the stages it is admitted (the row lifecycle)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.new)


@dataclass
class Step:
    """What one group computes next, as stage 0 issues it."""

    kind: int  # PREFILL | DECODE
    group: int
    rows: list[Seq]
    ids: np.ndarray  # (n, T) int64: stage 0's input; MIXED (1, N): the token rows back to back
    header: np.ndarray  # int64 (`Scheduler.header_size`,)
    start: int = 0  # a prefill chunk's first position (chunked prefill)
    tokens: np.ndarray | None = None  # (n,) once sampled; (n, 2 + 2K) `sampling.pack_sampled` with --logprobs K
    ops: np.ndarray | None = None  # (m, 4) int64 block ops (kind, slot, block index, pool id); header[6] = m
    pending: Any = None  # the posted receive of the tokens (pipelines of 2+ stages)

    @property
    def T(self) -> int:
        """Positions per prefill row (a decode row has one), as the header says."""
        return int(self.header[3])

    @property
    def n_decode(self) -> int:
        """MIXED: the first n_decode rows decode, the others prefill a chunk (0 otherwise)."""
        return decode_rows(self.header)


make_header = StepHeader.make


def read_header(h: np.ndarray) -> tuple[int, int, int, int, np.ndarray]:
    """(kind, group, n, T, rows (n, `records.ROW`)); the rest by name: `records.StepHeader`."""
    v = StepHeader(h)
    return v.kind, v.group, v.n, v.T, v.rows


def chunk_start(h: np.ndarray) -> int:
    """A prefill step's first position (0 unless it is a later chunk of a chunked prefill)."""
    return StepHeader(h).start


def decode_rows(h: np.ndarray) -> int:
    """A MIXED step's decode rows (its first rows; the others prefill a chunk)."""
    return StepHeader(h).n_decode


def split_batch(rows: int, groups: int, batch: int) -> int:
    """The slots per group that give every group rows: ``batch``, cut to ceil(rows / groups)
    when fewer rows are queued than ``groups`` x ``batch``.

    Why: the slots of a group are filled before the next group's, so 8 rows with ``batch`` 8 and
    2 groups made one group and left the other empty: the two stages took turns (0.54x one rank
    with two threads, where ``--batch 4`` gave 0.74x; issue #34). A smaller group never costs
    memory (fewer slots) nor changes a row (rows are batch-invariant). With replicas, ``groups``
    counts every replica's. E.g. ``split_batch(8, 2, 8) == 4``, ``split_batch(9, 2, 8) == 5``,
    ``split_batch(100, 2, 8) == 8``."""
    if rows < 1 or groups < 1 or batch < 1:
        return batch
    return min(batch, -(-rows // groups))


def block_ops(h: np.ndarray) -> int:
    """How many block ops (rows of 4 int64) follow the header in a message of their own."""
    return StepHeader(h).n_ops


def as_request(item: Request | tuple) -> Request:
    """A queued prompt as its record; a bare ``(index, id, tokens)`` (tests, benches) is a row of
    the job's settings."""
    if isinstance(item, Request):
        return item
    index, pid, tokens = item
    return Request(int(index), str(pid), tuple(int(t) for t in tokens))


def _next_chunk(fresh: list[Seq], budget: int = 0) -> tuple[list[Seq], int]:
    """The rows a group's next chunk prefills, and its first position: those furthest behind
    (a row admitted later catches up with the others first). ``budget`` > 0 (a MIXED step): only
    as many of them as fit that many positions in all, at least one (the step-budget note)."""
    start = min(r.filled for r in fresh)
    behind = [r for r in fresh if r.filled == start]
    if budget:
        T = min(budget, max(r.length for r in behind) - start)  # the chunk's width, as `Scheduler._mixed` takes it
        behind = behind[:max(1, budget // T)]
    return behind, start


def _fill_chunk(ids: np.ndarray, seqs: list[tuple[int, ...]], start: int) -> np.ndarray:
    """Positions start..start+T-1 of each sequence into ids (rows, T), right-padded with 0
    (padding is never attended to)."""
    T = ids.shape[1]
    for b, seq in enumerate(seqs):
        part = seq[start:start + T]
        ids[b, :len(part)] = part
    return ids


class Scheduler:
    """Which prompt takes which slot, and what each group computes next (continuous batching).

    ``prompts``: (index, id, tokens) in file order, not yet done. A row ends at any id of
    ``eos_ids`` (a checkpoint may name several: Llama 3's ``<|eot_id|>`` and ``<|end_of_text|>``).
    With ``recompute`` (kv_cache "none" on some stage) every step is a prefill of each row's
    whole sequence so far. ``prefill_chunk`` > 0: positions per prefill step of a group whose
    rows are all new (the chunked-prefill note); with ``mixed`` (the stages implement
    `Stage.mixed`) new rows beside decoding rows are prefilled that way too, in MIXED steps,
    and a group whose rows are all new rides its chunks in the steps of other groups while at
    least ``stages`` of them decode (the riding note).
    """

    def __init__(self, prompts: list[Request], groups: int, batch: int,
                 max_new_tokens: int, eos_ids: frozenset[int], recompute: bool, prefill_chunk: int = 0,
                 mixed: bool = False, stages: int = 1, feed: Any = None,
                 decode: Callable[[list[int]], str] | None = None, pool: BlockPool | None = None,
                 paged: bool = False):
        self.decode = decode  # token ids -> text, for rows with stop strings (the stop note)
        self.pool = None if recompute else pool  # the prefix cache's bookkeeping (the prefix-cache note)
        self.paged = paged and self.pool is not None  # rows' blocks from the pool too (the paged-rows note)
        self.peak_rows = 0  # the most rows held at once (decoding or prefilling)
        self._ops: list[tuple[int, int, int, int]] = []  # attaches waiting for the next step issued
        self._waiting: dict[int, tuple] = {}  # queued prompts waiting for a promised block (`_admit`)
        self.prompt_tokens = 0  # prompt positions of the rows admitted
        self.reused = 0  # of them, attached from the prefix cache
        self.chunk = 0 if recompute else prefill_chunk
        self.mixed = mixed and bool(self.chunk)
        self.stages = stages
        self.riding = [False] * groups  # a chunk of the group is in flight in another group's step
        self.issued = [False] * groups  # the group's own step is in flight
        self.turns = 0  # turns taken (a row's cohort)
        self.queue = deque(as_request(p) for p in prompts)
        self.feed = feed  # () -> more prompts as ``prompts``, [] when there are no more (replicas share a list)
        self.groups, self.batch = groups, batch
        self.max_new_tokens, self.eos_ids, self.recompute = max_new_tokens, frozenset(eos_ids), recompute
        self.rows: list[list[Seq | None]] = [[None] * batch for _ in range(groups)]
        self.stopping = False
        # a step may carry a rider's rows; room for the keys of every slot's row ending before it
        self.ended_room = groups * batch
        self.header_size = StepHeader.size(batch * (2 if self.mixed else 1), self.ended_room)
        self._ended: deque[int] = deque()  # keys of rows ended, not yet told in a header (the row lifecycle)
        self.prefill_steps = 0  # steps that carried prefill positions (MIXED ones too)
        self.gaps = array("d")  # seconds between a row's decode tokens (`token_gaps_ms`): 8 bytes each

    def next_step(self, g: int) -> Step | None:
        """Group ``g``'s next step (admitting queued prompts into free slots), or None when it has
        none: idle, parked, stopping, or a step of its own or a chunk of it is in flight."""
        if self.stopping or self.riding[g] or self.issued[g]:  # finish the steps in flight, start none
            return None
        step = self._next(g)
        self.issued[g] = step is not None
        if step is not None and self.pool is not None:
            self._block_ops(step)
        return step

    def _admit_next(self, g: int, slot: int) -> Seq | None:
        """The first of the next `_LOOKAHEAD` queued prompts that need not wait for a prefix being
        computed (`_admit`), taken out of the queue; None when all of them wait. Rows may so start
        out of file order (the journal writes them in order): a prompt that waits for another row's
        prefill does not hold the free slots from the unrelated prompts behind it."""
        for k in range(min(len(self.queue), _LOOKAHEAD if self.pool is not None else 1)):
            r = self._admit(self.queue[k], g, slot)
            if r is not None:
                del self.queue[k]
                return r
        return None

    def _admit(self, item: Request, g: int, slot: int) -> Seq | None:
        """A queued prompt as the row of ``slot``, its cached prefix attached; None (it waits) when
        the next block it could attach is being computed by a row admitted before (promised)."""
        tokens = item.tokens
        keys, ids = [], []
        pool = self.pool
        if pool is not None:  # (the shared admission path: `admission`)
            memo = self._waiting.get(id(item))  # (item, its keys, the promised key it waits for)
            if memo is not None and memo[0] is item and memo[2] in pool.promised:
                return None  # (still waiting: no new hashing or matching)
            # at least the last position is computed: its logits are sampled
            keys, ids, waits = admission.lookup(pool, tokens, (len(tokens) - 1) // pool.size,
                                                memo[1] if memo is not None and memo[0] is item else None,
                                                salt=item.kv_salt)
            if waits is not None:
                self._waiting[id(item)] = (item, keys, waits)
                return None
            self._waiting.pop(id(item), None)
        blocks: list[int] = []
        if self.paged:
            got = admit_blocks(pool, ids, len(tokens), item.max_new_tokens or self.max_new_tokens)
            if got is None:  # (its blocks do not fit yet: it waits for rows to end; its keys kept)
                self._waiting[id(item)] = (item, keys, None)
                return None
            blocks = got
        r = Seq(item.index, item.id, tokens, slot, item.key, start=time.perf_counter(), cohort=self.turns,
                max_new_tokens=item.max_new_tokens, stop=item.stop, sample=item.sample, request=item)
        self.prompt_tokens += len(tokens)
        if pool is not None:
            held, ops = admission.attach(pool, keys, ids, slot, acquired=self.paged)  # (admit_blocks acquired them)
            r.keys, r.blocks, r.next_block = held.keys, held.blocks, held.next_block
            r.filled = len(ids) * pool.size  # its prefill starts after the attached blocks (a later chunk)
            self.reused += r.filled
            self._ops += ops
            if self.paged:
                r.table, r.own = ids + blocks, list(blocks)
                self._ops += [(SET, slot, len(ids) + j, b) for j, b in enumerate(blocks)]
        return r

    def _block_ops(self, step: Step) -> None:
        """The step's block ops: the attaches waiting, then a SAVE of each prompt block its prefill
        rows complete (published now: a step issued later may attach them, the stages run steps in
        order), each into a block the pool hands out."""
        pool, ops = self.pool, self._ops
        self._ops = []
        if step.kind != DECODE:
            end = step.start + step.T
            for r in step.rows[step.n_decode:]:  # (prompt blocks whose positions are all computed)
                held = admission.Held(r.keys, r.blocks, r.next_block)
                ops += admission.publish(pool, held, r.prompt, r.slot, min(end, len(r.prompt)),
                                         r.table if self.paged else None, r.own)
                r.next_block = held.next_block
        if ops:
            step.ops = np.array(ops, np.int64).reshape(-1, 4)
            step.header[6] = len(ops)  # (`records.StepHeader.n_ops`)

    def _release(self, r: Seq) -> None:
        """A row that ended: its references dropped, its promises withdrawn."""
        if self.pool is not None:
            admission.release(self.pool, admission.Held(r.keys, r.blocks, r.next_block), r.own)
            r.blocks, r.next_block, r.own = [], len(r.keys), []

    def _next(self, g: int) -> Step | None:
        rows = self.rows[g]
        self.turns += 1
        for i, r in enumerate(rows):
            if r is None and not self.queue and self.feed is not None:  # a free slot: the next chunk
                self.queue.extend(self.feed() or ())
                if not self.queue:
                    self.feed = None
            if r is None and self.queue:
                rows[i] = self._admit_next(g, g * self.batch + i)
        live = [r for r in rows if r is not None]
        self.peak_rows = max(self.peak_rows, sum(r is not None for rs in self.rows for r in rs))
        fresh = [r for r in live if not r.prefilled]
        if self.recompute and live:
            return self._prefill(g, live)
        decoding = [r for r in live if r.prefilled]
        if fresh and self.chunk and (self.mixed or not decoding or any(r.filled for r in fresh)):
            chunk, start = _next_chunk(fresh)
            if self.mixed:  # rows admitted before them take their token in the same step
                cohorts = {r.cohort for r in fresh}
                if older := [r for r in decoding if r.cohort not in cohorts]:
                    return self._mixed(g, older, *_next_chunk(fresh, self.chunk))
                if not decoding and self._decoding_groups(g) >= self.stages:
                    return None  # parked: its chunks ride in the decoding groups' steps (`_rider`)
            return self._prefill(g, chunk, start, self.chunk)
        if fresh:  # new prompts first; the group's other rows wait one turn
            if any(r.filled for r in fresh):  # a cached prefix attached: from the rows furthest behind
                return self._prefill(g, *_next_chunk(fresh))
            return self._prefill(g, fresh)
        if not live:
            return None
        if self.mixed and (rider := self._rider(g)) is not None:
            h, chunk, start = rider
            self.riding[h] = True
            return self._mixed(g, live, chunk, start)
        ids = np.array([[r.new[-1]] for r in live], np.int64)  # (n, 1): the newest token
        return Step(DECODE, g, live, ids, self._header(DECODE, g, 1, live, [r.length - 1 for r in live]))

    def _decoding_groups(self, g: int) -> int:
        """How many groups other than ``g`` have rows decoding (each will issue steps again)."""
        return sum(any(r is not None and r.prefilled for r in rows) for h, rows in enumerate(self.rows) if h != g)

    def _rider(self, g: int) -> tuple[int, list[Seq], int] | None:
        """A parked group's next chunk for group ``g``'s decode step: (group, rows, start)."""
        for h, rows in enumerate(self.rows):
            live = [r for r in rows if r is not None]
            if h == g or self.riding[h] or self.issued[h] or not live or any(r.prefilled for r in live):
                continue
            if self._decoding_groups(h) < self.stages:  # too few left to keep the stages busy: its own steps
                continue
            return (h, *_next_chunk(live, self.chunk))
        return None

    def _prefill(self, g: int, rows: list[Seq], start: int = 0, chunk: int = 0) -> Step:
        """Rows' positions start.. (all of them, or at most ``chunk``), right-padded."""
        seqs = [r.prompt + tuple(r.new) for r in rows]
        T = max(map(len, seqs)) - start
        if chunk:
            T = min(T, chunk)
        ids = _fill_chunk(np.zeros((len(rows), T), np.int64), seqs, start)
        header = self._header(PREFILL, g, T, rows, [len(s) for s in seqs], start)
        self.prefill_steps += 1
        return Step(PREFILL, g, rows, ids, header, start=start)

    def _mixed(self, g: int, decoding: list[Seq], rows: list[Seq], start: int) -> Step:
        """The decoding rows' next tokens and positions start.. (at most ``chunk``) of ``rows``,
        in one step: ids (1, N), the decode tokens then each row's T positions, right-padded."""
        nd, seqs = len(decoding), [r.prompt + tuple(r.new) for r in rows]
        T = min(max(map(len, seqs)) - start, self.chunk)
        ids = np.zeros(nd + len(rows) * T, np.int64)
        ids[:nd] = [r.new[-1] for r in decoding]
        _fill_chunk(ids[nd:].reshape(len(rows), T), seqs, start)  # (a view of ids)
        both = decoding + rows
        header = self._header(MIXED, g, T, both, [r.length - 1 for r in decoding] + list(map(len, seqs)), start, nd)
        self.prefill_steps += 1
        return Step(MIXED, g, both, ids[None], header, start=start)

    def _header(self, kind: int, g: int, T: int, rows: list[Seq], lengths: list[int], start: int = 0,
                n_decode: int = 0) -> np.ndarray:
        """A step's header: its rows (those not yet announced flagged admitted) and the keys of the
        rows ended since the last header, as many as it has room for (the row lifecycle note)."""
        admitted = [not r.announced for r in rows]
        for r in rows:
            r.announced = True
        ended = [self._ended.popleft() for _ in range(min(len(self._ended), self.ended_room))]
        return make_header(kind, g, T, [r.slot for r in rows], lengths, [r.key for r in rows],
                           [len(r.new) for r in rows], self.header_size, start, n_decode, admitted=admitted, ended=ended)

    def stop_header(self) -> np.ndarray:
        """The STOP header, with the keys of the rows ended since the last step's header."""
        return self._header(STOP, 0, 0, [], [])

    def complete(self, step: Step, tokens: np.ndarray, logprobs: tuple | None = None) -> list[Seq]:
        """Append each row's new token (and its ``logprobs``: `sampling.logprobs`' arrays, one
        row each); return the rows that finished (their slots are free)."""
        done, now = [], time.perf_counter()
        self.issued[step.group] = False
        for b, (r, t) in enumerate(zip(step.rows, tokens.tolist())):
            g = r.slot // self.batch  # (a rider's rows belong to another group than the step's)
            if step.kind == MIXED and b >= step.n_decode:
                self.riding[g] = False
            if step.kind != DECODE and b >= step.n_decode and step.start + step.T < r.length:  # a chunk short of its end
                r.filled = step.start + step.T
                continue
            if len(r.new) >= 2:  # (not the first gap: at start-up it holds the other groups' prefills)
                self.gaps.append(now - r.last)
            r.new.append(int(t))
            r.last = now
            if logprobs is not None:
                r.logprobs.append(tuple(a[b] for a in logprobs))
            r.prefilled = True
            if t in self.eos_ids or (r.stop and self._stopped(r)):
                r.finish_reason = "stop"
            elif len(r.new) >= (r.max_new_tokens or self.max_new_tokens):
                r.finish_reason = "length"
            if r.finish_reason:
                self.rows[g][r.slot - g * self.batch] = None
                self._release(r)
                self._ended.append(r.key)
                done.append(r)
        return done

    def _stopped(self, r: Seq) -> bool:
        """Does the row's text now hold one of its stop strings? Only the tail is decoded: a stop
        string of L characters lies within the last 4L tokens (a character is at most 4 byte
        tokens), and the row ended at the first token that completed one."""
        tail = r.new[-(4 * max(map(len, r.stop)) + 8):]
        text = self.decode(tail)
        return any(s in text for s in r.stop)

    def token_gaps_ms(self) -> dict | None:
        """Median, 99th percentile and largest time between a row's consecutive decode tokens
        (the second and later gaps of each row: the wait a reader of a decoding row sees; another
        group's long prefill on the same stages shows as a large max)."""
        if not self.gaps:
            return None
        q = np.percentile(np.frombuffer(self.gaps) * 1e3, [50, 99, 100])
        return {"median": round(float(q[0]), 2), "p99": round(float(q[1]), 2), "max": round(float(q[2]), 2)}

    @property
    def idle(self) -> bool:
        return not self.queue and self.feed is None and all(r is None for g in self.rows for r in g)
