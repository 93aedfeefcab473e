"""Convert a Hugging Face decoder directory (config.json + safetensors) to our HDF5 checkpoint:
the machinery every family shares (the family gives its config translation and name map).

Everything that could make the numbers wrong is checked before a byte is written: the family
refuses config keys it does not compute (naming key and value), and every tensor must be
present, mapped, of a supported dtype and of the shape the config implies.
What we do not support is refused with a `CheckpointError` naming the file, the key and the
value found, rather than converted into a model that silently computes something else.

Note: the safetensors format (8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the raw bytes) is read here directly rather
than through the ``safetensors`` package: its numpy API cannot return bfloat16, the dtype
most Llama checkpoints ship in, and a thirty-line reader keeps the runtime dependencies at
numpy + h5py. Tensors are read one at a time in checkpoint order, so converting never holds
more than one tensor (plus its float32 copy) in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from ...model.checkpoint import write_checkpoint
from ...errors import CheckpointError, ConfigError
from ..decoder.arch import Arch, expected_shapes

__all__ = ["copy_tokenizer", "convert", "read_hf_config", "standard_names", "fused_expert_names", "text_tower",
           "TEXT_TOWERS", "Source", "TOKENIZER_FILES", "sizes", "rope_fields", "refuse_if", "sliding_windows",
           "mxfp4_decode", "fp8_block_decode"]

# safetensors dtype -> numpy dtype of the stored bytes (little-endian by the format's rule).
# BF16 is stored as uint16 and widened to float32 on read.
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header (100 MB)

# Tensors some exports carry that hold nothing we need: RoPE's inverse frequencies are
# recomputed from the config (older transformers saved them as buffers).
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq|long_inv_freq)$")


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


_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def _e4m3_table() -> np.ndarray:
    """float8 e4m3fn's 256 values: sign, 4 exponent bits (bias 7; 0: subnormal), 3 mantissa
    bits; exponent 15 with mantissa 7 is NaN (no infinities)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(b >> 7, -mag, mag).astype(np.float32)


_E4M3 = _e4m3_table()
FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size [128, 128]


def fp8_block_decode(weight: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """DeepSeek-V3's FP8 weights as float32: e4m3fn bytes (rows, cols) times their block's
    ``weight_scale_inv`` (ceil(rows / block), ceil(cols / block)), as transformers'
    ``finegrained_fp8`` dequantizes them."""
    rows, cols = weight.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block, axis=0), block, axis=1)[:rows, :cols]
    return _E4M3[weight] * scale


