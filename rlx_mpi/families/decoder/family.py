"""`DecoderFamily`: the whole `ModelFamily` contract for every `Arch` decoder.

A family module (llama.py, mistral.py, ...) only gives its name, Hugging Face model types,
config translation (``arch_from_hf``), name map (``hf_names``) and presets; this class does
the rest once: config loading, shapes, cost, TP checks, inputs, random init and the stage.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from ...errors import CheckpointError, ConfigError, InputError
from ... import rules
from ...model.cost import ModelCost
from ...model.stage import ModelDims, ParamSource, TensorParallel
from .arch import Arch, expected_shapes

__all__ = ["DecoderFamily", "random_tensors"]


class DecoderFamily:
    """A `rlx_mpi.stage.ModelFamily` over `Arch`; ``name`` is the checkpoint's ``family``."""

    prefix_cache = True  # its Stage keeps a prefix cache's pool and copies blocks (`DecoderStage.reset_prefix`)
    precisions = rules.PRECISIONS  # build_stage(precision=) takes every one (`decoder.weights`)

    def __init__(self, name: str, hf_model_types: tuple[str, ...], arch_from_hf: Callable[[dict, str], Arch],
                 hf_names: Callable[[Arch], dict], presets: Mapping[str, Arch] | None = None,
                 shape_defaults: Mapping[str, Any] | None = None,
                 hf_ignore: Callable[[Arch], Callable[[str], bool]] | None = None):
        self.name = name
        self.hf_model_types = hf_model_types
        self.arch_from_hf = arch_from_hf
        self.hf_names = hf_names
        self.presets = dict(presets or {})
        self._shape_defaults = dict(shape_defaults or {})
        self.hf_ignore = hf_ignore  # Hugging Face tensors the converter may leave (DeepSeek's MTP layer)

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    def load_config(self, config_json: str, where: str) -> Arch:
        return Arch.from_json(config_json, where)

    def dims(self, cfg: Arch) -> ModelDims:
        return ModelDims(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         max_positions=cfg.max_position_embeddings, n_layers=cfg.num_hidden_layers)

    def describe(self, cfg: Arch) -> str:
        heads = f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} kv, head_dim {cfg.head_dim})"
        if cfg.kv_lora_rank:  # MLA: one latent for all heads
            heads = (f"{cfg.num_attention_heads} heads (latent attention: cache {cfg.kv_lora_rank} + {cfg.head_dim} "
                     f"rope per token)")
        moe = f", {cfg.num_experts} experts (top {cfg.experts_per_token})" if cfg.num_experts else ""
        if cfg.shared_intermediate_size:
            moe = moe[:-1] + f", {cfg.shared_intermediate_size // cfg.intermediate_size} shared)"
        rope = f", rope {cfg.rope_type}" if cfg.rope_type != "default" else ""
        total, active = cfg.parameters(), cfg.parameters(active=True)
        size = f"{_count(total)} parameters"  # published sizes count the tied head once, as here
        if cfg.num_experts:  # a token multiplies all but the embedding: 2 FLOPs a parameter (+ attention)
            lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
            size += (f" ({_count(active)} active: {_flops(2 * (active - lookup))} of "
                     f"{_flops(2 * (total - lookup))} a token)")
        kv = f"KV cache {_bytes(cfg.kv_bytes_per_token() * 1000)} per 1k tokens"
        sliding = [w for w in cfg.layer_windows if w]
        if sliding:  # a sliding layer's ring stops growing at its window
            kv += f" ({len(sliding)} of {cfg.num_hidden_layers} layers keep at most {max(sliding)})"
        return (f"{self.name}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {heads}, "
                f"vocab {cfg.vocab_size}{moe}{rope}; {size}; {kv}")

    def config_from_shape(self, shape: Mapping[str, Any], where: str) -> Arch:
        s = {**self._shape_defaults, **{k: v for k, v in shape.items() if v is not None}}
        missing = [k for k in ("layers", "hidden", "heads", "intermediate", "vocab") if not s.get(k)]
        if missing:
            raise ConfigError(where, f"model shape incomplete: missing --{', --'.join(missing)}",
                              "give all of --layers --hidden --heads --intermediate --vocab (and --kv-heads)")
        try:
            cfg = Arch(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s.get("kv_heads") or s["heads"], head_dim=s.get("head_dim") or 0,
                       max_position_embeddings=s.get("max_positions") or 2048,
                       tie_word_embeddings=bool(s.get("tied", False)), num_experts=s.get("experts") or 0,
                       experts_per_token=s.get("top_k") or (2 if s.get("experts") else 0))
        except KeyError as e:
            raise ConfigError(where, f"model shape lacks {e.args[0]}", "give --layers --hidden --heads "
                              "--intermediate --vocab") from None
        try:
            return cfg.validate(where)
        except CheckpointError as e:  # the flags are the user's input here, not a checkpoint
            raise ConfigError(where, e.what, "fix the shape flags") from None

    def init_random(self, path: str | os.PathLike, cfg: Arch, *, seed: int = 0, dtype: str = "float32") -> None:
        from ...model.checkpoint import write_checkpoint

        from .weights import q4_tensor

        write_checkpoint(path, self.name, cfg.to_json(), random_tensors(cfg, seed), dtype=dtype,
                         quantize=q4_tensor if dtype == "q4" else None)

    def convert_hf(self, hf_dir, out, *, dtype: str = "float32", hf_config: Mapping[str, Any] | None = None,
                   **kw) -> Arch:
        from ..hf import convert

        return convert(self, hf_dir, out, dtype=dtype, hf_config=dict(hf_config) if hf_config is not None else None,
                       **kw)

    def expected_shapes(self, cfg: Arch) -> dict[str, tuple[int, ...]]:
        return expected_shapes(cfg)

    def cost(self, cfg: Arch, batch: int, seq: int) -> ModelCost:
        return cfg.cost(batch, seq)

    def held_bytes(self, cfg: Arch, checkpoint, precision: str) -> int:
        """The whole model's resident weight bytes on a rank of ``precision``, from the checkpoint's
        storage (`weights.held_bytes`; only attributes are read): the planner's measured prices."""
        from ...model.checkpoint import H5ParamSource
        from .weights import held_bytes

        with H5ParamSource(checkpoint, expected_shapes(cfg)) as src:
            return held_bytes(cfg, src, precision)

    def check_tp(self, cfg: Arch, tp: int, where: str) -> None:
        nh, nkv, ne = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_experts

        def kv_ok(k):  # a 1/k slice of the kv heads, or one replicated head per rank
            return nkv % k == 0 or k % nkv == 0

        if nh % tp or not kv_ok(tp) or (ne and ne % tp):
            valid = [k for k in range(1, nh + 1) if nh % k == 0 and kv_ok(k) and (not ne or ne % k == 0)]
            what = (f"tp = {tp} does not divide the model's {nh} attention heads" if nh % tp else
                    f"tp = {tp} neither divides nor is a multiple of the model's {nkv} key/value heads"
                    if not kv_ok(tp) else
                    f"tp = {tp} does not divide the model's {ne} experts (each TP rank holds whole experts)")
            raise ConfigError(where, what, f"choose tp from {valid}")

    def output_spec(self, cfg: Arch, batch: int, seq: int, last: bool) -> tuple[tuple[int, ...], np.dtype]:
        return (batch, seq, cfg.vocab_size if last else cfg.hidden_size), np.dtype(np.float32)

    def check_inputs(self, cfg: Arch, ids: np.ndarray, where: str) -> None:
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(where, f"input ids have dtype {ids.dtype}", "save them as an integer array (np.int64)")
        if ids.ndim != 2:
            raise InputError(where, f"input ids have shape {ids.shape}, expected 2-D [batch, seq]",
                             "reshape to [batch, seq], e.g. ids[None, :] for one sequence")
        if ids.size == 0:
            raise InputError(where, f"input ids are empty (shape {ids.shape})", "give at least one token")
        if ids.shape[1] > cfg.max_position_embeddings:
            raise InputError(where, f"sequence length {ids.shape[1]} exceeds the model's maximum "
                             f"{cfg.max_position_embeddings} positions", "truncate or split the sequences")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= cfg.vocab_size:
            bad = low if low < 0 else high
            raise InputError(where, f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})",
                             "tokenize with this model's tokenizer")

    def warm_up(self, cfg: Arch, precision: str = "f32", tp: int = 1, decode: bool = False) -> None:
        from .stage import warm_up

        warm_up(cfg, precision, tp, decode)

    def build_stage(self, cfg: Arch, source: ParamSource, layers: range, first: bool, last: bool,
                    tp: TensorParallel = TensorParallel(), ctx=None, precision: str = "f32"):
        from .stage import DecoderStage

        return DecoderStage(cfg, source, layers, first, last, tp, ctx, precision)


def _count(n: float, digits: int = 2) -> str:
    """235.09 B, 135.0 M: a count in the unit it reads best in (B = 10^9, M = 10^6)."""
    return f"{n / 1e9:.{digits}f} B" if n >= 1e9 else f"{n / 1e6:.{digits}f} M"


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _flops(n: float) -> str:
    return f"{n / 1e9:.1f} GFLOP" if n >= 1e9 else f"{n / 1e6:.1f} MFLOP"


def random_tensors(cfg: Arch, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors one at a time (so a large preset never sits in memory whole).

    Linear weights are scaled by 1/sqrt(fan_in) and norms scattered around 1 (around 0 with
    a norm offset of 1, as Gemma stores them), biases small, so hidden states and logits stay
    O(1) through every layer and numerical comparisons mean something."""
    rng = np.random.default_rng(seed)
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            base = 0.0 if name.endswith("_bias") else 1.0 - cfg.norm_offset
            yield name, base + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            scale = 1.0 if name == "embed_tokens" else shape[1] ** -0.5
            yield name, scale * rng.standard_normal(shape, dtype=np.float32)

