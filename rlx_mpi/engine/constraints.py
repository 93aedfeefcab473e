"""Structured output: a row's constraint (a JSON schema, a regex, a choice, a grammar) as a token
mask before each of its draws, with llguidance (``pip install 'rlx_mpi[structured]'``).

A request asks for structure the way OpenAI's and vLLM's APIs do (`from_request`):

* ``"response_format": {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``,
  or ``{"type": "json_object"}`` (any JSON object), or ``{"type": "text"}`` (none);
* vLLM's ``"structured_outputs"`` with exactly one of ``json`` (a schema), ``regex``, ``choice``
  (a list of strings), ``grammar`` (GBNF or Lark) and ``json_object``.

Each becomes one `Constraint`, a record of plain JSON that travels with the row (`records.Request`)
and is in its digest, so a resume refuses a line whose constraint changed.

Note: where the mask applies. On the last stage, every constrained row of a step has a matcher
(an ``llguidance.LLMatcher`` made when the header admits the row and freed when it ends:
`records.RowTable`). Before the draw, the matchers fill one bitmask for the step's constrained rows
(in parallel, without the GIL: ``LLExecutor``) and `kernels.bitmask.apply_bitmask` sets the
logits of the tokens the grammar does not allow to -inf; the draw (greedy or sampled, any n) then
picks an allowed token, and ``--logprobs`` reports the constrained distribution. The matcher
advances with the chosen token. A chunk of a prompt short of its end samples a token that is
thrown away: its row is neither masked nor advanced. The mask is a function of the row's own
tokens, so a row is the same bits whatever rows share its step, stage or replica.

Note: ending. Once the grammar is complete, the mask allows only the end-of-sequence ids, so the
row ends with ``finish_reason`` "stop" (its text is what the grammar matched); a row cut by its
max tokens ends with "length" and its text is what was produced (it may not parse). A job whose
rows never stop at an end-of-sequence id (``--ignore-eos``, a checkpoint naming none) cannot end
a constrained row and is refused before any compute.

Note: JSON is written compactly and deterministically: ``", "`` between items, ``": "`` between
a key and its value, and no other whitespace (llguidance's ``whitespace_flexible`` off), so a
small model cannot loop on blank lines inside an object.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError, clip, json_type

__all__ = ["Constraint", "ConstraintError", "from_request", "parse_structured", "Grammars", "GrammarMasks",
           "require_llguidance", "KEYS"]

log = logging.getLogger("rlx_mpi")

KEYS = ("response_format", "structured_outputs")  # what a request line may carry
_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs keys we take
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_TEXT = 1 << 20  # characters of one schema / grammar at most


class ConstraintError(ValueError):
    """A request's constraint that cannot be run: (message, the request key it is under)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class Constraint:
    """What a row's text must match: ``kind`` one of json, regex, choice, grammar, json_object."""

    kind: str
    value: Any  # json: the schema (a dict); regex, grammar: the text; choice: a list of str; json_object: True

    def to_json(self) -> dict:
        """The vLLM ``structured_outputs`` object (what travels, what a digest covers)."""
        return {self.kind: self.value}

    @classmethod
    def from_json(cls, d: dict) -> "Constraint":
        (kind, value), = d.items()
        return cls(kind, value)

    @property
    def key(self) -> str:
        """Its JSON text, compact: the grammar cache's key. Key order is kept: a schema's property
        order is the order the answer writes them in, so two orders are two grammars."""
        return json.dumps(self.to_json(), separators=(",", ":"), ensure_ascii=False)

    def grammar(self) -> str:
        """The llguidance grammar text (raises ValueError for a grammar that does not convert)."""
        import llguidance as llg

        if self.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(self.value), defaults=_JSON_OPTIONS)
        if self.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return llg.grammar_from("regex", self.value)
        if self.kind == "choice":
            return llg.grammar_from("choice", self.value)
        return llg.grammar_from("grammar", self.value)  # (GBNF, or Lark: llguidance tells them apart)


def from_request(obj: dict) -> Constraint | None:
    """A request's (an OpenAI body's, or our prompt line's) constraint, or None when it asks for
    none; `ConstraintError` naming the key for one that is malformed. Giving both keys is an error."""
    rf = obj.get("response_format")
    so = obj.get("structured_outputs")
    mine = _response_format(rf) if rf is not None else None
    if so is not None:
        if mine is not None:
            raise ConstraintError("both response_format and structured_outputs ask for structure; give one",
                                  "structured_outputs")
        mine = parse_structured(so, "structured_outputs")
    return mine


