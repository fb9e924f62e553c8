"""A memory budget on the measured peak: ``--max-memory`` with measurement (the default).

``engine.recompute.apply_budget`` lowers the step's *estimated saved activations* to a target.
What a user asks with ``--max-memory 512MiB`` is that the step run in 512 MiB: its measured peak
(``fusecli bench``'s figure: the resident memory one step adds above the loaded session, in a
fresh process, onnxruntime's CPU arena off, median of three). The peak is the saved activations
plus the backward's working set, and onnxruntime lays its tensors out in one planned block
whose size depends on the execution order, so a drop of the estimate lowers the measured peak
by less, or (measured on a 12-layer GPT-2-style ort-training step) not at all.

So this module closes the loop on measurement: it measures the fused step; if its peak is over
the budget it asks ``apply_budget`` for a saved-activation target lower by the excess, measures
the rewritten step, and moves the target along the measured slope (peak saved per estimated byte
dropped) until the measured peak fits with ``HEADROOM`` to spare, at most ``TRIES`` rewrites.
The answer is the first rewrite measured so; otherwise FuseError with the lowest peak measured.
"""

from __future__ import annotations

import copy
import itertools
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx

from fusecli.engine.recompute import BudgetReport, apply_budget, mib
from fusecli.errors import FuseError

TRIES = 5            # rewrites measured at most
_MIN_SLOPE = 0.05    # measured bytes saved per estimated byte dropped, assumed at least
# The same step measured again can peak higher: on the 12-layer GPT-2-style decoders (2 cores,
# 2 intra-op threads) 421.0 or 441.5 MiB (ort-training), 615.0 or 644.8 MiB (torch-joint),
# up to 4.9% apart between invocations, each the median of three processes. A rewrite is taken
# only when its measured peak is this much below the budget, so that the other mode fits too.
HEADROOM = 0.05


def measured_budget(model: onnx.ModelProto, budget: int, dims: dict[str, int] | None = None,
                    source: Path | None = None, feeds: Path | None = None,
                    threads: int | None = None,
                    log: Callable[[str], None] | None = None,
                    measure: Callable[[onnx.ModelProto], int] | None = None) -> BudgetReport:
    """Rewrite ``model`` (in place) so that the measured peak of its step fits ``budget``
    bytes (module doc). ``source``: the file the model came from (its external data);
    ``feeds``: an .npz of some or all of the step's inputs (as ``fusecli bench --feeds``);
    ``measure``: a model's measured peak in bytes (default: ``peak_of`` on onnxruntime).
    Raises FuseError, the model unchanged, when no rewrite tried fits."""
    say = log or (lambda _msg: None)
    with tempfile.TemporaryDirectory(prefix="fusecli-budget-") as tmp:
        if measure is None:
            files = (Path(tmp) / f"step{k}.onnx" for k in itertools.count())

            def measure(m: onnx.ModelProto) -> int:
                return peak_of(m, next(files), source, dims, feeds, threads)

        first = apply_budget(model, 1 << 62, dims)   # the estimate (a budget it meets: no change)
        goal = int(budget * (1 - HEADROOM))
        p0 = measure(model)
        say(f"memory budget {mib(budget)}: the fused step's measured peak is {mib(p0)} "
            f"(estimated saved activations {mib(first.before)})")
        if p0 <= goal:
            first.budget, first.measured_before, first.measured_after = budget, p0, p0
            return first
        points = [(first.before, p0)]          # (estimate, measured peak), fused first
        low = p0                               # the lowest peak measured
        target = first.before - (p0 - goal)
        for attempt in range(1, TRIES + 1):
            cand = copy.deepcopy(model)
            rep = apply_budget(cand, max(1, int(target)), dims, strict=False)
            if rep.after >= points[-1][0]:   # the estimate cannot go lower: nothing new to try
                break
            peak = measure(cand)
            say(f"  try {attempt}: estimated saved activations {mib(rep.after)}, measured "
                f"peak {mib(peak)}")
            low = min(low, peak)
            if peak <= goal:
                rep.budget, rep.measured_before, rep.measured_after = budget, p0, peak
                rep.met, rep.minimum = True, None
                model.CopyFrom(cand)
                return rep
            (s_prev, p_prev), s_now = points[-1], rep.after
            slope = max((p_prev - peak) / (s_prev - s_now), _MIN_SLOPE)
            points.append((s_now, peak))
            target = s_now - (peak - goal) / slope
    raise FuseError(f"--max-memory {mib(budget)} is unreachable: the fused step's measured peak "
                    f"is {mib(p0)}, and recomputation brought it to {mib(low)} at least; give a "
                    f"budget of at least {mib(low / (1 - HEADROOM))} ({HEADROOM:.0%} over it, "
                    f"for the measurement's spread), or --estimate-only to bound the estimated "
                    f"saved activations instead (nothing written)")


def peak_of(model: onnx.ModelProto, path: Path, source: Path | None,
            dims: dict[str, int] | None, feeds: Path | None, threads: int | None) -> int:
    """``model``'s measured step peak (bytes): saved to ``path`` and measured as
    ``fusecli bench`` measures it (fresh processes, arena off, median of three) on generated
    feeds (``feeds`` gives some or all of them)."""
    from fusecli.io.model import save_model
    from fusecli.runtime.bench import run_bench
    from fusecli.runtime.library import RuntimePythonError

    save_model(model, path, source if source is not None else path)
    try:
        res = run_bench(path, path, runs=1, warmup=0, threads=threads, dims=dims,
                        feeds_file=feeds, peaks_only="b")
    except RuntimePythonError as exc:
        raise FuseError(f"--max-memory could not measure the step ({exc}); use "
                        "--estimate-only to bound the estimated saved activations") from None
    peak = res["b"].get("peak_bytes")
    if peak is None:
        raise FuseError("--max-memory could not measure the step's peak on this system (no "
                        "/proc); use --estimate-only to bound the estimated saved activations")
    return int(peak)
