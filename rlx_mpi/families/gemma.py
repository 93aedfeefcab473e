"""Gemma 2: Hugging Face ``model_type = "gemma2"``: (1 + w) RMSNorm, norms before *and after*
attention and MLP, GeGLU (tanh), embeddings x sqrt(hidden), scores x query_pre_attn_scalar^-1/2,
attention and final logit soft-capping, a sliding window on alternate layers, tied head.
Covers Gemma-2-2B/9B/27B (and their -it variants)."""

from __future__ import annotations

import math

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import refuse_if, rope_fields, sizes, sliding_windows, standard_names

__all__ = ["FAMILY", "arch_from_hf", "hf_names"]


def _cap(raw: dict, where: str, key: str) -> float:
    value = raw.get(key)
    refuse_if(raw, where, key, value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                       or not value > 0), "expected a positive number or null")
    return float(value or 0.0)


def arch_from_hf(raw: dict, where: str) -> Arch:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    refuse_if({"hidden_activation": act}, where, "hidden_activation", act not in ("gelu_pytorch_tanh", "gelu_tanh"),
              "only GeGLU with the tanh approximation (gelu_pytorch_tanh) is supported")
    for key in ("attention_bias",):
        refuse_if(raw, where, key, bool(raw.get(key, False)), "linear layers with biases are not supported")
    refuse_if(raw, where, "use_bidirectional_attention", bool(raw.get("use_bidirectional_attention")),
              "only causal (decoder) attention is supported")
    shape = sizes(raw, where, tie_default=True, max_positions_default=8192)
    head_dim = shape["head_dim"] or shape["hidden_size"] // shape["num_attention_heads"]
    scalar = raw.get("query_pre_attn_scalar", head_dim)
    refuse_if(raw, where, "query_pre_attn_scalar", isinstance(scalar, bool) or not isinstance(scalar, (int, float))
              or not scalar > 0, "expected a positive number")
    windows = sliding_windows(raw, where, shape["num_hidden_layers"])
    if raw.get("sliding_window") and "layer_types" not in raw:  # before layer_types: even layers slide
        windows = tuple(raw["sliding_window"] if n % 2 == 0 else 0 for n in range(shape["num_hidden_layers"]))
    return Arch(**shape, **rope_fields(raw, where, ("default",)), norm_offset=1.0, activation="gelu_tanh",
                embedding_multiplier=math.sqrt(shape["hidden_size"]), attention_scale=float(scalar) ** -0.5,
                attn_logit_softcap=_cap(raw, where, "attn_logit_softcapping"),
                final_logit_softcap=_cap(raw, where, "final_logit_softcapping"), sandwich_norms=True,
                layer_windows=windows)


def hf_names(cfg: Arch):
    # Gemma 2's post_attention_layernorm is applied to the attention output (our attn_out_norm);
    # its pre_feedforward_layernorm is the norm before the MLP (our post_attention_layernorm).
    return standard_names(cfg, {"post_attention_layernorm": "pre_feedforward_layernorm.weight",
                                "attn_out_norm": "post_attention_layernorm.weight",
                                "mlp_out_norm": "post_feedforward_layernorm.weight"})


FAMILY = DecoderFamily("gemma2", ("gemma2",), arch_from_hf, hf_names)
