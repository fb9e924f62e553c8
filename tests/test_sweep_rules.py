"""Rules added for spellings found by the architecture sweep (scripts/corpus/SWEEP.md: real third-party models
the committed corpus lacks, generated with `scripts/corpus/gen.py --out build/sweep`).

act_gelu_tanh_bloom_grad_torch: BLOOM's GELU (transformers BloomGelu, a torch.autograd.Function
with a hand-written backward that shares the forward's tanh). Positive fixture: the real torch
2.13 export tests/data/torch_bloom_gelu.onnx (make_torch_bloom_gelu.py), fused into
LinearActivationGrad{gelu_tanh} and verified. Negatives, one per guard, each on a mutated copy:
every constant the rule checks (the kept forward's a, k and 1 as well as the backward's), a
wrong op, an extra consumer of a removed intermediate; each must leave the chain unfused and
`explain` must name the reason.

layernorm_torch_written: LayerNorms written out in the model code (DeBERTa's DebertaLayerNorm,
the TF-style BertLayerNorm), found by heads sweep 3 (torch-joint DeBERTa v1: 0 of 5 before).
Fixtures: tests/data/make_layernorm_written.py, both families; a negative on the mean's size.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import builders
from kernel_helpers import assert_verifies
from fusecli import FusionPass, load_rules
from fusecli.engine.explain import explain_model
from fusecli.runtime.verify import verify_models

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

def _vi(name, shape):
    return helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)


def _patterns(model):
    fp = FusionPass()
    fp.run(model)
    return fp.stats.patterns


def _sdpa(model):
    return _patterns(model)["sdpa"]


def test_attention_on_3d_view_fuses_and_verifies(tmp_path):
    m = builders.ortt_attention_3d()
    fused = copy.deepcopy(m)
    assert _sdpa(fused).fused == 1
    [node] = [n for n in fused.graph.node if n.op_type == "AttentionGrad"]
    assert node.input[4] == "P3"  # the op reads P in the layout of Q, K, V and dO
    assert list(node.output[:3]) == ["dQ", "dKt", "dV"]
    assert not {n.op_type for n in fused.graph.node} & {"SoftmaxGrad_13", "FusedMatMul"}
    assert_verifies(tmp_path, m, fused)


def test_attention_on_3d_view_with_dropout_before_the_view_is_not_fused():
    # Softmax -> Dropout -> Reshape: the viewed tensor is the dropped P, which the op may not
    # take as P (and the mask is in the other layout): refused
    m = builders.ortt_attention_3d(dropout=True)
    assert _sdpa(copy.deepcopy(m)).fused == 0
    misses = explain_model(m, FusionPass(only=["sdpa_ortt_scores_plain"]))
    assert any(x["rule"] == "sdpa_ortt_scores_plain" for x in misses), misses


def test_attention_on_a_view_that_breaks_the_softmax_rows_is_not_fused():
    # P viewed as [B*H, 8, 2]: its rows are no softmax rows; the shape guard refuses
    m = builders.ortt_attention_3d(p_rows=8)
    stats = _sdpa(copy.deepcopy(m))
    assert stats.fused == 0
    assert stats.skipped == {"shape_mismatch": 1}, stats.skipped


def test_attention_on_3d_view_extra_consumer_of_the_viewed_gradient_is_not_fused():
    m = builders.ortt_attention_3d()
    m.graph.node.append(helper.make_node("Identity", ["dP0"], ["peek"], name="peek"))
    m.graph.output.append(_vi("peek", None))
    assert _sdpa(copy.deepcopy(m)).fused == 0
    misses = explain_model(m, FusionPass(only=["sdpa_ortt_scores_plain"]))
    assert any(x["reason"] == "intermediate_consumed_outside" for x in misses), misses


# --- sdpa_ortt_scores_fill: masked_fill with the scale on the scores (MPT) ----------------
# flash_ortt_mask_masked_fill takes the same chain first (bias_first: the ALiBi bias, then the
# fill); the sdpa rule is checked with flash skipped. via -> (rule, fused backward op, its mask
# input)
FILL_RULES = {"sdpa": ("sdpa_ortt_scores_fill", "AttentionGrad", 8),
              "flash": ("flash_ortt_mask_masked_fill", "FlashAttentionGrad", 7)}


def test_scores_fill_fuses_and_verifies(tmp_path):
    m = builders.ortt_attention_fill()
    node = _fused_verified(m, tmp_path, via="sdpa")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["scale_q"] == pytest.approx(1 / np.sqrt(3), rel=1e-6)
    assert attrs["scale_k"] == pytest.approx(1 / np.sqrt(3), rel=1e-6)
    node = _fused_verified(m, tmp_path, via="flash")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["scale"] == pytest.approx(1 / np.sqrt(3), rel=1e-6)
    assert (attrs["bias_first"], attrs["fill_kept"]) == (1, 0) and node.input[6] == "alibi"


@pytest.mark.parametrize("kw,var", [
    # the fill value is no large negative: P is not 0 where the backward Where zeroes dS
    ({"ninf": -1.0}, "ninf"),
    # the backward Where writes something else than 0
    ({"zero": 1.0}, "zero"),
])
def test_scores_fill_negative_wrong_constant(kw, var):
    m = builders.ortt_attention_fill(**kw)
    assert _attention_fused(copy.deepcopy(m)) == 0
    misses = explain_model(m, FusionPass(only=["sdpa_ortt_scores_fill"]))
    assert any(x["reason"] == "constant" and f"({var})" in x["detail"] for x in misses), misses


def _attention_fused(model):
    """Attentions fused by either pattern (the negatives below are neither's)."""
    p = _patterns(model)
    return p["sdpa"].fused + p["flash_attention"].fused


def _fused_verified(m, tmp_path, feeds=None, via="sdpa"):
    """Fuses m (one attention expected, by FILL_RULES[via]), verifies it against m; returns the
    fused backward node."""
    rule, op, _ = FILL_RULES[via]
    fused = copy.deepcopy(m)
    fp = FusionPass(skip=["flash_attention"] if via == "sdpa" else [])
    fp.run(fused)
    assert [f.rule for f in fp.stats.fusions] == [rule]
    [node] = [n for n in fused.graph.node if n.op_type == op]
    src, out = tmp_path / "m.onnx", tmp_path / "m.fused.onnx"
    onnx.save(m, src)
    onnx.save(fused, out)
    ff = None
    if feeds is not None:
        ff = tmp_path / "feeds.npz"
        np.savez(ff, **feeds)
    report = verify_models(src, out, feeds_file=ff)
    assert report.ok and report.max_rel <= 1e-5, report
    return node


@pytest.mark.parametrize("via", sorted(FILL_RULES))
def test_scores_fill_fully_masked_row_fuses_and_verifies(via, tmp_path):
    # row 0 filled everywhere: P is uniform there (not 0); the op takes the fill mask and
    # zeroes dS there as the absorbed backward Where did (G11)
    mask = np.triu(np.ones((4, 4), bool), 1)[None, None].copy()
    mask[..., 0, :] = True
    node = _fused_verified(builders.ortt_attention_fill(mask=mask), tmp_path, via=via)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.input[FILL_RULES[via][2]] == "mask" and attrs.get("fill_kept", 0) == 0


@pytest.mark.parametrize("via", sorted(FILL_RULES))
def test_scores_fill_run_time_mask_with_a_fully_padded_sequence(via, tmp_path):
    # a padding mask computed at run time, one sequence fully filled: exact (G11)
    mask = np.zeros((2, 1, 4, 4), bool)
    mask[0, ..., 2:] = True
    mask[1] = True
    node = _fused_verified(builders.ortt_attention_fill(mask=mask, mask_input=True), tmp_path,
                           {"mask": mask}, via=via)
    assert node.input[FILL_RULES[via][2]] == "mask"


def test_scores_fill_negative_backward_mask_is_not_the_forward_mask():
    # the backward zeroes where another mask says: no proof that P is 0 there
    m = builders.ortt_attention_fill(bwd_mask="mask_all")
    assert _attention_fused(copy.deepcopy(m)) == 0
    misses = explain_model(m, FusionPass(only=["sdpa_ortt_scores_fill"]))
    assert any(x["rule"] == "sdpa_ortt_scores_fill" for x in misses), misses


def test_scores_fill_negative_extra_consumer():
    m = builders.ortt_attention_fill()
    m.graph.node.append(helper.make_node("Identity", ["dSb"], ["peek"], name="peek"))
    m.graph.output.append(_vi("peek", None))
    assert _attention_fused(copy.deepcopy(m)) == 0
    misses = explain_model(m, FusionPass(only=["sdpa_ortt_scores_fill"]))
    assert any(x["reason"] == "intermediate_consumed_outside" for x in misses), misses


# --- layernorm_torch: dBeta optional (LayerNorm without bias: MPT, nn.LayerNorm(bias=False)) ---

SAMPLES = Path(__file__).parents[1] / "samples"


def _ln_records(model):
    fp = FusionPass(rules=_upto("layernorm_torch"))
    fp.run(model)
    return [f for f in fp.stats.fusions if f.rule == "layernorm_torch"]


def test_layernorm_without_bias_fuses_and_verifies(tmp_path):
    m = onnx.load(DATA / "torch_layernorm_nobias.onnx")
    fused = copy.deepcopy(m)
    [rec] = _ln_records(fused)
    assert "dbeta" not in rec.nodes
    [node] = [n for n in fused.graph.node if n.op_type == "LayerNormGrad"]
    outs = [*node.output, "", "", ""]
    assert outs[1] and outs[2] == ""  # dGamma, no dBeta
    out = tmp_path / "fused.onnx"
    onnx.save(fused, out)
    report = verify_models(DATA / "torch_layernorm_nobias.onnx", out)
    assert report.ok and report.max_rel <= 1e-5, report


def test_layernorm_with_bias_still_takes_dbeta():
    m = onnx.load(SAMPLES / "torch_block.onnx")
    recs = _ln_records(m)
    assert recs and all("dbeta" in r.nodes for r in recs)


def test_layernorm_dbeta_over_the_wrong_axes_is_left_outside():
    # the bias gradient summed over the LAST axis is no dBeta: the optional node does not take
    # it (the LayerNorm still fuses, without dBeta; the ReduceSum stays and computes its value)
    m = onnx.load(SAMPLES / "torch_block.onnx")
    rec = _ln_records(copy.deepcopy(m))[0]
    node = next(n for n in m.graph.node if n.name == rec.nodes["dbeta"])
    axes = next(t for t in m.graph.initializer if t.name == node.input[1])
    rank_last = np.asarray([-1], dtype=numpy_helper.to_array(axes).dtype)
    m.graph.initializer.append(numpy_helper.from_array(rank_last, "axes_last_mutated"))
    node.input[1] = "axes_last_mutated"
    recs = _ln_records(copy.deepcopy(m))
    mine = [r for r in recs if r.nodes.get("xc") == rec.nodes["xc"]]
    assert mine and "dbeta" not in mine[0].nodes
    fp = FusionPass()
    fp.run(m)
    assert node.name in {n.name for n in m.graph.node}


# --- layernorm_ortt_centred: LayerNorm without bias, ort-training (MPT, ModernBERT) ---------

def _centred(model):
    fp = FusionPass()
    fp.run(model)
    return fp.stats


@pytest.mark.parametrize("residual", [True, False])
def test_layernorm_centred_fuses_and_verifies(residual, tmp_path):
    m = builders.ortt_layernorm_centred(residual=residual)
    fused = copy.deepcopy(m)
    stats = _centred(fused)
    assert [f.rule for f in stats.fusions] == ["layernorm_ortt_centred"]
    assert stats.patterns["rmsnorm"].fused == 0
    [node] = [n for n in fused.graph.node if n.op_type == "LayerNormGrad"]
    assert list(node.input[:5]) == ["dY", "X", "gamma", "mean", "inv_std"]
    assert_verifies(tmp_path, m, fused)


@pytest.mark.parametrize("kw,reason", [
    # c = X - mean(another tensor): no LayerNorm (rmsnorm_ortt still fuses the RMSNorm of c)
    ({"mean_of": "X2"}, None),
    # the mean over the middle axis, or the normalisation over more than the last axis
    ({"mean_axes": (1,)}, "attribute"),
    ({"sln_axis": 1}, "attribute"),
    # the mean's gradient summed over another axis than the one the mean reduced
    ({"sum_axes": (1,)}, "constant"),
])
def test_layernorm_centred_negatives(kw, reason):
    m = builders.ortt_layernorm_centred(**kw)
    stats = _centred(copy.deepcopy(m))
    assert stats.patterns["layernorm"].fused == 0
    misses = explain_model(m, FusionPass(only=["layernorm_ortt_centred"]), include_shallow=True)
    assert any(x["rule"] == "layernorm_ortt_centred" for x in misses), misses
    if reason:
        assert any(x["reason"] == reason for x in misses), misses


def test_layernorm_centred_extra_consumer():
    m = builders.ortt_layernorm_centred()
    m.graph.node.append(helper.make_node("Identity", ["dmean"], ["peek"], name="peek"))
    m.graph.output.append(_vi("peek", None))
    assert _centred(copy.deepcopy(m)).patterns["layernorm"].fused == 0
    misses = explain_model(m, FusionPass(only=["layernorm_ortt_centred"]))
    assert any(x["reason"] == "intermediate_consumed_outside" for x in misses), misses




def test_layernorm_without_weight_fuses_with_gamma_absent(tmp_path):
    """nn.LayerNorm(elementwise_affine=False) (OLMo's F.layer_norm(x, shape, None, None)): no
    dY * gamma, no dGamma, no dBeta; LayerNormGrad takes gamma as absent (1)."""
    m = onnx.load(DATA / "torch_layernorm_noaffine.onnx")
    fused = copy.deepcopy(m)
    [rec] = _ln_records(fused)
    assert not {"g", "dy_xhat", "dgamma", "dbeta"} & set(rec.nodes)
    [node] = [n for n in fused.graph.node if n.op_type == "LayerNormGrad"]
    assert node.input[2] == "" and list(node.output)[1:] in ([], [""], ["", ""])
    out = tmp_path / "fused.onnx"
    onnx.save(fused, out)
    report = verify_models(DATA / "torch_layernorm_noaffine.onnx", out)
    assert report.ok and report.max_rel <= 1e-5, report


@pytest.mark.parametrize("gamma,ok", [([16], True), ([1], False), ([], False), (None, True)])
def test_layernorm_gamma_must_have_the_normalised_size(gamma, ok):
    """A scalar multiplied onto dY (the MSE loss scale in front of a final LayerNorm without
    weight) is no gamma: the shape guard refuses it, so the matcher takes g = dY instead."""
    from fusecli.engine.shapes import input_problem

    why = input_problem("LayerNormGrad", {"axis": -1}, [[6, 16], [6, 16], gamma, [6, 1], [6, 1]],
                        ["dY", "X", "gamma", "mean", "rstd"])
    assert (why is None) is ok, why


# --- layernorm_torch_written (heads sweep 3: DeBERTa v1's DebertaLayerNorm) ------------------

@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_layernorm_written_out_fuses_and_verifies(family, tmp_path):
    """Three LayerNorms written out (tests/data/make_layernorm_written.py): weight and bias, a
    pre-norm residual block (its input's gradient takes the residual's), weight alone; epsilon
    1e-7 kept and 1e-12 dropped by torch's exporter. Counts from the model code: layernorm 3.
    torch-joint's LayerNormGrad reads the forward's mean and the Reciprocal of its std, which
    the replacement prepares; each fusion matches the op's NumPy reference on the original's
    tensors."""
    from fusecli.runtime.verify import check_fusions

    src = DATA / f"{family}_layernorm_written.onnx"
    m = onnx.load(src)
    fp = FusionPass()
    fp.run(m)
    assert {p: s.fused for p, s in fp.stats.patterns.items() if s.fused} == {"layernorm": 3}
    if family == "torch":
        grads = [n for n in m.graph.node if n.op_type == "LayerNormGrad"]
        recips = {n.output[0] for n in m.graph.node if n.op_type == "Reciprocal"}
        assert len(grads) == 3 and all(g.input[4] in recips for g in grads)
        assert sum(len(g.input) > 5 and bool(g.input[5]) for g in grads) == 1   # the residual
        assert sum(bool(g.output[2]) if len(g.output) > 2 else 0 for g in grads) == 2  # biases
        checks = check_fusions(src, fp.stats.fusions, atol=1e-6)
        assert checks and not [(c.rule, d.name) for c in checks for d in c.outputs if not d.ok]
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


def test_layernorm_written_out_over_another_count_is_not_fused():
    """The mean's gradient divided by 8 where the rows have 16 values: not a LayerNorm's
    backward (N is checked to be the last dim), so none of the three fuse, and explain says
    why."""
    m = onnx.load(DATA / "torch_layernorm_written.onnx")
    sixteen = {t.name for t in m.graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT and numpy_helper.to_array(t).size == 1
               and float(numpy_helper.to_array(t)) == 16.0}
    assert sixteen
    for t in m.graph.initializer:
        if t.name in sixteen:
            t.CopyFrom(numpy_helper.from_array(np.array(8.0, np.float32), t.name))
    assert FusionPass().run(copy.deepcopy(m)) == 0
    rules = [r for r in load_rules() if r.name == "layernorm_torch_written"]
    misses = explain_model(m, FusionPass(rules=rules))
    assert any("last dim" in x["detail"] for x in misses), misses
