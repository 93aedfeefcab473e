"""A Llama decoder in numpy, numerically matching Hugging Face transformers (float32).

One short function per block. Shapes: B batch, T sequence, C hidden, nh query heads,
nkv key/value heads, hs head size. Under tensor parallelism the functions see only this
rank's heads and MLP columns; ``reduce`` sums the row-parallel partial outputs across the
group (identity when tp = 1).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import kernels
from .weights import LayerWeights, Linear

__all__ = ["LayerWeights", "rms_norm", "rope_tables", "apply_rope", "attention", "mlp", "block",
           "embed", "lm_head"]

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


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return kernels.rope(x, cos, sin)  # x * cos + rotate_half(x) * sin, fused; C-contiguous (B, H, T, hs)


def attention(x: np.ndarray, w: LayerWeights, head_dim: int, cos: np.ndarray, sin: np.ndarray,
              reduce: Reduce = _identity) -> np.ndarray:
    B, T, C = x.shape
    nh = w.q_proj.shape[0] // head_dim
    nkv = w.k_proj.shape[0] // head_dim
    q = w.q_proj(x).reshape(B, T, nh, head_dim).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
    k = w.k_proj(x).reshape(B, T, nkv, head_dim).transpose(0, 2, 1, 3)  # (B, nkv, T, hs)
    v = w.v_proj(x).reshape(B, T, nkv, head_dim).transpose(0, 2, 1, 3)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = kernels.attend(q, k, v).reshape(B, T, nh * head_dim)  # causal: query t sees keys <= t
    return reduce(w.o_proj(y))  # row-parallel: partial sums over heads


def mlp(x: np.ndarray, w: LayerWeights, reduce: Reduce = _identity) -> np.ndarray:
    gate = w.gate_proj(x)
    silu = kernels.silu_mul_(gate, w.up_proj(x))  # silu(gate) * up, in place: no temporaries
    return reduce(w.down_proj(silu))  # row-parallel over I


def block(x: np.ndarray, w: LayerWeights, head_dim: int, eps: float, cos: np.ndarray,
          sin: np.ndarray, reduce: Reduce = _identity) -> np.ndarray:
    x = x + attention(rms_norm(x, w.input_layernorm, eps), w, head_dim, cos, sin, reduce)
    return x + mlp(rms_norm(x, w.post_attention_layernorm, eps), w, reduce)


def embed(ids: np.ndarray, table: np.ndarray | Linear) -> np.ndarray:
    return table[ids]  # (B, T) -> (B, T, C)


def lm_head(x: np.ndarray, norm: np.ndarray, head: Linear, eps: float) -> np.ndarray:
    return head(rms_norm(x, norm, eps))  # (B, T, V) or this rank's vocab slice
