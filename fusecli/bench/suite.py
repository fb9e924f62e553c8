"""The benchmark suite of issue #4: ``python -m fusecli.bench.suite --out BENCHMARKS.md``.

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

All timings: spinning off, ORT_ENABLE_ALL, one process per comparison, warm-up, interleaved runs,
medians (fusecli/bench_worker.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from ..contracts import FUSED_DOMAIN, floor_bytes
from .command import run_bench

REPO = Path(__file__).resolve().parents[2]
BENCH_SAMPLES = REPO / "build" / "bench-samples"
WORKDIR = REPO / "build" / "bench"
SAMPLE_NAMES = ["ortt_mlp", "ortt_block", "ortt_block_mul", "ortt_block_sdpa", "ortt_cnn",
                "ortt_llama", "torch_mlp", "torch_block", "torch_llama"]
# per-op comparisons run at least --runs interleaved pairs and keep going for this long, so a
# 0.1 ms op gets hundreds of samples instead of 20 (medians of 20 had 10-50% interquartile range)
OP_MIN_TIME_S = 2.0
STEP_MIN_TIME_S = 5.0  # the same for whole training steps
MAX_SPREAD = 0.2  # a comparison with a wider interquartile range / median is measured again
GEMM_OPS = {"Gemm", "MatMul", "FusedMatMul", "FusedGemm", "ConvGrad", "Conv", "ConvTranspose"}


# ---------------------------------------------------------------------------------------------
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


def ensure_bench_samples() -> dict[str, dict]:
    missing = [n for n in SAMPLE_NAMES if not (BENCH_SAMPLES / f"{n}.json").exists()
               or not (BENCH_SAMPLES / f"{n}.onnx").exists()]
    if missing:
        log(f"generating benchmark-size samples into {BENCH_SAMPLES} (missing: {missing})")
        subprocess.run(["bash", str(REPO / "scripts" / "make_samples.sh"), "--bench",
                        str(BENCH_SAMPLES)], check=True, cwd=REPO)
    entries = {}
    for n in SAMPLE_NAMES:
        e = json.loads((BENCH_SAMPLES / f"{n}.json").read_text())
        e["name"] = n
        e["manifest_dir"] = str(BENCH_SAMPLES)
        entries[n] = e
    return entries


# ---------------------------------------------------------------------------------------------
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

    from ..runtime_worker import session_options

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


# ---------------------------------------------------------------------------------------------
def profile_model(path, feeds: dict, python: str, threads: int, library: str | None,
                  repeat: int = 4) -> tuple[dict[str, float], dict[str, str]]:
    """Per-node mean kernel time (ms per run) from an onnxruntime profile (ORT_ENABLE_ALL)."""
    from ..verify import run_in_runtime

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


# ---------------------------------------------------------------------------------------------
def load_and_fuse(name: str):
    """(path, original model, fused copy, final fusion records, expanded names) of a
    benchmark-size sample."""
    src = BENCH_SAMPLES / f"{name}.onnx"
    orig = onnx.load(str(src))
    work = onnx.ModelProto()
    work.CopyFrom(orig)
    _, recs, expanded = fuse_with_records(work)
    return src, orig, work, recs, expanded


def fuse_with_records(model: onnx.ModelProto):
    """Run FusionPass on ``model`` (in place); return (final fused records, expanded names).

    FusionPass drops the record of a fusion that a later rule absorbs (torch-joint
    ActivationGrad -> LinearActivationGrad), so the ActivationGrad-only rules are run once more
    on a copy to learn which original nodes those intermediate fused nodes replaced.
    """
    from ..fusion import FusionPass
    from ..rules import load_rules

    pre = onnx.ModelProto()
    pre.CopyFrom(model)
    act_rules = [r for r in load_rules() if r.replace.op == "ActivationGrad"]
    extra = []
    if act_rules:
        fp0 = FusionPass(rules=act_rules)
        fp0.run(pre)
        extra = list(fp0.stats.fusions)
    fp = FusionPass()
    fp.run(model)
    final = {n.name for n in model.graph.node if n.domain == FUSED_DOMAIN}
    recs = [r for r in fp.stats.fusions if r.fused_node in final]
    return fp.stats, recs, expand_replaced(extra + list(fp.stats.fusions))


def expand_replaced(records) -> dict[str, list[str]]:
    """fused node name -> original node names it replaced (through nested fusions)."""
    by_name = {r.fused_node: r for r in records}

    def exp(names):
        out = []
        for n in names:
            out.extend(exp(by_name[n].replaced) if n in by_name else [n])
        return out

    return {r.fused_node: exp(r.replaced) for r in records}


def probe_values(model_path: Path, tensors: list[str], feeds: dict, python: str) -> dict:
    """Values of internal tensors from one run of the original model (optimizations off)."""
    from ..verify import run_in_runtime

    m = onnx.load(str(model_path))
    try:
        inferred = onnx.shape_inference.infer_shapes(m)
    except Exception:  # noqa: BLE001 - types are only a hint here
        inferred = m
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(inferred.graph.value_info) + list(inferred.graph.input)
             + list(inferred.graph.output) if v.type.tensor_type.elem_type}
    have = {o.name for o in m.graph.output}
    for t in tensors:
        if t not in have and t not in feeds:
            m.graph.output.append(helper.make_tensor_value_info(
                t, types.get(t, onnx.TensorProto.FLOAT), None))
    with tempfile.TemporaryDirectory(prefix="fusecli-probe-") as tmp:
        p = Path(tmp) / "probe.onnx"
        onnx.save(m, str(p))
        vals, _ = run_in_runtime(p, feeds, python)
    vals.update(feeds)
    return vals


def _vi(name, arr):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype),
                                         list(arr.shape))


def chain_models(orig: onnx.ModelProto, names: list[str], fused_node: onnx.NodeProto,
                 values: dict) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    """(unfused chain model, fused single-node model, feeds) for one fusion."""
    want = set(names)
    nodes = [n for n in orig.graph.node if n.name in want]
    produced = {o for n in nodes for o in n.output if o}
    inits = {t.name: t for t in orig.graph.initializer}
    ins, used_inits = [], []
    for n in nodes:
        for t in n.input:
            if t and t not in produced and t not in {i.name for i in ins} \
                    and t not in {u.name for u in used_inits}:
                if t in inits:
                    used_inits.append(inits[t])
                else:
                    ins.append(_vi(t, values[t]))
    # the chain's results (a fused op's workspace output, e.g. dZ, is not one of them)
    outs = [_vi(o, values[o]) for o in fused_node.output if o in produced]
    g = helper.make_graph(nodes, "chain", ins, outs, initializer=used_inits)
    um = helper.make_model(g, opset_imports=list(orig.opset_import))
    um.ir_version = orig.ir_version
    fins = [_vi(t, values[t]) for t in dict.fromkeys(fused_node.input) if t]
    fg = helper.make_graph([fused_node], "fused", fins, outs)
    ops = [o for o in orig.opset_import if o.domain != FUSED_DOMAIN]
    fm = helper.make_model(fg, opset_imports=ops + [helper.make_opsetid(FUSED_DOMAIN, 1)])
    fm.ir_version = orig.ir_version
    feeds = {i.name: values[i.name] for i in ins}
    feeds.update({t: values[t] for t in fused_node.input if t})
    return um, fm, feeds


def unfused_part_model(um: onnx.ModelProto, values: dict) -> onnx.ModelProto:
    """The unfused chain's non-GEMM nodes alone: the memory-bound work the fused op replaces.
    Its outputs are the tensors those nodes hand to the chain's GEMMs/convolutions or to the
    chain's own outputs (e.g. dZ and dB; dC, dGamma and dBeta)."""
    g = um.graph
    part = [n for n in g.node if n.op_type not in GEMM_OPS]
    to_gemm = {t for n in g.node if n.op_type in GEMM_OPS for t in n.input}
    chain_outs = {o.name for o in g.output}
    produced = {o for n in part for o in n.output if o}
    outs = [o for n in part for o in n.output if o and (o in to_gemm or o in chain_outs)]
    inits = {t.name: t for t in g.initializer}
    needed = list(dict.fromkeys(t for n in part for t in n.input if t and t not in produced))
    ins = [_vi(t, values[t]) for t in needed if t not in inits]
    pg = helper.make_graph(part, "part", ins, [_vi(o, values[o]) for o in outs],
                           initializer=[inits[t] for t in needed if t in inits])
    pm = helper.make_model(pg, opset_imports=list(um.opset_import))
    pm.ir_version = um.ir_version
    return pm


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _model(nodes, ins, outs, fused=False, ir=8):
    g = helper.make_graph(nodes, "m", ins, outs)
    ops = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(FUSED_DOMAIN, 1)] if fused else [])
    m = helper.make_model(g, opset_imports=ops)
    m.ir_version = ir
    return m


