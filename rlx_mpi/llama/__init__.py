"""The Llama model family: config, numpy model, pipeline stage, converter, random init."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import rules
from ..errors import ConfigError, InputError
from ..placement import ModelCost
from ..stage import ModelDims, ParamSource, TensorParallel
from .config import PRESETS, LlamaConfig, expected_shapes

if TYPE_CHECKING:
    from .stage import LlamaStage

__all__ = ["LlamaConfig", "LlamaStage", "PRESETS", "FAMILY", "LlamaFamily", "expected_shapes"]


def __getattr__(name: str):
    # The stage pulls in numba (about a second to import): only ranks that build one pay it.
    if name == "LlamaStage":
        from .stage import LlamaStage

        return LlamaStage
    raise AttributeError(name)


class LlamaFamily:
    """The `ModelFamily` plug-in for Llama checkpoints (``family = "llama"``)."""

    name = "llama"
    hf_model_types = ("llama",)
    presets = PRESETS

    def load_config(self, config_json: str, where: str) -> LlamaConfig:
        return LlamaConfig.from_json(config_json, where)

    def dims(self, cfg: LlamaConfig) -> ModelDims:
        return ModelDims(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         max_positions=cfg.max_position_embeddings, n_layers=cfg.num_hidden_layers)

    def describe(self, cfg: LlamaConfig) -> str:
        return (f"llama, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
                f"({cfg.num_key_value_heads} kv), vocab {cfg.vocab_size}")

    def config_from_shape(self, shape, where: str) -> LlamaConfig:
        for flag in ("experts", "top_k"):
            if shape.get(flag):
                raise ConfigError(f"{where} --{flag.replace('_', '-')}", f"got {shape[flag]}",
                                  "the llama family is dense: leave it out (or choose a family with experts)")
        need = ("layers", "hidden", "heads", "intermediate", "vocab")
        missing = [k for k in need if not shape.get(k)]
        if missing:
            raise ConfigError(where, f"model shape incomplete: missing --{', --'.join(missing)}",
                              "give all of --layers --hidden --heads --intermediate --vocab (and --kv-heads)")
        extra = {"max_position_embeddings": shape["max_positions"]} if shape.get("max_positions") else {}
        return LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                           intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                           num_attention_heads=shape["heads"], num_key_value_heads=shape.get("kv_heads") or shape["heads"],
                           head_dim=shape.get("head_dim") or 0, tie_word_embeddings=bool(shape.get("tied")),
                           **extra).validate(f"{where}: model shape")

    def init_random(self, path, cfg: LlamaConfig, *, seed: int, dtype: str = "float32") -> None:
        from .init import init_random

        init_random(path, cfg, seed, dtype)

    def convert_hf(self, hf_dir, out, *, dtype: str, hf_config=None) -> LlamaConfig:
        from .convert import convert_hf

        return convert_hf(hf_dir, out, dtype=dtype)

    def expected_shapes(self, cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
        return expected_shapes(cfg)

    def cost(self, cfg: LlamaConfig, batch: int, seq: int) -> ModelCost:
        return cfg.cost(batch, seq)

    def check_tp(self, cfg: LlamaConfig, tp: int, where: str) -> None:
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        if nh % tp or nkv % tp:
            valid = [k for k in range(1, nkv + 1) if nh % k == 0 and nkv % k == 0]
            what = (f"tp = {tp} does not divide the model's {nh} attention heads" if nh % tp else
                    f"tp = {tp} does not divide the model's {nkv} key/value heads")
            raise ConfigError(where, what, f"choose tp from {valid}")

    def output_spec(self, cfg: LlamaConfig, batch: int, seq: int, last: bool) -> tuple[tuple[int, ...], np.dtype]:
        return (batch, seq, cfg.vocab_size if last else cfg.hidden_size), np.dtype(np.float32)

    def check_inputs(self, cfg: LlamaConfig, ids: np.ndarray, where: str) -> None:
        rules.ids_array(ids.dtype, ids.shape, where)
        if ids.size == 0:
            raise InputError(where, f"input ids are empty (shape {ids.shape})", "give at least one token")
        rules.seq_fits(ids.shape[1], cfg.max_position_embeddings, where)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= cfg.vocab_size:
            bad = low if low < 0 else high
            raise InputError(where, f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})",
                             "tokenize with this model's tokenizer")

    def build_stage(self, cfg: LlamaConfig, source: ParamSource, layers: range, first: bool, last: bool,
                    tp: TensorParallel, ctx=None, precision: str = "f32") -> "LlamaStage":
        from .stage import LlamaStage

        return LlamaStage(cfg, source, layers, first, last, tp, ctx, precision)


FAMILY = LlamaFamily()
