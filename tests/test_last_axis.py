"""The rule language's `{last_axis: true}` attribute form (issue 36 item 1): an axis / axes
attribute that names the last axis of the tensor it indexes, -1 or rank-1, with the default of
the model's opset when absent (Softmax's axis is 1 before opset 13: a flattening softmax).

- ort-training exports with the forward at opset 12 (tests/data/make_rope_spellings.py,
  `_opset12`: Softmax(axis=3) and com.microsoft SoftmaxGrad(axis=3) on rank-4 scores) fuse
  their one attention as flash attention and verify (the fused model against the original, and
  each fused op's NumPy reference against the original's subgraph).
- Negatives on mutated copies: axis 1 (opset 12: normalises over the flattened axes 1..3), an
  absent axis (opset 12's default 1), a SoftmaxGrad of another axis, and axis 3 of a tensor
  whose rank is not recorded: not fused, and explain names the axis.
- Unit tests of matcher.check_attr's last_axis form and of its loading (rules.parse_rule).
- A ReduceSum below opset 13 (axes an attribute) is seen by the rules in the input form
  (GraphIndex.axes_attributes_as_inputs): an opset-12 export's bias gradient fuses with its
  Linear + GELU (tests/test_flash_mask.py's opset-12 exports); axes that are not the leading
  axes are refused.
"""

from __future__ import annotations

import copy
from pathlib import Path

import onnx
import pytest
import yaml
from onnx import helper

from test_flash import assert_verifies
from test_rope import _upto

from fusecli import FusionPass
from fusecli.engine.explain import explain_model
from fusecli.engine.graph import GraphIndex
from fusecli.engine.matcher import check_attr
from fusecli.engine.rules import AttrConstraint, parse_rule
from fusecli.errors import RuleError

DATA = Path(__file__).parent / "data"
# make_rope_spellings.py's Attention: one unmasked softmax(q k^T / sqrt(d)) v per export
OPSET12 = ["llama", "neox_partial", "gptj", "bad_slice", "bad_concat"]
LAST = AttrConstraint(last_axis=True)


def _path(style):
    return DATA / f"ortt_rope_sp_{style}_opset12.onnx"


def _fuse(m):
    fp = FusionPass()
    fp.run(m)
    return fp.stats


@pytest.mark.parametrize("style", OPSET12)
def test_opset12_exports_fuse_their_attention_as_flash_and_verify(style, tmp_path):
    m = onnx.load(_path(style))
    assert next(o.version for o in m.opset_import if o.domain == "") == 12
    sm = [n for n in m.graph.node if n.op_type == "Softmax"]
    sg = [n for n in m.graph.node if n.op_type == "SoftmaxGrad"]
    assert len(sm) == len(sg) == 1  # the export's spelling: pre-13 Softmax and its gradient
    fused = copy.deepcopy(m)
    stats = _fuse(fused)
    assert stats.rules["flash_ortt_plain"].fused == 1
    assert stats.patterns["flash_attention"].fused == 1
    assert stats.patterns["sdpa"].fused == 0
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("FlashAttention") == ops.count("FlashAttentionGrad") == 1
    assert "Softmax" not in ops and "SoftmaxGrad" not in ops
    assert_verifies(_path(style), fused, stats, tmp_path)


# --- negatives ---------------------------------------------------------------------------------

def _softmaxes(m):
    return (next(n for n in m.graph.node if n.op_type == "Softmax"),
            next(n for n in m.graph.node if n.op_type == "SoftmaxGrad"))


def _set_axis(node, value):
    keep = [a for a in node.attribute if a.name != "axis"]
    del node.attribute[:]
    node.attribute.extend(keep)
    if value is not None:
        node.attribute.append(helper.make_attribute("axis", value))


def _flash_misses(m):
    fp = FusionPass(rules=_upto("flash_ortt_plain"))
    return [x for x in explain_model(m, fp, include_shallow=True)
            if x["rule"] == "flash_ortt_plain"]


def _assert_not_flash(m, *needles):
    stats = _fuse(copy.deepcopy(m))
    assert stats.patterns["flash_attention"].fused == 0
    assert stats.patterns["sdpa"].fused == 0
    misses = _flash_misses(m)
    details = [x["detail"] for x in misses if x["reason"] == "attribute"]
    assert details, misses
    assert any(all(s in d for s in needles) for d in details), details


def test_flattening_softmax_at_opset12_is_not_flash():
    """Softmax(axis=1) of rank-4 scores at opset 12 normalises over heads x queries x keys
    together: not attention's softmax."""
    m = onnx.load(_path("llama"))
    sm, sg = _softmaxes(m)
    _set_axis(sm, 1)
    _set_axis(sg, 1)
    _assert_not_flash(m, "attribute axis = 1", "opset 12", "normalises over axes 1..3",
                      "-1 or 3")


def test_absent_axis_is_opset12s_default_1():
    m = onnx.load(_path("llama"))
    sm, _ = _softmaxes(m)
    _set_axis(sm, None)
    _assert_not_flash(m, "absent (default 1 at opset 12)")


