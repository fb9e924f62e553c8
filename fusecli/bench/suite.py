"""The benchmark suite: ``python -m fusecli.bench.suite --out BENCHMARKS.md`` (``make bench``).

This module is the driver (arguments, which sections run, the document); each section measures in
its own module (``fusecli.bench.ops`` (a), ``steps`` (b, d, g), ``optimizer`` (c), ``cases``
(e, f), over ``samples`` and ``measure``) and ``fusecli.bench.render`` turns the rows into the
Markdown document.

(a) per fused op: the fused op against the unfused chain it replaces (cut out of a benchmark-size
    sample: the original nodes, com.microsoft training ops run in onnxruntime-training for
    ort-training chains, standard ops in onnxruntime for torch-joint chains), fed with the real
    boundary tensors of a run of that sample; floors measured in the same run: copy bandwidth
    (numpy copy and onnxruntime Add on 64 MiB tensors; the faster one) for memory-bound parts, the
    GEMMs alone in onnxruntime's MatMul/Gemm for GEMM-bound parts.
(b) per sample (benchmark sizes, both families): training-step time unfused vs fused, the ideal
    speed-up from an onnxruntime profile of the unfused step (every fused chain's memory-bound
    part at its byte floor, its GEMM/conv nodes at onnxruntime's own time) and the fraction of
    the ideal achieved; peak memory of one step.
(c) optimiser speed: load + match + rewrite + save on deep graphs of ~5k/10k/20k/40k nodes.
(d) .. (g): see ``fusecli.bench.render``.
(h) third-party models at benchmark size (MobileNetV2, a Llama with SwiGLU and RoPE in both
    families): their training steps unfused vs fused with peak memory, and their fused ops
    (GatedActivationGrad, RotaryEmbeddingGrad, ConvBnReluGrad with each activation) against the
    chains they replace.

All timings: spinning off, ORT_ENABLE_ALL, one process per comparison, warm-up, interleaved runs,
medians (fusecli/runtime/bench_worker.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from fusecli.bench.cases import case_benchmarks
from fusecli.bench.measure import (CASE_MIN_TIME_S, MAX_SPREAD, OP_MIN_TIME_S, STEP_MIN_TIME_S,
                                   WORKDIR, Ctx, copy_bandwidth, log, machine)
from fusecli.bench.ops import op_benchmarks
from fusecli.bench.optimizer import optimizer_benchmarks, startup_benchmarks
from fusecli.bench.render import render, splice
from fusecli.bench.samples import (BENCH_SAMPLES, REAL_SAMPLE_NAMES, ensure_bench_samples,
                                   ensure_model_samples)
from fusecli.bench.steps import WEIGHT_SCALE, e2e_benchmarks, pattern_pairs, step_pairs

SECTIONS = ["ops", "e2e", "optimizer", "scaled", "outliers", "shapes", "real",
            "models"]  # (a) .. (h)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="fusecli benchmark suite")
    ap.add_argument("--out", default="BENCHMARKS.md")
    ap.add_argument("--runs", type=int, default=20, help="interleaved runs per comparison")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--skip", action="append", default=[], choices=SECTIONS)
    ap.add_argument("--only", action="append", default=[], choices=SECTIONS,
                    help="measure only these sections (repeatable); the rest are skipped")
    ap.add_argument("--update", action="store_true",
                    help="splice the measured sections (and their Summary lines) into the "
                         "existing --out file, keeping its other sections as they are")
    args = ap.parse_args(argv)
    if args.only:
        args.skip = sorted(set(args.skip) | (set(SECTIONS) - set(args.only)))
    if args.update and not Path(args.out).exists():
        ap.error(f"--update: {args.out} does not exist")
    t0 = time.time()
    need_samples = any(k not in args.skip for k in ("ops", "e2e", "scaled"))
    entries = ensure_bench_samples() if need_samples else {}
    WORKDIR.mkdir(parents=True, exist_ok=True)
    fused_dir = BENCH_SAMPLES / "fused"
    fused_dir.mkdir(parents=True, exist_ok=True)
    log("measuring copy bandwidth")
    bw = copy_bandwidth(args.threads)
    from fusecli.bench.shapes import model_op_cases, outlier_cases, real_shape_cases

    ops, e2e, opt, scaled, shapes, outliers, real = [], [], [], [], [], [], []
    model_steps, model_ops, model_before = [], [], []
    with tempfile.TemporaryDirectory(prefix="chains-", dir=WORKDIR) as tmp:
        ctx = Ctx(args.threads, args.runs, args.warmup, bw["used"], Path(tmp))
        if "ops" not in args.skip:
            ops = op_benchmarks(ctx, entries)
        if "e2e" not in args.skip:
            e2e = e2e_benchmarks(ctx, entries, fused_dir)
        if "scaled" not in args.skip:
            scaled = step_pairs(ctx, entries, fused_dir, WEIGHT_SCALE)
        if "outliers" not in args.skip:
            outliers = case_benchmarks(ctx, outlier_cases())
        if "shapes" not in args.skip:
            shapes = case_benchmarks(ctx, real_shape_cases())
        if "real" not in args.skip:
            real_entries = ensure_bench_samples(REAL_SAMPLE_NAMES, by_name=True)
            real = (step_pairs(ctx, real_entries, fused_dir)
                    + step_pairs(ctx, real_entries, fused_dir, WEIGHT_SCALE))
        if "models" not in args.skip:
            model_entries = ensure_model_samples()
            model_steps = step_pairs(ctx, model_entries, fused_dir, peak_memory=True)
            # the Llamas fused without the gated-MLP and RoPE patterns: fusecli before them
            llamas = {k: v for k, v in model_entries.items() if "llama" in k}
            model_before = pattern_pairs(ctx, llamas, fused_dir, ["swiglu", "geglu", "rope"])
            model_ops = case_benchmarks(ctx, model_op_cases())
    startup = []
    if "optimizer" not in args.skip:
        opt = optimizer_benchmarks()
        startup = startup_benchmarks()
    runtimes = sorted({r["runtime"] for r in ops + e2e + scaled + shapes + outliers + real
                       + model_steps + model_ops + model_before if "runtime" in r})
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "elapsed_s": time.time() - t0,
            "machine": machine(), "threads": args.threads, "runs": args.runs,
            "warmup": args.warmup, "bw": bw, "runtimes": ", ".join(runtimes) or "n/a",
            "opt_repeats": 3, "op_min_time_s": OP_MIN_TIME_S,
            "case_min_time_s": CASE_MIN_TIME_S,
            "step_min_time_s": STEP_MIN_TIME_S, "max_spread": MAX_SPREAD,
            "weight_scale": WEIGHT_SCALE, "startup": startup}
    sections = {"ops": ops, "e2e": e2e, "scaled": scaled, "outliers": outliers, "shapes": shapes,
                "real": real, "optimizer": opt, "models": {"steps": model_steps, "before": model_before,
                                                     "ops": model_ops}}
    doc = render(meta, **sections)
    if args.update:
        measured = [k for k in SECTIONS if k not in args.skip]
        doc = splice(Path(args.out).read_text(), doc, measured, meta)
    Path(args.out).write_text(doc)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, **sections}, indent=1, default=str))
    log(f"wrote {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
