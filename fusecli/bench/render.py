"""BENCHMARKS.md from the suite's measurements (``fusecli.bench.suite`` measures, this renders).

``render(meta, ops, e2e, opt, ...)`` takes the rows the suite measured (plain dicts, also written
by ``--json``) and returns the Markdown document; it measures nothing.
"""

from __future__ import annotations


def _ms(v):
    return "–" if v is None else f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def _mib(v):
    return "n/a" if v is None else f"{v / 2**20:.1f}"


def _op_label(r: dict) -> str:
    act = r["attrs"].get("activation")
    return r["op"] + (f" {act}" if act else "")


def _min_row(rows, key="speedup"):
    ok = [r for r in rows if "error" not in r]
    return min(ok, key=lambda r: r[key]) if ok else None


def _summary(meta, e2e, scaled, outliers, shapes, real, models=None) -> list[str]:
    """One line per target: the worst ratio measured in its table."""
    L = ["## Summary\n"]

    def line(what, rows, name, target):
        worst = _min_row(rows)
        errors = sum(1 for r in rows if "error" in r)
        if worst is None:
            L.append(f"- {what}: not measured" + (f" ({errors} errors)" if errors else "") + ".")
            return
        ok = "met" if worst["speedup"] >= target and not errors else "NOT met"
        cpu = [r["cpu_speedup"] for r in rows if "cpu_speedup" in r]
        cpu_txt = f" (CPU time: lowest {min(cpu):.2f}x)" if cpu else ""
        L.append(f"- {what}: lowest fused speed-up **{worst['speedup']:.2f}x** ({name(worst)})"
                 f"{cpu_txt}; target >= {target:.2f}x: {ok}"
                 + (f"; {errors} errors" if errors else "") + ".")

    line("Training steps, benchmark-size samples, default feeds (b)", e2e,
         lambda r: r["sample"], 0.97)
    line(f"Training steps with weights at {meta['weight_scale']:g}x (d)", scaled,
         lambda r: r["sample"], 0.97)
    line("Fused ops vs unfused chains, inputs up to |x| ~ 40 (e)", outliers,
         lambda r: f"{r['label']} {r['shape']}", 1.0)
    line("Fused ops vs unfused chains at real-model shapes (f)", shapes,
         lambda r: f"{r['model']}: {r['label']} {r['shape']}", 1.0)
    line("Real-size ResNet-50 training step (g)", real,
         lambda r: f"weights x{r['scale']:g}", 1.0)
    if models:
        line("MobileNetV2 and Llama (SwiGLU, RoPE) training steps (h)", models["steps"],
             lambda r: r["sample"], 1.0)
    L.append("")
    return L


def _table(head: list[str], align: str, rows, lead, cells) -> list[str]:
    """A Markdown table: `head` titles, `align` one of l/r per column, cells(row) per row; a row
    with an "error" gets lead(row) cells, then the error."""
    L = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if a == "r" else "---"
                                                      for a in align) + "|"]
    for r in rows:
        if "error" in r:
            first = lead(r) + [f"ERROR: {r['error']}"]
            L.append("| " + " | ".join(first + [""] * (len(head) - len(first))) + " |")
        else:
            L.append("| " + " | ".join(cells(r)) + " |")
    return L


CPU_HEAD = ["CPU ms unfused / fused", "CPU-time speed-up"]


def _cpu_cells(r: dict, digits: int = 2) -> list[str]:
    """Median process CPU time of the two models' runs (all threads of the bench worker) and
    its ratio; "–" where the worker did not report it."""
    if "cpu_speedup" not in r:
        return ["–", "–"]
    return [f"{_ms(r['cpu_unfused_ms'])} / {_ms(r['cpu_fused_ms'])}",
            f"{r['cpu_speedup']:.{digits}f}x"]


