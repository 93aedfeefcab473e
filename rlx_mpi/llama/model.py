"""A Llama decoder in numpy, numerically matching Hugging Face transformers (float32).

One short function per block. Shapes: B batch, T sequence, C hidden, nh query heads,
nkv key/value heads, hs head size. Under tensor parallelism the functions see only this
rank's heads and MLP columns; ``reduce`` sums the row-parallel partial outputs across the
group (identity when tp = 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import kernels
from ..kv_cache import KvSpec, LayerCache, decode_kv, prefill_kv
from .weights import LayerWeights, Linear

__all__ = ["LayerWeights", "rms_norm", "rope_tables", "rope_at", "apply_rope", "attention", "mlp", "block",
           "embed", "lm_head", "KvStep"]

Reduce = Callable[[np.ndarray], np.ndarray]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return kernels.rms_norm(np.ascontiguousarray(x), weight, eps)  # weight * x / sqrt(mean(x^2) + eps)


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (T, hs) for positions 0..T-1, in transformers' rotate-half layout."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    freqs = np.arange(seq, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]  # (T, hs/2)
    angles = np.concatenate([freqs, freqs], axis=-1)  # (T, hs)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_at(cos: np.ndarray, sin: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the (P, hs) tables at ``positions`` (B, T), shaped (B, 1, T, hs) to broadcast over heads."""
    return cos[positions][:, None], sin[positions][:, None]


@dataclass
class KvStep:
    """How one generation step's attention reads and writes a layer's cache.

    ``prefill``: the chunk holds positions 0..T-1 of each row (right-padded past ``lengths``);
    otherwise one new token per row at ``positions`` (B,). ``caches`` has one `LayerCache` per
    layer of the stage, or is None under ``kv_cache = "none"`` (the chunk is the whole prefix).
    """

    spec: KvSpec
    slots: np.ndarray  # (B,) cache rows
    prefill: bool
    lengths: np.ndarray | None = None  # (B,) with prefill
    positions: np.ndarray | None = None  # (B,) without
    caches: list[LayerCache] | None = None
    layer: int = 0  # index into caches, advanced by the stage

    def attend_inputs(self, k: np.ndarray, v: np.ndarray):
        cache = self.caches[self.layer] if self.caches is not None else None
        if self.prefill:
            return prefill_kv(cache, self.spec, k, v, self.slots, self.lengths)
        return decode_kv(cache, self.spec, k, v, self.slots, self.positions)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return kernels.rope(x, cos, sin)  # x * cos + rotate_half(x) * sin, fused; C-contiguous (B, H, T, hs)


def attention(x: np.ndarray, w: LayerWeights, head_dim: int, cos: np.ndarray, sin: np.ndarray,
              reduce: Reduce = _identity, kv: KvStep | None = None) -> np.ndarray:
    B, T, C = x.shape
    nh = w.q_proj.shape[0] // head_dim
    nkv = w.k_proj.shape[0] // head_dim
    q = w.q_proj(x).reshape(B, T, nh, head_dim).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
    k = w.k_proj(x).reshape(B, T, nkv, head_dim).transpose(0, 2, 1, 3)  # (B, nkv, T, hs)
    v = w.v_proj(x).reshape(B, T, nkv, head_dim).transpose(0, 2, 1, 3)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # cos (T, hs), or (B, 1, T, hs) at positions
    if kv is None:
        y = kernels.attend(q, k, v)  # causal: query t sees keys <= t
    else:  # generation: store this step's K/V, attend over the cached prefix
        keys, values, q_pos, window = kv.attend_inputs(k, v)
        y = kernels.attend(q, keys, values, q_pos, window)
    y = y.reshape(B, T, nh * head_dim)
    return reduce(w.o_proj(y))  # row-parallel: partial sums over heads


def mlp(x: np.ndarray, w: LayerWeights, reduce: Reduce = _identity) -> np.ndarray:
    gate = w.gate_proj(x)
    silu = kernels.silu_mul_(gate, w.up_proj(x))  # silu(gate) * up, in place: no temporaries
    return reduce(w.down_proj(silu))  # row-parallel over I


def block(x: np.ndarray, w: LayerWeights, head_dim: int, eps: float, cos: np.ndarray,
          sin: np.ndarray, reduce: Reduce = _identity, kv: KvStep | None = None) -> np.ndarray:
    x = _add_to(attention(rms_norm(x, w.input_layernorm, eps), w, head_dim, cos, sin, reduce, kv), x)
    return _add_to(mlp(rms_norm(x, w.post_attention_layernorm, eps), w, reduce), x)


def _add_to(fresh: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The residual ``x + fresh`` into ``fresh`` (a block's new output, owned here), so the
    layer allocates no array for it; ``x`` may be a caller's buffer and is left alone."""
    return np.add(fresh, x, out=fresh)


def embed(ids: np.ndarray, table: np.ndarray | Linear) -> np.ndarray:
    return table[ids]  # (B, T) -> (B, T, C)


def lm_head(x: np.ndarray, norm: np.ndarray, head: Linear, eps: float) -> np.ndarray:
    return head(rms_norm(x, norm, eps))  # (B, T, V) or this rank's vocab slice
