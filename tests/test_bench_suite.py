"""The benchmark suite's own pieces (no timing): the synthetic fused-vs-unfused cases compute the
same thing on both sides, weights are scaled as documented, and the renderer reports every
section and judges the targets from the rows it is given."""

from __future__ import annotations

import numpy as np

from fusecli.bench import render as R
from fusecli.bench import shapes as S
from fusecli.bench.steps import scale_weights

from kernel_helpers import run_in_ortt


def _small_cases(outliers):
    rng = np.random.default_rng(3)
    return [S.linear_case("t", act, 24, 40, 16, rng, outliers=outliers)
            for act in ("relu", "gelu", "silu")] + [
        S.layernorm_case("t", 16, 48, rng, outliers=outliers),
        S.attention_case("t", 3, 20, 8, rng, outliers=outliers),
        S.conv_case("t", 3, 8, 8, 5, 3, rng, outliers=outliers),
        S.conv_case("t", 3, 16, 8, 4, 1, rng, outliers=outliers),
        S.conv_case("t", 3, 8, 8, 3, 3, rng, outliers=outliers, stride=2),
        S.conv_case("t", 2, 16, 8, 2, 1, rng, outliers=outliers, stride=2),
        # MobileNetV2's: depthwise + ReLU6 (stride 1 and 2), 1x1 + ReLU6, projection (identity)
        S.conv_case("t", 2, 8, 8, 5, 3, rng, outliers=outliers, group=8, act="relu6"),
        S.conv_case("t", 2, 8, 8, 3, 3, rng, outliers=outliers, stride=2, group=8, act="relu6"),
        S.conv_case("t", 2, 4, 12, 4, 1, rng, outliers=outliers, act="relu6"),
        S.conv_case("t", 2, 12, 4, 4, 1, rng, outliers=outliers, act="identity")]


def test_synthetic_cases_match_their_unfused_chains():
    """Each case's fused node and its onnxruntime-training chain give the same outputs, on
    ordinary and on outlier inputs (the suite times them against each other)."""
    cases = _small_cases(False) + _small_cases(True) + [
        S.lora_case("t", 24, 40, 16, 4, np.random.default_rng(4))]
    jobs = []
    for c in cases:
        jobs.append(dict(model=c.unfused, feeds=c.feeds, outputs=c.outputs))
        jobs.append(dict(model=c.fused, feeds=c.feeds, outputs=c.outputs, library=True))
    _, results, _ = run_in_ortt(jobs)
    for i, c in enumerate(cases):
        ref, got = results[2 * i], results[2 * i + 1]
        for o, r, g in zip(c.outputs, ref, got):
            scale = max(1.0, float(np.abs(r).max()))
            np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-4 * scale,
                                       err_msg=f"{c.label} {c.shape} {o} (case {i})")
    # the outlier inputs reach the underflow range of exp(-x^2/2)
    assert np.abs(_small_cases(True)[1].feeds["X"]).max() >= 39.0


def test_scale_weights_scales_only_weight_matrices_and_kernels():
    entry = {"inputs": [{"name": "w", "role": "parameter"}, {"name": "b", "role": "parameter"},
                        {"name": "x", "role": "data"}, {"name": "k", "role": "parameter"}]}
    feeds = {"w": np.ones((3, 2), np.float32), "b": np.ones(3, np.float32),
             "x": np.ones((2, 2), np.float32), "k": np.ones((2, 1, 3, 3), np.float32)}
    assert scale_weights(feeds, entry, 16.0) == 2
    assert (feeds["w"] == 16).all() and (feeds["k"] == 16).all()
    assert (feeds["b"] == 1).all() and (feeds["x"] == 1).all()
    assert feeds["w"].dtype == np.float32


def _meta():
    return {"date": "d", "elapsed_s": 1.0, "machine": "m", "runtimes": "r", "threads": 2,
            "warmup": 3, "runs": 20, "bw": {"numpy_copy": 1e10, "ort_add": 2e10, "used": 2e10,
                                             "range": (1e10, 2e10)},
            "opt_repeats": 3, "op_min_time_s": 2.0, "step_min_time_s": 5.0, "max_spread": 0.2,
            "weight_scale": 16.0}


