"""Flash attention with a bool mask read by Where (issue 36): real exports of both families
(tests/data/make_flash_mask.py: GPT-2's causal where with finfo.min, the mask built at run time
from attention_mask with fully masked rows, GPT-2's where + additive padding mask, masked_fill
of a sliding window with -inf) fuse their attention as FlashAttention + FlashAttentionGrad with
the Where's condition as the ops' mask input, and verify against the original; look-alikes the
ops cannot compute exactly are not fused as flash.

Sliding windows (mask = (j <= i) & (i - j < 3)) as their own exports, both families: Where with
finfo.min, the same & a run-time padding mask, an additive band bias (constant, and built at run
time with the padding): each fuses as flash attention and verifies (the fused model, and each
fused op's NumPy reference against the original's subgraph); with padding that leaves whole
windows padded, the fully masked rows are checked in the original (uniform softmax) and the
fused graph verified on those feeds. ort-training also at opset 12."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusecli import FusionPass
from fusecli.runtime.verify import check_fusions, verify_models

DATA = Path(__file__).parent / "data"
FMIN = float(np.finfo(np.float32).min)

# counts from the model code (tests/data/make_flash_mask.py): one attention (forward and
# backward in the graph, nothing else reads P), two LayerNorms, one Linear + GELU
EXPECTED = {"flash_attention": 1, "layernorm": 2, "linear_gelu": 1}
# kind -> (fill, fill_kept, an additive bias too)
KINDS = {"where_causal": (FMIN, 1, False), "where_causal_pad": (FMIN, 1, False),
         "where_gpt2_pad": (FMIN, 1, True), "fill_causal_pad": (-np.inf, 0, True),
         "fill_window_ninf": (-np.inf, 0, False)}
CASES = [(f"{fam}_flash_{k}", k) for fam in ("ortt", "torch") for k in KINDS]


def _fuse(m):
    fp = FusionPass()
    fp.run(m)
    return {p: s.fused for p, s in fp.stats.patterns.items() if s.fused}


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("name,kind", CASES, ids=[c[0] for c in CASES])
def test_where_mask_exports_fuse_as_flash_and_verify(name, kind, tmp_path):
    src = DATA / f"{name}.onnx"
    m = onnx.load(src)
    conds = {n.input[0] for n in m.graph.node if n.op_type == "Where"}
    assert _fuse(m) == EXPECTED
    fwd = [n for n in m.graph.node if n.op_type == "FlashAttention"]
    bwd = [n for n in m.graph.node if n.op_type == "FlashAttentionGrad"]
    assert len(fwd) == len(bwd) == 1
    fill, kept, has_bias = KINDS[kind]
    for node, imask in ((fwd[0], 4), (bwd[0], 7)):
        a = _attrs(node)
        assert a["fill"] == pytest.approx(fill) if np.isfinite(fill) else a["fill"] == fill
        assert a.get("fill_kept", 1) == kept and a.get("bias_first", 0) == 0
        assert node.input[imask] in conds  # the Where's own condition, read as bool
        assert bool(node.input[imask - 1]) == has_bias
    # no Softmax / SoftmaxGrad / score Where left: P is never produced
    assert not [n for n in m.graph.node if n.op_type in ("Softmax", "SoftmaxGrad_13")]
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


def _where_nodes(m):
    """(forward Where feeding the scores, backward Where of the score gradient)."""
    ws = [n for n in m.graph.node if n.op_type == "Where"]
    fwd = [n for n in ws if any(c.op_type in ("Softmax", "Add") for c in m.graph.node
                                for o in n.output if o in c.input)]
    bwd = [n for n in ws if n not in fwd and n.input[0] == fwd[0].input[0]]
    assert fwd and bwd, "fixture spelling changed"
    return fwd[0], bwd[0]


def _set_init(m, name, value):
    for i, t in enumerate(m.graph.initializer):
        if t.name == name:
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(
                np.asarray(value, np.float32), name))
            return
    raise KeyError(name)


def _fresh_fill(m, fwd, value):
    """Points the forward Where's fill at a new initializer (the fill may be shared)."""
    name = "neg_fill"
    m.graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
    i = 2 if fwd.input[2] and _is_init(m, fwd.input[2]) else 1
    fwd.input[i] = name


