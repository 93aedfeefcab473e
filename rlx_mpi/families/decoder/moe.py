"""Mixture of experts: a router picks k of E experts per token (Mixtral's softmax, Qwen3-MoE's
without renormalising, DeepSeek's grouped sigmoid, GPT-OSS's top-k softmax: `route`), the
chosen SwiGLU experts run.

Only the chosen experts are computed: each expert multiplies just the rows routed to it (a
decode step of one sequence touches k of E experts). Under tensor parallelism a rank holds
E/tp whole experts (expert parallelism): every rank routes all rows (the router is
replicated and tiny), computes the rows that chose *its* experts, and the layer's existing
all-reduce sums the partial outputs, exactly as the row-parallel dense MLP's partial sums.
"""

from __future__ import annotations

import numpy as np

from ... import kernels
from .arch import Arch
from .weights import Experts

__all__ = ["route", "experts_forward"]


def route(x: np.ndarray, router: np.ndarray, top_k: int, cfg: Arch | None = None,
          bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x (N, C) -> (indices (N, k) int64, weights (N, k) float32), by ``cfg.routing``:

    * ``softmax`` (Mixtral; DeepSeek-V2): softmax over all E logits, the k largest (within the
      ``topk_group`` best of ``n_group`` groups, a group scored by its best expert), renormalised
      to sum 1 when ``norm_topk_prob``;
    * ``sigmoid`` (DeepSeek-V3): sigmoid scores; the choice adds ``bias`` (e_score_correction_bias)
      and scores a group by its two best; the weights are the unbiased scores, renormalised when
      ``norm_topk_prob``;
    * ``topk_softmax`` (GPT-OSS): the k largest logits (+ ``bias``), softmax over those k.

    Then x ``routed_scaling_factor``. Without ``cfg``: Mixtral's router."""
    logits = kernels.float_product(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(router, np.float32))  # (N, E); not BLAS: its order depends on N
    if cfg is None or cfg.routing == "softmax":
        logits = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=-1, keepdims=True)
        choice = _groups(probs, cfg, lambda g: g.max(axis=-1)) if cfg is not None else probs
        top = _top(choice, top_k)
        weights = np.take_along_axis(probs, top, axis=-1)
        if cfg is None or cfg.norm_topk_prob:
            weights /= weights.sum(axis=-1, keepdims=True)
    elif cfg.routing == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores + bias if bias is not None else scores
        choice = _groups(choice, cfg, lambda g: np.sort(g, axis=-1)[..., -2:].sum(axis=-1))
        top = _top(choice, top_k)
        weights = np.take_along_axis(scores, top, axis=-1)
        if cfg.norm_topk_prob:
            weights /= weights.sum(axis=-1, keepdims=True) + 1e-20
    else:  # topk_softmax
        if bias is not None:
            logits = logits + bias
        top = _top(logits, top_k)
        weights = np.take_along_axis(logits, top, axis=-1)
        weights = np.exp(weights - weights.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
    if cfg is not None and cfg.routed_scaling_factor != 1.0:
        weights = weights * np.float32(cfg.routed_scaling_factor)
    return top, weights.astype(np.float32)


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]  # (N, k), largest first


def _groups(scores: np.ndarray, cfg: Arch, group_score) -> np.ndarray:
    """``scores`` (N, E) with the experts outside each row's ``topk_group`` best groups at -inf."""
    if cfg.n_group <= 1 or cfg.topk_group >= cfg.n_group:
        return scores
    N, E = scores.shape
    grouped = scores.reshape(N, cfg.n_group, E // cfg.n_group)
    best = _top(group_score(grouped), cfg.topk_group)  # (N, topk_group)
    keep = np.zeros((N, cfg.n_group), bool)
    np.put_along_axis(keep, best, True, axis=-1)
    return np.where(np.repeat(keep, E // cfg.n_group, axis=-1), scores, -np.inf)


def experts_forward(x: np.ndarray, w: Experts, cfg: Arch, gated_mlp) -> np.ndarray:
    """x (B, T, C) -> this rank's share of the MoE output (B, T, C): the weighted outputs of
    its own experts for the rows routed to them, zeros elsewhere. ``gated_mlp(rows, mlp)``
    computes one expert (no reduction); ``cfg``'s routing picks the experts (`route`)."""
    B, T, C = x.shape
    flat = x.reshape(-1, C)
    index, weight = route(flat, w.router, cfg.experts_per_token, cfg, w.router_bias)  # (N, k)
    out = np.zeros_like(flat)
    for e in np.unique(index):  # only the experts some row chose (k of E at decode batch 1)
        if not w.first <= e < w.first + len(w.experts):
            continue  # another TP rank's expert
        rows, slot = np.nonzero(index == e)  # rows that chose expert e, and at which rank of k
        y = gated_mlp(flat[rows], w.experts[e - w.first])  # (n, C)
        out[rows] += y * weight[rows, slot][:, None]  # a row picks e at most once: no collisions
    return out.reshape(B, T, C)
