"""fusecli's custom-op library (fusecli/lib/libfusecli_ops.so) against the NumPy reference and
against the unfused standard-ONNX subgraphs each op replaces, in onnxruntime with graph
optimizations off; plus loading the same .so in onnxruntime-training 1.19.2."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from fusecli.runtime import library
from fusecli.ops.activation_grad.reference import activation_grad
from fusecli.ops.attention_grad.reference import attention_grad
from fusecli.ops.attention_grad.test_attention_grad import _attn_inputs, _gqa_inputs
from fusecli.ops.conv_bn_relu_grad.reference import conv_bn_relu_grad
from fusecli.ops.conv_bn_relu_grad.test_conv_bn_relu_grad import (CONV_CASES, CONV_OUTS,
                                                                  _conv_attrs, _conv_inputs)
from fusecli.ops.layer_norm_grad.reference import layer_norm_grad
from fusecli.ops.layer_norm_grad.test_layer_norm_grad import _ln_inputs
from fusecli.ops.linear_activation_grad.reference import linear_activation_grad
from fusecli.ops.linear_activation_grad.test_linear_activation_grad import _lin_inputs

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (F16, F32, _built, _inplace_model, _rng, assert_close, fused_model,
                            ort_session, rand, run_in_ortt, tol)


def test_inplace_outputs_in_onnxruntime_training():
    """onnxruntime-training 1.19.2 honours the same in-place pairs (custom-op struct version 18)."""
    rng = _rng("inplace-ortt")
    dy, x, a, w = rand(rng, (6, 40)), rand(rng, (6, 40), scale=2.0), rand(rng, (6, 9)), rand(rng, (40, 9))
    ln = _ln_inputs(rng, (6, 40), -1, F32)
    conv = CONV_CASES[3]
    cv = _conv_inputs(rng, *conv)
    cases = [("ActivationGrad", [("dY", dy), ("X", x)], ["dX"], dict(activation="gelu"),
              [activation_grad(dy, x, "gelu")]),
             ("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", w)],
              ["dA", "dW", "dB", "dZ"], dict(activation="gelu"),
              linear_activation_grad(dy, x, a, w, "gelu")),
             ("LayerNormGrad", list(ln.items()), ["dX", "dGamma", "dBeta"], {},
              layer_norm_grad(*ln.values())),
             ("ConvBnReluGrad", list(cv.items()), CONV_OUTS + ["dC"], _conv_attrs(*conv[7:]),
              conv_bn_relu_grad(*cv.values(), *conv[7:]))]
    jobs = []
    for op, inputs, outs, attrs, _ in cases:
        model, feeds = _inplace_model(op, inputs, outs, {"dY"}, (), F32, **attrs)
        jobs.append(dict(model=model, feeds=feeds, outputs=outs, library=True,
                         count=[op, f"{op}/inplace"]))
    _, results, calls = run_in_ortt(jobs)
    for (op, _, outs, _, ref), got, c in zip(cases, results, calls):
        assert c == {op: 1, f"{op}/inplace": 1}
        for g, r, nm in zip(got, ref, outs):
            assert_close(-g, r, what=f"{op} {nm}")


# ============================ library plumbing / both onnxruntimes ============================

def test_kernel_call_counter_counts_library_kernels():
    library.reset_kernel_calls()
    assert library.kernel_calls("LayerNormGrad") == 0
    assert library.kernel_calls("NoSuchOp") == -1
    rng = _rng("counter")
    ins = _ln_inputs(rng, (4, 8), -1, F32)
    model = fused_model("LayerNormGrad", list(ins.items()), [("dX", F32)])
    sess = ort_session(model)
    feeds = {k: v for k, v in ins.items() if v is not None}
    for _ in range(3):
        sess.run(None, feeds)
    assert library.kernel_calls("LayerNormGrad") == 3
    assert library.kernel_calls("ActivationGrad") == 0


def test_same_so_runs_each_op_in_onnxruntime_training():
    rng = _rng("ortt-all")
    dy, x = rand(rng, (5, 9)), rand(rng, (5, 9))
    lin = _lin_inputs(rng, (6,), 7, 5, 1)
    att = _attn_inputs(rng, (2,), 5, 6, 4, 3, 1)
    ln = _ln_inputs(rng, (4, 19), -1, F16)
    cases = [
        ("ActivationGrad", dict(dY=dy.astype(F16), X=x.astype(F16)), ["dX"], dict(activation="silu"),
         activation_grad(dy.astype(F16), x.astype(F16), "silu"), F16),
        ("LinearActivationGrad", dict(zip(["dY", "X", "A", "W"], lin)), ["dA", "dW", "dB"],
         dict(activation="gelu_tanh", trans_w=1), linear_activation_grad(*lin, "gelu_tanh", 1), F32),
        ("AttentionGrad", dict(zip(["dO", "Q", "K", "V", "P"], att)), ["dQ", "dK", "dV"],
         dict(scale_q=0.5, scale_k=0.25, k_transposed=1),
         attention_grad(*att, 0.5, 0.25, 1), F32),
        ("LayerNormGrad", {k: v for k, v in ln.items()}, ["dX", "dGamma", "dBeta"], {},
         layer_norm_grad(*ln.values()), F16),
    ]
    jobs = []
    for op, feeds, outs, attrs, _, dt in cases:
        model = fused_model(op, list(feeds.items()), [(o, dt) for o in outs], **attrs)
        jobs.append(dict(model=model, feeds=feeds, outputs=outs, library=True, count=[op]))
    version, results, calls = run_in_ortt(jobs)
    assert version == "1.19.2"
    for (op, _, _, _, ref, dt), got, c in zip(cases, results, calls):
        assert c == {op: 1}
        ref = ref if isinstance(ref, tuple) else (ref,)
        t = tol(dt) if dt == F32 else dict(rtol=2e-2, atol_scale=2e-2)
        for g, r in zip(got, ref):
            assert_close(g, r, **t, what=op)


def test_optional_inputs_in_onnxruntime_training():
    """The same .so in onnxruntime-training 1.19.2 with absent non-trailing optional inputs
    (LinearActivationGrad without W, LayerNormGrad without gamma, AttentionGrad without q_scale)
    and present trailing ones (AttentionGrad q_scale / k_scale, the bool dropout_mask with grouped
    K / V and the dS output)."""
    rng = _rng("ortt-optional")
    dy, x, a, _ = _lin_inputs(rng, (6,), 9, 5, 0)
    att = _attn_inputs(rng, (2,), 5, 6, 4, 3, 0)
    qs, ks = np.array(0.5, F32), np.array(-1.5, F32)
    ln = _ln_inputs(rng, (7, 19), -1, F32, with_dr=False)
    ln["gamma"] = None
    gqa = _gqa_inputs(rng, "gqa", 1, 1)
    cases = [
        ("AttentionGrad", list(zip(["dO", "Q", "K", "V", "P"], gqa[:5])) +
         [("q_scale", None), ("k_scale", ks), ("dropout_mask", gqa[5])], ["dQ", "dK", "dV", "dS"],
         dict(scale_q=0.5, scale_k=0.25, k_transposed=1, dropout_ratio=0.1),
         attention_grad(*gqa[:5], 0.5, 0.25, 1, None, ks, gqa[5], 0.1)),
        ("LinearActivationGrad", [("dY", dy), ("X", x), ("A", a), ("W", None)], [None, "dW", "dB"],
         dict(activation="gelu"), linear_activation_grad(dy, x, a, None, "gelu")[1:3]),
        ("AttentionGrad", list(zip(["dO", "Q", "K", "V", "P"], att)) + [("q_scale", qs), ("k_scale", ks)],
         ["dQ", "dK", "dV"], dict(scale_q=0.5, scale_k=0.25), attention_grad(*att, 0.5, 0.25, 0, qs, ks)[:3]),
        ("LayerNormGrad", list(ln.items()), [None, "dGamma", "dBeta"], {},
         layer_norm_grad(*ln.values())[1:]),
    ]
    jobs = []
    for op, inputs, outs, attrs, _ in cases:
        model = fused_model(op, inputs, [(o, F32) if o else None for o in outs], **attrs)
        feeds = {n: v for n, v in inputs if v is not None}
        jobs.append(dict(model=model, feeds=feeds, outputs=[o for o in outs if o], library=True,
                         count=[op]))
    version, results, calls = run_in_ortt(jobs)
    assert version == "1.19.2"
    for (op, _, _, _, ref), got, c in zip(cases, results, calls):
        assert c == {op: 1}
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert_close(g, r, what=op)


def test_library_path_and_session_options():
    path = library.library_path()
    assert path.endswith("fusecli/lib/libfusecli_ops.so")
    so = library.session_options(threads=1)
    assert isinstance(so, ort.SessionOptions)
    assert so.intra_op_num_threads == 1


def test_profiling_shows_fused_op_names(tmp_path):
    rng = _rng("profile")
    dy, x = rand(rng, (8, 8)), rand(rng, (8, 8))
    model = fused_model("ActivationGrad", [("dY", dy), ("X", x)], [("dX", F32)], activation="gelu")
    so = library.session_options(opt_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, {"dY": dy, "X": x})
    prof = sess.end_profiling()
    text = open(prof).read()
    assert '"op_name" : "ActivationGrad"' in text or '"op_name":"ActivationGrad"' in text