def _is_init(m, name):
    return any(t.name == name for t in m.graph.initializer)


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_grouped_kv_where_spellings_fuse_as_flash_and_verify(family, tmp_path):
    """Four attention layers on grouped K / V (repeat_kv, 2 query heads on 1 kv head), one per
    Where spelling (where, where + padding mask, masked_fill, masked_fill + padding mask):
    flash_attention 4 (model code), verified."""
    src = DATA / f"{family}_flash_gqa_where_all.onnx"
    m = onnx.load(src)
    assert _fuse(m) == {"flash_attention": 4}
    kept = sorted(_attrs(n).get("fill_kept", 1) for n in m.graph.node
                  if n.op_type == "FlashAttention")
    assert kept == [0, 0, 1, 1]
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


@pytest.mark.parametrize("family", ["ortt", "torch"])
@pytest.mark.parametrize("change", ["fill_runtime", "fill_small", "bwd_other_mask",
                                    "bwd_polarity"])
def test_where_look_alikes_are_not_flash(family, change):
    """The Where's false branch a run-time tensor (not a constant fill), a fill above -1e4
    (not a mask), the backward Where on another mask than the forward's, or with the other
    polarity than the forward's (its gradient would not be Where's): not flash attention."""
    m = onnx.load(DATA / f"{family}_flash_where_causal.onnx")
    fwd, bwd = _where_nodes(m)
    if change == "fill_runtime":
        m.graph.input.append(helper.make_tensor_value_info("fill_in", onnx.TensorProto.FLOAT, []))
        fwd.input[2] = "fill_in"
    elif change == "fill_small":
        _fresh_fill(m, fwd, -1.0)
    elif change == "bwd_other_mask":
        shape = None
        for t in m.graph.initializer:
            if t.name == bwd.input[0]:
                shape = list(t.dims)
        other = np.ones(shape or [1, 1, 8, 8], bool)
        m.graph.initializer.append(numpy_helper.from_array(other, "other_mask"))
        bwd.input[0] = "other_mask"
    else:
        bwd.input[1], bwd.input[2] = bwd.input[2], bwd.input[1]
    assert _fuse(m).get("flash_attention", 0) == 0


# --- heads sweep 3's CodeGen and CTRL spellings (tests/data/make_flash_mask.py) ----------------

def _fused_as_expected(m) -> list:
    """Fuses ``m`` in place: EXPECTED's counts; returns the fusions."""
    fp = FusionPass()
    fp.run(m)
    assert {p: s.fused for p, s in fp.stats.patterns.items() if s.fused} == EXPECTED
    return fp.stats.fusions


def _verified_with_references(src, fused, fusions, tmp_path) -> None:
    """The fused model against the original (every output), and each fused op's NumPy
    reference on the original's tensors (a prepared input computed from them)."""
    out = tmp_path / "fused.onnx"
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report
    checks = check_fusions(src, fusions, atol=1e-6)
    assert checks and not [(c.rule, d.name) for c in checks for d in c.outputs if not d.ok]


# kind -> the op of the node computing the ops' bias (replace.prepare)
PREPARED = {"bias_prescale_pad": "Div", "bias2_causal_pad": "Add"}


