"""Reading the small text files a user hands fusecli (rules, --expect, --baseline), bounded.

Only regular files are opened (a FIFO, a device such as /dev/zero or a folder is refused
without blocking or reading it), at most ``MAX_TEXT_BYTES`` are read, a YAML document may stand
for at most ``MAX_NODES`` values with its aliases expanded (an alias bomb of a few hundred bytes
would otherwise expand to gigabytes) and YAML/JSON nesting is capped at ``MAX_DEPTH`` levels.
Every problem is one line raised through the caller's ``error`` factory (exit 2).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import yaml

MAX_TEXT_BYTES = 1 << 20       # rule, expectation and baseline files are a few KB
MAX_DEPTH = 64
MAX_NODES = 100_000            # YAML values, aliases expanded

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


class BoundedComposer:
    """Mixin for a yaml Loader: nesting is capped at MAX_DEPTH, and the document may stand for at
    most MAX_NODES values with every alias (*name) expanded (a few hundred bytes of nested
    aliases would otherwise stand for billions); an alias to a node that contains it is refused.
    """

    _depth = 0

    def compose_node(self, parent, index):
        if not hasattr(self, "_weights"):
            self._weights: dict[int, int] = {}
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark)
            alias = self.peek_event() if self.check_event(yaml.events.AliasEvent) else None
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if id(node) in self._weights:
            return node
        if alias is not None:
            raise yaml.composer.ComposerError(
                None, None, f"alias *{alias.anchor} refers to a value that contains it",
                alias.start_mark)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        weight = 1 + sum(self._weights[id(c)] for c in children)
        if weight > MAX_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"stands for more than {MAX_NODES} values once its aliases (*name) "
                "are expanded; write it out without aliases", node.start_mark)
        self._weights[id(node)] = weight
        return node


class SafeBoundedLoader(BoundedComposer, yaml.SafeLoader):
    """yaml.SafeLoader with the bounds above."""


def yaml_problem(exc: Exception) -> tuple[str, int | None]:
    """(one-line problem, line number or None) of an error raised while loading YAML."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    return problem, (mark.line + 1 if mark is not None else None)


# Errors loading YAML can raise beyond yaml.YAMLError: a scalar int() or a date refuses
# (ValueError: e.g. more than 4300 digits, month 13), an overflow, or a deep recursion.
YAML_ERRORS = (yaml.YAMLError, ValueError, OverflowError, RecursionError)


def load_json(text: str) -> object:
    """json.loads with nesting capped at MAX_DEPTH; raises ValueError with a short message."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at line {exc.lineno}") from None
    except ValueError as exc:      # e.g. an integer of more than 4300 digits
        raise ValueError(str(exc).splitlines()[0]) from None
    stack = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(obj, dict):
            stack.extend((v, depth + 1) for v in obj.values())
        elif isinstance(obj, list):
            stack.extend((v, depth + 1) for v in obj)
    return data
