"""Rotary-embedding spellings beyond make_rope.py's Llama layer (tests/data/make_rope_spellings.py:
real exports of transformers' Llama / GPT-NeoX (partial) / GPT-J (interleaved, full and partial)
apply_rotary_pos_emb, RoFormer's apply_rotary_position_embeddings (interleaved; Q and K, or Q, K
and V) and of rotate-half written with chunk / split, in both families, ort-training also with
the forward exported at opset 12).

- Each export fuses as many rotations as the model code has (Q and K: 2; RoFormer's
  rotary_value: 3; the look-alikes 0), with
  the rule of its spelling, and verifies against its original.
- Each fused rotation's dX equals the original's dX (the unfused subgraph's output) and the NumPy
  reference on the dY, cos and sin of that run.
- One negative per guard of the new variants (rope_ortt_slices, rope_ortt_interleaved,
  rope_ortt_interleaved_attr_axes, rope_split_torch), on a mutated copy of a positive export:
  that rotation stays unfused, the other fuses, and explain names the failing check; the real
  look-alikes' near misses are explained too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from test_rope import RULES, _first, _upto, assert_guard_holds

from fusecli import FusionPass
from fusecli.engine.explain import explain_model
from fusecli.engine.graph import GraphIndex
from fusecli.ops.rotary_embedding_grad.reference import rotary_embedding_grad
from fusecli.runtime.feeds import make_feeds
from fusecli.runtime.library import library_path
from fusecli.runtime.runner import pick_runtime, run_in_runtime
from fusecli.runtime.verify import verify_models

DATA = Path(__file__).parent / "data"

# rotations from the model code (make_rope_spellings.py): Q and K once each; look-alikes none
ORTT = {"llama": "rope_ortt", "neox_partial": "rope_ortt", "gptj": "rope_ortt_interleaved",
        "gptj_partial": "rope_ortt_interleaved", "chunk": "rope_ortt", "split": "rope_ortt",
        "llama_opset12": "rope_ortt_slices", "neox_partial_opset12": "rope_ortt_slices",
        "gptj_opset12": "rope_ortt_interleaved_attr_axes", "roformer": "rope_ortt_interleaved",
        "roformer_value": "rope_ortt_interleaved", "sin_first": "rope_ortt",
        "sin_first_hi": "rope_ortt", "gptj_sin_first": "rope_ortt_interleaved"}
TORCH = {"llama": "rope_torch", "neox_partial": "rope_torch", "gptj": "rope_interleaved_torch",
         "gptj_partial": "rope_interleaved_torch", "chunk": "rope_split_torch",
         "split": "rope_split_torch", "roformer": "rope_interleaved_cos_lo_torch",
         "roformer_value": "rope_interleaved_cos_lo_torch", "sin_first": "rope_cos_hi_torch",
         "sin_first_hi": "rope_cos_lo_torch", "gptj_sin_first": "rope_interleaved_cos_hi_torch"}
# rotations per export where not Q and K (make_rope_spellings.py: RoFormer's rotary_value)
ROTATIONS = {"roformer_value": 3}
LOOK_ALIKES = ["gptj_swapped", "gptj_perm", "bad_slice", "bad_concat"]
POSITIVE = [("ortt", s) for s in ORTT] + [("torch", s) for s in TORCH]
CASES = POSITIVE + [(f, s) for f in ("ortt", "torch") for s in LOOK_ALIKES] + [
    ("ortt", "bad_slice_opset12"), ("ortt", "bad_concat_opset12")]


def _path(fam, style):
    return DATA / f"{fam}_rope_sp_{style}.onnx"


def _rule_of(fam, style):
    return (ORTT if fam == "ortt" else TORCH).get(style)


@pytest.mark.parametrize("fam,style", CASES, ids=lambda v: v)
def test_exports_fuse_as_the_model_code_says_and_verify(fam, style, tmp_path):
    m = onnx.load(_path(fam, style))
    fp = FusionPass()
    fp.run(m)
    rule = _rule_of(fam, style)
    ropes = [f for f in fp.stats.fusions if f.pattern == "rope"]
    assert len(ropes) == (ROTATIONS.get(style, 2) if rule else 0), [f.rule for f in ropes]
    assert {f.rule for f in ropes} == ({rule} if rule else set())
    if rule is None:
        return
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(_path(fam, style), out)
    assert report.ok and report.max_rel <= 1e-5, report


def _with_outputs(m, names):
    m = copy.deepcopy(m)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                          for n in names if n not in have)
    return m


def _run(m, tmp_path, name, feeds):
    p = tmp_path / f"{name}.onnx"
    onnx.save(m, p)
    outs, _ = run_in_runtime(p, feeds, pick_runtime(m), library=library_path())
    return outs


@pytest.mark.parametrize("fam,style", POSITIVE, ids=lambda v: v)
def test_fused_rotation_equals_the_unfused_subgraph_and_the_reference(fam, style, tmp_path):
    """Per rotation: the fused RotaryEmbeddingGrad's dX on onnxruntime equals the dX the
    original's subgraph computes in the same run, and the NumPy reference of dY, cos, sin."""
    m = onnx.load(_path(fam, style))
    fused = copy.deepcopy(m)
    fp = FusionPass()
    fp.run(fused)
    recs = [f for f in fp.stats.fusions if f.pattern == "rope"]
    assert len(recs) == ROTATIONS.get(style, 2)
    ports = [[r.tensors[v] for v in ("dY", "cos", "sin", "dX")] for r in recs]
    feeds = make_feeds(m, seed=3)
    orig = _run(_with_outputs(m, [t for p in ports for t in p]), tmp_path, "orig", feeds)
    got = _run(_with_outputs(fused, [p[3] for p in ports]), tmp_path, "fused", feeds)
    for rec, (dy, cos, sin, dx) in zip(recs, ports):
        attrs = {a.name: helper.get_attribute_value(a) for a in rec.node.attribute}
        ref = rotary_embedding_grad(orig[dy], orig[cos], orig[sin],
                                    attrs.get("interleaved", 0), attrs.get("axis", -1))
        assert np.abs(orig[dy]).max() > 0  # a real gradient flows through the rotation
        np.testing.assert_allclose(got[dx], orig[dx], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ref, orig[dx], rtol=1e-5, atol=1e-6)


