"""Flash-style attention across forward and backward (issue 22 item 1): the rule language's
multi-node replacement (replace.then / replace.new), rules/flash_ortt.yaml's variants on
fixtures (one positive per variant, one negative per guard), and the fused graphs against the
originals in onnxruntime-training."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import builders
from builders import MS, const, model, vi
from fusecli import FusionPass
from fusecli.errors import RuleError
from fusecli.engine.rules import parse_rule

FMIN = float(np.finfo(np.float32).min)


def ortt_attention_masked(*, B=2, H=2, S=5, D=4, mask_shape=None, p_output=False,
                          bias_grad=False, dropout=False):
    """onnxruntime-training forward + backward of softmax(Q K^T * c + mask) V (Llama's
    spelling: Mul by 1/sqrt(D), an additive causal mask [1, 1, S, S] of 0 / finfo.min).
    p_output: P is also a graph output (a model that outputs its attentions); bias_grad: the
    mask is a learned bias whose gradient reduces dS; dropout: attention dropout
    (Dropout / DropoutGrad)."""
    c = float(1 / np.sqrt(D))
    q, kt, v, p = [B, H, S, D], [B, H, D, S], [B, H, S, D], [B, H, S, S]
    mm = dict(domain=MS, alpha=1.0)
    mask_shape = mask_shape or [1, 1, S, S]
    value_info = []
    pv_in = "Pd" if dropout else "P"
    nodes = [
        helper.make_node("MatMul", ["Q", "Kt"], ["scores"], name="qk"),
        helper.make_node("Mul", ["scores", "c"], ["scaled"], name="fwd_scale"),
        helper.make_node("Add", ["scaled", "mask"], ["masked"], name="fwd_mask"),
        helper.make_node("Softmax", ["masked"], ["P"], axis=-1, name="softmax"),
        helper.make_node("MatMul", [pv_in, "V"], ["O"], name="pv"),
        helper.make_node("FusedMatMul", [pv_in, "dO"], ["dV"], transA=1, transB=0, name="dv",
                         **mm),
        helper.make_node("FusedMatMul", ["dO", "V"], ["dPd" if dropout else "dP"], transA=0,
                         transB=1, name="dp", **mm),
        helper.make_node("SoftmaxGrad_13", ["dP", "P"], ["dS0"], axis=-1, domain=MS, name="sg"),
        helper.make_node("Mul", ["dS0", "c"], ["dS"], name="bwd_scale"),
        helper.make_node("FusedMatMul", ["dS", "Kt"], ["dQ"], transA=0, transB=1, name="dq",
                         **mm),
        helper.make_node("FusedMatMul", ["Q", "dS"], ["dKt"], transA=1, transB=0, name="dk",
                         **mm),
    ]
    inits = [const("c", c)]
    inputs = [vi("Q", q), vi("Kt", kt), vi("V", v), vi("dO", q)]
    outputs = [vi("O", q), vi("dQ", q), vi("dKt", kt), vi("dV", v)]
    if dropout:
        nodes += [helper.make_node("Dropout", ["P", "ratio", "train"], ["Pd", "dmask"],
                                   name="drop"),
                  helper.make_node("DropoutGrad", ["dPd", "dmask", "ratio", "train"], ["dP"],
                                   domain=MS, name="drop_grad")]
        inits += [const("ratio", 0.1), const("train", True, np.bool_)]
        value_info = [vi("dmask", p, onnx.TensorProto.BOOL)]
    if bias_grad:
        inputs.append(vi("mask", mask_shape))
        nodes.append(helper.make_node("ReduceSum", ["dS0", "bias_axes"], ["mask_grad"],
                                      keepdims=1, name="bias_grad"))
        inits.append(const("bias_axes", [0, 1], np.int64))
        outputs.append(vi("mask_grad", mask_shape))
    else:
        i = np.arange(S)[:, None]
        inits.append(const("mask", np.broadcast_to(np.where(np.arange(S)[None, :] <= i, 0.0,
                                                            FMIN), mask_shape)))
    if p_output:
        outputs.append(vi("P", p))
    m = model(nodes, inputs, outputs, inits)
    m.graph.value_info.extend([vi("scores", p), vi("scaled", p), vi("masked", p), *value_info])
    return m


def _fuse(m, **kw):
    fused = copy.deepcopy(m)
    fp = FusionPass(**kw)
    fp.run(fused)
    return fused, fp.stats


def _ops(m):
    return [n.op_type for n in m.graph.node]


# --- the rule language: several fused nodes, tensors the replacement creates ----------------

RULE = """
name: two_nodes
pattern: flash_attention
order: 1
nodes:
  - {id: sm, op: Softmax, inputs: [S], outputs: [P]}
  - {id: pv, op: MatMul, inputs: [P, V], outputs: [O]}
