#!/usr/bin/env python3
"""Where a step's peak memory sits: the resident set size sampled through one run, against
onnxruntime's per-node profile of that run.

usage: .venv/bin/python scripts/flash/rss_timeline.py MODEL.onnx [--feeds PARAMS.npz]
           [--threads 2] [--top 12]

Runs the model as `fusecli bench` measures its peak (fresh process, CPU arena off, the same
fixed glibc mmap threshold, one warm-up run, the runtime `fusecli verify` picks, feeds built as
it builds them), with a sampler thread reading /proc/self/statm into a preallocated array
(a growing Python list would itself add MiBs to the figure). Prints the peak above the RSS just
before the run (it matches `fusecli bench`'s peak_bytes), when it happened, and the nodes that
were running when the RSS was highest, with the bytes each wrote. Linux only; a development
tool (how scripts/flash/memory.sh's ort-training Llama step was found to peak at the
embedding's GatherGrad, docs/memory-budget.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time


def child(model: str, feeds_path: str, library: str, threads: int, top: int) -> None:
    """Under the runtime's Python: one warm-up run, then one sampled, profiled run."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(library)
    so.enable_cpu_mem_arena = False
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(os.path.dirname(feeds_path), "profile")
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    loaded = dict(np.load(feeds_path))
    names = [i.name for i in sess.get_inputs()]
    outs = [o.name for o in sess.get_outputs()]
    sess.run(outs, {n: loaded[n].copy() for n in names})
    fresh = {n: loaded[n].copy() for n in names}
    page = os.sysconf("SC_PAGE_SIZE")
    cap = 4_000_000
    buf = np.ones((cap, 2), np.int64)  # touched now: its pages are in the baseline
    count = [0]
    stop = threading.Event()

    def sample():
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        while not stop.is_set() and count[0] < cap:
            os.lseek(fd, 0, 0)
            buf[count[0]] = (time.monotonic_ns(), int(os.read(fd, 100).split()[1]) * page)
            count[0] += 1
        os.close(fd)

    th = threading.Thread(target=sample)
    th.start()
    time.sleep(0.05)
    t0 = time.monotonic_ns()
    sess.run(outs, fresh)
    t1 = time.monotonic_ns()
    time.sleep(0.02)
    stop.set()
    th.join()
    s = buf[: count[0]]
    base = int(s[s[:, 0] < t0][-1, 1])
    k = int(np.argmax(s[:, 1]))
    events = json.load(open(sess.end_profiling()))
    nodes = sorted((e["ts"] * 1000, (e["ts"] + e["dur"]) * 1000, e["args"].get("op_name", "?"),
                    e["name"].removesuffix("_kernel_time"), int(e["args"].get("output_size", 0)))
                   for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"))
    # the profile's clock is not the sampler's: the sampled run is the last one, aligned by its
    # first node (a gap of > 50 ms separates the two runs)
    first = max([0] + [i for i in range(1, len(nodes)) if nodes[i][0] - nodes[i - 1][1] > 50e6])
    nodes = nodes[first:]
    shift = t0 - nodes[0][0]
    mib = 2.0 ** 20
    print(f"run {(t1 - t0) / 1e6:.0f} ms, {len(s)} samples; peak {(s[k, 1] - base) / mib:.1f} MiB "
          f"above the RSS before the run, at +{(s[k, 0] - t0) / 1e6:.0f} ms")
    rows = []
    for a, b, op, name, out_bytes in nodes:
        lo, hi = np.searchsorted(s[:, 0], [a + shift, b + shift])
        if hi > lo:
            rows.append((int(s[lo:hi, 1].max()) - base, (a + shift - t0) / 1e6, (b - a) / 1e6,
                         op, name, out_bytes))
    print("  highest RSS while the node ran | node start, duration | op | node | bytes it writes")
    for peak, at, dur, op, name, out_bytes in sorted(rows, key=lambda r: -r[0])[:top]:
        print(f"  {peak / mib:8.1f} MiB  +{at:6.0f} ms {dur:6.0f} ms  {op:<22} {name[:60]}  "
              f"({out_bytes / mib:.1f} MiB)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--feeds", help=".npz by graph input name (the rest generated)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--child", nargs=2, metavar=("FEEDS", "LIBRARY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.child[0], args.child[1], args.threads, args.top)
        return 0
    import numpy as np
    import onnx

    from fusecli.runtime.feeds import plan_feeds, read_feeds_file
    from fusecli.runtime.library import library_path
    from fusecli.runtime.runner import pick_runtime

    m = onnx.load(args.model, load_external_data=False)
    given = read_feeds_file(args.feeds, m) if args.feeds else None
    plan = plan_feeds(m, None, given=given)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "feeds.npz")
        np.savez(path, **plan.feeds)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        return subprocess.run([pick_runtime(m), os.path.abspath(__file__), args.model,
                               "--threads", str(args.threads), "--top", str(args.top),
                               "--child", path, library_path()], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
