"""Where our tensors come from in a Hugging Face checkpoint: `Source` (a tensor, rows of a fused
one, one expert's slab, packed MXFP4 / FP8 bytes) and the name maps families build from
(`standard_names`: the Llama-style export; `fused_expert_names`: transformers 5's stacked
experts; `text_tower`: a multimodal checkpoint's language model)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..decoder.arch import Arch, expected_shapes

__all__ = ["Source", "standard_names", "fused_expert_names", "text_tower", "TEXT_TOWERS"]


@dataclass(frozen=True)
class Source:
    """Where one of our tensors comes from: a Hugging Face tensor, or rows [start, stop) of
    one (a fused tensor split at convert time: Phi-3's qkv_proj and gate_up_proj).

    Per-expert 3-D tensors take ``index`` (the slab [index] of [E, ...]: transformers 5's fused
    experts, `fused_expert_names`; GPT-OSS's), ``transposed`` (the slab is stored (in, out)),
    ``step`` (every step-th row of ``rows``: gate and up interleaved) and, for MXFP4 weights,
    ``scales``: ``name`` is then the packed blocks (uint8 [E, out, in/32, 16]) and ``scales``
    their e8m0 exponents (uint8 [E, out, in/32]), dequantized at convert (`mxfp4_decode`). An
    FP8 weight (DeepSeek-V3's e4m3 [out, in]) names its float32 ``weight_scale_inv`` (one per
    128 x 128 block) as ``scales`` (`fp8_block_decode`)."""

    name: str
    rows: tuple[int, int] | None = None
    index: int | None = None
    step: int = 1
    transposed: bool = False
    scales: str | None = None

    @property
    def plain(self) -> bool:
        """Rows of a whole 2-D tensor at most (the parts of it must cover it)."""
        return self.index is None and self.step == 1 and not self.transposed and self.scales is None

_LAYER = {  # our per-layer name -> the Llama-style Hugging Face name under model.layers.{n}.
    "input_layernorm": "input_layernorm.weight", "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight", "post_attention_layernorm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}


def fused_expert_names(cfg: Arch, names: dict[str, Source], entries) -> dict[str, Source]:
    """``names`` with every MoE layer's router and experts read from transformers 5's fused
    layout when the checkpoint has it (``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` [E, 2I, C]
    with gate rows first, ``mlp.experts.down_proj`` [E, C, I]: what ``save_pretrained(...,
    save_original_format=False)`` writes for Mixtral, Qwen MoE and DeepSeek); else ``names``
    unchanged. A family whose names already read that tensor (GPT-OSS: [E, C, 2I], gate and up
    interleaved) knows its own layout and is left alone."""
    i, out = cfg.intermediate_size, dict(names)
    read = {src.name for src in names.values()}
    for n in range(cfg.num_hidden_layers):
        fused = f"model.layers.{n}.mlp.experts."
        if not cfg.moe(n) or fused + "gate_up_proj" not in entries or fused + "gate_up_proj" in read:
            continue
        out[f"layers/{n}/router"] = Source(f"model.layers.{n}.mlp.gate.weight")
        for e in range(cfg.num_experts):
            out[f"layers/{n}/experts/{e}/gate_proj"] = Source(fused + "gate_up_proj", (0, i), e)
            out[f"layers/{n}/experts/{e}/up_proj"] = Source(fused + "gate_up_proj", (i, 2 * i), e)
            out[f"layers/{n}/experts/{e}/down_proj"] = Source(fused + "down_proj", None, e)
    return out


# Where a multimodal checkpoint keeps its language model's "model." tensors (Gemma 3, and the
# Llava-style models): the Hub's layout, then transformers 5's own (save_original_format=False).
TEXT_TOWERS = ("language_model.model.", "model.language_model.")


def text_tower(names: dict[str, Source], entries) -> tuple[dict[str, Source], str | None]:
    """``names`` moved under the text tower of a multimodal checkpoint when the checkpoint has
    no ``model.embed_tokens.weight`` but one of `TEXT_TOWERS` holds it (``lm_head.weight``
    becomes ``language_model.lm_head.weight`` in the Hub's layout); else ``names`` unchanged.
    Returns (names, the tower's prefix or None): tensors outside the tower (vision encoder,
    projector) are then not ours to convert."""
    if "model.embed_tokens.weight" in entries:
        return names, None
    prefix = next((p for p in TEXT_TOWERS if p + "embed_tokens.weight" in entries), None)
    if prefix is None:
        return names, None
    head = "language_model.lm_head.weight" if prefix == TEXT_TOWERS[0] else "lm_head.weight"

    def moved(src: Source) -> Source:
        name = head if src.name == "lm_head.weight" else prefix + src.name[len("model."):]
        return dataclasses.replace(src, name=name)
    return {ours: moved(src) for ours, src in names.items()}, prefix


def standard_names(cfg: Arch, layer: dict[str, str] | None = None) -> dict[str, Source]:
    """Our name -> its `Source` in a Llama-style export; ``layer`` overrides per-layer names
    (a value with ``{e}`` is formatted per expert: ``experts/{e}/gate_proj``)."""
    names = {**_LAYER, **(layer or {})}
    out = {}
    for ours in expected_shapes(cfg):
        if ours == "embed_tokens":
            out[ours] = Source("model.embed_tokens.weight")
        elif ours == "norm":
            out[ours] = Source("model.norm.weight")
        elif ours == "lm_head":
            out[ours] = Source("lm_head.weight")
        else:
            _, n, short = ours.split("/", 2)
            if short.startswith("experts/"):
                _, e, proj = short.split("/")
                out[ours] = Source(f"model.layers.{n}." + names[f"experts/{proj}"].format(e=e))
            else:
                out[ours] = Source(f"model.layers.{n}.{names[short]}")
    return out