replace:
  op: FlashAttention
  inputs: [S, V, V]
  outputs: [O, L]
  new: [L]
  then:
%s
"""


def test_rule_then_and_new_are_validated():
    ok = parse_rule(RULE % "    - {op: FlashAttentionGrad, inputs: [V, S, V, V, O, L], "
                    "outputs: ['', '', '']}", "r.yaml")
    assert [r.op for r in ok.replace.nodes] == ["FlashAttention", "FlashAttentionGrad"]
    assert ok.replace.new == ("L",)
    bad = {
        # a created tensor read before any node writes it
        "is not written by an earlier": RULE.replace("outputs: [O, L]", "outputs: [O]")
        % "    - {op: FlashAttentionGrad, inputs: [V, S, V, V, O, L], outputs: [L]}",
        # a name no pattern node uses and not listed in new
        "which no pattern node uses": RULE % "    - {op: FlashAttentionGrad, inputs: [V, S, "
        "V, V, O, X], outputs: ['']}",
        # a further node may not nest its own then / new
        "cannot have its own": RULE % "    - {op: FlashAttentionGrad, inputs: [V, S, V, V, "
        "O, L], outputs: [''], new: [Z]}",
        # two fused nodes writing one tensor
        "written by an earlier fused node": RULE % "    - {op: FlashAttentionGrad, inputs: "
        "[V, S, V, V, O, L], outputs: [O]}",
    }
    for want, text in bad.items():
        with pytest.raises(RuleError, match=want):
            parse_rule(text, "r.yaml")


def test_two_fused_nodes_keep_topological_order():
    """The forward op takes the forward's place, the backward op the backward's: after dO's
    producer, before the consumers of dQ / dK / dV, with LSE a fresh tensor between them."""
    m = ortt_attention_masked()
    # dO produced inside the graph, after the forward; dQ read by a later node
    m.graph.input.remove(next(i for i in m.graph.input if i.name == "dO"))
    m.graph.node.insert(5, helper.make_node("Mul", ["O", "two"], ["dO"], name="make_dO"))
    m.graph.node.append(helper.make_node("Neg", ["dQ"], ["dQn"], name="use_dQ"))
    m.graph.initializer.append(const("two", 2.0))
    m.graph.output.append(vi("dQn", [2, 2, 5, 4]))
    fused, stats = _fuse(m)
    ops = _ops(fused)
    assert stats.patterns["flash_attention"].fused == 1
    assert ops.index("FlashAttention") < ops.index("Mul") < ops.index("FlashAttentionGrad") \
        < ops.index("Neg")
    fwd = fused.graph.node[ops.index("FlashAttention")]
    bwd = fused.graph.node[ops.index("FlashAttentionGrad")]
    assert fwd.output[1] == bwd.input[5] and fwd.output[1] not in {
        t for n in m.graph.node for t in (*n.input, *n.output)}
    onnx.checker.check_model(fused)


PREP_RULE = """
name: prepared
pattern: flash_attention
order: 1
nodes:
  - {id: sm, op: Softmax, inputs: [S], outputs: [P]}
  - {id: add, op: Add, inputs: [Sq, mask], outputs: [S]}
  - {id: qk, op: MatMul, inputs: [Q, Kt], outputs: [Sq]}
  - {id: pv, op: MatMul, inputs: [P, V], outputs: [O]}
replace:
  op: FlashAttention
  inputs: [Q, Kt, V, %s]
  outputs: [O]
  prepare:
