"""Errors that reach the user as one line and a documented exit code."""

from __future__ import annotations

# Exit codes shared by every command (documented in docs/usage.md).
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_EXPECTATION = 3
EXIT_INTERNAL = 4
EXIT_INCONCLUSIVE = 5  # `verify` could not judge (see docs/usage.md, "Exit codes")


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: unwinds like Ctrl-C (temporary files are removed on the way)
    but is not a KeyboardInterrupt, so no library turns it into something else."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum


class FuseError(Exception):
    """A user-facing error: one line saying what is wrong and how to fix it."""

    exit_code = EXIT_BAD_INPUT


class RuleError(FuseError):
    """A rule file is malformed. The message names the file (and line where known)."""

    def __init__(self, source: str, message: str, line: int | None = None):
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {message}")
        self.source = source
        self.line = line


class ModelError(FuseError):
    """The model file cannot be used as given."""


class CheckFailed(FuseError):
    """A check found the fused model at fault (e.g. it does not run where the original does)."""

    exit_code = EXIT_CHECK_FAILED