def mxfp4_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP microscaling) as float32: blocks uint8 (..., G, 16), scales uint8 (..., G) ->
    (..., G * 32). Each byte holds two e2m1 values, the low nibble first (sign bit, then the
    value table 0, .5, 1, 1.5, 2, 3, 4, 6); each block of 32 is scaled by 2^(scale - 127)
    (e8m0), as transformers' ``integrations/mxfp4.py`` decodes the Hub's GPT-OSS experts."""
    out = np.empty((*blocks.shape, 2), np.float32)
    out[..., 0], out[..., 1] = _FP4[blocks & 0x0F], _FP4[blocks >> 4]
    out = np.ldexp(out, (scales.astype(np.int32) - 127)[..., None, None]).astype(np.float32)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2)


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


# -- safetensors -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lives: its file, name, dtype, shape and absolute byte range."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


def _read_safetensors_header(path: Path) -> dict[str, _Entry]:
    """Parse and check a safetensors header; no tensor data is read."""
    where = str(path)
    fix = "the file is truncated or not safetensors; download it again"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(where, f"file is {size} bytes, too short for a safetensors header", fix)
            n = int.from_bytes(prefix, "little")
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(where, f"header length {n} exceeds the file ({size} bytes)", fix)
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(where, f"cannot read ({e.strerror or e})", "check the file's permissions") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(where, f"header is not valid JSON ({e})", fix) from None
    if not isinstance(header, dict):
        raise CheckpointError(where, "header is not a JSON object", fix)
    base = 8 + n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            a, b = int(a), int(b)
            if min(shape, default=0) < 0:
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{where}: {name}", f"malformed header entry {info!r}", fix) from None
        if dtype in _DTYPES and (b - a != math.prod(shape) * _DTYPES[dtype].itemsize or a < 0 or base + b > size):
            raise CheckpointError(f"{where}: {name}", f"byte range [{a}, {b}) does not hold a {dtype} "
                                  f"tensor of shape {shape} inside the file's {size - base} data bytes", fix)
        entries[name] = _Entry(path, name, dtype, shape, base + a, base + b)
    return entries


def _read_tensor(entry: _Entry, f: BinaryIO, index: int | None = None,
                 rows: tuple[int, int] | None = None) -> np.ndarray:
    """One tensor as float32 or float16 (bf16 widened to float32 exactly); with ``index`` only
    that entry of a stacked tensor (rows ``rows`` of it), read from its own bytes: converting
    a 128-expert layer reads each expert once, not the whole stack per expert."""
    stored = _DTYPES[entry.dtype]
    shape, skip = entry.shape, 0
    if index is not None:
        inner = shape[1:]
        a, b = rows if rows is not None else (0, inner[0])
        row = math.prod(inner[1:])
        skip, shape = (index * inner[0] + a) * row, (b - a, *inner[1:])
    f.seek(entry.start + skip * stored.itemsize)
    count = math.prod(shape)
    data = np.fromfile(f, dtype=stored, count=count)
    if data.size != count:
        raise CheckpointError(f"{entry.path}: {entry.name}", f"short read ({data.size} of {count} values)",
                              "the file is truncated; download it again")
    if entry.dtype == "BF16":
        # bfloat16 is the top half of a float32: put the 16 bits there, zero the rest.
        data = (data.astype(np.uint32) << 16).view(np.float32)
    return data.reshape(shape)


def _safetensors_files(hf_dir: Path) -> list[Path]:
    """The files transformers would load: the index's shards, else model.safetensors, else all."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(str(index), f"unreadable index ({type(e).__name__}: {e})",
                                  "download it again, or delete it to read every *.safetensors file") from None
        missing = [name for name in files if not (hf_dir / name).is_file()]
        if missing:
            raise CheckpointError(str(index), f"lists shards that do not exist: {missing}",
                                  "download the missing shards")
        return [hf_dir / name for name in files]
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(p for p in hf_dir.glob("*.safetensors") if p.is_file())
    if not files:
        bins = sorted(p.name for p in hf_dir.glob("*.bin"))
        found = f"found only {bins}" if bins else "found none"
        raise CheckpointError(str(hf_dir), f"no *.safetensors files ({found})",
                              "only the safetensors format is read, not pytorch_model.bin; download the "
                              "model's .safetensors files or re-save it with safe_serialization=True")
    return files


def _index_tensors(files: list[Path]) -> dict[str, _Entry]:
    """Every tensor name across ``files``; a name in two files is an error."""
    entries: dict[str, _Entry] = {}
    for path in files:
        for name, entry in _read_safetensors_header(path).items():
            if name in entries:
                raise CheckpointError(f"{path}: {name}", f"tensor also in {entries[name].path.name}",
                                      "the directory mixes two checkpoints; keep one set of files")
            entries[name] = entry
    return entries


# -- config ------------------------------------------------------------------------------------


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


# -- tensors -----------------------------------------------------------------------------------