def _step_table(rows) -> list[str]:
    return _table(
        ["family", "sample", "chains", "weights scaled", "unfused ms", "fused ms", "speed-up",
         *CPU_HEAD, "IQR/median (unf/fused)"], "llrrrrrrrl", rows, lambda r: ["", r["sample"]],
        lambda r: [r["family"], r["sample"], str(r["chains"]),
                   f"{r['weights_scaled']} (x{r['scale']:g})", _ms(r["unfused_ms"]),
                   _ms(r["fused_ms"]), f"{r['speedup']:.3f}x", *_cpu_cells(r, 3),
                   f"{r['spread_unfused']:.1%} / {r['spread_fused']:.1%}"])


def _case_table(rows) -> list[str]:
    return _table(
        ["model", "op", "shape", "unfused ms", "fused ms", "speed-up (paired)",
         "ratio of medians", *CPU_HEAD, "max rel. diff", "IQR/median"], "lllrrrrrrrr", rows,
        lambda r: [r["model"], r["label"], r["shape"]],
        lambda r: [r["model"], r["label"], r["shape"], _ms(r["unfused_ms"]), _ms(r["fused_ms"]),
                   f"{r['speedup']:.3f}x", f"{r.get('median_ratio', r['speedup']):.3f}x",
                   *_cpu_cells(r), f"{r['max_rel_diff']:.1e}", f"{r['spread']:.1%}"])


PAIRED_NOTE = ("Speed-up (the headline) = the median over the interleaved pairs of unfused / "
               "fused wall time: the two runs of a pair are back to back (A B, then B A), so a "
               "pair's ratio cancels what drifts on this shared machine over seconds (clock, "
               "neighbours), which moves whole medians by a few per cent; the ratio of the two "
               "medians is shown next to it. CPU ms = the median process CPU time of a run (user "
               "+ system, every thread of the bench worker; spinning is off, so idle threads add "
               "none).")


CPU_NOTE = ("Speed-up = unfused / fused median wall time (the headline). CPU ms = the median "
            "process CPU time of a run (user + system, every thread of the bench worker, "
            "onnxruntime's intra-op pool included; spinning is off, so idle threads add none): "
            "the work each model did, which load from other processes on this shared machine "
            "does not stretch the way it stretches wall time.")


OPT_HEADING = "## (c) Optimiser speed on deep graphs"


