"""The rmsnorm pattern end to end: its rules on the Llama-style samples of both families (the
residual guard of the ort-training rule, spellings the samples lack), LayerNorm and RMSNorm
never fused as each other, and `--json` / the CI gate knowing the pattern (they read it from
the contracts)."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import SAMPLES, run_cli

from fusecli import CANONICAL_PATTERNS, FusionPass, load_rules

RULES = load_rules()


def _fused(model, rules=None):
    fp = FusionPass(rules=rules)
    fp.run(model)
    out = {}
    for f in fp.stats.fusions:
        out[f.pattern] = out.get(f.pattern, 0) + 1
    return fp, out


@pytest.mark.parametrize("sample,rules", [
    ("ortt_llama", {"rmsnorm_ortt": 4, "rmsnorm_ortt_noscale": 2}),
    ("torch_llama", {"rmsnorm_torch": 2, "rmsnorm_torch_noscale": 1, "rmsnorm_torch_params": 1,
                     "rmsnorm_torch_div": 1, "rmsnorm_torch_div_noscale": 1})])
def test_llama_samples_fuse_every_rmsnorm(sample, rules):
    """Six RMSNorms per sample (rsqrt with weight over the model input; with a residual
    gradient rsqrt with and without weight, x / sqrt(...) with and without weight; final with
    weight): each fused once, by the rule of its spelling."""
    fp, counts = _fused(onnx.load(SAMPLES / f"{sample}.onnx"))
    assert counts == {"rmsnorm": 6}
    assert {k: v for k, v in ((r, fp.stats.rules[r].fused) for r in fp.stats.rules) if v} == rules


def test_ortt_noscale_captures_the_forward_epsilon():
    m = onnx.load(SAMPLES / "ortt_llama.onnx")
    FusionPass().run(m)
    nodes = [n for n in m.graph.node if n.op_type == "RMSNormGrad"]
    unscaled = [n for n in nodes if len(n.input) < 4 or not n.input[3]]
    assert len(unscaled) == 2 and all(n.input[2] == "" for n in unscaled)
    for n in unscaled:
        eps = {a.name: helper.get_attribute_value(a) for a in n.attribute}["epsilon"]
        assert eps == pytest.approx(1e-6, rel=1e-6)
        # the residual gradient (the Sum's third term) is folded in
        assert len(n.input) == 5 and n.input[4]


@pytest.mark.parametrize("sample", ["ortt_block", "torch_block", "ortt_block_mul",
                                    "ortt_block_sdpa"])
def test_layernorm_models_fuse_no_rmsnorm(sample):
    _, counts = _fused(onnx.load(SAMPLES / f"{sample}.onnx"))
    assert counts.get("layernorm") == 2 and "rmsnorm" not in counts


@pytest.mark.parametrize("sample", ["ortt_llama", "torch_llama"])
def test_rmsnorm_models_fuse_no_layernorm(sample):
    """Not even with the rmsnorm rules removed (nothing else takes their chains as LayerNorm)."""
    rules = [r for r in RULES if r.pattern != "rmsnorm"]
    _, counts = _fused(onnx.load(SAMPLES / f"{sample}.onnx"), rules)
    assert "layernorm" not in counts and "rmsnorm" not in counts

# rules whose guard fixtures are here (tests/test_rules.py::test_every_rule_has_guard_fixtures)
GUARD_FIXTURE_RULES = ("rmsnorm_ortt",)


def test_rmsnorm_ortt_residual_guard():
    """SimplifiedLayerNormalizationGrad with its residual Sum: an outside reader of the norm's
    own dX keeps the Sum outside (the fused op then produces that dX), never drops it."""
    m = onnx.load(SAMPLES / "ortt_llama.onnx")
    sln = next(n for n in m.graph.node if n.op_type == "SimplifiedLayerNormalizationGrad"
               and any(c.op_type == "Sum" and n.output[0] in c.input for c in m.graph.node))
    dx = sln.output[0]
    rules = [r for r in RULES if r.name == "rmsnorm_ortt"]
    fp, _ = _fused(copy.deepcopy(m), rules)
    with_sum = [f for f in fp.stats.fusions if dx not in f.node.output]
    assert any(len(f.node.input) == 5 and f.node.input[4] for f in with_sum)  # folded normally
    m.graph.output.append(helper.make_tensor_value_info(dx, onnx.TensorProto.FLOAT, None))
    fp, counts = _fused(m, rules)
    assert counts == {"rmsnorm": 4}
    assert any(dx in f.node.output for f in fp.stats.fusions)
    assert any(n.op_type == "Sum" and dx in n.input for n in m.graph.node)


def test_torch_rules_other_spellings(tmp_path):
    """An export that broadcasts instead of Expand, writes 2 X instead of 2 Pow(X, 1) (optional
    pass-throughs) and takes the mean as a Mul by 1/N instead of a Div by N (an op alternative)
    still fuses every RMSNorm, and the result verifies against the original."""
    m = onnx.load(SAMPLES / "torch_llama.onnx")
    g = m.graph
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in g.initializer}
    removed = {"Expand": 0, "Pow": 0, "Div": 0}
    for n in list(g.node):
        pow1 = n.op_type == "Pow" and n.input[1] in consts and float(consts[n.input[1]]) == 1.0
        if n.op_type == "Expand" or pow1:
            for c in g.node:
                for k, t in enumerate(c.input):
                    if t == n.output[0]:
                        c.input[k] = n.input[0]
            g.node.remove(n)
            removed[n.op_type] += 1
        elif n.op_type == "Div" and consts.get(n.input[1], np.zeros(2)).size == 1 and \
                float(consts[n.input[1]]) == 32.0:  # the mean over N = 32
            inv = f"{n.name}_inv_n"
            g.initializer.append(onnx.numpy_helper.from_array(np.array(1 / 32, np.float32), inv))
            n.op_type, n.input[1] = "Mul", inv
            removed["Div"] += 1
    assert removed == {"Expand": 5, "Pow": 5, "Div": 5}  # the five RMSNorms with a dX
    src = tmp_path / "spellings.onnx"
    onnx.save(m, src)
    d = json.loads(run_cli("optimize", src, "-o", tmp_path / "f.onnx", "--json").stdout)
    assert d["patterns"]["rmsnorm"]["fused"] == 6
    run_cli("verify", src, tmp_path / "f.onnx")


def test_json_and_ci_gate_know_rmsnorm(tmp_path):
    src = SAMPLES / "torch_llama.onnx"
    d = json.loads(run_cli("optimize", src, "-o", tmp_path / "a.onnx", "--json").stdout)
    assert list(d["patterns"])[:len(CANONICAL_PATTERNS)] == list(CANONICAL_PATTERNS)
    assert "rmsnorm" in CANONICAL_PATTERNS and d["patterns"]["rmsnorm"]["fused"] == 6
    assert d["rules"]["rmsnorm_torch"] == {"pattern": "rmsnorm", "detected": 2, "fused": 2}
    exp = tmp_path / "exp.yaml"
    exp.write_text("rmsnorm: 6\n")
    run_cli("optimize", src, "-o", tmp_path / "b.onnx", "--expect", exp, "-q")
    exp.write_text("rmsnorm: 7\n")
    proc = run_cli("optimize", src, "-o", tmp_path / "c.onnx", "--expect", exp, "-q", check_rc=3)
    assert "rmsnorm: fused 6, expected at least 7" in proc.stderr
    base = tmp_path / "base.json"
    base.write_text(json.dumps(d))
    proc = run_cli("optimize", src, "-o", tmp_path / "d.onnx", "--baseline", base, "-q",
                   "--skip", "rmsnorm", check_rc=3)
    assert "rmsnorm: fused 0, baseline had 6" in proc.stderr
