"""The config helpers every family's ``arch_from_hf`` is made of: `read_hf_config`, the shared
shape fields and refusals (`sizes`, `refuse_if`), RoPE (`rope_fields`, yarn too) and per-layer
sliding windows (`sliding_windows`); each refusal names the key and the value found."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ...errors import CheckpointError

__all__ = ["read_hf_config", "refuse_if", "sizes", "rope_fields", "sliding_windows"]


def read_hf_config(path: Path) -> dict:
    where = str(path)
    if not path.is_file():
        raise CheckpointError(where, "config file not found",
                              "give a Hugging Face model directory holding config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(where, f"unreadable config ({e})", "download config.json again") from None
    if not isinstance(raw, dict):
        raise CheckpointError(where, f"config is a JSON {type(raw).__name__}, not an object",
                              "download config.json again")
    return raw


def refuse_if(raw: dict, where: str, key: str, bad: bool, fix: str) -> None:
    """A `CheckpointError` naming ``key`` and its value when ``bad``."""
    if bad:
        raise CheckpointError(f"{where}: {key}", f"is {raw.get(key)!r}", fix)


def _positive_int(raw: dict, key: str, where: str) -> None:
    value = raw.get(key)  # None: the transformers default
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise CheckpointError(f"{where}: {key}", f"is {value!r}, expected a positive integer")


def _positive(value, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise CheckpointError(f"{where}: {key}", f"is {value!r}, expected a positive number")
    return float(value)


def sizes(raw: dict, where: str, *, tie_default: bool = False, max_positions_default: int = 2048) -> dict:
    """The shape fields every family shares, checked; refusals every family shares (quantized
    weights, pretraining_tp slices)."""
    if raw.get("quantization_config") is not None:  # null: transformers' own "not quantized"
        quant = raw["quantization_config"]
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise CheckpointError(f"{where}: quantization_config", f"quantized model (method {method!r})",
                              "convert the unquantized float16/bfloat16/float32 model")
    tp = raw.get("pretraining_tp", 1)
    refuse_if(raw, where, "pretraining_tp", tp is not None and tp != 1,
              "only pretraining_tp = 1 is supported; set it to 1 if the weights are not stored in slices")
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if raw.get(k) is None]
    if missing:
        raise CheckpointError(where, f"config lacks {missing}", "download config.json again")
    for key in (*need, "num_key_value_heads", "head_dim", "max_position_embeddings"):
        _positive_int(raw, key, where)
    tie = raw.get("tie_word_embeddings", tie_default)
    if not isinstance(tie, bool):
        raise CheckpointError(f"{where}: tie_word_embeddings", f"is {tie!r}, expected true or false")
    return dict(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim") or 0,  # 0: hidden_size // num_attention_heads
        max_position_embeddings=raw.get("max_position_embeddings") or max_positions_default,
        rms_norm_eps=_positive(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        tie_word_embeddings=tie,
    )


def rope_fields(raw: dict, where: str, allowed: tuple[str, ...] = ("default", "linear", "llama3", "longrope")) -> dict:
    """RoPE fields of `Arch` from a 4.x (top-level rope_theta + rope_scaling) or 5.x
    (rope_parameters) config; a kind not in ``allowed`` (yarn, dynamic, ...) is refused."""
    fix = f"supported RoPE types: {', '.join(allowed)}; another kind would give wrong logits here"
    params: dict = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: {key}", f"is {value!r}, expected an object or null", fix)
        kind = value.get("rope_type", value.get("type", "default"))
        if kind not in allowed:
            raise CheckpointError(f"{where}: {key}.rope_type", f"is {kind!r}, not supported", fix)
        partial = value.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise CheckpointError(f"{where}: {key}.partial_rotary_factor", f"is {partial!r}",
                                  "only full-width rotary embeddings (partial_rotary_factor = 1.0) are supported")
        params.update(value, rope_type=kind, _key=key)
    nested = params.get("rope_theta")
    found = {k: v for k, v in (("rope_theta", raw.get("rope_theta")), ("rope_parameters.rope_theta", nested))
             if v is not None}
    for key, value in found.items():
        _positive(value, key, where)
    if len(set(found.values())) > 1:
        raise CheckpointError(f"{where}: rope_theta", f"top-level {raw['rope_theta']!r} disagrees with "
                              f"rope_parameters.rope_theta {nested!r}", "keep one of them")
    out = {"rope_theta": float(next(iter(found.values()), 10000.0)),  # 10000: the transformers default
           "rope_type": params.get("rope_type", "default")}
    kind, key = out["rope_type"], params.get("_key")

    def get(name, default=None):
        value = params.get(name, default)
        if value is None:
            raise CheckpointError(f"{where}: {key}.{name}", "is missing", f"rope_type {kind!r} needs it")
        return value

    if kind in ("linear", "llama3"):
        out["rope_factor"] = _positive(get("factor"), f"{key}.factor", where)
    if kind == "llama3":
        out["rope_low_freq_factor"] = _positive(get("low_freq_factor"), f"{key}.low_freq_factor", where)
        out["rope_high_freq_factor"] = _positive(get("high_freq_factor"), f"{key}.high_freq_factor", where)
    if kind in ("llama3", "longrope", "yarn"):
        orig = get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise CheckpointError(f"{where}: original_max_position_embeddings", f"is {orig!r}",
                                  "expected a positive integer")
        out["rope_original_max_positions"] = orig
    if kind == "longrope":
        from ..decoder.rope import attention_factor

        out["rope_short_factor"] = tuple(float(f) for f in get("short_factor"))
        out["rope_long_factor"] = tuple(float(f) for f in get("long_factor"))
        given = params.get("attention_factor")
        out["rope_attention_factor"] = float(given) if given is not None else attention_factor(
            params.get("factor"), raw.get("max_position_embeddings") or 2048, out["rope_original_max_positions"])
    if kind == "yarn":
        out.update(_yarn_fields(params, raw, where, key, out["rope_original_max_positions"]))
    return out


def _yarn_fields(params: dict, raw: dict, where: str, key: str, original: int) -> dict:
    """yarn's `Arch` fields as transformers' ``_compute_yarn_parameters`` reads them (GPT-OSS,
    DeepSeek-V3): factor (else max_position_embeddings / original), the cos/sin attention factor
    (given, else from mscale / mscale_all_dim), beta_fast / beta_slow, truncate."""
    from ..decoder.rope import yarn_mscale

    factor = params.get("factor")
    factor = _positive(factor if factor is not None else (raw.get("max_position_embeddings") or 2048) / original,
                       f"{key}.factor", where)
    given, mscale, mscale_all = params.get("attention_factor"), params.get("mscale"), params.get("mscale_all_dim")
    if given is not None:
        attention = _positive(given, f"{key}.attention_factor", where)
    elif mscale and mscale_all:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    else:
        attention = yarn_mscale(factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointError(f"{where}: {key}.truncate", f"is {truncate!r}", "expected true or false")
    return {"rope_factor": factor, "rope_attention_factor": float(attention), "rope_truncate": truncate,
            "rope_beta_fast": _positive(params.get("beta_fast") or 32.0, f"{key}.beta_fast", where),
            "rope_beta_slow": _positive(params.get("beta_slow") or 1.0, f"{key}.beta_slow", where)}


def sliding_windows(raw: dict, where: str, layers: int, *, all_layers: bool = False) -> tuple:
    """Per-layer windows from ``layer_types`` ("sliding_attention" | "full_attention") and
    ``sliding_window``; with ``all_layers`` and no ``layer_types``, every layer slides (Mistral)."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if window is None:
        if types and "sliding_attention" in types:
            raise CheckpointError(f"{where}: sliding_window", "is null but layer_types has sliding layers",
                                  "set sliding_window")
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise CheckpointError(f"{where}: sliding_window", f"is {window!r}", "expected a positive integer or null")
    if types is None:
        return (window,) * layers if all_layers else ()
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(f"{where}: layer_types", f"is {types!r}", f"expected {layers} entries")
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if bad:
        raise CheckpointError(f"{where}: layer_types", f"has {bad[0]!r}",
                              "only sliding_attention and full_attention layers are supported")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()
