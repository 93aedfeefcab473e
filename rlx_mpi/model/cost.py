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

__all__ = ["ModelCost", "decoding", "kv_cost", "with_adapters", "with_held_scales", "StepCost", "step_cost", "Machine"]


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
    attn_flops_per_pos: float = 0.0  # attention FLOPs of one token and one position it attends, one layer
    dense_flops_per_token: float = 0.0  # one layer's FLOPs of a token but attention (0: not told, then
    # `step_cost` takes layer_flops_per_token, which prices every token's attention at the full seq)
    hidden_size: int = 0  # the hidden state's width (what a stage sends a token; 0: not told)
    adapter_bytes_per_layer: int = 0  # the job's LoRA adapters on the layer that holds most (float32 at any
    # precision, so never scaled by one; `with_adapters`)
    seq: int = 0  # positions of a row in the forward planned (tokens = rows x seq; 0: not told, one row)
    decode: bool = False  # the planner balances a decode step of the rows (generate's steady state), not a
    # forward of their every position through the head (run, score): `planned_step`

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
        return weights + n * (self.kv_bytes_per_layer + self.adapter_bytes_per_layer) + self.act_bytes

    def layer_cost_bytes(self, weight_scale: float = 1.0) -> int:
        """Bytes one more layer adds to a stage."""
        return ((self.layer_bytes if weight_scale == 1.0 else int(self.layer_bytes * weight_scale))
                + self.kv_bytes_per_layer + self.adapter_bytes_per_layer)

    def planned_step(self) -> list[tuple[int, int]]:
        """The step the planner balances, as `step_cost`'s rows ``(positions, start)``: the
        ``tokens / seq`` rows each forwarded over ``seq`` positions (run, score), or, with
        ``decode``, each decoding one token at the middle of its ``seq`` (generate)."""
        seq = self.seq or max(1, self.tokens)
        rows = max(1, self.tokens // seq)
        return [(1, seq // 2)] * rows if self.decode else [(seq, 0)] * rows

    def stage_flops(self, layers: range, last: bool) -> float:
        """FLOPs of the planned step (`planned_step`) through a stage (all TP shards together),
        priced by `step_cost` as ``plan --simulate`` prices a job's steps: a forward turns every
        position into logits, a decode step one a row."""
        return step_cost(self, len(layers), self.planned_step(), last=last, every=not self.decode).flops


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


def decoding(cost: ModelCost) -> ModelCost:
    """``cost`` planned on a decode step of its rows (``generate``: one logit a row), not a forward
    of their every position (`ModelCost.planned_step`)."""
    return dataclasses.replace(cost, decode=True)


def with_adapters(cost: ModelCost, per_layer: int) -> ModelCost:
    """``cost`` with the job's LoRA adapters: ``per_layer`` bytes on every layer (the most any layer
    holds: `families.hf.peft.stacked_layer_bytes`). Under TP a column-parallel adapter's A is
    whole on each rank (B split), so a TP stage holds a little more than this counts (r x in x 4
    bytes a projection and rank: 256 KiB at r = 16 on a 4096-wide one)."""
    return dataclasses.replace(cost, adapter_bytes_per_layer=int(per_layer))


# -- the price of one step ------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCost:
    """What one step costs one stage (all its TP ranks together; `per_rank` divides by tp)."""

    flops: float  # dense products (each position x every layer's weights) + attention by context
    weight_bytes: float  # weights read: each layer's once per step, whatever the rows (the decode note)
    kv_bytes: float  # cache read: every attended position's K and V, each layer
    send_bytes: float  # the hidden state to the next stage (or the tokens back: 8 a row)
    allreduce_bytes: float  # under tp: two all-reduces of the positions' hidden state a layer
    # what a calibrated price (`model.calibration`) needs beside the totals above
    layers: int = 0
    positions: int = 0  # token positions through the layers' products
    rows: int = 0
    product_weights: float = 0.0  # weights a position multiplies by in the layers (active ones: MoE)
    head_weights: float = 0.0  # the head's, multiplied by head_rows positions (one a row, or every one)
    head_rows: int = 0
    attn_prefill_flops: float = 0.0  # attention of prefill chunks (many queries a row)
    attn_decode_flops: float = 0.0  # attention of decode rows (one query against the cache)
    context: float = 0.0  # the rows' mean attended length (the attention rate depends on it)
    hidden: int = 0

    def seconds(self, m: "Machine", tp: int = 1) -> float:
        """Time on one rank of ``m`` when the stage is ``tp`` ranks: compute or memory, whichever
        binds, plus what its links move (the all-reduce's ring moves 2 (tp-1)/tp of its bytes)."""
        compute = self.flops / tp / (m.gflops * 1e9)
        memory = (self.weight_bytes + self.kv_bytes) / tp / (m.gbps * 1e9)
        reduce = self.allreduce_bytes * 2 * (tp - 1) / tp / (m.link_gbps * 1e9) if tp > 1 else 0.0
        return max(compute, memory) + reduce + self.send_bytes / (m.link_gbps * 1e9)


@dataclass(frozen=True)
class Machine:
    """One rank's rates: dense float GFLOP/s, memory GB/s (weights streamed), link GB/s."""

    gflops: float = 100.0
    gbps: float = 20.0
    link_gbps: float = 5.0


def step_cost(cost: ModelCost, layers: int, contexts: Sequence[tuple[int, int]], *, last: bool,
              weight_scale: float = 1.0, every: bool = False) -> StepCost:
    """Price one step of ``layers`` layers (a stage's) for rows given as ``(positions, start)``:
    a decode row is ``(1, its position)``, a prefill chunk ``(T, start)``. Each position attends to
    every position before it and itself; the last stage turns one position a row into logits.

    E.g. a decode step of 8 rows at position 511: ``step_cost(c, L, [(1, 511)] * 8, last=True)``;
    a 512-token prefill: ``[(512, 0)]``. Bytes of weights scale with ``weight_scale`` (a rank
    holding bf16 weights reads half the float32 bytes priced). ``every``: the last stage turns
    every position into logits (``score``), not one a row."""
    positions = sum(t for t, _ in contexts)
    attended = sum(t * start + t * (t + 1) / 2 for t, start in contexts)  # sum over positions of (pos + 1)
    dense = cost.dense_flops_per_token or cost.layer_flops_per_token
    flops = layers * (positions * dense + attended * cost.attn_flops_per_pos)
    kv_pos = cost.kv_bytes_per_layer / max(1, cost.tokens)  # one position's K and V, one layer
    rows = len(contexts)
    head_rows = (positions if every else rows) if last else 0
    flops += head_rows * cost.head_flops_per_token
    weights = layers * cost.layer_bytes * weight_scale + (cost.head_bytes * weight_scale if last else 0.0)
    hidden = cost.hidden_size * 4.0
    prefill = [(t, start) for t, start in contexts if t > 1]
    attended_prefill = sum(t * start + t * (t + 1) / 2 for t, start in prefill)
    return StepCost(flops=flops, weight_bytes=weights, kv_bytes=layers * attended * kv_pos,
                    send_bytes=8.0 * rows if last else positions * hidden,
                    allreduce_bytes=layers * 2 * positions * hidden,
                    layers=layers, positions=positions, rows=rows,
                    product_weights=layers * dense / 2, head_weights=cost.head_flops_per_token / 2 if last else 0.0,
                    head_rows=head_rows,
                    attn_prefill_flops=layers * attended_prefill * cost.attn_flops_per_pos,
                    attn_decode_flops=layers * (attended - attended_prefill) * cost.attn_flops_per_pos,
                    context=attended / positions if positions else 0.0, hidden=cost.hidden_size)
