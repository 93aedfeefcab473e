"""Mixture of experts (Mixtral, Qwen3-MoE): router softmax -> top-k -> renormalise? -> SwiGLU experts.

Only the chosen experts are computed: each expert multiplies just the rows routed to it (a
decode step of one sequence touches k of E experts). Under tensor parallelism a rank holds
E/tp whole experts (expert parallelism): every rank routes all rows (the router is
replicated and tiny), computes the rows that chose *its* experts, and the layer's existing
all-reduce sums the partial outputs, exactly as the row-parallel dense MLP's partial sums.
"""

from __future__ import annotations

import numpy as np

from .weights import Experts

__all__ = ["route", "experts_forward"]


def route(x: np.ndarray, router: np.ndarray, top_k: int, norm: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """x (N, C) -> (indices (N, k) int64, weights (N, k) float32) as Mixtral's router:
    softmax over all E logits, the k largest, divided by their sum (with ``norm``; Qwen3-MoE's
    ``norm_topk_prob = false`` keeps the softmax probabilities)."""
    logits = x @ router.T  # (N, E)
    logits = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # (N, k), largest first
    weights = np.take_along_axis(probs, top, axis=-1)
    if norm:
        weights /= weights.sum(axis=-1, keepdims=True)
    return top, weights.astype(np.float32)


def experts_forward(x: np.ndarray, w: Experts, top_k: int, gated_mlp, norm_topk: bool = True) -> np.ndarray:
    """x (B, T, C) -> this rank's share of the MoE output (B, T, C): the weighted outputs of
    its own experts for the rows routed to them, zeros elsewhere. ``gated_mlp(rows, mlp)``
    computes one expert (no reduction)."""
    B, T, C = x.shape
    flat = x.reshape(-1, C)
    index, weight = route(flat, w.router, top_k, norm_topk)  # (N, k)
    out = np.zeros_like(flat)
    for e in np.unique(index):  # only the experts some row chose (k of E at decode batch 1)
        if not w.first <= e < w.first + len(w.experts):
            continue  # another TP rank's expert
        rows, slot = np.nonzero(index == e)  # rows that chose expert e, and at which rank of k
        y = gated_mlp(flat[rows], w.experts[e - w.first])  # (n, C)
        out[rows] += y * weight[rows, slot][:, None]  # a row picks e at most once: no collisions
    return out.reshape(B, T, C)
