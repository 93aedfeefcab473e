"""Plug-in interfaces: what a rank computes (`Stage`) and where its weights come from
(`ParamSource`). A model family implements `ModelFamily`; rlx_mpi ships "llama".

Note: a stage never talks to its pipeline neighbours; the schedule (`schedule.py`) decides
the order of receives, computes and sends, and the executor (`executor.py`) moves the bytes
and encodes them in the job's wire format. The only communication inside a stage is the
tensor-parallel collective it is handed.

The contract, exactly as the core uses it (a family implementing only this works; see
tests/protocol_family.py): rlx_mpi calls ``load_config``, ``dims``, ``describe``, ``check_tp``,
``cost``, ``check_inputs``, ``expected_shapes``, ``output_spec`` and ``build_stage(config,
source, layers, first, last, tp, ctx)`` on the family, and ``forward`` and ``weight_bytes`` on
the stage, with ``reset``, ``prefill``, ``decode`` and ``mixed`` for ``generate`` (``layers``,
``first``, ``last`` are read for messages). ``presets``,
``config_from_shape``, ``init_random``, ``hf_model_types`` and ``convert_hf`` serve the
commands that make or price a model (``init-model``, ``[model] preset``, ``plan``,
``convert``); a family may leave them empty or raise `ConfigError` from them. The core never
reads a field of the config object itself: what it needs is in `ModelDims`.

Families are found by name through `rlx_mpi.families` (the registry); the checkpoint's
``family`` attribute picks one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np

from .cost import ModelCost

__all__ = ["ParamSource", "Stage", "StageCaps", "StepBatch", "run_step", "caps_of", "ModelFamily", "ModelDims", "TensorParallel"]


class ParamSource(Protocol):
    """Where a stage's weights come from (an HDF5 file, a user's own store).

    ``read(name)`` returns the whole tensor; with ``axis`` it returns only the ``part``-th of
    ``parts`` near-equal slices along that axis, so a tensor-parallel rank never holds the rest.
    ``dtype`` is what the caller will hold: "float32" (the default), "float16", or "bfloat16"
    (as uint16 bit patterns); a source converts tensor by tensor, so a 16-bit rank never needs
    a float32 copy of the model. Only ranks whose precision is not f32 pass ``dtype``: a source
    written before it existed still serves f32 ranks.
    """

    def read(self, name: str, *, axis: int | None = None, part: int = 0, parts: int = 1,
             dtype: str = "float32") -> np.ndarray: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class TensorParallel:
    """A stage's tensor-parallel group as seen by one rank: ``comm`` is None when tp = 1."""

    rank: int = 0
    size: int = 1
    comm: Any = None  # mpi4py communicator over the stage's ranks
    timeout_s: float = 60.0  # deadline of each collective


@dataclass(frozen=True)
class StageCaps:
    """What a stage does beyond `forward` and whole-prompt generation, declared by its family
    (`Stage.caps`); the drivers read this record and never inspect a method's signature."""

    chunked_prefill: bool = False  # ``prefill(..., start=)`` and ``mixed`` (`Stage`'s default: decode, then prefill)
    prefix_cache: bool = False  # ``reset_prefix`` and ``block_ops``: the prefix cache's blocks
    paged: bool = False  # ``reset_prefix(..., paged=)``: rows read their blocks through block tables
    score_every: bool = False  # ``prefill(..., every=)``: every position's logits (score under the prefix cache)
    forward_window: bool = False  # ``forward(x, window=)``: a sliding window in `run`'s forward
    adapters: bool = False  # ``load_adapters`` and `StepBatch.adapters`: LoRA adapters chosen per row


@dataclass(frozen=True)
class StepBatch:
    """The rows one generate step computes, as a stage receives them (`Stage.step`).

    ``kind``: "prefill" (positions start..start+T-1 of each row, right-padded), "decode" (one token
    a row) or "mixed" (the first ``n_decode`` rows decode, the others prefill a chunk). Per row:
    its cache ``slots``, ``lengths`` (a prefill row's prompt length, a decode row's position), its
    ``keys`` (what names it: `engine.records.Request.key`) and ``index`` (its new tokens so far).
    ``ops``: the prefix cache's block ops (kind, slot, block index, pool block) (m, 4) int64, made
    before (attaches) and after (saves) the step; None without. A per-row feature that changes what
    a stage computes (an adapter) is a field here, never a positional argument."""

    kind: str
    slots: np.ndarray  # (n,) int64
    lengths: np.ndarray  # (n,) int64
    keys: np.ndarray  # (n,) int64
    index: np.ndarray  # (n,) int64
    start: int = 0
    n_decode: int = 0
    ops: np.ndarray | None = None
    adapters: np.ndarray | None = None  # (n,) int64: each row's adapter, the job's index (-1: none); None: none


