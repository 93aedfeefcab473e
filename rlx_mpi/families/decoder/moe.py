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
from .weights import Experts, ExpertStack

__all__ = ["route", "experts_forward", "shared_forward"]


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

    Then x ``routed_scaling_factor``. Without ``cfg``: Mixtral's router. Each row alone, in numba
    (`kernels.route_experts`): the numpy of these rules was ~10 calls a layer, the largest cost of
    a small model's MoE decode step after the experts themselves; tests/test_moe_decode.py keeps it
    as the reference."""
    logits = kernels.lone_rows(x, router)  # (N, E), each row alone: its experts never depend on its batch
    if cfg is None:
        return kernels.route_experts(logits, "softmax", top_k)
    return kernels.route_experts(logits, cfg.routing, top_k, bias, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                 cfg.routed_scaling_factor)


def experts_forward(x: np.ndarray, w: Experts, cfg: Arch, gated_mlp) -> np.ndarray:
    """x (B, T, C) -> this rank's share of the MoE output (B, T, C): the weighted outputs of
    its own experts for the rows routed to them, zeros elsewhere. ``gated_mlp(rows, mlp)``
    computes one expert (no reduction); ``cfg``'s routing picks the experts (`route`).

    Up to `ExpertStack.rows` rows (a decode step, a short prefill chunk; the experts stacked) run
    every chosen expert in one call (`kernels.experts_decode`): each expert once over the rows that
    chose it, each row's products as a lone row's, so a row's output never depends on the rest of
    its batch. More rows (a long prefill chunk) multiply each expert's rows together (BLAS, or the
    tiles of the decode matvecs), as a dense layer multiplies its rows."""
    B, T, C = x.shape
    flat = x.reshape(-1, C)
    index, weight = route(flat, w.router, cfg.experts_per_token, cfg, w.router_bias)  # (N, k)
    if _kernel_takes(w.stack, flat, cfg):
        return _decode(flat, index, weight, w.first, w.stack, cfg).reshape(B, T, C)
    out = np.zeros_like(flat)
    for e in np.unique(index):  # only the experts some row chose (k of E at decode batch 1)
        if not w.first <= e < w.first + len(w.experts):
            continue  # another TP rank's expert
        rows, slot = np.nonzero(index == e)  # rows that chose expert e, and at which rank of k
        y = gated_mlp(flat[rows], w.experts[e - w.first])  # (n, C)
        out[rows] += y * weight[rows, slot][:, None]  # a row picks e at most once: no collisions
    return out.reshape(B, T, C)


def shared_forward(x: np.ndarray, w: Experts, cfg: Arch, gated_mlp) -> np.ndarray:
    """DeepSeek's always-on experts (this rank's slice) for x (B, T, C): at decode through the
    experts' kernel as one expert every row chose with weight 1 (each row alone, as the routed
    ones), else as a dense MLP."""
    flat = x.reshape(-1, x.shape[-1])
    if _kernel_takes(w.shared_stack, flat, cfg):
        N = len(flat)
        y = _decode(flat, np.zeros((N, 1), np.int64), np.ones((N, 1), np.float32), 0, w.shared_stack, cfg)
        return y.reshape(x.shape)
    return gated_mlp(x, w.shared)


def _kernel_takes(stack: ExpertStack | None, flat: np.ndarray, cfg: Arch) -> bool:
    return (stack is not None and len(flat) <= stack.rows and cfg.activation in kernels.EXPERT_ACTIVATIONS
            and flat.dtype == np.float32)


def _decode(flat: np.ndarray, index: np.ndarray, weight: np.ndarray, first: int, s: ExpertStack, cfg: Arch) -> np.ndarray:
    index = np.ascontiguousarray(index, dtype=np.int64)  # (flat: contiguous, the layer's own rows)
    return kernels.fused_experts(np.ascontiguousarray(flat), index, np.ascontiguousarray(weight, np.float32), first,
                                 s.gate_up_fmt, s.gate_up, s.gate_up_scale, s.gate_up_bias, s.down, s.down_scale,
                                 s.down_bias, cfg.activation, cfg.swiglu_limit, cfg.swiglu_alpha, s.down_fmt)