def _step(name, speedup, scale=1.0):
    return {"sample": name, "family": "ort-training", "scale": scale, "weights_scaled": 4,
            "chains": 2, "unfused_ms": 10.0 * speedup, "fused_ms": 10.0, "speedup": speedup,
            "spread_unfused": 0.01, "spread_fused": 0.02}


def _case(label, speedup):
    return {"model": "BERT-base", "op": label, "label": label, "shape": "M=1", "unfused_ms":
            2.0 * speedup, "fused_ms": 2.0, "speedup": speedup, "max_rel_diff": 1e-7,
            "spread": 0.05}


def test_render_reports_every_section_and_judges_the_targets():
    op = {"sample": "ortt_mlp", "family": "ort-training", "rule": "r", "op": "LayerNormGrad",
          "attrs": {}, "shape": "[4, 8]", "unfused_ms": 2.0, "fused_ms": 0.5, "speedup": 4.0,
          "floor_ms": 0.25, "floor_fraction": 0.5, "spread": 0.1, "mem_part_fused_ms": 0.5,
          "mem_floor_ms": 0.25, "gemm_ms": 0.0, "part": ("LayerNorm bwd", 2.0, 0.5),
          "unfused_profile": "LayerNormalizationGrad 2.00 ms (100%)"}
    bad = {"sample": "ortt_cnn", "rule": "c", "op": "ConvBnReluGrad", "error": "x"}
    doc = R.render(_meta(), [op, bad], [], [], scaled=[_step("ortt_mlp", 1.10, 16), _step("x", 0.95, 16)],
                   outliers=[_case("LayerNormGrad", 9.0)],
                   shapes=[_case("ConvBnReluGrad", 1.2),
                           {"model": "ResNet-50", "op": "C", "label": "C", "shape": "s",
                            "error": "boom"}],
                   real=[_step("ortt_resnet50", 1.05), _step("ortt_resnet50", 1.01, 16)])
    assert doc.startswith("# fusecli benchmarks\n") and "issue #4" not in doc
    for heading in ("## Summary", "## (a)", "## (b)", "## (c)", "## (d)", "## (e)", "## (f)",
                    "## (g)"):
        assert heading in doc, heading
    summary = doc.split("## Summary")[1].split("## (a)")[0]
    assert "weights at 16x (d): lowest fused speed-up **0.95x** (x); target >= 0.97x: NOT met" \
        in summary
    assert "(e): lowest fused speed-up **9.00x**" in summary and "1 errors" in summary
    assert "(g): lowest fused speed-up **1.01x** (weights x16); target >= 1.00x: met" in summary
    assert "| ort-training | ortt_mlp | 2 | 4 (x16) | 11.00 | 10.00 | 1.100x | – | – | 1.0% / 2.0% |" \
        in doc
    assert "| ResNet-50 | C | s | ERROR: boom |" in doc
    assert ("| ort-training | ortt_mlp | LayerNormGrad | [4, 8] | 2.000 | 0.500 | 4.00x | 0.250 | "
            "0.50 | 10.0% |") in doc
    assert "|  | ortt_cnn | ConvBnReluGrad (c) | ERROR: x |" in doc
    assert "| ort-training | LayerNormGrad | [4, 8] | 0.500 | 0.250 | 2.00 |" in doc


def _with_cpu(row, cu, cf):
    return {**row, "cpu_unfused_ms": cu, "cpu_fused_ms": cf, "cpu_speedup": cu / cf}


def test_render_reports_cpu_time_next_to_wall_time():
    """Wall time stays the headline (the Summary judges it); the CPU-time columns and the
    lowest CPU-time ratio come from the worker's process CPU times where they were measured."""
    doc = R.render(_meta(), [], [], [], shapes=[_with_cpu(_case("ConvBnReluGrad", 0.95), 3.0, 2.0),
                                               _with_cpu(_case("LayerNormGrad", 2.0), 4.0, 1.0)],
                   real=[_with_cpu(_step("ortt_resnet50", 1.2), 12.0, 10.0)])
    summary = doc.split("## Summary")[1].split("## (a)")[0]
    assert ("(f): lowest fused speed-up **0.95x** (BERT-base: ConvBnReluGrad M=1) (CPU time: "
            "lowest 1.50x); target >= 1.00x: NOT met") in summary
    assert ("| BERT-base | ConvBnReluGrad | M=1 | 1.900 | 2.000 | 0.950x | 0.950x | 3.000 / 2.000 "
            "| 1.50x |") in doc
    assert "| 12.00 / 10.00 | 1.200x | 1.0% / 2.0% |" in doc