def _f(name, shape):
    return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(shape))


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
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
             runs: int | None = None, python: str | None = None) -> dict:
        pa, pb = self.save(a, stem + "_a"), self.save(b, stem + "_b")
        return steadiest(lambda: run_bench(pa, pb, runs=runs or self.runs, warmup=self.warmup,
                                           threads=self.threads, feeds=feeds, peak_memory=False,
                                           runtime_python=python, min_time_s=OP_MIN_TIME_S))


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


def op_benchmarks(ctx: Ctx, entries: dict) -> list[dict]:
    """Section (a): every distinct fused op (op, attributes, shapes) of the benchmark samples."""
    from ..feeds import make_feeds
    from ..library import library_path
    from ..verify import pick_runtime

    lib = library_path()
    rows, seen = [], set()
    for name, entry in entries.items():
        src, orig, _, recs, expanded = load_and_fuse(name)
        python = pick_runtime(orig)
        feeds = make_feeds(orig, entry, dims=entry.get("dims"))
        inits = {t.name for t in orig.graph.initializer}
        known = {o for n in orig.graph.node for o in n.output} | {i.name for i in orig.graph.input}
        tensors = sorted(({t for r in recs for t in list(r.node.input) + list(r.node.output) if t}
                          | {t for r in recs for n in orig.graph.node if n.name in
                             set(expanded[r.fused_node]) for t in n.input if t}) & known - inits)
        values = probe_values(src, tensors, feeds, python)
        for r in recs:
            key = (entry["family"], r.node.op_type,
                   tuple(sorted((a.name, str(helper.get_attribute_value(a)))
                                for a in r.node.attribute)),
                   tuple(tuple(values[t].shape) if t else () for t in r.node.input),
                   tuple(bool(o) for o in r.node.output))
            if key in seen:
                continue
            seen.add(key)
            log(f"(a) {name}: {r.rule} ({r.node.op_type})")
            try:
                rows.append(one_op(ctx, name, entry, orig, r, expanded[r.fused_node], values,
                                   python, lib))
            except Exception as exc:  # noqa: BLE001 - keep the suite going, report it
                rows.append({"sample": name, "rule": r.rule, "op": r.node.op_type,
                             "error": f"{type(exc).__name__}: {exc}"[:300]})
                log(f"    failed: {exc}")
    return rows


