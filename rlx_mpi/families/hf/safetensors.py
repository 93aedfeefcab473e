"""The safetensors reader: headers checked before a byte of data is read (`_index_tensors`),
tensors read as float32 / float16 (`_read_tensor`, one expert of a stacked tensor from its own
bytes), and the packed weight formats some checkpoints ship decoded (`mxfp4_decode`,
`fp8_block_decode`).

Note: the safetensors format (8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the raw bytes) is read here directly rather
than through the ``safetensors`` package: its numpy API cannot return bfloat16, the dtype
most Llama checkpoints ship in, and a thirty-line reader keeps the runtime dependencies at
numpy + h5py. Tensors are read one at a time in checkpoint order, so converting never holds
more than one tensor (plus its float32 copy) in memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ...errors import CheckpointError

__all__ = ["mxfp4_decode", "fp8_block_decode", "FP8_BLOCK"]

# safetensors dtype -> numpy dtype of the stored bytes (little-endian by the format's rule).
# BF16 is stored as uint16 and widened to float32 on read.
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header (100 MB)


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
