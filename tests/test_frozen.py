"""Fine-tuning graphs with frozen parameters (issue 21): real exports of both families
(tests/data/make_frozen.py) fuse every Linear+activation / norm chain whose backward is in the
graph and verify against the original; the fused LinearActivationGrad of a frozen weight
computes only what the graph asked for (one GEMM, no bias reduction), counted by the library's
work counters, not timed."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest

from fusecli import FusionPass
from fusecli.runtime import library
from fusecli.ops.linear_activation_grad.reference import linear_activation_grad
from fusecli.runtime.verify import check_fusions, verify_models

from kernel_helpers import (F32, _built, _rng, assert_close, assert_verifies,  # noqa: F401
                            rand, run_fused)

DATA = Path(__file__).parent / "data"

# counts from the model code in tests/data/make_frozen.py: the Linear+activation and norm chains
# whose backward is in the graph (frozen or not), per pattern
EXPECTED = {
    "frozen_mlp": {"linear_relu": 1, "linear_gelu": 1, "linear_silu": 1},
    "frozen_first": {"linear_gelu": 1},
    "frozen_norms": {"layernorm": 1, "rmsnorm": 1},
    # ln1 has no backward (its input and parameters need no gradient); the attention has no dK;
    # the flash rules take that attention whole (explicit, no dropout, no mask; dK absent)
    "frozen_block": {"flash_attention": 1, "layernorm": 1, "linear_gelu": 1},
    # the same block without dQ, without dV, with dQ only, with dK only: the flash rules
    # take each (any of their gradient branches may be absent)
    **{f"frozen_block_no_{c}": {"flash_attention": 1, "layernorm": 1, "linear_gelu": 1}
       for c in ("q", "v", "kv", "qv")},
    # ... with attention dropout, which the flash rules refuse: the sdpa rules take each
    **{f"frozen_block_dropout{c}": {"sdpa": 1, "layernorm": 1, "linear_gelu": 1}
       for c in ("", "_no_q", "_no_v", "_no_kv", "_no_qv")},
    # ... at batch 1, where torch's exporter folds the views that feed one MatMul (Q's and dS's
    # without dK; P's, O's and dO's too without dV) into broadcasting MatMuls
    **{f"frozen_block{c}_b1": {"flash_attention": 1, "layernorm": 1, "linear_gelu": 1}
       for c in ("", "_no_kv")},
    # ... and with attention dropout (the sdpa rules: dS's view folded without dK, P's and dP's
    # too without dV)
    **{f"frozen_block_dropout{c}_b1": {"sdpa": 1, "layernorm": 1, "linear_gelu": 1}
       for c in ("", "_no_kv")},
    # q_proj and k_proj frozen: dV = P^T dO is the attention's whole backward (no softmax
    # backward), which no rule takes (one GEMM either way)
    "frozen_block_no_qk": {"layernorm": 1, "linear_gelu": 1},
}
CASES = [(f"{p}_{n}", f"{p}_{n}" if f"{p}_{n}" in EXPECTED else n)
         for p in ("ortt", "torch") for n in EXPECTED if not n.startswith(("ortt_", "torch_"))]


def _fused_counts(m):
    fp = FusionPass()
    fp.run(m)
    counted = {p for want in EXPECTED.values() for p in want}   # the patterns the fixtures have
    return {p: s.fused for p, s in fp.stats.patterns.items() if s.fused and p in counted}, fp


@pytest.mark.parametrize("name,model", CASES, ids=[c[0] for c in CASES])
def test_frozen_exports_fuse_every_chain_and_verify(name, model, tmp_path):
    m = onnx.load(DATA / f"{name}.onnx")
    counts, fp = _fused_counts(m)
    assert counts == EXPECTED[model]
    assert not any(s.skipped for s in fp.stats.patterns.values())
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(DATA / f"{name}.onnx", out)
    assert report.ok and report.max_rel <= 1e-5, report


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_frozen_mlp_fused_ops_take_only_what_they_need(family):
    """fc2 (frozen W and b): dA only, no A input; fc3 (frozen W): dA and dB, no A; fc1 (first
    layer, frozen bias): dW only, no W; the first layer with a frozen weight: dB only."""
    m = onnx.load(DATA / f"{family}_frozen_mlp.onnx")
    FusionPass().run(m)
    lin = {dict((a.name, a.s.decode()) for a in n.attribute if a.name == "activation")
           ["activation"]: n for n in m.graph.node if n.op_type == "LinearActivationGrad"}
    present = {act: (_given(n.input, 2, 4), _given(n.output, 0, 3)) for act, n in lin.items()}
    #                 A      W        dA     dW     dB
    assert present == {"relu": ([True, False], [False, True, False]),
                       "gelu": ([False, True], [True, False, False]),
                       "silu": ([False, True], [True, False, True])}
    m = onnx.load(DATA / f"{family}_frozen_first.onnx")
    FusionPass().run(m)
    (n,) = [n for n in m.graph.node if n.op_type == "LinearActivationGrad"]
    assert _given(n.input, 2, 4) == [False, False]
    assert _given(n.output, 0, 3) == [False, False, True]


def _given(names, lo, hi):
    """Which of the ports lo..hi-1 a node names (trailing absent ones are left off)."""
    return [bool(t) for t in (list(names) + [""] * hi)[lo:hi]]


def _work(outs, inputs):
    library.reset_kernel_calls()
    got = run_fused("LinearActivationGrad", inputs, outs, activation="gelu")
    return [g for g in got if g is not None], {k: library.kernel_calls(k) for k in
                 ("LinearActivationGrad", "cpu/gemm_calls", "cpu/gemm_macs",
                  "LinearActivationGrad/db_rows")}


def test_frozen_weight_linear_activation_grad_is_one_gemm():
    """A frozen-weight LinearActivationGrad (no A, no dW, no dB) runs one GEMM of M*N*K
    multiply-adds and no bias reduction; the full-training op runs two GEMMs and sums M rows;
    the results equal the NumPy reference."""
    M, N, K = 12, 17, 9
    rng = _rng("frozen-work")
    dy, x, a, w = rand(rng, (M, N)), rand(rng, (M, N), scale=2.0), rand(rng, (M, K)), rand(
        rng, (N, K), scale=0.3)
    rda, rdw, rdb, _ = linear_activation_grad(dy, x, a, w, "gelu")

    (da,), work = _work([("dA", F32)], [("dY", dy), ("X", x), ("A", None), ("W", w)])
    assert_close(da, rda, what="dA (frozen W)")
    assert work == {"LinearActivationGrad": 1, "cpu/gemm_calls": 1, "cpu/gemm_macs": M * N * K,
                    "LinearActivationGrad/db_rows": 0}

    (da, db), work = _work([("dA", F32), None, ("dB", F32)],
                           [("dY", dy), ("X", x), ("A", None), ("W", w)])
    assert_close(da, rda, what="dA (frozen W, trainable b)")
    assert_close(db, rdb, what="dB (frozen W, trainable b)")
    assert work == {"LinearActivationGrad": 1, "cpu/gemm_calls": 1, "cpu/gemm_macs": M * N * K,
                    "LinearActivationGrad/db_rows": M}

    (db,), work = _work([None, None, ("dB", F32)], [("dY", dy), ("X", x), ("A", None),
                                                    ("W", None)])
    assert_close(db, rdb, what="dB (first layer, frozen W)")
    assert work["cpu/gemm_calls"] == 0 and work["LinearActivationGrad/db_rows"] == M

    (da, dw, db), work = _work([("dA", F32), ("dW", F32), ("dB", F32)],
                               [("dY", dy), ("X", x), ("A", a), ("W", w)])
    for g, r, nm in ((da, rda, "dA"), (dw, rdw, "dW"), (db, rdb, "dB")):
        assert_close(g, r, what=f"{nm} (full)")
    assert work == {"LinearActivationGrad": 1, "cpu/gemm_calls": 2,
                    "cpu/gemm_macs": 2 * M * N * K, "LinearActivationGrad/db_rows": M}


@pytest.mark.parametrize("trans_w", [0, 1])
@pytest.mark.parametrize("lead", [(6,), (2, 3)])
def test_linear_activation_grad_without_a_vs_reference(trans_w, lead):
    """Without A, dA takes dY's leading dims and W's input dim (K)."""
    N, K = 7, 5
    rng = _rng("frozen-noa", trans_w, lead)
    dy, x = rand(rng, (*lead, N)), rand(rng, (*lead, N), scale=2.0)
    w = rand(rng, (K, N) if trans_w else (N, K), scale=0.3)
    (da,) = run_fused("LinearActivationGrad", [("dY", dy), ("X", x), ("A", None), ("W", w)],
                      [("dA", F32)], activation="silu", trans_w=trans_w)
    rda = linear_activation_grad(dy, x, None, w, "silu", trans_w)[0]
    assert da.shape == (*lead, K)
    assert_close(da, rda, what="dA")


def test_batched_right_operand_is_no_frozen_weight():
    """The frozen-weight rules bind W without a weight gradient to prove it is one: a batched
    (3-D) right operand of the input-gradient MatMul is refused by the shape guard."""
    import builders
    from onnx import helper

    m = builders.ortt_linear_act_matmul("gelu", frozen_w=True, bias=False)
    g = m.graph
    for vi in g.input:
        if vi.name == "Wt":
            g.input.remove(vi)
            break
    g.input.append(helper.make_tensor_value_info("Wt", onnx.TensorProto.FLOAT, [2, 4, 5]))
    fp = FusionPass()
    assert fp.run(m) == 0
    assert fp.stats.patterns["linear_gelu"].skipped == {"shape_mismatch": 1}
    assert np.all([n.op_type != "LinearActivationGrad" for n in m.graph.node])


# --- guards of the frozen-weight variants whose only intermediate comes from an earlier stage's
# ActivationGrad (torch-joint, ort-training tanh-GELU) or a FastGeluGrad alternative of it:
# tests/test_rules.py's generic guard fixtures skip those nodes, so they are here
GUARD_FIXTURE_RULES = ("linear_gelu_tanh_ortt_gemm_frozen_w",
                       "linear_gelu_tanh_ortt_gemm_frozen_w_first",
                       "linear_gelu_tanh_ortt_matmul_frozen_w", "linear_gelu_tanh_torch_frozen_w",
                       "linear_gelu_torch_frozen_w", "linear_quick_gelu_torch_frozen_w",
                       "linear_relu_torch_frozen_w", "linear_silu_torch_frozen_w")


def _guard_fixture(rule_name):
    import builders
    from fusecli import load_rules

    by = {r.name: r for r in load_rules()}
    if "_ortt_" in rule_name:
        first = rule_name.endswith("_first")
        if "_matmul_" in rule_name:
            return builders.ortt_linear_act_matmul("gelu_fast", frozen_w=True), "dZ"
        return builders.ortt_linear_act("gelu_fast", frozen_w=True, first=first), "dZ"
    act = rule_name.removeprefix("linear_").removesuffix("_torch_frozen_w")
    if act == "quick_gelu":
        return builders.torch_linear_act(by["act_silu_scaled_grad_torch"], frozen_w=True,
                                         act_consts={"c": 1.702}), "dZ"
    return builders.torch_linear_act(by[f"act_{act}_grad_torch"], frozen_w=True), "dZ"


@pytest.mark.parametrize("rule", GUARD_FIXTURE_RULES)
@pytest.mark.parametrize("guard", ["intermediate_consumed_outside", "intermediate_is_graph_output"])
def test_frozen_weight_variant_guards(rule, guard):
    from onnx import helper

    from fusecli import load_rules

    m, dz = _guard_fixture(rule)
    fp = FusionPass()
    fp.run(onnx.ModelProto.FromString(m.SerializeToString()))
    assert [f.rule for f in fp.stats.fusions if f.rule.startswith("linear_")] == [rule]
    g = m.graph
    if guard == "intermediate_consumed_outside":
        g.node.append(helper.make_node("Neg", [dz], ["dz_outside"], name="outside"))
        g.output.append(helper.make_tensor_value_info("dz_outside", onnx.TensorProto.FLOAT, None))
    else:
        g.output.append(helper.make_tensor_value_info(dz, onnx.TensorProto.FLOAT, None))
    pattern = next(r.pattern for r in load_rules() if r.name == rule)
    fp = FusionPass()
    fp.run(onnx.ModelProto.FromString(m.SerializeToString()))
    assert not [f for f in fp.stats.fusions if f.rule.startswith("linear_")]
    assert fp.stats.patterns[pattern].skipped == {guard: 1}
    assert any(s.rule == rule and s.failure.reason == guard for s in fp.stats.skips)


# attention backward without some of dQ, dK, dV (tests/data/make_frozen.py: the projection of
# each absent gradient frozen, with ln1 and the input): the gradients the graph computes, from
# the model code, and the sdpa variant named after the absent ones
ATTENTION_SUBSETS = {  # fixture: ((dQ, dK, dV) computed, variant suffix)
    "frozen_block": ((True, False, True), "nok"),
    "frozen_block_no_q": ((False, True, True), "noq"),
    "frozen_block_no_v": ((True, True, False), "nov"),
    "frozen_block_no_kv": ((True, False, False), "nokv"),
    "frozen_block_no_qv": ((False, True, False), "noqv")}
SDPA_PLAIN = {"ortt": "sdpa_ortt_scores_plain", "torch": "sdpa_torch_plain"}
# with attention dropout (frozen_block_dropout*): ort-training's variants take an optional
# Dropout, torch-joint's dropout spelling has its own variants
SDPA_DROPOUT = {"ortt": "sdpa_ortt_scores_plain", "torch": "sdpa_torch_plain_dropout"}


@pytest.mark.parametrize("family", ["ortt", "torch"])
@pytest.mark.parametrize("dropout", [False, True], ids=["", "dropout"])
@pytest.mark.parametrize("name", list(ATTENTION_SUBSETS))
def test_attention_without_some_gradients_fuses_into_only_those(family, dropout, name,
                                                                tmp_path):
    """A frozen projection: the fused attention backward writes only the gradients the graph
    computes and reads dO, Q, K, V and P (Q or K^T bound through the forward score MatMul,
    kept, where its gradient GEMM is absent). The flash rules take such an attention first
    (FlashAttentionGrad without those outputs); AttentionGrad does where they refuse (here: the
    probabilities are a graph output too, or attention dropout), and the fused graph computes
    what the original does; the fused node's outputs equal the NumPy reference on the
    original's tensors."""
    import builders

    want, suffix = ATTENTION_SUBSETS[name]
    if dropout:
        name = name.replace("frozen_block", "frozen_block_dropout")
    m = onnx.load(DATA / f"{family}_{name}.onnx")
    flash = copy.deepcopy(m)
    FusionPass().run(flash)
    grads = [n for n in flash.graph.node if n.op_type == "FlashAttentionGrad"]
    if dropout:
        assert not grads
    else:
        assert [_given(n.output, 0, 3) for n in grads] == [list(want)]
        m = builders.with_probabilities_output(m)
    fused = copy.deepcopy(m)
    fp = FusionPass()
    fp.run(fused)
    assert [f.rule for f in fp.stats.fusions if f.pattern == "sdpa"] == [
        f"{(SDPA_DROPOUT if dropout else SDPA_PLAIN)[family]}_{suffix}"]
    assert not any(s.skipped for p, s in fp.stats.patterns.items() if p != "flash_attention")
    (n,) = [n for n in fused.graph.node if n.op_type == "AttentionGrad"]
    assert _given(n.output, 0, 3) == list(want)
    assert all(n.input[:5])
    src = assert_verifies(tmp_path, m, fused)
    # each fused node against its NumPy reference on the original's tensors
    checks = check_fusions(src, fp.stats.fusions, atol=1e-6)
    assert len(checks) == fp.stats.total_fused
    assert not [(c.rule, d.name) for c in checks for d in c.outputs if not d.ok]


