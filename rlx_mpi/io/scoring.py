"""``rlx-mpi score``: the teacher-forced log-likelihood of given text, to evaluate a checkpoint.

The command (its driver runs the pipeline with large microbatches, prefill only, no KV cache)::

    mpiexec -n 4 rlx-mpi score JOB --prompts P.jsonl --out S.jsonl

reads a prompt file, computes the log-probability the model gives each scored token knowing
every token before it, appends one row per line to ``S.jsonl`` in prompt order (the same
resumable `rlx_mpi.journal.Journal`, progress line and exit codes as ``generate``; its
`RunIdentity` is `RunIdentity.for_score`), and ends with the summary of the whole file.

Input, one JSON object per line (ids, blank lines, size and token rules as ``generate``'s,
`rlx_mpi.prompts`)::

    {"id": "a", "tokens": [1, 450, 4996, 29889]}      every token but the first is scored
    {"id": "b", "text": "The capital of France is Paris."}
    {"id": "c", "context": "The capital of France is", "continuation": " Paris"}
    {"id": "d", "context": [1, 450], "continuation": [4996, 29889]}

A ``"tokens"`` / ``"text"`` line scores tokens 1..T-1 (the first has no context), as
transformers' ``model(ids, labels=ids)`` does. A ``"context"`` + ``"continuation"`` line scores
only the continuation's tokens. Each of the two is token ids or text, independently; text context is encoded with the tokenizer's special tokens (a Llama BOS), text
continuation without, and the two are concatenated (as lm-evaluation-harness does: put the
space at the start of the continuation, ``" Paris"``). The context must have a token.

Output row (`score_row`)::

    {"id": "c", "tokens": [3681], "logprobs": [-2.3125], "sum": -2.3125, "n": 1, "prompt_tokens": 7}

``tokens`` the scored ids, ``logprobs`` their float32 log-probs (9 significant digits: they
read back to the same float32), ``sum`` their sum (float64), ``n`` how many, ``prompt_tokens``
the length of the whole line's sequence. The summary (`summarize`, `read_summary`) is over
every row of the output file, those of earlier runs of a resumed job included: rows, scored
tokens, the summed and mean log-prob and the perplexity exp(-sum / tokens) (token-weighted,
as transformers' loss over a batch is).

Note: where the log-probs come from. Position t's logits predict token t+1, so token t is
scored from logits row t-1. `targets` lists, for a right-padded batch, the (row, logits
position, target id) of every scored token; the last stage needs the lm_head output only at
those positions (`gather_logprobs` takes them flat, (N, V), in chunks of bounded memory),
never the whole (B, T, V) of a long batch. The log-softmax is `rlx_mpi.sampling.log_softmax`,
the same float32 arithmetic as ``--logprobs``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..errors import InputError, clip, json_type
from .identity import prompt_digest
from .prompts import MAX_PROMPT_FILE_BYTES, _check_id, _parse_line, _read_text, _tokens_of
from ..engine.sampling import _num, log_softmax

__all__ = ["ScorePrompt", "ScoreSummary", "read_score_prompts", "targets", "gather_logprobs", "token_logprobs",
           "score_row", "summarize", "read_summary"]

_KEYS = ("id", "tokens", "text", "context", "continuation")
_FORMS = 'give "tokens" or "text" (all scored but the first token), or "context" and "continuation"'
_CHUNK_ROWS = 64  # gather_logprobs: rows of (N, V) log-softmaxed at once (64 x 128k x 4 B = 32 MB)


@dataclass(frozen=True)
class ScorePrompt:
    """One line of a score prompt file: the whole sequence and where its scored part starts."""

    index: int  # 0-based position among the file's lines (blank lines not counted)
    id: str
    tokens: tuple[int, ...]  # context + continuation (or the whole line)
    start: int  # tokens[start:] are scored, 1 <= start < len(tokens)
    text: str | None = None  # the line's text (or continuation text), if given as text

    @property
    def scored(self) -> tuple[int, ...]:
        return self.tokens[self.start:]

    @property
    def digest(self) -> str:
        """What the journal records for a resume: the tokens and where scoring starts."""
        return prompt_digest(self.tokens, self.start)


@dataclass(frozen=True)
class ScoreSummary:
    """The whole output file's figures."""

    rows: int
    tokens: int
    sum_logprob: float
    mean_logprob: float  # nan with no tokens
    perplexity: float  # exp(-sum / tokens); nan with no tokens

    def line(self) -> str:
        return (f"{self.rows} rows, {self.tokens} scored tokens: mean log-prob {self.mean_logprob:.6f}, "
                f"perplexity {self.perplexity:.6g}")


