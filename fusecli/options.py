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


TOLERANCE = _Tolerance()
SEED = click.IntRange(0, 2**32 - 1)       # what NumPy's generators accept
RUNTIME_PYTHON = click.Path(exists=True, dir_okay=False, executable=True, path_type=Path)