@pytest.mark.parametrize("family", ["ortt", "torch"])
@pytest.mark.parametrize("name", ["frozen_block_dropout_b1", "frozen_block_dropout_no_kv_b1"])
def test_attention_with_dropout_at_batch_1_fuses_through_the_folded_views(family, name,
                                                                           tmp_path):
    """At batch 1 torch's exporter folds the batched views read by one MatMul: without dK,
    MatMul(dS4 [1, H, S, S], K [H, S, D]) -> dQ [1, H, S, D]. The sdpa rule binds the 4-D Q and
    dS (the op reads them as P's batch dims), writes dQ in its 4-D shape, and the fused node
    equals the NumPy reference on the original's tensors."""
    want, suffix = ATTENTION_SUBSETS[name.replace("_dropout", "").removesuffix("_b1")]
    m = onnx.load(DATA / f"{family}_{name}.onnx")
    fused = copy.deepcopy(m)
    fp = FusionPass()
    fp.run(fused)
    assert [f.rule for f in fp.stats.fusions if f.pattern == "sdpa"] == [
        f"{SDPA_DROPOUT[family]}_{suffix}"]
    (n,) = [n for n in fused.graph.node if n.op_type == "AttentionGrad"]
    assert _given(n.output, 0, 3) == list(want)
    src = assert_verifies(tmp_path, m, fused)
    checks = check_fusions(src, fp.stats.fusions, atol=1e-6)
    assert len(checks) == fp.stats.total_fused
    assert not [(c.rule, d.name) for c in checks for d in c.outputs if not d.ok]


@pytest.mark.parametrize("family", ["ortt", "torch"])
@pytest.mark.parametrize("name,suffix,skip", [
    ("frozen_block_no_v", "nokv", "intermediate_consumed_outside"),
    ("frozen_block_no_v", "noqv", "intermediate_consumed_outside"),
    ("frozen_block", "nokv", None), ("frozen_block_no_q", "noqv", None)])
@pytest.mark.parametrize("dropout", [False, True], ids=["", "dropout"])
def test_a_variant_never_drops_a_gradient_the_graph_computes(family, name, suffix, skip,
                                                            dropout, tmp_path):
    """A variant without dQ or dK, alone on a graph that computes that gradient: the absent
    branch's GEMM reads dS, which the fused op does not write, so the match is refused. A
    variant without dV on a graph with dV fuses the rest and leaves the dV GEMM (it reads only
    P and dO) as it is; the graph computes the same. The two-gradient variants come first
    (test above), so this never happens under the full rule set."""
    import builders

    if dropout:
        m = onnx.load(DATA / f"{family}_{name.replace('frozen_block', 'frozen_block_dropout')}.onnx")
    else:
        m = builders.with_probabilities_output(onnx.load(DATA / f"{family}_{name}.onnx"))
    fused = copy.deepcopy(m)
    rule = f"{(SDPA_DROPOUT if dropout else SDPA_PLAIN)[family]}_{suffix}"
    fp = FusionPass(only={rule})
    fp.run(fused)
    if skip:
        assert not fp.stats.fusions
        assert fp.stats.patterns["sdpa"].skipped == {skip: 1}
        return
    assert [f.rule for f in fp.stats.fusions] == [rule]
    assert_verifies(tmp_path, m, fused)


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_attention_with_only_dv_is_left_as_it_is(family):
    """q_proj and k_proj frozen: no softmax backward, dV = P^T dO alone. Neither the flash nor
    the sdpa rules take it (an AttentionGrad would do the same GEMM and keep the forward's Q
    and K^T alive until the backward), with or without the probabilities as an output."""
    import builders

    m = onnx.load(DATA / f"{family}_frozen_block_no_qk.onnx")
    for model in (m, builders.with_probabilities_output(m)):
        fp = FusionPass()
        fp.run(model)
        assert not [f for f in fp.stats.fusions if f.pattern in ("sdpa", "flash_attention")]
        assert not any(n.op_type in ("AttentionGrad", "FlashAttentionGrad")
                       for n in model.graph.node)


@pytest.mark.parametrize("want", [w for w in itertools.product([False, True], repeat=3)
                                  if any(w)])
def test_attention_grad_skips_the_gemms_of_absent_gradients(want):
    """AttentionGrad asked for some of dQ, dK, dV runs only their GEMMs: dV = P^T dO
    (b * Sk * Dv * Sq multiply-adds), and for dQ or dK the dP = dO V^T GEMM (b * Sq * Sk * Dv)
    with dQ = dS K (b * Sq * Sk * D), dK = dS^T Q (b * Sk * D * Sq); the outputs equal the
    NumPy reference."""
    from fusecli.ops.attention_grad.reference import attention_grad
    from fusecli.ops.attention_grad.test_attention_grad import _attn_inputs

    b, sq, sk, d, dv = 3, 7, 6, 5, 4
    ins = _attn_inputs(_rng("frozen-attn"), (b,), sq, sk, d, dv, 1)
    ref = attention_grad(*ins, 0.5, 0.5, 1)
    feeds = list(zip(["dO", "Q", "K", "V", "P"], ins))
    outs = [(nm, F32) if w else None for nm, w in zip(("dQ", "dK", "dV"), want)]
    library.reset_kernel_calls()
    got = run_fused("AttentionGrad", feeds, outs, scale_q=0.5, scale_k=0.5, k_transposed=1)
    assert library.kernel_calls("AttentionGrad") == 1
    for g, r, o in zip(got, ref, outs):
        if o:
            assert_close(g, r, what=o[0])
    want_q, want_k, want_v = want
    assert library.kernel_calls("cpu/gemm_macs") == b * (
        sq * sk * dv * want_v + sq * sk * dv * (want_q or want_k) + sq * sk * d * want_q
        + sk * d * sq * want_k)


@pytest.mark.parametrize("act", ["relu", "quick_gelu"])
@pytest.mark.parametrize("build,kw,rule", [
    ("ortt_linear_act", {}, "gemm_frozen_w"),
    ("ortt_linear_act", {"first": True}, "gemm_frozen_w_first"),
    ("ortt_linear_act_matmul", {}, "matmul_frozen_w"),
    ("ortt_linear_act_gemm2d", {}, "matmul_2d_frozen_w"),
    ("ortt_linear_act_gemm2d", {"first": True}, "matmul_2d_frozen_w_first")])
def test_ortt_frozen_weight_variants_compute_the_same(act, build, kw, rule, tmp_path):
    """Every ort-training frozen-weight variant: the fused graph runs in onnxruntime-training
    with the original's results (the 2-D view: dA written [rows, K], flat_da)."""
    import builders

    m = getattr(builders, build)(act, frozen_w=True, **kw)
    fused = onnx.ModelProto.FromString(m.SerializeToString())
    fp = FusionPass()
    assert fp.run(fused) == 1
    assert [f.rule for f in fp.stats.fusions] == [f"linear_{act}_ortt_{rule}"]
    assert_verifies(tmp_path, m, fused)


# --- explain names the missing gradient ---------------------------------------------------------
# a full-training rule explained on a fine-tuning graph (the frozen-weight / no-dK variants fuse
# these chains; the full rule's near miss says which gradient the graph does not compute)
@pytest.mark.parametrize("name,rule,node,branch", [
    ("ortt_frozen_mlp", "linear_gelu_ortt_gemm", "wgrad", "weight gradient (dW)"),
    ("torch_frozen_mlp", "linear_gelu_torch", "tz", "weight gradient (dW)"),
    ("ortt_frozen_first", "linear_gelu_ortt_gemm_frozen_w", "dgrad", "input gradient (dA)"),
    ("ortt_frozen_block", "sdpa_ortt_scores_plain", "dk", "key gradient (dK)"),
    ("torch_frozen_block", "sdpa_torch_plain", "dk", "key gradient (dK)"),
    ("ortt_frozen_block_no_q", "sdpa_ortt_scores_plain", "dq", "query gradient (dQ)"),
    ("torch_frozen_block_no_q", "sdpa_torch_plain", "dq", "query gradient (dQ)"),
    ("ortt_frozen_block_no_v", "sdpa_ortt_scores_plain", "dv", "value gradient (dV)"),
    ("torch_frozen_block_no_v", "sdpa_torch_plain", "dv", "value gradient (dV)"),
    # a two-gradient variant explained on a one-gradient graph names the other missing one
    ("ortt_frozen_block_no_kv", "sdpa_ortt_scores_plain_nok", "dv", "value gradient (dV)"),
    ("torch_frozen_block_no_qv", "sdpa_torch_plain_noq", "dv", "value gradient (dV)")])
def test_explain_names_the_missing_gradient(name, rule, node, branch):
    import builders
    from fusecli.engine.explain import explain_model

    fp = FusionPass(only={rule})  # (the earlier stages apply first, as in `fusecli explain`)
    model = onnx.load(DATA / f"{name}.onnx")
    if "_frozen_block" in name:  # where the flash rules (an earlier stage) do not take it
        model = builders.with_probabilities_output(model)
    misses = [m for m in explain_model(model, fp) if m["rule"] == rule]
    assert misses
    assert misses[0]["node"] == node
    assert misses[0]["detail"].startswith(f"no {branch} branch: ")


# --- a rule variable bound to a constant binds by value -------------------------------------------
@pytest.mark.parametrize("spelling", ["initializer", "constant_node"])
def test_same_constant_in_two_tensors_is_one_variable(spelling):
    """QuickGELU x * sigmoid(c x) whose forward and backward Mul read c from two tensors of the
    same value (a raw export: one Constant node per use) fuses as if they shared one, and the
    fused graph computes what the original computes; another value stays unfused (the
    `bwd_other_value` case of tests/test_rules.py::test_torch_quick_gelu_scale_guards)."""
    import builders
    from onnx import helper, numpy_helper

    from fusecli import load_rules

    by = {r.name: r for r in load_rules()}
    m = builders.torch_linear_act(by["act_silu_scaled_grad_torch"], act_consts={"c": 1.702})
    (bwd,) = [n for n in m.graph.node if n.name == "act.bwd_scale"]
    c2 = np.asarray(1.702, np.float32)
    if spelling == "initializer":
        m.graph.initializer.append(numpy_helper.from_array(c2, "c_again"))
    else:
        m.graph.node.insert(0, helper.make_node("Constant", [], ["c_again"],
                                                value=numpy_helper.from_array(c2)))
    bwd.input[list(bwd.input).index(next(i for i in bwd.input if i.endswith("c")))] = "c_again"
    fused = onnx.ModelProto.FromString(m.SerializeToString())
    fp = FusionPass()
    assert fp.run(fused) == 1
    assert fp.stats.patterns["linear_gelu"].fused == 1
    import onnxruntime as ort

    from fusecli.runtime.library import session_options

    so = session_options(opt_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
             .astype(np.float32) for i in m.graph.input}
    want = ort.InferenceSession(m.SerializeToString(), so).run(None, feeds)
    got = ort.InferenceSession(fused.SerializeToString(), so).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
