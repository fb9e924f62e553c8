"""Time two ONNX models side by side in one process (standalone: numpy + onnxruntime + stdlib).

usage: python fusecli/runtime/bench_worker.py --a A.onnx --b B.onnx --feeds feeds.npz
           [--library custom_ops.so] [--library-for a|b|both] [--runs N] [--warmup K]
           [--min-time S] [--max-runs N]
           [--threads T] [--opt-level disable|basic|extended|all] [--spinning]
           [--peak-memory | --no-peak-memory] [--profile DIR] [--peaks-only a|b|both]

Runs under the main venv (onnxruntime) and under .venv-ortt (onnxruntime-training), so it must
not import the fusecli package (same rule as runtime_worker.py).

Timing: both sessions are created with the same SessionOptions (intra-op spinning OFF unless
--spinning, graph optimization level --opt-level (default "all" = ORT_ENABLE_ALL), --threads
intra-op threads, one inter-op thread), both get the same feeds, K warm-up runs each, then N
iterations in alternating order (A B, B A, A B, ...). Before EVERY run each fed input is copied
afresh from the pristine feed (outside the timed region): onnxruntime-training accumulates
gradients in place into the fed '*accumulation.buffer' arrays, and both models must do the same
work every time. A model's inputs that are not in the feeds file are an error.

Peak memory ("peak_bytes"): measured per model in a FRESH child process (this script with
--peak-of), with the CPU memory arena off so that freed memory goes back to the OS: the peak
resident set size (VmHWM, reset through /proc/self/clear_refs just before the run) minus the
resident set size just before the run, over one run after one warm-up run. It counts everything
the run allocates (intermediates, outputs, onnxruntime's own buffers) but not the feeds or the
session's initializers. The child runs with a fixed glibc mmap threshold (64 KiB), so freed
large blocks go back to the OS at once; the reported value is the median of three processes. "peak_method" says which method was used; null where neither
/proc/self/clear_refs nor /proc/self/status is usable.

CPU time ("cpu_median_ms"): the median over the timed runs of the process CPU time
(time.process_time: user + system time of every thread of this process, onnxruntime's intra-op
threads included) that a run used. With spinning off, idle pool threads do not add to it, and it
does not grow while other processes hold the cores, so on a loaded machine it shows the work
each model does next to the wall time.

Prints one JSON object on stdout; on error prints one line to stderr and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time




if __package__:  # imported as fusecli.runtime.bench_worker
    from fusecli.runtime.runtime_worker import (OPT_LEVELS, _runtime_name, input_names, load_feeds,
                                 report_error, session_options)
else:  # run as a script (also under .venv-ortt, where fusecli cannot be imported)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from runtime_worker import (OPT_LEVELS, _runtime_name, input_names, load_feeds,
                                report_error, session_options)


def _session_options(ort, args, arena: bool = True, library: str | None = None, profile=None):
    return session_options(ort, args.opt_level, args.threads, library, profile,
                           spinning=bool(args.spinning), arena=arena)


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def peak_of(args) -> int:
    """Child mode: one model, arena off; print {"peak_bytes": int|None, "peak_method": str}."""
    import numpy as np  # noqa: F401
    import onnxruntime as ort

    lib = args.library if args.peak_of == "a" and args.library_for in ("a", "both") or \
        args.peak_of == "b" and args.library_for in ("b", "both") else None
    model = args.a if args.peak_of == "a" else args.b
    so = _session_options(ort, args, arena=False, library=lib)
    sess = ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])
    loaded = load_feeds(args.feeds)
    names = input_names(sess, loaded, args.peak_of)
    outs = [o.name for o in sess.get_outputs()]
    sess.run(outs, {n: loaded[n].copy() for n in names})  # warm-up (lazy allocations)
    fresh = {n: loaded[n].copy() for n in names}
    can_reset = _reset_peak()
    base = _status_kb("VmRSS")
    if can_reset and base is not None:
        sess.run(outs, fresh)
        hwm = _status_kb("VmHWM")
        res = {"peak_bytes": max(0, (hwm - base)) * 1024 if hwm is not None else None,
               "peak_method": "VmHWM-VmRSS (clear_refs), arena off, fresh process"}
    else:
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sess.run(outs, fresh)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss only grows: a delta is a lower bound of the run's peak (0 when an earlier
        # phase of the process peaked higher), so say so
        res = {"peak_bytes": max(0, after - before) * 1024 if base is not None else None,
               "peak_method": "ru_maxrss delta (lower bound), arena off, fresh process"}
    print(json.dumps(res))
    return 0


def _measure_peak(args, which: str) -> tuple[int | None, str | None]:
    cmd = [sys.executable, os.path.abspath(__file__), "--a", args.a, "--b", args.b,
           "--feeds", args.feeds, "--threads", str(args.threads), "--opt-level", args.opt_level,
           "--library-for", args.library_for, "--peak-of", which]
    if args.library:
        cmd += ["--library", args.library]
    if args.spinning:
        cmd.append("--spinning")
    # a fixed mmap threshold: every large block is mmapped and unmapped when freed. glibc's
    # default threshold adapts to earlier frees and keeps such blocks in its heap, which made
    # the same step's peak vary by 3-4 MiB between processes.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        return None, None
    try:
        d = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, None
    return d.get("peak_bytes"), d.get("peak_method")


def _median_peak(args, which: str, repeats: int = 3) -> tuple[int | None, str | None]:
    """The median of `repeats` fresh-process measurements (one of them can be off by MiBs)."""
    got = [_measure_peak(args, which) for _ in range(repeats)]
    vals = sorted(p for p, _ in got if p is not None)
    if not vals:
        return None, None
    method = next(m for p, m in got if p is not None)
    return vals[len(vals) // 2], f"{method}, fixed mmap threshold, median of {len(vals)}"


def _summary(times):
    import numpy as np

    t = np.asarray(times, dtype=np.float64)
    return {"median_ms": float(np.median(t)), "min_ms": float(t.min()), "max_ms": float(t.max()),
            "mean_ms": float(t.mean()),
            "p25_ms": float(np.percentile(t, 25)), "p75_ms": float(np.percentile(t, 75)),
            "times_ms": [round(float(x), 4) for x in t]}


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="first model (the original)")
    ap.add_argument("--b", required=True, help="second model (the fused one)")
    ap.add_argument("--feeds", required=True, help=".npz keyed by graph input name")
    ap.add_argument("--library", default=None, help="custom-op shared library to register")
    ap.add_argument("--library-for", default="both", choices=("a", "b", "both"))
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--min-time", type=float, default=0.0,
                    help="keep iterating past --runs until this many seconds have passed")
    ap.add_argument("--max-runs", type=int, default=1000, help="cap for --min-time")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = ORT default)")
    ap.add_argument("--opt-level", default="all", choices=OPT_LEVELS)
    ap.add_argument("--spinning", action="store_true", help="leave intra-op spinning on")
    ap.add_argument("--no-peak-memory", dest="peak_memory", action="store_false")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also write an onnxruntime profile of each session into DIR/a, DIR/b")
    ap.add_argument("--peak-of", default=None, choices=("a", "b"), help=argparse.SUPPRESS)
    ap.add_argument("--peaks-only", default=None, choices=("a", "b", "both"),
                    help="measure only these models' peaks (median of three fresh processes), "
                         "no timing")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    try:
        if args.peak_of:
            return peak_of(args)
        if args.peaks_only:
            keys = ("a", "b") if args.peaks_only == "both" else (args.peaks_only,)
            result = {}
            for key in keys:
                peak, method = _median_peak(args, key)
                result[key] = {"peak_bytes": peak, "peak_method": method}
            print(json.dumps(result))
            return 0
        import numpy as np
        import onnxruntime as ort

        if args.runs < 1 or args.warmup < 0:
            raise ValueError("--runs must be >= 1 and --warmup >= 0")
        sessions, names, outs = {}, {}, {}
        loaded = load_feeds(args.feeds)
        for key, path in (("a", args.a), ("b", args.b)):
            lib = args.library if args.library_for in (key, "both") else None
            prof = os.path.join(args.profile, key) if args.profile else None
            so = _session_options(ort, args, library=lib, profile=prof)
            sessions[key] = ort.InferenceSession(path, sess_options=so,
                                                 providers=["CPUExecutionProvider"])
            names[key] = input_names(sessions[key], loaded, key)
            outs[key] = [o.name for o in sessions[key].get_outputs()]

        cpu = {"a": [], "b": []}

        def run(key):
            fresh = {n: loaded[n].copy() for n in names[key]}  # pristine buffers every run
            c0, t0 = time.process_time(), time.perf_counter()
            sessions[key].run(outs[key], fresh)
            t1, c1 = time.perf_counter(), time.process_time()
            cpu[key].append((c1 - c0) * 1e3)
            return (t1 - t0) * 1e3

        for _ in range(args.warmup):
            run("a")
            run("b")
        times = {"a": [], "b": []}
        cpu["a"].clear(), cpu["b"].clear()  # warm-up runs not counted
        start, i = time.perf_counter(), 0
        # --runs iterations, then more (up to --max-runs) while --min-time has not passed
        while i < args.runs or (time.perf_counter() - start < args.min_time
                                and i < max(args.runs, args.max_runs)):
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            for key in order:
                times[key].append(run(key))
            i += 1
        result = {"runtime": _runtime_name(ort), "threads": args.threads, "runs": i,
                  "warmup": args.warmup, "opt_level": args.opt_level,
                  "spinning": bool(args.spinning), "pid": os.getpid()}
        for key in ("a", "b"):
            result[key] = _summary(times[key])
            result[key]["cpu_median_ms"] = float(np.median(cpu[key]))
            if args.profile:
                result[key]["profile"] = sessions[key].end_profiling()
        for key in ("a", "b"):
            peak, method = _median_peak(args, key) if args.peak_memory else (None, None)
            result[key]["peak_bytes"] = peak
            result[key]["peak_method"] = method
    except Exception as e:  # noqa: BLE001 - one line to stderr, exit 2
        return report_error("bench_worker", e)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
