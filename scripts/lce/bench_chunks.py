"""Where chunked linear + cross-entropy pays (issue 22): LinearCrossEntropy against the unfused
onnxruntime-training head + loss (MatMul(H, W^T), SoftmaxCrossEntropyLoss, its Grad seeded by
a constant, dH = dZ W, dW = Gemm(dZ^T H)) at several tokens x vocabulary sizes, D = 512,
interleaved runs in one process, medians; and each model's peak memory (VmHWM of a fresh
process). Not a test: a measurement for the rule's choice (rules/lce_ortt.yaml, BENCHMARKS.md).

  .venv-ortt/bin/python scripts/lce/bench_chunks.py [--runs 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "fusecli" / "lib" / "libfusecli_ops.so"
# the fused op, as its contract names it
OP = re.search(r"^name: (\w+)$", (ROOT / "fusecli/ops/linear_cross_entropy/contract.yaml")
               .read_text(), re.M).group(1)
SIZES = [(256, 8000), (512, 32000), (1024, 32000), (2048, 32000), (4096, 32000), (2048, 50257)]
D = 512


def models(n, v, chunk=0):
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    ins = [helper.make_tensor_value_info("H", f, [n, D]), helper.make_tensor_value_info("W", f, [v, D]),
           helper.make_tensor_value_info("labels", i64, [n])]
    outs = [helper.make_tensor_value_info(x, f, None) for x in ("loss", "dH", "dW")]
    seed = numpy_helper.from_array(np.array(1.0, np.float32), "dloss")
    unf = helper.make_graph([
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["H", "Wt"], ["Z"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["Z", "labels"], ["loss", "LP"],
                         reduction="mean", ignore_index=-100),
        helper.make_node("SoftmaxCrossEntropyLossGrad", ["dloss", "LP", "labels"], ["dZ"],
                         domain="com.microsoft", reduction="mean", ignore_index=-100),
        helper.make_node("FusedMatMul", ["dZ", "Wt"], ["dH"], domain="com.microsoft", transB=1),
        helper.make_node("Gemm", ["H", "dZ"], ["dWt"], transA=1),
        helper.make_node("Transpose", ["dWt"], ["dW"], perm=[1, 0])], "unfused", ins, outs, [seed])
    fus = helper.make_graph([helper.make_node(
        OP, ["H", "W", "", "labels"], ["loss", "dH", "dW"], domain="com.fusecli",
        ignore_index=-100, reduction="mean", chunk_rows=chunk)], "fused", ins, outs)
    ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
           helper.make_opsetid("com.fusecli", 1)]
    return (helper.make_model(unf, opset_imports=ops, ir_version=9),
            helper.make_model(fus, opset_imports=ops, ir_version=9))


def session(m, threads):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.intra_op_num_threads = threads
    so.enable_cpu_mem_arena = False
    so.register_custom_ops_library(str(LIB))
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def feeds(n, v):
    r = np.random.default_rng(0)
    lab = r.integers(0, v, n).astype(np.int64)
    lab[::7] = -100
    return {"H": r.standard_normal((n, D), np.float32), "W": (r.standard_normal((v, D)) * 0.02)
            .astype(np.float32), "labels": lab}


def peak(which, n, v, threads, chunk):
    """VmHWM growth of one run in a fresh process (MiB)."""
    out = subprocess.run([sys.executable, __file__, "--peak", which, str(n), str(v),
                          str(threads), "--chunk", str(chunk)], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.split()[-1])


def _vm(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak", nargs=4)
    ap.add_argument("--chunk", type=int, default=0, help="chunk_rows (0: the kernel's choice)")
    ap.add_argument("--sizes", default="", help="N:V,N:V,... instead of the default list")
    a = ap.parse_args()
    if a.peak:
        which, n, v, t = a.peak[0], int(a.peak[1]), int(a.peak[2]), int(a.peak[3])
        m = models(n, v, a.chunk)[which == "fused"]
        s, fd = session(m, t), feeds(n, v)
        open("/proc/self/clear_refs", "w").write("5")
        base = _vm("VmRSS")
        s.run(None, fd)
        print(_vm("VmHWM") - base)
        return
    print(f"onnxruntime-training {ort.__version__}, {a.threads} threads, D={D}, median of "
          f"{a.runs} interleaved runs (1 warm-up)")
    print(f"{'tokens':>7} {'vocab':>6} {'unfused ms':>11} {'fused ms':>9} {'speed-up':>9} "
          f"{'unfused MiB':>12} {'fused MiB':>10}")
    sizes = [tuple(map(int, x.split(":"))) for x in a.sizes.split(",")] if a.sizes else SIZES
    for n, v in sizes:
        unf, fus = (session(m, a.threads) for m in models(n, v, a.chunk))
        fd = feeds(n, v)
        r_u, r_f = unf.run(None, fd), fus.run(None, fd)
        for x, y in zip(r_u, r_f):
            assert np.allclose(x, y, rtol=1e-3, atol=1e-5 * max(1.0, float(np.abs(x).max())))
        tu, tf = [], []
        for i in range(a.runs):
            for sess, acc in ((unf, tu), (fus, tf)) if i % 2 == 0 else ((fus, tf), (unf, tu)):
                t0 = time.perf_counter()
                sess.run(None, fd)
                acc.append((time.perf_counter() - t0) * 1e3)
        mu, mf = statistics.median(tu), statistics.median(tf)
        pu, pf = (peak(w, n, v, a.threads, a.chunk) for w in ("unfused", "fused"))
        print(f"{n:>7} {v:>6} {mu:>11.1f} {mf:>9.1f} {mu / mf:>8.2f}x {pu:>12.1f} {pf:>10.1f}",
              flush=True)


if __name__ == "__main__":
    main()
