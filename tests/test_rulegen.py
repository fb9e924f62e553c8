"""`fusecli rules new` (fusecli/engine/rulegen.py): drafts from example subgraphs.

Every draft must parse and, loaded as the only rule, fuse exactly the example it came from.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import yaml
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from conftest import SAMPLES

from fusecli.errors import FuseError
from fusecli import FusionPass
from fusecli.commands.rules import rules_new
from fusecli.engine.rulegen import draft_rule
from fusecli.engine.rules import parse_rule

# ReluGrad + bias ReduceSum + Identity + weight-grad Gemm, and the upstream input-grad Gemm
MLP_RELU = ["/fc2/Gemm_Grad/Gemm_0", "/Relu_Grad/ReluGrad_0", "/fc1/Gemm_Grad/ReduceSum_2",
            "/fc1/Gemm_Grad/Identity_3", "/fc1/Gemm_Grad/Gemm_0"]
BLOCK_LN = ["/ln2/Mul/LayerNormFusion/_Grad/LayerNormalizationGrad_0",
            "AccumulateGrad_/Add_1_output_0_grad"]
TORCH_GELU = ["node_mul_5", "n0_2", "node_add_1", "node_mul_6", "node_mul_7", "node_mul_8",
              "node_exp", "node_mul_9", "node_mul_10", "node_add_2", "node_mul_11"]

CASES = {
    "ortt_mlp_relu": ("ortt_mlp", MLP_RELU, None, "LinearActivationGrad"),
    "ortt_block_layernorm": ("ortt_block", BLOCK_LN, None, "LayerNormGrad"),
    "torch_mlp_gelu": ("torch_mlp", TORCH_GELU, "ActivationGrad", "ActivationGrad"),
}


@pytest.fixture(scope="module")
def samples():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = onnx.load(SAMPLES / f"{name}.onnx")
        return cache[name]
    return get


def _fuse_only(model, text):
    """Fuse with the draft alone. A draft's replace ports are placeholders in pattern order (its
    header says to reorder them), so the shape guard, which would rightly refuse to write such a
    graph, is off here: these tests check what the draft binds and removes."""
    from unittest import mock

    rule = parse_rule(text, "<draft>")
    m = copy.deepcopy(model)
    fp = FusionPass(rules=[rule])
    with mock.patch("fusecli.engine.matcher.fusion_problem", return_value=None), \
            mock.patch("fusecli.engine.fusion.fusion_problem", return_value=None):
        fp.run(m)
    return rule, fp.stats, m


def _graph_order(model, names):
    pos = {n.name: i for i, n in enumerate(model.graph.node)}
    return sorted(names, key=pos.__getitem__)


# --- real samples ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_draft_matches_its_example_exactly_once(samples, case):
    sample, nodes, op, expect_op = CASES[case]
    model = samples(sample)
    text = draft_rule(model, nodes, f"draft_{case}", fused_op=op)
    assert text.startswith("# DRAFT")
    rule, stats, fused = _fuse_only(model, text)
    assert rule.replace.op == expect_op
    assert len(rule.nodes) == len(nodes)
    assert len(stats.fusions) == 1
    # pass-through nodes (the bias grad's Identity) are drafted as optional pass-throughs:
    # FusionPass sees through them (graph.bypass_passthrough) and drops them at write-back
    passthrough = {n.id for n in rule.nodes if n.optional == "passthrough"}
    assert len(passthrough) == sum("Identity" in n for n in nodes)
    assert stats.fusions[0].replaced == _graph_order(
        model, [n for n in nodes if "Identity" not in n])
    assert sum(n.domain == "com.fusecli" for n in fused.graph.node) == 1
    assert not {n.name for n in fused.graph.node} & set(nodes)
    # the draft is plain YAML with the schema's keys
    raw = yaml.safe_load(text)
    assert set(raw) >= {"name", "pattern", "order", "nodes", "replace"}
    # every node after the first shares a named tensor with an earlier one
    seen = set()
    for i, n in enumerate(rule.nodes):
        names = {t for t in n.inputs + n.outputs if t != "_"}
        assert i == 0 or names & seen, n.id
        seen |= names


def test_torch_gelu_draft_details(samples):
    model = samples("torch_mlp")
    text = draft_rule(model, TORCH_GELU, "gelu_draft", fused_op="ActivationGrad")
    rule = parse_rule(text, "<draft>")
    by_id = {n.id: n for n in rule.nodes}
    # anchor: the rarest op type in the model (Erf and Exp occur once; Erf comes first)
    assert rule.nodes[0].ops == ("Erf",)
    # fan-out preserved: x*x reads one variable twice, and x feeds three nodes
    square = next(n for n in rule.nodes if len(n.inputs) == 2 and n.inputs[0] == n.inputs[1])
    x = square.inputs[0]
    assert sum(x in n.inputs for n in rule.nodes) == 3
    assert all(n.commutative for n in rule.nodes if n.ops[0] in ("Mul", "Add"))
    assert not by_id["erf"].commutative
    # the five small constants become value constraints with a small tolerance
    consts = sorted(round(float(t.const), 4) for t in rule.tensors.values())
    assert consts == [-0.5, 0.3989, 0.5, 0.7071, 1.0]
    assert all(0 < t.tol <= 1e-5 for t in rule.tensors.values())
    assert rule.replace.inputs == ("in0", "in1") and rule.replace.outputs == ("out0",)
    assert "activation" in text.split("name:")[0]  # the header names the attribute to set
    assert rule.pattern == "activation_grad"


def test_placeholder_op_and_captured_attribute(samples):
    model = samples("ortt_block")
    text = draft_rule(model, BLOCK_LN, "ln_draft")
    rule = parse_rule(text, "<draft>")
    assert rule.replace.op == "LayerNormGrad"
    assert "placeholder" in text and "AttentionGrad" in text   # the other op that fits
    ln = rule.nodes[0]
    assert ln.ops == ("LayerNormalizationGrad",) and ln.domains == ("com.microsoft",)
    assert ln.attrs["axis"].capture == "axis" and ln.attrs["axis"].equals == -1
    assert ln.attrs["stash_type"].equals == 1
    assert rule.replace.attrs == {"axis": ("attr", "axis")}
    assert rule.nodes[1].ops == ("Sum",) and rule.nodes[1].commutative
    # LN's inputs in order, then the residual gradient
    assert rule.replace.inputs == tuple(f"in{i}" for i in range(6))
    assert len(rule.replace.outputs) == 3


def test_mlp_attributes_and_axes_constant(samples):
    model = samples("ortt_mlp")
    rule = parse_rule(draft_rule(model, MLP_RELU, "relu_draft"), "<draft>")
    assert rule.nodes[0].ops == ("ReluGrad",)
    gemms = [n for n in rule.nodes if n.ops == ("Gemm",)]
    assert sorted(n.attrs["transA"].equals for n in gemms) == [0, 1]
    assert all(n.attrs["alpha"].equals == 1.0 for n in gemms)
    (axes,) = rule.tensors.values()
    assert axes.const == 0 and axes.tol == 0


def test_order_of_names_does_not_matter(samples):
    model = samples("ortt_mlp")
    a = draft_rule(model, MLP_RELU, "x")
    b = draft_rule(model, list(reversed(MLP_RELU)) + [MLP_RELU[0]], "x")
    assert a == b


# --- synthetic graphs ------------------------------------------------------------------------

def _vi(name, shape=(4, 8)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", [_vi(i) for i in inputs], [_vi(o) for o in outputs],
                          initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _const_model():
    big = numpy_helper.from_array(np.arange(32, dtype=np.float32).reshape(4, 8), "big")
    neg = numpy_helper.from_array(np.array(-np.inf, dtype=np.float32), "neg")
    nodes = [
        helper.make_node("Constant", [], ["k"], name="const_k",
                         value=numpy_helper.from_array(np.array([2.0], dtype=np.float32))),
        helper.make_node("Mul", ["x", "k"], ["a"], name="mul_a"),
        helper.make_node("Add", ["a", "big"], ["b"], name="add_b"),
        helper.make_node("Max", ["b", "neg"], ["c"], name="max_c"),
        helper.make_node("Mul", ["dy", "c"], ["out"], name="mul_out"),
    ]
    return _model(nodes, ["x", "dy"], ["out"], [big, neg])


def test_constants_kinds_and_skipped_tensor_attribute():
    model = _const_model()
    names = ["const_k", "mul_a", "add_b", "max_c", "mul_out"]
    text = draft_rule(model, names, "consts")
    rule, stats, _ = _fuse_only(model, text)
    assert [f.replaced for f in stats.fusions] == [names]
    # anchor: rarest op, Constant nodes excluded (Add and Max occur once; Add comes first)
    assert rule.nodes[0].ops == ("Add",)
    kinds = sorted(t.kind for t in rule.tensors.values())
    assert kinds == ["constant", "large_negative"]
    assert "tensor attribute, not copied" in text
    const_node = next(n for n in rule.nodes if n.ops == ("Constant",))
    assert const_node.attrs == {} and const_node.inputs == ()
    assert rule.replace.op == "ActivationGrad"


def test_constant_outside_selection_becomes_value_constraint():
    model = _const_model()
    names = ["mul_a", "add_b", "max_c", "mul_out"]
    rule, stats, fused = _fuse_only(model, draft_rule(model, names, "consts2"))
    assert [f.replaced for f in stats.fusions] == [names]
    assert sorted(str(t.const) for t in rule.tensors.values() if t.kind is None) == ["2.0"]
    assert not any(n.op_type == "Constant" for n in fused.graph.node)  # dead Constant dropped


def test_not_convex_selection_is_refused():
    nodes = [helper.make_node("Mul", ["x", "y"], ["a"], name="m"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Add", ["a", "r"], ["c"], name="add")]
    model = _model(nodes, ["x", "y"], ["c"])
    with pytest.raises(FuseError, match="not convex: node relu"):
        draft_rule(model, ["m", "add"], "nc")
    text = draft_rule(model, ["m", "relu", "add"], "nc")
    assert [f.replaced for f in _fuse_only(model, text)[1].fusions] == [["m", "relu", "add"]]


# --- errors -----------------------------------------------------------------------------------

def _one_line(exc_info):
    msg = str(exc_info.value)
    assert "\n" not in msg and msg
    return msg


@pytest.mark.parametrize("names", [[], [""], [" ", ""]])
def test_empty_selection(samples, names):
    with pytest.raises(FuseError, match="no nodes selected") as e:
        draft_rule(samples("ortt_mlp"), names, "x")
    _one_line(e)


def test_unknown_node_lists_close_matches(samples):
    with pytest.raises(FuseError, match="no node named") as e:
        draft_rule(samples("ortt_mlp"), ["/Relu_Grad/ReluGrad_0", "/Relu_Grad/ReluGrad_O"], "x")
    assert "/Relu_Grad/ReluGrad_0" in _one_line(e).split("close matches")[1]
    with pytest.raises(FuseError, match="dump_chains"):
        draft_rule(samples("ortt_mlp"), ["zzzzzzzzzzzzzzzzzzzzzzzzz"], "x")


def test_disconnected_selection(samples):
    # the input-grad Gemm of fc2 and the bias ReduceSum of fc1, without the ReluGrad between
    with pytest.raises(FuseError, match="not connected") as e:
        draft_rule(samples("ortt_mlp"), ["/fc2/Gemm_Grad/Gemm_0", "/fc1/Gemm_Grad/ReduceSum_2"],
                   "x")
    assert "/fc1/Gemm_Grad/ReduceSum_2" in _one_line(e)


def test_nodes_sharing_only_a_constant_are_not_connected(samples):
    # node_add (silu grad) and node_add_1 (gelu grad) both read scalar_tensor_default_2 = 1.0
    with pytest.raises(FuseError, match="not connected"):
        draft_rule(samples("torch_mlp"), ["node_add", "node_add_1"], "x")


def test_op_that_does_not_fit(samples):
    with pytest.raises(FuseError, match="--op LayerNormGrad does not fit") as e:
        draft_rule(samples("torch_mlp"), TORCH_GELU, "x", fused_op="LayerNormGrad")
    _one_line(e)
    with pytest.raises(FuseError, match="not a fused op.*did you mean 'ActivationGrad'"):
        draft_rule(samples("torch_mlp"), TORCH_GELU, "x", fused_op="ActivationGrd")


def test_no_fused_op_fits_requires_op(samples):
    # one Transpose: 1 input, 1 output; no contract takes that
    with pytest.raises(FuseError, match="no fused op of fusecli takes 1 input.*--op") as e:
        draft_rule(samples("torch_mlp"), ["node_t_5"], "x")
    _one_line(e)


def test_bad_rule_name(samples):
    with pytest.raises(FuseError, match="rule name"):
        draft_rule(samples("ortt_mlp"), MLP_RELU, "Bad-Name")


# --- the click command ---------------------------------------------------------------------

def _invoke(*args):
    return CliRunner().invoke(rules_new, [str(a) for a in args])


def test_cli_writes_file_and_never_overwrites_without_force(samples, tmp_path):
    out = tmp_path / "gelu.yaml"
    args = ["--from", SAMPLES / "torch_mlp.onnx", "--nodes", ",".join(TORCH_GELU),
            "--name", "gelu_draft", "--op", "ActivationGrad", "-o", out]
    r = _invoke(*args)
    assert r.exit_code == 0, (r.output, r.exception)
    text = out.read_text()
    _, stats, _ = _fuse_only(samples("torch_mlp"), text)
    assert [f.replaced for f in stats.fusions] == [_graph_order(samples("torch_mlp"), TORCH_GELU)]
    assert "matches its example" in r.stderr

    out.write_text("keep me\n")
    r = _invoke(*args)
    assert r.exit_code != 0 and isinstance(r.exception, FuseError)
    assert "--force" in str(r.exception)
    assert out.read_text() == "keep me\n"

    r = _invoke(*args, "--force")
    assert r.exit_code == 0, (r.output, r.exception)
    assert out.read_text() == text


def test_cli_prints_to_stdout_and_reports_errors(tmp_path):
    r = _invoke("--from", SAMPLES / "ortt_block.onnx", "--nodes", ",".join(BLOCK_LN),
                "--name", "ln_draft", "--pattern", "layernorm_draft")
    assert r.exit_code == 0, (r.output, r.exception)
    rule = parse_rule(r.stdout, "<stdout>")
    assert rule.name == "ln_draft" and rule.pattern == "layernorm_draft"

    r = _invoke("--from", SAMPLES / "ortt_block.onnx", "--nodes", "nope", "--name", "x",
                "-o", tmp_path / "x.yaml")
    assert isinstance(r.exception, FuseError) and "no node named 'nope'" in str(r.exception)
    assert not (tmp_path / "x.yaml").exists()

    r = _invoke("--from", tmp_path / "missing.onnx", "--nodes", "a", "--name", "x")
    assert isinstance(r.exception, FuseError)
    assert rules_new.name == "new"


def test_ambiguous_example_is_refused():
    # two identical Neg nodes read the Sum output and write graph outputs: the draft cannot
    # tell the selected one from the other
    nodes = [helper.make_node("Sum", ["x", "y", "z"], ["a"], name="sum"),
             helper.make_node("Neg", ["a"], ["b"], name="neg_other"),
             helper.make_node("Neg", ["a"], ["c"], name="neg_mine")]
    model = _model(nodes, ["x", "y", "z"], ["b", "c"])
    with pytest.raises(FuseError, match="ambiguous.*neg_other") as e:
        draft_rule(model, ["sum", "neg_mine"], "amb")
    _one_line(e)
    text = draft_rule(model, ["sum", "neg_other"], "amb")   # the first one matches
    assert [f.replaced for f in _fuse_only(model, text)[1].fusions] == [["sum", "neg_other"]]
