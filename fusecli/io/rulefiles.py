"""Rule files and folders: read (bounded, fusecli.io.userfiles) and parsed
(fusecli.engine.rules) into rules in application order."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

from fusecli.engine.rules import Rule, parse_rules
from fusecli.errors import RuleError
from fusecli.io.userfiles import os_reason, read_text

# the shipped rules: package data (in a checkout, fusecli/shipped_rules links to rules/)
DEFAULT_RULES_DIR = Path(str(files("fusecli") / "shipped_rules"))


def _rule_files(path: Path) -> list[Path]:
    try:
        if path.is_dir():
            return sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
    except OSError as exc:
        raise RuleError(str(path), f"cannot list the folder: {os_reason(exc)}") from None
    return [path]


def load_rules(paths=None) -> list[Rule]:
    """Load and validate rules from files or folders (default: the shipped ``rules/``).

    Rules come back in application order: ascending ``order``, then name.
    """
    shipped = paths is None or (isinstance(paths, (list, tuple)) and not paths)
    if shipped:
        paths = [DEFAULT_RULES_DIR]
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for p in map(Path, paths):
        if not os.path.lexists(p):
            raise RuleError(str(p), "no such rule file or folder")
        for f in _rule_files(p):
            text = read_text(f, lambda msg, f=f: RuleError(str(f), msg))
            for rule in parse_rules(text, str(f), shipped):
                if rule.name in seen:
                    raise RuleError(str(f), f"rule name '{rule.name}' is also used by "
                                    f"{seen[rule.name]}")
                seen[rule.name] = str(f)
                rules.append(rule)
    return sorted(rules, key=lambda r: (r.order, r.name))
