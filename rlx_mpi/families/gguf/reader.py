"""The GGUF file through the ``gguf`` package: open and check it (`open_gguf`), its metadata
(`read_metadata`), its tensors across llama.cpp's gguf-split shards (`_all_tensors`), a tensor as
float32 (`_dequantized`). Every way the file can be bad is one `CheckpointError` naming it."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CheckpointError, ConfigError

__all__ = ["open_gguf", "read_metadata"]

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



def _dequantized(gguf, t) -> np.ndarray:
    """A tensor as float32, through the gguf package's dequantizer (exact for float types)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        return np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise CheckpointError(t.name, f"unsupported tensor type {t.tensor_type.name}",
                              "re-quantize the model to a common type") from None
