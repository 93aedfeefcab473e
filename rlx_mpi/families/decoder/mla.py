"""Multi-head latent attention (DeepSeek-V2/V3): the cache holds a latent, not K and V.

Shapes: B batch, T sequence, C hidden, nh this rank's heads, dn / dr / dv the per-head no-RoPE,
RoPE and value widths, r the latent rank (``kv_lora_rank``), S cached positions.

    q      = q_b(norm(q_a(x)))  (or q_proj(x))        (B, T, nh, dn + dr): [q_nope | q_rot]
    c, kr  = kv_a(x) split (r | dr); c = norm(c)       the latent and one RoPE key for all heads
    q_rot, kr = RoPE(q_rot), RoPE(kr)                 only the dr decoupled dims are rotated
    cache <- (c, kr)                                   r + dr floats a token per layer
    k_h = [uk_h c | kr],  v_h = uv_h c                 kv_b's two halves per head (uk: dn x r, uv: dv x r)
    y_h = softmax(q_h . k_h * scale) v_h  -> o_proj

Note: prefill expands, decode absorbs. A prefill chunk multiplies its (and the cached) latents
by kv_b once and attends as ordinary attention (T queries share the expansion). A decode step
would have to expand all S cached latents for one query per head, so it uses the DeepSeek
paper's absorption instead: q_h . k_h = (uk_h^T q_nope_h) . c + q_rot_h . kr, so each head's
query moves into the latent space (``q_lat``, r wide) and attends over the cache as it is, one
shared "head" of width r + dr, with the latents themselves as values; the r-wide result goes
through uv_h to the head's dv outputs. Same numbers, reassociated (the fixture test bounds
decode against prefill logits at 1e-4). The per-head products are `ops.head_matmul` (numba):
each row's result is the same ordered sum whatever the batch (its note).

Note: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)...; transformers' V3 rotates
them and writes the even results before the odd ones, V2 writes them back in place. Only
q_rot . kr reaches the output, and both layouts give the same dot product, so with
``rope_interleave`` both are taken as evens-then-odds followed by the usual rotate-half RoPE.

Under tensor parallelism a rank holds nh/tp whole heads (q_b / q_proj and kv_b by rows, o_proj
by columns); q_a, kv_a and their norms are replicated, and so is the latent cache: every TP rank
keeps the whole (c, kr) of its stage's layers (it is one "head" shared by all heads).
"""

from __future__ import annotations

import numpy as np

from ... import kernels
from ...model.kv_cache import PagedCache, prefill_kv
from . import ops
from .arch import Arch
from .weights import LayerWeights, MlaWeights

__all__ = ["attention", "absorbed"]

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the
# config's rms_norm_eps (1e-6 in the released configs, so only a model with another value differs)
_LATENT_EPS = 1e-6


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """x (B, H, T, dr) -> RoPE(x), C-contiguous (interleaved pairs taken evens-then-odds: module note)."""
    if interleave:
        x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return kernels.rope(x, cos, sin)  # (any layout: rope copies it into (B, H, T, dr) order)