@pytest.mark.parametrize("family", ["ortt", "torch"])
@pytest.mark.parametrize("kind", sorted(PREPARED))
def test_masks_the_ops_take_as_one_prepared_bias_fuse_and_verify(kind, family, tmp_path):
    """CodeGen's (Q K^T + mask) / c: the ops' bias is mask / c; CTRL's scores / c + causal *
    -1e4 + padding mask: the ops' bias is the two masks' sum. One standard node computes it
    from the original's own mask tensors, before the forward op; both ops read it."""
    src = DATA / f"{family}_flash_{kind}.onnx"
    m = onnx.load(src)
    mask_adds = [n for n in m.graph.node if n.op_type == "Add"]
    fusions = _fused_as_expected(m)
    fwd = next(n for n in m.graph.node if n.op_type == "FlashAttention")
    bwd = next(n for n in m.graph.node if n.op_type == "FlashAttentionGrad")
    prep = next(n for n in m.graph.node if fwd.input[3] in n.output)
    assert prep.op_type == PREPARED[kind] and bwd.input[6] == fwd.input[3]
    order = [n.name for n in m.graph.node]
    assert order.index(prep.name) < order.index(fwd.name)
    originals = {t for n in mask_adds for t in n.input}
    if kind == "bias2_causal_pad":
        assert set(prep.input) <= originals and _attrs(fwd)["scale"] == pytest.approx(0.5)
    else:  # the mask the scores were added to, and the Div's divisor
        assert prep.input[0] in originals and _attrs(fwd)["scale"] == pytest.approx(0.5)
    _verified_with_references(src, m, fusions, tmp_path)


def test_a_mask_multiplied_on_fuses_as_a_bool_mask_with_fill_zero(tmp_path):
    """OpenAI GPT's S * b + -1e4 * (1 - b), b a 0 / 1 float causal buffer (folded to a
    constant by the ort-training exporter): Where(b, S, 0) + M exactly, the ops' bool mask
    (b cast by one prepared node) with fill 0 and the bias M; the Mul's gradient dS * b is the
    ops' zeroed score gradient."""
    src = DATA / "ortt_flash_mulmask_causal.onnx"
    m = onnx.load(src)
    muls = {t for n in m.graph.node if n.op_type == "Mul" for t in n.input}
    fusions = _fused_as_expected(m)
    fwd = next(n for n in m.graph.node if n.op_type == "FlashAttention")
    bwd = next(n for n in m.graph.node if n.op_type == "FlashAttentionGrad")
    cast = next(n for n in m.graph.node if fwd.input[4] in n.output)
    assert cast.op_type == "Cast" and cast.input[0] in muls and bwd.input[7] == fwd.input[4]
    a = _attrs(fwd)
    assert (a["fill"], a["fill_kept"], a["bias_first"]) == (0.0, 1, 0) and fwd.input[3]
    _verified_with_references(src, m, fusions, tmp_path)


def test_a_mask_multiplied_on_that_is_not_zero_one_is_not_flash():
    """The same graph with one element of b at 0.5 (S * b is then no Where): not flash
    attention, and explain names the buffer."""
    from fusecli import load_rules
    from fusecli.engine.explain import explain_model

    m = onnx.load(DATA / "ortt_flash_mulmask_causal.onnx")
    fwd_mul = next(n for n in m.graph.node if n.op_type == "Mul" and any(
        t.name in n.input and numpy_helper.to_array(t).ndim == 4 for t in m.graph.initializer))
    b = next(t for t in m.graph.initializer if t.name in fwd_mul.input)
    arr = numpy_helper.to_array(b).copy()
    arr.flat[0] = 0.5
    b.CopyFrom(numpy_helper.from_array(arr, b.name))
    assert _fuse(copy.deepcopy(m)).get("flash_attention", 0) == 0
    rules = [r for r in load_rules() if r.name == "flash_ortt_mulmask"]
    misses = explain_model(m, FusionPass(rules=rules))
    assert any("other than 0 and 1" in x["detail"] for x in misses), misses


# --- the architecture sweep's Falcon and MPT spellings (tests/data/make_flash_mask.py) ---------

