"""Llama (1, 2, 3.x): Hugging Face ``model_type = "llama"``, RoPE default / linear / llama3.

Covers Llama-2-7B..70B, Llama-3.1-8B/70B/405B, Llama-3.2-1B/3B (tied head), Llama-3.3-70B.
Checkpoints written before families existed (``family = "llama"``, the old eleven-key
config) load as they are: `Arch`'s other fields default to Llama 2.
"""

from __future__ import annotations

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import refuse_if, rope_fields, sizes, standard_names

__all__ = ["FAMILY", "PRESETS", "arch_from_hf"]

# Random models for trying the pipeline without downloading anything. "tiny" is the default
# job and the test model; "medium" is big enough that a forward is compute-bound (bench/).
PRESETS: dict[str, Arch] = {
    "tiny": Arch(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256),
    "small": Arch(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024),
    "medium": Arch(vocab_size=16384, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048),
}


def silu_only(raw: dict, where: str, key: str = "hidden_act") -> None:
    act = raw.get(key, "silu")
    refuse_if(raw, where, key, act not in ("silu", "swish"),  # transformers maps both names to SiLU
              "only silu (SwiGLU) MLPs are supported for this family")


def no_biases(raw: dict, where: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        refuse_if(raw, where, key, bool(raw.get(key, False)), "linear layers with biases are not supported")


def arch_from_hf(raw: dict, where: str) -> Arch:
    """A Hugging Face Llama config as an `Arch`, refusing what we do not compute."""
    no_biases(raw, where)
    silu_only(raw, where)
    return Arch(**sizes(raw, where), **rope_fields(raw, where, ("default", "linear", "llama3")))


FAMILY = DecoderFamily("llama", ("llama",), arch_from_hf, standard_names, PRESETS)
