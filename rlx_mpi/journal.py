"""Resumable output of a generation job: rows appended in prompt order, nothing torn or lost.

Note: the output file is at every moment the rows of the first k prompts, in prompt order,
one JSON object per line. Three things keep it so:

* rows are written in prompt order: `Journal.complete` holds a row back until every earlier
  prompt still to do is complete, so the file of a run that was stopped and resumed equals
  an uninterrupted run's row for row, whatever order the decode finished the prompts in;
* each batch of whole lines goes out in one ``os.write`` on an ``O_APPEND`` descriptor, and
  is fsynced at most every ``sync_s`` seconds (and on close). A ``kill -9`` can at worst cut
  the last batch short: the next open finds a last line without its newline (or, after a
  power loss, a tail of garbage) and cuts it off before appending;
* opening checks the rows already there against the prompts: an id that is not a prompt, a
  duplicated id, or a row out of prompt order means the file came from another prompt file,
  and is refused rather than "resumed" into nonsense.

A stopped job (SIGTERM/SIGINT/SIGUSR1, see `rlx_mpi.signals`) closes its journal and exits
with `REQUEUE_EXIT`; rerunning the same command carries on where it stopped. The price of
prompt order: rows complete but held back behind a slower earlier prompt are lost on a
``kill -9`` (they are recomputed); `Journal.held` says how many there are.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Iterable, Sequence

from .errors import InputError, RankFault
from .prompts import Prompt

__all__ = ["Journal", "REQUEUE_EXIT", "MAX_ROW_BYTES"]

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL, "temporary failure, the user is invited to retry": the job was
# stopped by a signal, wrote everything complete, and a rerun of the same command resumes.
# Outside 0-5 (rlx_mpi's own codes) and below 128 (a death by signal, as shells report it).
REQUEUE_EXIT = 75
MAX_ROW_BYTES = 1 << 26  # 64 MiB: a longer line in an output file is not one of our rows
_ROW_START = b'{"id":"'  # every row begins so (id first, compact JSON): a torn one too


class Journal:
    """The output file of a generation job, opened for appending rows in prompt order.

    ``pending`` is the prompts still to do when the journal was opened, in order; ``done`` the
    ids whose rows are in the file (it grows as rows are written).
    """

    def __init__(self, path, prompts: Sequence[Prompt], *, inputs: Iterable = (), sync_s: float = 2.0):
        if sync_s < 0:
            raise ValueError(f"sync_s must be >= 0, got {sync_s}")
        self.path = Path(path)
        self.sync_s = sync_s
        self._prompts = list(prompts)
        if [p.index for p in self._prompts] != list(range(len(self._prompts))) or \
                len({p.id for p in self._prompts}) != len(self._prompts):
            raise ValueError("prompts must be read_prompts' list: indices 0..n-1, unique ids")
        self._check_path(inputs)
        self._fd = self._open()
        try:
            k = self._recover()
        except BaseException:
            os.close(self._fd)
            raise
        self.done: set[str] = {p.id for p in self._prompts[:k]}
        self.pending: list[Prompt] = self._prompts[k:]
        self._next = k  # index of the first prompt whose row is not written yet
        self._held: dict[int, tuple[str, bytes]] = {}  # complete rows waiting for an earlier prompt
        self._ready: list[tuple[str, bytes]] = []  # (id, line) to write, in order
        self._last_sync = time.monotonic()
        self._unsynced = False

    # -- opening -------------------------------------------------------------------------------

    def _check_path(self, inputs: Iterable) -> None:
        """The output-path rules every command shares (`outputs.check_output`: not a folder, not
        a device or pipe, its folder writable, never an input), as this module's `InputError`."""
        from .errors import ConfigError
        from .outputs import check_output

        try:
            check_output("output", self.path, {f"the input file {p}": p for p in inputs if p is not None},
                         stream_ok=False)
        except ConfigError as e:
            raise InputError(e.where, e.what, e.fix) from None

    def _open(self) -> int:
        where = f"output {self.path}"
        created = not self.path.exists()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise InputError(where, f"cannot open for writing: {e.strerror}",
                             "check the path and its permissions") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InputError(where, "is not a regular file (a pipe, a device)",
                                 "give a file path: the job resumes from what the file holds")
            self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        if created:  # make the new name itself durable, not just the data we fsync later
            _fsync_dir(self.path.parent)
        return fd

    def _lock(self, fd: int) -> None:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise InputError(f"output {self.path}", "another process is writing this file",
                                 "wait for that job to end, or write to another file") from None
            # Some parallel file systems (Lustre mounted without -o flock) have no locks.
            log.debug("%s: no file lock (%s); carrying on without one", self.path, e.strerror)

    def _recover(self) -> int:
        """Check the rows already in the file, cut a torn tail; return how many rows are good."""
        index = {p.id: p.index for p in self._prompts}
        k, offset, lineno = 0, 0, 0  # good rows, byte offset after them, their last line
        with open(self.path, "rb") as f:
            for line in _lines(f):
                rid = _row_id(line)
                if rid is None:
                    break
                lineno += 1
                self._check_row(rid, k, index, f"{self.path}:{lineno}")
                k, offset = k + 1, offset + len(line)
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            tail = f.read(min(size - offset, MAX_ROW_BYTES))
        if size > offset:
            if not _torn(tail, size - offset):
                raise InputError(f"{self.path}:{lineno + 1}", "this line is not a completions row "
                                 "(a JSON object with a string id, as rlx-mpi writes them)",
                                 "give a new file for --out, or move this one aside; a row cut "
                                 "short by a crash is repaired, anything else is never overwritten")
            log.warning("%s: cut off %d bytes of a row that was being written when the job "
                        "stopped (line %d); it is written again", self.path, size - offset, lineno + 1)
            os.ftruncate(self._fd, offset)
            os.fsync(self._fd)
        if k:
            log.info("%s: %d of %d prompts already done; resuming", self.path, k, len(self._prompts))
        return k

    def _check_row(self, rid: str, k: int, index: dict, where: str) -> None:
        fix = "was it made from another prompt file? Write to a new output, or move this one aside"
        if rid not in index:
            raise InputError(where, f"row id {rid!r} is not in the prompt file", fix)
        i = index[rid]
        if i < k:
            raise InputError(where, f"row id {rid!r} appears twice (it is row {i + 1} too)", fix)
        if i != k:
            raise InputError(where, f"row {k + 1} is id {rid!r}, but prompt {k + 1} is "
                             f"{self._prompts[k].id!r}: rows must follow the prompt order", fix)

    # -- writing -------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Rows complete but held back behind an earlier prompt (lost if the process dies)."""
        return len(self._held)

    def complete(self, index: int, row: dict) -> None:
        """Record prompt ``index``'s finished row; it is written once all earlier ones are."""
        if not 0 <= index < len(self._prompts):
            raise ValueError(f"prompt index {index} is not in [0, {len(self._prompts)})")
        if index < self._next or index in self._held:
            raise ValueError(f"prompt {index} ({self._prompts[index].id!r}) is complete already")
        pid = self._prompts[index].id
        if row.get("id", pid) != pid:
            raise ValueError(f"row id {row['id']!r} is not prompt {index}'s id {pid!r}")
        # allow_nan=False: a NaN in a row is a bug upstream, never something to write down
        line = json.dumps({"id": pid, **row}, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":"), default=_plain).encode("utf-8") + b"\n"
        self._held[index] = (pid, line)
        while self._next in self._held:
            self._ready.append(self._held.pop(self._next))
            self._next += 1
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Write the lines that are ready; fsync if ``sync_s`` has passed (always if ``force``).

        `complete` calls it; call it once per decode step too, so that rows written in a burst
        are fsynced within ``sync_s`` even when no more prompts finish for a while.
        """
        if self._fd is None:
            raise ValueError(f"journal {self.path} is closed")
        if self._ready:
            self._write(b"".join(line for _, line in self._ready))
            self.done.update(pid for pid, _ in self._ready)
            self._ready.clear()
            self._unsynced = True
        now = time.monotonic()
        if self._unsynced and (force or now - self._last_sync >= self.sync_s):
            try:
                os.fsync(self._fd)
            except OSError as e:
                raise self._fault(e) from None
            self._last_sync, self._unsynced = now, False

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # one write unless the kernel takes less (a signal, a full quota)
            try:
                n = os.write(self._fd, view)
            except InterruptedError:
                continue
            except OSError as e:
                raise self._fault(e) from None
            view = view[n:]

    def _fault(self, e: OSError) -> RankFault:
        return RankFault(f"output {self.path}", f"writing the completions failed: {e.strerror}",
                         "free disk space or quota, then rerun the same command to resume")

    def close(self) -> None:
        """Write and fsync everything ready; rows still held back are dropped (recomputed on resume)."""
        if self._fd is None:
            return
        try:
            self.flush(force=True)
        finally:
            if self._held:
                log.info("%s: %d complete rows wait for an earlier prompt and are not written; "
                         "a resumed run computes them again", self.path, len(self._held))
            os.close(self._fd)  # also releases the lock
            self._fd = None

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Journal({str(self.path)!r}, done={len(self.done)}/{len(self._prompts)}, "
                f"held={len(self._held)})")


def _plain(obj):
    """numpy scalars and arrays as JSON numbers and lists (a row's tokens often are numpy)."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"a {type(obj).__name__} cannot go into a JSON row")


def _lines(f) -> Iterable[bytes]:
    """The file's lines with their newlines; a line longer than MAX_ROW_BYTES comes in pieces
    (each piece then fails to parse, as a row of ours cannot be that long)."""
    while True:
        line = f.readline(MAX_ROW_BYTES)
        if not line:
            return
        yield line


def _row_id(line: bytes) -> str | None:
    """The id of a whole row line, or None for a torn or foreign line."""
    if not line.endswith(b"\n") or len(line) >= MAX_ROW_BYTES:
        return None
    try:
        obj = json.loads(line)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else None


def _torn(tail: bytes, size: int) -> bool:
    """Is ``tail`` (the end of the file after the last whole row) what a crash leaves?

    A write cut short leaves the start of one of our rows, which always begin ``{"id":"``, and
    no newline; a power loss may leave zeros where unsynced data was to go. Anything else is
    somebody's data, and is refused rather than cut.
    """
    if size != len(tail):  # longer than any row
        return False
    if not tail.strip(b"\0"):
        return True
    n = min(len(tail), len(_ROW_START))
    return b"\n" not in tail and tail[:n] == _ROW_START[:n]


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory: nothing more to do
        pass
    finally:
        os.close(fd)
