"""Output paths: checked before any compute, written so that no file is ever destroyed.

Note: the rules, for every command that writes (``run --out/--json``, ``convert``,
``init-model``, a preset checkpoint).
1. Checked before the work starts (`check_output`): the folder exists and a file can be
   created in it (a real create-and-delete, which also catches read-only mounts and root
   squash); the path is not a directory or block device; it is not any input of the command
   nor another output (same inode after following symlinks). Failures are bad input (exit 2).
2. A regular file (or a new path, or a symlink to one) is written to a temporary name in the
   same folder and renamed over the target when complete, so a half-written result never
   looks complete; a symlink is kept and its target replaced.
3. A character device or FIFO (``--json /dev/stdout``, a named pipe to another program) is
   written through, as a user expects; the bytes are produced in a private temporary file
   first (HDF5 needs to seek), then copied.
4. A full disk or quota, or any other write failure, is `WriteFailed` (exit 4) naming the
   path, with the temporary file removed.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from .errors import ConfigError, WriteFailed

__all__ = ["Output", "check_output", "check_outputs", "write_output", "same_file", "write_failed", "check_space"]

_SPACE_MARGIN = 1 << 20  # room for HDF5's metadata beyond the raw bytes


@dataclass(frozen=True)
class Output:
    """A checked output path: ``target`` is where the bytes go (symlinks followed)."""

    flag: str  # how the user named it: "--out", "convert OUT.h5"
    path: Path  # as given
    target: Path  # resolved
    stream: bool  # a character device or FIFO: written through, never renamed over
    fd: int | None = None  # /dev/stdout, /dev/fd/N: this process's descriptor N, written directly

    @property
    def where(self) -> str:
        return f"{self.flag} {self.path}"


def same_file(a: os.PathLike | str, b: os.PathLike | str) -> bool:
    """Do ``a`` and ``b`` name one file (after symlinks; same device and inode)?"""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_output(flag: str, path: str | os.PathLike, inputs: Mapping[str, os.PathLike | str | None] = {},
                 *, stream_ok: bool = True) -> Output:
    """Check one output path before any work; raise `ConfigError` (exit 2) naming it.

    ``inputs`` maps a description ("the job file") to each input path of the command;
    ``stream_ok`` is False where a regular file is needed (an HDF5 checkpoint).
    """
    where = f"{flag} {path}"
    if not str(path):
        raise ConfigError(flag, "empty output path", "give a file name")
    given = Path(path)
    target = Path(os.path.realpath(given))
    for what, src in inputs.items():
        if src is not None and (same_file(target, src) or Path(os.path.realpath(src)) == target):
            raise ConfigError(where, f"is {what} ({src}): it would be overwritten",
                              "write the result to another path; rlx-mpi never overwrites an input")
    fd = _own_fd(str(given))
    if fd is not None:
        try:
            os.fstat(fd)
        except OSError:
            raise ConfigError(where, f"file descriptor {fd} is not open", "choose another path") from None
        return Output(flag, given, target, stream=True, fd=fd)
    try:
        st = os.stat(given)  # follows symlinks, like the write will
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ConfigError(where, f"cannot inspect the output path ({os.strerror(e.errno or 0)})",
                          "choose another path") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(where, "is a directory", "give a file name inside it")
        # /dev/stdout redirected to a file resolves to that file: still the user's stream
        special = str(given).startswith(("/dev/", "/proc/"))
        if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode) or (special and stat.S_ISREG(st.st_mode)):
            if not stream_ok:
                raise ConfigError(where, "is a device or pipe, not a regular file",
                                  "an HDF5 checkpoint needs a regular file: give a file path")
            if not os.access(given, os.W_OK):
                raise ConfigError(where, "permission denied (cannot write to this device or pipe)",
                                  "choose another path")
            return Output(flag, given, target, stream=True)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(where, "is not a regular file (a block device or socket)", "give a file path")
    _check_folder(where, target.parent)
    return Output(flag, given, target, stream=False)


def check_outputs(outputs: Iterable[tuple[str, str | os.PathLike | None]],
                  inputs: Mapping[str, os.PathLike | str | None] = {}) -> list[Output]:
    """`check_output` for each given ``(flag, path)``, and no two regular outputs the same file."""
    checked: list[Output] = []
    for flag, path in outputs:
        if path is None:
            continue
        out = check_output(flag, path, inputs)
        for other in checked:
            if not out.stream and not other.stream and (out.target == other.target or same_file(out.target, other.target)):
                raise ConfigError(out.where, f"is also the {other.flag} output", "give the two outputs different paths")
        checked.append(out)
    return checked


def _own_fd(path: str) -> int | None:
    """N for /dev/stdout (1), /dev/stderr (2), /dev/fd/N, /proc/self/fd/N; None otherwise.

    Under a launcher, stdout is often a socket, which cannot be opened again by name."""
    named = {"/dev/stdout": 1, "/dev/stderr": 2}
    if path in named:
        return named[path]
    for prefix in ("/dev/fd/", "/proc/self/fd/"):
        if path.startswith(prefix) and path[len(prefix):].isdigit():
            return int(path[len(prefix):])
    return None


def _check_folder(where: str, folder: Path) -> None:
    if not folder.exists():
        raise ConfigError(where, f"folder {folder} does not exist", "create it or choose another path")
    if not folder.is_dir():
        raise ConfigError(where, f"{folder} is not a folder", "choose another path")
    probe = folder / f".rlx-mpi-check.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        reason = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
                  errno.EROFS: "read-only filesystem", errno.ENOSPC: "no space left on the device",
                  errno.EDQUOT: "disk quota exceeded"}.get(e.errno, os.strerror(e.errno or 0))
        raise ConfigError(where, f"cannot create a file in {folder} ({reason})",
                          "choose a writable folder") from None
    os.close(fd)
    os.unlink(probe)


def write_failed(where: str, e: BaseException) -> WriteFailed:
    """The `WriteFailed` for an OSError (or h5py's wrapping of one) while writing ``where``."""
    text = str(e)
    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "errno = 28" in text:
        what = "no space left on the device (or quota exceeded)"
    elif code is not None:
        what = f"write failed ({os.strerror(code)})"
    else:
        what = f"write failed ({text})"
    return WriteFailed(where, what, "free space or choose another folder; no partial file was left")


def _copy_to_fd(src, fd: int) -> None:
    import sys

    for stream in (sys.stdout, sys.stderr):  # keep our own buffered text before the result
        stream.flush()
    while chunk := src.read(1 << 20):
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view):]


