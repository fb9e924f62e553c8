"""CI mode: expectations (minimum fused counts) and baselines (a previous --json report)."""

from __future__ import annotations

from pathlib import Path

import yaml

from fusecli.errors import FuseError
from fusecli.engine.safeyaml import YAML_ERRORS, SafeBoundedLoader, load_json, yaml_problem
from fusecli.io.userfiles import read_text


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def load_expectations(path: str | Path) -> dict[str, int]:
    p = Path(path)
    text = read_text(p, lambda msg: FuseError(f"--expect: {p}: {msg}"))
    try:
        data = yaml.load(text, Loader=SafeBoundedLoader)  # noqa: S506 - JSON is YAML
    except YAML_ERRORS as exc:
        raise FuseError(f"--expect: {p} is not YAML/JSON: {yaml_problem(exc)[0]}") from None
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and _is_count(v) for k, v in data.items()):
        raise FuseError(f"--expect: {p} must be a flat mapping of pattern or rule name to a "
                        "minimum fused count, e.g. 'linear_relu: 2'")
    return data


def load_baseline(path: str | Path) -> dict:
    p = Path(path)
    text = read_text(p, lambda msg: FuseError(f"--baseline: {p}: {msg}"))
    hint = "pass a report written by `fusecli optimize --json`"
    try:
        data = load_json(text)
    except ValueError as exc:
        raise FuseError(f"--baseline: {p} is not JSON ({exc}); {hint}") from None
    if not isinstance(data, dict) or "patterns" not in data:
        raise FuseError(f"--baseline: {p} has no 'patterns'; {hint}")
    for section in ("patterns", "rules"):
        entries = data.get(section) or {}
        if not isinstance(entries, dict):
            raise FuseError(f"--baseline: {p}: '{section}' must be a mapping of name to "
                            f"{{\"fused\": COUNT}}; {hint}")
        for name, entry in entries.items():
            if not (isinstance(entry, dict) and _is_count(entry.get("fused", 0))):
                raise FuseError(f"--baseline: {p}: {section}.{name} must be a mapping with a "
                                f"non-negative integer 'fused'; {hint}")
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
                was = entry.get("fused", 0)
                now = report[section].get(name, {}).get("fused", 0)
                if now < was:
                    problems.append(f"{name}: fused {now}, baseline had {was}")
    return problems
