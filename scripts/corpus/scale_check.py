"""Optimiser scale check on raw torch-joint exports (`gen.py --raw LAYERS ...` first; runs under
.venv): for each build/corpus-scale/*.onnx prints nodes, the in-process FusionPass time (median
of 3 runs on fresh copies, load excluded), the `fusecli optimize` CLI wall time (process start,
load, rules, save), microseconds per node and the fused counts against the Llama architecture's
(linear_silu L, sdpa L, rmsnorm 2L+1). --profile N: cProfile of one in-process run, top N.

    .venv/bin/python scripts/corpus/scale_check.py [--profile 25] [GRAPH.onnx ...]
"""
from __future__ import annotations

import cProfile
import io
import pstats
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

from fusecli import FusionPass

ROOT = Path(__file__).resolve().parents[2]
FUSECLI = Path(sys.executable).parent / "fusecli"


def in_process(model: onnx.ModelProto, runs: int = 3) -> tuple[float, float, FusionPass]:
    """Median wall and CPU seconds of FusionPass.run (the machine is shared: CPU time is the
    steadier number)."""
    wall, cpu = [], []
    for _ in range(runs):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        fp = FusionPass()
        t0, c0 = time.perf_counter(), time.process_time()
        fp.run(m)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu), fp


def cli(path: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one `fusecli optimize` process."""
    with tempfile.TemporaryDirectory() as td:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([str(FUSECLI), "optimize", str(path), "-o", str(Path(td) / "out.onnx"),
                        "-q"], check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main(argv: list[str]) -> int:
    top = 0
    if argv[:1] == ["--profile"]:
        top, argv = int(argv[1]), argv[2:]
    paths = [Path(a) for a in argv] or sorted(
        (ROOT / "build" / "corpus-scale").glob("*.onnx"),
        key=lambda p: int(re.search(r"L(\d+)", p.stem).group(1)))
    print("| graph | nodes | in-process wall s | CPU s | CPU us/node | CLI wall s | CLI CPU s "
          "| fused silu/sdpa/rms (expected) |")
    print("|---|---|---|---|---|---|---|---|")
    for p in paths:
        model = onnx.load(p)
        layers = int(re.search(r"L(\d+)", p.stem).group(1))
        wall, cpu, fp = in_process(model)
        n = len(model.graph.node)
        pats = fp.stats.patterns
        got = "/".join(str(pats[k].fused if k in pats else 0)
                       for k in ("linear_silu", "sdpa", "rmsnorm"))
        cwall, ccpu = cli(p)
        print(f"| {p.stem} | {n} | {wall:.2f} | {cpu:.2f} | {1e6 * cpu / n:.0f} | {cwall:.2f} | "
              f"{ccpu:.2f} | {got} ({layers}/{layers}/{2 * layers + 1}) |", flush=True)
    if top:
        model = onnx.load(paths[-1])
        prof = cProfile.Profile()
        prof.enable()
        FusionPass().run(model)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
