"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, head_dim of its own).

Hugging Face ``model_type = "qwen2"`` covers Qwen2-0.5B..72B and Qwen2.5-0.5B..72B (the small
ones tie the head); ``"qwen3"`` covers the dense Qwen3-0.6B..32B. Sliding-window layers
(``use_sliding_window``, off in every released config) follow ``layer_types``.
"""

from __future__ import annotations

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import refuse_if, rope_fields, sizes, sliding_windows, standard_names
from .llama import silu_only

__all__ = ["QWEN2", "QWEN3", "qwen2_arch", "qwen3_arch"]


def _windows(raw: dict, where: str, layers: int) -> tuple:
    """``layer_types`` when the config has it (5.x); else (4.x) layers from ``max_window_layers``
    on slide when ``use_sliding_window`` is set, as transformers derives layer_types."""
    if "layer_types" in raw or not raw.get("use_sliding_window", False):
        return sliding_windows(raw, where, layers) if raw.get("layer_types") else ()
    first = raw.get("max_window_layers", layers)
    types = ["sliding_attention" if n >= first else "full_attention" for n in range(layers)]
    return sliding_windows({**raw, "layer_types": types}, where, layers)


def qwen2_arch(raw: dict, where: str) -> Arch:
    silu_only(raw, where)
    shape = sizes(raw, where, max_positions_default=32768)
    return Arch(**shape, **rope_fields(raw, where, ("default", "linear", "llama3")), qkv_bias=True,
                layer_windows=_windows(raw, where, shape["num_hidden_layers"]))


def qwen3_arch(raw: dict, where: str) -> Arch:
    silu_only(raw, where)
    refuse_if(raw, where, "attention_bias", bool(raw.get("attention_bias", False)),
              "Qwen3 with q/k/v/o biases is not supported (no released model has them)")
    shape = sizes(raw, where, max_positions_default=32768)
    return Arch(**shape, **rope_fields(raw, where, ("default", "linear", "llama3")), qk_norm=True,
                layer_windows=_windows(raw, where, shape["num_hidden_layers"]))


QWEN2 = DecoderFamily("qwen2", ("qwen2",), qwen2_arch, standard_names)
QWEN3 = DecoderFamily("qwen3", ("qwen3",), qwen3_arch, standard_names)
FAMILY = QWEN2
