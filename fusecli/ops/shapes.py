"""The input-shape checks the op folders define (``fusecli/ops/<op>/shapes.py``) and the two
helpers they share.

An op folder whose op cannot run on every input shape its rules may bind writes
``input_problem(attrs, ins) -> str | None`` in its ``shapes.py``: ``ins`` are the fused node's
input shapes in port order (a dim is an int, a symbolic str or None; a shape None when unknown),
``attrs`` its attributes; it returns why the op could not run on them, or None (fine or
unknown). The shape guard (``fusecli.engine.shapes.fusion_problem``) calls it before a fusion.
An op that reads a loss's labels writes ``label_classes(k, ins) -> int | None`` there too: the
class count when input k holds labels (from the input shapes), for the feeds a benchmark
generates (``fusecli.runtime.feeds``: a fused graph has no logits left to read it from).
"""

from __future__ import annotations

import functools
import importlib
import math

from fusecli.ops.contracts import OPS_DIR, load_contracts


def numel(dims):
    """The element count of a shape, None unless every dim is a known int."""
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    return math.prod(dims)


def show(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


@functools.cache
def _folder_shapes(op_type: str):
    """A fused op type's ``fusecli.ops.<folder>.shapes`` module, None when it has none."""
    c = load_contracts().ops.get(op_type)
    if c is None or not (OPS_DIR / c.folder / "shapes.py").exists():
        return None
    return importlib.import_module(f"fusecli.ops.{c.folder}.shapes")


def input_check(op_type: str):
    """The op folder's ``shapes.input_problem`` of a fused op type, None when it has none."""
    mod = _folder_shapes(op_type)
    return mod.input_problem if mod is not None else None


def label_classes_hook(op_type: str):
    """The op folder's ``shapes.label_classes`` of a fused op type, None when it has none."""
    return getattr(_folder_shapes(op_type), "label_classes", None)
