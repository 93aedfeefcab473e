"""Granite 3: Hugging Face ``model_type = "granite"``: Llama with four scalars:
``embedding_multiplier`` (embeddings x it), ``residual_multiplier`` (each attention and MLP
output x it before the residual add), ``attention_multiplier`` (the softmax scale, in place of
head_dim^-1/2) and ``logits_scaling`` (logits divided by it). Covers Granite-3.0/3.1/3.2/3.3
2B and 8B (base and -instruct; tied head). Not the MoE Granite (``granitemoe``) nor Granite 4.
"""

from __future__ import annotations

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import refuse_if, rope_fields, sizes, standard_names
from .llama import no_biases, silu_only

__all__ = ["FAMILY", "arch_from_hf"]


def _scalar(raw: dict, where: str, key: str) -> float:
    value = raw.get(key, 1.0)  # GraniteConfig's default for all four
    refuse_if(raw, where, key, isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0,
              "expected a positive number")
    return float(value)


def arch_from_hf(raw: dict, where: str) -> Arch:
    no_biases(raw, where)
    silu_only(raw, where)
    shape = sizes(raw, where)
    return Arch(**shape, **rope_fields(raw, where, ("default", "linear", "llama3")),
                embedding_multiplier=_scalar(raw, where, "embedding_multiplier"),
                residual_multiplier=_scalar(raw, where, "residual_multiplier"),
                attention_scale=_scalar(raw, where, "attention_multiplier"),
                logits_scaling=_scalar(raw, where, "logits_scaling"))


FAMILY = DecoderFamily("granite", ("granite",), arch_from_hf, standard_names)