%s
"""


def test_rule_prepare_is_validated():
    """replace.prepare: standard ONNX nodes computing fused-op inputs from the pattern's
    tensors; their outputs join replace.new."""
    ok = parse_rule(PREP_RULE % ("mb", "    - {op: Div, inputs: [mask, Q], outputs: [mb]}"),
                    "r.yaml")
    assert ok.replace.prepare[0].op == "Div" and ok.replace.new == ("mb",)
    bad = {
        "is not a standard ONNX operator": PREP_RULE % (
            "mb", "    - {op: FlashAttention, inputs: [mask], outputs: [mb]}"),
        # an intermediate of the pattern: removed when the match fuses
        "is produced inside the pattern": PREP_RULE % (
            "mb", "    - {op: Neg, inputs: [S], outputs: [mb]}"),
        "no fused node reads its outputs": PREP_RULE % (
            "mask", "    - {op: Neg, inputs: [mask], outputs: [mb]}"),
        "which no pattern node uses": PREP_RULE % (
            "mb", "    - {op: Neg, inputs: [nowhere], outputs: [mb]}"),
        "unknown keys": PREP_RULE % (
            "mb", "    - {op: Neg, inputs: [mask], outputs: [mb], domain: x}"),
        # only a Constant has no inputs; dims name pattern variables, in VAR[a:b] terms
        "must be a non-empty list": PREP_RULE % (
            "mb", "    - {op: Neg, inputs: [], outputs: [mb]}"),
        "no pattern node uses": PREP_RULE % (
            "mb", "    - {op: Constant, outputs: [s], attrs: {value_ints: {dims: 'W[:2]'}}}\n"
            "    - {op: Reshape, inputs: [mask, s], outputs: [mb]}"),
        "a Constant has no inputs": PREP_RULE % (
            "mb", "    - {op: Constant, inputs: [Q], outputs: [s], attrs: {value_float: 1.0}}\n"
            "    - {op: Reshape, inputs: [mask, s], outputs: [mb]}"),
        "must be terms VAR": PREP_RULE % (
            "mb", "    - {op: Constant, outputs: [s], attrs: {value_ints: {dims: 'Q[:2'}}}\n"
            "    - {op: Reshape, inputs: [mask, s], outputs: [mb]}"),
    }
    for want, text in bad.items():
        with pytest.raises(RuleError, match=want):
            parse_rule(text, "r.yaml")


DIMS_PREP = ("mb", "    - {op: Constant, outputs: [s], attrs: {value_ints: {dims: 'Q[:-2] + "
             "mask[-2:]'}}}\n    - {op: Reshape, inputs: [mask, s], outputs: [mb]}")


def test_rule_prepare_constant_of_dims():
    """A prepared Constant's value_ints from the bound tensors' dims ({dims: EXPR}): per match,
    Q's dims but the last two, then the mask's last two; a match where two of them are not
    static is refused (`dims_not_known`), where one is not it is written -1."""
    from fusecli.engine.rules import Dims

    rule = parse_rule(PREP_RULE % DIMS_PREP, "r.yaml")
    const = rule.replace.prepare[0]
    assert const.op == "Constant" and const.inputs == ()
    assert const.attrs["value_ints"] == Dims((("Q", None, -2), ("mask", -2, None)),
                                             "Q[:-2] + mask[-2:]")
    # (the mask [H, 1, S] broadcasts to the scores, viewed [B, H, 1, S]; D = S: PREP_RULE's op
    # reads K^T as K)
    B, H, S, D = 1, 3, 5, 5

    def graph(qdims, mask_dims):
        nodes = [helper.make_node("MatMul", ["Q", "Kt"], ["Sq"]),
                 helper.make_node("Add", ["Sq", "mask"], ["S"]),
                 helper.make_node("Softmax", ["S"], ["P"], axis=-1),
                 helper.make_node("MatMul", ["P", "V"], ["O"])]
        ins = [vi("Q", qdims), vi("Kt", [B, H, D, S]), vi("V", [B, H, S, D]),
               vi("mask", mask_dims)]
        return model(nodes, ins, [vi("O", qdims)], [])

    def prepared(m):
        fp = FusionPass(rules=[rule])
        fp.run(m)  # (in place)
        return ([list(a.ints) for n in m.graph.node if n.op_type == "Constant"
                 for a in n.attribute], fp.stats)

    assert prepared(graph([B, H, S, D], [H, 1, S]))[0] == [[B, H, 1, S]]
    assert prepared(graph(["b", H, S, D], [H, 1, S]))[0] == [[-1, H, 1, S]]
    got, stats = prepared(graph(["b", H, "s", D], [H, 1, "s"]))
    assert got == [] and [s.failure.reason for s in stats.skips] == ["dims_not_known"]


def ortt_attention_prescale(layers=2, B=2, H=2, S=5, D=4):
    """``layers`` onnxruntime-training attentions in CodeGen's order, softmax((Q K^T + mask) /
    c) V, reading one additive causal mask [1, 1, S, S] (0 / finfo.min) and one c."""
    q, kt = [B, H, S, D], [B, H, D, S]
    mm = dict(domain=MS, alpha=1.0)
    nodes, inputs, outputs = [], [], []
    for i in range(layers):
        t = lambda n: f"{n}{i}"  # noqa: E731
        nodes += [
            helper.make_node("MatMul", [t("Q"), t("Kt")], [t("scores")]),
            helper.make_node("Add", [t("scores"), "mask"], [t("masked")]),
            helper.make_node("Div", [t("masked"), "c"], [t("scaled")]),
            helper.make_node("Softmax", [t("scaled")], [t("P")], axis=-1),
            helper.make_node("MatMul", [t("P"), t("V")], [t("O")]),
            helper.make_node("FusedMatMul", [t("P"), t("dO")], [t("dV")], transA=1, transB=0,
                             **mm),
            helper.make_node("FusedMatMul", [t("dO"), t("V")], [t("dP")], transA=0, transB=1,
                             **mm),
            helper.make_node("SoftmaxGrad_13", [t("dP"), t("P")], [t("dS0")], axis=-1,
                             domain=MS),
            helper.make_node("Div", [t("dS0"), "c"], [t("dS")]),
            helper.make_node("FusedMatMul", [t("dS"), t("Kt")], [t("dQ")], transA=0, transB=1,
                             **mm),
            helper.make_node("FusedMatMul", [t("Q"), t("dS")], [t("dKt")], transA=1, transB=0,
                             **mm)]
        inputs += [vi(t("Q"), q), vi(t("Kt"), kt), vi(t("V"), q), vi(t("dO"), q)]
        outputs += [vi(t("O"), q), vi(t("dQ"), q), vi(t("dKt"), kt), vi(t("dV"), q)]
    i = np.arange(S)[:, None]
    mask = np.where(np.arange(S)[None, :] <= i, 0.0, FMIN).reshape(1, 1, S, S)
    return model(nodes, inputs, outputs, [const("mask", mask), const("c", float(np.sqrt(D)))])


def test_prepared_bias_is_computed_once_before_the_fused_nodes(tmp_path):
    """CodeGen's mask before the scale: each FlashAttention reads the mask divided by c, one
    Div node for both layers (the same mask and c), placed before the first; the fused graph
    verifies against the original."""
    from fusecli.runtime.verify import verify_models

    m = ortt_attention_prescale()
    fused, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 2
    ops = _ops(fused)
    assert ops.count("Div") == 1 and ops.count("FlashAttention") == 2
    div = fused.graph.node[ops.index("Div")]
    assert list(div.input) == ["mask", "c"]
    fwd = [n for n in fused.graph.node if n.op_type in ("FlashAttention", "FlashAttentionGrad")]
    assert all(n.input[3 if n.op_type == "FlashAttention" else 6] == div.output[0] for n in fwd)
    assert ops.index("Div") < ops.index("FlashAttention")
    assert all(n.attribute for n in fwd)
    onnx.checker.check_model(fused)
    src, out = tmp_path / "m.onnx", tmp_path / "m.fused.onnx"
    onnx.save(m, src)
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report
    # each layer with its own mask: a Div for each
    m.graph.initializer.append(numpy_helper.from_array(
        numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "mask")),
        "mask1"))
    next(n for n in m.graph.node if n.op_type == "Add" and "mask" in n.input
         and n.input[0].endswith("1")).input[1] = "mask1"
    fused, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 2 and _ops(fused).count("Div") == 2


def test_mask_before_a_scale_by_multiplication_is_not_prepared():
    """(Q K^T + mask) * s: the prepared bias divides by the Div's c, so a Mul by s = 1 / c
    (no model writes it) is not taken by the mask-before-the-scale rule."""
    m = ortt_attention_prescale(layers=1)
    for n in m.graph.node:
        if n.op_type == "Div":
            n.op_type = "Mul"
    fused, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 0
    assert "Div" not in _ops(fused)


# --- rules/flash_ortt.yaml: one positive fixture per variant ------------------------------

@pytest.mark.parametrize("scale_op", ["Div", "Mul"])
def test_flash_ortt_plain(scale_op):
    m = builders.ortt_attention(scale_op=scale_op)
    fused, stats = _fuse(m)
    assert stats.rules["flash_ortt_plain"].fused == 1          # one attention in the model
    assert stats.patterns["sdpa"].fused == 0
    assert sorted(_ops(fused)) == ["FlashAttention", "FlashAttentionGrad"]
    fwd = next(n for n in fused.graph.node if n.op_type == "FlashAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in fwd.attribute}
    assert attrs["scale"] == pytest.approx(1 / np.sqrt(3), rel=1e-6)
    assert attrs["k_transposed"] == 1
    assert "P" not in {t for n in fused.graph.node for t in n.output}


def test_flash_ortt_mask():
    fused, stats = _fuse(ortt_attention_masked())
    assert stats.rules["flash_ortt_mask"].fused == 1
    fwd, bwd = (next(n for n in fused.graph.node if n.op_type == op)
                for op in ("FlashAttention", "FlashAttentionGrad"))
    assert fwd.input[3] == "mask" and bwd.input[6] == "mask"
    assert not {"Softmax", "SoftmaxGrad_13", "MatMul", "FusedMatMul"} & set(_ops(fused))


# --- negative fixtures: one per guard; today's sdpa fusion applies instead -----------------

@pytest.mark.parametrize("case,reason", [("p_output", "intermediate_is_graph_output"),
                                         ("bias_grad", "intermediate_consumed_outside")])
def test_flash_ortt_refused_where_p_or_ds_is_read(case, reason):
    """P a graph output (a model that outputs its attentions), or dS read by a learned bias's
    gradient: the probabilities must exist, so the flash rule refuses and AttentionGrad fuses
    the backward as before."""
    fused, stats = _fuse(ortt_attention_masked(**{case: True}))
    assert stats.patterns["flash_attention"].fused == 0
    assert reason in stats.patterns["flash_attention"].skipped
    assert stats.patterns["sdpa"].fused == 1
    assert "FlashAttention" not in _ops(fused) and "Softmax" in _ops(fused)


def test_flash_ortt_leaves_attention_dropout_to_sdpa():
    fused, stats = _fuse(ortt_attention_masked(dropout=True))
    assert stats.patterns["flash_attention"].detected == 0
    assert stats.patterns["sdpa"].fused == 1


def test_flash_ortt_multi_query_gradients_summed_over_the_heads(tmp_path):
    """K / V broadcast inside the MatMuls (Falcon's multi-query attention): the graph's dK^T /
    dV are [B, Hq, ...] and summed over the head axis after; the flash rule takes the sums
    (`broadcast_axes_of`), FlashAttentionGrad writes K's and V's shape."""
    m = builders.ortt_attention(kv_heads=1, heads=2)
    fused, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 1
    assert stats.patterns["sdpa"].fused == 0
    assert "ReduceSum" not in _ops(fused)
    bwd = next(n for n in fused.graph.node if n.op_type == "FlashAttentionGrad")
    assert list(bwd.output) == ["dQ", "dKt", "dV"]
    onnx.save(m, tmp_path / "m.onnx")
    assert_verifies(tmp_path / "m.onnx", fused, stats, tmp_path)


def test_flash_and_sdpa_refuse_a_sum_over_other_axes_than_the_broadcast():
    """The same graph with dK^T's sum over the batch axis instead of the heads (B = Hq, so the
    shapes still agree): not a broadcast's gradient, so neither rule absorbs it."""
    m = builders.ortt_attention(kv_heads=1, heads=2, B=2)
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0], np.int64), "batch"))
    next(n for n in m.graph.node if n.name == "sum_dk").input[1] = "batch"
    fused, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 0
    assert stats.patterns["sdpa"].fused == 0
    assert "Softmax" in _ops(fused)


