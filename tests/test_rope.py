"""Rotary position embeddings (rope: rules/rope_{ortt,torch}.yaml -> RotaryEmbeddingGrad).

Positive fixtures: real exports of one eager attention layer whose Q and K go through
transformers' Llama apply_rotary_pos_emb, in both families (tests/data/make_rope.py: rotate-
half with cos/sin computed from position ids or given as inputs, and partial rotary on half the
head dims), each fused and verified against its original; the expected count comes from the
model code (Q and K: two rotations). Look-alikes from the same script (cat(x1, -x2), a split at
3 of 8 dims) must not fuse. ort-training also with symbolic batch and sequence (`*_symbolic`:
rotate_half's half point computed at run time from Shape(x), rope_ortt_symbolic), whose
look-alikes are cat(x1, -x2) and a split at the run-time point x.shape[-1] // 4; torch-joint
also raw (`*_raw`, torch.onnx.export(dynamo=True, optimize=False): each Slice reads its own
Cast/Reshape constants, each scatter its own CastLike zeros). One negative per guard on mutated
copies of the positive fixtures, with the reason explain gives.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusecli import FusionPass, load_rules
from fusecli.engine.explain import explain_model
from fusecli.engine.graph import GraphIndex
from fusecli.runtime.verify import verify_models

DATA = Path(__file__).parent / "data"
RULES = load_rules()
GUARD_FIXTURE_RULES = ("rope_ortt", "rope_ortt_symbolic", "rope_torch",
                       "rope_interleaved_torch",
                       # (fixtures and guards: tests/test_rope_spellings.py)
                       "rope_ortt_slices", "rope_ortt_interleaved",
                       "rope_ortt_interleaved_attr_axes", "rope_split_torch",
                       "rope_cos_hi_torch", "rope_cos_lo_torch", "rope_interleaved_cos_hi_torch",
                       "rope_interleaved_cos_lo_torch")

# rope fusions from the model code (make_rope.py): Q and K rotated once each
EXPECTED = {"half": 2, "partial": 2, "inputs": 2, "interleaved": 2, "bad_concat": 0,
            "bad_slice": 0, "half_symbolic": 2, "partial_symbolic": 2,
            "bad_concat_symbolic": 0, "bad_slice_symbolic": 0, "half_raw": 2,
            "bad_concat_raw": 0, "bad_slice_raw": 0}
# (ort-training has no interleaved fixture here: make_rope.py's x[..., ::2] spelling fails ONNX
# shape inference in generate_artifacts; GPT-J's own x[:, :, :, ::2] exports and is
# tests/data/make_rope_spellings.py's, tests/test_rope_spellings.py;
# the symbolic-dim fixtures are ort-training's, the raw exports torch-joint's)
CASES = [(fam, name) for fam in ("ortt", "torch") for name in EXPECTED
         if (fam, name) != ("ortt", "interleaved")
         and not (fam == "torch" and name.endswith("_symbolic"))
         and not (fam == "ortt" and name.endswith("_raw"))]
RULE = {"half": "rope_{}", "partial": "rope_{}", "inputs": "rope_{}",
        "interleaved": "rope_interleaved_{}", "half_symbolic": "rope_{}_symbolic",
        "partial_symbolic": "rope_{}_symbolic", "half_raw": "rope_{}"}


def _load(fam, name):
    return onnx.load(DATA / f"{fam}_rope_{name}.onnx")


def _upto(rule):
    this = next(r for r in RULES if r.name == rule)
    return [r for r in RULES if (r.order, r.name) <= (this.order, this.name)]


def test_guard_fixture_rules_are_the_rope_rules():
    assert sorted(GUARD_FIXTURE_RULES) == sorted(r.name for r in RULES if r.pattern == "rope")


@pytest.mark.parametrize("fam,name", CASES, ids=lambda v: v)
def test_rope_exports_fuse_as_the_model_code_says_and_verify(fam, name, tmp_path):
    m = _load(fam, name)
    fp = FusionPass()
    fp.run(m)
    assert fp.stats.patterns["rope"].fused == EXPECTED[name]
    assert {f.rule for f in fp.stats.fusions if f.pattern == "rope"} == \
        ({RULE[name].format(fam)} if EXPECTED[name] else set())
    # the attention between the rotations fuses as before: forward and backward together
    # (flash_attention) in both families
    assert fp.stats.patterns["flash_attention"].fused == 1
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(DATA / f"{fam}_rope_{name}.onnx", out)
    assert report.ok and report.max_rel <= 1e-5, report


def _first(m, rule):
    fp = FusionPass(rules=_upto(rule))
    fp.run(copy.deepcopy(m))
    return next(f for f in fp.stats.fusions if f.rule == rule)


def assert_guard_holds(bad, rec, rule, case, reasons):
    """`bad` (a copy of a graph with one guard of `rule` broken on the rotation that fused as
    `rec`): that rotation stays unfused, the other one still fuses, and explain names exactly
    `reasons` for it."""
    fp = FusionPass(rules=_upto(rule))
    fp.run(copy.deepcopy(bad))
    recs = [f for f in fp.stats.fusions if f.rule == rule]
    assert len(recs) == 1 and rec.nodes["mul_s"] not in recs[0].replaced, case
    anchor = rec.nodes[next(r for r in RULES if r.name == rule).nodes[0].id]
    misses = explain_model(bad, FusionPass(rules=_upto(rule)), node_names=[anchor],
                           include_shallow=True)
    mine = {x["reason"] for x in misses if x["rule"] == rule and x["anchor"] == anchor}
    assert mine == reasons, misses


def _set_const(m, node, pos, value):
    """Feeds input `pos` of `node` from a new initializer holding `value`."""
    name = f"{node.name}_in{pos}_mutated"
    m.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    node.input[pos] = name


def _const(m, name):
    """The value of an initializer or Constant-node output."""
    for i in m.graph.initializer:
        if i.name == name:
            return numpy_helper.to_array(i)
    node = next(n for n in m.graph.node if n.op_type == "Constant" and name in n.output)
    return numpy_helper.to_array(node.attribute[0].t)


def _by_name(m, name):
    return next(n for n in m.graph.node if n.name == name)


# context (kept) nodes of rope_ortt_symbolic, which a fusion record does not name: by output
_KEPT_OUTPUT = {"half": "hs", "last_dim": "d", "fwd_lo": "x1", "fwd_hi": "x2",
                "x_shape": "xshape"}


def _rule_node(m, rec, node_id):
    """The graph node that rule node `node_id` matched in the fusion `rec`."""
    if node_id in rec.nodes:
        return _by_name(m, rec.nodes[node_id])
    out = rec.tensors[_KEPT_OUTPUT[node_id]]
    return next(n for n in m.graph.node if out in n.output)


def _mutate(m, rec, case):
    m = copy.deepcopy(m)
    t = rec.tensors
    if case == "split_not_halves":  # ortt: the forward Split is [3, 5], not [h, h]
        split = next(n for n in m.graph.node if n.op_type == "Split" and t["x1"] in n.output)
        _set_const(m, split, 1, np.asarray([3, 5], np.int64))
    elif case == "neg_on_other_half":  # ortt: the backward Neg on the second half
        neg, cat = _by_name(m, rec.nodes["bneg"]), _by_name(m, rec.nodes["bcat"])
        neg.input[0], cat.input[0] = t["g1"], t["g_neg"]
    elif case == "index_not_the_half":  # torch: the -g1 scatter goes to 0..h-1 as well
        sc = _by_name(m, rec.nodes["sc_hi"])
        sc.input[1] = t["idx_lo"]
    elif case == "index_shifted":  # torch: g2 scattered at 1..h
        sc = _by_name(m, rec.nodes["sc_lo"])
        h = int(_const(m, t["h"]).reshape(-1)[0])
        _set_const(m, sc, 1, np.arange(1, h + 1, dtype=np.int64).reshape(h, 1))
    elif case == "sin_not_forward":  # the backward's sin is not the forward's (cos instead)
        mul = _by_name(m, rec.nodes["mul_s"])
        mul.input[list(mul.input).index(t["sin"])] = t["cos"]
    elif case == "pairs_not_pairs":  # interleaved: g reshaped to [..., n/4, 4], not pairs
        rs = _by_name(m, rec.nodes["pairs"])
        shape = _const(m, t["pshape"]).copy()
        shape[-2], shape[-1] = shape[-2] // 2, 4
        _set_const(m, rs, 1, shape)
    elif case == "even_odd_swapped":  # interleaved: -g_even scattered to the even positions
        sc = _by_name(m, rec.nodes["sc_hi"])
        sc.input[1] = t["idx_lo"]
    elif case in SYMBOLIC_MUTATIONS:  # ortt symbolic: one rotation's nodes
        for node_id, port, value in SYMBOLIC_MUTATIONS[case]:
            node = _rule_node(m, rec, node_id)
            pos = port if isinstance(port, int) else (  # SliceGrad: Slice's inputs after dY
                ["starts", "ends", "axes", "steps"].index(port) + 1
                + (node.op_type == "SliceGrad"))
            _set_const(m, node, pos, np.asarray(value, np.int64))
    elif case == "odd_width":  # ortt symbolic: dY's last dim recorded odd (7): no halves
        vi = next(v for v in m.graph.value_info if v.name == t["dY"])
        vi.type.tensor_type.shape.dim[-1].dim_value = 7
    elif case == "half_of_another_tensor":  # ortt symbolic: h from Shape(cos), not Shape(X)
        _rule_node(m, rec, "x_shape").input[0] = t["cos"]
    elif case == "perm_not_swap":  # torch: the scatter's Transpose keeps the axes
        tr = _by_name(m, rec.nodes["tr_a"])
        tr.attribute[0].CopyFrom(helper.make_attribute("perm", [0, 1, 2, 3]))
    elif case == "scatter_into_ones":  # torch: -g1 scattered into ones, not zeros
        sc = _by_name(m, rec.nodes["sc_hi"])
        shape = _value(m, sc.input[0]).shape
        _set_const(m, sc, 0, np.ones(shape, np.float32))
    elif case in ("reads_value", "reads_type_of_runtime"):
        # raw: an outside node reads the backward's -g1 for its value (CastLike(-g1, x)), or
        # for its type but from a run-time tensor (CastLike(x, -g1), not a constant)
        ins = [t["nga"], "x"] if case == "reads_value" else ["x", t["nga"]]
        m.graph.node.append(helper.make_node("CastLike", ins, ["probe"], name="probe"))
        m.graph.output.append(helper.make_tensor_value_info("probe", onnx.TensorProto.FLOAT,
                                                            None))
    return m


def _value(m, name):
    """The value of a tensor computed from constants (the rules' reading of it)."""
    return np.asarray(GraphIndex(m.graph).const_value(name))


# symbolic spelling: constants of one rotation's nodes replaced (node id, input position or
# Slice input name, value); the forward Slice and its SliceGrad read the same starts / ends /
# axes / steps
_HALVES = ("fwd_lo", "fwd_hi", "bpad_lo", "bpad_hi")
SYMBOLIC_MUTATIONS = {
    "half_not_by_two": [("half", 1, 4)],              # h = D / 4: a split at another point
    "half_of_another_dim": [("last_dim", 1, 2)],      # h = Shape(X)[2] / 2: the sequence's
    "slice_axis_not_last": [(n, "axes", [2]) for n in _HALVES],
    "lower_half_not_from_0": [(n, "starts", [1]) for n in ("fwd_lo", "bpad_lo")],
    "upper_half_not_to_end": [(n, "ends", [7]) for n in ("fwd_hi", "bpad_hi")],
    "slice_step_not_1": [(n, "steps", [2]) for n in _HALVES],
}
GUARDS = {"ortt": [("split_not_halves", {"constant"}), ("neg_on_other_half", {"op_type"}),
                   ("sin_not_forward", {"dataflow"})],
          "ortt_symbolic": [(c, {"constant"}) for c in SYMBOLIC_MUTATIONS]
          + [("half_of_another_tensor", {"dataflow"}), ("sin_not_forward", {"dataflow"}),
             ("odd_width", {"shape_mismatch"})],
          "torch": [("index_not_the_half", {"constant"}), ("index_shifted", {"constant"}),
                    ("sin_not_forward", {"dataflow"}), ("perm_not_swap", {"attribute"}),
                    ("scatter_into_ones", {"constant"})],
          "torch_raw": [("index_not_the_half", {"constant"}), ("scatter_into_ones", {"constant"}),
                        ("sin_not_forward", {"dataflow"}),
                        ("reads_value", {"intermediate_consumed_outside"}),
                        ("reads_type_of_runtime", {"intermediate_consumed_outside"})],
          "torch_interleaved": [("pairs_not_pairs", {"constant"}),
                                ("even_odd_swapped", {"constant"}),
                                ("sin_not_forward", {"dataflow"})]}


@pytest.mark.parametrize("fam,case,reasons", [(f, c, r) for f, cs in GUARDS.items()
                                              for c, r in cs], ids=lambda v: str(v))
def test_rope_guards(fam, case, reasons):
    """Each guard broken on one rotation (Q's or K's): that one is left unfused, the other
    still fuses, and explain names the failing check."""
    fam, style = {"torch_interleaved": ("torch", "interleaved"),
                  "ortt_symbolic": ("ortt", "half_symbolic"),
                  "torch_raw": ("torch", "half_raw")}.get(fam, (fam, "half"))
    m = _load(fam, style)
    rule = RULE[style].format(fam)
    rec = _first(m, rule)
    assert_guard_holds(_mutate(m, rec, case), rec, rule, case, reasons)


def test_rope_raw_forward_split_must_be_the_backwards():
    """The forward rotation is context: Q's and K's forwards both multiply by the same cos and
    sin, so either one is context for either backward. Both forwards' first halves sliced at
    h-1 (each Slice reading its own constant, as the raw export writes them) while the
    backwards still split at h: nothing fuses, and explain names the slice point's
    constant (the forward's and the backward's differ)."""
    m = _load("torch", "half_raw")
    rec = _first(m, "rope_torch")
    bad = copy.deepcopy(m)
    fwd = [n for n in bad.graph.node if n.op_type == "Slice"
           and any(c.op_type == "Concat" for c in bad.graph.node if n.output[0] in c.input)
           and _value(bad, n.input[1]).reshape(-1).tolist() == [0]]
    assert len(fwd) == 2  # x1 of Q and of K (the model code: two rotations)
    h = int(_value(m, rec.tensors["h"]).reshape(-1)[0])
    for sl in fwd:
        _set_const(bad, sl, 2, np.asarray([h - 1], np.int64))
    fp = FusionPass(rules=_upto("rope_torch"))
    fp.run(copy.deepcopy(bad))
    assert fp.stats.patterns["rope"].fused == 0
    anchor = rec.nodes["bneg"]
    misses = explain_model(bad, FusionPass(rules=_upto("rope_torch")), node_names=[anchor],
                           include_shallow=True)
    assert {x["reason"] for x in misses
            if x["rule"] == "rope_torch" and x["anchor"] == anchor} == {"constant"}, misses


def test_rope_raw_type_reader_outside_is_rewritten(tmp_path):
    """A constant computed from the type of a fused-away tensor (CastLike(c, -g1), a raw
    export's new_zeros) that the result still reads stays, rewritten as Cast(c) to that type:
    the rotations fuse and the graph computes what it did."""
    m = _load("torch", "half_raw")
    rec = _first(m, "rope_torch")
    m.graph.initializer.append(numpy_helper.from_array(np.asarray(2, np.int64), "two_i64"))
    m.graph.node.append(helper.make_node("CastLike", ["two_i64", rec.tensors["nga"]],
                                         ["probe"], name="probe"))
    m.graph.output.append(helper.make_tensor_value_info("probe", onnx.TensorProto.FLOAT, []))
    orig = tmp_path / "orig.onnx"
    onnx.save(m, orig)
    fp = FusionPass()
    fp.run(m)
    assert fp.stats.patterns["rope"].fused == 2
    probe = next(n for n in m.graph.node if "probe" in n.output)
    assert probe.op_type == "Cast" and list(probe.input) == ["two_i64"]
    assert helper.get_attribute_value(probe.attribute[0]) == onnx.TensorProto.FLOAT
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(orig, out)
    assert report.ok and report.max_rel <= 1e-5, report
