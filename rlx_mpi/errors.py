"""One error hierarchy, one exit code per kind of failure.

Every user-facing failure is an `RlxError` carrying where it happened, what is wrong and how
to fix it; the CLI prints it as one line ``rlx-mpi: error: <where>: <what>; <fix>``.

Exit codes (documented in the README):

====  ==========================================================
0     success
1     internal error (a bug in rlx_mpi: please report it)
2     bad input: command line, job TOML, checkpoint, input ids
3     the model does not fit the ranks' memory
4     runtime fault: an exception or a dead rank during the run
5     deadline expired: a rank waited longer than ``timeout_s``
====  ==========================================================

A rank killed by a signal (kill -9, the OOM killer) is still named on stderr, but the job's
exit code is then the launcher's choice: MPICH's mpiexec reports the signal (9).
"""

from __future__ import annotations

__all__ = [
    "RlxError",
    "ConfigError",
    "CheckpointError",
    "InputError",
    "FitError",
    "RankFault",
    "DeadlineExpired",
    "WriteFailed",
    "EXIT_OK",
    "EXIT_INTERNAL",
    "EXIT_BAD_INPUT",
    "EXIT_NO_FIT",
    "EXIT_FAULT",
    "EXIT_TIMEOUT",
    "clip",
    "json_type",
]

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_NO_FIT = 3
EXIT_FAULT = 4
EXIT_TIMEOUT = 5


class RlxError(Exception):
    """A failure the user can act on: where, what is wrong, how to fix it."""

    exit_code = EXIT_INTERNAL

    def __init__(self, where: str, what: str, fix: str | None = None):
        self.where, self.what, self.fix = where, what, fix
        super().__init__(self.line())

    def line(self) -> str:
        """The one-line message, without the ``rlx-mpi: error:`` prefix."""
        text = f"{self.where}: {self.what}"
        return f"{text}; {self.fix}" if self.fix else text


class ConfigError(RlxError):
    """The job TOML or the command line is wrong."""

    exit_code = EXIT_BAD_INPUT


class CheckpointError(RlxError):
    """The checkpoint is missing, unreadable or disagrees with its own config."""

    exit_code = EXIT_BAD_INPUT


class InputError(RlxError):
    """The input ids are unusable (dtype, shape, range, length)."""

    exit_code = EXIT_BAD_INPUT


class FitError(RlxError):
    """The model does not fit the memory of the ranks it was given."""

    exit_code = EXIT_NO_FIT


class RankFault(RlxError):
    """A rank raised or died during the run."""

    exit_code = EXIT_FAULT


class DeadlineExpired(RlxError):
    """A blocking wait passed its deadline: some rank is stuck or gone."""

    exit_code = EXIT_TIMEOUT


class WriteFailed(RlxError):
    """Writing a result failed after the work was done (a full disk, a quota, an I/O error)."""

    exit_code = EXIT_FAULT


# How a bad value is shown inside a message (prompt, request and config files alike).

def json_type(value) -> str:
    """The JSON name of a parsed value's type ("integer", "list", "null", ...)."""
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def clip(text: str, n: int = 60) -> str:
    """``text`` cut to ``n`` characters (a long line must not fill the one error line)."""
    return text if len(text) <= n else text[:n] + "..."
