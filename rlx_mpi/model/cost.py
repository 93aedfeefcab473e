"""The price of the model: bytes held and FLOPs per token of each layer and of the ends.

`ModelCost` is what a family reports (`ModelFamily.cost`) and what the planner
(`cluster.placement`), `plan` and the drivers price with; `kv_cost` cuts its cache term to
what the cache policies keep, `with_held_scales` measures the resident bytes of a precision
from the checkpoint's storage. Pure: no MPI, no numpy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from .. import rules
from ..config import Precision

__all__ = ["ModelCost", "kv_cost", "with_held_scales"]


@dataclass(frozen=True)
class ModelCost:
    """What one forward of the model costs, per layer and at the ends; bytes are whole-model
    (all tensor-parallel shards together)."""

    n_layers: int
    layer_bytes: int  # parameters of one decoder layer
    layer_flops_per_token: float
    embed_bytes: int  # held by the first stage (whole, on each of its TP ranks: see plan_placement)
    head_bytes: int  # final norm + LM head, held by the last stage
    head_flops_per_token: float
    kv_bytes_per_layer: int  # KV cache of one layer for the whole batch
    act_bytes: int  # activation working set of one stage
    tokens: int = 1  # batch * seq of the forward being planned
    shared_end_bytes: int = 0  # counted in both embed_bytes and head_bytes, held once by a stage
    # that has both ends (tied embeddings on a one-stage plan)
    kv_heads: int = 0  # key/value heads (0: not told); under tp > kv_heads each TP rank holds one
    kv_weight_bytes: int = 0  # k and v projections (and biases) of one layer, within layer_bytes
    held_scales: tuple[tuple[str, float], ...] = ()  # (precision, resident weight bytes / the float32
    # bytes priced), measured from the checkpoint's storage (`with_held_scales`); a precision not
    # listed is priced at Precision.bytes_per_param / 4

    def under_tp(self, tp: int) -> "ModelCost":
        """The whole stage's bytes when its ``tp`` ranks split the layers: every rank holds the
        whole embedding (a lookup needs no collective), no rank holds a tied head as its
        embedding, and with tp > kv_heads each rank holds the kv head its queries read (k/v
        weights and cache replicated tp / kv_heads times, as `decoder.stage` loads them)."""
        if tp == 1:
            return self
        rep = tp / self.kv_heads if 0 < self.kv_heads < tp else 1.0
        return dataclasses.replace(
            self, embed_bytes=self.embed_bytes * tp, shared_end_bytes=0,
            layer_bytes=self.layer_bytes + int(self.kv_weight_bytes * (rep - 1)),
            kv_bytes_per_layer=int(self.kv_bytes_per_layer * rep))

    def stage_bytes(self, layers: range, first: bool, last: bool, weight_scale: float = 1.0) -> int:
        """Resident bytes of a stage holding ``layers`` (whole stage, all TP shards);
        ``weight_scale`` scales the weights (not KV cache or activations) for a rank that holds
        them in another precision than the cost was priced in."""
        n = len(layers)
        weights = n * self.layer_bytes + (self.embed_bytes if first else 0) + (self.head_bytes if last else 0)
        weights -= self.shared_end_bytes if first and last else 0
        weights = weights if weight_scale == 1.0 else int(weights * weight_scale)
        return weights + n * self.kv_bytes_per_layer + self.act_bytes

    def layer_cost_bytes(self, weight_scale: float = 1.0) -> int:
        """Bytes one more layer adds to a stage."""
        return (self.layer_bytes if weight_scale == 1.0 else int(self.layer_bytes * weight_scale)) + self.kv_bytes_per_layer

    def stage_flops(self, layers: range, last: bool) -> float:
        """FLOPs of one forward through a stage (all TP shards together)."""
        return self.tokens * (len(layers) * self.layer_flops_per_token
                              + (self.head_flops_per_token if last else 0.0))


def with_held_scales(cost: ModelCost, held_bytes: Callable[[str], int], precisions: Sequence[str]) -> ModelCost:
    """``cost`` with the resident bytes of each of ``precisions`` measured (``held_bytes(p)``: the
    whole model's weight bytes on one rank of precision p, from the checkpoint's storage), as
    ratios to the float32 bytes priced: a Q4_K file's float32 pairs and Q6_K's int8 blocks of 16
    are then counted as held, not at the precision's nominal bytes per weight."""
    priced = cost.n_layers * cost.layer_bytes + cost.embed_bytes + cost.head_bytes - cost.shared_end_bytes
    if priced <= 0:
        return cost
    names = dict.fromkeys(Precision(rules.precision_name(p, "placement precision")).value for p in precisions)
    return dataclasses.replace(cost, held_scales=tuple((p, held_bytes(p) / priced) for p in names))


def kv_cost(cost: ModelCost, specs: list, max_seq: int) -> ModelCost:
    """``cost`` for (slots, max_seq) with its KV term cut to what the cache policies keep.

    A family prices K and V of every layer for batch x seq tokens; ``none`` keeps no positions
    and ``window:W`` keeps W (`kv_cache.KvSpec.cache_len`), so the planner (and the fit check)
    see the real cache. The largest policy of any rank counts, as one layer's bytes are the
    same on every stage.
    """
    kept = max(s.cache_len(max_seq) for s in specs)
    return dataclasses.replace(cost, kv_bytes_per_layer=cost.kv_bytes_per_layer * kept // max_seq)
