"""`convert_gguf`: a GGUF file to our HDF5 checkpoint through the family of its architecture:
its tensors checked against the config before a byte is written (`_plan`), read (kept as groups,
dequantized, unpermuted) and written by `checkpoint.write_checkpoint`; the `ConvertReport`.

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
from .blocks import EXACT_TYPES, QUANT_CONTRACT, _FLOAT_TYPES, quant_groups
from .config import _GEMMA, _IGNORED, _PERMUTED, _rope_tensors, hf_config
from .reader import _FIX_FILE, _FIX_INSTALL, _all_tensors, _dequantized, _gguf, open_gguf, read_metadata
from .tokenizer import _write_beside, tokenizer_files

__all__ = ["ConvertReport", "convert_gguf"]


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
    _rope_tensors(raw, lambda name: _dequantized(gguf, tensors[name]), where)
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

