"""Rotary position embeddings: inverse frequencies and cos/sin tables for the five RoPE kinds.

Computed in float32 exactly as transformers' ``modeling_rope_utils`` (5.x) does:
``default`` theta^(-2i/hs); ``linear`` divides them by ``factor``; ``llama3`` divides the low
frequencies by ``factor``, keeps the high ones and blends between (Llama 3.1); ``longrope``
divides by per-frequency ``short_factor`` or ``long_factor`` and scales cos/sin by the
attention factor (Phi-3 128k); ``yarn`` blends ``default`` (high frequencies) and ``linear``
(low ones) over a ramp between the dims that turn ``beta_fast`` and ``beta_slow`` times in the
original context, and scales cos/sin by the attention factor (GPT-OSS, DeepSeek-V3). With
``rope_local_theta`` (Gemma 3) the sliding-window layers use a second, ``default`` table at that
base (``local``), the full layers the scaled one.

Note: longrope's choice. transformers picks the long factors for a whole forward when its
largest position + 1 exceeds ``original_max_position_embeddings``, and the short ones
otherwise: a decode step past the original context uses the long factors although the
cached keys were rotated with the short ones. We make the same choice per *sequence* (its
own length so far), which is transformers' choice for one sequence and keeps a sequence's
tokens independent of which others share its batch (a padded prefill does not count the
padding), so greedy tokens equal ``generate``'s.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .arch import Arch

__all__ = ["inv_freq", "Rope", "yarn_mscale"]


def _default(cfg: Arch) -> np.ndarray:
    hs = cfg.head_dim
    return (1.0 / (cfg.rope_theta ** (np.arange(0, hs, 2, dtype=np.int64).astype(np.float32) / hs))).astype(np.float32)


def inv_freq(cfg: Arch, long: bool = False) -> np.ndarray:
    """(hs/2,) float32 inverse frequencies; ``long`` picks longrope's long factors."""
    base = _default(cfg)
    if cfg.rope_type == "linear":
        return (base / np.float32(cfg.rope_factor)).astype(np.float32)
    if cfg.rope_type == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old = cfg.rope_original_max_positions
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = (2 * math.pi / base).astype(np.float32)
        scaled = np.where(wavelen > low_wavelen, base / np.float32(factor), base).astype(np.float32)
        smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if cfg.rope_type == "longrope":
        hs = cfg.head_dim
        ext = np.asarray(cfg.rope_long_factor if long else cfg.rope_short_factor, dtype=np.float32)
        shape = np.arange(0, hs, 2, dtype=np.int64).astype(np.float32) / hs
        return (1.0 / (ext * (cfg.rope_theta ** shape).astype(np.float32))).astype(np.float32)
    if cfg.rope_type == "yarn":
        return _yarn(cfg, base)
    return base


def _yarn(cfg: Arch, extrapolation: np.ndarray) -> np.ndarray:
    """transformers' ``_compute_yarn_parameters`` inverse frequencies (float32 as there)."""
    dim, theta, old = cfg.head_dim, cfg.rope_theta, cfg.rope_original_max_positions

    def correction_dim(rotations):
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (1 - ramp.astype(np.float32)).astype(np.float32)  # 1: extrapolate (high frequencies), 0: interpolate
    pos_freqs = (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)).astype(np.float32)
    interpolation = (1.0 / (np.float32(cfg.rope_factor) * pos_freqs)).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """yarn's attention-temperature term: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class Rope:
    """cos/sin tables of a model for positions 0..max_seq-1 (both longrope sets when needed;
    the local layers' own with ``rope_local_theta``)."""

    def __init__(self, cfg: Arch, max_seq: int):
        self.cfg, self.max_seq = cfg, max_seq
        self.short = self._table(inv_freq(cfg), max_seq)
        self.long = self._table(inv_freq(cfg, long=True), max_seq) if cfg.rope_type == "longrope" else self.short
        self.local = self.short
        if cfg.rope_local_theta:  # validate() refuses it with longrope
            local = dataclasses.replace(cfg, rope_type="default", rope_theta=cfg.rope_local_theta)
            self.local = self._table(inv_freq(local), max_seq, scaled=False)

    def _table(self, freq: np.ndarray, seq: int, scaled: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (T, hs); ``scaled``: times the attention factor of longrope / yarn (not the
        local layers' default table)."""
        freqs = np.arange(seq, dtype=np.float32)[:, None] * freq[None, :]  # (T, hs/2)
        angles = np.concatenate([freqs, freqs], axis=-1)  # (T, hs), rotate-half layout
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        if scaled and self.cfg.rope_type in ("longrope", "yarn") and self.cfg.rope_attention_factor != 1.0:
            a = np.float32(self.cfg.rope_attention_factor)
            cos, sin = cos * a, sin * a
        return cos, sin

    def _long(self, length):
        return self.cfg.rope_type == "longrope" and length > self.cfg.rope_original_max_positions

    def prefix(self, seq: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (T, hs) of positions 0..T-1 (a plain forward: every row is T long); ``local``:
        the local layers' table."""
        cos, sin = self.local if local else self.long if self._long(seq) else self.short
        return cos[:seq], sin[:seq]

    def at(self, positions: np.ndarray, lengths: np.ndarray | None = None,
           local: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Rows at ``positions`` (B, T), shaped (B, 1, T, hs) to broadcast over heads; with
        longrope each sequence's factors follow its length (``lengths``, else its last
        position + 1); ``local``: the local layers' table."""
        if local:
            return self.local[0][positions][:, None], self.local[1][positions][:, None]
        cos, sin = self.short[0][positions], self.short[1][positions]  # (B, T, hs)
        if self.cfg.rope_type == "longrope":
            length = lengths if lengths is not None else positions.max(axis=1) + 1
            rows = np.nonzero(self._long(np.asarray(length)))[0]
            if rows.size:
                cos[rows], sin[rows] = self.long[0][positions[rows]], self.long[1][positions[rows]]
        return cos[:, None], sin[:, None]


def attention_factor(cfg_factor: float | None, max_positions: int, original: int) -> float:
    """longrope's default cos/sin scale: sqrt(1 + ln(s) / ln(original)), s = the extension."""
    factor = cfg_factor if cfg_factor is not None else max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
