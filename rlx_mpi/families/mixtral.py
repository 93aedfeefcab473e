"""Mixtral: Hugging Face ``model_type = "mixtral"``: Mistral's attention with a mixture of
SwiGLU experts (router softmax -> top-k -> renormalised). Covers Mixtral-8x7B and 8x22B
(base and instruct). Under tensor parallelism each rank holds E/tp whole experts
(`decoder.moe`)."""

from __future__ import annotations

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import refuse_if, rope_fields, sizes, sliding_windows, standard_names
from .llama import no_biases, silu_only

__all__ = ["FAMILY", "arch_from_hf", "hf_names"]


def arch_from_hf(raw: dict, where: str) -> Arch:
    no_biases(raw, where)
    silu_only(raw, where)
    experts, top_k = raw.get("num_local_experts", 8), raw.get("num_experts_per_tok", 2)
    for key, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
        refuse_if(raw, where, key, isinstance(value, bool) or not isinstance(value, int) or value <= 0,
                  "expected a positive integer")
    refuse_if(raw, where, "num_experts_per_tok", top_k > experts, f"at most num_local_experts ({experts})")
    shape = sizes(raw, where, max_positions_default=32768)
    return Arch(**shape, **rope_fields(raw, where, ("default",)), num_experts=experts, experts_per_token=top_k,
                layer_windows=sliding_windows(raw, where, shape["num_hidden_layers"], all_layers=True))


def hf_names(cfg: Arch):
    return standard_names(cfg, {"router": "block_sparse_moe.gate.weight",
                                "experts/gate_proj": "block_sparse_moe.experts.{e}.w1.weight",
                                "experts/up_proj": "block_sparse_moe.experts.{e}.w3.weight",
                                "experts/down_proj": "block_sparse_moe.experts.{e}.w2.weight"})


FAMILY = DecoderFamily("mixtral", ("mixtral",), arch_from_hf, hf_names)
