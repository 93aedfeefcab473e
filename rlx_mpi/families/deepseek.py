"""DeepSeek-V2 / V3: Hugging Face ``model_type = "deepseek_v2"`` / ``"deepseek_v3"``: multi-head
latent attention (`decoder.mla`: the cache holds the latent) and a mixture of experts with
always-on shared experts after ``first_k_dense_replace`` dense layers.

V3 (DeepSeek-V3, V3.1, R1, and their bf16 re-exports) routes with sigmoid scores, a choice-only
``e_score_correction_bias`` and grouped top-k (``n_group`` / ``topk_group``), yarn RoPE on
interleaved pairs; V2 (DeepSeek-V2, V2-Lite, V2.5; V2-Lite has ``q_lora_rank`` null: one
``q_proj``) routes with a softmax, greedy or ``group_limited_greedy``, never renormalised.
The Hub's V3/R1 weights are FP8 (e4m3 with a float32 ``weight_scale_inv`` per 128 x 128 block):
dequantized at convert to the checkpoint's dtype (logged; `hf.fp8_block_decode`); any other
``quantization_config`` is refused. The multi-token-prediction layer(s) past
``num_hidden_layers`` are not read.
"""

from __future__ import annotations

from ..errors import CheckpointError
from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .decoder.rope import yarn_mscale
from .hf import refuse_if, rope_fields, sizes, standard_names
from .llama import silu_only

__all__ = ["DEEPSEEK_V2", "DEEPSEEK_V3", "arch_from_hf", "hf_names"]


def _count(raw: dict, where: str, key: str, default, *, zero: bool = False) -> int:
    value = raw.get(key, default)
    value = default if value is None else value
    refuse_if(raw, where, key, isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1),
              f"expected an integer >= {0 if zero else 1}")
    return value


def arch_from_hf(raw: dict, where: str) -> Arch:
    """A DeepSeek-V2/V3 config as an `Arch`, refusing what we do not compute."""
    v3 = raw.get("model_type") == "deepseek_v3"
    quant = raw.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":  # `hf.convert` dequantizes the weights
        for key, want in (("fmt", "e4m3"), ("weight_block_size", [128, 128])):
            if quant.get(key, want) != want:
                raise CheckpointError(f"{where}: quantization_config.{key}", f"is {quant[key]!r}",
                                      f"only DeepSeek-V3's FP8 ({want!r}) is read; convert a bf16 export")
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    silu_only(raw, where)
    for key in ("attention_bias", "mlp_bias"):
        refuse_if(raw, where, key, bool(raw.get(key, False)), "DeepSeek with linear biases is not supported "
                  "(no released model has them)")
    shape = sizes({**raw, "head_dim": None}, where, max_positions_default=4096 if v3 else 2048)
    nh = shape["num_attention_heads"]
    refuse_if(raw, where, "num_key_value_heads", raw.get("num_key_value_heads") not in (None, nh),
              f"latent attention has one latent for all heads: expected num_attention_heads ({nh})")
    rope = rope_fields({**raw, "head_dim": None}, where, ("default", "linear", "yarn"))
    dr, dn, dv = (_count(raw, where, k, d) for k, d in (("qk_rope_head_dim", 64), ("qk_nope_head_dim", 128),
                                                        ("v_head_dim", 128)))
    experts = _count(raw, where, "n_routed_experts", 256 if v3 else 64)
    top_k = _count(raw, where, "num_experts_per_tok", 8 if v3 else 6)
    method = raw.get("topk_method", "noaux_tc" if v3 else "greedy")
    if v3:
        refuse_if(raw, where, "topk_method", method not in ("noaux_tc", None), "DeepSeek-V3 routes by noaux_tc")
        refuse_if(raw, where, "scoring_func", raw.get("scoring_func", "sigmoid") != "sigmoid",
                  "DeepSeek-V3 scores experts with a sigmoid")
    else:
        refuse_if(raw, where, "topk_method", method not in ("greedy", "group_limited_greedy"),
                  "DeepSeek-V2 routes by greedy or group_limited_greedy")
    grouped = v3 or method == "group_limited_greedy"
    n_group = _count(raw, where, "n_group", 1) if grouped else 1
    topk_group = _count(raw, where, "topk_group", 1) if grouped else 1
    qk_head = dn + dr
    scale = qk_head ** -0.5
    if rope["rope_type"] != "default":  # transformers' yarn_apply_mscale: the softmax temperature too
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if params.get("mscale_all_dim"):
            scale *= yarn_mscale(rope["rope_factor"], params["mscale_all_dim"]) ** 2
    width = _count(raw, where, "moe_intermediate_size", 2048 if v3 else 1407)  # each routed expert's
    return Arch(**{**shape, "head_dim": dr, "num_key_value_heads": nh, "intermediate_size": width}, **rope,
                attention_scale=scale, kv_lora_rank=_count(raw, where, "kv_lora_rank", 512),
                q_lora_rank=0 if "q_lora_rank" in raw and raw["q_lora_rank"] is None else  # V2-Lite: q_proj
                _count(raw, where, "q_lora_rank", 1536),
                qk_nope_head_dim=dn, v_head_dim=dv, rope_interleave=True,
                num_experts=experts, experts_per_token=top_k, routing="sigmoid" if v3 else "softmax",
                router_bias=v3, n_group=n_group, topk_group=topk_group,
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if v3 else False,  # V2's router never renormalises
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
                shared_intermediate_size=_count(raw, where, "n_shared_experts", 1, zero=True) * width,
                dense_layers=tuple(range(min(_count(raw, where, "first_k_dense_replace", 0, zero=True),
                                             shape["num_hidden_layers"]))),
                dense_intermediate_size=shape["intermediate_size"])


def hf_names(cfg: Arch):
    layer = {"q_a_proj": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
             "q_b_proj": "self_attn.q_b_proj.weight", "kv_a_proj": "self_attn.kv_a_proj_with_mqa.weight",
             "kv_a_norm": "self_attn.kv_a_layernorm.weight", "kv_b_proj": "self_attn.kv_b_proj.weight",
             "router": "mlp.gate.weight", "router_bias": "mlp.gate.e_score_correction_bias",
             "experts/gate_proj": "mlp.experts.{e}.gate_proj.weight",
             "experts/up_proj": "mlp.experts.{e}.up_proj.weight",
             "experts/down_proj": "mlp.experts.{e}.down_proj.weight",
             "shared_gate_proj": "mlp.shared_experts.gate_proj.weight",
             "shared_up_proj": "mlp.shared_experts.up_proj.weight",
             "shared_down_proj": "mlp.shared_experts.down_proj.weight"}
    return standard_names(cfg, layer)


def mtp_layers(cfg: Arch):
    """The multi-token-prediction layers' tensors (``model.layers.{n}.*`` past num_hidden_layers,
    V3's ``num_nextn_predict_layers``): speculative decoding only, not read."""
    def skip(name: str) -> bool:
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and \
            int(parts[2]) >= cfg.num_hidden_layers
    return skip


DEEPSEEK_V3 = DecoderFamily("deepseek_v3", ("deepseek_v3",), arch_from_hf, hf_names, hf_ignore=mtp_layers)
DEEPSEEK_V2 = DecoderFamily("deepseek_v2", ("deepseek_v2",), arch_from_hf, hf_names)
FAMILY = DEEPSEEK_V3
