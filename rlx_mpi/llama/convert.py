"""Convert a Hugging Face Llama directory (config.json + safetensors) to our HDF5 checkpoint.

Everything that could make the numbers wrong is checked before a byte is written: the config
must describe a plain Llama (model_type "llama", default RoPE, SiLU, no biases), and every
tensor must be present, mapped, of a supported dtype and of the shape the config implies.
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
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from ..checkpoint import write_checkpoint
from ..errors import CheckpointError, ConfigError
from .config import LlamaConfig
from .config import expected_shapes

__all__ = ["copy_tokenizer", "convert_hf", "hf_name"]

# safetensors dtype -> numpy dtype of the stored bytes (little-endian by the format's rule).
# BF16 is stored as uint16 and widened to float32 on read.
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header (100 MB)

# Tensors some exports carry that hold nothing we need: RoPE's inverse frequencies are
# recomputed from rope_theta (older transformers saved them as buffers).
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

_LAYER_NAMES = {
    "input_layernorm": "input_layernorm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "post_attention_layernorm": "post_attention_layernorm",
    "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
}
_OURS_TO_HF = {ours: hf for hf, ours in _LAYER_NAMES.items()}


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of our checkpoint name (``layers/3/q_proj`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if name == "embed_tokens":
        return "model.embed_tokens.weight"
    if name == "norm":
        return "model.norm.weight"
    if name == "lm_head":
        return "lm_head.weight"
    _, n, short = name.split("/")
    return f"model.layers.{n}.{_OURS_TO_HF[short]}.weight"


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


def _read_tensor(entry: _Entry, f: BinaryIO) -> np.ndarray:
    """One tensor as float32 or float16 (bf16 widened to float32 exactly)."""
    stored = _DTYPES[entry.dtype]
    f.seek(entry.start)
    count = math.prod(entry.shape)
    data = np.fromfile(f, dtype=stored, count=count)
    if data.size != count:
        raise CheckpointError(f"{entry.path}: {entry.name}", f"short read ({data.size} of {count} values)",
                              "the file is truncated; download it again")
    if entry.dtype == "BF16":
        # bfloat16 is the top half of a float32: put the 16 bits there, zero the rest.
        data = (data.astype(np.uint32) << 16).view(np.float32)
    return data.reshape(entry.shape)


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


def _read_hf_config(path: Path) -> dict:
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


def _rope_theta(raw: dict, where: str) -> float:
    """rope_theta from a 4.x (top level + rope_scaling) or 5.x (rope_parameters) config;
    refuses every RoPE variant other than the plain one."""
    fix = "only default RoPE is supported; a scaled-RoPE model would give wrong logits here"
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: {key}", f"is {value!r}, expected an object or null", fix)
        kind = value.get("rope_type", value.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"{where}: {key}.rope_type", f"RoPE type {kind!r} is not supported", fix)
        partial = value.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise CheckpointError(f"{where}: {key}.partial_rotary_factor", f"is {partial!r}", fix)
    nested = (raw.get("rope_parameters") or {}).get("rope_theta")  # 5.x
    found = {k: v for k, v in (("rope_theta", raw.get("rope_theta")), ("rope_parameters.rope_theta", nested))
             if v is not None}
    for key, value in found.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise CheckpointError(f"{where}: {key}", f"is {value!r}, expected a positive number")
    if len(set(found.values())) > 1:
        raise CheckpointError(f"{where}: rope_theta", f"top-level {raw['rope_theta']!r} disagrees with "
                              f"rope_parameters.rope_theta {nested!r}", "keep one of them")
    return float(next(iter(found.values()), 10000.0))  # 10000: the transformers default


def _llama_config(raw: dict, where: str) -> LlamaConfig:
    """Map a Hugging Face config dict to `LlamaConfig`, refusing what we do not compute."""
    model_type = raw.get("model_type")
    if model_type != "llama":
        raise CheckpointError(f"{where}: model_type", f"is {model_type!r}, not \"llama\"",
                              "only Llama models are converted; a Llama-compatible model of another type "
                              "(some Mistral-like ones are) must be checked and relabelled by hand, since "
                              "an unknown type may differ in ways the tensors do not show")
    if "quantization_config" in raw:
        quant = raw["quantization_config"]
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise CheckpointError(f"{where}: quantization_config", f"quantized model (method {method!r})",
                              "convert the unquantized float16/bfloat16/float32 model")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key, False):
            raise CheckpointError(f"{where}: {key}", f"is {raw[key]!r}",
                                  "linear layers with biases are not supported")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers maps both names to SiLU
        raise CheckpointError(f"{where}: hidden_act", f"is {act!r}", "only silu (SwiGLU) MLPs are supported")
    tp = raw.get("pretraining_tp", 1)
    if tp is not None and tp != 1:
        raise CheckpointError(f"{where}: pretraining_tp", f"is {tp!r}",
                              "only pretraining_tp = 1 is supported; set it to 1 if the weights are not "
                              "stored in slices")

    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in sizes if raw.get(k) is None]
    if missing:
        raise CheckpointError(where, f"config lacks {missing}", "download config.json again")
    for key in (*sizes, "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = raw.get(key)  # None: the transformers default below
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise CheckpointError(f"{where}: {key}", f"is {value!r}, expected a positive integer")
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise CheckpointError(f"{where}: rms_norm_eps", f"is {eps!r}, expected a positive number")
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise CheckpointError(f"{where}: tie_word_embeddings", f"is {tie!r}, expected true or false")
    cfg = LlamaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim") or 0,  # 0: hidden_size // num_attention_heads
        max_position_embeddings=raw.get("max_position_embeddings") or 2048,
        rms_norm_eps=float(eps),
        rope_theta=_rope_theta(raw, where),
        tie_word_embeddings=tie,
    )
    return cfg.validate(where)


# -- tensors -----------------------------------------------------------------------------------


def _check_tensors(cfg: LlamaConfig, entries: dict[str, _Entry], where_dir: Path) -> dict[str, _Entry]:
    """Our name -> its entry, after checking names, dtypes and shapes against ``cfg``."""
    want = expected_shapes(cfg)
    wanted_hf = {hf_name(n) for n in want}
    unmapped = sorted(n for n in entries if n not in wanted_hf and not _HARMLESS.search(n)
                      and not (cfg.tie_word_embeddings and n == "lm_head.weight"))
    biases = [n for n in unmapped if n.endswith(".bias")]
    if biases:
        more = f" and {len(biases) - 3} more" if len(biases) > 3 else ""
        raise CheckpointError(f"{entries[biases[0]].path}: {biases[0]}",
                              f"bias tensors {biases[:3]}{more} are not supported",
                              "only Llama models without attention/MLP biases convert")
    if unmapped:
        more = f" and {len(unmapped) - 5} more" if len(unmapped) > 5 else ""
        raise CheckpointError(str(entries[unmapped[0]].path), f"unexpected tensors {unmapped[:5]}{more}",
                              f"they are not part of a {cfg.num_hidden_layers}-layer Llama; is "
                              "num_hidden_layers right, or is this another architecture?")
    missing = [hf_name(n) for n in want if hf_name(n) not in entries]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        fix = "download the missing shards"
        if missing == ["lm_head.weight"]:
            fix = "if the model ties lm_head to embed_tokens, its config should say tie_word_embeddings: true"
        raise CheckpointError(str(where_dir), f"missing tensors {missing[:5]}{more}", fix)
    out = {}
    for name, shape in want.items():
        entry = entries[hf_name(name)]
        where = f"{entry.path}: {hf_name(name)}"
        if entry.dtype not in _DTYPES:
            raise CheckpointError(where, f"dtype {entry.dtype} is not supported",
                                  f"only {sorted(_DTYPES)} are read; convert an unquantized model")
        if entry.shape != tuple(shape):
            raise CheckpointError(where, f"shape {entry.shape} disagrees with the config, which implies {tuple(shape)}",
                                  "config.json and the tensors come from different models")
        out[name] = entry
    return out


def _tensors(plan: dict[str, _Entry], stack: contextlib.ExitStack) -> Iterator[tuple[str, np.ndarray]]:
    """(our name, array) in checkpoint order, one tensor in memory at a time."""
    handles: dict[Path, BinaryIO] = {}
    for name, entry in plan.items():
        if entry.path not in handles:
            handles[entry.path] = stack.enter_context(open(entry.path, "rb"))
        yield name, _read_tensor(entry, handles[entry.path])


# -- entry point -------------------------------------------------------------------------------


def convert_hf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, *, dtype: str = "float32",
               config_name: str = "config.json", tokenizer: bool = True) -> LlamaConfig:
    """Convert the Hugging Face Llama in ``hf_dir`` to the checkpoint ``out_path`` (atomically).

    ``dtype`` ("float32", "float16" or "bfloat16") is the storage dtype of the output; a
    bfloat16 source written as bfloat16 is copied exactly. With ``tokenizer`` the directory's
    tokenizer files are copied beside the checkpoint (see `copy_tokenizer`). Returns the
    model's `LlamaConfig`.
    """
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ConfigError("dtype", f"{dtype!r} is not a checkpoint dtype", "use float32, float16 or bfloat16")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if not hf_dir.is_dir():
        raise CheckpointError(str(hf_dir), "not a directory", "give the Hugging Face model directory")
    parent = out_path.parent
    if not parent.is_dir():
        raise CheckpointError(str(out_path), f"output directory {str(parent)!r} does not exist", "create it first")
    if out_path.is_dir():
        raise CheckpointError(str(out_path), "is a directory", "give a file name such as model.h5")

    config_path = hf_dir / config_name
    cfg = _llama_config(_read_hf_config(config_path), str(config_path))
    plan = _check_tensors(cfg, _index_tensors(_safetensors_files(hf_dir)), hf_dir)
    with contextlib.ExitStack() as stack:
        write_checkpoint(out_path, "llama", cfg.to_json(), _tensors(plan, stack), dtype=dtype)
    if tokenizer:
        copy_tokenizer(hf_dir, out_path)
    return cfg


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what `prompts.load_tokenizer` reads


def copy_tokenizer(hf_dir: str | os.PathLike, out_path: str | os.PathLike) -> list[Path]:
    """Copy ``hf_dir``'s tokenizer files to ``<stem>.<name>`` beside the checkpoint ``out_path``.

    The stem prefix lets several models share a folder; ``generate`` finds them there. Each
    file is written through a temporary name and renamed; a source is never a destination.
    Returns the files written (none when the directory has no ``tokenizer.json``).
    """
    import shutil

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if not (hf_dir / "tokenizer.json").is_file():
        return []
    written = []
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        src, dst = hf_dir / name, out_path.with_name(f"{out_path.stem}.{name}")
        if not src.is_file() or (dst.exists() and os.path.samefile(src, dst)):
            continue
        tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        finally:
            if tmp.exists():
                tmp.unlink()
        written.append(dst)
    return written
