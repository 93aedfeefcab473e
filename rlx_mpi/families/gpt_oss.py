"""GPT-OSS: Hugging Face ``model_type = "gpt_oss"`` (gpt-oss-20b, gpt-oss-120b).

Attention with biased q/k/v/o and a learned sink logit per head in every softmax denominator,
alternating sliding-window (128) and full layers (``layer_types``), yarn RoPE; every layer a
mixture of experts: router logits (+ bias), top-k, softmax over the k; experts with biases and
the clamped SwiGLU ``(clip(up, ±limit) + 1) * g * sigmoid(1.702 g)``, g = min(gate, limit).

Experts are read in either layout: transformers' dense ``mlp.experts.gate_up_proj`` [E, C, 2I]
(gate and up interleaved along 2I) and ``down_proj`` [E, I, C] with their ``_bias``, or the Hub's
MXFP4 ``*_blocks`` + ``*_scales``, dequantized at convert to the checkpoint's dtype (logged;
`hf.mxfp4_decode`). A resident 4-bit path would keep them packed instead (see docs/families-moe.md).
"""

from __future__ import annotations

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import Source, refuse_if, rope_fields, sizes, sliding_windows, standard_names

__all__ = ["FAMILY", "arch_from_hf", "hf_names"]


def arch_from_hf(raw: dict, where: str) -> Arch:
    """A GPT-OSS config as an `Arch`; MXFP4 quantization is accepted (dequantized at convert)."""
    quant = raw.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":  # the experts: `hf.convert` dequantizes
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}  # them (and logs it)
    refuse_if(raw, where, "attention_bias", raw.get("attention_bias", True) is not True,
              "GPT-OSS without attention biases is not supported (no released model lacks them)")
    limit, alpha = raw.get("swiglu_limit", 7.0), raw.get("swiglu_alpha", 1.702)
    for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        refuse_if(raw, where, key, isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0,
                  "expected a positive number")
    experts, top_k = raw.get("num_local_experts", 128), raw.get("num_experts_per_tok", 4)
    for key, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k)):
        refuse_if(raw, where, key, isinstance(value, bool) or not isinstance(value, int) or value <= 0,
                  "expected a positive integer")
    refuse_if(raw, where, "num_experts_per_tok", top_k > experts, f"at most num_local_experts ({experts})")
    shape = sizes(raw, where, max_positions_default=131072)
    return Arch(**shape, **rope_fields(raw, where, ("default", "yarn")), qkv_bias=True, o_bias=True,
                attention_sinks=True, activation="silu_clamped", swiglu_limit=float(limit), swiglu_alpha=float(alpha),
                num_experts=experts, experts_per_token=top_k, routing="topk_softmax", router_bias=True,
                expert_bias=True, layer_windows=sliding_windows(raw, where, shape["num_hidden_layers"]))


def hf_names(cfg: Arch) -> dict[str, Source]:
    fused = {f"experts/{k}": "mlp.experts.{e}" for k in ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias",
                                                          "down_bias")}  # placeholders, replaced below
    names = standard_names(cfg, {"router": "mlp.router.weight", "router_bias": "mlp.router.bias",
                                 "o_bias": "self_attn.o_proj.bias", "sinks": "self_attn.sinks", **fused})
    i = cfg.intermediate_size
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}.mlp.experts."
        for e in range(cfg.num_experts):
            ours = f"layers/{n}/experts/{e}/"
            # [E, C, 2I] read (2I, C): rows 0, 2, 4... are gate, 1, 3, 5... up (transformers' [..., ::2])
            names[ours + "gate_proj"] = Source(p + "gate_up_proj", (0, 2 * i), e, 2, True)
            names[ours + "up_proj"] = Source(p + "gate_up_proj", (1, 2 * i), e, 2, True)
            names[ours + "down_proj"] = Source(p + "down_proj", None, e, 1, True)  # [E, I, C] -> (C, I)
            names[ours + "gate_bias"] = Source(p + "gate_up_proj_bias", (0, 2 * i), e, 2)
            names[ours + "up_bias"] = Source(p + "gate_up_proj_bias", (1, 2 * i), e, 2)
            names[ours + "down_bias"] = Source(p + "down_proj_bias", None, e)
    return names


FAMILY = DecoderFamily("gpt_oss", ("gpt_oss",), arch_from_hf, hf_names)
