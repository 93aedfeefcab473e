"""Gemma 3 (text): Hugging Face ``model_type = "gemma3_text"``: Gemma 2's (1 + w) RMSNorm,
sandwich norms, GeGLU (tanh), embeddings x sqrt(hidden) and ``query_pre_attn_scalar``, plus
per-head q/k RMSNorm (1 + w), five sliding-window layers to one full (``layer_types``) and two
RoPE bases: the local layers default RoPE at ``rope_local_base_freq`` (10 000), the global ones
``rope_theta`` (1 000 000) with linear scaling in the 4B+ models. No attention soft-cap (the
config key is ignored by transformers' Gemma 3, so by us); a final soft-cap if the config has one.
Covers Gemma-3-270M/1B (``gemma3_text``) and Gemma-3-4B/12B/27B (and -it) as published: the
multimodal ``model_type = "gemma3"`` (``Gemma3ForConditionalGeneration``), whose language model
(``text_config``, its keys defaulted as ``Gemma3TextConfig`` does) is converted and whose SigLIP
vision tower and projector are left out (`hf.text_tower`): text in, text out.
"""

from __future__ import annotations

import math

from ..errors import CheckpointError
from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .gemma import _cap
from .gemma import hf_names as gemma2_names
from .hf import refuse_if, rope_fields, sizes, sliding_windows

__all__ = ["FAMILY", "arch_from_hf", "hf_names"]

_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig.default_theta


def _ropes(raw: dict, where: str) -> tuple[dict, float]:
    """(the global layers' RoPE fields, the local base) from 5.x's per-layer-type
    ``rope_parameters`` or 4.x's ``rope_theta`` + ``rope_scaling`` + ``rope_local_base_freq``."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ({"full_attention", "sliding_attention"} & set(params)):
        full = {"rope_theta": _GLOBAL_THETA, **(params.get("full_attention") or {})}
        local = {"rope_theta": _LOCAL_THETA, **(params.get("sliding_attention") or {})}
        fields = rope_fields({"rope_parameters": full}, f"{where} (full_attention)", ("default", "linear"))
        base = rope_fields({"rope_parameters": local}, f"{where} (sliding_attention)", ("default",))["rope_theta"]
        return fields, base
    if "rope_local_base_freq" in raw or "rope_theta" in raw or "rope_scaling" in raw:  # 4.x
        flat = {k: v for k, v in raw.items() if k != "rope_local_base_freq"}
        flat.setdefault("rope_theta", _GLOBAL_THETA)
        base = raw.get("rope_local_base_freq", _LOCAL_THETA)
        refuse_if(raw, where, "rope_local_base_freq", isinstance(base, bool) or not isinstance(base, (int, float))
                  or not base > 0, "expected a positive number")
        return rope_fields(flat, where, ("default", "linear")), float(base)
    raise CheckpointError(f"{where}: rope_parameters", f"is {params!r}",
                          "expected full_attention and sliding_attention entries (transformers 5) or rope_theta")


def _windows(raw: dict, where: str, layers: int) -> tuple:
    """``layer_types``; a 4.x config without it: every ``sliding_window_pattern``-th layer full."""
    if "sliding_window" not in raw:
        raw = {**raw, "sliding_window": 4096}  # Gemma3TextConfig's default
    if raw.get("layer_types") is None:
        pattern = raw.get("sliding_window_pattern", 6)
        refuse_if(raw, where, "sliding_window_pattern", isinstance(pattern, bool) or not isinstance(pattern, int)
                  or pattern <= 0, "expected a positive integer")
        raw = {**raw, "layer_types": ["sliding_attention" if (n + 1) % pattern else "full_attention"
                                      for n in range(layers)]}
    return sliding_windows(raw, where, layers)


# Gemma3TextConfig's defaults: the Hub's multimodal configs give only what differs from them
_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096)


def _text_config(raw: dict, where: str) -> dict:
    """The language model's config of a multimodal ``gemma3`` checkpoint, defaults filled."""
    text = raw.get("text_config")
    refuse_if(raw, where, "text_config", not isinstance(text, dict), "expected the language model's config object")
    refuse_if(text, where, "text_config.model_type", text.get("model_type", "gemma3_text") != "gemma3_text",
              "expected gemma3_text")
    return {**_TEXT_DEFAULTS, "tie_word_embeddings": raw.get("tie_word_embeddings", True), **text}


def arch_from_hf(raw: dict, where: str) -> Arch:
    if raw.get("model_type") == "gemma3":
        raw, where = _text_config(raw, where), f"{where}: text_config"
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    refuse_if({"hidden_activation": act}, where, "hidden_activation", act not in ("gelu_pytorch_tanh", "gelu_tanh"),
              "only GeGLU with the tanh approximation (gelu_pytorch_tanh) is supported")
    refuse_if(raw, where, "attention_bias", bool(raw.get("attention_bias", False)),
              "linear layers with biases are not supported")
    refuse_if(raw, where, "use_bidirectional_attention", bool(raw.get("use_bidirectional_attention")),
              "only causal (decoder) attention is supported")
    shape = sizes(raw, where, tie_default=True, max_positions_default=131072)
    head_dim = shape["head_dim"] or 256  # Gemma3TextConfig's default, not hidden / heads
    shape["head_dim"] = head_dim
    scalar = raw.get("query_pre_attn_scalar", 256)
    refuse_if(raw, where, "query_pre_attn_scalar", isinstance(scalar, bool) or not isinstance(scalar, (int, float))
              or not scalar > 0, "expected a positive number")
    rope, local_theta = _ropes(raw, where)
    windows = _windows(raw, where, shape["num_hidden_layers"])
    return Arch(**shape, **rope, norm_offset=1.0, activation="gelu_tanh", qk_norm=True,
                embedding_multiplier=math.sqrt(shape["hidden_size"]), attention_scale=float(scalar) ** -0.5,
                final_logit_softcap=_cap(raw, where, "final_logit_softcapping"), sandwich_norms=True,
                layer_windows=windows, rope_local_theta=local_theta if windows else 0.0)


def hf_names(cfg: Arch):
    return gemma2_names(cfg)  # Gemma 2's four norms; q_norm / k_norm under self_attn as Qwen3


FAMILY = DecoderFamily("gemma3", ("gemma3_text", "gemma3"), arch_from_hf, hf_names)
