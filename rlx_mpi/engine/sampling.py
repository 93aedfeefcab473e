"""Choosing the next token from the last stage's logits: greedy, or temperature / top-k / top-p.

Note: reproducible draws. The random number for the n-th new token of a prompt comes from
``numpy.random.default_rng([seed, key, n])`` where ``key`` is a hash of the prompt id. A draw
therefore depends on nothing else: not on the rank count, the group a prompt landed in, the
order prompts finish in, or whether the run was interrupted and resumed. Every tensor-parallel
rank of the last stage holds the same logits and draws the same token.

Note: log-probabilities (``--logprobs K``). `logprobs` takes the same (B, V) float32 logits the
token was drawn from, *before* temperature, top-k or top-p: the model's own distribution, as
transformers' ``output_logits`` (and ``output_scores`` of a greedy run, where no processor
touches them) passed through ``torch.log_softmax(scores.float(), -1)``; the chosen token's
value is what ``model.compute_transition_scores(..., normalize_logits=True)`` gives. It is
computed in float32 (max subtracted, then log of the sum of exps), so it equals torch's within
float32 rounding (~1e-6), not bit for bit. The top K alternatives are sorted by log-prob,
best first, ties broken by the lower token id (as ``torch.sort(descending=True, stable=True)``;
``torch.topk`` orders tied values arbitrarily, so compare with it up to ties).

A row's ``"logprobs"`` (`logprob_entries`) is one object per new token, in order::

    {"id": 450, "logprob": -0.71, "top": [[450, -0.71], [29871, -1.9]]}

``id`` the chosen token, ``logprob`` its log-prob, ``top`` the K best ``[id, logprob]`` pairs
(empty when K is 0: the chosen token's log-prob alone). The chosen token is in ``top`` only if
it is among the K best (a sampled token may not be). Values are float32 written with 9
significant digits (they read back to the same float32); a log-prob of -inf (a logit of -inf)
is written as ``null``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError

__all__ = ["SamplingParams", "RowSettings", "prompt_key", "sample_id", "sample", "sample_rows", "log_softmax",
           "logprobs", "logprob_entries", "pack_sampled", "unpack_sampled"]


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks tokens; temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int = 0

    def check(self, where: str) -> "SamplingParams":
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ConfigError(f"{where} temperature", f"got {self.temperature!r}", "give a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ConfigError(f"{where} top_k", f"got {self.top_k!r}", "give an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{where} top_p", f"got {self.top_p!r}", "give a number in (0, 1] (1 = off)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class RowSettings:
    """One prompt line's own settings (an OpenAI request's body, or our line's keys: `batch_io`);
    None: the job's value.

    ``n`` samples of the request are rows of their own (sample j > 0 draws with the key of
    `sample_id`); ``stop`` strings end a row on its decoded text (`scheduler.Scheduler`).
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: bool = False  # the chosen tokens' log-probs in the output
    top_logprobs: int = 0  # and this many alternatives each
    constraint: Any = None  # a `constraints.Constraint` its text must match (structured output)

    def params(self, job: SamplingParams) -> SamplingParams:
        """The job's sampling under this row's own temperature, top_p and seed."""
        pick = lambda mine, theirs: theirs if mine is None else mine  # noqa: E731
        return SamplingParams(pick(self.temperature, job.temperature), job.top_k, pick(self.top_p, job.top_p),
                              pick(self.seed, job.seed))

    def to_json(self) -> dict:
        """The settings the line gave (defaults left out): what a row's digest covers."""
        out = {k: getattr(self, k) for k in ("max_tokens", "temperature", "top_p", "seed")
               if getattr(self, k) is not None}
        if self.stop:
            out["stop"] = list(self.stop)
        if self.n != 1:
            out["n"] = self.n
        if self.logprobs:
            out.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.constraint is not None:
            out["constraint"] = self.constraint.to_json()
        return out


def sample_id(prompt_id: str, j: int) -> str:
    """What keys the draws of sample ``j`` of a prompt: its id for the first (so a request of
    n = 1 draws as a plain prompt does), the id and j for the others (each its own draws)."""
    return prompt_id if j == 0 else f"{prompt_id}\x1fsample{j}"


def prompt_key(prompt_id: str) -> int:
    """A stable 63-bit integer for a prompt id (Python's hash() differs between processes)."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode("utf-8")).digest()[:8], "little") >> 1


def sample(logits: np.ndarray, keys: np.ndarray, steps: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One token per row of ``logits`` (B, V); ``keys``/``steps`` (B,) seed each row's draw."""
    if params.greedy:
        return logits.argmax(axis=-1).astype(np.int64)
    out = np.empty(len(logits), np.int64)
    for b, row in enumerate(logits):
        out[b] = _draw(row, int(keys[b]), int(steps[b]), params)
    return out


