"""Times every fusecli CUDA kernel against the unfused torch ops it replaces (CUDA events,
warm-up, median of many runs, inputs larger than L2, fresh random data). Writes JSON + markdown.
The cases are the op folders' (fusecli/ops/<op>/gpu.py: bench(add, r)); this file times them.

Usage: python tests/gpu/bench_cuda.py --out DIR"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's fusecli
from fusecli.ops.contracts import load_contracts  # noqa: E402


def timeit(fn, iters=30, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def copy_bandwidth_GBps() -> float:
    """Measured device copy bandwidth: read + write of a 1 GiB tensor (far larger than L2)."""
    src = r(256 * 2**20)
    dst = torch.empty_like(src)
    ms = timeit(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def bench():
    rows = []
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    copy_gbps = copy_bandwidth_GBps()
    print(json.dumps({"copy_GBps": round(copy_gbps, 1)}), flush=True)

    def add(op, shape, fused, unfused, bytes_min=None, torch_fused=None):
        tf, tu = timeit(fused), timeit(unfused)
        row = dict(op=op, shape=shape, fused_ms=round(tf, 4), unfused_torch_ms=round(tu, 4),
                   speedup=round(tu / tf, 3))
        if torch_fused is not None:
            row["torch_fused_ms"] = round(timeit(torch_fused), 4)
        if bytes_min:
            row["fused_GBps"] = round(bytes_min / tf / 1e6, 1)
            row["fraction_of_copy_bw"] = round(bytes_min / tf / 1e6 / copy_gbps, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)

    # each op folder's timing cases (fusecli/ops/<op>/gpu.py: bench(add, r)), folder order
    for c in (c for c in load_contracts().ops.values() if c.launchers):
        module = importlib.import_module(f"fusecli.ops.{c.folder}.gpu")
        module.bench(add, r)
        torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(0), l2_bytes=l2, torch=torch.__version__,
                copy_GBps=round(copy_gbps, 1), rows=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/gpu")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = bench()
    (out / "cuda_bench.json").write_text(json.dumps(rep, indent=1))
    lines = [f"# fusecli CUDA kernels vs unfused torch ({rep['device']}, torch {rep['torch']})", "",
             "Medians of 30 runs after warm-up, CUDA events; inputs larger than L2. Measured "
             f"device copy bandwidth: {rep['copy_GBps']} GB/s (targets: memory-bound kernels "
             ">= 0.8 of it, every fused op >= 1.5x the unfused torch ops).", "",
             "| op | shape | fused ms | unfused torch ms | speedup | torch fused ms | fused GB/s "
             "| fraction of copy bandwidth |",
             "|---|---|---|---|---|---|---|---|"]
    for r_ in rep["rows"]:
        lines.append(f"| {r_['op']} | {r_['shape']} | {r_['fused_ms']} | {r_['unfused_torch_ms']} | "
                     f"{r_['speedup']} | {r_.get('torch_fused_ms', '')} | {r_.get('fused_GBps', '')} "
                     f"| {r_.get('fraction_of_copy_bw', '')} |")
    (out / "cuda_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
