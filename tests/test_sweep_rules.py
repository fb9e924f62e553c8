"""Rules added for spellings found by the architecture sweep (SWEEP.md: real third-party models
the committed corpus lacks, generated with `scripts/corpus/gen.py --out build/sweep`).

act_gelu_tanh_bloom_grad_torch: BLOOM's GELU (transformers BloomGelu, a torch.autograd.Function
with a hand-written backward that shares the forward's tanh). Positive fixture: the real torch
2.13 export tests/data/torch_bloom_gelu.onnx (make_torch_bloom_gelu.py), fused into
LinearActivationGrad{gelu_tanh} and verified. Negatives, one per guard, each on a mutated copy:
every constant the rule checks (the kept forward's a, k and 1 as well as the backward's), a
wrong op, an extra consumer of a removed intermediate; each must leave the chain unfused and
`explain` must name the reason.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusecli import FusionPass, load_rules
from fusecli.explain import explain_model
from fusecli.verify import verify_models

DATA = Path(__file__).parent / "data"
RULES = load_rules()
BLOOM = "act_gelu_tanh_bloom_grad_torch"
BLOOM_RULE = next(r for r in RULES if r.name == BLOOM)
GUARD_FIXTURE_RULES = ("act_gelu_tanh_bloom_grad_torch",)


def _upto(rule_name):
    rule = next(r for r in RULES if r.name == rule_name)
    return [r for r in RULES if (r.order, r.name) <= (rule.order, rule.name)]


def _bloom():
    return onnx.load(DATA / "torch_bloom_gelu.onnx")


def _records(model, rule_name=BLOOM):
    fp = FusionPass(rules=_upto(rule_name))
    fp.run(model)
    return [f for f in fp.stats.fusions if f.rule == rule_name]


def _reasons(model, rule_name=BLOOM):
    misses = explain_model(model, FusionPass(rules=_upto(rule_name)), include_shallow=True)
    return {m["reason"] for m in misses if m["rule"] == rule_name}, misses


def test_bloom_gelu_positive_fuses_and_verifies(tmp_path):
    assert len(_records(_bloom())) == 1
    m = _bloom()
    fp = FusionPass()
    fp.run(m)
    assert {f.rule for f in fp.stats.fusions} == {"linear_gelu_tanh_torch"}
    assert fp.stats.patterns["linear_gelu"].fused == 1
    assert all(n.op_type != "ActivationGrad" for n in m.graph.node)
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(DATA / "torch_bloom_gelu.onnx", out)
    assert report.ok and report.max_rel <= 1e-5, report


@pytest.mark.parametrize("var", sorted(BLOOM_RULE.tensors))
def test_bloom_gelu_negative_wrong_constant(var):
    model = _bloom()
    rec = _records(copy.deepcopy(model))[0]
    tensor = rec.tensors[var]
    # the node of the match that reads this constant (kept forward nodes are not in
    # rec.nodes: found as the producer of the tensor bound to their output)
    spec = next(s for s in BLOOM_RULE.nodes if var in s.inputs)
    out = rec.tensors[spec.outputs[0]]
    node = next(n for n in model.graph.node if out in n.output)
    init = next(t for t in model.graph.initializer if t.name == tensor)
    bad = numpy_helper.to_array(init) * 1.01
    model.graph.initializer.append(numpy_helper.from_array(np.asarray(bad), f"{tensor}_bad"))
    node.input[list(node.input).index(tensor)] = f"{tensor}_bad"
    assert _records(copy.deepcopy(model)) == []
    reasons, misses = _reasons(model)
    assert "constant" in reasons, misses


def test_bloom_gelu_negative_wrong_op():
    # the backward's 1 - t t spelled 1 + t t: not the derivative of tanh
    model = _bloom()
    rec = _records(copy.deepcopy(model))[0]
    node = next(n for n in model.graph.node if n.name == rec.nodes["sech2"])
    node.op_type = "Add"
    assert _records(copy.deepcopy(model)) == []
    reasons, misses = _reasons(model)
    assert "op_type" in reasons or "no_candidate" in reasons, misses


def test_bloom_gelu_negative_intermediate_consumed_outside():
    model = _bloom()
    rec = _records(copy.deepcopy(model))[0]
    sw = next(n for n in model.graph.node if n.name == rec.nodes["sw"]).output[0]
    model.graph.node.append(helper.make_node("Identity", [sw], ["peek"], name="peek"))
    model.graph.output.append(helper.make_tensor_value_info("peek", onnx.TensorProto.FLOAT, None))
    assert _records(copy.deepcopy(model)) == []
    reasons, misses = _reasons(model)
    assert "intermediate_consumed_outside" in reasons, misses
