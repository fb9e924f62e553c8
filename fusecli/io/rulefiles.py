"""Rule files and folders: read (bounded, fusecli.io.userfiles) and parsed
(fusecli.engine.rules) into rules in application order.

The shipped rules, parsed, are cached on disk (``$FUSECLI_CACHE_DIR``, default
``$XDG_CACHE_HOME/fusecli`` or ``~/.cache/fusecli``; an empty value turns the cache off) under a
key of everything the parse depends on: the rule files' names and texts, the parser's source
(engine/rules.py, engine/safeyaml.py), the op contracts, and the versions of onnx, PyYAML
and Python. Parsing 477 rules is ~0.9 s of every run; reading the cache ~0.01 s. A cache
that cannot be read or written is ignored; one not owned by the user is not read.
"""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

from fusecli.engine.rules import Rule, parse_fragment, parse_rules, share_specs
from fusecli.errors import RuleError
from fusecli.io.userfiles import os_reason, read_text

# the shipped rules: package data (in a checkout, fusecli/shipped_rules links to rules/)
DEFAULT_RULES_DIR = Path(str(files("fusecli") / "shipped_rules"))
_PKG = Path(__file__).resolve().parents[1]
_CACHE_KEEP = 4  # cached rule sets kept (checkouts or versions used side by side)
_PARSER_SOURCES = ("engine/rules.py", "engine/safeyaml.py", "ops/contracts.py", "ops/domain.yaml")


def cache_dir() -> Path | None:
    """Where parsed shipped rules are cached; None when FUSECLI_CACHE_DIR is set empty."""
    env = os.environ.get("FUSECLI_CACHE_DIR")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusecli"


def _cache_key(texts: list[tuple[Path, str]]) -> str:
    import onnx
    import yaml

    h = hashlib.sha256(repr((onnx.__version__, yaml.__version__, sys.version)).encode())
    sources = [_PKG / s for s in _PARSER_SOURCES] + sorted((_PKG / "ops").glob("*/contract.yaml"))
    for path in sources:
        h.update(str(path.relative_to(_PKG)).encode() + b"\0" + path.read_bytes() + b"\0")
    for path, text in texts:
        h.update(str(path).encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:32]


def _owned(path: Path) -> bool:
    """The user's own file or folder, not writable by others (a cache we may unpickle)."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _cached(key: str) -> list[Rule] | None:
    folder = cache_dir()
    path = folder / f"rules-{key}.pickle" if folder else None
    try:
        if path is None or not (_owned(folder) and _owned(path)):
            return None
        data = path.read_bytes()
    except OSError:  # a missing or unreadable cache: the rules are parsed again
        return None
    enabled = gc.isenabled()
    gc.disable()  # ~40k new objects: the cyclic collector's passes over them doubled the time
    try:
        rules = pickle.loads(data)  # noqa: S301 - the user's own cache (_owned)
    except Exception:  # noqa: BLE001 - a corrupt cache (or one of other classes) is parsed again
        return None
    finally:
        if enabled:
            gc.enable()
    return rules if isinstance(rules, list) and all(isinstance(r, Rule) for r in rules) else None


def _store(key: str, rules: list[Rule]) -> None:
    folder = cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".rules-")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(rules, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, folder / f"rules-{key}.pickle")  # atomic: parallel runs race safely
        # other keys are older parsers or rule files, or other checkouts: the newest few stay
        kept = sorted(folder.glob("rules-*.pickle"), key=lambda p: p.stat().st_mtime)
        for old in kept[:-_CACHE_KEEP]:
            old.unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - the cache is an optimisation; a read-only home is fine
        pass


def _texts(folder_or_file: Path) -> list[tuple[Path, str]]:
    """(path, text) of each rule file there and of the fragment files beside them (bounded
    reads)."""
    return [(f, read_text(f, lambda msg, f=f: RuleError(str(f), msg)))
            for f in _rule_files(folder_or_file)]


def _shipped_rules() -> list[Rule]:
    texts = _texts(DEFAULT_RULES_DIR)
    key = _cache_key(texts)
    rules = _cached(key)
    if rules is None:
        rules = _parsed(texts, shipped=True)
        _store(key, rules)
    return rules


def _is_fragment(path: Path) -> bool:
    """``_NAME.yaml``: variants that rule files beside it include (engine.rules.parse_fragment),
    not a rule file."""
    return path.name.startswith("_")


def _rule_files(path: Path) -> list[Path]:
    """The rule files of a folder (or the one file given) and the fragment files beside them."""
    def yaml_files(folder: Path) -> list[Path]:
        return sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml"))

    try:
        if path.is_dir():
            return yaml_files(path)
        if not _is_fragment(path) and path.parent.is_dir():
            return [path, *(p for p in yaml_files(path.parent) if _is_fragment(p))]
    except OSError as exc:
        raise RuleError(str(path), f"cannot list the folder: {os_reason(exc)}") from None
    return [path]


def load_rules(paths=None) -> list[Rule]:
    """Load and validate rules from files or folders (default: the shipped ``rules/``).

    Rules come back in application order: ascending ``order``, then name.
    """
    if paths is None or (isinstance(paths, (list, tuple)) and not paths):
        return _shipped_rules()
    if isinstance(paths, (str, Path)):
        paths = [paths]
    texts = []
    for p in map(Path, paths):
        if not os.path.lexists(p):
            raise RuleError(str(p), "no such rule file or folder")
        texts += _texts(p)
    return _parsed(texts, shipped=False)


def _parsed(texts: list[tuple[Path, str]], shipped: bool) -> list[Rule]:
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    fragments = {f: parse_fragment(text, str(f), shipped) for f, text in texts if _is_fragment(f)}
    for f, text in texts:
        if _is_fragment(f):
            continue
        beside = {p.stem[1:]: v for p, v in fragments.items() if p.parent == f.parent}
        for rule in parse_rules(text, str(f), shipped, beside):
            if rule.name in seen:
                raise RuleError(str(f), f"rule name '{rule.name}' is also used by "
                                f"{seen[rule.name]}")
            seen[rule.name] = str(f)
            rules.append(rule)
    share_specs(rules)
    return sorted(rules, key=lambda r: (r.order, r.name))
