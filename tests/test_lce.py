"""Fused linear + cross-entropy (rules/lce_ortt.yaml, rules/lce_torch.yaml -> LinearCrossEntropy):
the real exports of tests/data/make_lce.py in both families fuse where the model code says
(one LM head + loss each; the LoRA-adapted head is left to the LoRA rules: its adapters read the
logits' gradient) and verify against their originals, also with the loss's incoming gradient
computed at run time (fed as an input: one op that reads it; computed from the loss: two ops,
the loss, then the gradients), and a label-smoothed loss (the op's lp_row); one negative per
guard (the logits read elsewhere, a mean whose divisor is not the mask's count, a run-time loss
gradient of more than one value); and the ort-training workflow (Module + Optimizer) on fused models with
the original's loss curve, a LoRA-adapted head's adapters included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from conftest import run_cli
from fusecli import FusionPass
from fusecli.runtime.library import library_path
from fusecli.runtime.verify import verify_models
from test_ortt_training import _SCRIPT, _ortt

DATA = Path(__file__).parent / "data"
# from the model code (tests/data/make_lce.py): one head + loss per model; the LoRA head: none
EXPECTED = {"lce_untied": 1, "lce_tied": 1, "lce_bias_sum": 1, "lce_frozen": 1, "lce_lora": 0,
            "lce_sum": 1, "lce_bias": 1, "lce_frozen_sum": 1}
CASES = [f"{p}_{n}" for p in ("ortt", "torch") for n in EXPECTED]
RULES = {"ortt_lce_untied": "lce_ortt", "ortt_lce_tied": "lce_ortt",
         "ortt_lce_bias_sum": "lce_ortt_ii", "ortt_lce_frozen": "lce_ortt_ii_frozen",
         "torch_lce_untied": "lce_torch_mean", "torch_lce_tied": "lce_torch_mean",
         "torch_lce_bias_sum": "lce_torch_sum_bias", "torch_lce_frozen": "lce_torch_mean_frozen_3d",
         "ortt_lce_sum": "lce_ortt_ii", "ortt_lce_bias": "lce_ortt", "ortt_lce_frozen_sum":
         "lce_ortt_frozen", "torch_lce_sum": "lce_torch_sum", "torch_lce_bias":
         "lce_torch_mean_bias", "torch_lce_frozen_sum": "lce_torch_sum_frozen_3d"}


def _fuse(m):
    fp = FusionPass()
    fp.run(m)
    st = fp.stats.patterns.get("linear_cross_entropy")
    return (st.fused if st else 0), fp


def _lce_nodes(m):
    return [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"]


@pytest.mark.parametrize("name", CASES)
def test_lce_exports_fuse_and_verify(name, tmp_path):
    m = onnx.load(DATA / f"{name}.onnx")
    fused, fp = _fuse(m)
    assert fused == EXPECTED[name.split("_", 1)[1]]
    nodes = _lce_nodes(m)
    assert len(nodes) == fused
    if fused:
        rec = [r for r in fp.stats.fusions if r.pattern == "linear_cross_entropy"]
        assert [r.rule for r in rec] == [RULES[name]]
        outs = list(nodes[0].output) + [""] * (4 - len(nodes[0].output))
        assert (outs[2] == "") == ("frozen" in name)               # a frozen head: no dW
        assert (outs[3] != "") == ("bias" in name)                 # dB only with a bias
        # the [N, V] tensors are gone: no LogSoftmax, no loss op, no ScatterElements
        left = {n.op_type for n in m.graph.node}
        assert not left & {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad",
                           "LogSoftmax", "ScatterElements"}
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(DATA / f"{name}.onnx", out)
    assert report.ok and report.max_rel <= 1e-5, report
    # the default feeds draw the labels over the vocabulary (make_lce.py: V = 50, S = 7, B = 2),
    # in both families (torch-joint's reach the gather through Where(label != -100, label, 0))
    assert report.feeds["labels"] == f"labels in [0, {VOCAB_LCE})"


# --- labels the original accepts, or refuses (issue 33) ---------------------------------------
# make_lce.py's model code: vocabulary 50, batch 2 x 7 tokens (V differs from S and from B)
VOCAB_LCE, BATCH_LCE, SEQ_LCE = 50, 2, 7
TORCH_FUSED = [n for n in EXPECTED if EXPECTED[n]]


def _labels_with_negatives():
    """B x S labels over all of [-V, V): -V, -1, V - 1, the ignored -100 and negatives between."""
    lab = np.random.default_rng(33).integers(-VOCAB_LCE, VOCAB_LCE, BATCH_LCE * SEQ_LCE)
    lab[:4] = [-VOCAB_LCE, -1, VOCAB_LCE - 1, -100]
    return lab.astype(np.int64)


@pytest.mark.parametrize("how", [None, "loss"])
@pytest.mark.parametrize("name", TORCH_FUSED)
def test_lce_torch_fused_heads_agree_with_originals_on_negative_labels(name, how, tmp_path):
    """torch-joint's original gathers and scatters at the label, which onnxruntime reads in
    [-V, V) (a negative one counts from the end): every fused torch-joint head (one op, or the
    loss op + the gradient op of a loss-dependent seed) reads them the same way
    (wrap_negative), and verify passes on labels with negatives other than -100 in them."""
    orig = onnx.load(DATA / f"torch_{name}.onnx") if how is None else \
        with_run_time_seed("torch", how, name)
    src = tmp_path / "orig.onnx"
    onnx.save(orig, src)
    m = onnx.ModelProto()
    m.CopyFrom(orig)
    assert _fuse(m)[0] == 1
    nodes = _lce_nodes(m)
    assert len(nodes) == (1 if how is None else 2)
    for n in nodes:
        assert [a.i for a in n.attribute if a.name == "wrap_negative"] == [1]
    onnx.save(m, tmp_path / "fused.onnx")
    lab = _labels_with_negatives()
    assert ((lab < 0) & (lab != -100)).sum() >= 5
    np.savez(tmp_path / "feeds.npz", labels=lab)
    report = verify_models(src, tmp_path / "fused.onnx", feeds_file=tmp_path / "feeds.npz")
    assert report.ok and report.max_rel <= 1e-5, report


def _run(model, feeds):
    import onnxruntime as ort

    from fusecli.runtime.library import session_options

    so = session_options(threads=1, opt_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in model.graph.input}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _fails_in_one_line(model, feeds, match):
    with pytest.raises(Exception) as err:
        _run(model, feeds)
    msg = str(err.value).split("Status Message: ", 1)[-1].strip()
    assert match in msg and "\n" not in msg, msg


@pytest.mark.parametrize("bad", [VOCAB_LCE, -VOCAB_LCE - 1])
def test_lce_torch_fused_heads_refuse_the_labels_the_originals_refuse(bad):
    """A label outside [-V, V) fails in torch-joint's original (onnxruntime's ScatterElements
    refuses the index) and in its fused head, in one line; the labels the default feeds draw
    run (the control)."""
    from fusecli.runtime.feeds import plan_feeds

    orig = onnx.load(DATA / "torch_lce_bias_sum.onnx")
    m = onnx.ModelProto()
    m.CopyFrom(orig)
    assert _fuse(m)[0] == 1
    feeds = plan_feeds(orig).feeds
    _run(m, feeds)
    feeds["labels"] = feeds["labels"].copy()
    feeds["labels"][5] = bad
    with pytest.raises(Exception, match="out of data bounds"):
        _run(orig, feeds)
    _fails_in_one_line(m, feeds, "a label is outside [-V, V) and not ignore_index")


@pytest.mark.parametrize("bad", [-5, VOCAB_LCE, -VOCAB_LCE - 1])
def test_lce_ortt_fused_head_refuses_a_label_the_original_does_not_define(bad, tmp_path):
    """onnxruntime-training's original defines no label outside [0, V) other than ignore_index:
    its loss reads another row's log-probability (or past the buffer) and its Grad leaves the
    one-hot out (test_linear_cross_entropy.py's
    test_lce_ort_training_original_defines_no_label_outside_the_classes). Its fused head
    refuses such a label, and verify says so in one line (the original runs, on another row's
    numbers; the fused model does not)."""
    from fusecli.errors import CheckFailed

    src = DATA / "ortt_lce_bias_sum.onnx"                   # ignore_index -100
    m = onnx.load(src)
    assert _fuse(m)[0] == 1
    onnx.save(m, tmp_path / "fused.onnx")
    lab = np.random.default_rng(5).integers(0, VOCAB_LCE, BATCH_LCE * SEQ_LCE).astype(np.int64)
    lab[2] = -100
    np.savez(tmp_path / "feeds.npz", labels=lab)
    report = verify_models(src, tmp_path / "fused.onnx", feeds_file=tmp_path / "feeds.npz")
    assert report.ok, report                                  # the control: -100 and classes
    lab[5] = bad                                              # row 5 of 14: read inside the buffer
    np.savez(tmp_path / "feeds.npz", labels=lab)
    with pytest.raises(CheckFailed) as err:
        verify_models(src, tmp_path / "fused.onnx", feeds_file=tmp_path / "feeds.npz")
    msg = str(err.value)
    assert "a label is outside [0, V) and not ignore_index" in msg and "\n" not in msg, msg


def _logits(m):
    for n in m.graph.node:
        if n.op_type in ("SoftmaxCrossEntropyLoss", "LogSoftmax"):
            return n.input[0]
    raise AssertionError("no loss")


@pytest.mark.parametrize("how", [None, "input", "loss"])
@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_lce_not_fused_when_the_logits_are_a_model_output(family, how):
    m = onnx.load(DATA / f"{family}_lce_untied.onnx") if how is None else \
        with_run_time_seed(family, how)
    m.graph.output.append(helper.make_tensor_value_info(_logits(m), onnx.TensorProto.FLOAT, None))
    fused, fp = _fuse(m)
    assert fused == 0 and not _lce_nodes(m)
    assert fp.stats.patterns["linear_cross_entropy"].detected == 1


def with_run_time_seed(family, how, name="lce_untied", k=0.5, c=0.25):
    """An export of tests/data/make_lce.py with its loss gradient computed at run time: the
    graph input `seed` (how="input": a loss scale fed by the caller), or seed = k * loss + c
    (how="loss": a scale computed from the loss value itself; k = 0 still reads the loss at
    run time). onnxruntime-training: `seed` replaces the constant dLoss that
    SoftmaxCrossEntropyLossGrad reads; torch-joint: the per-token coefficient g (the tangent
    over the count, times the mask) is multiplied by `seed` before it enters the one-hot
    scatter (F.cross_entropy's NegativeLogLikelihoodLoss spelling: the tangent t of its
    coefficient Where(ne, t, 0), which multiplies the scattered one-hot)."""
    m = onnx.load(DATA / f"{family}_{name}.onnx")
    nodes = list(m.graph.node)
    producer = {t: n for n in nodes for t in n.output}
    new = []
    if family == "ortt":
        user = next(n for n in nodes if n.op_type == "SoftmaxCrossEntropyLossGrad")
        init = next(i for i in m.graph.initializer if i.name == user.input[0])
        m.graph.initializer.remove(init)                  # the constant dLoss as exported
        user.input[0] = "seed"
        loss = next(n for n in nodes if n.op_type == "SoftmaxCrossEntropyLoss").output[0]
    else:
        scatter = next(n for n in nodes if n.op_type == "ScatterElements")
        src = producer.get(scatter.input[2])
        if src is not None and src.op_type == "Unsqueeze":
            user = producer[src.input[0]]     # Neg(g) -> Unsqueeze
            assert user.op_type == "Neg"
            slot = 0
        else:  # NegativeLogLikelihoodLoss's backward: Mul(scatter, Where(ne, t, 0))
            mul = next(n for n in nodes if scatter.output[0] in n.input)
            user = producer[next(t for t in mul.input if t != scatter.output[0])]
            assert user.op_type == "Where"
            slot = 1
        new.append(helper.make_node("Mul", [user.input[slot], "seed"], ["seed_g"]))
        user.input[slot] = "seed_g"
        loss = m.graph.output[0].name
        assert loss == "loss"
    if how == "input":
        m.graph.input.append(helper.make_tensor_value_info("seed", onnx.TensorProto.FLOAT, []))
    else:
        m.graph.initializer.extend([numpy_helper.from_array(np.array(k, np.float32), "seed_k"),
                                    numpy_helper.from_array(np.array(c, np.float32), "seed_c")])
        new[:0] = [helper.make_node("Mul", [loss, "seed_k"], ["seed_kl"]),
                   helper.make_node("Add", ["seed_kl", "seed_c"], ["seed"])]
        assert nodes.index(producer[loss]) < nodes.index(user)
    at = nodes.index(user)
    for j, n in enumerate(new):
        m.graph.node.insert(at + j, n)
    return m


def _loss_of(m, family):
    if family == "ortt":
        return next(n for n in m.graph.node if n.op_type == "SoftmaxCrossEntropyLoss").output[0]
    return "loss"


# every export that fuses, with its loss gradient computed at run time: the same one head +
# loss (the model code), fused by the rule of the constant case's spelling, in one op where
# the seed does not depend on the loss (ort-training: _seed; torch-joint: the same rule, g
# read as row_grad), in two where it does (_split)
SEED_CASES = [(f, how, n) for f in ("ortt", "torch") for how in ("input", "loss")
              for n in EXPECTED if EXPECTED[n]]
SUFFIX = {("ortt", "input"): "_seed", ("ortt", "loss"): "_split", ("torch", "input"): "",
          ("torch", "loss"): "_split"}


@pytest.mark.parametrize("family,how,name", SEED_CASES)
def test_lce_fuses_a_loss_gradient_computed_at_run_time(family, how, name, tmp_path):
    m = with_run_time_seed(family, how, name)
    loss = _loss_of(m, family)
    fused, fp = _fuse(m)
    assert fused == EXPECTED[name]
    assert [r.rule for r in fp.stats.fusions if r.pattern == "linear_cross_entropy"] == \
        [RULES[f"{family}_{name}"] + SUFFIX[family, how]]
    nodes = _lce_nodes(m)
    left = {n.op_type for n in m.graph.node}
    assert not left & {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad", "LogSoftmax",
                       "ScatterElements"}
    # the op reads the seed: as grad_seed (onnxruntime-training), in row_grad (torch-joint)
    seed_in = (6, "seed") if family == "ortt" else (5, "seed_g")
    if how == "input":
        assert len(nodes) == 1
        assert nodes[0].input[seed_in[0]] == seed_in[1]
    else:
        # two ops: the loss alone, then the gradients alone, after the seed's producer
        fwd, bwd = nodes
        assert list(fwd.output) == [loss]
        assert bwd.output[0] == "" and bwd.output[1]
        assert (len(bwd.output) > 2 and bwd.output[2] != "") == ("frozen" not in name)  # dW
        assert list(fwd.input[:4]) == list(bwd.input[:4])
        assert bwd.input[seed_in[0]] == seed_in[1]
        names = [n.name for n in m.graph.node]
        seed_at = next(j for j, n in enumerate(m.graph.node) if "seed" in n.output)
        assert names.index(fwd.name) < seed_at < names.index(bwd.name)
    _verify_seeds(m, tmp_path, family, how, name)


def _verify_seeds(fused_model, tmp_path, family, how, name):
    """The fused graph against the original on onnxruntime(-training), optimizations off:
    the seed fed as the input, or several k, c of k * loss + c (the untied export: several
    seeds; the others: one)."""
    fused_path = tmp_path / "fused.onnx"
    several = name == "lce_untied"
    if how == "input":
        onnx.save(with_run_time_seed(family, how, name), tmp_path / "orig.onnx")
        onnx.save(fused_model, fused_path)
        # (not 0: every gradient 0, which verify calls inconclusive; the op's tests have it)
        for s in (1.0, -0.5, 2.5) if several else (2.5,):
            np.savez(tmp_path / "feeds.npz", seed=np.array(s, np.float32))
            report = verify_models(tmp_path / "orig.onnx", fused_path,
                                   feeds_file=tmp_path / "feeds.npz")
            assert report.ok and report.max_rel <= 1e-5, (s, report)
        return
    for k, c in ((0.0, 1.5), (0.5, 0.25), (-2.0, 0.0)) if several else ((0.5, 0.25),):
        orig = with_run_time_seed(family, how, name, k=k, c=c)
        onnx.save(orig, tmp_path / "orig.onnx")
        assert _fuse(orig)[0] == 1
        onnx.save(orig, fused_path)
        report = verify_models(tmp_path / "orig.onnx", fused_path)
        assert report.ok and report.max_rel <= 1e-5, (k, c, report)


def test_lce_ortt_run_time_seed_must_be_one_value():
    """grad_seed is one number (the loss is a scalar): a seed of another recorded shape is
    refused by the shape guard, in one op and in two."""
    m = with_run_time_seed("ortt", "input")
    seed = next(i for i in m.graph.input if i.name == "seed")
    seed.CopyFrom(helper.make_tensor_value_info("seed", onnx.TensorProto.FLOAT, [2]))
    fused, fp = _fuse(m)
    assert fused == 0 and not _lce_nodes(m)
    assert fp.stats.patterns["linear_cross_entropy"].skipped == {"shape_mismatch": 1}


def test_lce_torch_mean_needs_the_mask_count_as_divisor(tmp_path):
    """A loss divided by something else than the count of the mask (here a constant) is not the
    op's mean: the _mean rule stops at the divisor's check (the count must be Cast of the mask's
    ReduceSum); whatever fuses instead (the sum rule, the Div left outside) computes what the
    original does."""
    from fusecli.engine.explain import explain_model

    only_mean = FusionPass(only=["lce_torch_mean"])
    assert only_mean.run(onnx.load(DATA / "torch_lce_untied.onnx")) == 1  # control: as exported
    m = onnx.load(DATA / "torch_lce_untied.onnx")
    div = next(n for n in m.graph.node if n.op_type == "Div" and n.output[0] == "loss")
    m.graph.initializer.append(numpy_helper.from_array(np.array(3.0, np.float32), "three"))
    div.input[1] = "three"
    orig = tmp_path / "orig.onnx"
    onnx.save(m, orig)
    (miss,) = [x for x in explain_model(m, only_mean, include_shallow=True)
               if x["rule"] == "lce_torch_mean"]
    assert miss["node"] == "cnt_cast" and "'three' (bound to cnt)" in miss["detail"]
    _, fp = _fuse(m)
    assert not [r for r in fp.stats.fusions if r.rule.startswith("lce_torch_mean")]
    onnx.save(m, tmp_path / "fused.onnx")
    report = verify_models(orig, tmp_path / "fused.onnx")
    assert report.ok, report


def test_lce_torch_fuses_a_label_smoothed_loss(tmp_path):
    """torch_lce_smooth (make_lce.py): lce_untied's loss with label smoothing 0.1 (the corpus's
    torch-joint cross-entropy): its smoothing term, the masked mean over classes of
    -log_softmax, reads the log-probabilities' row mean, which the one fused op writes (lp_row,
    with its gradient lp_row_grad): no log-probabilities, one-hot or logits left, and the
    fused graph verifies against the original."""
    m = onnx.load(DATA / "torch_lce_smooth.onnx")
    fused, fp = _fuse(m)
    (op,) = _lce_nodes(m)
    assert [r.rule for r in fp.stats.fusions if r.pattern == "linear_cross_entropy"] == [
        "lce_torch_mean_smoothed"]
    assert op.output[4] and op.input[9]  # lp_row, lp_row_grad
    assert not {"LogSoftmax", "GatherElements", "ScatterElements", "Exp"} & {
        n.op_type for n in m.graph.node}
    assert fp.stats.patterns["linear_relu"].fused == 1  # the model's Linear + ReLU
    onnx.save(m, tmp_path / "fused.onnx")
    report = verify_models(DATA / "torch_lce_smooth.onnx", tmp_path / "fused.onnx")
    assert report.ok and report.max_rel <= 1e-5, report


# --- training: onnxruntime.training.api Module + Optimizer ----------------------------------

STEPS, SEQ, VOCAB, EMB = 5, 40, 300, 16
_LM = r'''
if cfg["mode"] == "lm_artifacts":
    from onnxruntime.training import onnxblock
    rng = np.random.default_rng(0)
    S, V, E, lora = cfg["seq"], cfg["vocab"], cfg["emb"], cfg["lora"]
    def w(shape, name, s=1.0):
        return numpy_helper.from_array((s * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32), name)
    inits = [w((V, E), "emb", 4.0), w((E, E), "fc"), w((V, E), "head"),
             numpy_helper.from_array(np.array([-1, V], np.int64), "flat")]
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["x"]),
             helper.make_node("Transpose", ["fc"], ["fc_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "fc_t"], ["h0"]),
             helper.make_node("Relu", ["h0"], ["h"]),
             helper.make_node("Transpose", ["head"], ["head_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "head_t"], ["z"])]
    logits = "z"
    trained = ["emb", "fc", "head"]
    if lora:   # logits += 0.5 (h A^T) B^T, the head frozen, the adapters trained
        inits += [w((4, E), "lora_A"), w((V, 4), "lora_B"),
                  numpy_helper.from_array(np.array(0.5, np.float32), "lora_s")]
        nodes += [helper.make_node("Transpose", ["lora_A"], ["a_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h", "a_t"], ["ha"]),
                  helper.make_node("Transpose", ["lora_B"], ["b_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["ha", "b_t"], ["hab"]),
                  helper.make_node("Mul", ["hab", "lora_s"], ["habs"]),
                  helper.make_node("Add", ["z", "habs"], ["zl"])]
        logits = "zl"
        trained = ["emb", "fc", "lora_A", "lora_B"]
    nodes.append(helper.make_node("Reshape", [logits, "flat"], ["logits"]))
    graph = helper.make_graph(
        nodes, "lm", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, S])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [S, V])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    ce = onnxblock.loss.CrossEntropyLoss(reduction="mean", ignore_index=-100)

    class Scaled(onnxblock.Block):  # the loss times a scale: fed at run time, or itself
        def __init__(self):
            super().__init__()
            self.ce, self.mul = ce, onnxblock.blocks.Mul()

        def build(self, logits):
            loss = self.ce(logits)
            if cfg["seed"] == "input":
                self.base.graph.input.append(
                    helper.make_tensor_value_info("loss_scale", TensorProto.FLOAT, []))
                return self.mul(loss, "loss_scale")
            return self.mul(loss, loss)

    artifacts.generate_artifacts(
        model, requires_grad=trained, frozen_params=[i.name for i in inits if i.name not in trained and i.data_type == 1],
        loss=ce if cfg["seed"] is None else Scaled(),
        optimizer=getattr(artifacts.OptimType, cfg["optim"]), artifact_directory=d)
    finish_artifacts()
'''
_MARK = 'if cfg["mode"] == "artifacts":'
assert _MARK in _SCRIPT
SCRIPT = _SCRIPT.replace(_MARK, _LM.strip("\n") + "\n" + _MARK, 1)


# (LoRA adapter, the loss's scale): the cross-entropy as it is, times a loss_scale input fed at
# every step (the Module's third input, the batch's third array), or times itself (a scale computed from the loss); with
# a scale, plain SGD, whose steps follow the gradients' size (AdamW's nearly do not)
TRAIN = {"head": (False, None), "lora_head": (True, None), "head_scale_input": (False, "input"),
         "head_scale_loss": (False, "loss")}


@pytest.mark.parametrize("case", list(TRAIN))
def test_fused_lm_head_trains_like_the_original(case, tmp_path, ortt_python, monkeypatch):
    import test_ortt_training

    lora, seed = TRAIN[case]
    monkeypatch.setattr(test_ortt_training, "_SCRIPT", SCRIPT)
    art = tmp_path / "artifacts"
    art.mkdir()
    made = _ortt(ortt_python, {"mode": "lm_artifacts", "dir": str(art), "seq": SEQ,
                               "vocab": VOCAB, "emb": EMB, "lora": lora, "seed": seed,
                               "optim": "AdamW" if seed is None else "SGD"})
    assert {"training_model.onnx", "optimizer_model.onnx", "checkpoint"} <= set(made)
    orig, fused = art / "training_model.onnx", art / "fused_training_model.onnx"
    report = json.loads(run_cli("optimize", orig, "-o", fused, "--json").stdout)
    fusions = {p: v["fused"] for p, v in report["patterns"].items() if v["fused"]}
    # the model code: one head + loss; with the LoRA adapter the head's logits' gradient goes
    # to the adapters (left to the LoRA rule), so the head + loss stays
    assert fusions.get("linear_cross_entropy", 0) == (0 if lora else 1), fusions
    # a loss gradient computed from the loss: the loss op, then the gradient op
    ops = 2 if seed == "loss" else 0 if lora else 1

    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (1, SEQ)).astype(np.int64)
    labels = np.roll(ids[0], -1).astype(np.int64)      # next-token targets
    labels[-3:] = -100                                 # ignored tokens
    scale = {"loss_scale": np.array(0.75, np.float32)} if seed == "input" else {}
    np.savez(tmp_path / "batch.npz", x=ids, y=labels, **scale)
    res = _ortt(ortt_python, {"mode": "train", "dir": str(art), "library": library_path(),
                              "batch": str(tmp_path / "batch.npz"), "steps": STEPS, "lr": 0.02,
                              "models": [str(orig), str(fused)], "ops": ["LinearCrossEntropy"]})
    a, b = res[str(orig)], res[str(fused)]
    assert all(np.diff(a["losses"]) < 0), a["losses"]     # it does train
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b["params"], a["params"], rtol=1e-4, atol=1e-6)
    assert a["calls"] == {"LinearCrossEntropy": 0}
    assert b["calls"] == {"LinearCrossEntropy": ops * STEPS}


@pytest.fixture(scope="module", autouse=True)
def _library_built():
    library_path()


# --- the logits transformed before the loss (rules/lce_*.yaml _scaled, _softcap) -------------
# Granite's logits / logits_scaling (Div), Cohere's logits * logit_scale (Mul), Gemma 2's soft
# cap c tanh(z / c), added to exports of each rule's spellings (tests/builders.py
# with_logit_scale; real exports of all three: tests/test_lce_spellings.py), the one-op and the
# two-op (_split: the gradient op must apply the transform too) forms: the op carries the
# constant and the fused graph computes what the original does.
TRANSFORM_CASES = [
    ("ortt", None, "lce_untied", "Div"), ("ortt", None, "lce_bias_sum", "softcap"),
    ("ortt", None, "lce_frozen", "Mul"), ("ortt", "loss", "lce_untied", "softcap"),
    ("ortt", "input", "lce_bias_sum", "Div"),
    ("torch", None, "lce_untied", "softcap"), ("torch", None, "lce_bias", "Div"),
    ("torch", None, "lce_frozen_sum", "softcap"), ("torch", "loss", "lce_bias_sum", "softcap"),
    ("torch", "loss", "lce_untied", "Mul"),
    ("torch", None, "lces_reducemean", "softcap"), ("torch", None, "lces_reducesum_const", "Mul"),
    ("torch", None, "lces_ce_sum", "softcap"), ("torch", None, "lces_hf_llama_items", "Div")]


@pytest.mark.parametrize("family,how,name,op", TRANSFORM_CASES)
def test_lce_fuses_logits_transformed_before_the_loss(family, how, name, op, tmp_path):
    import builders

    base = (with_run_time_seed(family, how, name) if how
            else onnx.load(DATA / f"{family}_{name}.onnx"))
    c = {"Div": 4.0, "Mul": 0.5, "softcap": 3.0}[op]
    m = builders.with_logit_scale(base, family, c, op)
    onnx.save(m, tmp_path / "orig.onnx")
    fp = FusionPass()
    fp.run(m)
    rules = [r.rule for r in fp.stats.fusions if r.pattern == "linear_cross_entropy"]
    assert len(rules) == 1 and ("_softcap" if op == "softcap" else "_scaled") in rules[0]
    ops = [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"]
    assert ops and not {n.op_type for n in m.graph.node} & {"Tanh", "TanhGrad", "LogSoftmax"}
    want = ("logit_softcap", c) if op == "softcap" else (
        "logit_scale", 1.0 / c if op == "Div" else c)
    for n in ops:  # both ops of a _split pair
        got = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert got.get(want[0]) == pytest.approx(want[1]), got
    onnx.save(m, tmp_path / "fused.onnx")
    report = verify_models(tmp_path / "orig.onnx", tmp_path / "fused.onnx")
    assert report.ok and report.max_rel <= 1e-5, report