def _response_format(rf: Any) -> Constraint | None:
    p = "response_format"
    if not isinstance(rf, dict):
        raise ConstraintError(f"response_format is a {json_type(rf)}; give an object such as "
                              '{"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}', p)
    kind = rf.get("type")
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra:
        raise ConstraintError(f"response_format has unknown key {extra[0]!r} (it takes type, json_schema)", p)
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", True)
    if kind != "json_schema":
        raise ConstraintError(f"response_format type {clip(json.dumps(kind))} is not one of "
                              '"text", "json_object", "json_schema"', p)
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ConstraintError('response_format type "json_schema" needs "json_schema": {"name", "schema"}', p)
    extra = sorted(set(js) - {"name", "schema", "strict", "description"})
    if extra:
        raise ConstraintError(f"response_format.json_schema has unknown key {extra[0]!r} "
                              "(it takes name, schema, strict, description)", p)
    if "strict" in js and not isinstance(js["strict"], bool):
        raise ConstraintError(f"response_format.json_schema.strict is {clip(json.dumps(js['strict']))}; "
                              "give true or false (the schema is enforced either way)", p)
    if "schema" not in js:  # (OpenAI: a schema-less json_schema is any JSON; we ask for one)
        raise ConstraintError('response_format.json_schema has no "schema"; give the JSON schema the answer '
                              'must validate against (or use {"type": "json_object"})', p)
    return Constraint("json", _schema(js["schema"], "response_format.json_schema.schema", p))


def parse_structured(so: Any, where: str) -> Constraint:
    """A vLLM ``structured_outputs`` object: exactly one of json, regex, choice, grammar, json_object."""
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise ConstraintError(f"{where} is a {json_type(so)}; give an object with one of {', '.join(_KINDS)}", p)
    unknown = sorted(set(so) - set(_KINDS))
    if unknown:
        raise ConstraintError(f"{where} has unsupported key {unknown[0]!r} (supported: {', '.join(_KINDS)})", p)
    given = [k for k in _KINDS if so.get(k) is not None]
    if len(given) != 1:
        raise ConstraintError(f"{where} gives {len(given)} of {', '.join(_KINDS)} ({', '.join(given) or 'none'}); "
                              "give exactly one", p)
    kind = given[0]
    v = so[kind]
    if kind == "json":
        return Constraint("json", _schema(v, f"{where}.json", p))
    if kind == "json_object":
        if v is not True:
            raise ConstraintError(f"{where}.json_object is {clip(json.dumps(v))}; give true", p)
        return Constraint("json_object", True)
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)):
            raise ConstraintError(f"{where}.choice is {clip(json.dumps(v))}; give a non-empty list of non-empty "
                                  "strings", p)
        return Constraint("choice", list(v))
    if not (isinstance(v, str) and v.strip()):
        raise ConstraintError(f"{where}.{kind} is {clip(json.dumps(v))}; give a non-empty string", p)
    if len(v) > _MAX_TEXT:
        raise ConstraintError(f"{where}.{kind} has {len(v)} characters (at most {_MAX_TEXT})", p)
    return Constraint(kind, v)


def _schema(v: Any, where: str, p: str) -> dict:
    if isinstance(v, str):  # (vLLM takes a schema as JSON text too)
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ConstraintError(f"{where} is a string that is not JSON ({e})", p) from None
    if not isinstance(v, dict):
        raise ConstraintError(f"{where} is a {json_type(v)}; give a JSON schema object", p)
    if len(json.dumps(v)) > _MAX_TEXT:
        raise ConstraintError(f"{where} is longer than {_MAX_TEXT} characters of JSON", p)
    return v


def require_llguidance(where: str) -> Any:
    """The llguidance module, or the `InputError` that says how to get it."""
    try:
        import llguidance
    except ImportError:
        raise InputError(where, "this request asks for structured output (response_format / structured_outputs) "
                         "but llguidance is not installed",
                         "pip install 'rlx_mpi[structured]' (llguidance: one wheel, no dependencies)") from None
    return llguidance