def _check_tensors(cfg: Arch, names: dict[str, Source], entries: dict[str, _Entry], where_dir: Path,
                   family: str, tower: str | None = None, ignore=None) -> dict[str, tuple[_Entry, Source, _Entry | None]]:
    """Our name -> (entry, source, MXFP4 / FP8 scales entry or None), after checking names, dtypes
    and shapes against ``cfg``; with ``tower`` (`text_tower`) only the tensors under it must all be
    ours; ``ignore(name)``: a Hugging Face tensor the family leaves on purpose."""
    want = expected_shapes(cfg)
    names = {k: _mxfp4_instead(src, entries) for k, src in names.items()}
    used = {src.name for src in names.values()} | {src.scales for src in names.values() if src.scales}
    unmapped = sorted(n for n in entries if n not in used and not _HARMLESS.search(n)
                      and not (cfg.tie_word_embeddings and n.endswith("lm_head.weight"))
                      and (tower is None or n.startswith(tower)) and not (ignore and ignore(n)))
    biases = [n for n in unmapped if n.endswith(".bias")]
    if biases:
        more = f" and {len(biases) - 3} more" if len(biases) > 3 else ""
        raise CheckpointError(f"{entries[biases[0]].path}: {biases[0]}",
                              f"bias tensors {biases[:3]}{more} are not supported",
                              f"a {family} model has no such biases; is this another architecture?")
    if unmapped:
        more = f" and {len(unmapped) - 5} more" if len(unmapped) > 5 else ""
        raise CheckpointError(str(entries[unmapped[0]].path), f"unexpected tensors {unmapped[:5]}{more}",
                              f"they are not part of a {cfg.num_hidden_layers}-layer {family}; is "
                              "num_hidden_layers right, or is this another architecture?")
    missing = list(dict.fromkeys(names[n].name for n in want if names[n].name not in entries))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        fix = "download the missing shards"
        if missing == ["lm_head.weight"]:
            fix = "if the model ties lm_head to embed_tokens, its config should say tie_word_embeddings: true"
        raise CheckpointError(str(where_dir), f"missing tensors {missing[:5]}{more}", fix)
    fused: dict[str, tuple[int, int]] = {}  # a split or stacked tensor: (values our parts cover, its values)
    out = {}
    for name, shape in want.items():
        src = names[name]
        entry = entries[src.name]
        where = f"{entry.path}: {src.name}"
        scales = _check_mxfp4(src, entry, entries, where) if src.scales else None
        if entry.dtype not in _DTYPES and not scales:
            raise CheckpointError(where, f"dtype {entry.dtype} is not supported",
                                  f"only {sorted(_DTYPES)} are read; convert an unquantized model")
        matrix = _matrix_shape(src, entry)
        got = matrix if src.rows is None else (len(range(*src.rows, src.step)), *matrix[1:])
        if src.index is not None and not (len(entry.shape) >= 2 and 0 <= src.index < entry.shape[0]):
            raise CheckpointError(where, f"shape {entry.shape} has no expert {src.index}",
                                  "config.json and the tensors come from different models")
        if src.rows is not None or not src.plain:  # a part of a split or stacked tensor: all parts must cover it
            whole = math.prod(matrix) * (entry.shape[0] if src.index is not None else 1)
            covered, _ = fused.get(src.name, (0, whole))
            fused[src.name] = (covered + math.prod(got), whole)
        if got != tuple(shape) or (src.rows is not None and src.rows[1] > matrix[0]):
            implied = tuple(shape) if src.rows is None else f"{tuple(shape)} at rows {src.rows[0]}..{src.rows[1]}"
            raise CheckpointError(where, f"shape {entry.shape} disagrees with the config, which implies {implied}",
                                  "config.json and the tensors come from different models")
        out[name] = (entry, src, scales)
    for hf, (covered, whole) in fused.items():
        if covered != whole:
            raise CheckpointError(f"{entries[hf].path}: {hf}", f"has shape {entries[hf].shape}, the config's "
                                  f"parts cover {covered} of its {whole} values",
                                  "config.json and the tensors come from different models")
    return out


def _mxfp4_instead(src: Source, entries: dict) -> Source:
    """``src``, or where the checkpoint has no such tensor but MXFP4 ``<name>_blocks`` and
    ``<name>_scales`` (the Hub's GPT-OSS experts), those: stored (out, in), so a source read
    transposed from the dense (in, out) layout is read as it is from the blocks. An FP8 tensor
    with its ``<name>_scale_inv`` (DeepSeek-V3) gets that as its scales."""
    entry = entries.get(src.name)
    if entry is not None and entry.dtype == "F8_E4M3" and f"{src.name}_scale_inv" in entries and not src.scales:
        return dataclasses.replace(src, scales=f"{src.name}_scale_inv")
    if src.name in entries or src.scales or f"{src.name}_blocks" not in entries:
        return src
    return dataclasses.replace(src, name=f"{src.name}_blocks", scales=f"{src.name}_scales",
                               transposed=not src.transposed)


def _matrix_shape(src: Source, entry: _Entry) -> tuple[int, ...]:
    """The shape of the (out, in) matrix ``src`` reads from ``entry``, before its rows."""
    shape = entry.shape[1:] if src.index is not None else entry.shape
    if src.scales and entry.dtype == "U8":  # MXFP4 blocks (out, in/32, 16); FP8: as stored
        shape = (shape[0], shape[1] * shape[2] * 2) if len(shape) == 3 else (-1,)
    return tuple(reversed(shape)) if src.transposed else tuple(shape)


