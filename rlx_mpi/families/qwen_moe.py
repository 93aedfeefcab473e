"""Qwen3-MoE: Hugging Face ``model_type = "qwen3_moe"``: Qwen3's attention (per-head q/k
RMSNorm) with a mixture of SwiGLU experts: router softmax over up to 128 experts -> top-k ->
renormalised only with ``norm_topk_prob``; the layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` have a dense MLP of ``intermediate_size`` (experts have
``moe_intermediate_size``). Covers Qwen3-30B-A3B, Qwen3-235B-A22B (and their -Instruct-2507 /
-Thinking-2507), Qwen3-Coder-30B-A3B and -480B-A35B. Checkpoints in the Hub's per-expert layout
(``mlp.experts.{e}.gate_proj``) and transformers 5's fused one (``mlp.experts.gate_up_proj``)
both convert (`hf.fused_expert_names`). Under tensor parallelism each rank holds E/tp whole
experts (`decoder.moe`).

The presets are the published shapes, for ``plan --preset`` (see docs/families.md).
"""

from __future__ import annotations

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import refuse_if, rope_fields, sizes, sliding_windows, standard_names
from .llama import silu_only

__all__ = ["FAMILY", "PRESETS", "arch_from_hf", "hf_names"]

_QWEN3_MOE = dict(vocab_size=151936, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True, num_experts=128, experts_per_token=8)
PRESETS: dict[str, Arch] = {  # config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B
    "qwen3-30b-a3b": Arch(hidden_size=2048, intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          dense_intermediate_size=6144, **_QWEN3_MOE),
    "qwen3-235b-a22b": Arch(hidden_size=4096, intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                            dense_intermediate_size=12288, **_QWEN3_MOE),
}


def _positive_int(raw: dict, where: str, key: str, default: int) -> int:
    value = raw.get(key, default)
    refuse_if(raw, where, key, isinstance(value, bool) or not isinstance(value, int) or value <= 0,
              "expected a positive integer")
    return value


def arch_from_hf(raw: dict, where: str) -> Arch:
    silu_only(raw, where)
    refuse_if(raw, where, "attention_bias", bool(raw.get("attention_bias", False)),
              "Qwen3-MoE with q/k/v/o biases is not supported (no released model has them)")
    shape = sizes(raw, where, max_positions_default=32768)
    layers = shape["num_hidden_layers"]
    key = "num_local_experts" if "num_local_experts" in raw else "num_experts"  # 5.x saves the former
    experts = raw.get(key, 128)  # Qwen3MoeConfig's defaults
    refuse_if(raw, where, key, isinstance(experts, bool) or not isinstance(experts, int) or experts < 0,
              "expected an integer >= 0")
    top_k = _positive_int(raw, where, "num_experts_per_tok", 8)
    refuse_if(raw, where, "num_experts_per_tok", bool(experts) and top_k > experts, f"at most {key} ({experts})")
    step = _positive_int(raw, where, "decoder_sparse_step", 1)
    only = raw.get("mlp_only_layers") or []
    refuse_if(raw, where, "mlp_only_layers", not isinstance(only, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n < layers for n in only),
        f"expected a list of layer numbers 0..{layers - 1}")
    norm = raw.get("norm_topk_prob", False)
    refuse_if(raw, where, "norm_topk_prob", not isinstance(norm, bool), "expected true or false")
    windows = sliding_windows(raw, where, layers, all_layers=True) if raw.get("use_sliding_window") else ()
    if not experts:  # every layer dense: a Qwen3 of intermediate_size
        return Arch(**shape, **rope_fields(raw, where, ("default", "linear", "llama3")), qk_norm=True,
                    layer_windows=windows)
    dense = tuple(n for n in range(layers) if n in only or (n + 1) % step)  # as Qwen3MoeDecoderLayer decides
    moe_width = _positive_int(raw, where, "moe_intermediate_size", 768)
    return Arch(**{**shape, "intermediate_size": moe_width}, **rope_fields(raw, where, ("default", "linear", "llama3")),
                qk_norm=True, layer_windows=windows, num_experts=experts, experts_per_token=top_k,
                norm_topk_prob=norm, dense_layers=dense,
                dense_intermediate_size=shape["intermediate_size"] if dense else 0)


def hf_names(cfg: Arch):
    return standard_names(cfg, {"router": "mlp.gate.weight",
                                "experts/gate_proj": "mlp.experts.{e}.gate_proj.weight",
                                "experts/up_proj": "mlp.experts.{e}.up_proj.weight",
                                "experts/down_proj": "mlp.experts.{e}.down_proj.weight"})


FAMILY = DecoderFamily("qwen3_moe", ("qwen3_moe",), arch_from_hf, hf_names, PRESETS)
