"""The HDF5 checkpoint: one file, model config as metadata, one dataset per tensor.

Layout (``format_version`` 1)::

    /                      attrs: format = "rlx_mpi", format_version = 1,
                                  family = "llama", config = <model config as JSON>
    /embed_tokens          [vocab, hidden]
    /layers/<i>/<name>     one group per decoder layer i = 0..L-1; Llama names are
                           input_layernorm, q_proj, k_proj, v_proj, o_proj,
                           post_attention_layernorm, gate_proj, up_proj, down_proj
    /norm                  [hidden]
    /lm_head               [vocab, hidden]  (absent when the embeddings are tied)

Linear weights keep Hugging Face's ``[out_features, in_features]`` orientation, so a
tensor-parallel rank reads a contiguous block of rows (column-parallel) or columns
(row-parallel) with one hyperslab read. Weights are stored as float32, float16 or bfloat16
and read as whichever of those the rank asks for (``read(..., dtype=)``). HDF5 has no bfloat16
type: a bfloat16 tensor is a uint16 dataset (the top 16 bits of each float32) with the
attribute ``dtype = "bfloat16"``. Files are opened read-only with HDF5 file locking off, which shared filesystems
(Lustre, GPFS, NFS) need when many ranks open one file.

Quantized tensors (the contract shared with GGUF conversion): a linear weight ``X`` of logical
shape (N, K) may instead be a *group* ``X`` with attrs ``quant`` ("q4" | "q8"), ``shape`` [N, K]
and ``group_size`` G, holding ``codes`` and ``scale`` (and for q4 ``minimum``):

    q4: codes uint8 (N, K // 2), column 2j in byte j's low nibble and 2j+1 in its high one,
        codes 0..15; scale, minimum float16 or float32 (N, K // G); w = scale * code + minimum
    q8: codes int8 (N, K); scale float16 or float32 (N, K // G); w = scale * code

computed in float32; K is a multiple of G (else the tensor is stored as floats). The root attr
``quantized`` is true when any tensor is such a group. The root attr ``stored_precision`` (files
written since it was added) names the precision the weights are stored at, a job's ``precision =
"auto"`` (`stored_precision`): "q4" when any linear weight is a q4 group (a Q4_K_M GGUF's Q6_K
tensors beside its Q4_K ones included), else "int8" when any is a q8 group, else the float dtype
("f32" | "f16" | "bf16"). ``read`` dequantizes a group to the dtype
asked for (a float rank of a q4 file), ``read_q4`` hands a q4 group to a q4 rank as it is.
Tensor-parallel slices of a group cut rows freely and columns only on group boundaries.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Iterable

import h5py
import numpy as np

from ..errors import CheckpointError

__all__ = ["FORMAT", "FORMAT_VERSION", "READ_DTYPES", "write_checkpoint", "read_header", "H5ParamSource",
           "part_bounds", "stored_precision"]

FORMAT = "rlx_mpi"
FORMAT_VERSION = 1
READ_DTYPES = ("float32", "float16", "bfloat16")  # what read() returns; bfloat16 as uint16 bit patterns
_CONVERT_ROWS_BYTES = 4 << 20  # a converting read goes through float32 blocks of about this size (peak RSS)
_FLOAT_PRECISIONS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # a stored dtype -> its precision
_STORED_LOOK = 512  # nodes an older file (no stored_precision attr) is looked through at most


def part_bounds(n: int, part: int, parts: int) -> tuple[int, int]:
    """[start, stop) of the ``part``-th of ``parts`` near-equal slices of ``n`` (larger first)."""
    base, extra = divmod(n, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def write_checkpoint(path: str | os.PathLike, family: str, config_json: str,
                     tensors: Iterable[tuple[str, np.ndarray]], dtype: str = "float32",
                     quantize: Callable[[str, tuple[int, ...]], bool] | None = None) -> None:
    """Write a checkpoint atomically: to a temporary name first, renamed when complete.

    With ``dtype`` "q4" the tensors ``quantize(name, shape)`` picks (the family's linear weights
    whose input width is a multiple of 32) are written as q4 groups (`kernels.quantize_q4`), every
    other tensor as float32."""
    from ..outputs import check_space, write_failed

    if dtype == "q4" and quantize is None:
        raise ValueError("write_checkpoint: dtype q4 needs quantize= (which tensors are linear weights)")

    path = Path(os.path.realpath(path))  # a symlink stays a symlink: its target is replaced
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    groups: set[str] = set()  # the kinds of quantized group written ("q4", "q8")
    try:
        with h5py.File(tmp, "w", locking=False) as f:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["family"] = family
            f.attrs["config"] = config_json
            for name, array in tensors:
                if hasattr(array, "write_h5"):  # quantized groups (families/gguf/blocks.py: the quant contract)
                    check_space(tmp, array.nbytes, str(path))
                    array.write_h5(f, name)
                    f.attrs["quantized"] = True  # for plan / probe
                    groups.add(str(array.quant))
                    continue
                if dtype == "q4" and quantize(name, np.shape(array)):
                    f.attrs["quantized"] = True
                    _write_q4(f, name, np.ascontiguousarray(array, dtype=np.float32), tmp, str(path))
                    groups.add("q4")
                    continue
                if dtype == "bfloat16":  # HDF5 has no bfloat16: its bit patterns as uint16, marked
                    from ..kernels import to_bf16

                    data = to_bf16(np.asarray(array, dtype=np.float32))
                else:
                    data = np.asarray(array, dtype="float32" if dtype == "q4" else dtype)
                check_space(tmp, data.nbytes, str(path))  # before HDF5 meets the full disk itself
                ds = f.create_dataset(name, data=data)
                if dtype == "bfloat16":
                    ds.attrs["dtype"] = "bfloat16"
            f.attrs["stored_precision"] = _stored_name(groups, _FLOAT_PRECISIONS.get(dtype, "f32"))
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a quota, a read-only mount: one line, no partial file
        raise write_failed(str(path), e) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def _stored_name(groups: set[str], floats: str) -> str:
    """The precision of a file holding quantized groups of ``groups`` kinds and floats as ``floats``
    (the module note: any q4 group makes it q4, else any q8 group int8)."""
    return "q4" if "q4" in groups else "int8" if "q8" in groups else floats


def stored_precision(path: str | os.PathLike) -> tuple[str, str]:
    """(precision, how it was told) of the checkpoint at ``path``: the precision its weights are
    stored at (the module note), what a job's ``precision = "auto"`` runs at.

    Read from the root attr ``stored_precision``; a file written before it is looked at a bounded
    number of nodes (`_STORED_LOOK`), layer 0's first (its linear weights are stored as the rest
    are), so a checkpoint of tens of thousands of tensors is not walked whole."""
    path = Path(path)
    with _open(path) as f:
        attr = f.attrs.get("stored_precision")
        attr = attr.decode() if isinstance(attr, bytes) else attr
        quantized = bool(f.attrs.get("quantized", False))
        if attr in _FLOAT_PRECISIONS.values() and not quantized or attr in ("int8", "q4") and quantized:
            return attr, "its stored_precision attribute"  # (one that disagrees with quantized: looked at)
        groups: set[str] = set()
        floats: list[str] = []
        looked = 0
        for node in _nodes(f):
            looked += 1
            if isinstance(node, h5py.Group):
                kind = node.attrs.get("quant")
                groups.add(kind.decode() if isinstance(kind, bytes) else str(kind))
            elif node.ndim == 2:  # a linear weight or an embedding (norms are 1-D)
                floats.append("bfloat16" if _is_bf16(node) else str(node.dtype))
            if "q4" in groups or (not quantized and floats) or looked >= _STORED_LOOK:
                break
    name = _stored_name(groups, _FLOAT_PRECISIONS.get(floats[0], "f32") if floats else "f32")
    return name, f"{looked} of its tensors (the file predates the stored_precision attribute)"


def _nodes(f: h5py.File):
    """The file's tensors (datasets and quantized groups), layer 0's first, then the others."""

    def walk(node):
        if isinstance(node, h5py.Dataset) or "quant" in node.attrs:
            yield node
            return
        for key in sorted(node.keys(), key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k)):
            yield from walk(node[key])

    layers = f.get("layers")
    first = layers.get("0") if isinstance(layers, h5py.Group) else None
    if isinstance(first, h5py.Group):
        yield from walk(first)
    for key in f.keys():
        if key != "layers":
            yield from walk(f[key])
    if isinstance(layers, h5py.Group):
        for key in sorted(layers.keys(), key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k)):
            if key != "0":
                yield from walk(layers[key])


def _write_q4(f: h5py.File, name: str, w: np.ndarray, tmp: Path, where: str) -> None:
    """``w`` (N, K) as a q4 group of the contract: codes, float16 scale and minimum."""
    from ..kernels import Q4_GROUP, quantize_q4
    from ..outputs import check_space

    codes, sm = quantize_q4(w)
    check_space(tmp, codes.nbytes + sm.nbytes, where)
    g = f.create_group(name)
    g.attrs["quant"], g.attrs["shape"], g.attrs["group_size"] = "q4", np.array(w.shape, np.int64), Q4_GROUP
    g.create_dataset("codes", data=codes)
    g.create_dataset("scale", data=sm[:, 0::2].view(np.float16))
    g.create_dataset("minimum", data=sm[:, 1::2].view(np.float16))


def _open(path: Path) -> h5py.File:
    where = str(path)
    if not path.exists():
        raise CheckpointError(where, "checkpoint not found",
                              "check [model] checkpoint, or set [model] preset to create a random one")
    if path.is_dir():
        raise CheckpointError(where, "is a directory, not an HDF5 file",
                              "convert a Hugging Face directory first: rlx-mpi convert HF_DIR OUT.h5")
    if not path.is_file():  # a FIFO or device would block or mislead the HDF5 reader
        raise CheckpointError(where, "is not a regular file (a pipe or device)", "give the path of an HDF5 file")
    try:
        with open(path, "rb"):  # tells "permission denied" apart from a corrupt file
            pass
    except OSError as e:
        raise CheckpointError(where, f"cannot open the checkpoint ({os.strerror(e.errno or 0).lower()})",
                              "check the file's permissions (and its folder's) on every node") from None
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as e:
        found = re.search(r"\(([^():]+)", str(e))  # h5py: "Unable to ... (truncated file: eof = ...)"
        reason = found.group(1).strip() if found else str(e)
        what = {"truncated file": "truncated: the file is shorter than its HDF5 header says",
                "file signature not found": "not an HDF5 file"}.get(reason, f"cannot open as HDF5 ({reason})")
        raise CheckpointError(where, what, "copy it again, or re-create it with rlx-mpi convert or "
                              "init-model") from None


def read_header(path: str | os.PathLike) -> tuple[str, str]:
    """The checkpoint's (family, config JSON), checked for our format marker."""
    path = Path(path)
    with _open(path) as f:
        attrs = dict(f.attrs)
    where = str(path)
    if attrs.get("format") != FORMAT:
        raise CheckpointError(where, "not an rlx_mpi checkpoint (no format = \"rlx_mpi\" attribute)",
                              "convert it with rlx-mpi convert, or create one with rlx-mpi init-model")
    version = attrs.get("format_version")
    if isinstance(version, np.generic):
        version = version.item()
    if not isinstance(version, int) or isinstance(version, bool) or version != FORMAT_VERSION:
        got = f"{version!r} ({type(version).__name__})" if not isinstance(version, int) else repr(version)
        raise CheckpointError(where, f"format_version {got} is not supported",
                              f"this rlx_mpi reads the integer version {FORMAT_VERSION}; re-convert the model")
    family, config = attrs.get("family"), attrs.get("config")
    if not isinstance(family, str) or not isinstance(config, str):
        raise CheckpointError(where, "missing family or config attribute", "re-convert the model")
    return family, config


