"""Random Llama checkpoints from a preset, for trying the pipeline without a download."""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from ..checkpoint import write_checkpoint
from .config import LlamaConfig
from .config import expected_shapes

__all__ = ["init_random"]


def _random_tensors(cfg: LlamaConfig, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors one at a time (so a large preset never sits in memory whole).

    Linear weights are scaled by 1/sqrt(fan_in) and norms scattered around 1, so hidden
    states and logits stay O(1) through every layer and numerical comparisons mean something.
    """
    rng = np.random.default_rng(seed)
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            yield name, 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            scale = 1.0 if name == "embed_tokens" else shape[1] ** -0.5
            yield name, scale * rng.standard_normal(shape, dtype=np.float32)


def init_random(path: str | os.PathLike, cfg: LlamaConfig, seed: int = 0, dtype: str = "float32") -> None:
    """Write a random checkpoint of shape ``cfg`` to ``path`` (atomically)."""
    write_checkpoint(path, "llama", cfg.to_json(), _random_tensors(cfg, seed), dtype=dtype)
