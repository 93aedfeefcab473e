"""LoRA adapters on a decoder stage: each layer's adapters stacked per projection (`LayerLora`),
a step's rows' adapters (`LoraStep`), and the one call the layer makes after a base product
(`add_`).

Note: unmerged, many at once. A job declares K adapters (the job file's ``[adapters]``, in that
order: index 0..K-1; -1 is the base model). Each rank keeps, per layer and projection, the K
adapters' A and B in float32 beside its base weights whatever their precision (f32, bf16, int8,
q4), so one job serves the base model and every adapter: a row's adapter is a column of the
step (`model.stage.StepBatch.adapters`), expanded here to one entry per token row, and
`kernels.lora_add_` adds each row's own product after the base product. Under TP an adapter is
cut as its projection is (`shard`): a column-parallel projection's B by output rows (A whole),
a row-parallel one's A by input columns (B whole), so o_proj's and down_proj's partial products
are summed by the all-reduce the base product already makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ... import kernels
from ...model.checkpoint import part_bounds
from ..hf.peft import MODULES, LoraModule, read_adapter
from .arch import Arch

__all__ = ["Stack", "LayerLora", "LoraStep", "load_layers", "add_", "token_rows"]


@dataclass
class Stack:
    """One projection's K adapters on one layer: a (K, R, I), b (K, R, O) float32 (B transposed, the
    kernel's layout: `kernels.lora`; zero-padded to the widest rank R), ranks (K,) (0: that
    adapter leaves the projection alone), scale (K,)."""

    a: np.ndarray
    b: np.ndarray
    ranks: np.ndarray
    scale: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


LayerLora = dict  # our projection name -> Stack (only the projections some adapter targets)


@dataclass
class LoraStep:
    """A step's adapters: ``rows`` (N,) int64, each token row's adapter (-1: none), and the
    stage's ``layers`` (one `LayerLora` per layer of the stage)."""

    rows: np.ndarray
    layers: list[LayerLora]

    def __post_init__(self) -> None:  # checked once a step: the projections' calls are not (`add_`)
        self.rows = np.ascontiguousarray(self.rows, np.int64)
        K = next((len(s.ranks) for layer in self.layers for s in layer.values()), 0)
        if self.rows.ndim != 1 or (len(self.rows) and (self.rows.min() < -1 or self.rows.max() >= K)):
            raise ValueError(f"lora: row adapters {self.rows.tolist()[:8]}... must lie in [-1, {K - 1}]")


def token_rows(adapters: np.ndarray | None, kind: str, T: int, n_decode: int = 0) -> np.ndarray | None:
    """Each token row's adapter from each row's (``adapters`` (n,)): a decode row is one token row,
    a prefill row T (its chunk), a mixed step's decode rows first; None when no row has one."""
    if adapters is None:
        return None
    ad = np.asarray(adapters, np.int64)
    if not (ad >= 0).any():
        return None
    if kind == "decode":
        return ad
    if kind == "prefill":
        return np.repeat(ad, T)
    return np.concatenate([ad[:n_decode], np.repeat(ad[n_decode:], T)])


def shard_for(cfg: Arch, tp_rank: int, tp_size: int, kv_part: tuple[int, int]):
    """The `read_adapter` ``shard`` of one TP rank: a column-parallel projection's B rows as its
    weight's (k/v by ``kv_part``: a kv head replicated when tp > kv heads), a row-parallel one's
    A columns."""
    def shard(module: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if tp_size == 1:
            return a, b
        column = MODULES[module][1]
        part, parts = kv_part if module in ("k_proj", "v_proj") else (tp_rank, tp_size)
        if column:
            lo, hi = part_bounds(b.shape[0], part, parts)
            return a, b[lo:hi]
        lo, hi = part_bounds(a.shape[1], part, parts)
        return a[:, lo:hi], b
    return shard


def load_layers(adapters: list[tuple[str, Path]], cfg: Arch, layers: range, shard) -> list[LayerLora]:
    """Per layer of ``layers``, the stacks of the K ``adapters`` (name, directory), in job order."""
    per: list[list[LoraModule]] = [read_adapter(Path(path), name, cfg, layers, shard) for name, path in adapters]
    K = len(adapters)
    out: list[LayerLora] = []
    for n in layers:
        layer: LayerLora = {}
        for module in MODULES:
            found = {k: m for k, mods in enumerate(per) for m in mods if m.layer == n and m.module == module}
            if not found:
                continue
            any_ = next(iter(found.values()))
            R = max(m.a.shape[0] for m in found.values())
            I, O = any_.a.shape[1], any_.b.shape[0]
            a, b = np.zeros((K, R, I), np.float32), np.zeros((K, R, O), np.float32)
            ranks, scale = np.zeros(K, np.int64), np.zeros(K, np.float32)
            for k, m in found.items():
                r = m.a.shape[0]
                a[k, :r], b[k, :r], ranks[k], scale[k] = m.a, m.b.T, r, m.scaling
            layer[module] = Stack(a, b, ranks, scale)
            kernels.lora_add_(np.zeros((1, O), np.float32), np.zeros((1, I), np.float32), np.zeros(1, np.int64),
                              a, b, ranks, scale)  # (the stack's shapes checked once: `add_` calls it unchecked)
        out.append(layer)
    return out


def add_(kv, module: str, y: np.ndarray, x: np.ndarray, col: int = 0) -> None:
    """After the base product ``y = W x`` (..., W) of ``module`` (at columns ``col``.. of a fused
    output), each token row's adapter product, in place; nothing without a `LoraStep` on ``kv``."""
    step = getattr(kv, "lora", None)
    if step is None:
        return
    stack = step.layers[kv.layer].get(module)
    if stack is None:
        return
    if not y.flags.c_contiguous:  # (its 2-D view must be y itself: the sums are added in place)
        raise ValueError(f"lora: {module}'s output must be C-contiguous")
    y2, x2 = y.reshape(-1, y.shape[-1]), np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    if y2.shape[0] != len(step.rows) or x2.shape[0] != len(step.rows) or x2.shape[1] != stack.a.shape[2] \
            or col + stack.b.shape[2] > y2.shape[1]:  # (cheap: the kernel reads them unchecked)
        raise ValueError(f"lora: {module}: {y2.shape[0]} output rows, {x2.shape} input, {len(step.rows)} row "
                         f"adapters and a stack {stack.a.shape} / {stack.b.shape} at column {col} do not fit")
    kernels.lora_add_(y2, x2, step.rows, stack.a, stack.b, stack.ranks, stack.scale, col, checked=True)