@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_bias_then_masked_fill_fuses_with_bias_first(family, tmp_path):
    """MPT's order: scores + ALiBi bias, then masked_fill(~(causal & attention_mask), finfo.min):
    a filled score is the fill alone (bias_first 1), the Where's condition read as bool, the
    ALiBi bias as the ops' bias; the padding leaves no row fully masked here."""
    src = DATA / f"{family}_flash_alibi_fill_pad.onnx"
    m = onnx.load(src)
    conds = {n.input[0] for n in m.graph.node if n.op_type == "Where"}
    assert _fuse(m) == EXPECTED
    for op, imask in (("FlashAttention", 4), ("FlashAttentionGrad", 7)):
        node = next(n for n in m.graph.node if n.op_type == op)
        a = _attrs(node)
        assert (a["bias_first"], a["fill_kept"]) == (1, 0) and a["fill"] == pytest.approx(FMIN)
        assert node.input[imask] in conds and node.input[imask - 1]
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_bias_then_masked_fill_look_alike_is_not_flash(family):
    """The same graph with a fill above -1e4 (not a mask: S + bias would differ from the fill):
    not flash attention."""
    m = onnx.load(DATA / f"{family}_flash_alibi_fill_pad.onnx")
    fwd, _ = _where_nodes(m)
    _fresh_fill(m, fwd, -1.0)
    assert _fuse(m).get("flash_attention", 0) == 0


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_multi_query_broadcast_by_the_matmuls_fuses_and_verifies(family, tmp_path):
    """Falcon's multi-query attention: K / V of one head broadcast to the query heads by the
    matmuls (ort-training: inside MatMul; torch-joint: Expand before the batched views), their
    gradients summed over the heads after: the ops read K / V of one head, write theirs."""
    src = DATA / f"{family}_flash_mqa_bias_causal.onnx"
    m = onnx.load(src)
    assert _fuse(m) == EXPECTED
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in (*m.graph.value_info, *m.graph.input, *m.graph.output)}
    bwd = next(n for n in m.graph.node if n.op_type == "FlashAttentionGrad")
    q, k, v = (shapes.get(t) for t in bwd.input[1:4])
    assert q[1] == 2 and k[1] == v[1] == 1  # 2 query heads, 1 kv head
    assert _attrs(bwd)["k_transposed"] == 1
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


# model code -> (flash_attention count, fill_kept per layer, bias_first per layer, K / V of one
# head): mqa_all's eight spellings (keep, keep_pad, fill, fill_pad, bias, plain, alibi_keep,
# alibi_fill), alibi_all's two on full heads then two on repeat_kv's groups
LAYER_SETS = {"mqa_all": (8, [1, 1, 0, 0, None, None, 1, 0], [0, 0, 0, 0, 0, 0, 1, 1], True),
              "alibi_all": (4, [1, 0, 1, 0], [1, 1, 1, 1], False)}


@pytest.mark.parametrize("family", ["ortt", "torch"])
@pytest.mark.parametrize("kind", sorted(LAYER_SETS))
def test_every_spelling_on_broadcast_and_grouped_kv_fuses_and_verifies(kind, family, tmp_path):
    src = DATA / f"{family}_flash_{kind}.onnx"
    m = onnx.load(src)
    count, kept, first, one_kv = LAYER_SETS[kind]
    assert _fuse(m) == {"flash_attention": count}
    fwd = [n for n in m.graph.node if n.op_type == "FlashAttention"]
    # a node without a Where mask (no bool mask input) has no fill_kept to read (None)
    got = [(_attrs(n).get("fill_kept", 1) if len(n.input) > 4 and n.input[4] else None,
            _attrs(n).get("bias_first", 0)) for n in fwd]
    assert sorted(got, key=str) == sorted(zip(kept, first), key=str)
    if one_kv:
        shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
                  for v in (*m.graph.value_info, *m.graph.input)}
        for n in m.graph.node:
            if n.op_type == "FlashAttentionGrad":
                assert shapes[n.input[2]][1] == shapes[n.input[3]][1] == 1
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


