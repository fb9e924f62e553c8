"""fusecli: fuse backward chains of ONNX training graphs into custom ops, from YAML rules.

Public API (``fusecli/api.py``; README "Python API")::

    import fusecli
    result = fusecli.optimize("training_model.onnx")       # load, check, fuse (shipped rules)
    print(result.fused, result.skipped, result.bytes_removed)
    fusecli.save(result, "training_model.fused.onnx")      # transactional, external data too
    report = fusecli.verify("training_model.onnx", "training_model.fused.onnx")

Lower level: ``fusecli.FusionPass(rules=None).run(model)`` rewrites a ModelProto in place.
Names are imported on first use, so ``import fusecli`` (and ``fusecli --version``) stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily, PEP 562)
_EXPORTS = {
    "optimize": "fusecli.api", "verify": "fusecli.api", "save": "fusecli.api",
    "load": "fusecli.api", "stats": "fusecli.api", "explain": "fusecli.api",
    "Result": "fusecli.api", "FusionPass": "fusecli.api",
    "fusion_pass": "fusecli.api", "regressions": "fusecli.api",
    "load_rules": "fusecli.io.rulefiles", "write_report": "fusecli.report",
    "CANONICAL_PATTERNS": "fusecli.engine.rules", "Rule": "fusecli.engine.rules",
    "Stats": "fusecli.engine.fusion",
    "FuseError": "fusecli.errors", "ModelError": "fusecli.errors",
    "RuleError": "fusecli.errors", "CheckFailed": "fusecli.errors",
}


def library_path() -> str:
    """Absolute path of fusecli's onnxruntime custom-op library (build it with `make lib`)."""
    from fusecli.runtime.library import library_path as _lp

    return _lp()


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fusecli' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = ["CANONICAL_PATTERNS", "CheckFailed", "FuseError", "FusionPass", "ModelError", "Result",
           "Rule", "RuleError", "Stats", "__version__", "explain", "fusion_pass", "library_path",
           "load", "load_rules", "optimize", "regressions", "save", "stats", "verify",
           "write_report"]