def optimizer_section(meta, opt) -> list[str]:
    """Section (c): lines from its heading up to (not including) the next section."""
    L = [f"\n{OPT_HEADING}\n"]
    L.append("Deep graphs from `fusecli.bench.deepgraph` (copies of the shipped samples chained "
             "through their losses), and a raw `torch.onnx.export(..., dynamo=True, "
             "optimize=False)` training graph of a Llama-style model (`scripts/corpus/gen.py "
             "--raw 44`: 44 layers at the corpus size; constants as small subgraphs, Identity "
             "detach/clone, no-op views; expected counts from the model code). In-process load + "
             "FusionPass (rules loaded included) + save, median of "
             f"{meta['opt_repeats']} runs (CPU s: the process's CPU time for the same, the "
             "steadier number on a shared machine); CLI = wall time of the real `fusecli "
             "optimize` console script (Python start-up and imports included).\n")
    L.append("| family | graph | nodes | load s | match+rewrite s | save s | total s | CPU s "
             "| µs/node | CLI wall s | fused / expected |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in opt:
        cpu = f"{r['cpu_s']:.3f}" if r.get("cpu_s") is not None else "–"
        L.append(f"| {r['family']} | {r['graph']} | {r['nodes']} | {r['load_s']:.3f} | "
                 f"{r['pass_s']:.3f} | {r['save_s']:.3f} | {r['total_s']:.3f} | {cpu} | "
                 f"{r['us_per_node']:.1f} | {r['cli_s']:.2f} | {r['fused']} / {r['expected']}"
                 f"{'' if r['counts_ok'] else ' MISMATCH'} |")
    startup = meta.get("startup") or []
    if startup:
        L.append(f"\nStart-up: wall time of the whole `fusecli` process (Python start-up and "
                 f"imports included), median of {startup[0]['runs']} runs after one warm-up "
                 "(targets: `--version` <= 0.3 s, `optimize` of a small sample <= 0.7 s).\n")
        L.append("| command | median s | min s | max s |")
        L.append("|---|---:|---:|---:|")
        for r in startup:
            L.append(f"| `{r['command']}` | {r['median_s']:.3f} | {r['min_s']:.3f} | "
                     f"{r['max_s']:.3f} |")
    return L


def _model_step_table(rows) -> list[str]:
    return _table(
        ["family", "sample", "fused ops", "unfused ms", "fused ms", "speed-up", *CPU_HEAD,
         "IQR/median (unf/fused)", "peak unfused MiB", "peak fused MiB"], "lllrrrrrlrr", rows,
        lambda r: ["", r["sample"]],
        lambda r: [r["family"], r["sample"], r.get("fused_ops", ""), _ms(r["unfused_ms"]),
                   _ms(r["fused_ms"]), f"{r['speedup']:.3f}x", *_cpu_cells(r, 3),
                   f"{r['spread_unfused']:.1%} / {r['spread_fused']:.1%}",
                   _mib(r["peak_unfused"]) if "peak_unfused" in r else "–",
                   _mib(r["peak_fused"]) if "peak_fused" in r else "–"])


def models_section(models) -> list[str]:
    """Section (h): third-party models at benchmark size, their steps and their fused ops."""
    L = ["\n## (h) MobileNetV2 and a Llama with SwiGLU and RoPE: training steps and their ops\n"]
    L.append("Third-party model classes at benchmark size, generated by the corpus generator "
             "(`scripts/corpus/archs.py`, its `*_bench` architectures; not committed): "
             "torchvision's MobileNetV2 (width 1.0, 17 inverted-residual blocks) on 64x64 images, "
             "batch 8 (ort-training: the torchvision model has no torch-joint convolution "
             "backward export); transformers' LlamaModel (hidden 512, 8 heads of 64, 4 KV heads, "
             "SwiGLU FF 1408, 2 layers, rotary embeddings, sequence 256, batch 1) in both "
             "families. Parameters as the model classes initialise them. Steps: same method as "
             "(b) (interleaved runs, medians; peak = peak RSS growth of one step in a fresh "
             "process). " + CPU_NOTE + "\n")
    L.extend(_model_step_table(models.get("steps", [])))
    before = models.get("before", [])
    if before:
        L.append("\nThe Llamas fused WITHOUT the gated-MLP and RoPE patterns (every other rule "
                 "applied: fusecli before those patterns) vs fused with every rule, same method; "
                 "\"unfused\" columns = without them.\n")
        L.extend(_table(
            ["family", "sample", "fused ops without / with", "without ms", "with ms",
             "speed-up", "CPU ms without / with", "CPU-time speed-up", "IQR/median",
             "peak without MiB", "peak with MiB"], "lllrrrrrlrr", before,
            lambda r: ["", r["sample"]],
            lambda r: [r["family"], r["sample"],
                       f"{r['fused_ops_without']} / {r['fused_ops']}", _ms(r["unfused_ms"]),
                       _ms(r["fused_ms"]), f"{r['speedup']:.3f}x", *_cpu_cells(r, 3),
                       f"{r['spread_unfused']:.1%} / {r['spread_fused']:.1%}",
                       _mib(r["peak_unfused"]), _mib(r["peak_fused"])]))
    L.append("\nTheir fused ops against the onnxruntime-training chains they replace (same method "
             "as (f); the chains as the rules' descriptions spell them: relu6 = the Clip "
             "gradient's mask, silu = QuickGeluGrad, hardswish written out as z relu6(z + 3) / 6 "
             "= its product rule; SwiGLU / GeGLU = two Muls + QuickGeluGrad / GeluGrad; RoPE = "
             "Mul, SplitTraining, Neg, Concat, Mul, Sum). ConvBnReluGrad at the MobileNetV2 "
             "step's layer shapes, then its expand and depthwise shapes with each other "
             "activation; the gated and RoPE ops at the Llama sample's shapes and at "
             "TinyLlama-1.1B's (Q with all heads, K with 4 KV heads). " + PAIRED_NOTE + "\n")
    L.extend(_case_table(models.get("ops", [])))
    return L


SECTION_TITLES = {"a": "fused ops vs the chains they replace", "b": "training steps",
                  "c": "optimiser speed on deep graphs, start-up",
                  "d": "training steps, weights at 16x", "e": "fused ops, inputs up to |x| ~ 40",
                  "f": "fused ops at real-model shapes", "g": "ResNet-50 training step",
                  "h": "MobileNetV2 and Llama steps and ops"}
PROVENANCE_HEAD = ["| section | measured | machine | run | copy bandwidth used |",
                   "|---|---|---|---|---|"]


def _bw_cell(bw: dict) -> str:
    cell = f"{bw['used'] / 1e9:.2f} GB/s"
    if "numpy_copy" in bw and "ort_add" in bw:
        cell += (f" (numpy copy {bw['numpy_copy'] / 1e9:.2f}, onnxruntime Add "
                 f"{bw['ort_add'] / 1e9:.2f}")
        if "range" in bw:
            cell += f"; single runs {bw['range'][0] / 1e9:.1f}-{bw['range'][1] / 1e9:.1f}"
        cell += ")"
    return cell


def provenance_row(letter: str, meta: dict, update: bool = False) -> str:
    """One row of the preamble's table: when, where and by which run a section was measured."""
    run = (f"`--update`, {meta['elapsed_s']:.0f} s" if update
           else f"`make bench`, {meta['elapsed_s']:.0f} s")
    return (f"| ({letter}) {SECTION_TITLES[letter]} | {meta['date']} | {meta['machine']} | "
            f"{run} | {_bw_cell(meta['bw'])} |")


def provenance_table(meta: dict, with_models: bool) -> list[str]:
    letters = [ltr for ltr in SECTION_TITLES if with_models or ltr != "h"]
    return PROVENANCE_HEAD + [provenance_row(ltr, meta) for ltr in letters]


def render(meta, ops, e2e, optimizer, scaled=(), outliers=(), shapes=(), real=(),
           models=None) -> str:
    opt = optimizer
    L = []
    L.append("# fusecli benchmarks\n")
    L.append("The lettered sections are generated by `python -m fusecli.bench.suite` (`make bench`; "
             "`--only SECTION --update` re-measures one section in place); the sections after "
             "them by the scripts they name. When and where each section was measured:\n")
    L.extend(provenance_table(meta, with_models=bool(models)))
    L.append("")
    L.append(f"- Runtimes: {meta['runtimes']}. Intra-op threads: **{meta['threads']}**, one "
             "inter-op thread, spinning off, ORT_ENABLE_ALL, CPU execution provider.")
    L.append(f"- Each comparison: both models in one process, {meta['warmup']} warm-up runs each, "
             f"then at least {meta['runs']} interleaved runs (A B, B A, ...), more until "
             f"{meta['op_min_time_s']:g} s (a fused-op comparison; "
             f"{meta.get('case_min_time_s', meta['op_min_time_s']):g} s for the synthetic cases of "
             f"(e) and (f)) or {meta['step_min_time_s']:g} s (a training "
             f"step) have passed; medians. A comparison whose interquartile range exceeded "
             f"{meta['max_spread']:.0%} of its median (load from elsewhere on this shared machine) was "
             "measured again, up to 3 times, and the steadiest kept. In-place gradient "
             "buffers are re-copied from the pristine feed before every run.")
    L.append("- Copy bandwidth: measured in each run (numpy copy and onnxruntime Add on 64 MiB "
             "tensors, medians of 5); the byte floors use the larger (the table above; data that "
             "stays in cache can beat this floor, so a fraction > 1 is possible).")
    L.append("- Sizes: transformer d=512, 8 heads, seq 128, FF 2048, batch 4; MLP 1024 wide, "
             "batch 256; CNN 32/64 channels, 32x32, batch 16 (`scripts/make_samples.sh --bench`).")
    L.append("")
    L.extend(_summary(meta, e2e, scaled, outliers, shapes, real, models))
    L.append("## (a) Fused ops vs the chains they replace\n")
    L.append("Unfused = the original nodes cut out of the benchmark-size sample (ort-training "
             "chains in onnxruntime-training, torch-joint chains in onnxruntime), fed with the "
             "real boundary tensors of a run of that sample. Floor = GEMM part (the same GEMMs "
             "alone in onnxruntime's MatMul/Gemm; conv as plain GEMMs, im2col not counted) + "
             "memory-bound bytes / copy bandwidth. Fraction = floor / fused time (1.0 = at the "
             "floor).\n")
    L.extend(_table(
        ["family", "sample", "op", "shape", "unfused ms", "fused ms", "speed-up", "floor ms",
         "fraction of floor", "fused IQR/median"], "llllrrrrrr", ops,
        lambda r: ["", r["sample"], f"{r['op']} ({r['rule']})"],
        lambda r: [r["family"], r["sample"], _op_label(r), r["shape"], _ms(r["unfused_ms"]),
                   _ms(r["fused_ms"]), f"{r['speedup']:.2f}x", _ms(r["floor_ms"]),
                   f"{r['floor_fraction']:.2f}", f"{r['spread']:.1%}"]))
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
    L.extend(optimizer_section(meta, opt))
    scale = f"{meta['weight_scale']:g}"
    L.append(f"\n## (d) Training steps with weights at {scale}x their scale\n")
    L.append(f"The samples of (b) with every weight (each parameter of rank >= 2: weight matrices, "
             f"conv kernels) multiplied by {scale}, as activation outliers in real models do: "
             "large pre-activations whose exp/erf tails underflow to subnormal floats. Same "
             "method as (b), speed only.\n")
    L.extend(_step_table(scaled))
    L.append("\n## (e) Fused ops vs their unfused chains on inputs up to |x| ~ 40\n")
    L.append("Synthetic cases (`fusecli/bench/shapes.py`): the fused node against the "
             "onnxruntime-training chain it replaces (ReluGrad / GeluGrad / QuickGeluGrad + "
             "ReduceSum + Gemm; LayerNormalizationGrad; FusedMatMul + SoftmaxGrad_13; ReluGrad + "
             "BatchNormalizationGrad + ConvGrad), same feeds, both run in onnxruntime-training. "
             "Pre-activations uniform in [-40, 40]; attention probabilities from logits in "
             "[-40, 40]; LayerNorm rows / BatchNorm channels up to ~40, a quarter of them with a "
             "variance far below epsilon. Max rel. diff = largest |fused - unfused| over the "
             "outputs / the largest |unfused| of that output. " + PAIRED_NOTE + "\n")
    L.extend(_case_table(outliers))
    L.append("\n## (f) Fused ops vs their unfused chains at real-model shapes\n")
    L.append("Same method as (e), ordinary inputs (N(0,1); weights at fan-in scale). ResNet-50 "
             "at 64x64, batch 8: each stage's 3x3 conv and 1x1 reduce conv, and the stride-2 3x3 "
             "conv of the first block of layer2/3/4 (the stride-2 1x1 downsample conv has "
             "BatchNorm without ReLU after it: not this pattern, left unfused); BERT-base layer "
             "(d=768, 12 heads of 64, FF 3072, GELU, seq 128, batch 8); Llama-style layer at "
             "TinyLlama-1.1B's sizes (d=2048, 32 heads of 64, FF 5632, SiLU, seq 256, batch 1). "
             + PAIRED_NOTE + "\n")
    L.extend(_case_table(shapes))
    L.append("\n## (g) Real-size ResNet-50 training step\n")
    L.append("ResNet-50 in plain torch (torchvision's layout, `scripts/samples/models.py`), "
             "exported as an onnxruntime-training artifact at 64x64, batch 8, by the bench "
             "set-up (`make_samples.sh --bench DIR ortt_resnet50`; not committed). Its "
             "parameters as the sample generator initialised them (torch defaults), then with "
             f"every weight at {scale}x. Same method as (b), speed only. " + CPU_NOTE + "\n")
    L.extend(_step_table(real))
    if models:
        L.extend(models_section(models))
    L.append("")
    return "\n".join(L)


# ---- --update: re-measured sections spliced into an existing document -----------------------
LETTERS = {"ops": "a", "e2e": "b", "optimizer": "c", "scaled": "d", "outliers": "e",
           "shapes": "f", "real": "g", "models": "h"}


def _blocks(doc: str) -> list[tuple[str | None, list[str]]]:
    """The document's "## " sections as (heading, lines); the part before the first: None."""
    out: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in doc.splitlines():
        if line.startswith("## "):
            out.append((line, []))
        out[-1][1].append(line)
    return out


def _letter(heading: str | None) -> str | None:
    if heading and heading.startswith("## (") and heading[5:6] == ")":
        return heading[4]
    return None


def _summary_line(line: str, new_summary: list[str], letters: list[str]) -> str:
    """A Summary line of a re-measured section: its line from the new run; others unchanged."""
    for ltr in letters:
        if line.startswith("- ") and line.rstrip().endswith(".") and f"({ltr})" in line:
            return next((n for n in new_summary if n.startswith("- ") and f"({ltr})" in n), line)
    return line


def _spliced_provenance(lines: list[str], letters: list[str], meta: dict) -> list[str]:
    """The preamble with the provenance rows of the re-measured sections replaced (a section
    without a row gets one after the table's last row); the other rows are kept as they are."""
    lines = list(lines)
    for ltr in letters:
        row = provenance_row(ltr, meta, update=True)
        at = next((i for i, ln in enumerate(lines) if ln.startswith(f"| ({ltr}) ")), None)
        if at is not None:
            lines[at] = row
        else:
            rows = [i for i, ln in enumerate(lines) if ln.startswith("| ")]
            lines.insert(rows[-1] + 1 if rows else len(lines), row)
    return lines


def splice(old: str, new: str, measured: list[str], meta: dict) -> str:
    """`old` with the sections of `measured` (suite section keys) and their Summary lines taken
    from `new` (a document rendered from this run), and their rows of the preamble's table
    saying when and where they were measured replaced by this run's."""
    letters = [LETTERS[k] for k in measured]
    fresh = {_letter(h): lines for h, lines in _blocks(new)}
    new_summary = next((lines for h, lines in _blocks(new) if h == "## Summary"), [])
    done, out = set(), []
    for head, lines in _blocks(old):
        letter = _letter(head)
        if letter in letters and letter in fresh:
            lines = fresh[letter]
            done.add(letter)
        elif head == "## Summary":
            lines = [_summary_line(ln, new_summary, letters) for ln in lines]
            # a measured section the old Summary has no line for (a section added since)
            had = [ltr for ltr in letters if any(f"({ltr})" in ln for ln in lines)]
            extra = [n for ltr in letters if ltr not in had for n in new_summary
                     if n.startswith("- ") and f"({ltr})" in n]
            last = max((i for i, ln in enumerate(lines) if ln.startswith("- ")), default=0)
            lines = lines[:last + 1] + extra + lines[last + 1:]
        elif head is None:
            lines = _spliced_provenance(lines, letters, meta)
        out.append("\n".join(lines))
    for ltr in letters:  # measured sections the old document did not have
        if ltr not in done and ltr in fresh:
            out.append("\n".join(fresh[ltr]))
    return "\n".join(out).rstrip("\n") + "\n"