def test_torchscript_sdpa_spellings_fuse_as_flash_and_verify(tmp_path):
    """torch's scaled_dot_product_attention exported for ort-training (make_flash_mask.py
    sdpa_all, model code): is_causal, a bool mask (0 / -inf added, then Where(IsNaN(P), 0, P)
    before the P V MatMul and on dP: the ops' nan_guard), an additive float mask, no mask:
    flash_attention 4, one of them guarded; verified."""
    src = DATA / "ortt_flash_sdpa_all.onnx"
    m = onnx.load(src)
    fp = FusionPass()
    fp.run(m)
    assert {p: s.fused for p, s in fp.stats.patterns.items() if s.fused} == {"flash_attention": 4}
    assert sorted(f.rule for f in fp.stats.fusions) == [
        "flash_ortt_mask", "flash_ortt_mask", "flash_ortt_mask_nanguard", "flash_ortt_plain"]
    guards = sorted(_attrs(n).get("nan_guard", 0) for n in m.graph.node
                    if n.op_type in ("FlashAttention", "FlashAttentionGrad"))
    assert guards == [0] * 6 + [1] * 2
    assert not [n for n in m.graph.node if n.op_type in ("IsNaN", "Softmax")]
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


def test_torch_math_sdpa_spellings_fuse_as_flash_and_verify(tmp_path):
    """torch's scaled_dot_product_attention in a torch-joint graph, exported under
    SDPBackend.MATH (make_flash_mask.py sdpa_math_all, model code): the scale's square root on
    Q and K^T, the mask added, _safe_softmax's Where(all(S == -inf), 0, P) (the ops' nan_guard
    2): is_causal, a bool mask, a float mask and none on full heads; a bool mask, a float mask
    and none on repeat_kv's groups (the Mul after the transpose absorbed into the ops' scale)
    and on one kv head broadcast by sdpa: flash_attention 10; verified."""
    src = DATA / "torch_flash_sdpa_math_all.onnx"
    m = onnx.load(src)
    fp = FusionPass()
    fp.run(m)
    assert {p: s.fused for p, s in fp.stats.patterns.items() if s.fused} == {"flash_attention": 10}
    assert sorted(f.rule for f in fp.stats.fusions) == sorted(
        ["flash_torch_mask_safe"] * 3 + ["flash_torch_plain_safe"]
        + [f"flash_torch_{kv}_{b}_safe" for kv in ("gqa", "mqa") for b in ("mask", "mask", "plain")])
    fwd = [n for n in m.graph.node if n.op_type == "FlashAttention"]
    assert sorted(_attrs(n)["nan_guard"] for n in m.graph.node
                  if n.op_type in ("FlashAttention", "FlashAttentionGrad")) == [2] * 20
    # the scale: 1 where the ops read the scaled Q and K^T; 1 / sqrt(d) = sqrt(d)^-0.5 twice
    # (Q's share outside, K^T's absorbed) on repeat_kv's groups, whose K the ops read unscaled
    assert sorted(round(_attrs(n).get("scale", 1.0), 6) for n in fwd) == [
        round(4 ** -0.25, 6)] * 3 + [1.0] * 7
    assert not [n for n in m.graph.node if n.op_type in ("ReduceMin", "Softmax")]
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


# --- sliding windows (tests/data/make_flash_mask.py, W = 3: mask = (j <= i) & (i - j < W)) ------

# kind -> (a Where on the scores: its condition is the ops' mask, fill finfo.min kept where
# True; else an additive band bias: the ops' bias input, no mask)
WINDOWS = {"where_window": True, "where_window_pad": True, "bias_window": False,
           "bias_window_pad": False}
# ort-training exports with the forward at opset 12 (Softmax(axis=3) + SoftmaxGrad)
WINDOWS_OPSET12 = ["where_causal", "where_window", "bias_window_pad"]
WINDOW_CASES = ([(fam, k) for fam in ("ortt", "torch") for k in WINDOWS]
                + [("ortt", f"{k}_opset12") for k in WINDOWS_OPSET12])
