"""Reading the small text files a user hands fusecli (rules, --expect, --baseline), bounded.

Only regular files are opened (a FIFO, a device such as /dev/zero or a folder is refused
without blocking or reading it) and at most ``MAX_TEXT_BYTES`` are read (parsing the text, with
its own bounds, is fusecli.engine.safeyaml). Every problem is one line raised through the caller's ``error`` factory (exit 2).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

MAX_TEXT_BYTES = 1 << 20       # rule, expectation and baseline files are a few KB

ErrorFactory = Callable[[str], Exception]

_REASONS = {
    errno.ENOENT: "no such file",
    errno.ELOOP: "symbolic link loop",
    errno.ENAMETOOLONG: "name too long for the file system",
    errno.EACCES: "permission denied",
    errno.ENOTDIR: "a part of the path is not a folder",
}


def os_reason(exc: OSError) -> str:
    """A short reason for an OSError, without the path (the caller names the file)."""
    return _REASONS.get(exc.errno, exc.strerror or str(exc))


def read_text(path: str | os.PathLike, error: ErrorFactory,
              limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes; else ``error(problem)``
    (the problem does not name the file: the caller does)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block
    except OSError as exc:
        raise error(f"cannot read it: {os_reason(exc)}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise error("is a folder; give a file")
        if not stat.S_ISREG(st.st_mode):
            raise error("is not a regular file (a FIFO, device or socket); give a file")
        if st.st_size > limit:
            raise error(f"is {st.st_size} bytes; such files are at most {limit} bytes")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, limit + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise error(f"cannot read it: {os_reason(exc)}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise error(f"grew past {limit} bytes while it was read")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