# --- guards -----------------------------------------------------------------------------------

def _set_input(m, node, pos, value):
    name = f"{node.name}_in{pos}_mutated"
    m.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    node.input[pos] = name


def _node_of(m, rec, node_id, var=None):
    """The graph node that rule node `node_id` matched (kept context nodes, which a record does
    not name, found as the producer of the variable `var` they output)."""
    if node_id in rec.nodes:
        return next(n for n in m.graph.node if n.name == rec.nodes[node_id])
    return next(n for n in m.graph.node if rec.tensors[var] in n.output)


def _value(m, name):
    return np.asarray(GraphIndex(m.graph).const_value(name))


# Slice(data, starts, ends, axes, steps) / SliceGrad(dY, shape, starts, ends, axes, steps)
_SLICE_PORT = {"starts": 1, "ends": 2, "axes": 3, "steps": 4}
# kept forward Slices by the variable they output
_KEPT = {"fwd_lo": "x1", "fwd_hi": "x2"}


def _slice_mut(*edits):
    def apply(m, rec):
        for node_id, port, value in edits:
            node = _node_of(m, rec, node_id, _KEPT.get(node_id))
            pos = _SLICE_PORT[port] + (node.op_type == "SliceGrad")
            _set_input(m, node, pos, np.asarray(value, np.int64))
    return apply


def _sin_not_forward(m, rec):
    mul = _node_of(m, rec, "mul_s")
    mul.input[list(mul.input).index(rec.tensors["sin"])] = rec.tensors["cos"]


def _pairs_of_four(m, rec):
    rs = _node_of(m, rec, "pairs")
    shape = _value(m, rs.input[1]).copy()
    shape[-2], shape[-1] = shape[-2] // 2, 4
    _set_input(m, rs, 1, shape)


def _squeeze_axis_input(m, rec):
    _set_input(m, _node_of(m, rec, "sq_neg"), 1, np.asarray([0], np.int64))


def _squeeze_axis_attr(m, rec):
    sq = _node_of(m, rec, "sq_neg")
    del sq.attribute[:]
    sq.attribute.append(helper.make_attribute("axes", [0]))


def _concat_swapped(m, rec):
    cat = _node_of(m, rec, "bcat")
    cat.input[0], cat.input[1] = cat.input[1], cat.input[0]


def _sum_half_twice(m, rec):
    """dX's last Add reads the half its first Add already summed, in place of the other."""
    add = _node_of(m, rec, "add_x")
    swap = {rec.tensors["s1"]: rec.tensors["s2"], rec.tensors["s2"]: rec.tensors["s1"]}
    for i, t in enumerate(add.input):
        if t in swap:
            add.input[i] = swap[t]


# (the half no Add reads any more leaves the rule no candidate for its Add)
_SUM_GUARDS = [("sum_reads_one_half_twice", _sum_half_twice, {"no_candidate"}),
               ("sin_not_forward", _sin_not_forward, {"dataflow"})]
