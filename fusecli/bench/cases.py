"""Sections (e) and (f): the synthetic fused-vs-unfused cases of ``fusecli.bench.shapes``
(outlier inputs, real model shapes), each compared once and then timed side by side."""

from __future__ import annotations

import numpy as np

from fusecli.bench.measure import CASE_MIN_TIME_S, Ctx, cpu_cols, log


def paired_speedup(res: dict) -> float:
    """The median over the interleaved pairs of a / b run times (unfused / fused): the two runs
    of a pair are back to back, so a pair's ratio cancels the drift that moves whole medians on
    a shared machine."""
    ta, tb = np.asarray(res["a"]["times_ms"]), np.asarray(res["b"]["times_ms"])
    n = min(len(ta), len(tb))
    return float(np.median(ta[:n] / tb[:n]))


def case_benchmarks(ctx: Ctx, cases) -> list[dict]:
    """Fused op vs its unfused chain for synthetic cases (``fusecli.bench.shapes``): both run
    once and compared, then timed side by side."""
    from fusecli.runtime.library import library_path
    from fusecli.runtime.runner import pick_runtime, run_in_runtime

    lib = library_path()
    rows = []
    for c in cases:
        log(f"{c.model}: {c.label} {c.shape}")
        row = {"model": c.model, "op": c.op, "label": c.label, "shape": c.shape}
        try:
            python = pick_runtime(c.unfused)
            ref, _ = run_in_runtime(ctx.save(c.unfused, "case_u"), c.feeds, python, library=lib)
            got, _ = run_in_runtime(ctx.save(c.fused, "case_f"), c.feeds, python, library=lib)
            row["max_rel_diff"] = max(
                float(np.abs(got[o].astype(np.float64) - ref[o]).max()
                      / max(float(np.abs(ref[o]).max()), 1e-30)) for o in c.outputs)
            res = ctx.pair(c.unfused, c.fused, c.feeds, f"case_{c.op}", python=python,
                           min_time_s=CASE_MIN_TIME_S)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            log(f"    failed: {exc}")
            continue
        t_un, t_fu = res["a"]["median_ms"], res["b"]["median_ms"]
        row.update(unfused_ms=t_un, fused_ms=t_fu, speedup=paired_speedup(res),
                   median_ratio=t_un / t_fu, runtime=res["runtime"],
                   **cpu_cols(res), spread=max((res[k]["p75_ms"] - res[k]["p25_ms"]) / res[k]["median_ms"]
                              for k in ("a", "b")))
        rows.append(row)
    return rows