# the padding of make_flash_mask.py's window kinds: batch 1's keys 0..2 padded, so its queries
# 0, 1 and 2 (windows {0}, {0, 1}, {0, 1, 2}) see no key at all
WINDOW_PAD = np.array([[1] * 6 + [0] * 2, [0] * 3 + [1] * 5], np.int64)


def _window_keep(mask=None):
    """The model code's mask [B or 1, S, S]: (j <= i) & (i - j < 3) [& attention_mask]."""
    i = np.arange(8)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)
    return keep[None] if mask is None else keep[None] & mask[:, None, :].astype(bool)


@pytest.mark.parametrize("fam,style", WINDOW_CASES, ids=[f"{f}_{s}" for f, s in WINDOW_CASES])
def test_sliding_window_exports_fuse_as_flash_and_verify(fam, style, tmp_path):
    from test_flash import assert_verifies

    src = DATA / f"{fam}_flash_{style}.onnx"
    m = onnx.load(src)
    kind = style.removesuffix("_opset12")
    where = WINDOWS.get(kind, True)
    conds = {n.input[0] for n in m.graph.node if n.op_type == "Where"}
    # at opset 12 too (the Linear + GELU's bias gradient: a ReduceSum with an axes attribute)
    assert _fuse(m) == EXPECTED
    fwd = [n for n in m.graph.node if n.op_type == "FlashAttention"]
    bwd = [n for n in m.graph.node if n.op_type == "FlashAttentionGrad"]
    assert len(fwd) == len(bwd) == 1
    for node, imask in ((fwd[0], 4), (bwd[0], 7)):
        inputs = list(node.input) + [""] * 8
        if where:
            a = _attrs(node)
            assert a["fill"] == pytest.approx(FMIN) and a.get("fill_kept", 1) == 1
            assert inputs[imask] in conds and not inputs[imask - 1]
        else:
            assert inputs[imask - 1] and not inputs[imask]  # the band bias, no bool mask
    assert not [n for n in m.graph.node
                if n.op_type in ("Softmax", "SoftmaxGrad", "SoftmaxGrad_13")]
    stats = FusionPass()
    orig = onnx.load(src)
    fused_m = copy.deepcopy(orig)
    stats.run(fused_m)
    assert_verifies(src, fused_m, stats.stats, tmp_path)


def _probabilities(src, feeds_path, tmp_path):
    """The original's Softmax output P [B, H, S, S] on the feeds."""
    from fusecli.runtime.feeds import make_feeds
    from fusecli.runtime.runner import pick_runtime, run_in_runtime

    m = onnx.load(src)
    p = next(n for n in m.graph.node if n.op_type == "Softmax").output[0]
    m.graph.output.append(helper.make_tensor_value_info(p, onnx.TensorProto.FLOAT, None))
    path = tmp_path / "probe.onnx"
    onnx.save(m, path)
    feeds = make_feeds(m, seed=0)
    feeds.update(dict(np.load(feeds_path)))
    outs, _ = run_in_runtime(path, feeds, pick_runtime(m))
    return outs[p]


@pytest.mark.parametrize("fam,style", [(f, k) for f in ("ortt", "torch")
                                       for k in ("where_window_pad", "bias_window_pad")]
                         + [("ortt", "bias_window_pad_opset12")], ids=lambda v: v)
def test_sliding_window_fully_masked_rows_verify(fam, style, tmp_path):
    """With batch 1's keys 0..2 padded, its queries 0..2 have no key in their window: the
    original's softmax gives those rows the uniform 1/S (every score filled alike), the other
    rows are 0 outside the window; the fused graph computes the same outputs and gradients."""
    src = DATA / f"{fam}_flash_{style}.onnx"
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, attention_mask=WINDOW_PAD)
    keep = _window_keep(WINDOW_PAD)                       # [B, S, S]
    full = ~keep.any(-1)
    assert full[1, :3].all() and full.sum() == 3          # the model code's fully masked rows
    p = _probabilities(src, feeds, tmp_path)              # [B, H, S, S]
    np.testing.assert_allclose(p[1, :, :3], 1.0 / 8, rtol=1e-6)
    live = np.broadcast_to(~full[:, None, :, None] & ~keep[:, None], p.shape)
    assert np.all(p[live] == 0)
    m = onnx.load(src)
    assert _fuse(m)["flash_attention"] == 1
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out, feeds_file=feeds)
    assert report.ok and report.max_rel <= 1e-5, report


