"""Stale numba caches: dropped when any kernel source changed.

Note: why. numba keys a kernel's on-disk cache on its own source file alone, so a kernel compiled
with functions of other files keeps their old code when only those files change:
decode_layer.py's cache holds the matvecs of matvec.py and lowp.py, and theirs the dot products
of rowdot.py. A ``git pull`` (or an edit) that changes rowdot.py but not decode_layer.py would
then run the old dot products, silently, until the cache is deleted by hand (measured, editing
rowdot.py: a decode A/B compared old code with old code). `drop_stale` keeps a digest of every
kernel source beside the caches and deletes the ``*.nbi``/``*.nbc`` files when it differs, under
a lock, so the ranks of a job starting together delete once and then build or load the same
caches; a lock held longer than ``wait_s`` (a process stopped inside) is given up on, never
waited for without end, since this runs at import, before MPI_Init and its deadlines. A folder it cannot write (a read-only install) is left as it is.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from pathlib import Path

STAMP = "rlx-kernel-sources.sha256"


def sources_digest(folder: Path) -> str:
    """One digest of the folder's .py files, names and bytes."""
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _stamped(stamp: Path, digest: str) -> bool:
    try:
        return stamp.read_text() == digest
    except OSError:
        return False


def _lock(f, wait_s: float) -> bool:
    """Take an exclusive flock on f within wait_s seconds (False: another process holds it, e.g.
    one stopped mid-way; this one then goes on without deleting anything rather than hang)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def drop_stale(folder: Path, wait_s: float = 10.0) -> bool:
    """Delete folder/__pycache__'s numba caches unless they were built from the folder's current
    sources; True if it deleted them. Waits at most ``wait_s`` for another process doing the same."""
    cache, digest = folder / "__pycache__", sources_digest(folder)
    stamp = cache / STAMP
    if _stamped(stamp, digest):
        return False
    try:
        cache.mkdir(exist_ok=True)
        with open(cache / (STAMP + ".lock"), "a") as lock:
            if not _lock(lock, wait_s) or _stamped(stamp, digest):  # (or another rank did it meanwhile)
                return False
            for p in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
                p.unlink(missing_ok=True)
            tmp = cache / f"{STAMP}.{os.getpid()}"
            tmp.write_text(digest)
            os.replace(tmp, stamp)
            return True
    except OSError:  # read-only: numba cannot write here either
        return False
