"""The real `fusecli` entry point: commands, JSON shape, exit codes, CI mode."""

from __future__ import annotations

import hashlib
import json

import onnx
import yaml

from conftest import SAMPLES, run_cli

from fusecli import CANONICAL_PATTERNS

REPORT_KEYS = {"model", "nodes_before", "nodes_after", "total_fused", "patterns", "rules",
               "buffers_eliminated", "bytes_eliminated", "saved_activations",
               "tied_gradients_folded", "embedding_gradients_planned"}


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_optimize_json_is_one_object_with_every_pattern(tmp_path):
    src = SAMPLES / "ortt_mlp.onnx"
    before = _sha(src)
    proc = run_cli("optimize", src, "-o", tmp_path / "o.onnx", "--json")
    d = json.loads(proc.stdout)  # exactly one JSON document on stdout
    assert set(d) == REPORT_KEYS
    assert set(CANONICAL_PATTERNS) <= set(d["patterns"])
    for p in d["patterns"].values():
        assert set(p) == {"detected", "fused", "skipped"}
    for r in d["rules"].values():
        assert set(r) == {"pattern", "detected", "fused"}
    assert d["total_fused"] == 4 and d["nodes_before"] == 55
    assert "wrote" in proc.stderr  # logs on stderr
    assert _sha(src) == before


def test_human_table(tmp_path):
    proc = run_cli("optimize", SAMPLES / "ortt_block.onnx", "-o", tmp_path / "o.onnx")
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("fused 4 chain(s)")
    row = next(ln for ln in lines if ln.strip().startswith("layernorm"))
    assert row.split()[1:3] == ["2", "2"]


def test_dry_run_writes_nothing(tmp_path):
    out = tmp_path / "o.onnx"
    proc = run_cli("optimize", SAMPLES / "ortt_cnn.onnx", "-o", out, "--dry-run")
    assert not out.exists()
    # 2 Conv+BN+ReLU, the Conv+BN shortcut (conv_bn) and the Linear head + loss (lce_ortt_gemm)
    assert "would fuse 4" in proc.stdout
    run_cli("optimize", SAMPLES / "ortt_cnn.onnx", "--dry-run")  # -o not needed


def test_only_and_skip(tmp_path):
    d = json.loads(run_cli("optimize", SAMPLES / "ortt_block.onnx", "-o", tmp_path / "a.onnx",
                           "--only", "layernorm", "--json").stdout)
    assert d["total_fused"] == 2 and d["patterns"]["layernorm"]["fused"] == 2
    d = json.loads(run_cli("optimize", SAMPLES / "ortt_block.onnx", "-o", tmp_path / "b.onnx",
                           "--skip", "layernorm", "--skip", "sdpa", "--skip", "flash_attention",
                           "--json").stdout)
    assert d["total_fused"] == 1 and d["patterns"]["linear_gelu"]["fused"] == 1
    proc = run_cli("optimize", SAMPLES / "ortt_block.onnx", "-o", tmp_path / "c.onnx",
                   "--only", "nosuch", check_rc=2)
    assert proc.stderr.count("\n") == 1 and "no rule or pattern named 'nosuch'" in proc.stderr


def test_missing_output_is_a_usage_error():
    proc = run_cli("optimize", SAMPLES / "ortt_mlp.onnx", check_rc=2)
    assert "missing -o/--output" in proc.stderr and "Traceback" not in proc.stderr


def test_stats_detection_and_inventory(tmp_path):
    d = json.loads(run_cli("stats", SAMPLES / "torch_block.onnx", "--json").stdout)
    assert d["patterns"]["flash_attention"]["detected"] == 1 and d["total_fused"] == 4
    assert d["already_fused"]["fused_ops"] == {}
    out = tmp_path / "o.onnx"
    run_cli("optimize", SAMPLES / "torch_block.onnx", "-o", out, "-q")
    d = json.loads(run_cli("stats", out, "--json").stdout)
    # the model's Linear + GELU, its attention (forward and backward ops), its two LayerNorms
    fused_ops = d["already_fused"]["fused_ops"]
    assert fused_ops.pop("LayerNormGrad") == 2 and fused_ops.pop("LinearActivationGrad") == 1
    assert fused_ops == {"FlashAttention": 1, "FlashAttentionGrad": 1}
    assert d["total_fused"] == 0
    assert "fused ops already in the model" in run_cli("stats", out).stdout


