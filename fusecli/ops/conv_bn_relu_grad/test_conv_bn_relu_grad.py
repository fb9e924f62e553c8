"""ConvBnReluGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference
and against the unfused standard-ONNX subgraph it replaces, in onnxruntime with graph
optimizations off."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fusecli.ops.conv_bn_relu_grad.reference import conv_bn_relu_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (F32, OPSET, _built, _inplace_run, _rng, assert_close, assert_requested,
                            fused_model, ort_session, rand, run_fused, run_in_ortt)


def _conv_inputs(rng, n, cin, hin, win, c, kh, kw, strides, pads, dilations, group):
    x = rand(rng, (n, cin, hin, win))
    w = rand(rng, (c, cin // group, kh, kw), scale=0.5)
    h = (hin + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    wd = (win + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    cv = rand(rng, (n, c, h, wd), scale=1.5) + 0.2
    mean = cv.mean(axis=(0, 2, 3)).astype(F32)
    inv_std = (1 / np.sqrt(cv.var(axis=(0, 2, 3)) + 1e-5)).astype(F32)
    gamma = rand(rng, (c,), positive=True)
    y = np.maximum(rand(rng, cv.shape), 0).astype(F32) + (rng.random(cv.shape) < 0.1).astype(F32)
    dy = rand(rng, cv.shape)
    return dict(dY=dy, Y=y, X=x, W=w, Cv=cv, gamma=gamma, mean=mean, inv_std=inv_std)


CONV_CASES = [
    # n, cin, hin, win, c, kh, kw, strides, pads, dilations, group
    (1, 1, 1, 1, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),
    (2, 3, 7, 9, 5, 3, 3, (1, 1), (0, 0, 0, 0), (1, 1), 1),
    (2, 3, 7, 9, 4, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 1),
    (3, 4, 11, 10, 6, 3, 2, (2, 1), (1, 0, 2, 1), (2, 1), 2),
    (2, 6, 9, 9, 6, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 6),      # depthwise
    (2, 8, 8, 8, 16, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),     # pointwise
    (3, 8, 5, 7, 12, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 4),     # grouped pointwise
    (2, 4, 9, 9, 8, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 4),
    (4, 16, 16, 16, 32, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1),  # large-ish
    # images in chunks of 2 (2, 2, 1), the columns [Kc, 2*HW] across each chunk's images
    (5, 128, 13, 13, 8, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 2),
    (3, 64, 40, 40, 16, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),  # pointwise, chunks of 2
    (8, 64, 2, 2, 64, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1),    # deep channels, 2x2 maps
    (2, 3, 9, 21, 4, 3, 3, (1, 1), (2, 1, 0, 2), (2, 2), 1),     # unit stride, dilated, 21 wide
    # pointwise with small maps: dX as ONE GEMM over the chunk's images, unpacked after
    (8, 64, 2, 2, 32, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),
    (3, 4096, 4, 8, 8, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),   # same, chunks of 2 images
    # ResNet's downsampling convs: 3x3 stride 2 and 1x1 stride 2, small maps
    (8, 32, 4, 4, 32, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 1),
    (4, 16, 8, 8, 24, 1, 1, (2, 2), (0, 0, 0, 0), (1, 1), 1),
    (2, 4, 6, 40, 4, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 1),      # stride 2, rows over 16 wide
    (2, 5, 12, 20, 6, 3, 3, (3, 3), (1, 2, 0, 1), (2, 1), 1),     # stride 3, dilated, odd pads
    (8, 256, 4, 4, 8, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1),     # room for 7 images: 4 + 4
]
CONV_OUTS = ["dX", "dW", "dBc", "dGamma", "dBeta"]


def _conv_attrs(strides, pads, dilations, group, relu=1):
    return dict(strides=list(strides), pads=list(pads), dilations=list(dilations), group=group,
                relu=relu)


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "x".join(map(str, c[:7])) + f"g{c[-1]}")
@pytest.mark.parametrize("relu", [1, 0])
def test_conv_bn_relu_grad_vs_reference(case, relu):
    *dims, strides, pads, dilations, group = case
    rng = _rng("conv", case, relu)
    ins = _conv_inputs(rng, *dims, strides, pads, dilations, group)
    got = run_fused("ConvBnReluGrad", list(ins.items()), [(o, F32) for o in CONV_OUTS],
                    **_conv_attrs(strides, pads, dilations, group, relu))
    ref = conv_bn_relu_grad(*ins.values(), strides=strides, pads=pads, dilations=dilations,
                              group=group, relu=relu)
    for g, r, nm in zip(got, ref, CONV_OUTS):
        assert_close(g, r, rtol=1e-3, atol_scale=1e-3, what=nm)


@pytest.mark.parametrize("case", [CONV_CASES[2], CONV_CASES[3], CONV_CASES[6],
                                  (2, 32, 32, 32, 8, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1)],
                         ids=["strided", "grouped", "grouped-pointwise", "two-chunks"])
@pytest.mark.parametrize("dy_dead", [True, False])
@pytest.mark.parametrize("present", [(1, 1, 1, 1, 1), (0, 0, 0, 0, 0)])
def test_conv_bn_relu_grad_dc_output_in_place(case, dy_dead, present):
    """Output 5 (dC, the working buffer fusecli always names) is the convolution-output gradient;
    onnxruntime puts it in dY's buffer when dY is dead after the node (in-place pair dY -> dC),
    and every output stays right. "two-chunks": each image's columns exceed the chunk budget, so
    the images go one at a time."""
    *dims, strides, pads, dilations, group = case
    rng = _rng("conv-dc", case, dy_dead, present)
    ins = _conv_inputs(rng, *dims, strides, pads, dilations, group)
    outs = [o if p else None for o, p in zip(CONV_OUTS, present)] + ["dC"]
    got, calls, inplace = _inplace_run("ConvBnReluGrad", list(ins.items()), outs, {"dY"},
                                       () if dy_dead else {"dY"},
                                       **_conv_attrs(strides, pads, dilations, group))
    ref = dict(zip(CONV_OUTS + ["dC"], conv_bn_relu_grad(
        *ins.values(), strides=strides, pads=pads, dilations=dilations, group=group)))
    for g, nm in zip(got, [o for o in outs if o]):
        assert_close(g, ref[nm], rtol=1e-3, atol_scale=1e-3, what=nm)
    assert (calls, inplace) == (1, 1 if dy_dead else 0)


@pytest.mark.parametrize("present", [
    (0, 1, 1, 1, 1),   # first conv: no dX
    (1, 1, 0, 1, 1),   # bias-free conv: no dBc
    (0, 1, 0, 1, 1),   # both
    (1, 0, 0, 0, 0),   # only dX
    (0, 0, 0, 1, 1),   # BN only
])
def test_conv_bn_relu_grad_optional_outputs(present):
    case = CONV_CASES[2]
    *dims, strides, pads, dilations, group = case
    rng = _rng("conv-opt", present)
    ins = _conv_inputs(rng, *dims, strides, pads, dilations, group)
    outs = [(o, F32) if p else None for o, p in zip(CONV_OUTS, present)]
    got = run_fused("ConvBnReluGrad", list(ins.items()), outs,
                    **_conv_attrs(strides, pads, dilations, group))
    ref = conv_bn_relu_grad(*ins.values(), strides=strides, pads=pads, dilations=dilations,
                              group=group)
    assert_requested(present, got, ref, CONV_OUTS, rtol=1e-3, atol_scale=1e-3)


def test_conv_bn_relu_grad_default_attributes():
    rng = _rng("conv-defaults")
    ins = _conv_inputs(rng, 2, 3, 6, 6, 4, 3, 3, (1, 1), (0, 0, 0, 0), (1, 1), 1)
    got = run_fused("ConvBnReluGrad", list(ins.items()), [(o, F32) for o in CONV_OUTS])
    ref = conv_bn_relu_grad(*ins.values())
    for g, r in zip(got, ref):
        assert_close(g, r, rtol=1e-3, atol_scale=1e-3)


def _conv_unfused_chain(ins, strides, pads, dilations, group):
    """ReluGrad -> BatchNormalizationGrad -> ConvGrad (com.microsoft, onnxruntime-training)."""
    w = ins["W"]
    nodes = [
        helper.make_node("ReluGrad", ["dY", "Y"], ["dZ"], domain="com.microsoft"),
        helper.make_node("BatchNormalizationGrad", ["dZ", "Cv", "gamma", "mean", "inv_std"],
                         ["dC", "dGamma", "dBeta"], domain="com.microsoft", epsilon=1e-5),
        helper.make_node("ConvGrad", ["dC", "X", "W"], ["dX", "dW", "dBc"], domain="com.microsoft",
                         strides=list(strides), pads=list(pads), dilations=list(dilations),
                         group=group, kernel_shape=list(w.shape[2:])),
    ]
    g_in = [helper.make_tensor_value_info(k, 1, list(v.shape)) for k, v in ins.items()]
    g_out = [helper.make_tensor_value_info(o, 1, None) for o in CONV_OUTS]
    graph = helper.make_graph(nodes, "conv_unfused", g_in, g_out)
    return helper.make_model(graph, ir_version=9, opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)])


def test_conv_bn_relu_grad_vs_unfused_ortt_chain_and_same_so_in_ortt():
    """The unfused com.microsoft chain in onnxruntime-training 1.19.2 vs the fused op, the fused
    op running in onnxruntime-training (same .so, API 16) and in this onnxruntime, and the
    kernel-call counter seen through ctypes in that process."""
    jobs, fused_here = [], []
    for case in (CONV_CASES[1], CONV_CASES[2], CONV_CASES[6], CONV_CASES[13], CONV_CASES[15]):
        *dims, strides, pads, dilations, group = case
        ins = _conv_inputs(_rng("conv-ortt", case), *dims, strides, pads, dilations, group)
        jobs.append(dict(model=_conv_unfused_chain(ins, strides, pads, dilations, group),
                         feeds=ins, outputs=CONV_OUTS))
        fused = fused_model("ConvBnReluGrad", list(ins.items()), [(o, F32) for o in CONV_OUTS],
                            **_conv_attrs(strides, pads, dilations, group))
        jobs.append(dict(model=fused, feeds=ins, outputs=CONV_OUTS, library=True,
                         count=["ConvBnReluGrad"]))
        fused_here.append(ort_session(fused).run(CONV_OUTS, ins))
    version, results, calls = run_in_ortt(jobs)
    assert version == "1.19.2"
    for i, here in enumerate(fused_here):
        unfused, fused_ortt = results[2 * i], results[2 * i + 1]
        assert calls[2 * i + 1] == {"ConvBnReluGrad": 1}
        for nm, u, f, h in zip(CONV_OUTS, unfused, fused_ortt, here):
            assert_close(f, u, rtol=1e-3, atol_scale=1e-3, what=f"case {i} {nm} fused vs unfused")
            # not bitwise: vectorized sums peel differently with the buffers' alignment
            assert_close(f, h, rtol=1e-5, atol_scale=1e-5, what=f"{nm}: same .so, two onnxruntimes")