def one_op(ctx: Ctx, name, entry, orig, rec, names, values, python, lib) -> dict:
    node = rec.node
    um, fm, feeds = chain_models(orig, names, node, values)
    res = ctx.pair(um, fm, feeds, f"{name}_{rec.rule}")
    t_un, t_fu = res["a"]["median_ms"], res["b"]["median_ms"]
    prof, op_of = profile_model(ctx.save(um, f"{name}_{rec.rule}_prof"), feeds, python,
                                ctx.threads, lib)
    row = {"sample": name, "family": entry["family"], "rule": rec.rule, "op": node.op_type,
           "attrs": {a.name: _attr(node, a.name) for a in node.attribute},
           "unfused_ms": t_un, "fused_ms": t_fu, "speedup": t_un / t_fu,
           "unfused_profile": by_op(prof, op_of), "runtime": res["runtime"],
           "shape": "", "spread": (res["b"]["p75_ms"] - res["b"]["p25_ms"]) / t_fu}
    bw = ctx.bw
    op = node.op_type
    ins = [values[t] if t else None for t in node.input]
    parts = {"LinearActivationGrad": linear_parts, "AttentionGrad": attention_parts,
             "ConvBnReluGrad": conv_parts}.get(op)  # ops with GEMM work beside the memory part
    if parts:
        parts(ctx, row, node, ins, um, values)
    else:  # memory-bound as a whole: its contract's byte floor
        byts = value_floor_bytes(node, values)
        row.update(shape=f"{list(ins[0].shape)}", mem_bytes=byts, mem_floor_ms=byts / bw * 1e3,
                   gemm_ms=0.0, mem_part_fused_ms=t_fu)
        if op != "ActivationGrad":  # the whole chain is the part
            row["part"] = ("LayerNorm bwd" if op == "LayerNormGrad" else op, t_un, t_fu)
    floor = row.get("gemm_ms", 0.0) + row.get("mem_floor_ms", 0.0)
    row["floor_ms"] = floor
    row["floor_fraction"] = floor / t_fu if t_fu else None
    return row