def sample_rows(logits: np.ndarray, keys: np.ndarray, steps: np.ndarray, params: SamplingParams,
                per_key: dict[int, SamplingParams] | None = None) -> np.ndarray:
    """`sample` where a row whose key is in ``per_key`` samples with its own settings.

    A row's token depends only on its own logits, key, step and settings: a greedy row is its
    argmax as in a greedy batch, a sampled row its `_draw`, whatever the rows beside it.
    """
    if not per_key:
        return sample(logits, keys, steps, params)
    out = np.empty(len(logits), np.int64)
    for b, row in enumerate(logits):
        p = per_key.get(int(keys[b]), params)
        out[b] = row.argmax() if p.greedy else _draw(row, int(keys[b]), int(steps[b]), p)
    return out


def _draw(row: np.ndarray, key: int, step: int, p: SamplingParams) -> int:
    z = row.astype(np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")  # (V,) best first; ties broken by token id
    if p.top_k:
        order = order[:p.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if p.top_p < 1.0:  # the smallest prefix whose mass reaches top_p
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    u = np.random.default_rng([p.seed, key, step]).random()
    return int(order[min(int(np.searchsorted(np.cumsum(probs), u, side="right")), len(order) - 1)])


# -- log-probabilities ---------------------------------------------------------------------------


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(B, V) float32 log-softmax over the last axis, in float32 (as torch.log_softmax)."""
    x = np.asarray(logits)
    if x.dtype != np.float32:
        raise ValueError(f"logits must be float32, got {x.dtype}")
    m = x.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, np.float32(0))  # a row of -inf stays -inf, not NaN
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True, dtype=np.float32))


def logprobs(logits: np.ndarray, chosen: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chosen tokens' log-probs and the top ``k`` alternatives of each row of ``logits``.

    ``logits`` (B, V) float32, the temperature-free logits the tokens were drawn from;
    ``chosen`` (B,) token ids. Returns (chosen_lp (B,) float32, top_ids (B, k) int64, top_lp
    (B, k) float32), top sorted best first, ties by lower id.
    """
    x = np.asarray(logits)
    if x.ndim != 2:
        raise ValueError(f"logits must be (B, V), got shape {x.shape}")
    B, V = x.shape
    chosen = np.asarray(chosen)
    if chosen.shape != (B,) or chosen.dtype.kind not in "iu":
        raise ValueError(f"chosen must be ({B},) integer ids, got {chosen.shape} {chosen.dtype}")
    if B and not (0 <= chosen.min() and chosen.max() < V):
        raise ValueError(f"chosen ids must be in [0, {V}), got {chosen.min()}..{chosen.max()}")
    if not 0 <= k <= V:
        raise ValueError(f"k must be in [0, {V}], got {k}")
    lp = log_softmax(x)  # (B, V)
    chosen_lp = lp[np.arange(B), chosen]
    top_ids = np.empty((B, k), np.int64)
    for b in range(B):
        top_ids[b] = _top(lp[b], k)
    top_lp = np.take_along_axis(lp, top_ids, axis=1)
    return chosen_lp, top_ids, top_lp


def _top(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest values, best first, ties by lower id (exact at the k-th value)."""
    if k == 0:
        return np.empty(0, np.int64)
    threshold = np.partition(row, len(row) - k)[len(row) - k]  # the k-th largest value
    above = np.flatnonzero(row > threshold)
    tied = np.flatnonzero(row == threshold)[:k - len(above)]
    cand = np.concatenate([above, tied])
    return cand[np.lexsort((cand, -row[cand]))]


def logprob_entries(tokens, chosen_lp, top_ids, top_lp) -> list[dict]:
    """One row's ``"logprobs"``: per new token {"id", "logprob", "top": [[id, logprob], ...]}."""
    return [{"id": int(t), "logprob": _num(c), "top": [[int(i), _num(v)] for i, v in zip(ids, vals)]}
            for t, c, ids, vals in zip(tokens, chosen_lp, top_ids, top_lp)]


def pack_sampled(tokens: np.ndarray, chosen_lp: np.ndarray, top_ids: np.ndarray, top_lp: np.ndarray) -> np.ndarray:
    """Tokens and their log-probs as one (B, 2 + 2K) int64 array, to travel back to stage 0 as
    the tokens alone do: [token, bits(chosen_lp), top ids..., bits(top_lp)...], log-probs as
    their float32 bit patterns (exact; no second message, no float64 rounding)."""
    B, K = top_ids.shape
    out = np.empty((B, 2 + 2 * K), np.int64)
    out[:, 0] = tokens
    out[:, 1] = np.asarray(chosen_lp, np.float32).view(np.uint32)
    out[:, 2:2 + K] = top_ids
    out[:, 2 + K:] = np.asarray(top_lp, np.float32).view(np.uint32)
    return out


def unpack_sampled(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`pack_sampled`'s inverse: (tokens (B,), chosen_lp (B,), top_ids (B, K), top_lp (B, K))."""
    K = (packed.shape[1] - 2) // 2
    bits = lambda a: np.ascontiguousarray(a).astype(np.uint32).view(np.float32)  # noqa: E731
    return packed[:, 0].copy(), bits(packed[:, 1]), packed[:, 2:2 + K].copy(), bits(packed[:, 2 + K:])


def _num(v) -> float | None:
    v = float(v)
    return float(f"{v:.9g}") if np.isfinite(v) else None
