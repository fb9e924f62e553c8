"""Parsing the YAML and JSON text a user hands fusecli (rules, --expect, --baseline), bounded:
a YAML document may stand for at most ``MAX_NODES`` values with its aliases expanded (an
alias bomb of a few hundred bytes would otherwise expand to gigabytes) and YAML/JSON nesting
is capped at ``MAX_DEPTH`` levels. Reading the files is fusecli.io.userfiles' job."""

from __future__ import annotations

import json

import yaml

MAX_DEPTH = 64
MAX_NODES = 100_000            # YAML values, aliases expanded


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