def test_case_speedup_is_the_median_of_the_paired_ratios():
    """(e)/(f): each interleaved pair's unfused / fused ratio, then their median; a drift that
    slows both runs of some pairs (a busy neighbour) moves the medians, not the pairs."""
    from fusecli.bench.cases import paired_speedup

    unf = [10.0, 10.0, 10.0, 20.0, 20.0]  # the last two pairs ran on a slowed machine
    fus = [9.0, 9.0, 9.0, 18.0, 18.0]
    res = {"a": {"times_ms": unf}, "b": {"times_ms": fus}}
    assert abs(paired_speedup(res) - 10 / 9) < 1e-12
    assert np.median(unf) / np.median(fus) == 10 / 9  # here both agree; now skew the drift
    res = {"a": {"times_ms": [10.0, 10.0, 20.0, 20.0, 20.0]},
           "b": {"times_ms": [9.0, 18.0, 18.0, 18.0, 18.0]}}  # pair 2: fused ran slowed alone
    assert abs(paired_speedup(res) - 10 / 9) < 1e-12


def test_update_splices_only_the_measured_sections_and_their_summary_lines():
    old = R.render(_meta(), [], [], [], scaled=[_step("ortt_mlp", 1.10, 16)],
                   outliers=[_case("LayerNormGrad", 9.0)], shapes=[_case("ConvBnReluGrad", 0.93)],
                   real=[_step("ortt_resnet50", 1.05)])
    meta = {**_meta(), "date": "later"}
    new = R.render(meta, [], [], [], shapes=[_case("ConvBnReluGrad", 3.3)],
                   real=[_step("ortt_resnet50", 1.25)])
    doc = R.splice(old, new, ["shapes", "real"], meta)
    summary = doc.split("## Summary")[1].split("## (a)")[0]
    assert "(f): lowest fused speed-up **3.30x**" in summary and "0.93x" not in doc
    assert "(g): lowest fused speed-up **1.25x**" in summary
    assert "(e): lowest fused speed-up **9.00x**" in summary  # kept from the old run
    assert "(d): lowest fused speed-up **1.10x**" in summary
    assert "| ort-training | ortt_mlp | 2 | 4 (x16) | 11.00 | 10.00 | 1.100x |" in doc
    assert doc.count("## (f)") == 1 and doc.count("## (g)") == 1 and doc.count("## (e)") == 1
    head = doc.split("## Summary")[0]
    rows = {ln.split(")")[0][3:]: ln for ln in head.splitlines() if ln.startswith("| (")}
    assert sorted(rows) == list("abcdefg")
    assert "| later |" in rows["f"] and "| later |" in rows["g"] and "`--update`" in rows["f"]
    assert "| d |" in rows["e"] and "`make bench`" in rows["e"]  # kept from the old run
    # splicing the same sections again replaces the rows instead of adding more
    again = R.splice(doc, new, ["shapes", "real"], meta)
    assert again.split("## Summary")[0] == head
    assert again.split("## (f)")[1] == doc.split("## (f)")[1]
    # re-measuring only (f) keeps the row of the run that (g) still comes from
    partial = R.splice(doc, new, ["shapes"], {**meta, "date": "latest"})
    rows = [ln for ln in partial.split("## Summary")[0].splitlines() if ln.startswith("| (")]
    assert len(rows) == 7 and "| latest |" in rows[5] and "| later |" in rows[6]
    assert "Re-measured" not in partial


