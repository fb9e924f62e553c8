"""Sweep graphs generated outside the corpus (`gen.py --out DIR FAMILY ARCH ...`): merge DIR's
fragments into DIR/manifest.yaml (so that `fusecli verify` feeds the models' own parameters and
input ranges), then print, per graph, what the rules fuse against the architecture's expected
counts (scripts/corpus/archs.py derive_counts). Runs under .venv:
`python scripts/corpus/sweep.py DIR`. Writes nothing outside DIR.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import finish  # noqa: E402


def main(argv: list[str]) -> int:
    out = Path(argv[0]).resolve()
    entries = {}
    for p in sorted(out.glob("*.json")):
        e = json.loads(p.read_text())
        if (out / e["file"]).exists():
            e.setdefault("known_gaps", {})
            entries[p.stem] = e
    lines = [finish.HEADER, "samples:"]
    for name, e in entries.items():
        lines.append(f"  {name}:")
        lines += finish.entry_lines(e, finish.KEY_ORDER)
    (out / "manifest.yaml").write_text("\n".join(lines) + "\n")
    for name, e in entries.items():
        fused, before, after = finish.fused_counts(out / e["file"])
        cells = [f"{p} {fused[p]}/{e['expected'][p]}" for p in finish.PATTERNS
                 if e["expected"][p] or fused[p]]
        print(f"{name}: {before} -> {after} nodes: " + (", ".join(cells) or "nothing expected"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