def test_softmax_grad_of_another_axis_is_not_flash():
    m = onnx.load(_path("llama"))
    _, sg = _softmaxes(m)
    _set_axis(sg, 2)
    _assert_not_flash(m, "attribute axis = 2", "normalises over axes 2..3")


def _without_ranks(m):
    """The model with no recorded shape for the Softmax's and SoftmaxGrad's tensors."""
    sm, sg = _softmaxes(m)
    names = set(sm.input) | set(sm.output) | set(sg.input) | set(sg.output)
    keep = [v for v in m.graph.value_info if v.name not in names]
    del m.graph.value_info[:]
    m.graph.value_info.extend(keep)
    return m


def test_rank_unknown_only_minus_one_is_the_last_axis(tmp_path):
    m = _without_ranks(onnx.load(_path("llama")))
    _assert_not_flash(m, "attribute axis = 3", "is not recorded")
    # the same graph with axis -1 (the same softmax at any opset): fused and verified
    sm, sg = _softmaxes(m)
    _set_axis(sm, -1)
    _set_axis(sg, -1)
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    fused = copy.deepcopy(m)
    stats = _fuse(fused)
    assert stats.patterns["flash_attention"].fused == 1
    assert_verifies(src, fused, stats, tmp_path)


# --- check_attr's last_axis form ----------------------------------------------------------------

def _index(op, attrs, rank=4, opset=12, domain="", out_rank=None, n_in=1):
    shape = None if rank is None else [2] * rank
    ins = [f"x{i}" for i in range(n_in)]
    node = helper.make_node(op, ins, ["y"], domain=domain, **attrs)
    vis = [helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, shape) for t in ins]
    if out_rank is not None:
        vis.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2] * out_rank))
    g = helper.make_graph([node], "g", [], [], value_info=vis if shape is not None or out_rank
                          is not None else [])
    imports = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    ix = GraphIndex(g, imports)
    return ix.nodes[0], ix


@pytest.mark.parametrize("op,attrs,rank,opset,ok", [
    ("Softmax", {"axis": -1}, 4, 12, True),
    ("Softmax", {"axis": 3}, 4, 12, True),
    ("Softmax", {"axis": 3}, 4, 17, True),
    ("Softmax", {"axis": 3}, None, 17, False),   # rank unknown: only -1
    ("Softmax", {"axis": -1}, None, 12, True),
    ("Softmax", {"axis": 1}, 4, 12, False),      # flattens axes 1..3
    ("Softmax", {"axis": 2}, 4, 17, False),      # axis 2 alone
    ("Softmax", {"axis": -2}, 4, 17, False),
    ("Softmax", {}, 4, 12, False),               # default 1 before opset 13
    ("Softmax", {}, 2, 12, True),                # ... the last axis of a matrix
    ("Softmax", {}, 4, 13, True),                # default -1 from opset 13
    ("LogSoftmax", {}, 3, 11, False),
    ("LogSoftmax", {"axis": 2}, 3, 11, True),
    ("ReduceMean", {"axes": [-1]}, 3, 12, True),
    ("ReduceMean", {"axes": [2]}, 3, 12, True),
    ("ReduceMean", {"axes": [1]}, 3, 12, False),
    ("ReduceMean", {"axes": [1, 2]}, 3, 12, False),
    ("ReduceMean", {"axes": [2]}, None, 12, False),
])
def test_last_axis_of_onnx_ops(op, attrs, rank, opset, ok):
    node, ix = _index(op, attrs, rank, opset)
    got, _, detail = check_attr(node, next(iter(attrs), "axis"), LAST, ix)
    assert got == ok, detail
    if not ok:
        assert "rule wants the last axis" in detail


@pytest.mark.parametrize("op,attrs,rank,ok", [
    ("SoftmaxGrad", {}, 4, False),        # onnxruntime's pre-13 gradient: default 1
    ("SoftmaxGrad", {}, 2, True),
    ("SoftmaxGrad", {"axis": 3}, 4, True),
    ("SoftmaxGrad_13", {}, 4, True),      # default -1
    ("SoftmaxGrad_13", {"axis": 1}, 4, False),
    ("LogSoftmaxGrad", {"axis": 1}, 4, False),
])
def test_last_axis_of_onnxruntime_gradients(op, attrs, rank, ok):
    node, ix = _index(op, attrs, rank, domain="com.microsoft", n_in=2)
    got, _, detail = check_attr(node, "axis", LAST, ix)
    assert got == ok, detail


def test_flattening_is_named_in_the_detail():
    node, ix = _index("Softmax", {"axis": 1}, 4, 12)
    _, _, detail = check_attr(node, "axis", LAST, ix)
    assert detail == ("attribute axis = 1 (opset 12: it flattens at axis 1 and normalises over "
                      "axes 1..3 together), rule wants the last axis: -1 or 3 (of the rank-4 "
                      "tensor it indexes)")
    node, ix = _index("Softmax", {"axis": 1}, 4, 13)
    _, _, detail = check_attr(node, "axis", LAST, ix)
    assert "flattens" not in detail


