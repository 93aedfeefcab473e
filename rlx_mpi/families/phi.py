"""Phi-3: Hugging Face ``model_type = "phi3"``; fused ``qkv_proj`` and ``gate_up_proj``, split
here at convert time into q/k/v and gate/up (so a TP shard never straddles them); RoPE
default (4k models) or ``longrope`` (128k). Covers Phi-3-mini/small-free/medium 4k and 128k,
Phi-3.5-mini."""

from __future__ import annotations

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import Source, refuse_if, rope_fields, sizes, sliding_windows, standard_names
from .llama import silu_only

__all__ = ["FAMILY", "arch_from_hf", "hf_names"]


def arch_from_hf(raw: dict, where: str) -> Arch:
    silu_only(raw, where)
    refuse_if(raw, where, "partial_rotary_factor", raw.get("partial_rotary_factor", 1.0) != 1.0,
              "only full-width rotary embeddings are supported (Phi-4-mini's partial RoPE is not)")
    shape = sizes(raw, where, max_positions_default=4096)
    return Arch(**shape, **rope_fields(raw, where, ("default", "longrope")),
                layer_windows=sliding_windows(raw, where, shape["num_hidden_layers"], all_layers=True))


def hf_names(cfg: Arch) -> dict[str, Source]:
    names = standard_names(cfg)
    q, kv, i = cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    parts = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    for n in range(cfg.num_hidden_layers):
        qkv, gate_up = f"model.layers.{n}.self_attn.qkv_proj.weight", f"model.layers.{n}.mlp.gate_up_proj.weight"
        for k, rows in parts.items():
            names[f"layers/{n}/{k}"] = Source(qkv, rows)
        names[f"layers/{n}/gate_proj"] = Source(gate_up, (0, i))  # gate first: transformers' chunk(2)
        names[f"layers/{n}/up_proj"] = Source(gate_up, (i, 2 * i))
    return names


FAMILY = DecoderFamily("phi3", ("phi3",), arch_from_hf, hf_names)
