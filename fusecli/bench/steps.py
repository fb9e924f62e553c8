"""Whole training steps, unfused vs fused, per benchmark sample: section (b) (with the ideal
speed-up from an onnxruntime profile and peak memory), (d) every weight at WEIGHT_SCALE times its
value ("outlier" steps) and (g) the real-size models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from fusecli.bench.measure import (STEP_MIN_TIME_S, Ctx, by_op, cpu_cols, log, profile_model,
                                   steadiest)
from fusecli.bench.ops import GEMM_OPS
from fusecli.bench.samples import load_and_fuse, probe_values
from fusecli.ops.contracts import FUSED_DOMAIN, floor_bytes
from fusecli.runtime.bench import run_bench


WEIGHT_SCALE = 16.0  # "outlier" steps: every weight matrix / conv kernel at 16x its scale


def chain_floor_bytes(node: onnx.NodeProto, shapes: dict[str, tuple]) -> int:
    """Byte floor of the memory-bound part of one fused chain (its op's contract `floor_bytes`,
    see BENCHMARKS.md method)."""
    return floor_bytes(node, lambda t: int(np.prod(shapes[t])) if t in shapes else 0)


def e2e_benchmarks(ctx: Ctx, entries: dict, fused_dir: Path) -> list[dict]:
    from fusecli.runtime.feeds import make_feeds
    from fusecli.runtime.library import library_path
    from fusecli.runtime.runner import pick_runtime

    lib = library_path()
    rows = []
    for name, entry in entries.items():
        log(f"(b) {name}")
        src, orig, work, _, expanded = load_and_fuse(name)
        dest = fused_dir / f"{name}.fused.onnx"
        onnx.save(work, str(dest))
        final = [n for n in work.graph.node if n.domain == FUSED_DOMAIN]
        dims = entry.get("dims")
        try:
            res = steadiest(lambda: run_bench(
                src, dest, runs=ctx.runs, warmup=ctx.warmup, threads=ctx.threads, entry=entry,
                dims=dims, peak_memory=True, min_time_s=STEP_MIN_TIME_S))
            python = pick_runtime(orig)
            feeds = make_feeds(orig, entry, dims=dims)
            prof, op_of = profile_model(src, feeds, python, ctx.threads, lib)
            fprof, fop_of = profile_model(dest, feeds, python, ctx.threads, lib)
            inits = {t.name for t in orig.graph.initializer}
            # intermediate tensors the fusions removed: outputs of the replaced original nodes
            # that no fused node produces (sized from this run's real shapes)
            by_name = {nd.name: nd for nd in orig.graph.node if nd.name}
            removed = sorted({o for n in final for k in expanded.get(n.name, [])
                              for o in (by_name[k].output if k in by_name else []) if o}
                             - {o for n in final for o in n.output})
            tensors = sorted(({t for n in final for t in n.input if t} - inits) | set(removed))
            vals = probe_values(src, tensors, feeds, python)
        except Exception as exc:  # noqa: BLE001 - keep the suite going, report it
            rows.append(_failed(name, exc))
            continue
        shapes = {t: v.shape for t, v in vals.items()}
        t_un, t_fu = res["a"]["median_ms"], res["b"]["median_ms"]
        saved, unmatched, chain_total = 0.0, 0, 0.0
        for n in final:
            names = expanded.get(n.name, [])
            t_chain = sum(prof.get(k, 0.0) for k in names)
            unmatched += sum(1 for k in names if k not in prof)
            t_gemm = sum(prof.get(k, 0.0) for k in names if op_of.get(k) in GEMM_OPS)
            floor = t_gemm + chain_floor_bytes(n, shapes) / ctx.bw * 1e3
            chain_total += t_chain
            saved += max(t_chain - floor, 0.0)
        ideal = max(t_un - saved, 1e-6)
        rows.append({
            "sample": name, "family": entry["family"], "runtime": res["runtime"],
            "unfused_ms": t_un, "fused_ms": t_fu, "speedup": t_un / t_fu,
            "ideal_ms": ideal, "ideal_speedup": t_un / ideal, "fraction_of_ideal": ideal / t_fu,
            "chains": len(final), "chain_unfused_ms": chain_total,
            "buffers_removed": len(removed),
            "bytes_removed": int(sum(vals[t].nbytes for t in removed if t in vals)),
            "profile_unmatched_nodes": unmatched,
            "peak_unfused": res["a"]["peak_bytes"], "peak_fused": res["b"]["peak_bytes"],
            "peak_method": res["a"].get("peak_method"),
            "spread_unfused": (res["a"]["p75_ms"] - res["a"]["p25_ms"]) / t_un,
            "spread_fused": (res["b"]["p75_ms"] - res["b"]["p25_ms"]) / t_fu,
            "profile_unfused": by_op(prof, op_of), "profile_fused": by_op(fprof, fop_of)})
    return rows


def scale_weights(feeds: dict, entry: dict, scale: float) -> int:
    """Multiply every weight (a parameter of rank >= 2: weight matrices, conv kernels,
    embeddings) in ``feeds`` by ``scale``, in place; returns how many were scaled."""
    roles = {i["name"]: i.get("role") for i in entry.get("inputs", []) if isinstance(i, dict)}
    names = [k for k, v in feeds.items() if roles.get(k) == "parameter" and v.ndim >= 2
             and np.issubdtype(v.dtype, np.floating)]
    for k in names:
        feeds[k] = (feeds[k] * scale).astype(feeds[k].dtype)
    return len(names)


def step_pairs(ctx: Ctx, entries: dict, fused_dir: Path, scale: float = 1.0,
               peak_memory: bool = False) -> list[dict]:
    """Training step unfused vs fused per sample, with every weight at `scale` times the
    sample's own values; speed, and with `peak_memory` the peak memory of one step of each
    (fresh processes, as (b))."""
    from fusecli.runtime.feeds import make_feeds

    rows = []
    for name, entry in entries.items():
        log(f"steps x{scale:g}: {name}")
        try:
            src, orig, work, recs, _ = load_and_fuse(name)
            dest = fused_dir / f"{name}.fused.onnx"
            onnx.save(work, str(dest))
            dims = entry.get("dims")
            feeds = make_feeds(orig, entry, dims=dims)
            n_scaled = scale_weights(feeds, entry, scale) if scale != 1.0 else 0
            res = _step_pair(ctx, src, dest, feeds, peak_memory)
        except Exception as exc:  # noqa: BLE001 - keep the suite going, report it
            rows.append(_failed(name, exc))
            continue
        rows.append({"sample": name, "family": entry["family"], "scale": scale,
                     "weights_scaled": n_scaled, "chains": len(recs), "runs": res.get("runs"),
                     "fused_ops": _op_counts(work), **_pair_cols(res, peak_memory)})
    return rows


def pattern_pairs(ctx: Ctx, entries: dict, fused_dir: Path, patterns: list[str]) -> list[dict]:
    """Training step fused WITHOUT `patterns` (every other rule applied: fusecli before those
    patterns existed) vs fused with every rule, per sample; speed and peak memory, as
    step_pairs."""
    from fusecli.api import FusionPass
    from fusecli.io.rulefiles import load_rules
    from fusecli.runtime.feeds import make_feeds

    rows = []
    for name, entry in entries.items():
        log(f"steps without {'/'.join(patterns)}: {name}")
        try:
            src, orig, work, _, _ = load_and_fuse(name)
            without = onnx.ModelProto()
            without.CopyFrom(orig)
            FusionPass(rules=[r for r in load_rules() if r.pattern not in patterns]).run(without)
            pa, pb = fused_dir / f"{name}.without.onnx", fused_dir / f"{name}.fused.onnx"
            onnx.save(without, str(pa))
            onnx.save(work, str(pb))
            feeds = make_feeds(orig, entry, dims=entry.get("dims"))
            res = _step_pair(ctx, pa, pb, feeds, True)
        except Exception as exc:  # noqa: BLE001 - keep the suite going, report it
            rows.append(_failed(name, exc))
            continue
        rows.append({"sample": name, "family": entry["family"], "without": patterns,
                     "fused_ops_without": _op_counts(without), "fused_ops": _op_counts(work),
                     **_pair_cols(res, True)})
    return rows


def _step_pair(ctx: Ctx, a: Path, b: Path, feeds: dict, peak: bool) -> dict:
    """One step of `a` vs `b` on the same feeds, interleaved, the steadiest of up to 3 tries."""
    return steadiest(lambda: run_bench(a, b, runs=ctx.runs, warmup=ctx.warmup,
                                       threads=ctx.threads, feeds=feeds, peak_memory=peak,
                                       min_time_s=STEP_MIN_TIME_S))


def _failed(name: str, exc: Exception) -> dict:
    log(f"    failed: {exc}")
    return {"sample": name, "error": f"{type(exc).__name__}: {exc}"[:300]}


def _pair_cols(res: dict, peak: bool) -> dict:
    """The columns of one step comparison (a = unfused or without, b = fused): medians, their
    ratio, CPU time, spreads, and the peaks when measured."""
    t_un, t_fu = res["a"]["median_ms"], res["b"]["median_ms"]
    return {"unfused_ms": t_un, "fused_ms": t_fu, "speedup": t_un / t_fu,
            "runtime": res["runtime"], **cpu_cols(res),
            "spread_unfused": (res["a"]["p75_ms"] - res["a"]["p25_ms"]) / t_un,
            "spread_fused": (res["b"]["p75_ms"] - res["b"]["p25_ms"]) / t_fu,
            **({"peak_unfused": res["a"]["peak_bytes"], "peak_fused": res["b"]["peak_bytes"]}
               if peak else {})}


def _op_counts(model: onnx.ModelProto) -> str:
    """The fused graph's fused nodes by op type ("ConvBnReluGrad 52, ...")."""
    counts: dict[str, int] = {}
    for n in model.graph.node:
        if n.domain == FUSED_DOMAIN:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
