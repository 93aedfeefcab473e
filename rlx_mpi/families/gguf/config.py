"""GGUF metadata -> the Hugging Face config dict (config.json's keys) the family's
``arch_from_hf`` reads (`hf_config`), the file's tensors settling what the metadata leaves out;
the RoPE scaling a GGUF keeps as tensors read back into it (`_rope_tensors`)."""

from __future__ import annotations

import math
import re

import numpy as np

from ...errors import CheckpointError
from .reader import _FIX_FILE, _clip

__all__ = ["ARCHITECTURES", "hf_config"]

# general.architecture -> the Hugging Face model_type our families convert (llama.cpp writes
# Mistral-7B and Mistral-Nemo as "llama", with the q/k permutation: they convert as llama)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                 "gemma3": "gemma3_text", "phi3": "phi3"}
_PERMUTED = ("llama",)  # llama.cpp's LlamaModel.permute: q/k rows interleaved for its RoPE
_GEMMA = ("gemma2", "gemma3")  # norms stored as 1 + w


def hf_config(meta: dict, tensors: dict[str, tuple[int, ...]], where: str) -> dict:
    """The Hugging Face config dict (config.json's keys) that the GGUF metadata ``meta`` states,
    for the family converter; ``tensors`` (name -> shape) settles what the metadata leaves out
    (tied head, biases, vocabulary size). An architecture we do not map is a `CheckpointError`."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: general.architecture", f"unknown architecture {arch!r}",
                              f"supported GGUF architectures: {', '.join(sorted(ARCHITECTURES))}")

    def get(key, default=None, *, required=False):
        value = meta.get(f"{arch}.{key}", default)
        if required and value is None:
            raise CheckpointError(where, f"metadata lacks {arch}.{key}", _FIX_FILE)
        if isinstance(value, list):
            if len(set(value)) != 1:  # per-layer values (OpenELM, LFM2): not a shape our records hold
                raise CheckpointError(f"{where}: {arch}.{key}", f"differs per layer ({_clip(str(value), 60)})",
                                      "only models with the same shape in every layer are supported")
            value = value[0]
        return value

    heads = get("attention.head_count", required=True)
    hidden = get("embedding_length", required=True)
    # llama files may state the head size only as the rotary width (transformers reads it so)
    head_dim = get("attention.key_length") or (get("rope.dimension_count") if arch in _PERMUTED else None) \
        or hidden // heads
    value_dim = get("attention.value_length")
    if value_dim is not None and value_dim != head_dim:
        raise CheckpointError(f"{where}: {arch}.attention.value_length", f"is {value_dim}, key_length {head_dim}",
                              "only equal key and value head sizes are supported")
    rotary = get("rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        raise CheckpointError(f"{where}: {arch}.rope.dimension_count", f"is {rotary}, head size {head_dim}",
                              "only full-width rotary embeddings are supported")
    # the embedding's rows are the model's vocabulary (a token list may be shorter than a padded one)
    vocab = (tensors.get("token_embd.weight") or (0,))[0] or get("vocab_size") or \
        len(meta.get("tokenizer.ggml.tokens") or ())
    raw = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", required=True),
        "num_hidden_layers": get("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    biases = any(re.search(r"\.attn_(q|k|v|output|qkv)\.bias$", n) for n in tensors)
    if arch != "qwen2":
        raw["attention_bias"] = biases
    raw["mlp_bias"] = any(re.search(r"\.ffn_(gate|up|down)\.bias$", n) for n in tensors)
    scaling = _rope_scaling(get, arch, where, tensors)
    if scaling is not None:
        raw["rope_scaling"] = scaling
    window = get("attention.sliding_window")
    layers = raw["num_hidden_layers"]
    if arch == "phi3":
        raw["sliding_window"] = window
    elif arch in _GEMMA:
        raw["hidden_activation"] = "gelu_pytorch_tanh"
        # llama.cpp's scale: 1 / sqrt(hidden / heads) for the 27B models, else 1 / sqrt(head size)
        raw["query_pre_attn_scalar"] = hidden // heads if _is_27b(arch, layers, hidden) else head_dim
        raw["sliding_window"] = window
        raw["layer_types"] = _layer_types(meta, arch, layers, where) if window else None
        if arch == "gemma2":
            raw["attn_logit_softcapping"] = get("attn_logit_softcapping")
            raw["final_logit_softcapping"] = get("final_logit_softcapping")
        else:  # Gemma 3: the local layers' RoPE base is not in the file; llama.cpp fixes it at 10000
            raw["rope_local_base_freq"] = get("rope.freq_base_swa", 10000.0)
            raw["final_logit_softcapping"] = get("final_logit_softcapping")
    return {k: v for k, v in raw.items() if v is not None}  # absent: the family's default, as in config.json


def _layer_types(meta: dict, arch: str, layers: int, where: str) -> list[str]:
    """Which layers slide: ``attention.sliding_window_pattern`` when the file states it (one
    bool per layer, or n: every n-th layer is global), else llama.cpp's fixed pattern (Gemma 2:
    every 2nd layer global, Gemma 3: every 6th)."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointError(f"{where}: {arch}.attention.sliding_window_pattern",
                                  f"has {len(pattern)} entries for {layers} layers", _FIX_FILE)
        return ["sliding_attention" if slides else "full_attention" for slides in pattern]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise CheckpointError(f"{where}: {arch}.attention.sliding_window_pattern", f"is {pattern!r}",
                              "expected a positive integer or one bool per layer")
    return ["full_attention" if (n + 1) % pattern == 0 else "sliding_attention" for n in range(layers)]