def _project(x: np.ndarray, m: MlaWeights, cfg: Arch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (B, T, C) -> q (B, T, nh, dn + dr), the normed latent c (B, T, r), kr (B, T, dr) before RoPE."""
    eps = _LATENT_EPS
    q = m.q(kernels.rms_norm(np.ascontiguousarray(m.q_a(x)), m.q_a_norm, eps)) if m.q_a is not None else m.q(x)
    B, T, _ = q.shape
    ckv = m.kv_a(x)  # (B, T, r + dr)
    r = cfg.kv_lora_rank
    c = kernels.rms_norm(np.ascontiguousarray(ckv[..., :r]), m.kv_a_norm, eps)
    return q.reshape(B, T, -1, cfg.qk_head_dim), c, ckv[..., r:]


def _chunk(q, c, kr, m: MlaWeights, cfg: Arch, cos, sin, kv) -> np.ndarray:
    """A forward or prefill chunk: store (c, kr), expand the latents by kv_b, attend. (B, T, nh*dv)."""
    B, T, nh, _ = q.shape
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    q_rot = _rope(q[..., dn:].transpose(0, 2, 1, 3), cos, sin, cfg.rope_interleave)  # (B, nh, T, dr)
    kr = _rope(kr[:, None], cos, sin, cfg.rope_interleave)  # (B, 1, T, dr)
    keys_c, keys_r, q_pos, window = c[:, None], kr, None, 0
    if kv is not None:  # the cache keeps the latent; a later chunk also sees the cached one
        keys_c, keys_r, q_pos, window = prefill_kv(kv.caches[kv.layer] if kv.caches is not None else None,
                                                   kv.specs[kv.layer], c[:, None], kr, kv.slots, kv.lengths, kv.start,
                                                   kv.saves, kv.pool_layer())
    S = keys_c.shape[2]
    kvb = m.kv_b(keys_c[:, 0]).reshape(B, S, nh, dn + dv).transpose(0, 2, 1, 3)  # (B, nh, S, dn + dv)
    k = np.empty((B, nh, S, dn + keys_r.shape[-1]), np.float32)
    k[..., :dn], k[..., dn:] = kvb[..., :dn], keys_r  # the RoPE key is shared by every head
    qq = np.concatenate([q[..., :dn].transpose(0, 2, 1, 3), q_rot], axis=-1)  # (B, nh, T, dn + dr)
    y = kernels.attend(qq, k, np.ascontiguousarray(kvb[..., dn:]), q_pos, window,
                       scale=cfg.attention_scale or None)
    return y.reshape(B, T, nh * dv)


def absorbed(q_nope: np.ndarray, q_rot: np.ndarray, c: np.ndarray, kr: np.ndarray, m: MlaWeights, q_pos: np.ndarray,
             scale: float) -> np.ndarray:
    """One query per head over latents, the up-projections absorbed (module note).

    q_nope (B, nh, dn), q_rot (B, nh, dr) roped; c (B, S, r) latents, kr (B, S, dr) roped keys;
    q_pos (B,): each row sees cached columns 0..q_pos. Returns (B, nh * dv)."""
    B, nh, _ = q_nope.shape
    q_lat = ops.head_matmul(q_nope, m.uk)  # (B, nh, r): uk_h^T q_nope_h
    q = np.concatenate([q_lat, q_rot], axis=-1)[:, :, None]  # (B, nh, 1, r + dr)
    keys = np.concatenate([c, kr], axis=-1)[:, None]  # (B, 1, S, r + dr): one head shared by all
    y = kernels.attend(np.ascontiguousarray(q, np.float32), keys, np.ascontiguousarray(c[:, None]),
                       np.asarray(q_pos, np.int64).reshape(B, 1), 0, scale=scale)  # (B, 1, nh, r)
    return ops.head_matmul(y[:, 0], m.uv, transposed=True).reshape(B, -1)  # (B, nh * dv): uv_h y_h


def _decode(q, c, kr, m: MlaWeights, cfg: Arch, cos, sin, kv) -> np.ndarray:
    """One new token per row (T = 1): store its (c, kr) at column position % L, attend absorbed."""
    B, _, nh, _ = q.shape
    dn = cfg.qk_nope_head_dim
    q_rot = _rope(q[:, 0, :, dn:][:, :, None], cos, sin, cfg.rope_interleave)[:, :, 0]  # (B, nh, dr)
    kr = _rope(kr[:, None], cos, sin, cfg.rope_interleave)[:, 0, 0]  # (B, dr)
    cache = kv.caches[kv.layer]
    scale = cfg.attention_scale or cfg.qk_head_dim ** -0.5
    if isinstance(cache, PagedCache):  # through the block table: the row's latents gathered in position order
        at = cache.columns(kv.slots, kv.positions[:, None])[:, 0]
        cache.k[0, 0, at], cache.v[0, 0, at] = c[:, 0], kr
        S = int(kv.positions.max()) + 1
        cols = cache.columns(kv.slots, np.broadcast_to(np.arange(S), (B, S)))  # (B, S)
        return absorbed(np.ascontiguousarray(q[:, 0, :, :dn]), q_rot, cache.k[0, 0][cols], cache.v[0, 0][cols], m,
                        kv.positions, scale).reshape(B, 1, -1)
    L = cache.k.shape[2]
    cols = kv.positions % L
    cache.k[kv.slots, 0, cols] = c[:, 0]
    cache.v[kv.slots, 0, cols] = kr
    return absorbed(np.ascontiguousarray(q[:, 0, :, :dn]), q_rot, cache.k[kv.slots, 0], cache.v[kv.slots, 0], m,
                    np.minimum(kv.positions, L - 1), scale).reshape(B, 1, -1)


def attention(x: np.ndarray, w: LayerWeights, cfg: Arch, cos, sin, kv=None) -> np.ndarray:
    """x (B, T, C) -> the attention output before o_proj (B, T, nh*dv); ``kv`` as `model.attention`
    takes it (None: a plain forward; a `model.KvStep`; a `model.MixedKv` of decode rows and a chunk)."""
    m = w.mla
    q, c, kr = _project(x, m, cfg)
    if hasattr(kv, "decode"):  # a MixedKv (not imported: model imports this module): decode rows, then the chunk
        nd, T = len(kv.decode.slots), kv.T
        yd = _decode(q[0, :nd, None], c[0, :nd, None], kr[0, :nd, None], m, cfg, kv.cos_d, kv.sin_d, kv.decode)
        n = (q.shape[1] - nd) // T
        yp = _chunk(q[0, nd:].reshape(n, T, *q.shape[2:]), c[0, nd:].reshape(n, T, -1),
                    kr[0, nd:].reshape(n, T, -1), m, cfg, kv.cos_p, kv.sin_p, kv.prefill)
        return np.concatenate([yd.reshape(1, nd, -1), yp.reshape(1, n * T, -1)], axis=1)
    if kv is not None and not kv.prefill:
        return _decode(q, c, kr, m, cfg, cos, sin, kv)
    return _chunk(q, c, kr, m, cfg, cos, sin, kv)
