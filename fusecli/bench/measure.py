"""What every benchmark section measures with: the timing rules (minimum times, spread limit),
the comparison context that runs fused-vs-unfused pairs (fusecli.runtime.bench), the copy
bandwidth floor, onnxruntime profiles, the log line and the machine line."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from fusecli.runtime.bench import run_bench


REPO = Path(__file__).resolve().parents[2]
WORKDIR = REPO / "build" / "bench"
# per-op comparisons run at least --runs interleaved pairs and keep going for this long, so a
# 0.1 ms op gets hundreds of samples instead of 20 (medians of 20 had 10-50% interquartile range)
OP_MIN_TIME_S = 2.0
# a synthetic (e)/(f) case: a GEMM-bound one (80 ms a run at Llama sizes) would get only --runs
# pairs in 2 s, and a 1-2% difference would sit inside the noise of 20 medians
CASE_MIN_TIME_S = 10.0
STEP_MIN_TIME_S = 5.0  # the same for whole training steps
MAX_SPREAD = 0.2  # a comparison with a wider interquartile range / median is measured again


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        txt = Path("/proc/cpuinfo").read_text()
        flags = "AVX-512" if "avx512f" in txt else "AVX2" if "avx2" in txt else ""
    except OSError:
        pass
    return f"{cpu} ({flags}), {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def _median_seconds(fn, reps: int = 12, skip: int = 2) -> float:
    """Median wall time of fn() over reps runs, the first `skip` dropped as warm-up."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[skip:])


def copy_bandwidth(threads: int, repeats: int = 5) -> dict:
    """Bytes/s of a large copy: numpy (1 thread) and onnxruntime Add (threads), each the median
    of `repeats` measurements (one of them once read 54 GB/s where 26-33 GB/s is typical here);
    the larger of the two medians is used."""
    import onnxruntime as ort

    from fusecli.runtime.runtime_worker import session_options

    n = 16 * 2**20  # 64 MiB of float32 per tensor: far beyond any cache
    src = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    dst = np.empty_like(src)
    np_all = [2 * src.nbytes / _median_seconds(lambda: np.copyto(dst, src))
              for _ in range(repeats)]
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "bw",
                          [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [n]),
                           helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [n])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    so = session_options(ort, "all", threads)
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {"a": src, "b": dst}
    ort_all = [3 * src.nbytes / _median_seconds(lambda: sess.run(None, feeds))
               for _ in range(repeats)]
    np_bw, ort_bw = statistics.median(np_all), statistics.median(ort_all)
    return {"numpy_copy": np_bw, "ort_add": ort_bw, "used": max(np_bw, ort_bw),
            "range": (min(np_all + ort_all), max(np_all + ort_all))}


def profile_model(path, feeds: dict, python: str, threads: int, library: str | None,
                  repeat: int = 4) -> tuple[dict[str, float], dict[str, str]]:
    """Per-node mean kernel time (ms per run) from an onnxruntime profile (ORT_ENABLE_ALL)."""
    from fusecli.runtime.runner import run_in_runtime

    with tempfile.TemporaryDirectory(prefix="fusecli-prof-") as tmp:
        _, info = run_in_runtime(path, feeds, python, library=library, opt_level="all",
                                 extra=["--threads", str(threads), "--profile", tmp,
                                        "--repeat", str(repeat)])
        events = json.loads(Path(info["profile"]).read_text())
    per_node: dict[str, float] = {}
    op_of: dict[str, str] = {}
    for ev in events:
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
            continue
        name = ev["name"][: -len("_kernel_time")]
        per_node[name] = per_node.get(name, 0.0) + ev["dur"] / 1e3
        op_of[name] = ev.get("args", {}).get("op_name", "?")
    runs = repeat + 1
    return {k: v / runs for k, v in per_node.items()}, op_of


def by_op(per_node: dict[str, float], op_of: dict[str, str], top: int = 5) -> str:
    acc: dict[str, float] = {}
    for k, v in per_node.items():
        acc[op_of.get(k, "?")] = acc.get(op_of.get(k, "?"), 0.0) + v
    tot = sum(acc.values()) or 1.0
    items = sorted(acc.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {v:.2f} ms ({v / tot:.0%})" for k, v in items)


class Ctx:
    def __init__(self, threads, runs, warmup, bw, tmp: Path):
        self.threads, self.runs, self.warmup, self.bw, self.tmp = threads, runs, warmup, bw, tmp
        self.n = 0

    def save(self, m: onnx.ModelProto, stem: str) -> Path:
        self.n += 1
        p = self.tmp / f"{self.n:03d}_{stem}.onnx"
        onnx.save(m, str(p))
        return p

    def pair(self, a: onnx.ModelProto, b: onnx.ModelProto, feeds: dict, stem: str,
             runs: int | None = None, python: str | None = None,
             min_time_s: float = OP_MIN_TIME_S) -> dict:
        pa, pb = self.save(a, stem + "_a"), self.save(b, stem + "_b")
        return steadiest(lambda: run_bench(pa, pb, runs=runs or self.runs, warmup=self.warmup,
                                           threads=self.threads, feeds=feeds, peak_memory=False,
                                           runtime_python=python, min_time_s=min_time_s))


def cpu_cols(res: dict) -> dict:
    """The median process CPU time of each model's runs (bench_worker: all threads of the
    worker process) and their ratio; wall time stays the headline, CPU time shows the work done
    where load from elsewhere on the machine stretched the wall time."""
    cu, cf = res["a"].get("cpu_median_ms"), res["b"].get("cpu_median_ms")
    if not cu or not cf:
        return {}
    return {"cpu_unfused_ms": cu, "cpu_fused_ms": cf, "cpu_speedup": cu / cf}


def _spread(res: dict) -> float:
    return max((res[k]["p75_ms"] - res[k]["p25_ms"]) / res[k]["median_ms"] for k in ("a", "b"))


def steadiest(measure, limit: float = MAX_SPREAD, tries: int = 3) -> dict:
    """measure() again while its interquartile range exceeds `limit` of the median (load from
    elsewhere on a shared machine), at most `tries` times; the steadiest result wins."""
    best = None
    for i in range(tries):
        res = measure()
        res["tries"] = i + 1
        if best is None or _spread(res) < _spread(best):
            best = res
        if _spread(best) <= limit:
            break
    return best