def linear_parts(ctx, row, node, ins, um, values):
    dY, X, A = ins[0], ins[1], ins[2]
    N, K = dY.shape[-1], A.shape[-1]
    M = dY.size // N
    trans_w = int(_attr(node, "trans_w", 0) or 0)
    want_da = bool(node.output[0]) if len(node.output) > 0 else False
    want_db = len(node.output) > 2 and bool(node.output[2])
    row["shape"] = f"M={M} N={N} K={K}" + ("" if want_da else " (no dA)") + \
        ("" if want_db else " (no dB)")
    # GEMMs alone, onnxruntime: dW = dZ^T A (Gemm transA=1), dA = dZ W (MatMul)
    dz, a2 = _rand((M, N), 1), _rand((M, K), 2)
    w2 = _rand((N, K), 3)
    gn = [helper.make_node("Gemm", ["dZ", "A"], ["dW"], transA=1)]
    gin, gout = [_f("dZ", (M, N)), _f("A", (M, K))], [_f("dW", (N, K))]
    feeds = {"dZ": dz, "A": a2}
    if want_da:
        gn.append(helper.make_node("MatMul", ["dZ", "W"], ["dA"]))
        gin.append(_f("W", (N, K)))
        gout.append(_f("dA", (M, K)))
        feeds["W"] = w2
    gemm_model = _model(gn, gin, gout)
    # the fused op with activation=identity and no dB: its GEMM work only (same shapes)
    fn = helper.make_node("LinearActivationGrad", ["dZ", "dZ", "A", "W" if want_da else ""],
                          ["dA" if want_da else "", "dW", ""], domain=FUSED_DOMAIN,
                          activation="identity", trans_w=0)
    fid = _model([fn], gin, gout, fused=True)
    r = ctx.pair(gemm_model, fid, feeds, "gemm_linear")
    ort_gemm, fused_gemm = r["a"]["median_ms"], r["b"]["median_ms"]
    row.update(gemm_ms=ort_gemm, fused_gemm_ms=fused_gemm, gemm_ratio=fused_gemm / ort_gemm)
    # the act-grad (+ bias-grad) part alone: the same fused op asked for dZ (+ dB) only, no
    # GEMMs, against the chain's non-GEMM nodes (act grad, ReduceSum, ...) in one pair. Both
    # write dZ (the GEMMs' operand); byte floor = read dY and X, write dZ.
    bn = helper.make_node("LinearActivationGrad", [node.input[0], node.input[1], node.input[2]],
                          ["", "", "dB" if want_db else "", "dZ"], domain=FUSED_DOMAIN,
                          activation=_attr(node, "activation", "relu"), trans_w=trans_w)
    fin = [_vi(node.input[0], dY), _vi(node.input[1], X), _vi(node.input[2], A)]
    pm = _model([bn], fin, ([_f("dB", (N,))] if want_db else []) + [_f("dZ", dY.shape)],
                fused=True)
    feeds = {node.input[0]: dY, node.input[1]: X, node.input[2]: A}
    um_part = unfused_part_model(um, values)
    feeds.update({i.name: values[i.name] for i in um_part.graph.input})
    r3 = ctx.pair(um_part, pm, feeds, "act_bias_part")
    byts = value_floor_bytes(node, values)  # the op contract's floor_bytes
    row.update(mem_bytes=byts, mem_floor_ms=byts / ctx.bw * 1e3,
               mem_part_fused_ms=r3["b"]["median_ms"])
    row["part"] = ("act grad + bias grad" if want_db else "act grad", r3["a"]["median_ms"],
                   r3["b"]["median_ms"])


def attention_parts(ctx, row, node, ins, um, values):
    dO, Q, K, V, P = ins[:5]
    ktr = int(_attr(node, "k_transposed", 0) or 0)
    sq, dv = dO.shape[-2], dO.shape[-1]
    d = Q.shape[-1]
    sk = P.shape[-1]
    bh = P.size // (sq * sk)
    row["shape"] = f"BH={bh} Sq={sq} Sk={sk} D={d}" + (" (K^T)" if ktr else "")
    names = {"Pt": (bh, sk, sq), "dO": (bh, sq, dv), "Vt": (bh, dv, sk), "dS": (bh, sq, sk),
             "K": (bh, sk, d), "dSt": (bh, sk, sq), "Q": (bh, sq, d)}
    feeds = {k: _rand(s, i) for i, (k, s) in enumerate(names.items())}
    nodes = [helper.make_node("MatMul", ["Pt", "dO"], ["dV"]),
             helper.make_node("MatMul", ["dO", "Vt"], ["dP"]),
             helper.make_node("MatMul", ["dS", "K"], ["dQ"]),
             helper.make_node("MatMul", ["dSt", "Q"], ["dK"])]
    outs = [_f("dV", (bh, sk, dv)), _f("dP", (bh, sq, sk)), _f("dQ", (bh, sq, d)),
            _f("dK", (bh, sk, d))]
    gm = _model(nodes, [_f(k, s) for k, s in names.items()], outs)
    # a second copy of the same model as B: a self-comparison whose A side we use
    r = ctx.pair(gm, gm, feeds, "gemm_attn")
    gemm = r["a"]["median_ms"]
    # the fused op's softmax backward (between its GEMMs) cannot be separated by timing from
    # outside: the kernel times it itself ("AttentionGrad/softmax_ns"); the op runs here, in
    # this process, and the rest of its time is its GEMMs
    softmax_ms, whole_ms = attention_softmax_phase(node, ins, ctx.threads)
    byts = value_floor_bytes(node, values)  # the op contract's floor_bytes
    row.update(gemm_ms=gemm, fused_gemm_ms=whole_ms - softmax_ms,
               gemm_ratio=(whole_ms - softmax_ms) / gemm, mem_bytes=byts,
               mem_floor_ms=byts / ctx.bw * 1e3, mem_part_fused_ms=softmax_ms)
    um_part = unfused_part_model(um, values)
    r3 = ctx.pair(um_part, um_part, {i.name: values[i.name] for i in um_part.graph.input},
                  "attn_unfused_part")
    row["part"] = ("softmax bwd + scale (kernel's own timer)", r3["a"]["median_ms"], softmax_ms)