def test_rank_from_the_other_input_or_output():
    # SoftmaxGrad(dY, Y): dY's shape not recorded, Y's is
    node = helper.make_node("SoftmaxGrad_13", ["dy", "y"], ["dx"], domain="com.microsoft", axis=3)
    g = helper.make_graph([node], "g", [], [], value_info=[
        helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 3, 4])])
    ix = GraphIndex(g, [helper.make_opsetid("com.microsoft", 1)])
    assert check_attr(ix.nodes[0], "axis", LAST, ix)[0]


def test_unsqueeze_axes_index_its_output():
    # Unsqueeze(x rank 3, axes [3]) appends a last axis: axes index the rank-4 output
    node, ix = _index("Unsqueeze", {"axes": [3]}, 3, 12, out_rank=4)
    assert check_attr(node, "axes", LAST, ix)[0]
    node, ix = _index("Unsqueeze", {"axes": [2]}, 3, 12, out_rank=4)
    assert not check_attr(node, "axes", LAST, ix)[0]


def test_without_an_index_only_minus_one():
    node, _ = _index("Softmax", {"axis": 3}, 4, 12)
    assert not check_attr(node, "axis", LAST)[0]
    node, _ = _index("Softmax", {"axis": -1}, 4, 12)
    assert check_attr(node, "axis", LAST)[0]


# --- loading ---------------------------------------------------------------------------------

def _rule(attrs, op="Softmax"):
    return yaml.safe_dump({
        "name": "t_last_axis", "pattern": "activation_grad", "order": 1,
        "family": "ort-training",
        "nodes": [{"id": "a", "op": op, "inputs": ["X"], "attrs": attrs, "outputs": ["Y"]},
                  {"id": "b", "op": "Mul", "inputs": ["Y", "dY"], "outputs": ["dZ"]}],
        "replace": {"op": "ActivationGrad", "inputs": ["dY", "X"], "outputs": ["dZ"],
                    "attrs": {"activation": "relu"}}}), "r.yaml"


def test_last_axis_loads_with_capture():
    r = parse_rule(*_rule({"axis": {"last_axis": True, "capture": "axis"}}))
    c = r.nodes[0].attrs["axis"]
    assert c.last_axis and c.capture == "axis"


@pytest.mark.parametrize("attrs,op,msg", [
    ({"axis": {"last_axis": 1}}, "Softmax", "last_axis must be true"),
    ({"axis": {"last_axis": True, "equals": -1}}, "Softmax", "combines only with capture"),
    ({"alpha": {"last_axis": True}}, "LeakyRelu", "needs an integer"),
])
def test_last_axis_misuse_is_refused(attrs, op, msg):
    with pytest.raises(RuleError, match=msg):
        parse_rule(*_rule(attrs, op))


# --- ReduceSum's axes attribute below opset 13 ----------------------------------------------------

def _reduce_index(opset, op="ReduceSum", axes=(0, 1)):
    node = helper.make_node(op, ["x"], ["y"], axes=list(axes), keepdims=0)
    g = helper.make_graph([node], "g", [], [])
    return GraphIndex(g, [helper.make_opsetid("", opset)])


def test_reduce_sum_axes_attribute_is_read_as_an_input_below_opset_13():
    ix = _reduce_index(12)
    assert ix.axes_attributes_as_inputs() == 1
    node = ix.nodes[0]
    assert node.inputs[0] == "x" and len(node.inputs) == 2
    assert ix.const_value(node.inputs[1]).tolist() == [0, 1]
    assert list(node.proto.input) == ["x"] and node.attrs["axes"] == [0, 1]  # proto untouched
    assert ix.consumers[node.inputs[1]] == [node]
    for other in (_reduce_index(13), _reduce_index(12, op="ReduceMean")):
        assert other.axes_attributes_as_inputs() == 0
        assert other.nodes[0].inputs == ["x"]


def test_opset12_bias_gradient_over_other_axes_is_not_fused():
    """The opset-12 export's Linear + GELU bias gradient summed over axis 1 only (not the
    leading axes [0, 1] of the [B, S, N] gradient): linear_gelu refuses it, explain names it."""
    m = onnx.load(DATA / "ortt_flash_where_causal_opset12.onnx")
    act = next(n for n in m.graph.node if n.op_type == "GeluGrad")
    rs = [n for n in m.graph.node if n.op_type == "ReduceSum" and act.output[0] in n.input]
    assert len(rs) == 1
    axes = [helper.get_attribute_value(a) for a in rs[0].attribute if a.name == "axes"]
    assert len(axes) == 1 and sorted(axes[0]) == [0, 1]  # onnxruntime writes [1, 0]
    good = _fuse(copy.deepcopy(m))
    assert good.patterns["linear_gelu"].fused == 1
    for a in rs[0].attribute:
        if a.name == "axes":
            a.ints[:] = [1]
    bad = _fuse(copy.deepcopy(m))
    assert bad.patterns["linear_gelu"].fused == 0
    assert bad.patterns["flash_attention"].fused == 1
    fp = FusionPass(rules=_upto("linear_gelu_ortt_matmul"))
    misses = [x for x in explain_model(m, fp, include_shallow=True)
              if x["rule"] == "linear_gelu_ortt_matmul"]
    assert any("every axis but the last" in x["detail"] for x in misses), misses
