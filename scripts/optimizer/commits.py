"""The optimiser's speed at several commits, in one run on this machine (BENCHMARKS (c)).

    .venv/bin/python scripts/optimizer/commits.py [--runs N] [--rounds R] [--skip P,...] \
        COMMIT [COMMIT ...] -- GRAPH ...

Each commit's `fusecli/` and `rules/` are extracted (git archive) into a temporary folder with
this checkout's custom-op library. In each of --rounds rounds (default 5) every commit in turn
fuses every graph --runs times (default 3) in a fresh process: its shipped rules loaded +
FusionPass.run, CPU seconds. The commits alternate, so load from elsewhere on a shared machine
falls on all of them alike. Prints a Markdown table: per commit and graph, the median and the
minimum over all runs, in seconds and per node of the original graph. --skip: patterns or
rules left out at every commit (the same work where a later commit fuses more). Older trees
without fusecli.api are driven through their fusecli.fusion.FusionPass.
"""

from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import json, sys, time
import onnx
sys.path.insert(0, sys.argv[1])
try:
    from fusecli.api import fusion_pass
except ImportError:
    from fusecli.fusion import FusionPass as fusion_pass
runs = int(sys.argv[2])
skip = [p for p in sys.argv[3].split(",") if p]
out = {}
for path in sys.argv[4:]:
    ts = []
    for _ in range(runs):
        m = onnx.load(path)
        t = time.process_time()
        fp = fusion_pass(skip=skip)
        n = fp.run(m)
        ts.append(time.process_time() - t)
    out[path] = {"times": ts, "nodes": fp.stats.nodes_before, "fused": n,
                 "rules": len(fp.all_rules)}
print(json.dumps(out))
'''


def extract(commit: str, dest: Path) -> None:
    for tree in ("fusecli", "rules"):
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, tree],
                             check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(dest, filter="data")
    link = dest / "fusecli" / "shipped_rules"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(dest / "rules")
    for so in (ROOT / "fusecli" / "lib").glob("*.so"):
        (dest / "fusecli" / "lib").mkdir(exist_ok=True)
        (dest / "fusecli" / "lib" / so.name).write_bytes(so.read_bytes())


def main(argv: list[str]) -> int:
    opts = {"--runs": 3, "--rounds": 5, "--skip": ""}
    while argv[:1] and argv[0] in opts:
        opts[argv[0]], argv = type(opts[argv[0]])(argv[1]), argv[2:]
    if "--" not in argv or argv.index("--") in (0, len(argv) - 1):
        print("usage: commits.py [--runs N] [--rounds R] [--skip P,...] COMMIT [COMMIT ...] -- "
              "GRAPH [GRAPH ...]", file=sys.stderr)
        return 2
    cut = argv.index("--")
    commits, graphs = argv[:cut], [str(Path(g).resolve()) for g in argv[cut + 1:]]
    samples: dict[tuple[str, str], list[float]] = {}
    facts: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as td:
        trees = {}
        for c in commits:
            trees[c] = Path(td) / c
            extract(c, trees[c])
        for _ in range(opts["--rounds"]):
            for c in commits:
                out = json.loads(subprocess.run(
                    [sys.executable, "-c", CHILD, str(trees[c]), str(opts["--runs"]),
                     opts["--skip"], *graphs],
                    check=True, capture_output=True, text=True, cwd=trees[c]).stdout)
                for g, r in out.items():
                    samples.setdefault((c, g), []).extend(r["times"])
                    facts[(c, g)] = r
    print("| commit | graph | rules | fused | CPU s median | min | µs/node median | min |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for c in commits:
        for g in graphs:
            ts, f = samples[(c, g)], facts[(c, g)]
            med, low = statistics.median(ts), min(ts)
            print(f"| {c} | {Path(g).name} | {f['rules']} | {f['fused']} | {med:.3f} | "
                  f"{low:.3f} | {med / f['nodes'] * 1e6:.1f} | {low / f['nodes'] * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
