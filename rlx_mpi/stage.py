"""Plug-in interfaces: what a rank computes (`Stage`) and where its weights come from
(`ParamSource`). A model family implements `ModelFamily`; rlx_mpi ships "llama".

Note: a stage never talks to its pipeline neighbours; the schedule (`schedule.py`) decides
the order of receives, computes and sends, and the driver (`driver.py`) moves the bytes.
The only communication inside a stage is the tensor-parallel collective it is handed.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .placement import ModelCost

__all__ = ["ParamSource", "Stage", "ModelFamily", "TensorParallel", "register_family", "get_family"]


class ParamSource(Protocol):
    """Where a stage's weights come from (an HDF5 file, a user's own store).

    ``read(name)`` returns the whole tensor; with ``axis`` it returns only the ``part``-th of
    ``parts`` near-equal slices along that axis, so a tensor-parallel rank never holds the rest.
    """

    def read(self, name: str, *, axis: int | None = None, part: int = 0, parts: int = 1) -> np.ndarray: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class TensorParallel:
    """A stage's tensor-parallel group as seen by one rank: ``comm`` is None when tp = 1."""

    rank: int = 0
    size: int = 1
    comm: Any = None  # mpi4py communicator over the stage's ranks
    timeout_s: float = 60.0  # deadline of each collective


class Stage(abc.ABC):
    """What one rank computes for its layer range.

    The first stage takes int64 ids ``[batch, seq]``; the others take the previous stage's
    output. The last stage returns logits ``[batch, seq, vocab]`` (on every TP rank).
    """

    layers: range
    first: bool
    last: bool

    @abc.abstractmethod
    def output_spec(self, batch: int, seq: int) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of ``forward``'s result; fixes the wire buffers at setup."""

    @abc.abstractmethod
    def forward(self, x: np.ndarray) -> np.ndarray:
        """One forward of a microbatch through this stage."""

    @property
    @abc.abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds."""

    # Generation (``rlx-mpi generate``): optional; a family without it can still ``run``.
    # Rows of a step are cache slots; the last stage returns logits (B, V) of each row's
    # newest token. See `rlx_mpi.kv_cache` for the policies and `rlx_mpi.generation` for the loop.

    def reset(self, slots: int, max_seq: int, kv: Any) -> int:
        """Allocate the KV cache (`kv_cache.KvSpec`) for ``slots`` sequences of up to ``max_seq``
        tokens; return its bytes."""
        raise NotImplementedError(f"{type(self).__name__} does not support generation")

    def prefill(self, x: np.ndarray, slots: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Positions 0..T-1 of rows ``slots`` (right-padded past ``lengths``), filling the cache."""
        raise NotImplementedError(f"{type(self).__name__} does not support generation")

    def decode(self, x: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One new token per row at ``positions`` (B,), attending over the cache."""
        raise NotImplementedError(f"{type(self).__name__} does not support generation")


class ModelFamily(Protocol):
    """A model family: reads its config from a checkpoint, prices it, builds stages."""

    name: str

    def load_config(self, config_json: str, where: str) -> Any: ...

    def cost(self, config: Any, batch: int, seq: int) -> ModelCost: ...

    def check_tp(self, config: Any, tp: int, where: str) -> None: ...

    def output_spec(self, config: Any, batch: int, seq: int, last: bool) -> tuple[tuple[int, ...], np.dtype]:
        """What a stage sends on (hidden state) or, for the last, returns (logits)."""

    def check_inputs(self, config: Any, ids: np.ndarray, where: str) -> None: ...

    def build_stage(self, config: Any, source: ParamSource, layers: range, first: bool, last: bool,
                    tp: TensorParallel) -> Stage: ...


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> None:
    """Make ``family`` loadable from checkpoints whose ``family`` attribute is its name."""
    _FAMILIES[family.name] = family


def get_family(name: str) -> ModelFamily | None:
    if name == "llama" and name not in _FAMILIES:  # registered lazily, so import stays cheap;
        from .llama import FAMILY  # a plug-in registering first must not hide it

        _FAMILIES.setdefault(FAMILY.name, FAMILY)
    return _FAMILIES.get(name)
