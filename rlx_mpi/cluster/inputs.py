"""The files a job reads that every rank must see alike: the input ids and the checkpoint.

`read_ids` reads ``run --input-ids IDS.npy`` with its header checked before any data (a forged
shape or a file of another kind is refused without allocating); `check_everywhere` names the
hosts that do not see the checkpoint (a node-local disk); `digest` is what ranks compare to
find a stale copy of the job file or checkpoint (`Cluster.prepare`). Rank 0 writes nothing here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .. import rules
from ..comm import transport
from ..errors import CheckpointError, InputError
from ..lifecycle.faults import RankContext

__all__ = ["read_ids", "check_everywhere", "digest"]


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def _by_host(rows: list[dict], status: str) -> str:
    hosts: dict[str, list[int]] = {}
    for r in rows:
        if r["status"] == status:
            hosts.setdefault(r["host"], []).append(r["rank"])
    return ", ".join(f"{h} (ranks {_ranges(sorted(rs))})" for h, rs in sorted(hosts.items()))


def check_everywhere(world: Any, ctx: RankContext, path: Path, timeout_s: float, created: bool) -> None:
    """Every rank checks it sees the checkpoint; rank 0 names the ranks and hosts that do not.

    Note: a checkpoint on a node-local disk exists for some ranks only, and a preset's is created
    by rank 0 on its own disk: both must fail here, naming the hosts, not later as a bare "not
    found" on some rank. The same on every rank is left to the header read, which says what is wrong.
    """
    status = "ok" if path.is_file() and os.access(path, os.R_OK) else ("unreadable" if path.exists() else "missing")
    rows = transport.gather_json(world, {"rank": world.rank, "host": ctx.host, "status": status}, 0, timeout_s,
                                 ctx, "whether the checkpoint is visible")
    if rows is None or len({r["status"] for r in rows}) == 1:
        return  # the same everywhere: the header read says what is wrong, if anything
    parts = [f"exists on {_by_host(rows, 'ok')}"] if any(r["status"] == "ok" for r in rows) else []
    if any(r["status"] == "missing" for r in rows):
        parts.append(f"not on {_by_host(rows, 'missing')}")
    if any(r["status"] == "unreadable" for r in rows):
        parts.append(f"not readable on {_by_host(rows, 'unreadable')}")
    what = ("created from the preset by rank 0 on its own disk: " if created else "") + ", ".join(parts)
    raise CheckpointError(str(path), what, "put it on a filesystem every node mounts (the same path on every node)")


def digest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()[:16]


def read_ids(path: Path, where: str, check_shape) -> np.ndarray:
    """Read an integer .npy of input ids, its header checked before any data is read.

    ``check_shape(shape)`` refuses shapes the model cannot take; a forged header (a shape
    larger than the file) or a file of another kind is refused without allocating.
    """
    fix = "save the ids with np.save(path, ids) as an integer array [batch, seq]"
    if not path.exists():
        raise InputError(where, "input ids file not found", "give an integer .npy of shape [batch, seq]")
    if not path.is_file():
        raise InputError(where, "is not a regular file (a folder, pipe or device)", fix)
    try:
        with open(path, "rb") as f:
            magic = f.read(8)
            kinds = {b"PK\x03\x04": "a .npz archive (np.savez), not a .npy array",
                     b"\x89HDF\r\n\x1a\n": "an HDF5 file, not a .npy array"}
            for head, what in kinds.items():
                if magic.startswith(head):
                    raise InputError(where, what, fix)
            if not magic.startswith(b"\x93NUMPY"):
                raise InputError(where, "not a .npy file (no NUMPY header)", fix)
            f.seek(0)
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read:
                raise InputError(where, f".npy format version {version} is not supported", fix)
            shape, fortran, dtype = read[version](f, max_header_size=100_000)
            data_bytes = path.stat().st_size - f.tell()
    except PermissionError:
        raise InputError(where, "cannot open the input ids (permission denied)", "check the file's permissions") from None
    except (ValueError, OSError, EOFError, SyntaxError) as e:
        raise InputError(where, f"not a readable .npy header ({e})", fix) from None
    if dtype.hasobject:
        raise InputError(where, "holds Python objects (pickled data), not integers", fix)
    rules.ids_array(dtype, shape, where)
    check_shape(shape)
    need = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if need != data_bytes:
        raise InputError(where, f"the header says shape {shape} of {dtype} ({need} bytes) but the file holds "
                         f"{data_bytes} bytes of data", "the file is truncated or not written by np.save; save it again")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise InputError(where, f"not a readable .npy array ({e})", fix) from None