# --- numerics: the fused graph against the original in onnxruntime-training ---------------

@pytest.mark.parametrize("build", [lambda: builders.ortt_attention(scale_op="Mul", S=70, D=8),
                                   lambda: ortt_attention_masked(S=150, D=8),
                                   lambda: ortt_attention_masked(S=3, D=4, B=1, H=1)])
def test_flash_ortt_fused_graph_verifies(build, tmp_path):
    from fusecli.runtime.verify import verify_models

    m = build()
    fused, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 1
    src, out = tmp_path / "m.onnx", tmp_path / "m.fused.onnx"
    onnx.save(m, src)
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-4, report


# real ort-training exports of grouped / multi-query attention (tests/data/make_gqa.py): the
# repeat_kv spellings (Expand, repeat_interleave, Tile) feed repeated K^T / V to the MatMuls,
# which the flash rule takes (their gradients' group sums stay in the graph); K / V broadcast
# inside the MatMuls (q viewed [B, kv, g, S, D]) too, with the broadcast sums of their
# gradients (the ops' grouping: kv item j // g)
GQA = {"ortt_gqa_expand_kv2": 1, "ortt_gqa_expand_kv1": 1, "ortt_gqa_interleave_kv2": 1,
       "ortt_gqa_tile_kv2": 1, "ortt_gqa_bcast_kv2": 1, "ortt_gqa_bcast_kv1": 1}