def check_space(path: Path, nbytes: int, where: str) -> None:
    """Refuse to write ``nbytes`` more into ``path``'s folder when they would not fit.

    Note: HDF5 that meets a full disk mid-write floods stderr from destructors and can then
    crash (seen: a segfault in ``convert``); finding the full disk first, in Python, keeps
    it one line. A disk that fills between this check and the write is still caught below.
    """
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if st.f_blocks == 0:  # a filesystem that reports no size (some FUSE and pseudo filesystems): no verdict
        return
    if free < nbytes + _SPACE_MARGIN:
        raise WriteFailed(where, f"no space left on the device: {_mb(nbytes)} to write, {_mb(free)} free in "
                          f"{path.parent}", "free space or choose another folder; no partial file was left")


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def write_output(out: Output, write: Callable[[Path], None], nbytes: int = 0) -> None:
    """Write ``out`` with ``write(path)``, which creates a complete file at the path it is given
    (``nbytes``: about how large it will be, checked against the free space first)."""
    if out.stream:
        with tempfile.TemporaryDirectory(prefix="rlx-mpi-") as tmpdir:
            tmp = Path(tmpdir) / "out"
            try:
                write(tmp)
            except OSError as e:
                raise write_failed(f"{out.where} (temporary file {tmp})", e) from None
            try:
                with open(tmp, "rb") as src:
                    if out.fd is not None:
                        _copy_to_fd(src, out.fd)
                    else:
                        with open(out.path, "ab") as dst:
                            shutil.copyfileobj(src, dst)
            except OSError as e:
                raise write_failed(out.where, e) from None
        return
    tmp = out.target.with_name(f".{out.target.name}.tmp{os.getpid()}")
    check_space(tmp, nbytes, out.where)
    try:
        write(tmp)
        os.replace(tmp, out.target)
    except OSError as e:
        raise write_failed(out.where, e) from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError:
            pass