_ALL4 = ("fwd_lo", "fwd_hi", "bpad_lo", "bpad_hi")
GUARDS = {
    # (fixture, rule): [(case, mutation, explain reasons)]
    ("ortt", "llama_opset12", "rope_ortt_slices"): [
        ("split_at_3_not_half", _slice_mut(("fwd_lo", "ends", [3]), ("fwd_hi", "starts", [3]),
                                           ("bpad_lo", "ends", [3]), ("bpad_hi", "starts", [3])),
         {"constant"}),
        ("upper_half_not_to_end", _slice_mut(("fwd_hi", "ends", [7]), ("bpad_hi", "ends", [7])),
         {"constant"}),
        ("step_2", _slice_mut(*[(n, "steps", [2]) for n in _ALL4]), {"constant"}),
        ("axis_not_last", _slice_mut(*[(n, "axes", [2]) for n in _ALL4]), {"constant"}),
        ("sin_not_forward", _sin_not_forward, {"dataflow"})],
    ("ortt", "gptj", "rope_ortt_interleaved"): [
        ("stride_3", _slice_mut(*[(n, "steps", [3]) for n in _ALL4]), {"constant"}),
        ("negated_piece_to_even", _slice_mut(("bpad_lo", "starts", [1]),
                                             ("bpad_hi", "starts", [0])), {"constant"}),
        ("pairs_not_pairs", _pairs_of_four, {"constant"}),
        ("squeeze_not_last_axis", _squeeze_axis_input, {"constant"}),
        ("sin_not_forward", _sin_not_forward, {"dataflow"})],
    ("ortt", "gptj_opset12", "rope_ortt_interleaved_attr_axes"): [
        ("stride_3", _slice_mut(*[(n, "steps", [3]) for n in _ALL4]), {"constant"}),
        ("squeeze_not_last_axis", _squeeze_axis_attr, {"attribute"}),
        ("sin_not_forward", _sin_not_forward, {"dataflow"})],
    ("torch", "chunk", "rope_split_torch"): [
        ("split_at_3_not_half", _slice_mut(("sl_a", "ends", [3]), ("sl_b", "starts", [3])),
         {"constant"}),
        ("upper_half_not_to_end", _slice_mut(("sl_b", "ends", [7])), {"constant"}),
        ("halves_put_back_swapped", _concat_swapped, {"dataflow"}),
        ("sin_not_forward", _sin_not_forward, {"dataflow"})],
    # dX's terms summed in the other orders (X * cos written last)
    ("torch", "sin_first", "rope_cos_hi_torch"): _SUM_GUARDS,
    ("torch", "sin_first_hi", "rope_cos_lo_torch"): _SUM_GUARDS,
    ("torch", "gptj_sin_first", "rope_interleaved_cos_hi_torch"): _SUM_GUARDS,
    ("torch", "roformer", "rope_interleaved_cos_lo_torch"): _SUM_GUARDS,
}


@pytest.mark.parametrize("fam,style,rule,case,mutate,reasons",
                         [(*k, c, f, r) for k, cs in GUARDS.items() for c, f, r in cs],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_guards(fam, style, rule, case, mutate, reasons):
    """Each guard broken on one rotation: that one stays unfused, the other still fuses, and
    explain names the failing check."""
    m = onnx.load(_path(fam, style))
    rec = _first(m, rule)
    bad = copy.deepcopy(m)
    mutate(bad, rec)
    assert_guard_holds(bad, rec, rule, case, reasons)


def test_guard_rules_are_the_new_rope_variants():
    new = {r.name for r in RULES if r.pattern == "rope"} - {
        "rope_ortt", "rope_ortt_symbolic", "rope_torch", "rope_interleaved_torch"}
    assert new == {k[2] for k in GUARDS}


@pytest.mark.parametrize("fam,style,rule,reason", [
    # GPT-J's pairs rotated the other way, stack((x2, -x1)): the first piece of the pairs is
    # not negated (its Squeeze feeds SliceGrad, where the rule wants Neg)
    ("ortt", "gptj_swapped", "rope_ortt_interleaved", "op_type"),
    # even / odd halves concatenated, stack((-x2, x1), -2): the pieces are split along the
    # second-to-last axis (SplitTraining axis -2), not the pairs' last
    ("ortt", "gptj_perm", "rope_ortt_interleaved", "attribute"),
    # opset 12 rotate-half split at 3 of 8: not the half of the last dim
    ("ortt", "bad_slice_opset12", "rope_ortt_slices", "constant"),
    # torch-joint GPT-J the other way: the -g scatter goes to the even positions
    ("torch", "gptj_swapped", "rope_interleaved_torch", "constant"),
])
def test_look_alike_near_miss_is_explained(fam, style, rule, reason):
    """A real look-alike export fuses nothing, and explain on its backward names why the rule
    of the nearest spelling refuses it."""
    m = onnx.load(_path(fam, style))
    fp = FusionPass(rules=_upto(rule))
    fp.run(copy.deepcopy(m))
    assert not [f for f in fp.stats.fusions if f.pattern == "rope"]
    misses = [x for x in explain_model(m, FusionPass(rules=_upto(rule)), include_shallow=True)
              if x["rule"] == rule]
    assert misses and reason in {x["reason"] for x in misses}, misses