@pytest.mark.ortt
@pytest.mark.parametrize("name", sorted(GQA))
def test_flash_ortt_on_grouped_attention_exports(name, tmp_path):
    from pathlib import Path

    src = Path(__file__).parent / "data" / "gqa" / f"{name}.onnx"
    fused, stats = _fuse(onnx.load(src))
    assert stats.patterns["flash_attention"].fused == GQA[name]
    assert stats.patterns["sdpa"].fused == 1 - GQA[name]
    assert_verifies(src, fused, stats, tmp_path)


def assert_verifies(src, fused, stats, tmp_path):
    """The fused model against the original (every output), and each fusion against the
    original's subgraph on its reference inputs."""
    from fusecli.runtime.verify import check_fusions, verify_models

    out = tmp_path / "m.fused.onnx"
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok, [d.as_dict() for d in report.diffs if not d.ok]
    checks = check_fusions(src, stats.fusions, atol=1e-6)
    assert not [(c.rule, d.name) for c in checks for d in c.outputs if not d.ok]


# --- fine-tuning: any of dQ, dK, dV absent (issue 21) ---------------------------------------

def _without(m, grads):
    """The attention with the FusedMatMuls of `grads` (dq / dk / dv) removed, as
    onnxruntime-training builds the backward when the projection and everything below it are
    frozen (no gradient asked for)."""
    m = copy.deepcopy(m)
    outs = {"dq": "dQ", "dk": "dKt", "dv": "dV"}
    keep = [n for n in m.graph.node if n.name not in grads]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    kept = [o for o in m.graph.output if o.name not in {outs[g] for g in grads}]
    del m.graph.output[:]
    m.graph.output.extend(kept)
    return m


