"""Section (a): every distinct fused op of the benchmark samples against the unfused chain it
replaces (cut out of the sample, fed with the sample's real boundary tensors), with its floors:
the contract's byte floor at the measured copy bandwidth for the memory-bound part, the GEMMs
alone in onnxruntime for the GEMM-bound part."""

from __future__ import annotations

import time

import numpy as np
import onnx
from onnx import helper

from fusecli.bench.measure import Ctx, by_op, log, profile_model
from fusecli.bench.samples import load_and_fuse, probe_values
from fusecli.ops.contracts import FUSED_DOMAIN, floor_bytes


GEMM_OPS = {"Gemm", "MatMul", "FusedMatMul", "FusedGemm", "ConvGrad", "Conv", "ConvTranspose"}


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


def op_benchmarks(ctx: Ctx, entries: dict) -> list[dict]:
    """Section (a): every distinct fused op (op, attributes, shapes) of the benchmark samples."""
    from fusecli.runtime.feeds import make_feeds
    from fusecli.runtime.library import library_path
    from fusecli.runtime.runner import pick_runtime

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

    from fusecli.runtime.library import kernel_calls, reset_kernel_calls, session_options

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


def value_floor_bytes(node: onnx.NodeProto, values: dict) -> int:
    """The op contract's byte floor of a fused node, with its inputs' arrays in `values`."""
    return floor_bytes(node, lambda t: values[t].size if t in values else 0)
