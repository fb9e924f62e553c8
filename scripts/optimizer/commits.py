"""The optimiser's speed at several commits, in one run on this machine (BENCHMARKS (c)).

    .venv/bin/python scripts/optimizer/commits.py [--runs N] COMMIT [COMMIT ...] -- GRAPH ...

Each commit's `fusecli/` and `rules/` are extracted (git archive) into a temporary folder with
this checkout's custom-op library, and each graph is fused by that tree in a fresh process:
its shipped rules loaded + FusionPass.run, CPU seconds, median of --runs (default 5), and per
node of the original graph. Prints a Markdown table. Older trees without fusecli.api are driven through their
fusecli.fusion.FusionPass.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import statistics, sys, time
import onnx
sys.path.insert(0, sys.argv[1])
try:
    from fusecli.api import fusion_pass
except ImportError:
    from fusecli.fusion import FusionPass as fusion_pass
runs = int(sys.argv[2])
for path in sys.argv[3:]:
    ts = []
    for _ in range(runs):
        m = onnx.load(path)
        t = time.process_time()
        fp = fusion_pass()
        n = fp.run(m)
        ts.append(time.process_time() - t)
    med = statistics.median(ts)
    nodes = fp.stats.nodes_before
    print(f"| {path.rsplit('/', 1)[-1]} | {len(fp.all_rules)} | {n} | {med:.3f} | "
          f"{med / nodes * 1e6:.1f} |", flush=True)
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
    runs = 5
    if argv[:1] == ["--runs"]:
        runs, argv = int(argv[1]), argv[2:]
    if "--" not in argv or argv.index("--") in (0, len(argv) - 1):
        print("usage: commits.py [--runs N] COMMIT [COMMIT ...] -- GRAPH [GRAPH ...]",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    commits, graphs = argv[:cut], [str(Path(g).resolve()) for g in argv[cut + 1:]]
    print("| commit | graph | rules | fused | CPU s | µs/node |")
    print("|---|---|---:|---:|---:|---:|")
    for c in commits:
        with tempfile.TemporaryDirectory() as td:
            extract(c, Path(td))
            out = subprocess.run([sys.executable, "-c", CHILD, td, str(runs), *graphs],
                                 check=True, capture_output=True, text=True, cwd=td).stdout
            for line in out.splitlines():
                print(f"| {c} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
