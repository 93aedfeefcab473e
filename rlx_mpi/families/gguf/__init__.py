"""Convert a GGUF file (llama.cpp's format) to our HDF5 checkpoint: the second reader beside
`families.hf` (safetensors directories); both go through the family's config translation and
name map and end in `checkpoint.write_checkpoint`.

A GGUF holds the model's config as metadata (``general.architecture``, ``<arch>.block_count``,
...), its tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q``, ..., ``output``),
often quantized in blocks, and its tokenizer and chat template (``tokenizer.ggml.*``,
``tokenizer.chat_template``). Here the metadata becomes the Hugging Face config dict the family's
``arch_from_hf`` already reads and the family's name map (``hf_names``) gives each tensor's
Hugging Face name, found in the file through the ``gguf`` package's own name map; so a GGUF is
refused or accepted for the same reasons as the safetensors of the same model, and every tensor
is checked against the config before a byte is written (`_plan`, the GGUF twin of `hf`'s check:
the safetensors reader's plan is being reshaped by the MoE families, so this one owns its own).

Tensors of the block types the checkpoint's quantized groups hold exactly (``QUANT_CONTRACT``:
Q4_0, Q4_1, Q4_K as 4-bit groups; Q8_0, Q6_K, Q5_0, Q3_K as int8 groups) are kept as they are,
not quantized a second time (`QuantGroups`, written by `checkpoint.write_checkpoint`); every
other type (Q5_1, Q5_K, Q2_K: a minimum the int8 groups lack; IQ*, ...) is dequantized by the ``gguf`` package and written as
float, and so is every tensor with ``dequantize=True`` (a checkpoint any precision loads).
Embeddings and norms are always float. The `ConvertReport` says, per type, what was kept and
what was dequantized.

Note: llama.cpp's converter permutes the rows of q and k for ``llama``-architecture models
(its RoPE rotates interleaved pairs, Hugging Face's rotates halves); `_unpermute` undoes it, as
transformers does when it loads a GGUF. Gemma's norms are stored as ``1 + w`` and are stored
back as ``w`` (the family adds the 1 at load). A row permutation and a row slice (Phi-3's fused
qkv) act on whole rows, so both apply to quantized groups without touching a value.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...model.checkpoint import write_checkpoint
from ...errors import CheckpointError, ConfigError
from ..decoder.arch import expected_shapes

__all__ = ["QuantGroups", "ConvertReport", "EXACT_TYPES", "ARCHITECTURES", "open_gguf", "read_metadata",
           "hf_config", "tokenizer_files", "convert_gguf", "quant_groups"]

_FIX_FILE = "the file is truncated or corrupt; download it again"
_FIX_INSTALL = "pip install 'rlx_mpi[gguf]'"


def _gguf():
    try:
        import gguf
        import gguf.quants  # noqa: F401
    except ImportError:
        raise ConfigError("convert", "reading a .gguf file needs the gguf package, which is not installed",
                          _FIX_INSTALL) from None
    return gguf


# -- quantized groups (the on-disk contract shared with the q4 precision) ---------------------------


@dataclass(frozen=True)
class QuantGroups:
    """A linear weight (N, K) as the checkpoint's quantized groups (quant contract):
    ``w[n, k] = scale[n, k // G] * code[n, k] + minimum[n, k // G]`` in float32.

    ``quant`` "q4": ``codes`` uint8 (N, K // 2), byte j of a row holding column 2j in its low
    nibble and 2j + 1 in its high one, codes 0..15, and a ``minimum``; "q8": ``codes`` int8
    (N, K), no minimum. ``scale`` / ``minimum``: float16 or float32, (N, K // G)."""

    quant: str
    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.codes.shape
        return n, width * (2 if self.quant == "q4" else 1)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + (0 if self.minimum is None else self.minimum.nbytes)

    def __getitem__(self, rows: slice) -> "QuantGroups":
        """Rows ``[a:b]`` (a fused tensor's part), or any index array of rows (a permutation)."""
        pick = (lambda a: None if a is None else np.ascontiguousarray(a[rows]))
        return QuantGroups(self.quant, pick(self.codes), pick(self.scale), pick(self.minimum), self.group_size)

    def unpack(self) -> np.ndarray:
        """The codes, one per column: uint8 0..15 (q4) or int8 (q8), (N, K)."""
        if self.quant == "q8":
            return self.codes
        out = np.empty(self.shape, np.uint8)
        out[:, 0::2] = self.codes & 0x0F
        out[:, 1::2] = self.codes >> 4
        return out

    def dequantize(self) -> np.ndarray:
        """The float32 weight, computed as the contract says (scale * code + minimum)."""
        n, k = self.shape
        g = self.group_size
        codes = self.unpack().astype(np.float32).reshape(n, k // g, g)
        w = self.scale.astype(np.float32)[:, :, None] * codes
        if self.minimum is not None:
            w = w + self.minimum.astype(np.float32)[:, :, None]
        return w.reshape(n, k)

    def write_h5(self, parent, name: str) -> None:
        """Write as the h5py group ``name`` under ``parent`` (`checkpoint.write_checkpoint`)."""
        group = parent.create_group(name)
        group.attrs["quant"] = self.quant
        group.attrs["shape"] = np.asarray(self.shape, np.int64)
        group.attrs["group_size"] = self.group_size
        group.create_dataset("codes", data=self.codes)
        group.create_dataset("scale", data=self.scale)
        if self.minimum is not None:
            group.create_dataset("minimum", data=self.minimum)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from a (..., 2) uint8 view."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0]


def _narrow(*arrays: np.ndarray) -> list[np.ndarray]:
    """float16 when every value is exactly a float16 (Q4_0's -8 d overflows only past 8188),
    else float32 for all (scale and minimum share one dtype)."""
    with np.errstate(over="ignore"):
        narrow = [a.astype(np.float16) for a in arrays]
    if all(np.array_equal(n.astype(np.float32), a.astype(np.float32)) for n, a in zip(narrow, arrays)):
        return narrow
    return [a.astype(np.float32) for a in arrays]


def _pack_q4(codes: np.ndarray) -> np.ndarray:
    """(N, K) codes 0..15 -> (N, K // 2) bytes: column 2j low nibble, 2j + 1 high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-value nibble block (16 bytes: value j < 16 in byte j's low nibble, value 16 + j
    in its high one) -> (..., 32) codes in column order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(raw: np.ndarray) -> QuantGroups:  # block: d f16, 16 bytes of nibbles; w = d (q - 8)
    n = raw.shape[0]
    b = raw.reshape(n, -1, 18)
    d = _f16(b[..., 0:2]).astype(np.float32)
    codes = _nibbles32(b[..., 2:]).reshape(n, -1)
    scale, minimum = _narrow(d, -8.0 * d)
    return QuantGroups("q4", _pack_q4(codes), scale, minimum, 32)


def _q4_1(raw: np.ndarray) -> QuantGroups:  # block: d, m f16, 16 bytes of nibbles; w = d q + m
    n = raw.shape[0]
    b = raw.reshape(n, -1, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    codes = _nibbles32(b[..., 4:]).reshape(n, -1)
    return QuantGroups("q4", _pack_q4(codes), d.copy(), m.copy(), 32)


def _q8_0(raw: np.ndarray) -> QuantGroups:  # block: d f16, 32 int8; w = d q
    n = raw.shape[0]
    b = raw.reshape(n, -1, 34)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1)
    return QuantGroups("q8", codes, _f16(b[..., 0:2]).copy(), None, 32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = s.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _q4_k(raw: np.ndarray) -> QuantGroups:
    """Super-block of 256: d, dmin f16, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    (chunk c of 32 bytes: group 2c in the low nibbles, 2c + 1 in the high); w = d sc q - dmin mn."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 144)
    d, dmin = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(n, -1, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(n, -1)  # (chunk, low|high, 32)
    # exact in float32: an f16 (11-bit significand) times a 6-bit integer
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
    minimum = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
    return QuantGroups("q4", _pack_q4(codes), scale, minimum, 32)


def _q6_k(raw: np.ndarray) -> QuantGroups:
    """Super-block of 256: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d
    f16; value e = 128 h + r: low = (ql[64 h + r % 64] >> 4 (r // 64)) & 15, high =
    (qh[32 h + r % 32] >> 2 (r // 32)) & 3, code = low | high << 4 - 32, scale d * sc[e // 16]."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 210)
    ql = b[..., :128].reshape(n, -1, 2, 1, 64)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = ((ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(n, -1, 2, 128)
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03).reshape(n, -1, 2, 128)
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, -1)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210]).astype(np.float32)
    return QuantGroups("q8", codes, (d[..., None] * sc).reshape(n, -1), None, 16)


def _q5_0(raw: np.ndarray) -> QuantGroups:
    """Block: d f16, 32 high bits (uint32, bit j for value j), 16 bytes of low nibbles;
    w = d (q - 16), q - 16 in [-16, 15]: an int8 group of 32 with scale d, exactly."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 22)
    high = (np.ascontiguousarray(b[..., 2:6]).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    codes = ((_nibbles32(b[..., 6:]) | (high.astype(np.uint8) << 4)).astype(np.int16) - 16).astype(np.int8)
    return QuantGroups("q8", codes.reshape(n, -1), _f16(b[..., 0:2]).copy(), None, 32)


def _q3_k(raw: np.ndarray) -> QuantGroups:
    """Super-block of 256: 32 bytes of high bits (hmask), 64 bytes of 2-bit lows, 12 bytes of
    6-bit scales, d f16; value e = 128 h + 32 s + l: low (qs[32 h + l] >> 2 s) & 3, high bit
    (hmask[l] >> (e // 32)) & 1, q = low - 4 (1 - high) in [-4, 3], scale d (sc - 32) per 16:
    int8 groups of 16, exact (an f16 times a 6-bit integer)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 110)
    hmask, qs, sc = b[..., :32], b[..., 32:96], b[..., 96:108]
    low = ((qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3).reshape(n, -1, 256)
    high = ((hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1).reshape(n, -1, 256)
    codes = (low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)).reshape(n, -1)
    lo = (sc[..., 0:8, None] >> np.array([0, 4], np.uint8)).swapaxes(-1, -2).reshape(n, -1, 16) & 0x0F
    hi = (sc[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).swapaxes(-1, -2).reshape(n, -1, 16) & 0x03
    scales = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.float32)
    d = _f16(b[..., 108:110]).astype(np.float32)
    return QuantGroups("q8", codes, (d[..., None] * scales).reshape(n, -1), None, 16)


# GGML type name -> its exact groups; the contract's "no second quantization" list (Q5_0 and
# Q3_K have no minimum: their codes fit int8 groups as they are, 8 bits where they used 5 or 3.4)
QUANT_CONTRACT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q8_0": _q8_0, "Q6_K": _q6_k, "Q5_0": _q5_0,
                  "Q3_K": _q3_k}
EXACT_TYPES = tuple(QUANT_CONTRACT)
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def quant_groups(type_name: str, raw: np.ndarray) -> QuantGroups:
    """The groups of a 2-D tensor of GGML type ``type_name`` from its raw bytes (N, bytes per row)."""
    return QUANT_CONTRACT[type_name](np.ascontiguousarray(raw, dtype=np.uint8))


# -- the file ---------------------------------------------------------------------------------------


def open_gguf(path: str | os.PathLike):
    """The ``gguf`` package's reader over ``path``; every way the file can be bad is one
    `CheckpointError` naming it (magic, truncation, an unknown tensor type, a tensor whose bytes
    disagree with its shape), never the package's traceback."""
    gguf = _gguf()
    path = Path(path)
    where = str(path)
    if not path.exists():
        raise CheckpointError(where, "file not found", "give the path of a .gguf file")
    if not path.is_file():
        raise CheckpointError(where, "is not a regular file", "give the path of a .gguf file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(where, f"cannot read ({e.strerror or e})", "check the file's permissions") from None
    if len(magic) < 4:
        raise CheckpointError(where, f"truncated: {size} bytes, too short for a GGUF header", _FIX_FILE)
    if magic != b"GGUF":
        raise CheckpointError(where, f"wrong magic {magic!r}: not a GGUF file (which starts with b'GGUF')",
                              "give a .gguf file (llama.cpp's format), or a Hugging Face directory")

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):  # checked before the package reshapes the bytes
            _check_tensor_table(gguf, where, size, start_offs, fields)
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(path)
    except CheckpointError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as e:
        raise CheckpointError(where, f"truncated or corrupt header ({type(e).__name__}: {_clip(str(e))})",
                              _FIX_FILE) from None
    except OSError as e:
        raise CheckpointError(where, f"cannot read ({e.strerror or e})", "check the file's permissions") from None


def _check_tensor_table(gguf, where: str, size: int, start: int, fields) -> None:
    """Each tensor's type is one ggml knows, its row a whole number of blocks, and its bytes
    inside the file and clear of the next tensor's."""
    spans = []
    for fld in fields:
        _, name_data, _, dims, raw_type, offset = fld.parts
        name = bytes(name_data).decode("utf-8", "replace")
        try:
            qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise CheckpointError(f"{where}: {name}", f"unsupported tensor type (type id {int(raw_type[0])} is "
                                  "not a ggml type this reader knows)",
                                  "update the gguf package, or re-quantize the model to a common type") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape = [int(d) for d in dims]
        count = math.prod(shape)
        if not shape or shape[0] % block:
            raise CheckpointError(f"{where}: {name}", f"size disagrees with its shape: rows of {shape[0] if shape else 0} "
                                  f"values are not whole {qtype.name} blocks of {block}", _FIX_FILE)
        nbytes = count // block * type_size
        first = start + int(offset[0])
        spans.append((first, nbytes, name, qtype.name, tuple(reversed(shape))))
    spans.sort()
    for (first, nbytes, name, tname, shape), after in zip(spans, spans[1:] + [(size, 0, None, None, None)]):
        if first + nbytes > size and after[2] is None:
            raise CheckpointError(f"{where}: {name}", f"truncated: its {tname} data ends at byte {first + nbytes}, "
                                  f"past the end of the {size}-byte file", _FIX_FILE)
        if first + nbytes > after[0]:
            raise CheckpointError(f"{where}: {name}", f"size disagrees with its shape: {tname} {shape} needs "
                                  f"{nbytes} bytes but the next tensor ({after[2]}) starts {after[0] - first} "
                                  "bytes after it", _FIX_FILE)


def read_metadata(reader) -> dict[str, Any]:
    """Every metadata key -> its value (strings, numbers, lists), the ``GGUF.*`` header aside."""
    out = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = fld.contents()
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{reader.data.filename}: {key}", f"unreadable metadata value ({e})", _FIX_FILE) from None
    return out


def _clip(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


# -- config -----------------------------------------------------------------------------------------

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


# -- tokenizer --------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every token with it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# tokenizer.ggml.pre -> the split regex its merges were learned with (transformers'
# integrations/gguf table, from llama.cpp's llama-vocab.cpp); others keep GPT-2's
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3),
           **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2), "tekken": _TEKKEN,
           **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O)}


def _merges(meta: dict, vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """The file's merges, or (SentencePiece files have none) every split of a token into two
    vocabulary pieces, best score first (transformers' generate_merges)."""
    given = meta.get("tokenizer.ggml.merges")
    if given:
        return [tuple(m.split(" ", 1)) for m in given]
    found = []
    for token, score in (scores or {}).items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        found.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _build_tokenizer(meta: dict, arch: str):
    """A `tokenizers.Tokenizer` equal to the one transformers builds from the same metadata
    (integrations/gguf: GPT2Tokenizer for ``gpt2``, LlamaTokenizer / GemmaTokenizer for ``llama``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    tokens = list(meta.get("tokenizer.ggml.tokens") or ())
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    where = "tokenizer.ggml.model"
    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab, _merges(meta, vocab, None), dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
        split = _SPLITS.get(meta.get("tokenizer.ggml.pre"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        control_ok = lambda t: set(t) <= alphabet  # noqa: E731 (a mislabelled token would grow the vocab)
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or ())
        gemma = arch in ("gemma", "gemma2", "gemma3")
        if gemma:  # runs of spaces are stored as spaces; merges follow the file's order, not its scores
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        order = {t: -i for i, t in enumerate(tokens)} if gemma else dict(zip(tokens, scores))
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab, _merges(meta, vocab, order), fuse_unk=True, byte_fallback=True,
                                   dropout=None, unk_token=tokens[unk] if gemma and unk is not None else None))
        if gemma:
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        else:
            if arch == "phi3":  # the prefix space from a normalizer (Phi-3's tokenizer.json), not Metaspace
                tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
            else:
                tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        control_ok = lambda t: True  # noqa: E731
    else:
        raise CheckpointError(where, f"is {kind!r}: no tokenizer is built for it",
                              "give token ids in the prompt file (\"tokens\"); supported: gpt2, llama")
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == 3 and control_ok(t)]  # 3: CONTROL
    named = [tokens[i] for i in _special_ids(meta).values() if i is not None and 0 <= i < len(tokens)]
    control += [AddedToken(t, normalized=False, special=True) for t in named if t not in {c.content for c in control}]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == 4 and t in vocab]  # 4: USER_DEFINED, matched whole
    if user:
        tok.add_tokens(user)
    if _add_bos(meta) and meta.get("tokenizer.ggml.bos_token_id") is not None:
        from tokenizers import processors

        bos = tokens[meta["tokenizer.ggml.bos_token_id"]]
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                           special_tokens=[(bos, bos_id)])
    return tok


def _special_ids(meta: dict) -> dict[str, int | None]:
    return {name: meta.get(f"tokenizer.ggml.{key}") for name, key in
            (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
             ("pad_token", "padding_token_id"))}


def _add_bos(meta: dict) -> bool:
    # transformers: a SentencePiece vocabulary that does not say adds BOS, as llama.cpp does
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def tokenizer_files(meta: dict, vocabulary: bool = True) -> dict[str, str]:
    """The files `tokenizer.load_tokenizer` reads, as text: ``tokenizer.json`` (when the metadata
    has a vocabulary and ``vocabulary``; it needs the tokenizers package), ``tokenizer_config.json``
    (special tokens, chat template) and ``generation_config.json`` (the end-of-sequence ids
    generate stops at)."""
    tokens = (meta.get("tokenizer.ggml.tokens") or []) if vocabulary else []
    eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos = list(dict.fromkeys(i for i in eos if isinstance(i, int)))
    generation = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "bos_token_id": meta.get("tokenizer.ggml.bos_token_id")}
    files = {"generation_config.json": json.dumps({k: v for k, v in generation.items() if v not in (None, [])}, indent=1)}
    if not tokens:
        return files
    config: dict[str, Any] = {name: tokens[i] for name, i in _special_ids(meta).items()
                              if isinstance(i, int) and 0 <= i < len(tokens)}
    config["add_bos_token"] = _add_bos(meta)
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if meta.get("tokenizer.chat_template") is not None:
        config["chat_template"] = meta["tokenizer.chat_template"]
    files["tokenizer_config.json"] = json.dumps(config, indent=1, ensure_ascii=False)
    files["tokenizer.json"] = _build_tokenizer(meta, meta.get("general.architecture")).to_str()
    return files


def _write_beside(out_path: Path, files: dict[str, str]) -> list[Path]:
    """``<stem>.<name>`` beside the checkpoint, each through a temporary name (hf.copy_tokenizer's way)."""
    from ..hf import write_through

    return [write_through(out_path.with_name(f"{out_path.stem}.{name}"),
                          lambda tmp, text=text: tmp.write_text(text, encoding="utf-8"))
            for name, text in files.items()]


# -- convert ----------------------------------------------------------------------------------------


@dataclass
class ConvertReport:
    """What `convert_gguf` did with each tensor, by GGML type: kept as groups, dequantized to
    float (a type the groups cannot hold exactly, an embedding, or ``dequantize=True``), float;
    and with ``dtype="q4"`` which float linear weights were quantized to q4 groups on writing."""

    kept: Counter = field(default_factory=Counter)  # type -> tensors kept ("Q4_1": 210)
    dequantized: dict = field(default_factory=lambda: defaultdict(list))  # type -> tensor names
    float: Counter = field(default_factory=Counter)
    requantized: list = field(default_factory=list)  # GGUF names written as q4 groups from floats (--dtype q4)
    notes: list = field(default_factory=list)  # anything else the user should read
    files: list = field(default_factory=list)  # tokenizer files written beside the checkpoint

    def lines(self) -> list[str]:
        out = []
        for t in sorted(set(self.kept) | set(self.dequantized) | set(self.float)):
            parts = []
            if self.kept[t]:
                parts.append(f"{self.kept[t]} kept as {'q4' if t.startswith('Q4') else 'int8'} groups (exact)")
            if self.dequantized.get(t):
                names = self.dequantized[t]
                parts.append(f"{len(names)} dequantized to float: {_compress(names)}")
            if self.float[t]:
                parts.append(f"{self.float[t]} float")
            out.append(f"{t}: " + "; ".join(parts))
        if self.requantized:
            out.append(f"requantized to q4 (from float): {len(self.requantized)}: {_compress(self.requantized)}")
        return out + self.notes


def _compress(names: list[str]) -> str:
    """``blk.{0-29}.attn_q.weight``-style: one entry per name pattern, its layers as ranges."""
    layers: dict[str, list[int]] = defaultdict(list)
    for name in names:
        m = re.match(r"blk\.(\d+)\.(.*)", name)
        layers[m.group(2) if m else name].append(int(m.group(1)) if m else -1)
    out = []
    for rest, ns in layers.items():
        if ns == [-1]:
            out.append(rest)
            continue
        ns, runs = sorted(ns), []
        for n in ns:
            if runs and n == runs[-1][1] + 1:
                runs[-1][1] = n
            else:
                runs.append([n, n])
        text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
        out.append(f"blk.{text}.{rest}" if len(ns) == 1 else f"blk.{{{text}}}.{rest}")
    return ", ".join(out)


def _unpermute(rows: int, heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's q/k permutation: new row i is stored row order[i]."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def convert_gguf(path: str | os.PathLike, out_path: str | os.PathLike, *, dtype: str = "float32",
                 dequantize: bool = False, tokenizer: bool = True) -> tuple[Any, Any, ConvertReport]:
    """Convert the GGUF ``path`` to the checkpoint ``out_path`` (atomically): the family of its
    architecture, its quantized tensors kept exactly where the contract allows (all float with
    ``dequantize``), float tensors stored as ``dtype`` ("q4": float linear weights quantized to q4
    groups, once the q4 precision is in the build), and with ``tokenizer`` its tokenizer,
    chat template and end-of-sequence ids beside it. Returns (family, `Arch`, `ConvertReport`)."""
    from .. import family_for_model_type

    if dtype not in ("float32", "float16", "bfloat16", "q4"):
        raise ConfigError("dtype", f"{dtype!r} is not a checkpoint dtype", "use float32, float16, bfloat16 or q4")
    requantize = _q4_picker() if dtype == "q4" else None
    gguf = _gguf()
    path, out_path = Path(path), Path(out_path)
    if not out_path.parent.is_dir():
        raise CheckpointError(str(out_path), f"output directory {str(out_path.parent)!r} does not exist", "create it first")
    if out_path.is_dir():
        raise CheckpointError(str(out_path), "is a directory", "give a file name such as model.h5")
    where = str(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensors = _all_tensors(path, meta, reader)
    shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in tensors.items()}
    raw = hf_config(meta, shapes, where)
    arch = meta["general.architecture"]
    family = family_for_model_type(raw["model_type"])
    if family is None:
        raise CheckpointError(f"{where}: general.architecture", f"{arch!r} maps to the Hugging Face model type "
                              f"{raw['model_type']!r}, which no family of this rlx_mpi converts",
                              "update rlx_mpi (or install the family's plug-in)")
    for name, t in tensors.items():
        tname = t.tensor_type.name
        if tname not in _FLOAT_TYPES and tname not in QUANT_CONTRACT and getattr(gguf.quants, tname, None) is None:
            raise CheckpointError(f"{where}: {name}", f"unsupported tensor type {tname}",
                                  f"types read: {', '.join(_FLOAT_TYPES + EXACT_TYPES)} and those the gguf package "
                                  "dequantizes; re-quantize the model to one of them")
    scaling = raw.get("rope_scaling") or {}
    if scaling.pop("_factors", None):  # Phi-3's per-frequency factors are tensors in a GGUF, config lists in HF's
        for key, tensor in (("long_factor", "rope_factors_long.weight"), ("short_factor", "rope_factors_short.weight")):
            scaling[key] = [float(v) for v in _dequantized(gguf, tensors[tensor])]
    if scaling.pop("_freqs", None):
        scaling.update(_llama3_scaling(_dequantized(gguf, tensors["rope_freqs.weight"]), raw["rope_theta"],
                                       raw["head_dim"], f"{where}: rope_freqs.weight"))
    cfg = family.arch_from_hf(raw, where).validate(where)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)

    def rename(hf_name: str) -> str:  # model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight
        base, _, suffix = hf_name.rpartition(".")
        found = names.get_name(base)
        return f"{found}.{suffix}" if found else hf_name

    plan = _plan(cfg, {ours: (rename(src.name), src.rows) for ours, src in family.hf_names(cfg).items()},
                 shapes, where, family.name)
    report = ConvertReport()
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads

    def read(name: str):
        t = tensors[name]
        tname = t.tensor_type.name
        if name != "token_embd.weight" and len(shapes[name]) == 2 and tname in QUANT_CONTRACT and not dequantize:
            value = quant_groups(tname, t.data)  # a linear weight: the groups hold it exactly
            report.kept[tname] += 1
        else:
            value = _dequantized(gguf, t)
            if tname in _FLOAT_TYPES:
                report.float[tname] += 1
            else:
                report.dequantized[tname].append(name)
        if arch in _PERMUTED and re.search(r"\.attn_[qk]\.(weight|bias)$", name):
            value = value[_unpermute(shapes[name][0], heads if ".attn_q." in name else kv_heads)]
        if arch in _GEMMA and name.endswith("norm.weight"):
            value = value - np.float32(1.0)  # transformers' Gemma2TensorProcessor
        return value

    extra = {}
    if requantize is not None:  # dtype q4: the float linear weights (F16/F32, or a type dequantized above) as q4

        def quantize(name: str, shape: tuple[int, ...]) -> bool:
            if requantize(name, shape):
                report.requantized.append(plan[name][0])
                return True
            return False

        extra["quantize"] = quantize
    write_checkpoint(out_path, family.name, cfg.to_json(), _tensors(plan, read), dtype=dtype, **extra)
    if tokenizer:
        try:
            files = tokenizer_files(meta)
        except ImportError:  # the [gguf] extra brings tokenizers; without it prompts are token ids
            files = tokenizer_files(meta, vocabulary=False)
            report.notes.append("no tokenizer.json written: the tokenizers package is not installed "
                                f"({_FIX_INSTALL}); prompts must then be token ids")
        report.files = _write_beside(out_path, files)
    return family, cfg, report


# read into the config: Phi-3's longrope factors, Llama 3.1's llama3 factors
def _all_tensors(path: Path, meta: dict, reader) -> dict:
    """Name -> tensor of the whole model: the file's, and with ``split.count`` > 1 (llama.cpp's
    gguf-split: ``NAME-00001-of-00003.gguf`` ...) every shard's, the first file holding the metadata."""
    count = meta.get("split.count", 1)
    readers = [reader]
    if count > 1:
        found = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path.name)
        if found is None or int(found.group(2)) != 1 or int(found.group(3)) != count:
            raise CheckpointError(str(path), f"is one of {count} shards (split.count) but not the first, "
                                  "NAME-00001-of-NNNNN.gguf", "give the first shard; the others are read beside it")
        for i in range(2, count + 1):
            shard = path.with_name(f"{found.group(1)}-{i:05d}-of-{count:05d}.gguf")
            if not shard.is_file():
                raise CheckpointError(str(shard), f"shard {i} of {count} not found beside the first",
                                      "download every shard into the same folder")
            readers.append(open_gguf(shard))
    tensors = {}
    for r in readers:
        for t in r.tensors:
            if t.name in tensors:
                raise CheckpointError(f"{r.data.filename}: {t.name}", "is in two shards", _FIX_FILE)
            tensors[t.name] = t
    expected = meta.get("split.tensors.count")
    if count > 1 and expected is not None and expected != len(tensors):
        raise CheckpointError(str(path), f"split.tensors.count is {expected} but the {count} shards hold "
                              f"{len(tensors)} tensors", "download the shards again")
    return tensors


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


def _plan(cfg, sources: dict[str, tuple[str, tuple[int, int] | None]], shapes: dict[str, tuple[int, ...]],
          where: str, family: str) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """Our name -> (GGUF name, rows or None), after checking that every tensor the config implies
    is in the file with its shape, that a fused tensor's parts cover it, and that nothing is left."""
    want = expected_shapes(cfg)
    used = {name for name, _ in sources.values()}
    missing = list(dict.fromkeys(sources[n][0] for n in want if sources[n][0] not in shapes))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(where, f"missing tensors {missing[:5]}{more}", _FIX_FILE)
    extra = sorted(n for n in shapes if n not in used and n not in _IGNORED)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise CheckpointError(where, f"unexpected tensors {extra[:5]}{more}",
                              f"they are not part of a {cfg.num_hidden_layers}-layer {family}; the metadata and "
                              "the tensors disagree (another architecture?)")
    covered: dict[str, int] = {}
    for ours, shape in want.items():
        name, rows = sources[ours]
        have = shapes[name]
        got = have if rows is None else (rows[1] - rows[0], *have[1:])
        if got != tuple(shape) or (rows is not None and rows[1] > have[0]):
            implied = tuple(shape) if rows is None else f"{tuple(shape)} at rows {rows[0]}..{rows[1]}"
            raise CheckpointError(f"{where}: {name}", f"shape {have} disagrees with the config, which implies "
                                  f"{implied}", "the metadata and the tensors disagree; download the file again")
        if rows is not None:
            covered[name] = covered.get(name, 0) + got[0]
    for name, count in covered.items():
        if count != shapes[name][0]:
            raise CheckpointError(f"{where}: {name}", f"has {shapes[name][0]} rows, the config's parts cover {count}",
                                  "the metadata and the tensors disagree; download the file again")
    return {ours: sources[ours] for ours in want}


def _tensors(plan: dict, read) -> Any:
    """(our name, tensor) in checkpoint order; a fused tensor is read once for its parts."""
    last: tuple[str, Any] | None = None
    for ours, (name, rows) in plan.items():
        if last is None or last[0] != name:
            last = (name, read(name))
        part = last[1] if rows is None else last[1][rows[0]:rows[1]]
        yield ours, (np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part)


def _q4_picker():
    """The q4 precision's choice of tensors a q4 checkpoint quantizes (``weights.q4_tensor``: issue
    #32 part 1); a `ConfigError` in a build without it."""
    try:
        from ..decoder.weights import q4_tensor
    except ImportError:
        raise ConfigError("convert --dtype", "q4 needs the q4 precision, which this rlx_mpi lacks",
                          "use float32, float16 or bfloat16 (the GGUF's 4-bit tensors are kept as they are)") from None
    return q4_tensor


def _dequantized(gguf, t) -> np.ndarray:
    """A tensor as float32, through the gguf package's dequantizer (exact for float types)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        return np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise CheckpointError(t.name, f"unsupported tensor type {t.tensor_type.name}",
                              "re-quantize the model to a common type") from None
