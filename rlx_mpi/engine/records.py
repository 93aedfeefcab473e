"""The row as a record: one `Request` from the prompt line to the output line, the step header
as named fields (`StepHeader`), and the per-row state a stage keeps (`RowTable`).

Note: one shape for a row. A request row used to change shape four times on its way (a
`RowSettings`, an ``own`` dict with a ``params`` list, broadcast JSON, a `SamplingParams` found
by key on the last stage). Now stage 0's driver makes one `Request` per row (each of a request's
n samples is a row), broadcasts it as `Request.to_wire` (plain JSON: no pickle on the data path)
and every rank reads it back with `Request.from_wire`. A new per-row feature is a field here
(``constraint`` for a grammar, ``adapter`` for LoRA), not a positional argument through three
drivers.

Note: the row lifecycle. Sampling runs on the last stage, but rows are admitted and ended on
stage 0 (`scheduler.Scheduler`). The step header therefore carries both events to every stage,
in the order stage 0 issues steps: a row's flags say ``ADMITTED`` in the first step that holds
it, and the header lists the keys of the rows that ended since the previous header (at most
``ended_room`` of them; the rest ride in the next header, and the stop header carries what is
left). A `RowTable` on any stage creates a row's state when it is admitted and frees it when it
ends, so per-row state (its sampling, a logits processor such as a grammar mask) lives exactly
as long as the row. Every stage sees every header in issue order, so a row's end always comes
after its last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ..model.stage import StepBatch
from .constraints import Constraint, GrammarMasks
from .sampling import SamplingParams, prompt_key, sample_id, sample_rows

__all__ = ["Request", "StepHeader", "RowState", "RowTable", "ADMITTED", "HEAD", "ROW"]

# the header: HEAD int64 fields, then ROW per row, then the ended rows' keys
HEAD = 8
_KIND, _GROUP, _N, _T, _START, _N_DECODE, _N_OPS, _N_ENDED = range(HEAD)
ROW = 5
SLOT, LENGTH, KEY, INDEX, FLAGS = range(ROW)  # LENGTH: a prefill row's prompt length, a decode row's position
ADMITTED = 1  # FLAGS bit: this is the row's first step
_PREFILL, _DECODE, _MIXED = 1, 2, 4  # (the scheduler's PREFILL, DECODE, MIXED)
_KIND_NAMES = {_PREFILL: "prefill", _DECODE: "decode", _MIXED: "mixed"}


@dataclass(frozen=True)
class Request:
    """One row of a generate job, from its prompt line to its output line."""

    index: int  # the prompt line's position in the file (rows are written in this order)
    id: str  # the line's id (a request's ``custom_id``)
    tokens: tuple[int, ...]  # the prompt's token ids
    sample: int = 0  # which of its request's n samples this row is
    draw_id: str = ""  # what keys its draws (`sampling.sample_id`); "" means ``id``
    max_new_tokens: int = 0  # its own limit (a request's max_tokens); 0: the job's
    stop: tuple[str, ...] = ()  # strings that end it once its decoded text holds one
    sampling: SamplingParams | None = None  # its own sampling; None: the job's
    constraint: Constraint | None = None  # what its text must match (structured output: `constraints`)
    adapter: str | None = None  # room for a LoRA adapter name: None today

    @classmethod
    def rows_of(cls, p: Any, max_new_tokens: int, sampling: SamplingParams, constraint: Any = None) -> list["Request"]:
        """A pending prompt's rows (`io.prompts.Prompt`), one per sample (the scheduler's per-row
        note); a prompt without settings of its own is one row of the job's ``sampling`` and
        ``constraint`` (the job-wide structured output)."""
        s = p.settings
        tokens = tuple(p.tokens)
        adapter = getattr(p, "adapter", None)  # its LoRA adapter (`decoder.lora`); None: the base model
        if s is None:
            return [cls(p.index, p.id, tokens, constraint=constraint, adapter=adapter)]
        limit = p.request["max_new_tokens"] if p.request else (s.max_tokens or max_new_tokens)
        q = s.params(sampling)
        own = q if q != sampling else None  # (rows that sample as the job does keep the batched path)
        c = s.constraint if s.constraint is not None else constraint
        return [cls(p.index, p.id, tokens, j, sample_id(p.id, j), limit, tuple(s.stop), own, c, adapter)
                for j in range(s.n)]

    @property
    def key(self) -> int:
        """The 63-bit key its draws are seeded with and its steps name it by."""
        return prompt_key(self.draw_id or self.id)

    @property
    def kv_salt(self) -> bytes:
        """What besides its tokens changes this row's KV: its prefix-cache keys start from it
        (`block_pool.chain_keys`), so rows that differ in it never share a block. The precision
        is the job's (one salt for all); an adapter is the row's own."""
        return b"" if self.adapter is None else b"adapter\x00" + self.adapter.encode("utf-8")

    def to_wire(self, constraints: dict[str, int] | None = None) -> dict:
        """A JSON object for the start-up broadcast (only the fields that differ from the defaults).
        ``constraints``: a table (`Constraint.key` -> its position in a list the broadcast carries),
        so a schema shared by many rows travels once; the row then names its position."""
        out: dict = {"index": self.index, "id": self.id, "tokens": list(self.tokens)}
        if self.sample:
            out["sample"] = self.sample
        if self.draw_id and self.draw_id != self.id:
            out["draw_id"] = self.draw_id
        if self.max_new_tokens:
            out["max_new_tokens"] = self.max_new_tokens
        if self.stop:
            out["stop"] = list(self.stop)
        if self.sampling is not None:
            s = self.sampling
            out["sampling"] = [s.temperature, s.top_k, s.top_p, s.seed]
        if self.constraint is not None:
            c = self.constraint
            out["constraint"] = c.to_json() if constraints is None else constraints[c.key]
        if self.adapter is not None:
            out["adapter"] = self.adapter
        return out

    @classmethod
    def from_wire(cls, d: dict, constraints: list | None = None) -> "Request":
        """`to_wire`'s inverse; ``constraints``: the broadcast's table, as Constraints in position order."""
        c = d.get("constraint")
        if c is not None:
            c = constraints[c] if isinstance(c, int) else Constraint.from_json(c)
        return cls(int(d["index"]), str(d["id"]), tuple(int(t) for t in d["tokens"]), int(d.get("sample", 0)),
                   str(d.get("draw_id", "")), int(d.get("max_new_tokens", 0)), tuple(d.get("stop", ())),
                   SamplingParams(*d["sampling"]) if "sampling" in d else None, c, d.get("adapter"))


class StepHeader:
    """A step header (int64) read by name: what every stage is told about a step.

    ``kind, group, n, T, start, n_decode, n_ops, n_ended``, then n rows of (slot, length|position,
    key, token index, flags), then the keys of the n_ended rows that ended before this step."""

    __slots__ = ("h",)

    def __init__(self, h: np.ndarray):
        self.h = h

    @staticmethod
    def size(rows: int, ended_room: int) -> int:
        return HEAD + ROW * rows + ended_room

    @classmethod
    def make(cls, kind: int, group: int, T: int, slots, lengths, keys, index, size: int, start: int = 0,
             n_decode: int = 0, n_ops: int = 0, admitted=None, ended=()) -> np.ndarray:
        h = np.zeros(size, np.int64)
        n = len(slots)
        if HEAD + ROW * n + len(ended) > size:
            raise ValueError(f"a step header of {n} rows and {len(ended)} ended keys does not fit {size} int64")
        h[:HEAD] = (kind, group, n, T, start, n_decode, n_ops, len(ended))
        rows = h[HEAD:HEAD + ROW * n].reshape(n, ROW)
        rows[:, SLOT], rows[:, LENGTH], rows[:, KEY], rows[:, INDEX] = slots, lengths, keys, index
        if admitted is not None:
            rows[:, FLAGS] = np.where(np.asarray(admitted, bool), ADMITTED, 0)
        h[HEAD + ROW * n:HEAD + ROW * n + len(ended)] = list(ended)
        return h

    kind = property(lambda self: int(self.h[_KIND]))
    group = property(lambda self: int(self.h[_GROUP]))
    n = property(lambda self: int(self.h[_N]))
    T = property(lambda self: int(self.h[_T]))  # positions per prefill row (a decode row has one)
    start = property(lambda self: int(self.h[_START]))  # a chunk's first position
    n_decode = property(lambda self: int(self.h[_N_DECODE]))  # a MIXED step's decode rows (its first)
    n_ops = property(lambda self: int(self.h[_N_OPS]))  # block ops after the header (a message of their own)
    n_ended = property(lambda self: int(self.h[_N_ENDED]))

    @property
    def rows(self) -> np.ndarray:
        """(n, ROW) int64, a view."""
        n = self.n
        return self.h[HEAD:HEAD + ROW * n].reshape(n, ROW)

    slots = property(lambda self: self.rows[:, SLOT])
    lengths = property(lambda self: self.rows[:, LENGTH])
    keys = property(lambda self: self.rows[:, KEY])
    index = property(lambda self: self.rows[:, INDEX])  # each row's token index (new tokens so far)

    @property
    def final(self) -> np.ndarray:
        """(n,) bool: does the row keep the token this step samples for it? Not a prompt's chunk
        short of its end (the scheduler throws that token away: `Scheduler.complete`)."""
        r, kind = self.rows, self.kind
        if kind == _DECODE:
            return np.ones(len(r), bool)
        keep = self.start + self.T >= r[:, LENGTH]
        if kind == _MIXED:  # its decode rows first
            keep[:self.n_decode] = True
        return keep

    @property
    def admitted(self) -> np.ndarray:
        """The keys of the rows whose first step this is."""
        r = self.rows
        return r[(r[:, FLAGS] & ADMITTED) != 0, KEY]

    @property
    def ended(self) -> np.ndarray:
        """The keys of the rows that ended before this step."""
        at = HEAD + ROW * self.n
        return self.h[at:at + self.n_ended]

    def set_kind(self, kind: int) -> None:
        self.h[_KIND] = kind

    def batch(self, ops: np.ndarray | None = None) -> StepBatch:
        """The step as a stage receives it (`model.stage.StepBatch`), ``ops`` its block ops."""
        return StepBatch(_KIND_NAMES[self.kind], self.slots.copy(), self.lengths.copy(), self.keys.copy(),
                         self.index.copy(), self.start, self.n_decode, ops)


@dataclass
class RowState:
    """What a stage keeps for one live row: its own sampling (None: the job's), its grammar's
    matcher (structured output: `constraints`), and an optional logits processor,
    ``processor(logits_row (V,) float32, token_index)`` applied in place before the draw."""

    key: int
    sampling: SamplingParams | None = None
    grammar: Any = None  # an llguidance matcher, advanced with each token the row keeps
    processor: Callable[[np.ndarray, int], None] | None = None
    extra: dict = field(default_factory=dict)


class RowTable:
    """The live rows of a stage, created and freed by the step headers' events (the lifecycle note).

    ``make(key)`` builds a row's `RowState` when a header admits it; a header's ended keys free
    theirs. A key admitted twice (two live rows with one key) is counted, and freed with its last end."""

    def __init__(self, make: Callable[[int], RowState] | None = None, masks: GrammarMasks | None = None):
        self.make = make or (lambda key: RowState(key))
        self.masks = masks  # the grammar masks of the rows that have a matcher (None: no row has one)
        self._rows: dict[int, RowState] = {}
        self._count: dict[int, int] = {}
        self.admitted = 0  # rows admitted so far
        self.ended = 0  # rows ended so far
        self.own_sampling: dict[int, SamplingParams] = {}  # key -> its own sampling, live rows only

    def on_header(self, h: StepHeader) -> None:
        """Apply a header's events: the ended rows first (their steps are all done), then the admitted."""
        for key in h.ended.tolist():
            self.end(key)
        for key in h.admitted.tolist():
            self.admit(key)

    def admit(self, key: int) -> RowState:
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        self.admitted += 1
        if n == 0:
            state = self._rows[key] = self.make(key)
            if state.sampling is not None:
                self.own_sampling[key] = state.sampling
        return self._rows[key]

    def end(self, key: int) -> None:
        n = self._count.get(key)
        if n is None:
            raise KeyError(f"row key {key} ended but was never admitted on this stage")
        self.ended += 1
        if n > 1:
            self._count[key] = n - 1
            return
        del self._count[key], self._rows[key]
        self.own_sampling.pop(key, None)

    def get(self, key: int) -> RowState | None:
        return self._rows.get(key)

    def processors(self, keys) -> Iterator[tuple[int, Callable]]:
        """(row position, processor) for the rows of ``keys`` that have one."""
        for b, k in enumerate(keys):
            s = self._rows.get(int(k))
            if s is not None and s.processor is not None:
                yield b, s.processor

    def sample(self, logits: np.ndarray, h: StepHeader, params: SamplingParams) -> np.ndarray:
        """The step's tokens (n,) from its rows' logits (n, V): each live row's processor and grammar
        mask first (in place; only on the rows that keep their token: `StepHeader.final`), then each
        row's draw with its own sampling, or ``params`` (`sampling.sample_rows`: a row's token never
        depends on the rows beside it); a grammar's matcher then takes its row's token."""
        keys, index = h.keys, h.index
        for b, proc in self.processors(keys):
            proc(logits[b], int(index[b]))
        constrained: list[tuple[int, Any]] = []
        if self.masks is not None:
            final = h.final
            for b, k in enumerate(keys.tolist()):
                s = self._rows.get(k)
                if s is not None and s.grammar is not None and final[b]:
                    constrained.append((b, s.grammar))
        if constrained:
            positions, matchers = [b for b, _ in constrained], [m for _, m in constrained]
            self.masks.apply(logits, positions, matchers)
        tokens = sample_rows(logits, keys, index, params, self.own_sampling)
        if constrained:
            self.masks.advance(matchers, tokens[positions].tolist())
        return tokens

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        self._rows.clear()
        self._count.clear()
        self.own_sampling.clear()
