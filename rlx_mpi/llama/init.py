"""Compatibility: `init_random` of the family that owns ``cfg``'s checkpoint name (llama)."""

from __future__ import annotations

import os

from ..families.decoder.arch import Arch
from ..families.decoder.family import random_tensors as _random_tensors
from ..families.llama import FAMILY

__all__ = ["init_random"]


def init_random(path: str | os.PathLike, cfg: Arch, seed: int = 0, dtype: str = "float32") -> None:
    """Write a random checkpoint of shape ``cfg`` to ``path`` (atomically)."""
    FAMILY.init_random(path, cfg, seed=seed, dtype=dtype)