class Grammars:
    """One job's grammar engine on one rank: the tokenizer as llguidance sees it, and each distinct
    constraint compiled once (keyed by `Constraint.key`); a row's matcher is a copy of its
    constraint's compiled one.

    ``tokenizer_json``: the text of the checkpoint's tokenizer.json; ``vocab_size``: the model's
    (its logits' width: the mask covers it); ``eos``: the ids that end a row (what a complete
    grammar allows)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int], where: str = "structured output"):
        llg = require_llguidance(where)
        if not eos:
            raise ValueError("structured output needs an end-of-sequence id")
        self.llg = llg
        try:
            self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos))
        except ValueError as e:  # (a tokenizer llguidance cannot read, or one larger than the model's vocabulary)
            raise InputError(where, f"llguidance cannot use the checkpoint's tokenizer.json: {_one_line(str(e))}",
                             "check that tokenizer.json belongs to this checkpoint") from None
        self.vocab_size, self.eos = vocab_size, list(eos)
        self._compiled: dict[str, Any] = {}  # Constraint.key -> a fresh LLMatcher
        self._errors: dict[str, str] = {}

    def check(self, c: Constraint) -> str | None:
        """Why ``c`` cannot run (the engine's message), or None; compiles it once."""
        self._compile(c)
        return self._errors.get(c.key)

    def matcher(self, c: Constraint) -> Any:
        """A new matcher at the start of ``c``'s grammar (ValueError if it does not compile)."""
        proto = self._compile(c)
        if proto is None:
            raise ValueError(self._errors[c.key])
        return proto.deep_copy()

    def _compile(self, c: Constraint) -> Any:
        k = c.key
        if k in self._compiled or k in self._errors:
            return self._compiled.get(k)
        try:
            grammar = c.grammar()
        except (ValueError, RuntimeError) as e:  # (a GBNF that does not convert, a schema llguidance refuses)
            self._errors[k] = _one_line(str(e))
            return None
        bad = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if bad:
            self._errors[k] = _one_line(bad)
            return None
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            self._errors[k] = _one_line(m.get_error())
            return None
        self._compiled[k] = m
        return m

    def __len__(self) -> int:
        return len(self._compiled)


def _one_line(msg: str) -> str:
    lines = [s.strip() for s in msg.strip().splitlines() if s.strip()]
    return clip(" ".join(lines[:3]) or "the grammar engine refused it", 400)


class GrammarMasks:
    """A step's masks: fill the bitmask of the constrained rows (llguidance, in parallel), apply it
    to their logits (`kernels.bitmask.apply_bitmask`), and advance each matcher with its token.
    ``threads``: llguidance's mask threads (None: its default)."""

    def __init__(self, grammars: Grammars, threads: int | None = None):
        self.g = grammars
        self.executor = grammars.llg.LLExecutor(threads)
        self.words = (grammars.vocab_size + 31) // 32
        self._mask = np.empty((0, self.words), np.int32)
        self.mask_s = 0.0  # time in fill + apply, summed
        self.masked = 0  # rows masked, summed

    def apply(self, logits: np.ndarray, positions: list[int], matchers: list) -> None:
        """Mask ``logits[positions[i]]`` by ``matchers[i]``'s next allowed tokens, in place."""
        import time

        from ..kernels.bitmask import apply_bitmask

        t0 = time.perf_counter()
        m = len(positions)
        if len(self._mask) < m:
            self._mask = np.empty((max(m, 2 * len(self._mask)), self.words), np.int32)
        mask = self._mask[:m]
        mask.fill(-1)
        self.executor.unsafe_compute_mask_ptr([(mt, i) for i, mt in enumerate(matchers)], mask.ctypes.data,
                                              self.words * 4, m)
        for i in np.flatnonzero(~mask.any(axis=1)).tolist():  # a matcher in error allows nothing: end the row
            log.warning("structured output: a row's grammar allows no token (%s); it ends here",
                        matchers[i].get_error() or "no reason given")
            e = self.g.eos[0]
            mask.view(np.uint32)[i, e // 32] |= np.uint32(1 << (e % 32))
        apply_bitmask(logits, np.asarray(positions, np.int64), mask)
        self.mask_s += time.perf_counter() - t0
        self.masked += m

    @staticmethod
    def advance(matchers: list, tokens: list[int]) -> None:
        """Each matcher takes its row's chosen token (an end-of-sequence id once it is complete)."""
        for mt, t in zip(matchers, tokens):
            if not mt.is_stopped():
                mt.consume_token(int(t))