def attention_softmax_phase(node, ins, threads: int, seconds: float = 2.0) -> tuple[float, float]:
    """(softmax-backward ms, whole-op ms) per call of the fused AttentionGrad node, medians over
    `seconds` of runs in this process (onnxruntime), from the kernel's phase timer."""
    import onnxruntime as ort

    from ..library import kernel_calls, reset_kernel_calls, session_options

    feeds = {t: a for t, a in zip(node.input, ins) if t}
    outs = [_f(o, a.shape) for o, a in zip(node.output, ins[1:4]) if o]  # dQ~Q, dK~K, dV~V
    m = _model([node], [_vi(t, a) for t, a in feeds.items()], outs, fused=True)
    sess = ort.InferenceSession(m.SerializeToString(), session_options(threads=threads),
                                providers=["CPUExecutionProvider"])
    for _ in range(3):
        sess.run(None, feeds)
    phase, whole, start = [], [], time.perf_counter()
    while len(whole) < 20 or time.perf_counter() - start < seconds:
        reset_kernel_calls()
        t0 = time.perf_counter()
        sess.run(None, feeds)
        whole.append((time.perf_counter() - t0) * 1e3)
        phase.append(kernel_calls("AttentionGrad/softmax_ns") / 1e6)
    return float(np.median(phase)), float(np.median(whole))


def conv_parts(ctx, row, node, ins, um, values):
    dY, Y, X, W, Cv = ins[:5]
    n, c, h, w = dY.shape
    cin, kh, kw = X.shape[1], W.shape[2], W.shape[3]
    want_dx = bool(node.output[0])
    row["shape"] = f"N={n} C={c} Cin={cin} {h}x{w} k={kh}x{kw}" + ("" if want_dx else " (no dX)")
    # the fused op's BN+ReLU part alone: ask only for dBc/dGamma/dBeta and dC (no conv)
    bn_node = helper.make_node("ConvBnReluGrad", list(node.input),
                               ["", "", "dBc", "dG", "dB", "dC"], domain=FUSED_DOMAIN,
                               **{a.name: helper.get_attribute_value(a) for a in node.attribute})
    feeds = {t: v for t, v in zip(node.input, ins) if t}
    fin = [_vi(t, v) for t, v in feeds.items()]
    full = helper.make_node("ConvBnReluGrad", list(node.input), list(node.output),
                            domain=FUSED_DOMAIN,
                            **{a.name: helper.get_attribute_value(a) for a in node.attribute})
    fouts = [_f(o, {0: X.shape, 1: W.shape}.get(i, (c,))) for i, o in enumerate(node.output) if o]
    bn_m = _model([bn_node], fin, [_f("dBc", (c,)), _f("dG", (c,)), _f("dB", (c,)),
                                   _f("dC", dY.shape)], fused=True)
    full_m = _model([full], fin, fouts, fused=True)
    r = ctx.pair(full_m, bn_m, feeds, "conv_bn_part")
    bn_part = r["b"]["median_ms"]
    # the unfused ReluGrad + BatchNormalizationGrad alone, in one pair with the fused part
    um_part = unfused_part_model(um, values)
    pfeeds = dict(feeds)
    pfeeds.update({i.name: values[i.name] for i in um_part.graph.input})
    r_un = ctx.pair(um_part, bn_m, pfeeds, "conv_bn_unfused_part")
    # GEMM floor: the conv dgrad/wgrad as plain GEMMs in onnxruntime (im2col not counted)
    kc, hw = cin * kh * kw, h * w
    gfeeds = {"dC": _rand((n, c, hw), 1), "colsT": _rand((n, hw, kc), 2),
              "Wt": _rand((kc, c), 3)}
    gnodes = [helper.make_node("MatMul", ["dC", "colsT"], ["dWp"])]
    gouts = [_f("dWp", (n, c, kc))]
    if want_dx:
        gnodes.append(helper.make_node("MatMul", ["Wt", "dC"], ["cols"]))
        gouts.append(_f("cols", (n, kc, hw)))
    gm = _model(gnodes, [_f("dC", (n, c, hw)), _f("colsT", (n, hw, kc)), _f("Wt", (kc, c))],
                gouts)
    r2 = ctx.pair(gm, gm, gfeeds, "gemm_conv")
    byts = value_floor_bytes(node, values)  # the op contract's floor_bytes
    row.update(gemm_ms=r2["a"]["median_ms"], mem_bytes=byts, mem_floor_ms=byts / ctx.bw * 1e3,
               mem_part_fused_ms=bn_part)
    row["part"] = ("ReLU+BN bwd", r_un["a"]["median_ms"], r_un["b"]["median_ms"])


