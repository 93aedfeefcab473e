"""OLMo 2: Hugging Face ``model_type = "olmo2"``: Llama's SwiGLU and RoPE, but norms only on
the attention and MLP *outputs* (no pre-norms) and RMSNorm over the whole q and k projections
(nh*hs and nkv*hs values, not per head). Covers OLMo-2-1B/7B/13B/32B (base, -SFT, -DPO,
-Instruct). Under tensor parallelism the q/k norm needs the whole projection's sum of squares:
one small all-reduce per layer (`decoder.model.projection_norm_`).
"""

from __future__ import annotations

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import refuse_if, rope_fields, sizes, standard_names
from .llama import no_biases, silu_only

__all__ = ["FAMILY", "arch_from_hf", "hf_names"]


def arch_from_hf(raw: dict, where: str) -> Arch:
    no_biases(raw, where)
    silu_only(raw, where)
    refuse_if(raw, where, "clip_qkv", raw.get("clip_qkv") is not None,
              "clipping q/k/v (OLMo 1) is not supported; OLMo 2 has none")
    shape = sizes(raw, where, max_positions_default=4096)
    return Arch(**shape, **rope_fields(raw, where, ("default", "linear", "llama3")), qk_norm=True,
                qk_norm_scope="projection", sandwich_norms=True, pre_norms=False)


def hf_names(cfg: Arch):
    # OLMo 2's post_attention_layernorm is applied to the attention output (our attn_out_norm)
    return standard_names(cfg, {"attn_out_norm": "post_attention_layernorm.weight",
                                "mlp_out_norm": "post_feedforward_layernorm.weight"})


FAMILY = DecoderFamily("olmo2", ("olmo2",), arch_from_hf, hf_names)
