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

Note: what made the rows. A journal opened with a `identity.RunIdentity` keeps the sidecar
``<out>.meta.json`` (`identity.meta_bytes`) and ends every row with its `identity.ROW_IDENTITY`
digest; opening a file that already holds rows compares them with this run's and refuses, in one
line naming the setting, a resume made another way (`identity.py` says what is recorded, why).

Note: no leftovers, no torn lines. A new output file is created at the first row (with its
sidecar just before), so a job that fails before it (a plan that does not fit, a bad flag)
leaves no empty file behind. A write that fails part-way (a full disk, a quota) is cut back to
the last line it wrote whole before the error is raised, so a reader never sees half a row and
no row that reached the file is lost; only a
``kill -9`` inside a write can leave one, and the next open repairs it.

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
from typing import Any, Iterable, Sequence

from ..errors import InputError, RankFault
from .identity import META_FORMAT, ROW_IDENTITY, RunIdentity, digest_of, meta_bytes, meta_path
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
    ids whose rows are in the file (it grows as rows are written). ``settle``: the identity's
    settings known only once the job is placed (`identity.layout_settings`) are given to `settle`, which
    then decides whether the rows already there may be resumed; nothing is written before it.
    ``adopt``: rows with no identity at all (an older rlx-mpi's file) are taken as this run's.
    """

    def __init__(self, path, prompts: Sequence[Prompt], *, inputs: Iterable = (), sync_s: float = 2.0,
                 identity: RunIdentity | None = None, shard: dict | None = None, settle: bool = False,
                 adopt: bool = False):
        if sync_s < 0:
            raise ValueError(f"sync_s must be >= 0, got {sync_s}")
        self.path = Path(path)
        self.meta = meta_path(self.path)
        self.sync_s = sync_s
        self.identity = identity
        self.shard = shard  # `shards.select`'s record of which part of the prompt file this is (--shard)
        self._prompts = list(prompts)
        if [p.index for p in self._prompts] != list(range(len(self._prompts))) or \
                len({p.id for p in self._prompts}) != len(self._prompts):
            raise ValueError("prompts must be read_prompts' list: indices 0..n-1, unique ids")
        self._check_path(inputs)
        self._closed, self._created = False, False
        # A new file is created at the first row (no empty leftover when the job fails before it)
        self._fd: int | None = self._open() if self.path.exists() else None
        self.adopt, self._adopted = adopt, 0
        self._row_ids: list[str | None] = []  # the identity digest of each row already there (None: none)
        try:
            if self._fd is not None and identity is not None:
                self._check_shard()
            k = self._recover() if self._fd is not None else 0
            self._unsettled = settle
            if not settle:
                self._decide(k)
        except BaseException:
            if self._fd is not None:
                os.close(self._fd)
            raise
        self._meta_due = identity is not None  # (re)written before the first row of this run
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
        a device or pipe, its folder writable, never an input), for the completions file and its
        sidecar record (replaced too: never onto an input), as this module's `InputError`."""
        from ..errors import ConfigError
        from ..outputs import check_output

        named = {f"the input file {p}": p for p in inputs if p is not None}
        try:
            check_output("output", self.path, named, stream_ok=False)
            check_output(f"output {self.path}: its record", self.meta, named, stream_ok=False)
        except ConfigError as e:
            raise InputError(e.where, e.what, e.fix) from None

    def _open(self, create: bool = False) -> int:
        where = f"output {self.path}"
        created = create
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0),
                         0o666)
        except FileExistsError:
            raise InputError(where, "the file appeared while this job ran (another job writing it?); its "
                             "rows were not made by this run", "write to another file, or rerun to resume "
                             "from what it holds") from None
        except FileNotFoundError:
            raise InputError(where, "the file disappeared while this job started", "rerun the job") from None
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
            fs = _filesystem(self.path)
            if fs not in _WARNED_NO_LOCK:
                _WARNED_NO_LOCK.add(fs)
                log.info("%s: the file system (%s) gives no file lock (%s), so nothing stops two jobs writing "
                         "this output at once; run one job per output file (Lustre: mount with -o flock, or "
                         "write the output to a local or NFS folder)", self.path, fs, e.strerror)


    def _recover(self) -> int:
        """Check the rows already in the file, cut a torn tail; return how many rows are good."""
        index = {p.id: p.index for p in self._prompts}
        k, offset, lineno = 0, 0, 0  # good rows, byte offset after them, their last line
        with open(self.path, "rb") as f:
            for line in _lines(f):
                rid, made_by = _row_fields(line)
                if rid is None:
                    break
                lineno += 1
                self._check_row(rid, k, index, f"{self.path}:{lineno}")
                self._row_ids.append(made_by)
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
        return k

    def settle(self, **settings: Any) -> None:
        """Add the settings known once the job is placed to the identity (`identity.layout_settings`), then
        decide on the rows already there (`Journal` with ``settle=True``); rank 0, before any compute."""
        if not self._unsettled:
            raise ValueError(f"journal {self.path} was not opened with settle=True, or is settled already")
        if self.identity is not None:
            self.identity = self.identity.with_settings(**settings)
        self._unsettled = False
        self._decide(len(self.done))

    def check_done(self, **settings: Any) -> None:
        """A file whose every prompt is done: nothing will be written, but saying "all done" to a
        run made another way would pass its rows off as this run's. Compare what is known without
        a plan (``settings``: `unplaced_settings`) with the record; without a record, nothing to say."""
        if not self._unsettled or self.identity is None or self.pending:
            raise ValueError(f"journal {self.path}: check_done is for an unsettled journal with every prompt done")
        where = f"output {self.path}"
        meta = self._read_meta(where, "choose another --out")
        if meta is None:
            return
        for p in self._prompts:
            was, now = meta["prompts"].get(p.id), digest_of(p)
            if was != now:
                raise InputError(where, f"holds every prompt's row already, but prompt {p.id!r} (prompt "
                                 f"{p.index + 1} of the prompt file) has other tokens or settings than when its row "
                                 f"was written (digest {was} then, {now} now)",
                                 f"choose another --out (or remove {self.path} and {self.meta})")
        theirs = RunIdentity.from_json(meta).fields()
        mine = self.identity.with_settings(**settings).fields()
        for name, b in mine.items():
            a = theirs.get(name, b)  # (an older record's missing setting: not a difference here)
            if a != b:
                raise InputError(where, f"holds every prompt's row already, made with {name} {_show(a)}; this run has "
                                 f"{name} {_show(b)}", "to make the rows again this way, choose another --out (or "
                                 f"remove {self.path} and {self.meta})")

    def _decide(self, k: int) -> None:
        """May this run append to the ``k`` rows in the file? Said (resuming) only once decided."""
        if self.identity is not None and k:
            self._check_identity(k)
        if k:
            log.info("%s: %d of %d prompts already done; resuming", self.path, k, len(self._prompts))

    def _check_identity(self, k: int) -> None:
        """The ``k`` rows in the file were made as this run makes them, or one line says what differs.

        The record (``<out>.meta.json``) names the setting that differs; without it, each row's
        own identity digest says whether this run makes it, and rows with none (an older
        rlx-mpi's) are resumed only when adopted (``--adopt-output``)."""
        where = f"output {self.path}"
        fresh = f"to start afresh remove {self.path} and {self.meta}, or choose another --out"
        meta = self._read_meta(where, fresh)
        if meta is None:  # the file alone: every row says what made it
            self._check_rows(k, 0, where, f"put its record {self.meta} back beside it (it names the setting that "
                             f"differs), or rerun with the settings the rows were made with; {fresh}")
            return
        old = RunIdentity.from_json(meta)
        digests = meta["prompts"]
        mine, theirs = self.identity.fields(), old.fields()
        for name in [*mine, *(n for n in theirs if n not in mine)]:
            a, b = theirs.get(name, "(not set)"), mine.get(name, "(not set)")
            if a == b:
                continue
            if name not in theirs and self.adopt:  # an older record, without this setting: adopted
                continue
            if name not in theirs:
                raise InputError(where, f"its record {self.meta} (an older rlx-mpi's) does not say which {name} its "
                                 f"{k} rows were made with; this run has {name} {_show(b)}",
                                 "add --adopt-output to take the rows as made with this run's settings; " + fresh)
            how = ("the checkpoint they were made with" if name.startswith("checkpoint ") else
                   f"its layers on hosts whose kernels run {_show(a)} (`rlx-mpi probe` shows each rank's)"
                   if name == "arithmetic" else f"{name} {_show(a)}")
            raise InputError(where, f"its {k} rows were made with {name} {_show(a)}, this run has {name} "
                             f"{_show(b)}", f"to resume, rerun with {how}; {fresh}")
        for p in self._prompts[:k]:
            was, now = digests.get(p.id), digest_of(p)
            if was != now:
                raise InputError(where, f"prompt {p.id!r} (prompt {p.index + 1} of the prompt file) has "
                                 f"other tokens or settings than when its row was written (digest {was} then, {now} now)",
                                 fresh)
        adopted = meta.get("adopted", 0)
        self._check_rows(k, adopted if isinstance(adopted, int) else 0, where, fresh)

    def _read_meta(self, where: str, fresh: str) -> dict | None:
        """The record beside the output, or None when there is none."""
        try:
            with open(self.meta, "rb") as f:
                meta = json.loads(f.read(1 << 30))
            if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or meta.get("version") != 1:
                raise ValueError("not our sidecar")
            RunIdentity.from_json(meta)
            if not isinstance(meta.get("prompts"), dict):
                raise ValueError("no prompt digests")
            return meta
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise InputError(where, f"{self.meta} is not a record rlx-mpi wrote ({e})", f"move it aside to resume "
                             f"from the rows alone (each says what made it); {fresh}") from None

    def _check_rows(self, k: int, adopted: int, where: str, fix: str) -> None:
        """Each of the first ``k`` rows carries this run's digest of its prompt, or none at all
        (the first ``adopted`` rows, or any with ``--adopt-output``); refused naming the first that does not."""
        bare = 0
        for i, (p, got) in enumerate(zip(self._prompts[:k], self._row_ids)):
            if got is None:
                if i >= adopted and not self.adopt:
                    raise InputError(where, f"has {k} rows but no record of how they were made ({self.meta} is "
                                     f"missing) and row {i + 1} ({p.id!r}) carries no identity (an older rlx-mpi's "
                                     "file)", "add --adopt-output to take its rows as made with this run's "
                                     f"settings; to start afresh move {self.path} aside, or choose another --out")
                bare = i + 1
                continue
            if got != self.identity.row_digest(digest_of(p)):
                raise InputError(where, f"row {i + 1} ({p.id!r}) was made with other settings, model or prompt than "
                                 f"this run's (its identity {got})", fix)
        self._adopted = max(bare, adopted)

    def _check_shard(self) -> None:
        """A ``--shard`` output resumes only as the same shard (and an unsharded one unsharded):
        said in one line before its rows are compared with another part's prompts."""
        try:
            with open(self.meta, "rb") as f:
                was = json.loads(f.read(1 << 30)).get("shard")
        except (OSError, ValueError, AttributeError):
            return  # no record, or not ours: `_check_identity` says so
        name = lambda s: f"shard {s['k']}/{s['n']}" if isinstance(s, dict) else "the whole prompt file"  # noqa: E731
        now = self.shard
        if (was and now and (was.get("k"), was.get("n")) != (now["k"], now["n"])) or bool(was) != bool(now):
            raise InputError(f"output {self.path}", f"holds {name(was)}, this run is {name(now)}",
                             "resume with the --shard it was made with, or write to another --out")

    def _write_meta(self) -> None:
        """Replace the sidecar (atomically): this run's identity and every prompt's digest."""
        data = meta_bytes(self.identity, {p.id: digest_of(p) for p in self._prompts}, self.shard, self._adopted)
        try:
            with open(self.meta, "rb") as f:
                if f.read(len(data) + 1) == data:
                    return
        except OSError:
            pass
        tmp = self.meta.with_name(f".{self.meta.name}.tmp{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.meta)
        except OSError as e:
            raise self._fault(e) from None
        finally:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        _fsync_dir(self.meta.parent)

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
        if self._unsettled:
            raise ValueError(f"journal {self.path} is not settled: call settle before writing rows")
        if self.identity is not None:  # last: what made the row, so that the file alone can resume
            row = {**row, ROW_IDENTITY: self.identity.row_digest(digest_of(self._prompts[index]))}
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
        if self._closed:
            raise ValueError(f"journal {self.path} is closed")
        if self._ready:
            if self._meta_due:  # the record of how the rows are made goes first
                self._write_meta()
                self._meta_due = False
            if self._fd is None:
                self._fd = self._open(create=True)
                self._created = True
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
        """Append whole lines; if the kernel fails part-way, cut the file back to the end of the
        last line it took whole (the rows before it are kept: a rerun does not recompute them)."""
        start = os.fstat(self._fd).st_size  # only we write it (the lock): the end of the last whole line
        view, written = memoryview(data), 0
        while written < len(data):  # one write unless the kernel takes less (a signal, a full quota)
            try:
                written += os.write(self._fd, view[written:])
            except InterruptedError:
                continue
            except OSError as e:
                self._cut_back(start + data.rfind(b"\n", 0, written) + 1)
                raise self._fault(e) from None

    def _cut_back(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
            if size == 0 and self._created:  # made by this run, for a row never written: no leftover
                for path in (self.path, self.meta):
                    path.unlink(missing_ok=True)
        except OSError as e:  # the next open cuts the torn line instead
            log.warning("%s: could not cut a partly written row off (%s)", self.path, e.strerror)

    def _fault(self, e: OSError) -> RankFault:
        return RankFault(f"output {self.path}", f"writing the completions failed: {e.strerror}",
                         "free disk space or quota, then rerun the same command to resume")

    def close(self) -> None:
        """Write and fsync everything ready; rows still held back are dropped (recomputed on resume)."""
        if self._closed:
            return
        try:
            self.flush(force=True)
        finally:
            if self._held:
                log.info("%s: %d complete rows wait for an earlier prompt and are not written; "
                         "a resumed run computes them again", self.path, len(self._held))
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)  # also releases the lock
                self._fd = None

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Journal({str(self.path)!r}, done={len(self.done)}/{len(self._prompts)}, "
                f"held={len(self._held)})")


def _show(value) -> str:
    return json.dumps(value) if isinstance(value, (str, list)) else repr(value)


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
    return _row_fields(line)[0]


def _row_fields(line: bytes) -> tuple[str | None, str | None]:
    """(id, `ROW_IDENTITY` digest) of a whole row line; (None, None) for a torn or foreign line,
    a None digest for a row of an older rlx-mpi."""
    if not line.endswith(b"\n") or len(line) >= MAX_ROW_BYTES:
        return None, None
    try:
        obj = json.loads(line)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        return None, None
    rid = obj.get("id") if isinstance(obj, dict) else None
    if not isinstance(rid, str):
        return None, None
    made_by = obj.get(ROW_IDENTITY)
    return rid, made_by if isinstance(made_by, str) else None


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


_WARNED_NO_LOCK: set[str] = set()  # one warning per file system and process


def _filesystem(path: Path) -> str:
    """``TYPE at MOUNTPOINT`` of the mount that holds ``path`` (from /proc/mounts), or "unknown"."""
    try:
        target = os.path.realpath(path.parent)
        best = ("", "unknown")
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]):
                    best = (mount, parts[2])
        return f"{best[1]} at {best[0]}" if best[0] else "unknown"
    except OSError:
        return "unknown"