def test_stats_reports_skips_with_reasons(tmp_path):
    m = onnx.load(SAMPLES / "ortt_mlp.onnx")
    relu = next(n for n in m.graph.node if n.op_type == "ReluGrad")
    m.graph.output.append(onnx.helper.make_tensor_value_info(relu.output[0],
                                                             onnx.TensorProto.FLOAT, None))
    onnx.save(m, tmp_path / "m.onnx")
    d = json.loads(run_cli("stats", tmp_path / "m.onnx", "--json").stdout)
    assert d["patterns"]["linear_relu"]["skipped"] == {"intermediate_is_graph_output": 1}
    assert any(s["reason"] == "intermediate_is_graph_output" for s in d["skips"])


def test_rules_list_show_validate(tmp_path):
    listing = json.loads(run_cli("rules", "list", "--json").stdout)
    names = [r["name"] for r in listing]
    orders = [r["order"] for r in listing]
    assert orders == sorted(orders) and "layernorm_ortt" in names
    shown = run_cli("rules", "show", "layernorm_ortt").stdout
    assert "LayerNormalizationGrad" in shown
    assert yaml.safe_load(shown.split("\n", 1)[1])["name"] == "layernorm_ortt"
    assert "rule(s) valid" in run_cli("rules", "validate").stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\npattern: y\norder: 1\nnodes:\n  - id: a\n    op: Relu\n"
                   "    outputs: [o]\nreplace:\n  op: NoSuchOp\n")
    proc = run_cli("rules", "validate", bad, check_rc=2)
    assert f"{bad}:9" in proc.stderr and "NoSuchOp" in proc.stderr
    run_cli("rules", "show", "nosuch", check_rc=2)


def test_ops_command():
    assert "com.fusecli::LayerNormGrad" in run_cli("ops").stdout
    assert "dGamma" in run_cli("ops", "LayerNormGrad").stdout


def test_expect_and_baseline_exit_3(tmp_path):
    src = SAMPLES / "torch_mlp.onnx"
    exp = tmp_path / "exp.yaml"
    exp.write_text("linear_relu: 2\nlinear_gelu: 1\n")
    run_cli("optimize", src, "-o", tmp_path / "a.onnx", "--expect", exp, "-q")
    exp.write_text("linear_relu: 3\nsdpa: 1\n")
    proc = run_cli("optimize", src, "-o", tmp_path / "b.onnx", "--expect", exp, "-q",
                   check_rc=3)
    lines = [ln for ln in proc.stderr.splitlines() if "regression" in ln]
    assert len(lines) == 2 and "linear_relu: fused 2, expected at least 3" in lines[0]
    base = tmp_path / "base.json"
    base.write_text(run_cli("optimize", src, "-o", tmp_path / "c.onnx", "--json").stdout)
    run_cli("optimize", src, "-o", tmp_path / "d.onnx", "--baseline", base, "-q")
    proc = run_cli("optimize", src, "-o", tmp_path / "e.onnx", "--baseline", base, "-q",
                   "--skip", "linear_gelu", check_rc=3)
    assert "linear_gelu: fused 0, baseline had 1" in proc.stderr
    exp.write_text("- not a mapping\n")
    run_cli("optimize", src, "-o", tmp_path / "f.onnx", "--expect", exp, check_rc=2)


def test_explain_cli_json(tmp_path):
    m = onnx.load(SAMPLES / "ortt_mlp.onnx")
    gemm = next(n for n in m.graph.node if n.op_type == "Gemm" and n.name.endswith("Gemm_0")
                and any(a.name == "transA" and a.i == 1 for a in n.attribute))
    for a in gemm.attribute:
        if a.name == "alpha":
            a.f = 2.0
    onnx.save(m, tmp_path / "m.onnx")
    d = json.loads(run_cli("explain", tmp_path / "m.onnx", "--node", gemm.name,
                           "--json").stdout)
    assert any(x["reason"] == "attribute" and "alpha" in x["detail"] for x in d["misses"])
    text = run_cli("explain", tmp_path / "m.onnx", "--node", gemm.name).stdout
    assert "rule wants 1.0" in text


def test_python_module_entry_point():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "fusecli", "rules", "list"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "sdpa_ortt_scores_plain" in proc.stdout


def test_optimize_verify_json_stays_one_object(tmp_path):
    proc = run_cli("optimize", SAMPLES / "torch_mlp.onnx", "-o", tmp_path / "o.onnx", "--verify",
                   "--json", "-q")
    d = json.loads(proc.stdout)
    assert d["verify"]["ok"] and d["verify"]["runtime"].startswith("onnxruntime ")
    assert set(d) == REPORT_KEYS | {"verify"}
