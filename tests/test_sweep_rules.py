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


# --- sdpa_ortt_scores_plain: attention on a 3-D [B*H, S, S] view (BLOOM, DeBERTa-v2) ---------

MS = "com.microsoft"


def _vi(name, shape):
    return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)


def ortt_attention_3d(*, dropout=False, p_rows=None, B=2, H=2, S=4, D=3):
    """BLOOM's ort-training spelling: S3 = MatMul(Q3, K3^T) [B*H, S, S] -> Mul(c) -> Reshape
    [B, H, S, S] -> Add(mask) -> Softmax -> [Dropout ->] Reshape [B*H, S, S] -> MatMul(., V3);
    backward FusedMatMul(dO, V3) -> Reshape -> [DropoutGrad ->] SoftmaxGrad_13 -> Identity (the
    mask Add) -> Reshape -> Mul(c) -> FusedMatMul x2. p_rows: view P as [B*H, p_rows, S*S //
    p_rows] instead (its rows are no softmax rows; V3 then has S*S // p_rows rows)."""
    bh = B * H
    pr = S if p_rows is None else p_rows
    pc = S * S // pr
    c = float(1 / np.sqrt(D))
    mm = dict(domain=MS, alpha=1.0)
    p_in = "Pd" if dropout else "P0"
    dp_out = "dPd" if dropout else "dP0"
    nodes = [
        helper.make_node("MatMul", ["Q", "Kt"], ["S3"], name="qk"),
        helper.make_node("Mul", ["S3", "c"], ["S3s"], name="fwd_scale"),
        helper.make_node("Reshape", ["S3s", "shape4"], ["S4"], name="fwd_view_s"),
        helper.make_node("Add", ["S4", "mask"], ["Sm"], name="fwd_mask"),
        helper.make_node("Softmax", ["Sm"], ["P0"], axis=-1, name="softmax"),
        helper.make_node("Reshape", [p_in, "shape_p"], ["P3"], name="fwd_view_p"),
        helper.make_node("MatMul", ["P3", "V"], ["O"], name="pv"),
        helper.make_node("FusedMatMul", ["P3", "dO"], ["dV"], transA=1, transB=0, name="dv", **mm),
        helper.make_node("FusedMatMul", ["dO", "V"], ["dP3"], transA=0, transB=1, name="dp", **mm),
        helper.make_node("Reshape", ["dP3", "shape4"], [dp_out], name="bwd_view_p"),
        helper.make_node("SoftmaxGrad_13", ["dP0", "P0"], ["dS0"], axis=-1, domain=MS, name="sg"),
        helper.make_node("Identity", ["dS0"], ["dS4"], name="bwd_mask"),
        helper.make_node("Reshape", ["dS4", "shape3"], ["dS3"], name="bwd_view_s"),
        helper.make_node("Mul", ["dS3", "c"], ["dS"], name="bwd_scale"),
        helper.make_node("FusedMatMul", ["dS", "Kt"], ["dQ"], transA=0, transB=1, name="dq", **mm),
        helper.make_node("FusedMatMul", ["Q", "dS"], ["dKt"], transA=1, transB=0, name="dk", **mm),
    ]
    inits = [numpy_helper.from_array(np.float32(c), "c"),
             numpy_helper.from_array(np.array([B, H, S, S], np.int64), "shape4"),
             numpy_helper.from_array(np.array([bh, S, S], np.int64), "shape3"),
             numpy_helper.from_array(np.array([bh, pr, pc], np.int64), "shape_p")]
    if dropout:
        nodes.insert(5, helper.make_node("Dropout", ["P0", "ratio", "train"], ["Pd", "dmask"],
                                         name="drop", seed=1))
        nodes.insert(11, helper.make_node("DropoutGrad", ["dPd", "dmask", "ratio", "train"],
                                          ["dP0"], domain=MS, name="drop_grad"))
        inits += [numpy_helper.from_array(np.float32(0.1), "ratio"),
                  numpy_helper.from_array(np.array(True), "train")]
    q, kt, v = [bh, S, D], [bh, D, S], [bh, pc, D]
    g = helper.make_graph(
        nodes, "attn3d",
        [_vi("Q", q), _vi("Kt", kt), _vi("V", v), _vi("mask", [B, 1, 1, S]),
         _vi("dO", [bh, pr, D])],
        [_vi("O", [bh, pr, D]), _vi("dQ", q), _vi("dKt", kt), _vi("dV", v)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid(MS, 1)])
    m.ir_version = 9
    m.graph.value_info.extend([_vi("S3", [bh, S, S]), _vi("S4", [B, H, S, S]),
                               _vi("P0", [B, H, S, S]), _vi("P3", [bh, pr, pc])])
    return m


def _sdpa(model):
    fp = FusionPass()
    fp.run(model)
    return fp.stats.patterns["sdpa"]


def test_attention_on_3d_view_fuses_and_verifies(tmp_path):
    m = ortt_attention_3d()
    fused = copy.deepcopy(m)
    assert _sdpa(fused).fused == 1
    [node] = [n for n in fused.graph.node if n.op_type == "AttentionGrad"]
    assert node.input[4] == "P3"  # the op reads P in the layout of Q, K, V and dO
    assert list(node.output[:3]) == ["dQ", "dKt", "dV"]
    assert not {n.op_type for n in fused.graph.node} & {"SoftmaxGrad_13", "FusedMatMul"}
    src, out = tmp_path / "m.onnx", tmp_path / "m.fused.onnx"
    onnx.save(m, src)
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


def test_attention_on_3d_view_with_dropout_before_the_view_is_not_fused():
    # Softmax -> Dropout -> Reshape: the viewed tensor is the dropped P, which the op may not
    # take as P (and the mask is in the other layout): refused
    m = ortt_attention_3d(dropout=True)
    assert _sdpa(copy.deepcopy(m)).fused == 0
    misses = explain_model(m, FusionPass(only=["sdpa_ortt_scores_plain"]))
    assert any(x["rule"] == "sdpa_ortt_scores_plain" for x in misses), misses


def test_attention_on_a_view_that_breaks_the_softmax_rows_is_not_fused():
    # P viewed as [B*H, 8, 2]: its rows are no softmax rows; the shape guard refuses
    m = ortt_attention_3d(p_rows=8)
    stats = _sdpa(copy.deepcopy(m))
    assert stats.fused == 0
    assert stats.skipped == {"shape_mismatch": 1}, stats.skipped


def test_attention_on_3d_view_extra_consumer_of_the_viewed_gradient_is_not_fused():
    m = ortt_attention_3d()
    m.graph.node.append(helper.make_node("Identity", ["dP0"], ["peek"], name="peek"))
    m.graph.output.append(_vi("peek", None))
    assert _sdpa(copy.deepcopy(m)).fused == 0
    misses = explain_model(m, FusionPass(only=["sdpa_ortt_scores_plain"]))
    assert any(x["reason"] == "intermediate_consumed_outside" for x in misses), misses