@pytest.mark.parametrize("absent", [("dk",), ("dq",), ("dv",), ("dq", "dk"), ("dk", "dv")])
def test_flash_ortt_without_some_gradients(absent, tmp_path):
    from fusecli.runtime.verify import verify_models

    m = _without(builders.ortt_attention(scale_op="Mul", S=6, D=4), absent)
    fused, stats = _fuse(m)
    assert stats.rules["flash_ortt_plain"].fused == 1
    bwd = next(n for n in fused.graph.node if n.op_type == "FlashAttentionGrad")
    names = dict(zip(("dq", "dk", "dv"), list(bwd.output) + ["", "", ""]))  # trailing "" dropped
    assert {g for g, t in names.items() if not t} == set(absent)  # not computed
    assert "FusedMatMul" not in _ops(fused)
    src, out = tmp_path / "m.onnx", tmp_path / "m.fused.onnx"
    onnx.save(m, src)
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-4, report


def test_flash_ortt_refuses_a_gradient_read_from_ds_another_way():
    """dK computed from dS by something else than the rule's FusedMatMul: dS is read outside
    the match, so nothing fuses (the absent branch is no licence to drop a consumer)."""
    m = _without(builders.ortt_attention(scale_op="Mul"), ("dk",))
    m.graph.node.append(helper.make_node("MatMul", ["dS", "Q"], ["dKt_other"], name="other"))
    m.graph.output.append(helper.make_tensor_value_info("dKt_other", onnx.TensorProto.FLOAT, None))
    fused, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 0
    assert "FlashAttention" not in _ops(fused)
