"""Option types shared by the CLI commands: values are bounded where they are parsed, before
anything is allocated or started (click reports a bad value as one line, exit 2)."""

from __future__ import annotations

import math
from pathlib import Path

import click


class _Tolerance(click.ParamType):
    name = "float"

    def convert(self, value, param, ctx):
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not (0.0 <= v < math.inf):         # NaN fails this too
            self.fail(f"{value!r} is not a finite number >= 0", param, ctx)
        return v


class _Size(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):
        from fusecli.engine.recompute import parse_size
        from fusecli.errors import FuseError

        try:
            return parse_size(value)
        except FuseError as exc:
            self.fail(str(exc).split(": ", 1)[-1], param, ctx)


TOLERANCE = _Tolerance()
SIZE = _Size()
SEED = click.IntRange(0, 2**32 - 1)       # what NumPy's generators accept
RUNTIME_PYTHON = click.Path(exists=True, dir_okay=False, executable=True, path_type=Path)

RULES = click.option("--rules", "rules", multiple=True, type=click.Path(path_type=Path),
                     help="Rule file or folder (repeatable). Default: the shipped rules.")
JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
FEEDS = click.option("--feeds", "feeds_file", type=click.Path(path_type=Path),
                     help="NumPy .npz of arrays keyed by graph input name; the inputs it "
                          "lacks are generated from the graph (docs/usage.md: verify).")
PROVIDER = click.option(
    "--provider", type=click.Choice(["any", "cpu", "cuda"]), default="any", show_default=True,
    help="Fuse only where fusecli's library has a kernel for this execution provider.")
ONLY = click.option("--only", multiple=True, help="Apply only this pattern or rule (repeatable).")
SKIP = click.option("--skip", multiple=True, help="Do not apply this pattern or rule (repeatable).")
DIMS = click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
                    help="Symbolic dimension NAME=VALUE (repeatable).")
