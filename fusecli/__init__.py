"""fusecli: fuse backward chains of ONNX training graphs into custom ops, from YAML rules.

Public API::

    import onnx, fusecli
    model = onnx.load("training_model.onnx")
    fp = fusecli.FusionPass()            # the shipped rules; or rules=[path, ...]
    n = fp.run(model)                    # rewrites in place, returns the number of fused nodes
    print(fp.stats.as_dict())
"""

from __future__ import annotations

from .errors import FuseError, ModelError, RuleError
from .fusion import FusionPass, Stats, run_fusion_pass
from .rules import CANONICAL_PATTERNS, Rule, load_rules

__version__ = "0.1.0"


def library_path() -> str:
    """Absolute path of fusecli's onnxruntime custom-op library (build it with `make lib`)."""
    from .library import library_path as _lp

    return _lp()


__all__ = ["CANONICAL_PATTERNS", "FuseError", "FusionPass", "ModelError", "Rule", "RuleError",
           "Stats", "library_path", "load_rules", "run_fusion_pass", "__version__"]
