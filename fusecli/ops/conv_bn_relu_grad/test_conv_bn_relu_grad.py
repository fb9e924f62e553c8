"""ConvBnReluGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference
and against the unfused standard-ONNX subgraph it replaces, in onnxruntime with graph
optimizations off."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fusecli.ops.conv_bn_relu_grad.reference import conv_bn_relu_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (F32, OPSET, Builder, _built, _inplace_run, _rng, act_grad_subgraph,
                            assert_close, assert_requested, fused_model, ort_session, rand,
                            run_fused, run_in_ortt)


ACTS = ["relu", "relu6", "silu", "hardswish", "identity"]


def _act_input(rng, shape, activation):
    """Y as the activation gradient reads it, with values ON the kinks (ORT's Clip gradient
    keeps the bounds: 0 <= Z <= 6 for relu6, -3 <= Z <= 3 for hardswish's Z + 3)."""
    if activation == "relu":  # the ReLU output: >= 0, some exact zeros
        return np.maximum(rand(rng, shape), 0).astype(F32) + (rng.random(shape) < 0.1).astype(F32)
    if activation == "identity":
        return None
    z = rand(rng, shape, scale=4.0)  # the BN output, spread over every branch
    if activation == "relu6":
        z = z + 3.0
        z.flat[::7] = rng.choice([0.0, 6.0, -1e-7, 6.0000005], size=z.flat[::7].shape)
    elif activation == "hardswish":
        z.flat[::7] = rng.choice([-3.0, 3.0, -3.0000002, 3.0000002], size=z.flat[::7].shape)
    return z.astype(F32)


def _conv_inputs(rng, n, cin, hin, win, c, kh, kw, strides, pads, dilations, group,
                 activation="relu"):
    x = rand(rng, (n, cin, hin, win))
    w = rand(rng, (c, cin // group, kh, kw), scale=0.5)
    h = (hin + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    wd = (win + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    cv = rand(rng, (n, c, h, wd), scale=1.5) + 0.2
    mean = cv.mean(axis=(0, 2, 3)).astype(F32)
    inv_std = (1 / np.sqrt(cv.var(axis=(0, 2, 3)) + 1e-5)).astype(F32)
    gamma = rand(rng, (c,), positive=True)
    y = _act_input(rng, cv.shape, activation)
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


def _conv_attrs(strides, pads, dilations, group, activation="relu"):
    return dict(strides=list(strides), pads=list(pads), dilations=list(dilations), group=group,
                activation=activation)


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "x".join(map(str, c[:7])) + f"g{c[-1]}")
@pytest.mark.parametrize("activation", ["relu", "identity"])
def test_conv_bn_relu_grad_vs_reference(case, activation):
    *dims, strides, pads, dilations, group = case
    rng = _rng("conv", case, activation)
    ins = _conv_inputs(rng, *dims, strides, pads, dilations, group, activation)
    got = run_fused("ConvBnReluGrad", list(ins.items()), [(o, F32) for o in CONV_OUTS],
                    **_conv_attrs(strides, pads, dilations, group, activation))
    ref = conv_bn_relu_grad(*ins.values(), strides=strides, pads=pads, dilations=dilations,
                              group=group, activation=activation)
    for g, r, nm in zip(got, ref, CONV_OUTS):
        assert_close(g, r, rtol=1e-3, atol_scale=1e-3, what=nm)


# MobileNet-style convolutions: depthwise 3x3 (stride 1 and 2), pointwise expand/project,
# grouped, a dense stem with a conv bias; every activation on each
ACT_CASES = [
    (2, 3, 9, 9, 8, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 1),      # stem, stride 2
    (2, 8, 8, 8, 8, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 8),      # depthwise
    (3, 12, 9, 7, 12, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 12),   # depthwise, stride 2
    (2, 8, 6, 6, 24, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),     # pointwise expand
    (2, 12, 5, 5, 8, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 4),     # grouped
    (5, 128, 13, 13, 8, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 2),  # image chunks
    (3, 16, 7, 7, 16, 5, 5, (1, 1), (2, 2, 2, 2), (1, 1), 16),   # depthwise 5x5
    (2, 6, 11, 10, 6, 3, 3, (2, 1), (1, 0, 2, 1), (2, 1), 6),    # depthwise, odd geometry
    (2, 5, 9, 40, 5, 3, 3, (3, 2), (1, 1, 0, 2), (1, 2), 5),     # depthwise, strides 3 / 2
]


@pytest.mark.parametrize("case", ACT_CASES, ids=lambda c: "x".join(map(str, c[:7])) + f"g{c[-1]}")
@pytest.mark.parametrize("activation", ACTS)
def test_conv_bn_act_grad_vs_reference(case, activation):
    *dims, strides, pads, dilations, group = case
    rng = _rng("conv-act", case, activation)
    ins = _conv_inputs(rng, *dims, strides, pads, dilations, group, activation)
    got = run_fused("ConvBnReluGrad", list(ins.items()), [(o, F32) for o in CONV_OUTS + ["dC"]],
                    **_conv_attrs(strides, pads, dilations, group, activation))
    ref = conv_bn_relu_grad(*ins.values(), strides=strides, pads=pads, dilations=dilations,
                              group=group, activation=activation)
    for g, r, nm in zip(got, ref, CONV_OUTS + ["dC"]):
        assert_close(g, r, rtol=1e-3, atol_scale=1e-3, what=nm)


def test_act_grad_reference_on_the_kinks():
    """The reference's activation derivatives, written out by hand at and around the kinks
    (onnxruntime-training's Clip gradient keeps both bounds)."""
    from fusecli.ops.conv_bn_relu_grad.reference import act_grad
    d = np.ones(9)
    z6 = np.array([-1.0, -1e-7, 0.0, 1e-7, 3.0, 6.0 - 1e-6, 6.0, 6.0 + 1e-6, 9.0])
    np.testing.assert_array_equal(act_grad(d, z6, "relu6"), [0, 0, 1, 1, 1, 1, 1, 0, 0])
    zh = np.array([-5.0, -3.0 - 1e-6, -3.0, -1.5, 0.0, 1.5, 3.0, 3.0 + 1e-6, 5.0])
    np.testing.assert_allclose(act_grad(d, zh, "hardswish"),
                               [0, 0, -0.5, 0.0, 0.5, 1.0, 1.5, 1, 1])
    np.testing.assert_allclose(act_grad(2 * d, zh, "identity"), 2 * d)


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


def _act_grad_nodes(activation):
    """The activation gradient dY -> dZ as onnxruntime-training 1.19.2's generate_artifacts
    writes it (constants c0, c3, c6 are graph inputs fed 0, 3, 6)."""
    ms = dict(domain="com.microsoft")
    mask = [  # Clip's gradient: the bounds kept
        helper.make_node("GreaterOrEqual", ["A", "c0"], ["ge"]),
        helper.make_node("LessOrEqual", ["A", "c6"], ["le"]),
        helper.make_node("And", ["ge", "le"], ["m"]),
        helper.make_node("Cast", ["m"], ["mf"], to=1)]
    if activation == "relu":
        return [helper.make_node("ReluGrad", ["dY", "Y"], ["dZ"], **ms)]
    if activation == "silu":
        return [helper.make_node("QuickGeluGrad", ["dY", "Y"], ["dZ"], alpha=1.0, **ms)]
    if activation == "relu6":
        return [helper.make_node("Identity", ["Y"], ["A"]), *mask,
                helper.make_node("Mul", ["dY", "mf"], ["dZ"])]
    if activation == "hardswish":  # z * relu6(z + 3) / 6, its product-rule backward
        return [helper.make_node("Add", ["Y", "c3"], ["A"]),
                helper.make_node("Clip", ["A", "c0", "c6"], ["Cl"]),
                helper.make_node("Div", ["dY", "c6"], ["dM"]),
                helper.make_node("Mul", ["dM", "Cl"], ["dZ1"]),
                helper.make_node("Mul", ["dM", "Y"], ["dCl"]), *mask,
                helper.make_node("Mul", ["dCl", "mf"], ["dA"]),
                helper.make_node("Sum", ["dA", "dZ1"], ["dZ"])]
    assert activation == "identity"
    return [helper.make_node("Identity", ["dY"], ["dZ"])]


def _conv_unfused_chain(ins, strides, pads, dilations, group, activation="relu", present=None):
    """activation gradient -> BatchNormalizationGrad -> ConvGrad (com.microsoft,
    onnxruntime-training); `present`: which of CONV_OUTS the graph reads. ConvGrad writes ''
    for the others (as generate_artifacts does for a frozen weight); BatchNormalizationGrad's
    dGamma/dBeta are not optional in onnxruntime-training, a frozen BN affine leaves them
    unread."""
    w = ins["W"]
    outs = [o if p else "" for o, p in zip(CONV_OUTS, present or [1] * 5)]
    bn_outs = [o or f"unread_{i}" for i, o in enumerate(outs[3:])]
    nodes = _act_grad_nodes(activation) + [
        helper.make_node("BatchNormalizationGrad", ["dZ", "Cv", "gamma", "mean", "inv_std"],
                         ["dC", *bn_outs], domain="com.microsoft", epsilon=1e-5),
        helper.make_node("ConvGrad", ["dC", "X", "W"], outs[:3], domain="com.microsoft",
                         strides=list(strides), pads=list(pads), dilations=list(dilations),
                         group=group, kernel_shape=list(w.shape[2:])),
    ]
    g_in = [helper.make_tensor_value_info(k, 1, list(v.shape)) for k, v in ins.items()
            if v is not None]
    if activation in ("relu6", "hardswish"):
        g_in += [helper.make_tensor_value_info(c, 1, []) for c in ("c0", "c3", "c6")]
    g_out = [helper.make_tensor_value_info(o, 1, None) for o in outs if o]
    graph = helper.make_graph(nodes, "conv_unfused", g_in, g_out)
    return helper.make_model(graph, ir_version=9, opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.ortt
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


# (activation, case, outputs present): every activation, depthwise / grouped / dense, and the
# frozen spellings: conv weight frozen (no dW), BN affine frozen (no dGamma, dBeta), both, the
# first layer (no dX), a conv with bias (dBc)
UNFUSED_ACT_CASES = [
    ("relu6", ACT_CASES[1], (1, 1, 0, 1, 1)),
    ("relu6", ACT_CASES[0], (0, 1, 1, 1, 1)),
    ("relu6", ACT_CASES[3], (1, 0, 0, 1, 1)),
    ("silu", ACT_CASES[2], (1, 1, 0, 1, 1)),
    ("silu", ACT_CASES[4], (1, 1, 1, 0, 0)),
    ("hardswish", ACT_CASES[1], (1, 1, 0, 1, 1)),
    ("hardswish", ACT_CASES[3], (1, 0, 0, 0, 0)),
    ("identity", ACT_CASES[3], (1, 1, 0, 1, 1)),
    ("relu", ACT_CASES[1], (1, 0, 0, 0, 0)),
]


@pytest.mark.ortt
def test_conv_bn_act_grad_vs_unfused_ortt_chain():
    """Each activation's unfused onnxruntime-training chain (ReluGrad, the Clip-gradient mask,
    QuickGeluGrad, hardswish's product rule, none) + BatchNormalizationGrad + ConvGrad computing
    only some outputs, against the fused op asked for the same outputs, both in
    onnxruntime-training 1.19.2; the fused op also against the reference."""
    jobs, refs = [], []
    consts = {"c0": np.array(0, F32), "c3": np.array(3, F32), "c6": np.array(6, F32)}
    for activation, case, present in UNFUSED_ACT_CASES:
        *dims, strides, pads, dilations, group = case
        ins = _conv_inputs(_rng("conv-ortt-act", activation, case), *dims, strides, pads,
                           dilations, group, activation)
        names = [o for o, p in zip(CONV_OUTS, present) if p]
        feeds = {k: v for k, v in ins.items() if v is not None}
        chain_feeds = dict(feeds, **consts) if activation in ("relu6", "hardswish") else feeds
        jobs.append(dict(model=_conv_unfused_chain(ins, strides, pads, dilations, group,
                                                   activation, present),
                         feeds=chain_feeds, outputs=names))
        outs = [(o, F32) if p else None for o, p in zip(CONV_OUTS, present)]
        fused = fused_model("ConvBnReluGrad", list(ins.items()), outs,
                            **_conv_attrs(strides, pads, dilations, group, activation))
        jobs.append(dict(model=fused, feeds=feeds, outputs=names, library=True,
                         count=["ConvBnReluGrad"]))
        ref = dict(zip(CONV_OUTS, conv_bn_relu_grad(
            *ins.values(), strides=strides, pads=pads, dilations=dilations, group=group,
            activation=activation)))
        refs.append([ref[o] for o in names])
    version, results, calls = run_in_ortt(jobs)
    assert version == "1.19.2"
    for i, (activation, case, present) in enumerate(UNFUSED_ACT_CASES):
        unfused, fused = results[2 * i], results[2 * i + 1]
        assert calls[2 * i + 1] == {"ConvBnReluGrad": 1}
        names = [o for o, p in zip(CONV_OUTS, present) if p]
        assert len(unfused) == len(fused) == len(names)
        for nm, u, f, r in zip(names, unfused, fused, refs[i]):
            what = f"{activation} {case} {nm}"
            assert_close(f, u, rtol=1e-3, atol_scale=1e-3, what=what + " fused vs unfused")
            assert_close(f, r, rtol=1e-3, atol_scale=1e-3, what=what + " fused vs reference")
def _stock_act_grad(b, dy, y, activation):
    """dY -> dZ from standard ops: ReLU's and SiLU's gradients as kernel_helpers spells them,
    relu6's and hardswish's as the Clip-gradient mask above (0 <= Z <= 6 kept)."""
    if activation in ("relu", "silu", "identity"):
        return act_grad_subgraph(b, dy, y, activation)
    a = y if activation == "relu6" else b.add(y, b.const(3.0))
    mf = b.op("Cast", b.op("And", b.op("GreaterOrEqual", a, b.const(0.0)),
                           b.op("LessOrEqual", a, b.const(6.0))), to=1)
    if activation == "relu6":
        return b.mul(dy, mf)
    dm = b.op("Div", dy, b.const(6.0))
    return b.add(b.mul(b.mul(dm, y), mf), b.mul(dm, b.op("Clip", a, b.const(0.0), b.const(6.0))))


def _conv_stock_chain(ins, strides, pads, dilations, group, activation="relu", present=None):
    """(model, feeds, outputs): the backward of Conv -> BatchNormalization (training statistics
    mean, inv_std) -> activation in STANDARD ops only, for stock onnxruntime (no ConvGrad /
    BatchNormalizationGrad there): the activation gradient, the BN gradient written out
    (ReduceSum, Mul, Sub), dX as ConvTranspose(dC, W) (output_padding to X's size), dW as the
    convolution of X with dC over the batch (per group: batch and channel axes swapped, strides
    and dilations exchanged, cut to the kernel size), dBc = ReduceSum(dC)."""
    x, w, cv = ins["X"], ins["W"], ins["Cv"]
    n, cin, hin, win = x.shape
    cout, cin_g, kh, kw = w.shape
    ho, wo = cv.shape[2:]
    b = Builder()
    dy = b.input("dY", ins["dY"])
    y = b.input("Y", ins["Y"]) if ins["Y"] is not None else None
    xn, wn, cvn = b.input("X", x), b.input("W", w), b.input("Cv", cv)
    shp = b.ints([1, cout, 1, 1])
    gam, mean, istd = (b.op("Reshape", b.input(k, ins[k]), shp) for k in ("gamma", "mean", "inv_std"))
    dz = _stock_act_grad(b, dy, y, activation)
    axes = b.ints([0, 2, 3])
    xhat = b.mul(b.sub(cvn, mean), istd)
    dbeta = b.op("ReduceSum", dz, axes, keepdims=1)
    dgamma = b.op("ReduceSum", b.mul(dz, xhat), axes, keepdims=1)
    r = float(n * ho * wo)
    coef = b.op("Div", b.mul(gam, istd), b.const(r))
    dc = b.mul(coef, b.sub(b.sub(b.mul(dz, b.const(r)), dbeta), b.mul(xhat, dgamma)))
    eff = [(kh - 1) * dilations[0] + 1, (kw - 1) * dilations[1] + 1]
    opad = [size + pads[i] + pads[i + 2] - (o - 1) * strides[i] - eff[i]
            for i, (size, o) in enumerate([(hin, ho), (win, wo)])]
    dx = b.op("ConvTranspose", dc, wn, strides=list(strides), pads=list(pads),
              dilations=list(dilations), group=group, output_padding=opad,
              kernel_shape=[kh, kw])
    cout_g = cout // group
    xs = b.op("Split", xn, b.ints([cin_g] * group), axis=1, n_out=group) if group > 1 else [xn]
    dcs = b.op("Split", dc, b.ints([cout_g] * group), axis=1, n_out=group) if group > 1 else [dc]
    dws = []
    for xg, dcg in zip(xs, dcs):
        wg = b.op("Conv", b.op("Transpose", xg, perm=[1, 0, 2, 3]),
                  b.op("Transpose", dcg, perm=[1, 0, 2, 3]), strides=list(dilations),
                  dilations=list(strides), pads=list(pads))       # [cin_g, cout_g, >=kh, >=kw]
        wg = b.op("Slice", wg, b.ints([0, 0]), b.ints([kh, kw]), b.ints([2, 3]))
        dws.append(b.op("Transpose", wg, perm=[1, 0, 2, 3]))
    dw = b.op("Concat", *dws, axis=0) if group > 1 else dws[0]
    dbc = b.op("ReduceSum", dc, axes, keepdims=0)
    flat = b.ints([cout])
    outs = dict(dX=dx, dW=dw, dBc=dbc, dGamma=b.op("Reshape", dgamma, flat),
                dBeta=b.op("Reshape", dbeta, flat))
    names = [o for o, p in zip(CONV_OUTS, present or [1] * 5) if p]
    return b, [outs[o] for o in names], names


# the cases the onnxruntime-training tests above run, for the standard-op chain in stock
# onnxruntime (ARM64 has no onnxruntime-training: `make test-arm64` runs these instead)
STOCK_CASES = [("relu", CONV_CASES[i], (1, 1, 1, 1, 1)) for i in (1, 2, 6, 13, 15)] + \
    UNFUSED_ACT_CASES


@pytest.mark.parametrize("activation,case,present", STOCK_CASES,
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v[:7])))
def test_conv_bn_act_grad_vs_unfused_standard_op_chain(activation, case, present):
    """The fused op against the unfused backward of Conv -> BN -> activation written in
    standard ops (_conv_stock_chain), both in stock onnxruntime, and against the reference:
    every activation, dense / grouped / depthwise, the frozen spellings (outputs absent)."""
    *dims, strides, pads, dilations, group = case
    ins = _conv_inputs(_rng("conv-stock", activation, case), *dims, strides, pads, dilations,
                       group, activation)
    b, outs, names = _conv_stock_chain(ins, strides, pads, dilations, group, activation, present)
    unfused = b.run(outs)
    got = run_fused("ConvBnReluGrad", list(ins.items()),
                    [(o, F32) if p else None for o, p in zip(CONV_OUTS, present)],
                    **_conv_attrs(strides, pads, dilations, group, activation))
    ref = dict(zip(CONV_OUTS, conv_bn_relu_grad(
        *ins.values(), strides=strides, pads=pads, dilations=dilations, group=group,
        activation=activation)))
    got = [g for g in got if g is not None]
    assert len(got) == len(unfused) == len(names)
    for nm, g, u in zip(names, got, unfused):
        assert_close(u, ref[nm], rtol=1e-3, atol_scale=1e-3, what=f"{nm}: unfused vs reference")
        assert_close(g, u, rtol=1e-3, atol_scale=1e-3, what=f"{nm}: fused vs unfused")
        assert_close(g, ref[nm], rtol=1e-3, atol_scale=1e-3, what=f"{nm}: fused vs reference")