# ---------------------------------------------------------------------------------------------
def value_floor_bytes(node: onnx.NodeProto, values: dict) -> int:
    """The op contract's byte floor of a fused node, with its inputs' arrays in `values`."""
    return floor_bytes(node, lambda t: values[t].size if t in values else 0)


def chain_floor_bytes(node: onnx.NodeProto, shapes: dict[str, tuple]) -> int:
    """Byte floor of the memory-bound part of one fused chain (its op's contract `floor_bytes`,
    see BENCHMARKS.md method)."""
    return floor_bytes(node, lambda t: int(np.prod(shapes[t])) if t in shapes else 0)


def e2e_benchmarks(ctx: Ctx, entries: dict, fused_dir: Path) -> list[dict]:
    from ..feeds import make_feeds
    from ..library import library_path
    from ..verify import pick_runtime

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
        except Exception as exc:  # noqa: BLE001
            rows.append({"sample": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            log(f"    failed: {exc}")
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


# ---------------------------------------------------------------------------------------------
def optimizer_benchmarks(repeats: int = 3) -> list[dict]:
    from ..fusion import FusionPass
    from ..modelio import load_model, save_model
    from .deepgraph import FAMILIES, SIZES, write_deep_graphs

    ddir = REPO / "build" / "deep-graphs"
    infos = write_deep_graphs(ddir, SIZES, tuple(FAMILIES))
    fusecli = Path(sys.executable).parent / "fusecli"
    rows = []
    for info in infos:
        log(f"(c) {Path(info['path']).name}")
        path = Path(info["path"])
        out = path.with_suffix(".fused.onnx")
        phases = {"load": [], "pass": [], "save": [], "total": []}
        fused = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            m = load_model(path)
            t1 = time.perf_counter()
            fp = FusionPass()
            fp.run(m)
            t2 = time.perf_counter()
            save_model(m, out, path)
            t3 = time.perf_counter()
            for k, v in zip(("load", "pass", "save", "total"), (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[k].append(v)
            fused = {k: v.fused for k, v in fp.stats.patterns.items()}
        cli = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            proc = subprocess.run([str(fusecli), "optimize", str(path), "-o", str(out), "-q",
                                   "--json"], capture_output=True, text=True)
            cli.append(time.perf_counter() - t0)
            if proc.returncode != 0:
                cli = [float("nan")]
                break
        exp = {k: v for k, v in info["expected"].items()}
        med = {k: statistics.median(v) for k, v in phases.items()}
        rows.append({"graph": path.name, "family": info["family"], "nodes": info["nodes"],
                     "copies": info["copies"], **{f"{k}_s": v for k, v in med.items()},
                     "cli_s": statistics.median(cli),
                     "us_per_node": med["total"] / info["nodes"] * 1e6,
                     "fused": sum(fused.values()), "expected": info["expected_total"],
                     "counts_ok": all(fused.get(k, 0) == v for k, v in exp.items())})
    return rows


# ---------------------------------------------------------------------------------------------
def _ms(v):
    return "–" if v is None else f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def _mib(v):
    return "n/a" if v is None else f"{v / 2**20:.1f}"


def _op_label(r: dict) -> str:
    act = r["attrs"].get("activation")
    return r["op"] + (f" {act}" if act else "")


def render(meta, ops, e2e, opt) -> str:
    L = []
    L.append("# fusecli benchmarks (issue #4)\n")
    L.append(f"Generated by `python -m fusecli.bench.suite` (`make bench`) on {meta['date']}, "
             f"in {meta['elapsed_s']:.0f} s.\n")
    L.append(f"- Machine: {meta['machine']}.")
    L.append(f"- Runtimes: {meta['runtimes']}. Intra-op threads: **{meta['threads']}**, one "
             "inter-op thread, spinning off, ORT_ENABLE_ALL, CPU execution provider.")
    L.append(f"- Each comparison: both models in one process, {meta['warmup']} warm-up runs each, "
             f"then at least {meta['runs']} interleaved runs (A B, B A, ...), more until "
             f"{OP_MIN_TIME_S:g} s (a fused-op comparison) or {STEP_MIN_TIME_S:g} s (a training "
             f"step) have passed; medians. A comparison whose interquartile range exceeded "
             f"{MAX_SPREAD:.0%} of its median (load from elsewhere on this shared machine) was "
             "measured again, up to 3 times, and the steadiest kept. In-place gradient "
             "buffers are re-copied from the pristine feed before every run.")
    L.append(f"- Copy bandwidth measured in this run (medians of 5): numpy copy "
             f"{meta['bw']['numpy_copy'] / 1e9:.2f} GB/s, onnxruntime Add "
             f"{meta['bw']['ort_add'] / 1e9:.2f} GB/s (single measurements "
             f"{meta['bw']['range'][0] / 1e9:.1f}-{meta['bw']['range'][1] / 1e9:.1f} GB/s); the "
             "byte floors use "
             f"the larger, **{meta['bw']['used'] / 1e9:.2f} GB/s** (64 MiB tensors, DRAM; data "
             "that stays in cache can beat this floor, so a fraction > 1 is possible).")
    L.append("- Sizes: transformer d=512, 8 heads, seq 128, FF 2048, batch 4; MLP 1024 wide, "
             "batch 256; CNN 32/64 channels, 32x32, batch 16 (`scripts/make_samples.sh --bench`).")
    L.append("")
    L.append("## (a) Fused ops vs the chains they replace\n")
    L.append("Unfused = the original nodes cut out of the benchmark-size sample (ort-training "
             "chains in onnxruntime-training, torch-joint chains in onnxruntime), fed with the "
             "real boundary tensors of a run of that sample. Floor = GEMM part (the same GEMMs "
             "alone in onnxruntime's MatMul/Gemm; conv as plain GEMMs, im2col not counted) + "
             "memory-bound bytes / copy bandwidth. Fraction = floor / fused time (1.0 = at the "
             "floor).\n")
    L.append("| family | sample | op | shape | unfused ms | fused ms | speed-up | floor ms | "
             "fraction of floor | fused IQR/median |")
    L.append("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in ops:
        if "error" in r:
            L.append(f"| | {r['sample']} | {r['op']} ({r['rule']}) | ERROR: {r['error']} "
                     "| | | | | | |")
            continue
        L.append(f"| {r['family']} | {r['sample']} | {_op_label(r)} | {r['shape']} | "
                 f"{_ms(r['unfused_ms'])} | {_ms(r['fused_ms'])} | {r['speedup']:.2f}x | "
                 f"{_ms(r['floor_ms'])} | {r['floor_fraction']:.2f} | {r['spread']:.1%} |")
    L.append("\n### Parts of each fused op\n")
    L.append("Memory-bound part of the fused op: LayerNormGrad = the whole op; "
             "LinearActivationGrad = the same op asked for dZ (+ dB) only: act grad (+ bias "
             "grad), no GEMMs, byte floor = read dY and X, write dZ; its GEMM part = the op run "
             "with activation=identity vs onnxruntime's Gemm/MatMul on the same shapes; "
             "AttentionGrad = its softmax backward as timed by the kernel itself (the phase "
             "between its GEMMs, in this process), its GEMM part = the rest of its time vs "
             "onnxruntime's 4 MatMuls; ConvBnReluGrad = the op asked for dBc/dGamma/dBeta "
             "and dC only (no conv), byte floor = read dY, Y, Cv, write dC. Unfused part = the "
             "chain's non-GEMM nodes alone (act grad + ReduceSum ...; ReluGrad + BatchNormalizationGrad), timed in one interleaved pair "
             "with the fused part (AttentionGrad: timed alone).\n")
    L.append("| family | op | shape | mem-bound part ms | byte floor ms | x floor | GEMM: fused "
             "ms | GEMM: onnxruntime ms | GEMM ratio | part | unfused part ms | part speed-up |")
    L.append("|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in ops:
        if "error" in r:
            continue
        part = r.get("part")
        mp, mf = r.get("mem_part_fused_ms"), r.get("mem_floor_ms")
        xf = f"{mp / mf:.2f}" if mp and mf else "–"
        L.append(f"| {r['family']} | {_op_label(r)} | {r['shape']} | {_ms(mp)} | {_ms(mf)} | "
                 f"{xf} | {_ms(r.get('fused_gemm_ms'))} | {_ms(r.get('gemm_ms'))} | "
                 + (f"{r['gemm_ratio']:.3f}" if 'gemm_ratio' in r else "–") + " | "
                 + (f"{part[0]} | {_ms(part[1])} | {part[1] / part[2]:.2f}x |" if part
                    else "– | – | – |"))
    L.append("\nWhere the unfused chains spend their time (onnxruntime profile, top op types):\n")
    for r in ops:
        if "error" not in r:
            L.append(f"- {r['family']} {_op_label(r)} ({r['shape']}): {r['unfused_profile']}")
    L.append("\n## (b) Training step, per sample (benchmark sizes)\n")
    L.append("Ideal = unfused step time minus, for every fused chain, (chain time - chain floor), "
             "chain times from an onnxruntime profile of the unfused step (ORT_ENABLE_ALL, mean "
             "of 5 runs), chain floor = its GEMM/conv nodes at onnxruntime's own time + its "
             "memory-bound bytes / copy bandwidth. Fraction of ideal = ideal time / fused time. "
             "Intermediate buffers removed = tensors the replaced nodes produced that the "
             "fused graph no longer has, with their bytes at this size (one step). "
             "Peak = peak RSS growth during one step in a fresh process, CPU arena off "
             f"({e2e[0].get('peak_method') if e2e else ''}).\n")
    L.append("| family | sample | chains | unfused ms | fused ms | speed-up | ideal ms | ideal "
             "speed-up | fraction of ideal | peak unfused MiB | peak fused MiB | intermediate "
             "buffers removed | IQR/median (unf/fused) |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in e2e:
        if "error" in r:
            L.append(f"| | {r['sample']} | ERROR: {r['error']} | | | | | | | | | | |")
            continue
        L.append(f"| {r['family']} | {r['sample']} | {r['chains']} | {_ms(r['unfused_ms'])} | "
                 f"{_ms(r['fused_ms'])} | {r['speedup']:.3f}x | {_ms(r['ideal_ms'])} | "
                 f"{r['ideal_speedup']:.3f}x | {r['fraction_of_ideal']:.2f} | "
                 f"{_mib(r['peak_unfused'])} | {_mib(r['peak_fused'])} | "
                 f"{r['buffers_removed']} ({r['bytes_removed'] / 2**20:.1f} MiB) | "
                 f"{r['spread_unfused']:.1%} / {r['spread_fused']:.1%} |")
    L.append("\nWhere the step time goes (profile, top op types):\n")
    for r in e2e:
        if "error" not in r:
            L.append(f"- {r['sample']}: unfused: {r['profile_unfused']}; fused: "
                     f"{r['profile_fused']}"
                     + (f" ({r['profile_unmatched_nodes']} chain nodes renamed by onnxruntime's "
                        "optimizer, not attributed)" if r['profile_unmatched_nodes'] else ""))
    L.append("\n## (c) Optimiser speed on deep graphs\n")
    L.append("Deep graphs from `fusecli.bench.deepgraph` (copies of the shipped samples chained "
             "through their losses). In-process load + FusionPass.run + save, median of "
             f"{meta['opt_repeats']} runs; CLI = wall time of the real `fusecli optimize` console "
             "script (Python start-up and imports included).\n")
    L.append("| family | graph | nodes | load s | match+rewrite s | save s | total s | µs/node "
             "| CLI wall s | fused / expected |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in opt:
        L.append(f"| {r['family']} | {r['graph']} | {r['nodes']} | {r['load_s']:.3f} | "
                 f"{r['pass_s']:.3f} | {r['save_s']:.3f} | {r['total_s']:.3f} | "
                 f"{r['us_per_node']:.1f} | {r['cli_s']:.2f} | {r['fused']} / {r['expected']}"
                 f"{'' if r['counts_ok'] else ' MISMATCH'} |")
    L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="fusecli benchmark suite (issue #4)")
    ap.add_argument("--out", default="BENCHMARKS.md")
    ap.add_argument("--runs", type=int, default=20, help="interleaved runs per comparison")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--skip", action="append", default=[], choices=["ops", "e2e", "optimizer"])
    args = ap.parse_args(argv)
    t0 = time.time()
    entries = ensure_bench_samples()
    WORKDIR.mkdir(parents=True, exist_ok=True)
    fused_dir = BENCH_SAMPLES / "fused"
    fused_dir.mkdir(exist_ok=True)
    log("measuring copy bandwidth")
    bw = copy_bandwidth(args.threads)
    ops, e2e, opt = [], [], []
    with tempfile.TemporaryDirectory(prefix="chains-", dir=WORKDIR) as tmp:
        ctx = Ctx(args.threads, args.runs, args.warmup, bw["used"], Path(tmp))
        if "ops" not in args.skip:
            ops = op_benchmarks(ctx, entries)
        if "e2e" not in args.skip:
            e2e = e2e_benchmarks(ctx, entries, fused_dir)
    if "optimizer" not in args.skip:
        opt = optimizer_benchmarks()
    runtimes = sorted({r["runtime"] for r in ops + e2e if "runtime" in r})
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "elapsed_s": time.time() - t0,
            "machine": machine(), "threads": args.threads, "runs": args.runs,
            "warmup": args.warmup, "bw": bw, "runtimes": ", ".join(runtimes) or "n/a",
            "opt_repeats": 3}
    Path(args.out).write_text(render(meta, ops, e2e, opt))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "ops": ops, "e2e": e2e,
                                               "optimizer": opt}, indent=1, default=str))
    log(f"wrote {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
