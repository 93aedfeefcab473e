"""Choosing the next token from the last stage's logits: greedy, or temperature / top-k / top-p.

Note: reproducible draws. The random number for the n-th new token of a prompt comes from
``numpy.random.default_rng([seed, key, n])`` where ``key`` is a hash of the prompt id. A draw
therefore depends on nothing else: not on the rank count, the group a prompt landed in, the
order prompts finish in, or whether the run was interrupted and resumed. Every tensor-parallel
rank of the last stage holds the same logits and draws the same token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

__all__ = ["SamplingParams", "prompt_key", "sample"]


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
