"""CI mode: expectations (minimum fused counts) and baselines (a previous --json report)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from .errors import FuseError


def load_expectations(path: str | Path) -> dict[str, int]:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())  # JSON is YAML
    except FileNotFoundError:
        raise FuseError(f"--expect: no such file: {p}") from None
    except yaml.YAMLError as exc:
        raise FuseError(f"--expect: {p} is not YAML/JSON: "
                        f"{str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in data.items()):
        raise FuseError(f"--expect: {p} must be a flat mapping of pattern or rule name to a "
                        "minimum fused count, e.g. 'linear_relu: 2'")
    return data


def load_baseline(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise FuseError(f"--baseline: no such file: {p}") from None
    except json.JSONDecodeError as exc:
        raise FuseError(f"--baseline: {p} is not JSON ({exc.msg} at line {exc.lineno}); pass "
                        "a report written by `fusecli optimize --json`") from None
    if not isinstance(data, dict) or "patterns" not in data:
        raise FuseError(f"--baseline: {p} has no 'patterns'; pass a report written by "
                        "`fusecli optimize --json`")
    return data


def check_expectations(report: dict, expect: dict[str, int], baseline: dict | None) -> list[str]:
    """One line per regression (empty when every expectation holds)."""
    fused = {k: v["fused"] for k, v in report["patterns"].items()}
    fused.update({k: v["fused"] for k, v in report["rules"].items()})
    problems = []
    for name, want in expect.items():
        if name not in fused:
            problems.append(f"{name}: no pattern or rule of that name (expected >= {want})")
        elif fused[name] < want:
            problems.append(f"{name}: fused {fused[name]}, expected at least {want}")
    if baseline is not None:
        for section in ("patterns", "rules"):
            for name, entry in (baseline.get(section) or {}).items():
                was = entry.get("fused", 0) if isinstance(entry, dict) else 0
                now = report[section].get(name, {}).get("fused", 0)
                if now < was:
                    problems.append(f"{name}: fused {now}, baseline had {was}")
    return problems
