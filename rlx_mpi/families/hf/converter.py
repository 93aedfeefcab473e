"""The converter every family shares (`convert`): a Hugging Face directory's tensors checked
against the config (present, mapped, of a supported dtype and of the shape it implies) before a
byte is written, then read one at a time (a fused tensor split, one expert of a stacked one,
MXFP4 / FP8 dequantized) into `checkpoint.write_checkpoint`; the tokenizer files copied beside."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from ...model.checkpoint import write_checkpoint
from ...errors import CheckpointError, ConfigError
from ..decoder.arch import Arch, expected_shapes
from .config import read_hf_config
from .names import Source, fused_expert_names, text_tower
from .safetensors import (_DTYPES, FP8_BLOCK, _Entry, _index_tensors, _read_tensor, _safetensors_files,
                          fp8_block_decode, mxfp4_decode)

__all__ = ["convert", "copy_tokenizer", "TOKENIZER_FILES", "write_through"]

# Tensors some exports carry that hold nothing we need: RoPE's inverse frequencies are
# recomputed from the config (older transformers saved them as buffers).
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq|long_inv_freq)$")


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