# -- the prompt file ------------------------------------------------------------------------------


def read_score_prompts(path, *, vocab_size: int, max_positions: int, tokenizer=None,
                       max_bytes: int = MAX_PROMPT_FILE_BYTES) -> list[ScorePrompt]:
    """Read and check a whole score prompt file; every problem is an `InputError` at ``FILE:LINE``."""
    path = Path(path)
    text = _read_text(path, max_bytes)
    out: list[ScorePrompt] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        obj = _parse_line(line, where, _KEYS)
        pid = _check_id(obj, where)
        if pid in first_line:
            raise InputError(where, f"id {pid!r} is already used on line {first_line[pid]}",
                             "give every prompt a unique id")
        first_line[pid] = lineno
        tokens, start, shown = _sequence(obj, where, vocab_size, tokenizer)
        if len(tokens) > max_positions:
            raise InputError(where, f"line {pid!r} has {len(tokens)} tokens but the model has {max_positions} "
                             "positions", "shorten it (or split the context)")
        out.append(ScorePrompt(len(out), pid, tokens, start, shown))
    if not out:
        raise InputError(str(path), "the prompt file has no lines to score",
                         'give one JSON object per line: {"id": "...", "tokens": [...]}')
    return out


def _sequence(obj: dict, where: str, vocab_size: int, tokenizer) -> tuple[tuple[int, ...], int, str | None]:
    """(tokens, start, text) of one line; the token rules are `rlx_mpi.prompts`'."""
    pair = [k for k in ("context", "continuation") if k in obj]
    whole = [k for k in ("tokens", "text") if k in obj]
    if pair and whole:
        raise InputError(where, f'both "{whole[0]}" and "{pair[0]}"', _FORMS)
    if not pair:
        tokens = _tokens_of(obj, where, vocab_size, tokenizer)[0]  # exactly one of tokens/text, checked there
        if len(tokens) < 2:
            raise InputError(where, "a single token: nothing to score (the first token has no context)",
                             'give at least 2 tokens, or a "context" and a "continuation"')
        return tokens, 1, obj.get("text")
    if len(pair) == 1:
        raise InputError(where, f'"{pair[0]}" without "{"continuation" if pair[0] == "context" else "context"}"',
                         _FORMS)
    context = _part(obj["context"], f'{where} "context"', vocab_size, tokenizer, True)
    continuation = _part(obj["continuation"], f'{where} "continuation"', vocab_size, tokenizer, False)
    text = obj["continuation"] if isinstance(obj["continuation"], str) else None
    return context + continuation, len(context), text


class _NoSpecials:
    """A tokenizer whose encode adds no special tokens (the continuation follows the context)."""

    def __init__(self, tok):
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


def _part(value, where: str, vocab_size: int, tokenizer, specials: bool) -> tuple[int, ...]:
    if isinstance(value, str):
        tok = tokenizer if specials or tokenizer is None else _NoSpecials(tokenizer)
        return _tokens_of({"text": value}, where, vocab_size, tok)[0]
    if isinstance(value, list):
        return _tokens_of({"tokens": value}, where, vocab_size, tokenizer)[0]
    raise InputError(where, f"is {clip(json.dumps(value))}, a {json_type(value)}",
                     "give token ids (a list of integers) or text (a string)")


# -- the maths ------------------------------------------------------------------------------------


