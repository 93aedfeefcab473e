"""Per-rank logs (``--log-dir DIR``): one file per rank, rank 0 alone on the terminal.

Note: under srun or mpiexec every rank's stderr is merged into one stream, interleaved and
unattributed; with hundreds of ranks a warning per rank drowns the one line that matters. With
``--log-dir`` every rank writes ``DIR/rank-0003.log`` (appended to, so a requeued job keeps
its earlier attempts), each line prefixed with the rank and host, and what a rank writes to
stderr (a fault report) goes to its log too; the terminal gets rank 0's log lines and the error
lines that end the job.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import TextIO

__all__ = ["log_path", "job_id", "setup_rank_logging", "setup_logging"]


def log_path(log_dir: str | os.PathLike, rank: int) -> Path:
    return Path(log_dir) / f"rank-{rank:04d}.log"


def job_id() -> str | None:
    """The Slurm job id (with the array task when there is one), or None outside Slurm."""
    jid = os.environ.get("SLURM_JOB_ID")
    if jid and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ.get('SLURM_ARRAY_JOB_ID', jid)}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return jid or None


class _Tee:
    """stderr that also goes, line-prefixed, to the rank's log file."""

    def __init__(self, terminal: TextIO, log: TextIO, prefix: str):
        self._terminal, self._log, self._prefix, self._at_line_start = terminal, log, prefix, True

    def write(self, text: str) -> int:
        self._terminal.write(text)
        out = []
        for piece in text.splitlines(keepends=True):
            out.append((self._prefix if self._at_line_start else "") + piece)
            self._at_line_start = piece.endswith("\n")
        try:
            self._log.write("".join(out))
            self._log.flush()
        except (OSError, ValueError):  # a full or closed disk must not hide the error on the terminal
            pass
        return len(text)

    def flush(self) -> None:
        self._terminal.flush()

    def fileno(self) -> int:
        return self._terminal.fileno()

    def isatty(self) -> bool:
        return self._terminal.isatty()

    def __getattr__(self, name):
        return getattr(self._terminal, name)


def setup_rank_logging(rank: int, size: int, debug: bool, log_dir: str | os.PathLike | None,
                       command: str = "") -> None:
    """Terminal logging as before (rank 0 at INFO, others at WARNING); with ``log_dir`` every rank
    also logs to its own file at INFO (DEBUG with --debug) and only rank 0 logs to the terminal.

    Raises OSError when the folder cannot be made or the file opened (the caller agrees on it).
    """
    host = socket.gethostname()
    level = logging.DEBUG if debug else logging.INFO
    terminal_level = logging.DEBUG if debug else (logging.INFO if rank == 0 else logging.WARNING)
    prefix = "rlx-mpi: " if rank == 0 else f"rlx-mpi [rank {rank}]: "
    root = logging.getLogger()
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setFormatter(logging.Formatter(prefix + "%(message)s"))
    terminal.setLevel(terminal_level)
    if log_dir is None:
        root.addHandler(terminal)
        root.setLevel(terminal_level)
        return
    folder = Path(log_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stream = open(log_path(folder, rank), "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives as long as the process)
    where = f"rank {rank} {host}"
    file_handler = logging.StreamHandler(stream)
    file_handler.setFormatter(logging.Formatter(f"%(asctime)s [{where}] %(levelname)s %(message)s"))
    file_handler.setLevel(level)
    root.addHandler(file_handler)
    if rank == 0:
        root.addHandler(terminal)
    root.setLevel(level)
    sys.stderr = _Tee(sys.stderr, stream, f"[{where}] stderr: ")
    jid = job_id()
    step = os.environ.get("SLURM_STEP_ID")
    slurm = f", slurm job {jid}" + (f" step {step}" if step else "") if jid else ""
    logging.getLogger("rlx_mpi").info("%s: rank %d of %d on %s, pid %d%s", command, rank, size, host, os.getpid(), slurm)


def setup_logging(world, debug: bool, log_dir: str | os.PathLike | None = None, command: str = "",
                  timeout_s: float = 60.0) -> None:
    """Logging of an MPI command on every rank of ``world``: rank 0 on the terminal at INFO, the
    others at WARNING; with ``log_dir`` one log per rank (`setup_rank_logging`), agreed so a
    folder some rank cannot write fails every rank with one line."""
    if log_dir is None:
        level = logging.DEBUG if debug else (logging.INFO if world.rank == 0 else logging.WARNING)
        prefix = "rlx-mpi: " if world.rank == 0 else f"rlx-mpi [rank {world.rank}]: "
        logging.basicConfig(level=level, format=prefix + "%(message)s", stream=sys.stderr)
        return
    from ..errors import ConfigError
    from .faults import RankContext, agree

    def setup() -> None:
        try:
            setup_rank_logging(world.rank, world.size, debug, log_dir, command)
        except OSError as e:
            raise ConfigError(f"--log-dir {log_dir}", f"cannot write a log there ({e.strerror})",
                              "give a folder every rank can write (on a filesystem every node mounts)") from None

    agree(world, RankContext(world.rank, world.size, host=socket.gethostname(), debug=debug), timeout_s, setup)