def test_models_section_renders_steps_with_peak_memory_and_splices_into_an_older_document():
    """Section (h): the model steps with their fused ops and peak memory beside the times, the
    ops table, a Summary line judged on the steps; --update into a document written before (h)
    existed appends the section and adds its Summary line after the others."""
    step = {**_step("ortt_tv_mobilenet_v2_bench", 1.4), "fused_ops": "ConvBnReluGrad 52",
            "peak_unfused": 54 * 2**20, "peak_fused": 53 * 2**20}
    slow = {**_step("torch_llama_bench", 0.9), "fused_ops": "RotaryEmbeddingGrad 4"}
    before = {**_step("ortt_llama_bench", 1.07), "fused_ops_without": "RMSNormGrad 5",
              "fused_ops": "RMSNormGrad 5, RotaryEmbeddingGrad 4", "peak_unfused": 34 * 2**20,
              "peak_fused": 30 * 2**20}
    models = {"steps": [step, slow], "before": [before],
              "ops": [_case("GatedActivationGrad silu (swiglu)", 2.0)]}
    doc = R.render(_meta(), [], [], [], models=models)
    h = doc.split("## (h)")[1]
    assert ("| ort-training | ortt_tv_mobilenet_v2_bench | ConvBnReluGrad 52 | 14.00 | 10.00 | "
            "1.400x |") in h
    assert h.split("ortt_tv_mobilenet_v2_bench")[1].split("\n")[0].endswith("| 54.0 | 53.0 |")
    # no peak measured: dashes
    assert h.split("| torch_llama_bench |")[1].split("\n")[0].endswith("% | – | – |")
    assert "GatedActivationGrad silu (swiglu)" in h
    assert ("| ort-training | ortt_llama_bench | RMSNormGrad 5 / RMSNormGrad 5, "
            "RotaryEmbeddingGrad 4 | 10.70 | 10.00 | 1.070x |") in h
    assert h.split("| 1.070x |")[1].split("\n")[0].endswith("| 34.0 | 30.0 |")
    summary = doc.split("## Summary")[1].split("## (a)")[0]
    assert "(h): lowest fused speed-up **0.90x** (torch_llama_bench)" in summary
    assert "target >= 1.00x: NOT met" in summary.split("(h)")[1]
    old = R.render(_meta(), [], [], [], real=[_step("ortt_resnet50", 1.05)])
    assert "(h)" not in old
    spliced = R.splice(old, doc, ["models"], _meta())
    lines = spliced.split("## Summary")[1].split("## (a)")[0].strip().splitlines()
    assert lines[-1].startswith("- MobileNetV2 and Llama") and "(g)" in lines[-2]
    assert spliced.count("## (h)") == 1 and spliced.split("## (h)")[1] == h


def test_bench_worker_reports_process_cpu_time(tmp_path):
    """The worker measures each model's process CPU time per run next to the wall time (the
    suite's CPU-time columns); both are positive medians of the timed runs."""
    import onnx

    from fusecli.runtime.bench import run_bench
    from fusecli.bench.measure import cpu_cols

    c = S.layernorm_case("t", 64, 256, np.random.default_rng(0))
    pa, pb = tmp_path / "u.onnx", tmp_path / "f.onnx"
    onnx.save(c.unfused, str(pa))
    onnx.save(c.fused, str(pb))
    res = run_bench(pa, pb, runs=5, warmup=1, threads=2, feeds=c.feeds, peak_memory=False)
    for k in ("a", "b"):
        assert res[k]["cpu_median_ms"] > 0 and res[k]["median_ms"] > 0
    cols = cpu_cols(res)
    assert cols["cpu_speedup"] == cols["cpu_unfused_ms"] / cols["cpu_fused_ms"]


def _opt_row(graph, nodes, family="torch-joint", ok=True):
    return {"graph": graph, "family": family, "nodes": nodes, "copies": 1, "load_s": 0.1,
            "pass_s": 1.0, "save_s": 0.1, "total_s": 1.2, "cpu_s": 1.1, "cli_s": 2.0,
            "us_per_node": 1.2e6 / nodes, "fused": 7, "expected": 7, "counts_ok": ok}


def test_update_re_renders_the_optimizer_section_with_the_raw_export_row():
    old = R.render(_meta(), [], [], [_opt_row("deep_5k.onnx", 5000)],
                   scaled=[_step("ortt_mlp", 1.1, 16)])
    meta = {**_meta(), "date": "later"}
    new = R.render(meta, [], [], [_opt_row("deep_5k.onnx", 5000),
                                  _opt_row("torch_llama_raw_L44.onnx", 31236,
                                           "torch-joint (raw export)", ok=False)])
    doc = R.splice(old, new, ["optimizer"], meta)
    section = doc.split(R.OPT_HEADING)[1].split("## (d)")[0]
    assert "| torch-joint (raw export) | torch_llama_raw_L44.onnx | 31236 |" in section
    assert section.count("MISMATCH") == 1 and "deep_5k.onnx" in section
    assert doc.count(R.OPT_HEADING) == 1
    assert doc.split("## (d)")[1] == old.split("## (d)")[1]  # (d) kept from the old run