class H5ParamSource:
    """A `ParamSource` over an HDF5 checkpoint that reads only the slices asked for.

    ``expect`` maps tensor names to the shapes the model config implies; a tensor that is
    missing or shaped otherwise is a `CheckpointError` naming it.
    """

    def __init__(self, path: str | os.PathLike, expect: dict[str, tuple[int, ...]] | None = None,
                 check_finite: bool = False):
        self.path = Path(path)
        self.expect = expect or {}
        self.check_finite = check_finite
        self._file = _open(self.path)
        self.bytes_read = 0
        self._quantized = bool(self._file.attrs.get("quantized", False))  # any quantized group (module note)

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _node(self, name: str) -> "h5py.Dataset | _Quant":
        """The tensor ``name``: a float dataset, or a quantized group (checked)."""
        where = f"{self.path}: /{name}"
        try:
            node = self._file[name]
        except KeyError:
            raise CheckpointError(where, "tensor missing", "the checkpoint is incomplete; re-convert it") from None
        if isinstance(node, h5py.Group) and "quant" in node.attrs:
            q = _Quant(node, where)
            want = self.expect.get(name)
            if want is not None and q.shape != tuple(want):
                raise CheckpointError(where, f"shape {q.shape} disagrees with the model config, which implies "
                                      f"{tuple(want)}", "the config attribute and tensors come from different models; "
                                      "re-convert")
            return q
        return self._dataset(name, node)

    def _dataset(self, name: str, ds) -> h5py.Dataset:
        """``ds`` (the file's node ``name``) checked as a float tensor."""
        where = f"{self.path}: /{name}"
        if not isinstance(ds, h5py.Dataset):
            raise CheckpointError(where, "is a group, not a tensor", "re-convert the checkpoint")
        if ds.dtype.kind != "f" and not _is_bf16(ds):
            raise CheckpointError(where, f"dtype {ds.dtype} is not floating point", "re-convert the checkpoint")
        want = self.expect.get(name)
        if want is not None and tuple(ds.shape) != tuple(want):
            raise CheckpointError(where, f"shape {tuple(ds.shape)} disagrees with the model config, which implies {tuple(want)}",
                                  "the config attribute and tensors come from different models; re-convert")
        return ds

    def shape(self, name: str) -> tuple[int, ...]:
        node = self._node(name)
        return node.shape if isinstance(node, _Quant) else tuple(node.shape)

    def stored(self, name: str) -> tuple | None:
        """How tensor ``name`` is stored, from its attributes alone (no data read): None for
        floats, ("q4", group, bytes of a scale / minimum: 2 when both are float16, else 4) or
        ("q8", group): what the planner prices a rank's resident bytes from (weights.held_bytes)."""
        if not self._quantized:  # a float file: no per-tensor lookups (tens of thousands for a large MoE)
            return None
        node = self._node(name)
        if not isinstance(node, _Quant):
            return None
        if node.kind == "q8":
            return ("q8", node.group)
        half = node.g["scale"].dtype == np.float16 and node.g["minimum"].dtype == np.float16
        return ("q4", node.group, 2 if half else 4)

    def read_q8(self, name: str, *, axis: int | None = None, part: int = 0,
                parts: int = 1) -> tuple[np.ndarray, np.ndarray] | None:
        """A q8 group (or its slice) as an int8 rank holds it: (int8 codes, float32 scales, one
        per group of 16, 32 or 64; exact from float16); None when ``name`` is not a q8 group."""
        node = self._node(name)
        if not isinstance(node, _Quant) or node.kind != "q8":
            return None
        from ..kernels import INT8_GROUPS

        if node.group not in INT8_GROUPS:
            return None  # another group width: read() dequantizes it and the rank quantizes its own blocks
        codes, scale = node.read(axis, part, parts)
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        if self.check_finite and not np.isfinite(scale).all():
            raise CheckpointError(f"{self.path}: /{name}", "contains NaN or Inf scales",
                                  "the weights are corrupt; re-convert from the source model")
        self.bytes_read += codes.nbytes + scale.nbytes
        return codes, scale

    def read_q4(self, name: str, *, axis: int | None = None, part: int = 0,
                parts: int = 1) -> tuple[np.ndarray, np.ndarray] | None:
        """A q4 group (or its ``part``-th slice along ``axis``) as `kernels.quantize_q4` makes them:
        (codes, scale / minimum pairs), float16 pairs where the file holds both as float16; None
        when ``name`` is not a q4 group (a float tensor, or q8)."""
        from ..kernels import Q4_GROUP

        node = self._node(name)
        if not isinstance(node, _Quant) or node.kind != "q4" or node.group != Q4_GROUP:
            return None  # (q4 groups of another width: read() dequantizes them, the rank quantizes its own)
        codes, scale, minimum = node.read(axis, part, parts)
        half = scale.dtype == np.float16 and minimum.dtype == np.float16
        sm = np.empty((codes.shape[0], 2 * scale.shape[1]), np.float16 if half else np.float32)
        sm[:, 0::2], sm[:, 1::2] = scale, minimum
        if self.check_finite and not (np.isfinite(scale).all() and np.isfinite(minimum).all()):
            raise CheckpointError(f"{self.path}: /{name}", "contains NaN or Inf scales",
                                  "the weights are corrupt; re-convert from the source model")
        self.bytes_read += codes.nbytes + sm.nbytes
        return codes, (sm.view(np.uint16) if half else sm)

    def read(self, name: str, *, axis: int | None = None, part: int = 0, parts: int = 1,
             dtype: str = "float32") -> np.ndarray:
        """Tensor ``name`` (or its ``part``-th slice along ``axis``) as ``dtype``: "float32",
        "float16" or "bfloat16" (uint16 bit patterns). A conversion goes block by block, so it
        never holds a float32 copy of a whole large tensor."""
        if dtype not in READ_DTYPES:
            raise ValueError(f"H5ParamSource.read: dtype {dtype!r} is not one of {READ_DTYPES}")
        node = self._node(name)
        if isinstance(node, _Quant):  # dequantized (a float rank of a quantized file), then as asked
            out = self._convert(node.dequantize(axis, part, parts), "float32", dtype)
            if self.check_finite and not _finite(out, dtype):
                raise CheckpointError(f"{self.path}: /{name}", "contains NaN or Inf values",
                                      "the weights are corrupt; re-convert from the source model")
            self.bytes_read += out.nbytes
            return out
        ds = node
        index = [slice(None)] * ds.ndim
        if axis is not None and parts > 1:
            index[axis] = slice(*part_bounds(ds.shape[axis], part, parts))
        stored = "bfloat16" if _is_bf16(ds) else str(ds.dtype)
        try:
            if stored == dtype and ds.ndim >= 2:  # straight into a 64-byte aligned buffer: the kernels'
                # `Linear` would otherwise copy it to align it (a second copy of the tensor at load)
                from ..kernels import aligned_empty

                shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, ds.shape))
                out = aligned_empty(shape, ds.dtype)
                if out.size:
                    ds.read_direct(out, tuple(index))
            elif stored == dtype or (dtype == "float32" and ds.ndim < 2):
                out = self._convert(ds[tuple(index)] if ds.ndim else ds[()], stored, dtype)
            else:
                out = self._read_blocks(ds, index, stored, dtype)
        except OSError as e:
            raise CheckpointError(f"{self.path}: /{name}", f"read failed ({e})",
                                  "the file may be truncated; re-create it") from None
        if self.check_finite and not _finite(out, dtype):
            raise CheckpointError(f"{self.path}: /{name}", "contains NaN or Inf values",
                                  "the weights are corrupt; re-convert from the source model")
        self.bytes_read += out.nbytes
        return out

    def _read_blocks(self, ds: h5py.Dataset, index: list, stored: str, dtype: str) -> np.ndarray:
        """Read and convert a 2-D (or larger) tensor a block of leading rows at a time."""
        rows = range(*index[0].indices(ds.shape[0]))
        shape = (len(rows), *(len(range(*s.indices(n))) for s, n in zip(index[1:], ds.shape[1:])))
        from ..kernels import aligned_empty

        out = aligned_empty(shape, np.uint16 if dtype == "bfloat16" else dtype)  # (aligned: see `read`)
        per_row = max(1, int(np.prod(shape[1:])) * 4)
        step = max(1, _CONVERT_ROWS_BYTES // per_row)
        for a in range(0, len(rows), step):
            b = min(len(rows), a + step)
            block = ds[(slice(rows.start + a, rows.start + b), *index[1:])]
            out[a:b] = self._convert(block, stored, dtype)
        return out

    @staticmethod
    def _convert(raw: np.ndarray, stored: str, dtype: str) -> np.ndarray:
        from ..kernels import from_bf16, to_bf16

        if stored == dtype:
            return np.ascontiguousarray(raw)
        f32 = from_bf16(raw) if stored == "bfloat16" else np.asarray(raw, dtype=np.float32)
        return to_bf16(f32) if dtype == "bfloat16" else np.ascontiguousarray(f32, dtype=dtype)


class _Quant:
    """A quantized tensor's group (the module note), checked when opened."""

    def __init__(self, g: h5py.Group, where: str):
        self.where = where
        kind, shape, gs = g.attrs.get("quant"), g.attrs.get("shape"), g.attrs.get("group_size")
        kind = kind.decode() if isinstance(kind, bytes) else kind
        fix = "re-convert the model"
        if kind not in ("q4", "q8"):
            raise CheckpointError(where, f"quant = {kind!r} is not q4 or q8", fix)
        try:
            n, k = (int(v) for v in np.asarray(shape).reshape(-1))
            gs = int(gs)
        except (TypeError, ValueError):
            raise CheckpointError(where, f"{kind} group without a shape [N, K] and group_size", fix) from None
        if gs <= 0 or k % gs or n <= 0 or (kind == "q4" and gs % 2):
            raise CheckpointError(where, f"{kind} group of shape {[n, k]}: {k} columns are not groups of {gs}", fix)
        want = {"codes": ((n, k // 2), "uint8") if kind == "q4" else ((n, k), "int8"),
                "scale": ((n, k // gs), "float"), **({"minimum": ((n, k // gs), "float")} if kind == "q4" else {})}
        for key, (wshape, wtype) in want.items():
            ds = g.get(key)
            if not isinstance(ds, h5py.Dataset):
                raise CheckpointError(where, f"{kind} group lacks its {key!r} dataset", fix)
            ok = ds.dtype in (np.float16, np.float32) if wtype == "float" else ds.dtype == np.dtype(wtype)
            if tuple(ds.shape) != wshape or not ok:
                raise CheckpointError(where, f"{key} is {ds.dtype} {tuple(ds.shape)}, the {kind} contract says "
                                      f"{'float16 or float32' if wtype == 'float' else wtype} {wshape}", fix)
        self.kind, self.shape, self.group, self.g = kind, (n, k), gs, g

    def _index(self, axis: int | None, part: int, parts: int) -> tuple[slice, slice]:
        """(rows, columns) of the slice in weight columns; a column cut must fall between groups."""
        rows, cols = slice(None), slice(None)
        if axis is None or parts <= 1:
            return rows, cols
        a, b = part_bounds(self.shape[axis], part, parts)
        if axis == 0:
            return slice(a, b), cols
        if a % self.group or b % self.group:
            from ..errors import ConfigError

            groups = self.shape[1] // self.group
            raise ConfigError(self.where, f"tp {parts} cuts its {self.kind} groups: its {self.shape[1]} input columns "
                              f"are {groups} groups of {self.group}, and rank {part}'s share starts or ends "
                              f"inside one (columns {a}:{b})",
                              f"use a tp that divides {groups} (the groups are stored whole; re-convert from floats "
                              "to quantize per shard at load)")
        return rows, slice(a, b)

    def read(self, axis: int | None, part: int, parts: int) -> tuple[np.ndarray, ...]:
        """(codes, scale[, minimum]) of the slice, as stored."""
        rows, cols = self._index(axis, part, parts)
        c = cols if cols.start is None else slice(cols.start // (2 if self.kind == "q4" else 1),
                                                  cols.stop // (2 if self.kind == "q4" else 1))
        s = cols if cols.start is None else slice(cols.start // self.group, cols.stop // self.group)
        try:
            out = [np.ascontiguousarray(self.g["codes"][rows, c]), np.ascontiguousarray(self.g["scale"][rows, s])]
            if self.kind == "q4":
                out.append(np.ascontiguousarray(self.g["minimum"][rows, s]))
        except OSError as e:
            raise CheckpointError(self.where, f"read failed ({e})", "the file may be truncated; re-create it") from None
        return tuple(out)

    def dequantize(self, axis: int | None, part: int, parts: int) -> np.ndarray:
        """The slice as float32: scale * code (+ minimum) per group, in float32."""
        parts_ = self.read(axis, part, parts)
        if self.kind == "q4":
            codes, scale, minimum = parts_
            q = np.empty((codes.shape[0], 2 * codes.shape[1]), np.float32)
            q[:, 0::2], q[:, 1::2] = codes & 15, codes >> 4
        else:
            q, scale = parts_[0].astype(np.float32), parts_[1]
            minimum = None
        g = self.group
        out = (q.reshape(q.shape[0], -1, g) * scale.astype(np.float32)[..., None])
        if minimum is not None:
            out += minimum.astype(np.float32)[..., None]
        return out.reshape(q.shape)


def _finite(a: np.ndarray, dtype: str) -> bool:
    if dtype == "bfloat16":  # exponent bits all ones: Inf or NaN
        return not ((a & np.uint16(0x7F80)) == np.uint16(0x7F80)).any()
    return bool(np.isfinite(a).all())


def _is_bf16(ds: h5py.Dataset) -> bool:
    return ds.dtype == np.uint16 and ds.attrs.get("dtype") == "bfloat16"
