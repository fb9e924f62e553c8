"""Times every fusecli CUDA kernel against the unfused torch ops it replaces and writes JSON +
markdown. The cases are the op folders' (fusecli/ops/<op>/gpu.py: bench(add, r)); this file
times them.

How (docs/gpu-kernels.md, /work notes "How to measure"):
- baseline = what the unfused float32 graph runs: torch's float32 ops with TF32 OFF
  (torch.backends.cuda.matmul.allow_tf32 = False, cudnn too); a case may add torch in TF32
  (`tf32=`), torch's own fused kernel (`torch_fused=`: native layer-norm backward, cuDNN
  convolution gradients) and a bf16 pair (`bf16=(fused, unfused)`);
- CUDA-event timings after warm-up, the median; iterations adapt to the run time (>= 5);
- inputs larger than L2, random normals (never zeros);
- TFLOP/s where the case gives its `flops`, the fraction of the measured copy bandwidth where it
  gives `bytes_min` (its floor of bytes moved);
- peak device memory of one call: torch's allocator peak above what was allocated before, PLUS
  the default memory pool's CU_MEMPOOL_ATTR_USED_MEM_HIGH (the launchers' cudaMallocAsync
  scratch, which torch's statistics do not see), reset before the call (driver API via ctypes).

Usage: python tests/gpu/bench_cuda.py --out DIR [--only SUBSTRING]"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's fusecli
from fusecli.ops.contracts import load_contracts  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False  # the float32 graph's baseline: no TF32
torch.backends.cudnn.allow_tf32 = False


def timeit(fn, budget_s=1.5, min_iters=5, max_iters=30, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() < t_end):
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
    return 2 * 256 * 2**20 * 4 / ms / 1e6


# ---- the default memory pool's high-water mark (cudaMallocAsync), driver API ----------------------
CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8  # cuda.h: CUmemPool_attribute


class MemPool:
    def __init__(self):
        self.ok, self.why = False, ""
        try:
            self.cu = ctypes.CDLL("libcuda.so.1")
            dev = ctypes.c_int()
            pool = ctypes.c_void_p()
            for call in (lambda: self.cu.cuInit(0),
                         lambda: self.cu.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()),
                         lambda: self.cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev)):
                err = call()
                if err != 0:
                    raise OSError(f"CUresult {err}")
            self.pool = pool
            self.ok = True
        except (OSError, AttributeError) as e:
            self.why = str(e)

    def reset(self):
        if self.ok:
            zero = ctypes.c_uint64(0)
            self.cu.cuMemPoolSetAttribute(self.pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                                          ctypes.byref(zero))

    def high(self) -> int:
        if not self.ok:
            return 0
        v = ctypes.c_uint64(0)
        err = self.cu.cuMemPoolGetAttribute(self.pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                                            ctypes.byref(v))
        return int(v.value) if err == 0 else 0


def peak_MiB(fn, pool: MemPool) -> float:
    """Device memory one call takes at its peak, above what was allocated before it (its outputs
    included): torch's allocator peak + the default pool's (cudaMallocAsync) high-water mark."""
    torch.cuda.synchronize()
    out = None
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    pool.reset()
    out = fn()
    torch.cuda.synchronize()
    torch_peak = torch.cuda.max_memory_allocated() - base
    del out
    return round((torch_peak + pool.high()) / 2**20, 1)


def bench(only=""):
    rows = []
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    copy_gbps = copy_bandwidth_GBps()
    pool = MemPool()
    print(json.dumps({"copy_GBps": round(copy_gbps, 1), "mempool": pool.ok or pool.why}),
          flush=True)

    def add(op, shape, fused, unfused, bytes_min=None, torch_fused=None, flops=None, tf32=None,
            bf16=None, fused_tf32=None):
        """fused / unfused: float32 calls (unfused: torch, TF32 off); torch_fused: torch's own
        fused kernel; tf32: the unfused torch ops in TF32 (fused_tf32: the fused op with its tf32
        attribute set); bf16: (fused, unfused) in bfloat16;
        flops: the useful floating-point operations of one call; bytes_min: its floor of bytes."""
        if only and only not in op:
            return
        try:
            tf, tu = timeit(fused), timeit(unfused)
            row = dict(op=op, shape=shape, fused_ms=round(tf, 4), unfused_torch_ms=round(tu, 4),
                       speedup=round(tu / tf, 3))
            if torch_fused is not None:
                row["torch_fused_ms"] = round(timeit(torch_fused), 4)
            if tf32 is not None:
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
                try:
                    row["torch_tf32_ms"] = round(timeit(tf32), 4)
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = False
                    torch.backends.cudnn.allow_tf32 = False
            if fused_tf32 is not None:
                row["fused_tf32_ms"] = round(timeit(fused_tf32), 4)
            if bf16 is not None:
                fb, ub = timeit(bf16[0]), timeit(bf16[1])
                row.update(fused_bf16_ms=round(fb, 4), unfused_bf16_ms=round(ub, 4),
                           speedup_bf16=round(ub / fb, 3))
            if flops:
                row["fused_TFLOPs"] = round(flops / tf / 1e9, 1)
                row["unfused_TFLOPs"] = round(flops / tu / 1e9, 1)
            if bytes_min:
                row["fused_GBps"] = round(bytes_min / tf / 1e6, 1)
                row["fraction_of_copy_bw"] = round(bytes_min / tf / 1e6 / copy_gbps, 3)
            row["fused_peak_MiB"] = peak_MiB(fused, pool)
            row["unfused_peak_MiB"] = peak_MiB(unfused, pool)
        except Exception as e:  # one failing case must not hide the others' figures
            row = dict(op=op, shape=shape, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()

    # each op folder's timing cases (fusecli/ops/<op>/gpu.py: bench(add, r)), folder order
    for c in (c for c in load_contracts().ops.values() if c.launchers):
        module = importlib.import_module(f"fusecli.ops.{c.folder}.gpu")
        try:
            module.bench(add, r)
        except Exception as e:  # a case's set-up failed (e.g. out of memory)
            rows.append(dict(op=c.name, shape=[], error=f"{type(e).__name__}: {e}"[:300]))
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(0), l2_bytes=l2, torch=torch.__version__,
                copy_GBps=round(copy_gbps, 1), gemm_path=gemm_path(),
                mempool_peak=pool.ok or pool.why, rows=rows)


def gemm_path() -> str:
    from fusecli.ops.gpu import lib

    f = getattr(lib(), "fusecli_gemm_path", None)
    if f is None:
        return "unknown (library without fusecli_gemm_path)"
    f.restype = ctypes.c_char_p
    return f().decode()


COLS = [("op", "op"), ("shape", "shape"), ("fused_ms", "fused ms"),
        ("unfused_torch_ms", "unfused torch fp32 ms"), ("speedup", "speedup"),
        ("fused_tf32_ms", "fused TF32 ms"), ("torch_tf32_ms", "torch TF32 ms"), ("torch_fused_ms", "torch fused ms"),
        ("fused_bf16_ms", "fused bf16 ms"), ("unfused_bf16_ms", "torch bf16 ms"),
        ("speedup_bf16", "bf16 speedup"), ("fused_TFLOPs", "fused TFLOP/s"),
        ("unfused_TFLOPs", "unfused TFLOP/s"), ("fraction_of_copy_bw", "fraction of copy bw"),
        ("fused_peak_MiB", "fused peak MiB"), ("unfused_peak_MiB", "unfused peak MiB"),
        ("error", "error")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/gpu")
    ap.add_argument("--only", default="", help="time only the cases whose name contains this")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = bench(args.only)
    (out / "cuda_bench.json").write_text(json.dumps(rep, indent=1))
    lines = [f"# fusecli CUDA kernels vs unfused torch ({rep['device']}, torch {rep['torch']})", "",
             f"GEMM path: {rep['gemm_path']}. Baseline: torch float32 with TF32 off. Medians of "
             "CUDA-event timings after warm-up; random inputs larger than L2. Measured device "
             f"copy bandwidth: {rep['copy_GBps']} GB/s. Peak = torch allocator peak + the "
             "default memory pool's high-water mark (cudaMallocAsync)"
             + ("" if rep["mempool_peak"] is True else f" (pool unread: {rep['mempool_peak']})")
             + ".", "",
             "| " + " | ".join(h for _, h in COLS) + " |", "|" + "---|" * len(COLS)]
    for r_ in rep["rows"]:
        lines.append("| " + " | ".join(str(r_.get(k, "")) for k, _ in COLS) + " |")
    (out / "cuda_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(1 if any("error" in r_ for r_ in rep["rows"]) else 0)


if __name__ == "__main__":
    main()