def run_step(stage: Any, x: np.ndarray, batch: StepBatch) -> np.ndarray:
    """A step through ``stage``: `Stage.step` (a family may override it), or for a stage written
    only to the Protocol's methods the same dispatch as `Stage.step`'s default."""
    return stage.step(x, batch) if isinstance(stage, Stage) else Stage.step(stage, x, batch)


class Stage(abc.ABC):
    """What one rank computes for its layer range.

    The first stage takes int64 ids ``[batch, seq]``; the others take the previous stage's
    output. Every stage returns float32 of the shape its family's ``output_spec`` gives: the
    hidden state, or on the last stage logits ``[batch, seq, vocab]`` (on every TP rank).
    ``forward`` may be called with a smaller batch for the last microbatch of an uneven split.
    """

    layers: range
    first: bool
    last: bool
    caps: StageCaps = StageCaps()  # what it does beyond the basics; a family's stage declares its own

    @abc.abstractmethod
    def forward(self, x: np.ndarray) -> np.ndarray:
        """One forward of a microbatch through this stage."""

    @property
    @abc.abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds."""

    def step(self, x: np.ndarray, batch: StepBatch) -> np.ndarray:
        """One generate step (`StepBatch`): the block ops before, the step's rows by their kind
        (``decode``, ``mixed``, ``prefill``; a later chunk's ``start`` only to a stage that
        declares ``caps.chunked_prefill``), the block ops after. A family overrides it to see
        the whole record (e.g. a row's adapter)."""
        if batch.ops is not None:
            self.block_ops(batch.ops, before=True)
        if batch.kind == "decode":
            out = self.decode(x, batch.slots, batch.lengths)
        elif batch.kind == "mixed":  # decode rows and a prefill chunk in one step
            out = self.mixed(x, batch.slots, batch.lengths, batch.n_decode, batch.start)
        elif batch.start:
            out = self.prefill(x, batch.slots, batch.lengths, start=batch.start)
        else:
            out = self.prefill(x, batch.slots, batch.lengths)
        if batch.ops is not None:
            self.block_ops(batch.ops, before=False)
        return out

    # Generation (``rlx-mpi generate``): optional; a family without it can still ``run``.
    # Rows of a step are cache slots; the last stage returns logits (B, V) of each row's
    # newest token. See `rlx_mpi.kv_cache` for the policies and `rlx_mpi.drivers.generate` for the loop.

    def reset(self, slots: int, max_seq: int, kv: Any) -> int:
        """Allocate the KV cache (`kv_cache.KvSpec`) for ``slots`` sequences of up to ``max_seq``
        tokens; return its bytes."""
        raise NotImplementedError(f"{type(self).__name__} does not support generation")

    def prefill(self, x: np.ndarray, slots: np.ndarray, lengths: np.ndarray, start: int = 0) -> np.ndarray:
        """Positions start..start+T-1 of rows ``slots``, filling the cache; a row's whole prompt is
        ``lengths`` long (right-padded past it), so the last stage returns the logits of each row's
        last real token in the chunk. ``start`` > 0 (chunked prefill, ``[generate] prefill_chunk``)
        is a later chunk: 0..start-1 are in the cache. A Stage whose prefill has no ``start``
        parameter is only ever given whole prompts (positions 0..T-1)."""
        raise NotImplementedError(f"{type(self).__name__} does not support generation")

    def decode(self, x: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One new token per row at ``positions`` (B,), attending over the cache."""
        raise NotImplementedError(f"{type(self).__name__} does not support generation")

    def mixed(self, x: np.ndarray, slots: np.ndarray, pos: np.ndarray, n_decode: int, start: int) -> np.ndarray:
        """A decode of rows 0..n_decode-1 (at positions ``pos``) and a prefill chunk of the others
        (positions start..start+T-1 of prompts ``pos`` long) in one step (chunked prefill beside
        decoding rows). x holds the rows' token rows back to back: ids (1, N) on the first stage,
        else hidden (1, N, C), N = n_decode + rows x T. Returns the same layout, or on the last
        stage logits (n, V) as `decode` and `prefill` give them.

        This default runs `decode` and `prefill` one after the other; a family overrides it to
        read each weight matrix once for both (the decoder family does: `model.MixedKv`). Only
        used when ``prefill`` takes ``start``."""
        nd, n = n_decode, len(slots)
        T = (x.shape[1] - nd) // (n - nd)
        tail = x.shape[2:]
        d = self.decode(x[0, :nd].reshape(nd, 1, *tail), slots[:nd], pos[:nd])
        p = self.prefill(x[0, nd:].reshape(n - nd, T, *tail), slots[nd:], pos[nd:], start=start)
        if self.last:
            return np.concatenate([d, p])
        return np.concatenate([d.reshape(1, nd, -1), p.reshape(1, -1, p.shape[-1])], axis=1)


@dataclass(frozen=True)
class ModelDims:
    """What the core needs to know of a model's shape, whatever its family."""

    vocab_size: int  # logits width; input ids must be < vocab_size
    hidden_size: int  # width of the hidden state a non-last stage hands on
    max_positions: int  # longest sequence (prompt + new tokens) the model accepts
    n_layers: int  # decoder layers the planner places


class ModelFamily(Protocol):
    """A model family: reads its config from a checkpoint, prices it, builds stages."""

    name: str  # the checkpoint's ``family`` attribute
    hf_model_types: tuple[str, ...]  # Hugging Face ``model_type`` values `convert_hf` takes; () for none
    presets: Mapping[str, Any]  # random-model configs by name (init-model, [model] preset, plan --preset)
    precisions: tuple[str, ...]  # what ``build_stage(precision=)`` takes; a family without it: f32 only

    def load_config(self, config_json: str, where: str) -> Any:
        """The config stored in a checkpoint's header; `CheckpointError` naming ``where`` if invalid."""

    def dims(self, config: Any) -> ModelDims:
        """Vocabulary, hidden width, maximum positions and layer count of ``config``."""

    def describe(self, config: Any) -> str:
        """One line for ``plan`` and ``convert``: family, layers, widths, heads, vocab, experts."""

    def config_from_shape(self, shape: Mapping[str, Any], where: str) -> Any:
        """A config from ``plan``'s shape flags: ``layers``, ``hidden``, ``heads``, ``kv_heads``,
        ``intermediate``, ``vocab``, ``tied`` (bool), ``head_dim`` (0: hidden // heads),
        ``experts`` and ``top_k`` (0: dense), ``max_positions``; `ConfigError` naming the flag."""

    def init_random(self, path: Any, config: Any, *, seed: int, dtype: str = "float32") -> None:
        """Write a checkpoint of random weights for ``config`` (`checkpoint.write_checkpoint`)."""

    def convert_hf(self, hf_dir: Any, out: Any, *, dtype: str, hf_config: Mapping[str, Any]) -> Any:
        """Write our checkpoint from a Hugging Face directory whose ``config.json`` (``hf_config``)
        has a ``model_type`` in ``hf_model_types``; return the config. What the family does not
        support is refused before a byte is written (`CheckpointError` naming file, key, value)."""

    def cost(self, config: Any, batch: int, seq: int) -> ModelCost: ...

    def check_tp(self, config: Any, tp: int, where: str) -> None: ...

    def expected_shapes(self, config: Any) -> dict[str, tuple[int, ...]] | None:
        """Every tensor the checkpoint must hold, by name, checked at load; None skips the check."""

    def output_spec(self, config: Any, batch: int, seq: int, last: bool) -> tuple[tuple[int, ...], np.dtype]:
        """The one place that fixes what a stage hands on: shape and dtype (float32) of
        ``forward``'s result, the hidden state or, with ``last``, the logits. Receive buffers are
        sized from it before anything arrives; the job's ``[run] wire`` codec (not the family)
        chooses the bytes on the wire."""

    def check_inputs(self, config: Any, ids: np.ndarray, where: str) -> None:
        """Raise `InputError` naming ``where`` if ``ids`` are not valid input ids."""

    def warm_up(self, config: Any, precision: str, tp: int, decode: bool) -> None:
        """Optional. Load, or compile into numba's on-disk cache, the kernels a stage of
        ``config`` will run at ``precision`` under ``tp`` (``decode``: also those generation
        adds). The cluster calls it on one rank per node before any rank builds its stage, so
        the other ranks of the node load each kernel instead of compiling it too (the cold
        start). A family without it compiles as its stages are built."""

    def build_stage(self, config: Any, source: ParamSource, layers: range, first: bool, last: bool,
                    tp: TensorParallel, ctx: Any) -> Stage:
        """The stage for ``layers``; ``ctx`` is the rank's `faults.RankContext` (for messages and
        for deadlines of the TP collectives; a stage may ignore it). For a rank whose precision
        is not f32 it is also called with ``precision=`` ("bf16" | "f16" | "int8" | "q4"); a family
        without that keyword is refused for such ranks."""


def caps_of(stage: Any) -> StageCaps:
    """A stage's declared `StageCaps` (none for a stage written only to the Protocol's methods)."""
    caps = getattr(stage, "caps", None)
    return caps if isinstance(caps, StageCaps) else StageCaps()