def _is_27b(arch: str, layers: int, hidden: int) -> bool:
    return (arch, layers, hidden) in (("gemma2", 46, 4608), ("gemma3", 62, 5376))


def _rope_scaling(get, arch: str, where: str, tensors: dict) -> dict | None:
    kind = get("rope.scaling.type")
    if arch == "phi3" and "rope_factors_long.weight" in tensors:
        return {"rope_type": "longrope", "original_max_position_embeddings": get("rope.scaling.original_context_length"),
                "attention_factor": get("rope.scaling.attn_factor"), "_factors": True}
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: its llama3 scaling as per-frequency factors
        return {"rope_type": "llama3", "_freqs": True}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    raise CheckpointError(f"{where}: {arch}.rope.scaling.type", f"is {kind!r}",
                          "supported GGUF RoPE scaling: none, linear (and Phi-3's longrope factors)")


# tensors read into the config (`_rope_tensors`): Phi-3's longrope factors, Llama 3.1's llama3 ones
_IGNORED = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")


def _llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs`` for llama3 scaling
    (LlamaModel.generate_extra_tensors; transformers' _compute_llama3_parameters likewise)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _llama3_scaling(freqs: np.ndarray, theta: float, head_dim: int, where: str) -> dict:
    """llama3 RoPE parameters back from llama.cpp's ``rope_freqs`` tensor, which is all a GGUF keeps
    of them: Meta's values (low 1, high 4, an 8192-token original context; the factor is the
    largest divisor) are taken only if they reproduce every stored factor."""
    factor = float(np.max(freqs))
    if freqs.shape == (head_dim // 2,) and factor >= 1.0:
        want = _llama3_factors(theta, head_dim, factor, 1.0, 4.0, 8192)
        if np.allclose(want, freqs, rtol=1e-5, atol=0):
            return {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
    raise CheckpointError(where, f"per-frequency RoPE factors {_clip(str(freqs.tolist()), 80)} are not llama3 "
                          "scaling with Meta's parameters (low 1, high 4, original context 8192)",
                          "convert the model's Hugging Face safetensors instead")


def _rope_tensors(raw: dict, tensor, where: str) -> None:
    """Fill ``raw``'s rope_scaling from the tensors `_rope_scaling` marked (``_factors``, ``_freqs``);
    ``tensor(name)``: the GGUF tensor ``name`` as float32."""
    scaling = raw.get("rope_scaling") or {}
    if scaling.pop("_factors", None):  # Phi-3's per-frequency factors are tensors in a GGUF, config lists in HF's
        for key, name in (("long_factor", "rope_factors_long.weight"), ("short_factor", "rope_factors_short.weight")):
            scaling[key] = [float(v) for v in tensor(name)]
    if scaling.pop("_freqs", None):
        scaling.update(_llama3_scaling(tensor("rope_freqs.weight"), raw["rope_theta"],
                                       raw["head_dim"], f"{where}: rope_freqs.weight"))
