"""The NumPy references of every fused op, as ``onnx.reference`` op classes.

Each op folder's ``reference.py`` holds its math (float64, cast back to the input dtype) and a
``Reference`` adapter class; ``reference_ops()`` names them after their ops for
``onnx.reference.ReferenceEvaluator(model, new_ops=reference_ops())``.
"""

from __future__ import annotations

import numpy as np


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


def _fit(op, res):
    # a node lists only the outputs it needs; an absent ("") output gets a placeholder
    res = tuple(res)[:len(op.output)]
    return tuple(np.empty(0, np.float32) if r is None else r for r in res)


def reference_ops() -> list:
    """Op classes for ``onnx.reference.ReferenceEvaluator(model, new_ops=reference_ops())``."""
    import importlib

    from fusecli.ops.contracts import load_contracts

    contracts = load_contracts()
    out = []
    for c in contracts.ops.values():
        base = importlib.import_module(f"fusecli.ops.{c.folder}.reference").Reference
        out.append(type(c.name, (base,), {"op_domain": contracts.domain}))
    return out
