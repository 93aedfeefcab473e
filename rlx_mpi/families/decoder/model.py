"""One decoder in numpy, driven by an `Arch`, numerically matching Hugging Face transformers.

One short function per block. Shapes: B batch, T sequence, C hidden, nh query heads, nkv
key/value heads, hs head size. Under tensor parallelism the functions see only this rank's
heads, MLP columns or experts; ``reduce`` sums the row-parallel partial outputs across the
group (identity when tp = 1).

A layer (``block``):
    x = x + m * out_norm?(attention(norm?(x)))      out_norm: Gemma 2's sandwich norm; norm?: not OLMo 2
    x = x + m * out_norm?(mlp_or_experts(norm?(x)))  m: Granite's residual_multiplier (else 1)
attention: q/k/v (one fused product, +bias) -> q/k norm (per head, or OLMo 2's over the whole
projection) -> RoPE (the layer's base: Gemma 3's local or global) -> KV cache -> scaled
(soft-capped) causal attention over the layer's window (+ GPT-OSS's sinks) -> o_proj (+ bias).
DeepSeek's latent attention (`decoder.mla`) takes the place of q/k/v and the K/V cache; the MLP
is dense or experts (`decoder.moe`: the router kinds, shared experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ... import kernels
from ...model.kv_cache import KvSpec, LayerCache, PagedCache, PoolLayer, paged_before, prefill_kv
from . import lora, mla, moe, ops
from .arch import Arch
from .weights import Experts, LayerWeights, Linear, Mlp

__all__ = ["LayerWeights", "rms_norm", "apply_rope", "attention", "projection_norm_", "mlp", "block", "decode_block",
           "fused_decode_rows", "embed", "lm_head", "KvStep", "MixedKv"]

Reduce = Callable[[np.ndarray], np.ndarray]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return kernels.rms_norm(np.ascontiguousarray(x), weight, eps)  # weight * x / sqrt(mean(x^2) + eps)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return kernels.rope(x, cos, sin)  # x * cos + rotate_half(x) * sin, fused; C-contiguous (B, H, T, hs)


@dataclass
class KvStep:
    """How one generation step's attention reads and writes a layer's cache.

    ``prefill``: the chunk holds positions start..start+T-1 of each row, whose whole prompt is
    ``lengths`` long (right-padded past it; ``start`` > 0: chunked prefill, the positions before
    are in the cache); otherwise one new token per row at ``positions`` (B,). ``caches`` has one `LayerCache` per
    layer of the stage, or is None under ``kv_cache = "none"`` (the chunk is the whole prefix).
    ``specs`` is each layer's cache policy (a sliding-window layer keeps a ring of its window).
    """

    specs: list[KvSpec]
    slots: np.ndarray  # (B,) cache rows
    prefill: bool
    lengths: np.ndarray | None = None  # (B,) with prefill
    positions: np.ndarray | None = None  # (B,) without
    caches: list[LayerCache] | None = None
    layer: int = 0  # index into caches and specs, advanced by the stage
    start: int = 0  # with prefill: the chunk's first position
    saves: np.ndarray | None = None  # with prefill: (m, 3) row, block, pool id of the prefix cache (`prefill_kv`)
    pool: list[PoolLayer] | None = None  # the prefix cache's pool, one per layer
    lora: "lora.LoraStep | None" = None  # each token row's adapter (`decoder.lora`); None: no row has one

    def pool_layer(self) -> PoolLayer | None:
        return self.pool[self.layer] if self.pool is not None else None

    def __post_init__(self) -> None:
        if not self.prefill and self.caches:  # once per step, not per layer
            paged = next((c for c in self.caches if isinstance(c, PagedCache)), None)
            rows = paged.table.shape[0] if paged is not None else self.caches[0].k.shape[0]  # (the same: slots)
            top = paged.table.shape[1] * paged.size if paged is not None else None
            self.slots, self.positions = kernels.check_cache_rows(self.slots, self.positions, len(self.slots),
                                                                  rows, "decode step", top)

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, model_window: int, scale: float | None,
               softcap: float, sinks: np.ndarray | None = None) -> np.ndarray:
        """A prefill chunk (or, without a cache, a whole prefix): store its k, v (B, nkv, T, hs)
        and attend q (B, nh, T, hs) over the chunk: (B, T, nh, hs)."""
        cache = self.caches[self.layer] if self.caches is not None else None
        before = paged_before(cache, self.slots, self.start)  # (a paged row's earlier blocks: read where they are)
        keys, values, q_pos, window = prefill_kv(cache, self.specs[self.layer], k, v, self.slots, self.lengths,
                                                 self.start, self.saves, self.pool_layer(), gather=before is None)
        if model_window:  # the chunk attends to itself: the model's own window applies
            window = min(window, model_window) if window else model_window
        return kernels.attend(q, keys, values, q_pos, window, scale=scale, softcap=softcap, sinks=sinks, before=before)

    def attend_decode(self, qkv: np.ndarray, w: LayerWeights, cfg: Arch, cos: np.ndarray, sin: np.ndarray,
                      step_rows: int | None = None) -> np.ndarray:
        """A decode step from the fused projection qkv (B, 1, q|k|v): RoPE, the cache write and
        attention in `kernels.decode_attention` (a window layer's ring is its window). (B, 1, nh*hs).
        ``step_rows``: the token rows of the whole step (a MIXED step's chunk too)."""
        cache = self.caches[self.layer]
        B = qkv.shape[0]
        y = kernels.decode_attention(qkv.reshape(B, -1), w.q_dim, cos.reshape(B, -1), sin.reshape(B, -1), cache.k,
                                     cache.v, self.slots, self.positions, q_norm=w.q_norm, k_norm=w.k_norm,
                                     eps=cfg.rms_norm_eps, scale=cfg.attention_scale or None,
                                     softcap=cfg.attn_logit_softcap, rows_checked=True, step_rows=step_rows,
                                     sinks=w.sinks, **_paged(cache))
        return y.reshape(B, 1, -1)


def _paged(cache: LayerCache | PagedCache) -> dict:
    """The block table arguments of the decode kernels for a paged layer (`kv_cache.PagedCache`)."""
    return {"table": cache.table, "size": cache.size} if isinstance(cache, PagedCache) else {}


@dataclass
class MixedKv:
    """A step that decodes some rows and prefills a chunk of others in one pass over the weights.

    The step's token rows (1, N, C) are the ``n_decode`` decode rows' new tokens, then each
    prefill row's T positions (N = n_decode + rows x T): every projection and the MLP run once
    over all N (one read of each weight matrix), attention runs per half through its own
    `KvStep` (``decode``: the cache at each row's position; ``prefill``: the chunk, reading the
    cache before it), each half with its own RoPE rows (``cos_d``: (n_decode, 1, 1, hs);
    ``cos_p``: (rows, 1, T, hs)).
    """

    decode: KvStep
    prefill: KvStep
    T: int
    cos_d: np.ndarray
    sin_d: np.ndarray
    cos_p: np.ndarray
    sin_p: np.ndarray
    lora: "lora.LoraStep | None" = None  # each token row's adapter, decode rows first (`decoder.lora`)

    @property
    def layer(self) -> int:
        return self.decode.layer

    @layer.setter
    def layer(self, i: int) -> None:
        self.decode.layer = self.prefill.layer = i

    def attend(self, qkv: np.ndarray, w: LayerWeights, cfg: Arch) -> np.ndarray:
        """qkv (1, N, q|k|v) -> attention output (1, N, nh*hs), decode rows first."""
        nd, W = len(self.decode.slots), qkv.shape[-1]
        yd = self.decode.attend_decode(qkv[:, :nd].reshape(nd, 1, W), w, cfg, self.cos_d, self.sin_d,
                                       step_rows=qkv.shape[1])  # (nd, 1, D)
        yp = _attend_chunk(qkv[:, nd:].reshape(-1, self.T, W), w, cfg, self.cos_p, self.sin_p, self.prefill)
        return np.concatenate([yd.reshape(1, nd, -1), yp.reshape(1, -1, yd.shape[-1])], axis=1)


def attention(x: np.ndarray, w: LayerWeights, cfg: Arch, cos: np.ndarray, sin: np.ndarray,
              reduce: Reduce = _identity, kv: KvStep | MixedKv | None = None) -> np.ndarray:
    if w.mla is not None:  # DeepSeek: latent attention (its cache holds the latent)
        return _o_proj(mla.attention(x, w, cfg, cos, sin, kv), w, reduce)
    qkv = w.qkv(x)  # (B, T, nh*hs + 2*nkv*hs): q, k, v in one product (fused at load)
    if w.qkv_bias is not None:
        qkv += w.qkv_bias
    if getattr(kv, "lora", None) is not None:  # each row's adapter on q, k and v (`decoder.lora`)
        for module, col in (("q_proj", 0), ("k_proj", w.q_dim), ("v_proj", w.q_dim + w.kv_dim)):
            lora.add_(kv, module, qkv, x, col)
    if w.q_proj_norm is not None:  # OLMo 2: before every attention path below
        projection_norm_(qkv, w, cfg.rms_norm_eps, reduce)
    if isinstance(kv, MixedKv):  # decode rows and a prefill chunk, one projection for both
        y = kv.attend(qkv, w, cfg)
    elif kv is not None and not kv.prefill:  # decode: RoPE, cache write and attention in numba
        y = kv.attend_decode(qkv, w, cfg, cos, sin)
    else:
        y = _attend_chunk(qkv, w, cfg, cos, sin, kv)
    return _o_proj(y, w, reduce, kv)


def _o_proj(y: np.ndarray, w: LayerWeights, reduce: Reduce, kv=None) -> np.ndarray:
    out = w.o_proj(y)
    lora.add_(kv, "o_proj", out, y)  # (a row-parallel adapter's partial product: summed with the base's)
    out = reduce(out)  # row-parallel: partial sums over heads
    if w.o_bias is not None:  # once, after the sum (every TP rank holds it whole)
        out += w.o_bias
    return out


def projection_norm_(qkv: np.ndarray, w: LayerWeights, eps: float, reduce: Reduce = _identity) -> np.ndarray:
    """OLMo 2's RMSNorm over each token's whole q and whole k projection, in place on qkv
    (..., q|k|v); returns qkv.

    Note: under TP a rank holds a slice of heads, so the squares are summed locally and the
    (tokens, 2) sums all-reduced over the group (``reduce``: 8 bytes a token per layer) rather
    than gathering the projections; every rank holds an equal width (kv heads replicated
    tp / nkv times are counted that many times in the sum and in the width), so the mean is the
    reduced sum over ``width x norm_group``. bench/bench_olmo2_norm.py prices the alternative
    (each rank computing the whole q and k projections itself)."""
    qd, kd = w.q_dim, w.kv_dim
    q, k = qkv[..., :qd], qkv[..., qd:qd + kd]  # views
    sums = np.stack([np.square(q).sum(-1), np.square(k).sum(-1)], axis=-1)  # (..., 2) float32
    sums = reduce(np.ascontiguousarray(sums, dtype=np.float32))
    widths = np.array([qd, kd], np.float32) * np.float32(w.norm_group)
    scale = (1.0 / np.sqrt(sums / widths + np.float32(eps))).astype(np.float32)  # (..., 2)
    q *= scale[..., :1]
    q *= w.q_proj_norm
    k *= scale[..., 1:]
    k *= w.k_proj_norm
    return qkv


def _attend_chunk(qkv: np.ndarray, w: LayerWeights, cfg: Arch, cos: np.ndarray, sin: np.ndarray,
                  kv: KvStep | None) -> np.ndarray:
    """Causal attention of a forward or prefill chunk from its fused projection qkv (B, T, q|k|v):
    q/k norms, RoPE, the cache (with ``kv``): (B, T, nh*hs)."""
    B, T, _ = qkv.shape
    hs, qd, kd = cfg.head_dim, w.q_dim, w.kv_dim
    nh, nkv = qd // hs, kd // hs
    q, k, v = qkv[..., :qd], qkv[..., qd:qd + kd], qkv[..., qd + kd:]  # views
    if w.q_norm is not None:  # Qwen3: RMSNorm over each head's hs values
        q = rms_norm(q.reshape(B * T * nh, hs), w.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k.reshape(B * T * nkv, hs), w.k_norm, cfg.rms_norm_eps)
    q = q.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs), a view
    k = k.reshape(B, T, nkv, hs).transpose(0, 2, 1, 3)  # (B, nkv, T, hs)
    v = v.reshape(B, T, nkv, hs).transpose(0, 2, 1, 3)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # cos (T, hs), or (B, 1, T, hs) at positions
    scale = cfg.attention_scale or None  # None: hs ** -0.5
    if kv is None:
        y = kernels.attend(q, k, v, None, w.window, scale=scale, softcap=cfg.attn_logit_softcap,
                           sinks=w.sinks)  # causal
    else:  # generation: store this step's K/V, attend over the cached prefix
        y = kv.attend(q, k, v, w.window, scale, cfg.attn_logit_softcap, w.sinks)
    return y.reshape(B, T, nh * hs)


def gated_mlp(x: np.ndarray, w: Mlp, cfg: Arch, kv=None) -> np.ndarray:
    """down(act(gate(x)) * up(x)) without the reduction: one dense shard or one expert; ``kv``:
    a step whose rows may have adapters (`decoder.lora`)."""
    gu = w.gate_up(x)  # (..., 2I): [gate | up] in one product (fused at load)
    if w.gate_up_bias is not None:  # GPT-OSS's experts
        gu += w.gate_up_bias
    I = gu.shape[-1] // 2
    lora.add_(kv, "gate_proj", gu, x, 0)
    lora.add_(kv, "up_proj", gu, x, I)
    if cfg.activation == "gelu_tanh":  # GeGLU, in place into a copy of the gate
        h = ops.gelu_tanh_mul_(np.ascontiguousarray(gu[..., :I]), gu[..., I:])
    elif cfg.activation == "silu_clamped":  # GPT-OSS
        h = ops.swiglu_clamped_(np.ascontiguousarray(gu[..., :I]), gu[..., I:], cfg.swiglu_limit, cfg.swiglu_alpha)
    else:
        h = kernels.swiglu(gu)  # silu(gate) * up, one pass, (..., I)
    y = w.down_proj(h)
    lora.add_(kv, "down_proj", y, h)
    if w.down_bias is not None:  # an expert's own (whole on its rank): no TP double count
        y += w.down_bias
    return y


def mlp(x: np.ndarray, w: Mlp | Experts, cfg: Arch, reduce: Reduce = _identity, kv=None) -> np.ndarray:
    if isinstance(w, Experts):  # this rank's experts' share (+ its slice of the shared experts), summed over TP
        y = moe.experts_forward(x, w, cfg, lambda rows, e: gated_mlp(rows, e, cfg))
        if w.shared is not None:
            y += moe.shared_forward(x, w, cfg, lambda rows, e: gated_mlp(rows, e, cfg))
        return reduce(y)
    return reduce(gated_mlp(x, w, cfg, kv))  # row-parallel over I


def block(x: np.ndarray, w: LayerWeights, cfg: Arch, cos: np.ndarray, sin: np.ndarray,
          reduce: Reduce = _identity, kv: KvStep | MixedKv | None = None) -> np.ndarray:
    eps, scale = cfg.rms_norm_eps, cfg.residual_multiplier
    a = attention(_pre_norm(x, w.input_layernorm, eps), w, cfg, cos, sin, reduce, kv)
    if w.attn_out_norm is not None:
        a = rms_norm(a, w.attn_out_norm, eps)
    x = _add_to(a, x, scale)
    m = mlp(_pre_norm(x, w.post_attention_layernorm, eps), w.mlp, cfg, reduce, kv)
    if w.mlp_out_norm is not None:
        m = rms_norm(m, w.mlp_out_norm, eps)
    return _add_to(m, x, scale)


def _pre_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    return x if weight is None else rms_norm(x, weight, eps)  # None: OLMo 2 has no pre-norms


def fused_decode_rows(cfg: Arch, precision: str, tp: int) -> int:
    """Up to how many rows `decode_block` runs this model's decode steps (0: never). It needs dense
    SwiGLU layers without sandwich norms, weights in one of `kernels.decode_layer`'s formats and no
    TP partial sums; the rows are those for which a `Linear` takes the decode matvecs."""
    if (tp == 1 and precision in kernels.DECODE_LAYER_FORMATS and cfg.activation == "silu"
            and not cfg.num_experts and not cfg.sandwich_norms and cfg.residual_multiplier == 1.0
            and not cfg.rope_local_theta and cfg.qk_norm_scope == "head" and cfg.pre_norms
            and not cfg.kv_lora_rank and not cfg.attention_sinks and not cfg.o_bias):
        return kernels.F32_MATVEC_ROWS if precision == "f32" else kernels.matvec_rows(precision)
    return 0


def decode_block(x: np.ndarray, w: LayerWeights, cfg: Arch, cos: np.ndarray, sin: np.ndarray, kv: KvStep) -> np.ndarray:
    """`block` at a decode step in one numba call (`kernels.decode_layer`, bit-for-bit the same):
    x (B, 1, C) -> (B, 1, C), for B up to `fused_decode_rows`."""
    B, _, C = x.shape
    cache, mlp_ = kv.caches[kv.layer], w.mlp
    y = kernels.decode_layer(np.ascontiguousarray(x).reshape(B, C), w.input_layernorm, w.post_attention_layernorm,
                             cfg.rms_norm_eps, w.qkv.kernel_data, w.qkv.scale, w.qkv_bias, w.q_dim, cos.reshape(B, -1),
                             sin.reshape(B, -1), w.q_norm, w.k_norm, cache.k, cache.v, kv.slots, kv.positions,
                             cfg.attention_scale or cfg.head_dim ** -0.5, cfg.attn_logit_softcap, w.o_proj.kernel_data,
                             w.o_proj.scale, mlp_.gate_up.kernel_data, mlp_.gate_up.scale, mlp_.down_proj.kernel_data,
                             mlp_.down_proj.scale, kernels.pool_threads(), **_paged(cache))
    return y.reshape(B, 1, C)


def _add_to(fresh: np.ndarray, x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """The residual ``x + scale * fresh`` into ``fresh`` (a block's new output, owned here), so the
    layer allocates no array for it; ``x`` may be a caller's buffer and is left alone."""
    if scale != 1.0:  # Granite's residual_multiplier, in float32 as transformers
        fresh *= np.float32(scale)
    return np.add(fresh, x, out=fresh)


def embed(ids: np.ndarray, table: np.ndarray | Linear, multiplier: float = 1.0) -> np.ndarray:
    h = table[ids]  # (B, T) -> (B, T, C)
    if multiplier != 1.0:  # Gemma: x sqrt(C), the factor rounded to float32 as transformers does
        h = h * np.float32(multiplier)
    return h


def lm_head(x: np.ndarray, norm: np.ndarray, head: Linear, cfg: Arch) -> np.ndarray:
    logits = head(rms_norm(x, norm, cfg.rms_norm_eps))  # (B, T, V) or this rank's vocab slice
    if cfg.logits_scaling != 1.0:  # Granite: logits divided, in place on the fresh product
        logits = np.divide(logits, np.float32(cfg.logits_scaling), out=np.ascontiguousarray(logits))
    if cfg.final_logit_softcap:
        logits = ops.softcap_(np.ascontiguousarray(logits), cfg.final_logit_softcap)
    return logits