def _check_mxfp4(src: Source, entry: _Entry, entries: dict, where: str) -> _Entry:
    """The scales entry of MXFP4 blocks ``entry``, both checked (uint8, matching shapes, whole bytes);
    or of an FP8 weight (e4m3 bytes, float32 scales of its 128 x 128 blocks)."""
    scales = entries.get(src.scales)
    if scales is None:
        raise CheckpointError(where, f"MXFP4 blocks without their scales {src.scales!r}", "download the missing shards")
    if entry.dtype == "F8_E4M3":
        grid = tuple(-(-d // FP8_BLOCK) for d in entry.shape)
        if len(entry.shape) != 2 or entry.stop - entry.start != math.prod(entry.shape) or scales.dtype != "F32" \
                or scales.shape != grid:
            raise CheckpointError(where, f"FP8 weight {entry.shape} with scales {scales.dtype} {scales.shape}",
                                  f"expected float32 scales {grid}: one per {FP8_BLOCK} x {FP8_BLOCK} block")
        return scales
    for e in (entry, scales):
        if e.dtype != "U8" or e.stop - e.start != math.prod(e.shape):
            raise CheckpointError(f"{e.path}: {e.name}", f"dtype {e.dtype} shape {e.shape} is not MXFP4 "
                                  "(uint8 blocks [..., 16] and scales)", "download the model again")
    if entry.shape[:-1] != scales.shape or entry.shape[-1] != 16:
        raise CheckpointError(where, f"blocks {entry.shape} do not fit scales {scales.shape}",
                              "expected blocks [..., G, 16] with scales [..., G]")
    return scales


def _read_source(entry: _Entry, src: Source, scales: _Entry | None, handle) -> np.ndarray:
    """The (out, in) matrix of a per-expert source (its slab alone) or of an FP8 weight, before its rows."""
    def slab(e: _Entry, dtype) -> np.ndarray:  # the packed bytes (MXFP4 blocks / FP8) and their scales
        shape = e.shape[1:] if src.index is not None else e.shape
        count = math.prod(shape)
        handle(e.path).seek(e.start + (src.index or 0) * count * np.dtype(dtype).itemsize)
        data = np.fromfile(handle(e.path), dtype=dtype, count=count)
        if data.size != count:
            raise CheckpointError(f"{e.path}: {e.name}", f"short read ({data.size} of {count} values)",
                                  "the file is truncated; download it again")
        return data.reshape(shape)

    if scales is not None and entry.dtype == "F8_E4M3":
        m = fp8_block_decode(slab(entry, np.uint8), slab(scales, _DTYPES["F32"]))
    elif scales is not None:
        m = mxfp4_decode(slab(entry, np.uint8), slab(scales, np.uint8))
    else:
        m = _read_tensor(entry, handle(entry.path), src.index)
    return m.T if src.transposed else m


def _tensors(plan: dict, stack: contextlib.ExitStack) -> Iterator[tuple[str, np.ndarray]]:
    """(our name, array) in checkpoint order, one tensor (or one fused tensor) in memory at a time."""
    handles: dict[Path, BinaryIO] = {}

    def handle(path: Path) -> BinaryIO:
        if path not in handles:
            handles[path] = stack.enter_context(open(path, "rb"))
        return handles[path]

    last: tuple[tuple, np.ndarray] | None = None  # a fused tensor (or expert slab) is read once for its parts
    for name, (entry, src, scales) in plan.items():
        if src.index is not None and src.step == 1 and not src.transposed and scales is None:
            yield name, _read_tensor(entry, handle(entry.path), src.index, src.rows)  # one expert's rows: their bytes
            continue
        key = (entry.name, src.index, src.transposed)
        if last is None or last[0] != key:
            matrix = _read_tensor(entry, handle(entry.path)) if src.plain else _read_source(entry, src, scales, handle)
            last = (key, matrix)
        rows = src.rows
        yield name, (last[1] if rows is None and src.plain else
                     np.ascontiguousarray(last[1][slice(*(rows or (None, None)), src.step)]))


# -- entry point -------------------------------------------------------------------------------


def convert(family, hf_dir: str | os.PathLike, out_path: str | os.PathLike, *, dtype: str = "float32",
            hf_config: dict | None = None, config_name: str = "config.json", tokenizer: bool = True) -> Arch:
    """Convert the Hugging Face model in ``hf_dir`` to the checkpoint ``out_path`` (atomically),
    with ``family``'s config translation (``family.arch_from_hf``) and name map
    (``family.hf_names``).

    ``dtype`` ("float32", "float16" or "bfloat16") is the storage dtype of the output; a
    bfloat16 source written as bfloat16 is copied exactly. With ``tokenizer`` the directory's
    tokenizer files are copied beside the checkpoint (see `copy_tokenizer`). Everything that
    could make the numbers wrong is checked before a byte is written. Returns the `Arch`.
    """
    if dtype not in ("float32", "float16", "bfloat16", "q4"):
        raise ConfigError("dtype", f"{dtype!r} is not a checkpoint dtype", "use float32, float16, bfloat16 or q4")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if not hf_dir.is_dir():
        raise CheckpointError(str(hf_dir), "not a directory", "give the Hugging Face model directory")
    parent = out_path.parent
    if not parent.is_dir():
        raise CheckpointError(str(out_path), f"output directory {str(parent)!r} does not exist", "create it first")
    if out_path.is_dir():
        raise CheckpointError(str(out_path), "is a directory", "give a file name such as model.h5")

    config_path = hf_dir / config_name
    raw = hf_config if hf_config is not None else read_hf_config(config_path)
    cfg = family.arch_from_hf(raw, str(config_path)).validate(str(config_path))
    entries = _index_tensors(_safetensors_files(hf_dir))
    names, tower = text_tower(family.hf_names(cfg), entries)
    names = fused_expert_names(cfg, names, entries) if cfg.num_experts else names
    hf_ignore = getattr(family, "hf_ignore", None)
    plan = _check_tensors(cfg, names, entries, hf_dir, family.name, tower, hf_ignore(cfg) if hf_ignore else None)
    for kind, stored in (("MXFP4", "U8"), ("FP8", "F8_E4M3")):
        packed = sorted({s.name for e, s, _ in plan.values() if s.scales and e.dtype == stored})
        if packed:  # until such weights are resident, say what the checkpoint holds instead
            logging.getLogger(__name__).warning("%s: %d %s tensors (%s, ...) are dequantized to %s at convert",
                                                hf_dir, len(packed), kind, packed[0], dtype)
    from ..decoder.weights import q4_tensor

    with contextlib.ExitStack() as stack:
        write_checkpoint(out_path, family.name, cfg.to_json(), _tensors(plan, stack), dtype=dtype,
                         quantize=q4_tensor if dtype == "q4" else None)  # q4: linear weights as q4 groups
    if tokenizer:
        copy_tokenizer(hf_dir, out_path)
    return cfg


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what `tokenizer.load_tokenizer` reads
# chat_template.jinja: transformers 5 saves the chat template there (it wins over the config's);
# generation_config: the end-of-sequence ids, copied even without a tokenizer (ids-only prompts)
_COPIED = (*TOKENIZER_FILES, "chat_template.jinja", "generation_config.json")


def copy_tokenizer(hf_dir: str | os.PathLike, out_path: str | os.PathLike) -> list[Path]:
    """Copy ``hf_dir``'s tokenizer files to ``<stem>.<name>`` beside the checkpoint ``out_path``.

    The stem prefix lets several models share a folder; ``generate`` finds them there. Each
    file is written through a temporary name and renamed; a source is never a destination.
    Returns the files written (only ``generation_config.json`` when there is no ``tokenizer.json``).
    """
    import shutil

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    names = _COPIED if (hf_dir / "tokenizer.json").is_file() else ("generation_config.json",)
    written = []
    for name in names:
        src, dst = hf_dir / name, out_path.with_name(f"{out_path.stem}.{name}")
        if not src.is_file() or (dst.exists() and os.path.samefile(src, dst)):
            continue
        written.append(write_through(dst, lambda tmp, src=src: shutil.copyfile(src, tmp)))
    return written


def write_through(dst: Path, write) -> Path:
    """``write(tmp)`` to a temporary name beside ``dst``, then renamed to it (no torn file)."""
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst
