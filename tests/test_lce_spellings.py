"""The loss spellings of a language-model / classifier head + cross-entropy that real exports use
(issue 36; rules/lce_torch_loss.yaml, rules/lce_torch_rows.yaml, rules/lce_ortt_gemm.yaml): the
real exports of scripts/make_lce_spellings.py fuse where the model code says (one head + loss
each, or none where the loss is no LinearCrossEntropy), verify against their originals on onnxruntime, and the fused
graph's loss and head gradient match a NumPy computation of the model; one negative per new guard
(a ReduceMean over one axis, a per-row gradient that is not one number, a coefficient not zeroed
on ignored tokens, an ignore_index other than the compared one, a scaled Gemm; the per-token
losses: an ignore_index other than the compared one, a scatter value without its Neg), each
named by `explain`."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusecli import FusionPass
from fusecli.engine.explain import explain_model
from fusecli.runtime.library import library_path
from fusecli.runtime.verify import verify_models

DATA = Path(__file__).parent / "data"
# from the model code (scripts/make_lce_spellings.py): the rule that takes the one head + loss;
# the losses the graph reduces itself (F.cross_entropy(reduction='none').mean(), the mean over
# every token, ignored ones included; per-sequence masked means, then their mean; the logits
# sliced before the loss, then Hugging Face's masked mean) are the op's per-token losses
# (reduction none; the slice: the op's seq_start / seq_end on the hidden states): one op where
# the per-token coefficient, computed from the reduction's tangent and the mask, moves before the
# forward's readers of the losses (rules/lce_torch_rows.yaml, rules/lce_torch_shift.yaml's
# gather); two (_split) where the coefficient reads the losses themselves (tests/test_rules.py's
# run-time seed samples)
EXPECTED = {
    "torch_lces_reducemean": "lce_torch_reducemean",
    "torch_lces_reducemean_neg_tied": "lce_torch_reducemean_neg",
    "torch_lces_reducesum_const": "lce_torch_reducesum",
    # (g computed in the backward, after the Div by 2 reads the loss, from the constant tangent
    # and the mask alone: moved before that Div, one op)
    "torch_lces_masked_sum_const": "lce_torch_sum",
    "torch_lces_ce_sum": "lce_torch_nllloss",
    "torch_lces_ce_mean": "lce_torch_nllloss",
    # (w the same, after the Div by num_items_in_batch reads the loss)
    "torch_lces_hf_llama_items": "lce_torch_nllloss",
    "torch_lces_hf_gpt2_mean_tied": "lce_torch_reducemean_neg",
    "torch_lces_ce_none_mean": "lce_torch_rows_nllloss_none",
    "torch_lces_shift_logits": "lce_torch_shift_gather",
    "torch_lces_shift_ce": "lce_torch_shift_nllloss",
    "torch_lces_shift_ce_sum_tied": "lce_torch_shift_nllloss",
    "torch_lces_seqlevel": "lce_torch_rows_gather",
    "ortt_lces_cls_mlp": "lce_ortt_gemm",
    "ortt_lces_cls_cnn": "lce_ortt_gemm",
    "ortt_lces_cls_mlp_ii": "lce_ortt_gemm_ii",
    "ortt_lces_cls_matmul": "lce_ortt",
    "ortt_lces_lm_shift_ce": "lce_ortt_shift",
    "ortt_lces_lm_shift_ce_tied": "lce_ortt_shift",
    "ortt_lces_lm_shift_ce_frozen_head": "lce_ortt_shift_frozen",
    # Hugging Face's own loss (ForCausalLMLoss: labels padded and shifted, logits whole)
    "ortt_lces_hf_llama_loss": "lce_ortt_ii",
    "ortt_lces_hf_gpt2_loss_tied": "lce_ortt_ii",
    # the logits times a constant before the loss (scripts/corpus/archs.py granite_lm, cohere_lm:
    # GraniteForCausalLM's logits / logits_scaling, CohereForCausalLM's logits * logit_scale,
    # exported by scripts/corpus/gen.py with the corpus' ce_lm loss): the op's logit_scale; or
    # soft-capped (gemma2_lm: Gemma2ForCausalLM's final_logit_softcapping): its logit_softcap
    "ortt_lces_granite_lm": "lce_ortt_ii_scaled",
    "torch_lces_granite_lm": "lce_torch_mean_scaled",
    "torch_lces_cohere_lm": "lce_torch_mean_scaled",
    "ortt_lces_gemma2_lm": "lce_ortt_ii_softcap",
    "torch_lces_gemma2_lm": "lce_torch_mean_softcap",
    # the same transforms in the shifted-logits, per-token-loss and classifier spellings (the
    # tiny models of scripts/make_lce_spellings.py with their logits / 4, * 0.5 or 3 tanh(z / 3)
    # between the head and the loss: TRANSFORMED, ORTT_LM, ORTT)
    "torch_lces_shift_logits_div": "lce_torch_shift_gather_scaled",
    "torch_lces_shift_logits_softcap": "lce_torch_shift_gather_softcap",
    "torch_lces_shift_ce_sum_tied_mul": "lce_torch_shift_nllloss_scaled",
    "torch_lces_shift_ce_sum_tied_softcap": "lce_torch_shift_nllloss_softcap",
    "torch_lces_ce_none_mean_mul": "lce_torch_rows_nllloss_none_scaled",
    "torch_lces_ce_none_mean_softcap": "lce_torch_rows_nllloss_none_softcap",
    "torch_lces_seqlevel_div": "lce_torch_rows_gather_scaled",
    "torch_lces_seqlevel_softcap": "lce_torch_rows_gather_softcap",
    "ortt_lces_lm_shift_ce_div": "lce_ortt_shift_scaled",
    "ortt_lces_lm_shift_ce_tied_softcap": "lce_ortt_shift_softcap",
    "ortt_lces_lm_shift_ce_frozen_head_div": "lce_ortt_shift_frozen_scaled",
    "ortt_lces_lm_shift_ce_frozen_head_softcap": "lce_ortt_shift_frozen_softcap",
    "ortt_lces_cls_mlp_div": "lce_ortt_gemm_scaled",
    "ortt_lces_cls_mlp_ii_div": "lce_ortt_gemm_ii_scaled",
    "ortt_lces_cls_mlp_softcap": "lce_ortt_gemm_softcap",
    "ortt_lces_cls_mlp_ii_softcap": "lce_ortt_gemm_ii_softcap",
    # label smoothing 0.1 (make_lce_spellings.py _smoothed_masked, _smoothed_ce): the
    # log-probabilities' row mean (written out) or row sum (F.cross_entropy's) is the op's
    # lp_row; one op (its coefficients, computed in the backward from the count and the mask
    # alone, are moved before the forward's readers of the loss)
    "torch_lces_smoothed_masked_mean": "lce_torch_mean_smoothed",
    "torch_lces_smoothed_masked_mean_tied": "lce_torch_mean_smoothed",
    "torch_lces_smoothed_masked_sum": "lce_torch_sum_smoothed",
    "torch_lces_smoothed_ce_sum": "lce_torch_nllloss_smoothed",
    "torch_lces_smoothed_ce_mean": "lce_torch_nllloss_smoothed",
    "torch_lces_smoothed_masked_mean_softcap": "lce_torch_mean_softcap_smoothed",
    "torch_lces_shift_ce_smoothed": "lce_torch_shift_nllloss_smoothed",
    "torch_lces_shift_ce_sum_tied_smoothed": "lce_torch_shift_nllloss_smoothed",
    # a frozen bias added to the logits (make_lce_spellings.py FBIASED: BART's, mBART's,
    # Marian's and Pegasus's final_logits_bias buffer): the op's bias input, no dB
    "torch_lces_fbias_reducemean": "lce_torch_reducemean_fbias",
    "torch_lces_fbias_ce_sum": "lce_torch_nllloss_fbias",
    "torch_lces_fbias_ce_mean": "lce_torch_nllloss_fbias",
    "torch_lces_fbias_smoothed_masked_mean": "lce_torch_mean_fbias_smoothed",
    # (ort-training: the head's MatMul + Add of the bias, as a bias whose gradient is not taken)
    "ortt_lces_lm_shift_ce_fbias": "lce_ortt_shift",
    # sequence classifiers pooling each sequence's last non-pad token after the score Linear
    # (make_lce_spellings.py hf_*_seqcls: Llama's own loss, F.cross_entropy; GPT-2's pooled
    # logits with the written-out masked mean): the op's seq_index (rules/_lce_pool_torch.yaml)
    "torch_lces_hf_llama_seqcls": "lce_torch_nllloss_pooled",
    "torch_lces_hf_gpt2_seqcls_masked": "lce_torch_mean_pooled",
    # the head frozen (make_lce_spellings.py FROZEN, FROZEN_HEAD, LORA: LoRA fine-tuning, frozen
    # embeddings under a tied head): torch exports its product on the 3-D hidden states, then
    # flattened, and dH viewed back; no dW (the op writes dH only)
    "torch_lces_reducemean_frozen_head": "lce_torch_reducemean_frozen_3d",
    "torch_lces_reducesum_const_frozen_head": "lce_torch_reducesum_frozen_3d",
    "torch_lces_masked_sum_const_frozen_head": "lce_torch_sum_frozen_3d",
    "torch_lces_ce_sum_frozen_head": "lce_torch_nllloss_frozen_3d",
    "torch_lces_ce_none_mean_frozen_head": "lce_torch_rows_nllloss_none_frozen_3d",
    "torch_lces_shift_logits_frozen_head": "lce_torch_shift_gather_frozen_3d",
    "torch_lces_shift_ce_frozen_head": "lce_torch_shift_nllloss_frozen_3d",
    "torch_lces_seqlevel_frozen_head": "lce_torch_rows_gather_frozen_3d",
    "torch_lces_smoothed_ce_sum_frozen_head": "lce_torch_nllloss_smoothed_frozen_3d",
    "torch_lces_smoothed_masked_mean_frozen_head": "lce_torch_mean_frozen_3d_smoothed",
    "torch_lces_hf_llama_items_frozen_head": "lce_torch_nllloss_frozen_3d",
    "torch_lces_hf_gpt2_mean_tied_frozen_head": "lce_torch_reducemean_neg_frozen_3d",
    "torch_lces_hf_llama_items_lora": "lce_torch_nllloss_frozen_3d",
    "torch_lces_shift_logits_frozen_head_div": "lce_torch_shift_gather_frozen_3d_scaled",
    "torch_lces_shift_logits_frozen_head_softcap": "lce_torch_shift_gather_frozen_3d_softcap",
    "torch_lces_shift_ce_frozen_head_mul": "lce_torch_shift_nllloss_frozen_3d_scaled",
    "torch_lces_shift_ce_frozen_head_softcap": "lce_torch_shift_nllloss_frozen_3d_softcap",
}
# the frozen heads: the op writes no dW
FROZEN = {n for n, rule in EXPECTED.items() if rule and "_frozen" in rule}
# the pooled ones: the op reads one row per sequence at the positions the graph computes
POOLED = {n for n, rule in EXPECTED.items() if rule and "_pooled" in rule}
# the op's lp_row_reduce there: the rows' mean (the written-out loss's lp.mean(-1)) or their
# sum (F.cross_entropy's)
SMOOTHED = {n: "sum" if "_ce_" in n else "mean" for n in EXPECTED if "smoothed" in n}
# the logits' transform of those (the model code: logits_scaling 4, logit_scale 0.5,
# final_logit_softcapping 30 by Gemma2Config's default)
LOGIT_TRANSFORM = {"ortt_lces_granite_lm": {"logit_scale": 0.25},
                   "torch_lces_granite_lm": {"logit_scale": 0.25},
                   "torch_lces_cohere_lm": {"logit_scale": 0.5},
                   "ortt_lces_gemma2_lm": {"logit_softcap": 30.0},
                   "torch_lces_gemma2_lm": {"logit_softcap": 30.0},
                   **{n: {"logit_scale": {"div": 0.25, "mul": 0.5}[n.rsplit("_", 1)[1]]}
                      for n in EXPECTED if n.endswith(("_div", "_mul"))},
                   **{n: {"logit_softcap": 3.0} for n in EXPECTED
                      if n.endswith("_softcap") and "gemma2" not in n}}


def _lce(fp):
    return [r.rule for r in fp.stats.fusions if r.pattern == "linear_cross_entropy"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_spelling_fuses_as_the_model_says_and_verifies(name, tmp_path):
    m = onnx.load(DATA / f"{name}.onnx")
    fp = FusionPass()
    fp.run(m)
    rule = EXPECTED[name]
    assert _lce(fp) == ([rule] if rule else [])
    ops = [n.op_type for n in m.graph.node]
    if rule:
        # one op, or two (the loss, then the gradients) for _split; no [N, V] tensor left
        assert ops.count("LinearCrossEntropy") == (2 if rule.endswith("_split") else 1)
        assert not set(ops) & {"LogSoftmax", "ScatterElements", "NegativeLogLikelihoodLoss",
                               "SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad"}
        for lce in (n for n in m.graph.node if n.op_type == "LinearCrossEntropy"):  # both of _split
            attrs = {a.name: helper.get_attribute_value(a) for a in lce.attribute}
            for attr, default in (("logit_scale", 1.0), ("logit_softcap", 0.0)):
                want = LOGIT_TRANSFORM.get(name, {}).get(attr, default)
                assert attrs.get(attr, default) == pytest.approx(want), (attr, attrs)
            # label smoothing: the op writes the rows' reduction over the classes and reads its
            # gradient (lp_row, lp_row_grad)
            smoothed = name in SMOOTHED
            assert (len(lce.output) == 5 and lce.output[4] != "") == smoothed
            assert (len(lce.input) >= 10 and lce.input[9] != "") == smoothed
            assert (len(lce.input) == 11 and lce.input[10] != "") == (name in POOLED)
            assert attrs.get("lp_row_reduce", b"sum").decode() == SMOOTHED.get(name, "sum")
            assert (len(lce.output) > 2 and lce.output[2] != "") == (name not in FROZEN)
    else:
        assert "LinearCrossEntropy" not in ops and "LogSoftmax" in ops
    # the node list stays topologically sorted (the coefficients a one-op head reads before
    # the forward's readers of its loss were moved there: rules.md's placement guard)
    defined = {i.name for i in m.graph.input} | {t.name for t in m.graph.initializer} | {""}
    for n in m.graph.node:
        assert set(n.input) <= defined, (n.name, set(n.input) - defined)
        defined.update(n.output)
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(DATA / f"{name}.onnx", out)
    assert report.ok and report.max_rel <= 1e-5, report


# --- the fused graph against NumPy: the tiny decoder of make_lce_spellings.py --------------------

V, D, B, S = 50, 16, 2, 7


def _random_feeds(m, seed):
    """Seeded feeds for the tiny decoder: token ids and labels in [0, V), weights N(0, 0.25)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in m.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.name in ("input_ids", "labels"):
            feeds[i.name] = rng.integers(0, V, shape).astype(np.int64)
        else:
            feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    return feeds


def _numpy_loss_and_grads(params, ids, lab, spelling):
    """loss and d loss / d head weight of Net (Embedding -> Linear + ReLU -> head) in float64,
    written from the model code; `tied`: the head weight is the embedding's (its dW here is only
    the head's part)."""
    emb = params["emb.weight"].astype(np.float64)
    x = emb[ids].reshape(-1, D)
    h = np.maximum(x @ params["fc.weight"].T.astype(np.float64) + params["fc.bias"], 0.0)
    w = emb if spelling.endswith("_tied") else params["head.weight"].astype(np.float64)
    z = h @ w.T
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    y = lab.reshape(-1)
    nll = lse - z[np.arange(len(y)), y]
    n = len(y)
    loss, c = {"reducemean": (nll.mean(), 1.0 / n),
               "reducemean_neg_tied": (nll.mean(), 1.0 / n),
               "reducesum_const": (nll.sum() / 2.0, 0.5)}[spelling]
    p = np.exp(z - lse[:, None])
    p[np.arange(n), y] -= 1.0
    dw = (c * p).T @ h
    if spelling.endswith("_tied"):  # the table's whole gradient: the head's + the embedding's
        pre = x @ params["fc.weight"].T.astype(np.float64) + params["fc.bias"]
        dx = (((c * p) @ w) * (pre > 0)) @ params["fc.weight"].astype(np.float64)
        np.add.at(dw, ids.reshape(-1), dx)
    return loss, dw


@pytest.mark.parametrize("spelling", ["reducemean", "reducemean_neg_tied", "reducesum_const"])
def test_fused_head_matches_numpy(spelling, tmp_path):
    import onnxruntime as ort

    m = onnx.load(DATA / f"torch_lces_{spelling}.onnx")
    fp = FusionPass()
    fp.run(m)
    assert _lce(fp) == [EXPECTED[f"torch_lces_{spelling}"]]
    feeds = _random_feeds(m, 3)
    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in m.graph.output]
    res = dict(zip(names, sess.run(None, feeds)))
    loss, dw = _numpy_loss_and_grads(feeds, feeds["input_ids"], feeds["labels"], spelling)
    np.testing.assert_allclose(res["loss"], loss, rtol=1e-5)
    # the head's gradient: head.weight_grad, or (tied) the table's whole gradient: the
    # embedding's rows scattered into the dW the fused op writes (fusecli/engine/tied.py; the
    # graph's ScatterND into zeros and its Add are gone)
    fused = next(n for n in m.graph.node if n.op_type == "LinearCrossEntropy")
    if spelling.endswith("_tied"):
        (scat,) = [n for n in m.graph.node if fused.output[2] in n.input]
        assert scat.op_type == "ScatterND" and scat.output[0] == "emb.weight_grad"
        assert "Add" not in [n.op_type for n in m.graph.node]
        got = res["emb.weight_grad"]
    else:
        assert fused.output[2] == "head.weight_grad"
        got = res["head.weight_grad"]
    np.testing.assert_allclose(got, dw, rtol=1e-4, atol=1e-6)


def _fused_and_verified(name, tmp_path, seed, ignored):
    """The export `name` fused by its rule (EXPECTED) and verified against its original on
    seeded feeds whose labels at each index of `ignored` are -100: (fused model, feeds)."""
    m = onnx.load(DATA / f"{name}.onnx")
    orig = tmp_path / "orig.onnx"
    onnx.save(m, orig)
    fp = FusionPass()
    fp.run(m)
    assert _lce(fp) == [EXPECTED[name]]
    onnx.save(m, tmp_path / "fused.onnx")
    feeds = _random_feeds(m, seed)
    for at in ignored:
        feeds["labels"][at] = -100
    np.savez(tmp_path / "feeds.npz", **feeds)
    report = verify_models(orig, tmp_path / "fused.onnx", feeds_file=tmp_path / "feeds.npz")
    assert report.ok and report.max_rel <= 1e-5, report
    return m, feeds


def _run(m, feeds) -> dict:
    """The fused model's outputs by name (onnxruntime with fusecli's library)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in m.graph.output], sess.run(None, feeds)))


# the losses the graph reduces itself, and on logits transformed before the loss
ROWS = ["ce_none_mean", "seqlevel", "shift_logits", "ce_none_mean_mul", "ce_none_mean_softcap",
        "seqlevel_div", "seqlevel_softcap", "shift_logits_div", "shift_logits_softcap"]
# the model code's logit transforms (make_lce_spellings.TRANSFORMS): f and f' in float64
TRANSFORM = {"": (lambda z: z, lambda z: np.ones_like(z)),
             "div": (lambda z: z / 4.0, lambda z: np.full_like(z, 0.25)),
             "mul": (lambda z: z * 0.5, lambda z: np.full_like(z, 0.5)),
             "softcap": (lambda z: 3.0 * np.tanh(z / 3.0), lambda z: 1.0 - np.tanh(z / 3.0) ** 2)}


def _hidden(params, ids):
    """The tiny decoder's hidden states before its head (make_lce_spellings.py Net), float64:
    relu(fc(emb(ids))), [B * S, D]."""
    x = params["emb.weight"].astype(np.float64)[ids].reshape(-1, D)
    return np.maximum(x @ params["fc.weight"].T.astype(np.float64) + params["fc.bias"], 0.0)


def _token_ce(z, y, eps):
    """Per token of the logits z [N, V] against the labels y [N] (-100: ignored), float64:
    F.cross_entropy's loss with label smoothing eps, (1 - eps) nll + eps (lse - the logits'
    mean), its gradient in z, softmax - (1 - eps) onehot - eps / V, and the kept tokens (1 / 0)."""
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    keep = (y != -100).astype(np.float64)
    safe = np.where(y == -100, 0, y)
    per = (1 - eps) * (lse - z[np.arange(len(y)), safe]) + eps * (lse - z.mean(1))
    p = np.exp(z - lse[:, None]) - eps / z.shape[1]
    p[np.arange(len(y)), safe] -= 1.0 - eps
    return per, p, keep


def _numpy_rows(params, ids, lab, spelling):
    """loss, the logits' gradient dZ and the hidden states h it multiplies (d loss / d head
    weight = dZ^T h) of the model code's per-token reductions (float64):
    ce_none_mean sums the kept tokens' losses over all N tokens; seqlevel averages each
    sequence's kept tokens, then the B sequences; shift_logits: the logits of tokens 0..S-2
    against the labels of 1..S-1, the kept ones' mean; shift_ce: the same rows, F.cross_entropy's
    mean with the exported graph's coefficient (1 per kept token: torch 2.13's wrong gradient of
    the mean); shift_ce_sum_tied: their sum (coefficient 1), the head tied to the embedding.
    A suffix _div, _mul or _softcap: the logits transformed before the loss (TRANSFORM);
    _smoothed: F.cross_entropy's label smoothing 0.1 (each token's (1 - eps) nll + eps (lse -
    the logits' mean), its logits' gradient softmax - (1 - eps) onehot - eps / V)."""
    how = next((t for t in ("div", "mul", "softcap") if spelling.endswith("_" + t)), "")
    spelling = spelling.removesuffix("_" + how) if how else spelling
    eps = 0.1 if spelling.endswith("_smoothed") else 0.0
    spelling = spelling.removesuffix("_smoothed")
    f, df = TRANSFORM[how]
    h = _hidden(params, ids)
    if spelling.startswith("shift"):
        h = h.reshape(B, S, D)[:, :-1].reshape(-1, D)
        lab = lab[:, 1:]
    w = params["emb.weight" if spelling.endswith("_tied") else "head.weight"].astype(np.float64)
    y = lab.reshape(-1)
    per, p, keep = _token_ce(f(h @ w.T), y, eps)
    nll = per * keep
    if spelling == "ce_none_mean":
        loss, c = nll.sum() / len(y), keep / len(y)
    elif spelling == "shift_logits":
        loss, c = nll.sum() / keep.sum(), keep / keep.sum()
    elif spelling == "shift_ce":
        loss, c = nll.sum() / keep.sum(), keep
    elif spelling == "shift_ce_sum_tied":
        loss, c = nll.sum(), keep
    else:
        cnt = keep.reshape(lab.shape).sum(1)
        loss = (nll.reshape(lab.shape).sum(1) / cnt).mean()
        c = (keep.reshape(lab.shape) / (lab.shape[0] * cnt[:, None])).reshape(-1)
    return loss, c[:, None] * p * df(h @ w.T), h


@pytest.mark.parametrize("spelling", ROWS)
def test_graph_reduced_losses_match_numpy(spelling, tmp_path):
    """The losses the graph reduces itself: the op writes the per-token losses (reduction
    none) and the gradients with the graph's per-token coefficient (row_grad): one op where
    that coefficient's nodes move before the forward's reduction (else, _split, one op the
    losses, the other the gradients). Verified against the original on onnxruntime and
    against NumPy on labels with ignored tokens."""
    name = f"torch_lces_{spelling}"
    m, feeds = _fused_and_verified(name, tmp_path, 5, [(0, slice(0, 3)), (1, 5)])
    fused = [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"]
    assert all([a.s for a in n.attribute if a.name == "reduction"] == [b"none"] for n in fused)
    if EXPECTED[name].endswith("_split"):
        # the loss op writes the per-token losses the graph's own reduction reads; the other,
        # the gradients from the graph's coefficient (row_grad)
        assert len(fused) == 2
        assert len(fused[0].input) == 4 and fused[0].output[0] and len(fused[0].output) == 1
        assert len(fused[1].input) == 6 and fused[1].output[0] == ""
    else:
        (op,) = fused
        assert len(op.input) == 6 and op.output[0] and op.output[1] and op.output[2]
    assert "LogSoftmax" not in [n.op_type for n in m.graph.node]
    res = _run(m, feeds)
    loss, dz, h = _numpy_rows(feeds, feeds["input_ids"], feeds["labels"], spelling)
    np.testing.assert_allclose(res["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(res["head.weight_grad"], dz.T @ h, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("spelling", ["ce_none_mean", "seqlevel", "shift_logits", "shift_ce"])
def test_frozen_head_matches_numpy(spelling, tmp_path):
    """The head frozen (LoRA fine-tuning): the op writes the loss and dH only (no dW), and the
    layer below trains on that dH: its weight gradient against NumPy's backpropagation through
    the frozen head, the ReLU and fc (the shifted spellings: dH 0 in each sequence's last row,
    which the slice drops)."""
    name = f"torch_lces_{spelling}_frozen_head"
    m, feeds = _fused_and_verified(name, tmp_path, 5, [(0, slice(0, 3)), (1, 5)])
    (op,) = [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"]
    assert op.output[1] and (len(op.output) < 3 or op.output[2] == "")
    assert "head.weight_grad" not in [o.name for o in m.graph.output]
    res = _run(m, feeds)
    loss, dz, _ = _numpy_rows(feeds, feeds["input_ids"], feeds["labels"], spelling)
    x = feeds["emb.weight"].astype(np.float64)[feeds["input_ids"]].reshape(-1, D)
    pre = x @ feeds["fc.weight"].T.astype(np.float64) + feeds["fc.bias"]
    dh = dz @ feeds["head.weight"].astype(np.float64)
    if spelling.startswith("shift"):  # rows 0..S-2 of each sequence
        dh = np.concatenate([dh.reshape(B, S - 1, D), np.zeros((B, 1, D))], 1).reshape(-1, D)
    np.testing.assert_allclose(res["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(res["fc.weight_grad"], (dh * (pre > 0)).T @ x, rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize("spelling", ["shift_ce", "shift_ce_sum_tied", "shift_ce_sum_tied_mul",
                                      "shift_ce_sum_tied_softcap", "shift_ce_sum_tied_smoothed"])
def test_shifted_cross_entropy_matches_numpy(spelling, tmp_path):
    """F.cross_entropy on the shifted logits (Hugging Face's older CrossEntropyLoss): one op on
    the hidden states' rows 0..S-2 (seq_start / seq_end), the loss F.cross_entropy's (the kept
    tokens' mean, or their sum), the head's gradient that of the graph's per-token coefficient
    (torch 2.13 exports the mean's as 1 per kept token, not 1 / count: the exported graph's)."""
    # (label 1, 0 is never read: the shift drops every sequence's first label)
    m, feeds = _fused_and_verified(f"torch_lces_{spelling}", tmp_path, 7,
                                   [(0, slice(2, 4)), (1, 0)])
    (op,) = [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"]
    attrs = {a.name: helper.get_attribute_value(a) for a in op.attribute}
    assert (attrs["seq_start"], attrs["seq_end"]) == (0, -1)  # Python's [:-1]
    loss, dz, h = _numpy_rows(feeds, feeds["input_ids"], feeds["labels"], spelling)
    dw = dz.T @ h
    if "_tied" in spelling:  # the fused op's dW alone (tied.py scattered the
        # embedding's rows into it; read as an output, onnxruntime scatters into a copy)
        m.graph.output.append(helper.make_tensor_value_info(op.output[2], onnx.TensorProto.FLOAT,
                                                            None))
    res = _run(m, feeds)
    np.testing.assert_allclose(res["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(res[op.output[2]], dw, rtol=1e-4, atol=1e-6)


def _numpy_head(feeds, reduce, eps=0.0, transform="", fbias=False):
    """loss and d loss / d head weight of the tiny decoder (make_lce_spellings.py Net) in
    float64, from the model code: logits TRANSFORM[transform] of H W^T (+ final_logits_bias
    with fbias); F.cross_entropy's label smoothing eps, (1 - eps) nll + eps (lse - the logits'
    mean) per kept token, their mean over every token ("all"), their sum ("sum") or their mean
    over the kept ones ("mean"); the logits' gradient softmax - (1 - eps) onehot - eps / V."""
    f, df = TRANSFORM[transform]
    h = _hidden(feeds, feeds["input_ids"])
    pre = h @ feeds["head.weight"].T.astype(np.float64)
    if fbias:
        pre = pre + feeds["final_logits_bias"]
    y = feeds["labels"].reshape(-1)
    per, p, keep = _token_ce(f(pre), y, eps)
    denom = {"all": len(y), "sum": 1.0, "mean": keep.sum()}[reduce]
    dz = (keep / denom)[:, None] * p * df(pre)
    return (per * keep).sum() / denom, dz.T @ h


@pytest.mark.parametrize("spelling", ["smoothed_masked_mean", "smoothed_masked_sum",
                                      "smoothed_ce_sum", "smoothed_ce_mean",
                                      "smoothed_masked_mean_softcap"])
def test_label_smoothed_losses_match_numpy(spelling, tmp_path):
    """Label smoothing eps = 0.1 (the model code: gen_torch.cross_entropy, F.cross_entropy):
    per kept token (1 - eps) nll + eps (lse - the mean of the logits), their mean or sum; the
    head's gradient ((1 - eps) (p - onehot) + eps (p - 1 / V)) per kept token over the count
    (mean) or 1 (sum), from NumPy in float64, with ignored tokens; the fused graph verified
    against the original. F.cross_entropy's mean: the loss only (torch 2.13 exports its gradient
    wrong, and the fused graph computes what the export computes: the verify)."""
    m, feeds = _fused_and_verified(f"torch_lces_{spelling}", tmp_path, 11, [(0, slice(0, 3))])
    res = _run(m, feeds)
    loss, dw = _numpy_head(feeds, "mean" if "_mean" in spelling else "sum", eps=0.1,
                           transform="softcap" if spelling.endswith("_softcap") else "")
    np.testing.assert_allclose(res["loss"], loss, rtol=1e-5)
    if spelling != "smoothed_ce_mean":
        np.testing.assert_allclose(res["head.weight_grad"], dw, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("spelling,reduce,eps", [("fbias_reducemean", "all", 0.0),
                                              ("fbias_ce_sum", "sum", 0.0),
                                              ("fbias_smoothed_masked_mean", "mean", 0.1)])
def test_frozen_logit_bias_is_the_ops_bias(spelling, reduce, eps, tmp_path):
    """BART's final_logits_bias (a buffer [1, V] added to the head's logits, fed as a graph
    input with no gradient output): the one op reads it as its bias and writes no dB; its loss
    and head gradient against float64 NumPy with the bias in the logits (the mean over every
    token, the sum or, label-smoothed, the mean over the kept ones)."""
    ignored = [] if reduce == "all" else [(0, slice(0, 3))]
    m, feeds = _fused_and_verified(f"torch_lces_{spelling}", tmp_path, 13, ignored)
    (op,) = [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"]
    assert op.input[2] == "final_logits_bias" and (len(op.output) < 4 or op.output[3] == "")
    res = _run(m, feeds)
    loss, dw = _numpy_head(feeds, reduce, eps=eps, fbias=True)
    np.testing.assert_allclose(res["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(res["head.weight_grad"], dw, rtol=1e-4, atol=1e-6)


# --- negatives: one per new guard -----------------------------------------------------------------

def _explained(m, rule):
    fp = FusionPass(only=[rule])
    misses = [x for x in explain_model(copy.deepcopy(m), fp, include_shallow=True)
              if x["rule"] == rule]
    assert misses, rule
    return misses[0]


def _not_fused_and_verifies(m, tmp_path, name):
    orig = tmp_path / "orig.onnx"
    onnx.save(m, orig)
    fp = FusionPass()
    fp.run(m)
    assert not _lce(fp)
    onnx.save(m, tmp_path / "fused.onnx")
    report = verify_models(orig, tmp_path / "fused.onnx")
    assert report.ok, (name, report)


def _node(m, op, pred=lambda n: True):
    return next(n for n in m.graph.node if n.op_type == op and pred(n))


def test_reducemean_over_one_axis_is_not_the_mean(tmp_path):
    """-lp.gather(...).mean(dim=1) then .sum(): the ReduceMean reads an axes input (here [1] of
    G [N, 1]): not a mean over every token; the rule wants the ReduceMean without axes."""
    m = onnx.load(DATA / "torch_lces_reducemean_neg_tied.onnx")
    assert FusionPass(only=["lce_torch_reducemean_neg"]).run(copy.deepcopy(m)) == 1  # control
    rm = _node(m, "ReduceMean")
    m.graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "axis_one"))
    rm.input.append("axis_one")
    miss = _explained(m, "lce_torch_reducemean_neg")
    assert miss["node"] == "rmean", miss
    _not_fused_and_verifies(m, tmp_path, "axes")


def test_folded_gradient_must_be_one_number_per_row(tmp_path):
    """The scatter's per-row gradient U must hold one number in every row (-1/N of a mean): a
    U with different rows is a weighted loss the op's grad_scale cannot say."""
    m = onnx.load(DATA / "torch_lces_reducemean.onnx")
    assert FusionPass(only=["lce_torch_reducemean"]).run(copy.deepcopy(m)) == 1  # control
    sc = _node(m, "ScatterElements")
    init = next(i for i in m.graph.initializer if i.name == sc.input[2])
    u = numpy_helper.to_array(init).copy()
    u[0] *= 2.0
    init.CopyFrom(numpy_helper.from_array(u, init.name))
    miss = _explained(m, "lce_torch_reducemean")
    assert miss["node"] == "scatter" and "one number in every element" in miss["detail"], miss
    _not_fused_and_verifies(m, tmp_path, "uniform")


def test_nllloss_coefficient_must_be_zero_on_ignored_tokens(tmp_path):
    """F.cross_entropy's backward: w = Where(ne, t, 0); a w that is not 0 where the label is
    ignored (here 1) scatters into class 0 of those rows, which the op's one-hot of the labels
    does not: refused at the Where's constant."""
    m = onnx.load(DATA / "torch_lces_ce_sum.onnx")
    assert FusionPass(only=["lce_torch_nllloss"]).run(copy.deepcopy(m)) == 1  # control
    mul = _node(m, "Mul", lambda n: any(
        p.op_type == "ScatterElements" and p.output[0] in n.input for p in m.graph.node))
    wsel = _node(m, "Where", lambda n: n.output[0] in mul.input)
    m.graph.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), "one_f"))
    wsel.input[2] = "one_f"
    miss = _explained(m, "lce_torch_nllloss")
    assert miss["node"] == "wsel" and "'one_f' (zero_f)" in miss["detail"], miss
    _not_fused_and_verifies(m, tmp_path, "where")


@pytest.mark.parametrize("fixture,rule", [
    ("torch_lces_ce_sum", "lce_torch_nllloss"),
    ("torch_lces_ce_none_mean", "lce_torch_rows_nllloss_none")])
def test_nllloss_ignore_index_must_be_the_compared_one(fixture, rule, tmp_path):
    """NegativeLogLikelihoodLoss{ignore_index} (mean / sum, and reduction none for the
    per-token rule) must be -100, the label the backward's Equal compares with: another
    ignore_index is refused at the attribute."""
    m = onnx.load(DATA / f"{fixture}.onnx")
    nll = _node(m, "NegativeLogLikelihoodLoss")
    for a in nll.attribute:
        if a.name == "ignore_index":
            a.i = -1
    miss = _explained(m, rule)
    assert miss["node"] == "nll" and "ignore_index" in miss["detail"], miss
    _not_fused_and_verifies(m, tmp_path, "ignore_index")


def test_ce_none_mean_is_not_the_ops_mean():
    """F.cross_entropy(reduction='none').mean(): the mean over every token, ignored ones
    included, is not the op's mean over the kept ones: lce_torch_nllloss refuses it at the
    loss's reduction (lce_torch_rows_nllloss_none takes it, the ReduceMean kept)."""
    m = onnx.load(DATA / "torch_lces_ce_none_mean.onnx")
    miss = _explained(m, "lce_torch_nllloss")
    assert miss["node"] == "nll" and "reduction" in miss["detail"], miss


def test_rows_scatter_value_must_be_minus_the_coefficient(tmp_path):
    """lce_torch_rows_gather: the scatter adds -g (Unsqueeze(Neg(g))), the op's row_grad g; the
    value without its Neg (+g: the gradient's sign flipped) is refused at the Neg."""
    m = onnx.load(DATA / "torch_lces_seqlevel.onnx")
    assert FusionPass(only=["lce_torch_rows_gather"]).run(copy.deepcopy(m)) == 1  # control
    sc = _node(m, "ScatterElements")
    unsq = _node(m, "Unsqueeze", lambda n: n.output[0] == sc.input[2])
    gneg = _node(m, "Neg", lambda n: n.output[0] == unsq.input[0])
    gneg.op_type = "Identity"
    miss = _explained(m, "lce_torch_rows_gather")
    assert miss["node"] == "gneg", miss
    _not_fused_and_verifies(m, tmp_path, "rows_sign")


def _shift():
    m = onnx.load(DATA / "torch_lces_shift_logits.onnx")
    assert FusionPass(only=["lce_torch_shift_gather"]).run(copy.deepcopy(m)) == 1  # control
    return m


def _const(m, name, arr):
    m.graph.initializer.append(numpy_helper.from_array(np.asarray(arr), name))
    return name


def test_shift_logits_view_must_be_the_hidden_states_sequences(tmp_path):
    """The logits' [B, S, V] view must have the hidden states' leading dims [B, S]: with the
    hidden states transposed to [S, B, D] before the head (dH transposed back, a valid joint
    graph), the logits' rows are not H3's sequences: slicing H3's second-to-last axis would
    read other rows. Refused at the logits' view (lead_dims_of)."""
    m = _shift()
    hview = _node(m, "Reshape", lambda n: n.output[0] == "view_2")
    dhview = _node(m, "Reshape", lambda n: n.output[0] == "view_5")
    nodes = list(m.graph.node)
    tr = helper.make_node("Transpose", [hview.input[0]], ["relu_sb"], perm=[1, 0, 2])
    back = helper.make_node("Transpose", ["view_5_sb"], ["view_5"], perm=[1, 0, 2])
    hview.input[0] = "relu_sb"
    dhview.input[1] = _const(m, "shape_sb", np.array([S, B, D], np.int64))
    dhview.output[0] = "view_5_sb"
    for t in ("relu_sb", "view_5_sb"):  # recorded, as the exporter records every tensor's
        m.graph.value_info.append(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT,
                                                                [S, B, D]))
    del m.graph.node[:]
    for n in nodes:
        if n is hview:
            m.graph.node.append(tr)
        m.graph.node.append(n)
        if n is dhview:
            m.graph.node.append(back)
    miss = _explained(m, "lce_torch_shift_gather")
    assert miss["node"] == "zview" and "leading dims of H3" in miss["detail"], (miss["node"], miss["detail"])
    _not_fused_and_verifies(m, tmp_path, "shift_view")


def test_shift_gradient_must_go_back_to_the_sliced_rows(tmp_path):
    """The slice_scatter's indices must be the Slice's rows (start, start + 1, ...): the
    gradient put into rows 1..S-1 (a valid graph of another gradient) is refused at the
    ScatterND's indices."""
    m = _shift()
    put = _node(m, "ScatterND")
    put.input[1] = _const(m, "rows_from_1", np.arange(1, S, dtype=np.int64).reshape(-1, 1))
    miss = _explained(m, "lce_torch_shift_gather")
    assert miss["node"] == "put" and "rows_from_1" in miss["detail"], miss
    _not_fused_and_verifies(m, tmp_path, "shift_indices")


def test_shift_slice_must_be_on_the_sequence_axis():
    """A Slice of the logits' last axis (the vocabulary) is no row selection: refused at the
    Slice's axes (second_last_axis)."""
    m = _shift()
    sl = _node(m, "Slice", lambda n: n.output[0] == "slice_1")
    sl.input[3] = _const(m, "axis_two", np.array([2], np.int64))
    miss = _explained(m, "lce_torch_shift_gather")
    assert miss["node"] == "zslice" and "axis_two" in miss["detail"], miss


def _ortt_shift():
    m = onnx.load(DATA / "ortt_lces_lm_shift_ce.onnx")
    assert FusionPass(only=["lce_ortt_shift"]).run(copy.deepcopy(m)) == 1  # control
    return m


def test_ortt_shift_gradient_must_go_back_to_the_sliced_rows(tmp_path):
    """The SliceGrad must put the gradient into the rows the forward's Slice took (the same
    start / end tensors): a SliceGrad into rows 1..S (a valid graph of another gradient) is
    refused at the SliceGrad, and the graph is left as it was."""
    m = _ortt_shift()
    sg = _node(m, "SliceGrad")
    sg.input[2] = _const(m, "start_one", np.array([1], np.int64))
    sg.input[3] = _const(m, "end_max", np.array([S], np.int64))
    miss = _explained(m, "lce_ortt_shift")
    assert miss["node"] == "slice_grad", miss
    _not_fused_and_verifies(m, tmp_path, "ortt_shift_rows")


def test_ortt_shift_slice_must_be_on_the_sequence_axis():
    """A Slice of the logits' vocabulary axis is no row selection: refused at its axes."""
    m = _ortt_shift()
    sl = _node(m, "Slice", lambda n: n.input[0] != "labels")
    sl.input[3] = _const(m, "axis_two", np.array([2], np.int64))
    miss = _explained(m, "lce_ortt_shift")
    assert miss["node"] == "zslice" and "axis_two" in miss["detail"], miss


def test_lead_dims_of_names_its_tensor(tmp_path):
    """A rule's lead_dims_of constraint without the tensor it compares with (`of`) is refused
    when the rule file is read."""
    from fusecli.errors import RuleError
    from fusecli.io import rulefiles

    rules = DATA.parent.parent / "rules"
    text = (rules / "lce_torch_shift.yaml").read_text()
    bad = text.replace("h3_kind: {kind: lead_dims_of, of: H3}", "h3_kind: {kind: lead_dims_of}")
    assert bad != text
    (tmp_path / "bad.yaml").write_text(bad)
    for fragment in rules.glob("_*.yaml"):  # the variants it includes
        (tmp_path / fragment.name).write_text(fragment.read_text())
    with pytest.raises(RuleError, match="lead_dims_of needs 'of'"):
        rulefiles.load_rules([tmp_path / "bad.yaml"])


def test_pooled_view_must_have_as_many_sequences_as_the_arange(tmp_path):
    """The pooled logits' view [B, S, V] must have as many sequences B as the GatherND's
    arange counts: with the view made [3, 4, V] (12 rows, the arange still 0, 1), the op's S =
    N / 2 would read other rows than the gather. Refused at the arange (index_range `of`)."""
    m = onnx.load(DATA / "torch_lces_hf_gpt2_seqcls_masked.onnx")
    view = _node(m, "GatherND", lambda n: n.output[0] == "val_239").input[0]
    reshape = _node(m, "Reshape", lambda n: n.output[0] == view)
    reshape.input[1] = _const(m, "view_3_4", np.array([3, 4, 5], np.int64))
    for vi in m.graph.value_info:
        if vi.name == view:
            vi.CopyFrom(helper.make_tensor_value_info(view, onnx.TensorProto.FLOAT, [3, 4, 5]))
    miss = _explained(m, "lce_torch_mean_pooled")
    assert miss["node"] == "pool_idx" and "garange" in miss["detail"], miss
    fp = FusionPass()
    fp.run(m)
    assert not _lce(fp) and "LinearCrossEntropy" not in {n.op_type for n in m.graph.node}


def test_index_range_of_replaces_the_count(tmp_path):
    """An index_range with both `of` (the count: that tensor's first dim) and `count` is
    refused when the rule file is read."""
    from fusecli.errors import RuleError
    from fusecli.io import rulefiles

    rules = DATA.parent.parent / "rules"
    for fragment in rules.glob("_*.yaml"):
        text = fragment.read_text()
        if fragment.name == "_lce_pool_torch.yaml":
            text = text.replace("start: 0, of: Zg3}", "start: 0, of: Zg3, count: 2}")
        (tmp_path / fragment.name).write_text(text)
    (tmp_path / "lce_torch.yaml").write_text((rules / "lce_torch.yaml").read_text())
    with pytest.raises(RuleError, match="'of' .* replaces 'count'"):
        rulefiles.load_rules([tmp_path / "lce_torch.yaml"])


def test_scaled_classifier_gemm_is_not_a_linear(tmp_path):
    """lce_ortt_gemm: the head Gemm with alpha 0.5 computes 0.5 H W^T + b, not the op's
    logits: refused at the attribute."""
    m = onnx.load(DATA / "ortt_lces_cls_mlp.onnx")
    sce = _node(m, "SoftmaxCrossEntropyLoss")
    gemm = _node(m, "Gemm", lambda n: n.output[0] == sce.input[0])
    for a in gemm.attribute:
        if a.name == "alpha":
            a.f = 0.5
    miss = _explained(m, "lce_ortt_gemm")
    assert miss["node"] == "fwd_gemm" and "alpha" in miss["detail"], miss
    _not_fused_and_verifies(m, tmp_path, "alpha")


@pytest.fixture(scope="module", autouse=True)
def _library_built():
    library_path()


# --- labels the originals accept: a negative one counts from the end --------------------------

TORCH_FUSED = sorted(n for n, r in EXPECTED.items() if r and n.startswith("torch_"))


@pytest.mark.parametrize("name", TORCH_FUSED)
def test_fused_spelling_reads_negative_labels_as_the_original(name, tmp_path):
    """Every torch-joint spelling gathers at the label (GatherElements, or onnxruntime's
    NegativeLogLikelihoodLoss, which runs as one), so the original reads a label in [-V, V) with a
    negative one counting from the end; the fused op is told so (wrap_negative) and verify passes
    on labels over all of [-V, V)."""
    m = onnx.load(DATA / f"{name}.onnx")
    FusionPass().run(m)
    nodes = [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"]
    assert nodes and all([a.i for a in n.attribute if a.name == "wrap_negative"] == [1]
                         for n in nodes)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    vocab = shapes[nodes[0].input[1]][0]
    # (make_lce_spellings.py names the labels input `labels`, the corpus generator `target`)
    lab_name = next(n for n in ("labels", "target") if n in shapes)
    lab_shape = shapes[lab_name]
    lab = np.random.default_rng(36).integers(-vocab, vocab, int(np.prod(lab_shape)))
    k = min(3, lab.size)  # (a sequence classifier: one label per sequence)
    lab[:k] = [-vocab, -1, vocab - 1][:k]
    assert ((lab < 0) & (lab != -100)).sum() >= min(2, k)
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    np.savez(tmp_path / "feeds.npz", **{lab_name: lab.reshape(lab_shape).astype(np.int64)})
    report = verify_models(DATA / f"{name}.onnx", out, feeds_file=tmp_path / "feeds.npz")
    assert report.ok and report.max_rel <= 1e-5, report


def test_a_per_token_logit_bias_is_not_the_ops_bias(tmp_path):
    """The frozen bias added to the logits must be one number per class ([V] or [1, V]: the
    op's bias): fed as a per-token bias [B, S, V] instead, the fused op could not say it, and
    the shape guard refuses it."""
    m = onnx.load(DATA / "torch_lces_fbias_reducemean.onnx")
    assert FusionPass(only=["lce_torch_reducemean_fbias"]).run(copy.deepcopy(m)) == 1  # control
    fb = next(i for i in m.graph.input if i.name == "final_logits_bias")
    fb.CopyFrom(helper.make_tensor_value_info("final_logits_bias", onnx.TensorProto.FLOAT,
                                              [B, S, V]))
    miss = _explained(m, "lce_torch_reducemean_fbias")
    assert miss["reason"] == "shape_mismatch" and "bias" in miss["detail"], miss
    _not_fused_and_verifies(m, tmp_path, "per-token bias")