# --- scores on [B * H] views: BLOOM's and GPT-NeoX-Japanese's baddbmm (make_flash_mask.py) ----

def _bmm_layers(m) -> tuple[list, list, dict]:
    """Fuses ``m`` in place (flash 12): its fused forward ops in graph order, each with the
    node the replacement added to write its bias (None: no bias, or one the original
    computes); the fusions; every tensor's producer."""
    original = {n.name for n in m.graph.node}
    fp = FusionPass()
    fp.run(m)
    assert {p: s.fused for p, s in fp.stats.patterns.items() if s.fused} == {
        "flash_attention": 12}
    made = {o: n for n in m.graph.node for o in n.output}
    added = {t: n for t, n in made.items() if n.name not in original}
    fwd = [n for n in m.graph.node if n.op_type == "FlashAttention"]
    return ([(n, added.get(n.input[3]) if len(n.input) > 3 and n.input[3] else None)
             for n in fwd], fp.stats.fusions, made)


def _rank(m, name) -> int | None:
    for v in (*m.graph.value_info, *m.graph.input):
        if v.name == name:
            return len(v.type.tensor_type.shape.dim)
    return None


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_scores_on_batched_head_views_fuse_as_flash_and_verify(family, tmp_path):
    """bmm_all's twelve layers (model code: the term on the [B * H] view, BLOOM's ALiBi through
    baddbmm(ALiBi, q3, k3^T, beta 1, alpha), GPT-NeoX-Japanese's baddbmm(zeros, ...) or
    bmm(q3, k3^T) * alpha; the additive padding mask after the view or none; P V on the views
    or on the 4-D heads): flash 12. The ops read the 4-D heads (K not transposed: the view's
    input); the ALiBi term [B * H, 1, S] becomes the ops' bias viewed to [B, H, 1, S] by a
    prepared Reshape (plus the mask, where there is one), the zeros no bias at all; each op
    checked against its NumPy reference on the original's tensors, the fused model against the
    original."""
    src = DATA / f"{family}_flash_bmm_all.onnx"
    m = onnx.load(src)
    layers, fusions, made = _bmm_layers(m)
    consts = {n.output[0]: list(n.attribute[0].ints) for n in m.graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].ints}
    kinds = []
    for fwd, prep in layers:
        a = _attrs(fwd)
        assert a["k_transposed"] == 0 and a["scale"] == pytest.approx(0.5)
        assert _rank(m, fwd.input[0]) == 4 and _rank(m, fwd.input[1]) == 4
        if prep is None:
            kinds.append("mask" if len(fwd.input) > 3 and fwd.input[3] else "none")
            continue
        if prep.op_type == "Add":  # the ALiBi view plus the mask
            prep = next(made[t] for t in prep.input if t in made and made[t].op_type == "Reshape")
            kinds.append("alibi+mask")
        else:
            kinds.append("alibi")
        assert prep.op_type == "Reshape" and consts[prep.input[1]] == [2, 2, 1, 8]
    assert sorted(kinds) == sorted(["alibi", "alibi+mask"] * 2 + ["mask", "none"] * 4)
    _verified_with_references(src, m, fusions, tmp_path)


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_an_added_term_that_is_not_zeros_is_read_as_a_bias(family, tmp_path):
    """GPT-NeoX-Japanese's zeros made 0.25 everywhere: adding them changes the scores, so the
    four layers no longer fuse as `zeros` (no bias): theirs is the ALiBi spelling's
    [B * H, S, S] term, the ops' bias, and the fused model still verifies against the changed
    original."""
    m = onnx.load(DATA / f"{family}_flash_bmm_all.onnx")
    zeros = [t for t in m.graph.initializer
             if len(t.dims) == 3 and not numpy_helper.to_array(t).any()]
    assert zeros
    for z in zeros:
        z.CopyFrom(numpy_helper.from_array(np.full(list(z.dims), 0.25, np.float32), z.name))
    src = tmp_path / "changed.onnx"
    onnx.save(m, src)
    fp = FusionPass()
    fused = onnx.load(src)
    fp.run(fused)
    rules = sorted(f.rule for f in fp.stats.fusions)
    assert not [r for r in rules if "_zeros_" in r] and sum("_alibi_" in r for r in rules) == 8
    _verified_with_references(src, fused, fp.stats.fusions, tmp_path)


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_batched_views_of_other_dims_are_not_flash(family):
    """bmm_seqheads: the same code on [B, S, H, dh] (the heads not moved before the view: each
    query position attends over the heads): the ops on the view's 4-D input would attend over
    the sequence. The scores' view [B, H, S, S] does not have the batch dims of that input
    (`same_batch_dims_as` Q4), so the rule refuses (sdpa, which works on the views themselves,
    takes it), and explain says why; without that check, the shape guard refuses (the mask
    does not broadcast to [B, S, H, H])."""
    from fusecli import load_rules
    from fusecli.engine.explain import explain_model

    m = onnx.load(DATA / f"{family}_flash_bmm_seqheads.onnx")
    assert _fuse(copy.deepcopy(m)) == {"sdpa": 1}
    rule = f"flash_{family}_bmm_none_mask" + ("_v3" if family == "ortt" else "")
    misses = explain_model(m, FusionPass(rules=[r for r in load_rules() if r.name == rule]))
    assert any("batch dims (all but the last two) of Q4" in x["detail"] for x in misses), \
        misses
    checked = next(r for r in load_rules() if r.name == rule)
    unchecked = dataclasses.replace(checked, tensors={
        v: t for v, t in checked.tensors.items() if v != "S4"})
    misses = explain_model(m, FusionPass(rules=[unchecked]))
    assert any(x["reason"] == "shape_mismatch" for x in misses), misses


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_a_term_broadcast_over_the_batched_heads_is_not_viewed_to_them(family, tmp_path):
    """One layer's ALiBi term replaced by a constant [1, 1, S] that the Add broadcasts over
    every [B * H] item: it has no view to [B, H, 1, S] (`same_batch_dims_as` the scores), so that
    layer is not flash (sdpa takes it) and explain names the term; the other eleven are, and
    the fused model verifies."""
    from fusecli import load_rules
    from fusecli.engine.explain import explain_model

    m = onnx.load(DATA / f"{family}_flash_bmm_all.onnx")
    alibi = {n.output[0] for n in m.graph.node if n.op_type == "Reshape"
             and _rank(m, n.output[0]) == 3 and n.input[0] in {
                 o for k in m.graph.node if k.op_type == "Mul" for o in k.output}}
    add = next(n for n in m.graph.node if n.op_type == "Add" and set(n.input) & alibi)
    m.graph.initializer.append(numpy_helper.from_array(
        np.linspace(-1.0, 0.0, 8, dtype=np.float32).reshape(1, 1, 8), "row_term"))
    add.input[[i for i, t in enumerate(add.input) if t in alibi][0]] = "row_term"
    src = tmp_path / "changed.onnx"
    onnx.save(m, src)
    fused = onnx.load(src)
    assert _fuse(fused) == {"flash_attention": 11, "sdpa": 1}
    rules = [r for r in load_rules() if r.name.startswith(f"flash_{family}_bmm_alibi")]
    misses = explain_model(m, FusionPass(rules=rules))
    why = "does not have the rank and batch dims (all but the last two) of S3"
    assert any(why in x["detail"] for x in misses), misses
    out = tmp_path / "fused.onnx"
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report
