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
waited for without end, since this runs at import, before MPI_Init and its deadlines.

Note: where the caches are. numba picks the folder itself (`cache_dir`: ``NUMBA_CACHE_DIR`` when
set, else the ``__pycache__`` beside the kernels when writable, else the user's cache folder),
and `drop_stale` cleans the folder numba will use: a site install read-only to its users keeps
its caches under ``NUMBA_CACHE_DIR``, and those must be dropped when stale too. Where no folder is
writable (a read-only install, no NUMBA_CACHE_DIR, no HOME) numba compiles every kernel in every
job (~11-40 s); `cache_note` says so and how to fix it, and the start-up's compile step names it.
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


def _probe() -> None:
    """(A function of this folder for numba's cache locators to place.)"""


def cache_dir(folder: Path) -> Path | None:
    """The writable folder numba caches this folder's kernels in (the where note), None if none."""
    source = next(iter(sorted(folder.glob("*.py"))), None)
    try:
        from numba.core.caching import CacheImpl
    except ImportError:
        return None
    for cls in CacheImpl._locator_classes if source is not None else ():  # numba's order: NUMBA_CACHE_DIR, in tree, ...
        try:
            loc = cls.from_function(_probe, str(source))
        except Exception:  # (a locator that does not apply here, e.g. IPython's)
            loc = None
        if loc is not None:
            return Path(loc.get_cache_path())
    return None


def cache_note(folder: Path) -> str | None:
    """None when numba can cache the kernels; else why every job compiles them, and the fix."""
    if cache_dir(folder) is not None:
        return None
    return (f"numba cannot write a cache for the kernels ({folder / '__pycache__'} is read-only, NUMBA_CACHE_DIR "
            "is unset and there is no writable user cache folder), so every job compiles them (11-40 s): set "
            "NUMBA_CACHE_DIR to a writable folder (the same path on every node) and run `rlx-mpi compile-kernels` "
            "once with it")


def drop_stale(folder: Path, wait_s: float = 10.0) -> bool:
    """Delete the numba caches of the folder's kernels (where numba keeps them: `cache_dir`) unless
    they were built from the folder's current sources; True if it deleted them. Waits at most
    ``wait_s`` for another process doing the same."""
    cache, digest = cache_dir(folder), sources_digest(folder)
    if cache is None:  # nothing numba could write: nothing stale to drop
        return False
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