def targets(ids: np.ndarray, starts: Sequence[int], lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every scored token of a right-padded batch ``ids`` (B, T): (row, logits position, target id).

    Row b scores tokens ``starts[b]..lengths[b]-1``; token t is predicted by logits position
    t-1. Arrays are flat (N,) int64, row-major (row b's tokens in order, then row b+1's).
    """
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be (B, T), got shape {ids.shape}")
    B, T = ids.shape
    if len(starts) != B or len(lengths) != B:
        raise ValueError(f"starts and lengths must have {B} entries, got {len(starts)} and {len(lengths)}")
    rows, pos = [], []
    for b, (s, n) in enumerate(zip(starts, lengths)):
        if not 1 <= s < n <= T:
            raise ValueError(f"row {b}: need 1 <= start < length <= {T}, got start {s}, length {n}")
        rows.append(np.full(n - s, b, np.int64))
        pos.append(np.arange(s - 1, n - 1, dtype=np.int64))
    rows_, pos_ = np.concatenate(rows), np.concatenate(pos)
    return rows_, pos_, ids[rows_, pos_ + 1].astype(np.int64)


def gather_logprobs(logits: np.ndarray, target_ids: np.ndarray, chunk_rows: int = _CHUNK_ROWS) -> np.ndarray:
    """log_softmax(logits)[i, target_ids[i]] for (N, V) float32 logits: (N,) float32."""
    x = np.asarray(logits)
    if x.ndim != 2 or x.dtype != np.float32:
        raise ValueError(f"logits must be (N, V) float32, got {x.shape} {x.dtype}")
    t = np.asarray(target_ids)
    if t.shape != (len(x),):
        raise ValueError(f"target_ids must be ({len(x)},), got {t.shape}")
    if len(t) and not (0 <= t.min() and t.max() < x.shape[1]):
        raise ValueError(f"target ids must be in [0, {x.shape[1]})")
    out = np.empty(len(x), np.float32)
    for i in range(0, len(x), chunk_rows):
        lp = log_softmax(x[i:i + chunk_rows])
        out[i:i + chunk_rows] = lp[np.arange(len(lp)), t[i:i + chunk_rows]]
    return out


def token_logprobs(logits: np.ndarray, ids: np.ndarray, starts: Sequence[int],
                   lengths: Sequence[int]) -> list[np.ndarray]:
    """Per row, the scored tokens' log-probs (float32) from a batch's logits (B, T, V)."""
    logits = np.asarray(logits)
    if logits.ndim != 3 or logits.shape[:2] != np.shape(ids):
        raise ValueError(f"logits must be (B, T, V) over ids {np.shape(ids)}, got {logits.shape}")
    rows, pos, tgt = targets(ids, starts, lengths)
    lp = gather_logprobs(logits[rows, pos], tgt)
    return np.split(lp, np.cumsum([n - s for s, n in zip(starts, lengths)])[:-1])


def score_row(prompt: ScorePrompt, logprobs: np.ndarray) -> dict:
    """The output row of one line from its scored tokens' log-probs."""
    lp = np.asarray(logprobs, np.float32)
    if lp.shape != (len(prompt.scored),):
        raise ValueError(f"{prompt.id!r}: {len(prompt.scored)} scored tokens but {lp.shape} log-probs")
    if not np.isfinite(lp).all():  # the driver's finite check comes first; never write inf/nan
        raise ValueError(f"{prompt.id!r}: a log-prob is not finite")
    return {"id": prompt.id, "tokens": list(prompt.scored), "logprobs": [_num(v) for v in lp],
            "sum": float(lp.astype(np.float64).sum()), "n": len(lp), "prompt_tokens": len(prompt.tokens)}


# -- the summary ----------------------------------------------------------------------------------


def summarize(rows: Iterable[dict]) -> ScoreSummary:
    """The figures of a set of rows (all of an output file's for the job's summary)."""
    n_rows, tokens, total = 0, 0, 0.0
    for r in rows:
        n_rows += 1
        tokens += int(r["n"])
        total += float(r["sum"])
    mean = total / tokens if tokens else float("nan")
    return ScoreSummary(n_rows, tokens, total, mean, math.exp(-mean) if tokens else float("nan"))


def read_summary(path) -> ScoreSummary:
    """`summarize` of every row of a score output file (run after the journal is closed)."""
    with open(path, "rb") as f:
        return summarize(json.loads(line) for line in f if line.strip())
