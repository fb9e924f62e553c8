"""Small synthetic training-graph fragments, built the way each exporter spells them.

Used as rule fixtures: one positive fixture per rule variant and one negative fixture per guard.
Every builder returns a ModelProto that passes onnx.checker (custom/training domains aside).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"
F = TensorProto.FLOAT


# onnxruntime-training's activation-gradient ops (gelu_fast: FastGeluGrad, the backward of the
# FastGelu that ORT's pre-gradient fusion makes of Hugging Face's gelu_new; quick_gelu:
# QuickGeluGrad{alpha=1.702}, the backward of CLIP's x * sigmoid(1.702 x), silu: alpha=1)
ORTT_ACT_GRAD = {"relu": "ReluGrad", "gelu": "GeluGrad", "silu": "QuickGeluGrad",
                 "gelu_fast": "FastGeluGrad", "quick_gelu": "QuickGeluGrad"}
ORTT_ACT_ATTRS = {"silu": {"alpha": 1.0}, "quick_gelu": {"alpha": 1.702}}


def vi(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def model(nodes, inputs, outputs, initializers=(), opset=17, ms=True, ir=9):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    ops = [helper.make_opsetid("", opset)]
    if ms:
        ops.append(helper.make_opsetid(MS, 1))
    m = helper.make_model(g, opset_imports=ops)
    m.ir_version = ir
    return m


def const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def ortt_linear_act(act="relu", *, first=False, bias=True, identity=True, frozen_w=False, M=6,
                    N=5, K=4, extra=None):
    """onnxruntime-training backward of Gemm(transB=1)+activation. frozen_w: no weight
    gradient (requires_grad without the weight), so no weight-grad Gemm and no A input.

    extra: None | "consumer" (dZ also feeds an outside node) | "graph_output" (dZ is an output)
           | "wrong_attr" (weight Gemm transA=0) | "wrong_const" (ReduceSum over axis 1)
           | "wrong_domain" (activation grad in the default domain)
    """
    op = ORTT_ACT_GRAD[act]
    kw = ORTT_ACT_ATTRS.get(act, {})
    domain = "" if extra == "wrong_domain" else MS
    nodes = [helper.make_node(op, ["dY", "X"], ["dZ"], name="act_grad", domain=domain, **kw)]
    outputs = [] if frozen_w else [vi("dW", [N, K])]
    inits = []
    if bias:
        inits.append(const("axes0", [1] if extra == "wrong_const" else [0], np.int64))
        nodes.append(helper.make_node("ReduceSum", ["dZ", "axes0"],
                                      ["db_raw" if identity else "db"], keepdims=0,
                                      name="bgrad"))
        if identity:
            nodes.append(helper.make_node("Identity", ["db_raw"], ["db"], name="bgrad_id"))
        outputs.append(vi("db", [N] if extra != "wrong_const" else [M]))
    if not frozen_w:
        nodes.append(helper.make_node("Gemm", ["dZ", "A"], ["dW"], name="wgrad",
                                      transA=0 if extra == "wrong_attr" else 1, transB=0,
                                      beta=0.0))
    if not first:
        nodes.append(helper.make_node("Gemm", ["dZ", "W"], ["dA"], name="dgrad",
                                      transA=1 if extra == "wrong_attr" and frozen_w else 0))
        outputs.append(vi("dA", [M, K]))
    if extra == "consumer":
        nodes.append(helper.make_node("Neg", ["dZ"], ["dZ_neg"], name="outside"))
        outputs.append(vi("dZ_neg", [M, N]))
    if extra == "graph_output":
        outputs.append(vi("dZ", [M, N]))
    inputs = [vi("dY", [M, N]), vi("X", [M, N])] + ([] if frozen_w else [vi("A", [M, K])])
    if not first:
        inputs.append(vi("W", [N, K]))
    return model(nodes, inputs, outputs, inits)


# --- composable fragments (prefixed tensor names, several per graph) -------------------------
# Each returns a Fragment: nodes, graph inputs/outputs, initializers, and the intermediates a
# fusion removes. ``critical`` intermediates block the fusion when something outside reads them
# (or they are graph outputs); ``soft`` ones only shrink it (an optional/passthrough rule node
# then stays outside and the rest still fuses).

class Fragment:
    def __init__(self, kind, prefix, nodes, inputs, outputs, inits, critical, soft, anchor,
                 dy, out_grad, shapes=None):
        self.kind = kind
        self.shapes = dict(shapes or {})  # intermediates' shapes (declared tensors carry theirs)
        self.prefix = prefix
        self.nodes = nodes
        self.inputs = inputs
        self.outputs = outputs
        self.inits = inits
        self.critical = critical          # intermediates whose outside use blocks the fusion
        self.soft = soft                  # intermediates whose outside use only shrinks it
        self.anchor = anchor              # name of the node that disappears when fused
        self.dy = dy                      # name of the incoming gradient (a graph input)
        self.out_grad = out_grad          # outgoing gradient (may feed another fragment) or None

    @property
    def tensors(self) -> list[str]:
        seen = []
        for n in self.nodes:
            for t in list(n.input) + list(n.output):
                if t and t not in seen:
                    seen.append(t)
        return seen


def frag_ortt_linear_act(p, act="relu", *, first=False, bias=True, identity=True, M=6, N=5,
                         K=4):
    """ortt_linear_act as a fragment with tensor/node names prefixed by ``p``."""
    op = {"relu": "ReluGrad", "gelu": "GeluGrad", "silu": "QuickGeluGrad"}[act]
    kw = {"alpha": 1.0} if act == "silu" else {}
    t = lambda s: f"{p}{s}"  # noqa: E731
    nodes = [helper.make_node(op, [t("dY"), t("X")], [t("dZ")], name=t("act_grad"), domain=MS,
                              **kw)]
    outputs = [vi(t("dW"), [N, K])]
    inits = []
    soft = []
    if bias:
        inits.append(const(t("axes0"), [0], np.int64))
        nodes.append(helper.make_node("ReduceSum", [t("dZ"), t("axes0")],
                                      [t("db_raw") if identity else t("db")], name=t("bgrad"),
                                      keepdims=0))
        if identity:
            nodes.append(helper.make_node("Identity", [t("db_raw")], [t("db")], name=t("bid")))
            soft.append(t("db_raw"))
        outputs.append(vi(t("db"), [N]))
    nodes.append(helper.make_node("Gemm", [t("dZ"), t("A")], [t("dW")], name=t("wgrad"),
                                  transA=1, transB=0, beta=0.0))
    out_grad = None
    if not first:
        nodes.append(helper.make_node("Gemm", [t("dZ"), t("W")], [t("dA")], name=t("dgrad")))
        outputs.append(vi(t("dA"), [M, K]))
        out_grad = t("dA")
    inputs = [vi(t("dY"), [M, N]), vi(t("X"), [M, N]), vi(t("A"), [M, K]), vi(t("W"), [N, K])]
    return Fragment(f"linear_{act}", p, nodes, inputs, outputs, inits, [t("dZ")], soft,
                    t("act_grad"), t("dY"), out_grad,
                    shapes={t("dZ"): [M, N], t("db_raw"): [N], t("db"): [N]})


def frag_ortt_layernorm(p, *, residual=True, B=4, D=8):
    """onnxruntime-training LayerNormalizationGrad (+ the residual-gradient Sum), as in
    samples/ortt_block.onnx nodes 63-65."""
    t = lambda s: f"{p}{s}"  # noqa: E731
    dx0 = t("dX0") if residual else t("dX")
    nodes = [helper.make_node("LayerNormalizationGrad",
                              [t("dY"), t("X"), t("gamma"), t("mean"), t("inv_std")],
                              [dx0, t("dGamma"), t("dBeta")], name=t("ln_grad"), domain=MS,
                              axis=-1, epsilon=1e-5)]
    inputs = [vi(t("dY"), [B, D]), vi(t("X"), [B, D]), vi(t("gamma"), [D]),
              vi(t("mean"), [B, 1]), vi(t("inv_std"), [B, 1])]
    soft = []
    if residual:
        nodes.append(helper.make_node("Sum", [t("dR"), dx0], [t("dX")], name=t("acc")))
        inputs.append(vi(t("dR"), [B, D]))
        soft.append(dx0)
    outputs = [vi(t("dX"), [B, D]), vi(t("dGamma"), [D]), vi(t("dBeta"), [D])]
    return Fragment("layernorm", p, nodes, inputs, outputs, [], [], soft, t("ln_grad"), t("dY"),
                    None, shapes={dx0: [B, D]})


def compose(fragments, extra_nodes=(), extra_outputs=(), opset=17):
    """One model from several fragments (+ distractor nodes and extra graph outputs)."""
    nodes, inputs, outputs, inits = [], [], [], []
    for f in fragments:
        nodes += f.nodes
        inputs += f.inputs
        outputs += f.outputs
        inits += f.inits
    nodes += list(extra_nodes)
    outputs += list(extra_outputs)
    return model(nodes, inputs, outputs, inits, opset=opset)


def ortt_linear_act_matmul(act="silu", *, three_d=True, bias=True, first=False, frozen_w=False,
                           B=2, S=3, N=5, K=4):
    """onnxruntime-training backward of Transpose(W) + MatMul (+ Add) + activation, as in the
    transformer MLP (3-D, FusedMatMul, Reshape to 2-D for the weight grad) or a 2-D bias-free
    layer (Gemm with transB=1 for the input grad). frozen_w: no weight gradient (no weight-grad
    Gemm, no A)."""
    op = ORTT_ACT_GRAD[act]
    kw = ORTT_ACT_ATTRS.get(act, {})
    lead = [B, S] if three_d else [B * S]
    nodes = [helper.make_node(op, ["dY", "X"], ["dZ"], name="act_grad", domain=MS, **kw)]
    inits = []
    outputs = [] if frozen_w else [vi("dWt", [K, N])]
    if three_d:
        nodes.append(helper.make_node("Identity", ["dZ"], ["dZm"], name="add_grad_id"))
        if not frozen_w:
            inits += [const("shape_dz", [-1, N], np.int64), const("shape_a", [-1, K], np.int64)]
            nodes += [helper.make_node("Reshape", ["dZm", "shape_dz"], ["dZ2"], name="flat_dz"),
                      helper.make_node("Reshape", ["A", "shape_a"], ["A2"], name="flat_a"),
                      helper.make_node("Gemm", ["A2", "dZ2"], ["dWt"], name="wgrad", transA=1,
                                       beta=1.0)]
        src = "dZm"
    else:
        if not frozen_w:
            nodes.append(helper.make_node("Gemm", ["A", "dZ"], ["dWt"], name="wgrad", transA=1,
                                          transB=0, beta=0.0))
        src = "dZ"
    if bias:
        inits.append(const("axes", list(range(len(lead))), np.int64))
        nodes.append(helper.make_node("ReduceSum", ["dZ", "axes"], ["dB"], name="bgrad",
                                      keepdims=0))
        outputs.append(vi("dB", [N]))
    if not first:
        if three_d:
            nodes.append(helper.make_node("FusedMatMul", [src, "Wt"], ["dA"], name="dgrad",
                                          domain=MS, transA=0, transB=1, alpha=1.0,
                                          transBatchA=0, transBatchB=0))
        else:
            nodes.append(helper.make_node("Gemm", [src, "Wt"], ["dA"], name="dgrad", transA=0,
                                          transB=1, beta=0.0))
        outputs.append(vi("dA", lead + [K]))
    inputs = [vi("dY", lead + [N]), vi("X", lead + [N])]
    inputs += ([] if frozen_w else [vi("A", lead + [K])]) + ([] if first else [vi("Wt", [K, N])])
    return model(nodes, inputs, outputs, inits)


def ortt_linear_act_gemm2d(act="relu", *, bias=True, first=False, frozen_w=False, B=2, S=3, N=5,
                           K=4):
    """onnxruntime-training backward of a 3-D Linear exported as Gemm on a 2-D Reshape of its
    input, W [in, out] (Hugging Face Conv1D through addmm, GPT-2's MLP), + activation: the
    activation gradient (3-D) -> Reshape [-1, N] -> dZ2, which the bias ReduceSum(axes [0]), the
    weight grad Gemm(A2, dZ2, transA=1) -> [K, N] and the input grad Gemm(dZ2, W, transB=1)
    -> [B*S, K] all read; A2 is the forward's 2-D view of the input. frozen_w: no weight
    gradient (no weight-grad Gemm, no A2)."""
    op = ORTT_ACT_GRAD[act]
    kw = ORTT_ACT_ATTRS.get(act, {})
    nodes = [helper.make_node(op, ["dY", "X"], ["dZ"], name="act_grad", domain=MS, **kw),
             helper.make_node("Reshape", ["dZ", "shape_dz"], ["dZ2"], name="flat_dz")]
    if not frozen_w:
        nodes.append(helper.make_node("Gemm", ["A2", "dZ2"], ["dW"], name="wgrad", transA=1,
                                      transB=0, alpha=1.0, beta=0.0))
    inits = [const("shape_dz", [-1, N], np.int64)]
    outputs = [] if frozen_w else [vi("dW", [K, N])]
    if bias:
        inits.append(const("axes", [0], np.int64))
        nodes.append(helper.make_node("ReduceSum", ["dZ2", "axes"], ["dB"], name="bgrad",
                                      keepdims=0, noop_with_empty_axes=0))
        outputs.append(vi("dB", [N]))
    if not first:
        nodes.append(helper.make_node("Gemm", ["dZ2", "W"], ["dA2"], name="dgrad", transA=0,
                                      transB=1, alpha=1.0, beta=0.0))
        outputs.append(vi("dA2", [B * S, K]))
    inputs = [vi("dY", [B, S, N]), vi("X", [B, S, N])]
    inputs += ([] if frozen_w else [vi("A2", [B * S, K])]) + ([] if first else [vi("W", [K, N])])
    return model(nodes, inputs, outputs, inits)


def ortt_attention(*, kv_heads=2, heads=2, scale_op="Div", B=2, S=4, D=3, record_backward=False):
    """ort-training attention backward, softmax(Q K^T / c) V with K^T [B, Hkv, D, S] and
    V [B, Hkv, S, D] fed to the score/value MatMuls. With kv_heads=1 < heads (multi-query
    attention, K/V broadcast inside the MatMuls) onnxruntime computes dK^T and dV at the full
    head count and sums them over the head axis afterwards (ReduceSum keepdims=1). Only the
    forward tensors' shapes are recorded (as in real artifacts) unless record_backward.
    scale_op: "Div" (by sqrt(D)) or "Mul" (by 1/sqrt(D), the Llama spelling)."""
    c = float(np.sqrt(D)) if scale_op == "Div" else float(1 / np.sqrt(D))
    q, kt, v = [B, heads, S, D], [B, kv_heads, D, S], [B, kv_heads, S, D]
    p = [B, heads, S, S]
    mm = dict(domain=MS, alpha=1.0)
    nodes = [
        helper.make_node("MatMul", ["Q", "Kt"], ["scores"], name="qk"),
        helper.make_node(scale_op, ["scores", "c"], ["scaled"], name="fwd_scale"),
        helper.make_node("Softmax", ["scaled"], ["P"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["P", "V"], ["O"], name="pv"),
        helper.make_node("FusedMatMul", ["P", "dO"], ["dV_full"], transA=1, transB=0,
                         name="dv", **mm),
        helper.make_node("FusedMatMul", ["dO", "V"], ["dP"], transA=0, transB=1, name="dp",
                         **mm),
        helper.make_node("SoftmaxGrad_13", ["dP", "P"], ["dS0"], axis=-1, domain=MS, name="sg"),
        helper.make_node(scale_op, ["dS0", "c"], ["dS"], name="bwd_scale"),
        helper.make_node("FusedMatMul", ["dS", "Kt"], ["dQ"], transA=0, transB=1, name="dq",
                         **mm),
        helper.make_node("FusedMatMul", ["Q", "dS"], ["dKt_full"], transA=1, transB=0,
                         name="dk", **mm),
    ]
    outputs = [vi("O", q), vi("dQ", q)]
    if kv_heads == heads:
        nodes[4].output[0], nodes[9].output[0] = "dV", "dKt"
    else:
        nodes += [helper.make_node("ReduceSum", ["dV_full", "head_axis"], ["dV"], keepdims=1,
                                   name="sum_dv"),
                  helper.make_node("ReduceSum", ["dKt_full", "head_axis"], ["dKt"], keepdims=1,
                                   name="sum_dk")]
    outputs += [vi("dKt", kt), vi("dV", v)]
    value_info = [vi("scores", p), vi("scaled", p), vi("P", p)]
    if record_backward:
        value_info += [vi("dP", p), vi("dS0", p), vi("dS", p)]
    m = model(nodes, [vi("Q", q), vi("Kt", kt), vi("V", v), vi("dO", q)], outputs,
              [const("c", c), const("head_axis", [1], np.int64)])
    m.graph.value_info.extend(value_info)
    return m


def ortt_attention_3d(*, dropout=False, p_rows=None, B=2, H=2, S=4, D=3):
    """BLOOM's ort-training spelling: S3 = MatMul(Q3, K3^T) [B*H, S, S] -> Mul(c) -> Reshape
    [B, H, S, S] -> Add(mask) -> Softmax -> [Dropout ->] Reshape [B*H, S, S] -> MatMul(., V3);
    backward FusedMatMul(dO, V3) -> Reshape -> [DropoutGrad ->] SoftmaxGrad_13 -> Identity (the
    mask Add) -> Reshape -> Mul(c) -> FusedMatMul x2. p_rows: view P as [B*H, p_rows, S*S //
    p_rows] instead (its rows are no softmax rows; V3 then has S*S // p_rows rows)."""
    bh = B * H
    pr = S if p_rows is None else p_rows
    pc = S * S // pr
    c = float(1 / np.sqrt(D))
    mm = dict(domain=MS, alpha=1.0)
    p_in = "Pd" if dropout else "P0"
    dp_out = "dPd" if dropout else "dP0"
    nodes = [
        helper.make_node("MatMul", ["Q", "Kt"], ["S3"], name="qk"),
        helper.make_node("Mul", ["S3", "c"], ["S3s"], name="fwd_scale"),
        helper.make_node("Reshape", ["S3s", "shape4"], ["S4"], name="fwd_view_s"),
        helper.make_node("Add", ["S4", "mask"], ["Sm"], name="fwd_mask"),
        helper.make_node("Softmax", ["Sm"], ["P0"], axis=-1, name="softmax"),
        helper.make_node("Reshape", [p_in, "shape_p"], ["P3"], name="fwd_view_p"),
        helper.make_node("MatMul", ["P3", "V"], ["O"], name="pv"),
        helper.make_node("FusedMatMul", ["P3", "dO"], ["dV"], transA=1, transB=0, name="dv", **mm),
        helper.make_node("FusedMatMul", ["dO", "V"], ["dP3"], transA=0, transB=1, name="dp", **mm),
        helper.make_node("Reshape", ["dP3", "shape4"], [dp_out], name="bwd_view_p"),
        helper.make_node("SoftmaxGrad_13", ["dP0", "P0"], ["dS0"], axis=-1, domain=MS, name="sg"),
        helper.make_node("Identity", ["dS0"], ["dS4"], name="bwd_mask"),
        helper.make_node("Reshape", ["dS4", "shape3"], ["dS3"], name="bwd_view_s"),
        helper.make_node("Mul", ["dS3", "c"], ["dS"], name="bwd_scale"),
        helper.make_node("FusedMatMul", ["dS", "Kt"], ["dQ"], transA=0, transB=1, name="dq", **mm),
        helper.make_node("FusedMatMul", ["Q", "dS"], ["dKt"], transA=1, transB=0, name="dk", **mm),
    ]
    inits = [const("c", c),
             numpy_helper.from_array(np.array([B, H, S, S], np.int64), "shape4"),
             numpy_helper.from_array(np.array([bh, S, S], np.int64), "shape3"),
             numpy_helper.from_array(np.array([bh, pr, pc], np.int64), "shape_p")]
    if dropout:
        nodes.insert(5, helper.make_node("Dropout", ["P0", "ratio", "train"], ["Pd", "dmask"],
                                         name="drop", seed=1))
        nodes.insert(11, helper.make_node("DropoutGrad", ["dPd", "dmask", "ratio", "train"],
                                          ["dP0"], domain=MS, name="drop_grad"))
        inits += [numpy_helper.from_array(np.float32(0.1), "ratio"),
                  numpy_helper.from_array(np.array(True), "train")]
    q, kt, v = [bh, S, D], [bh, D, S], [bh, pc, D]
    g = helper.make_graph(
        nodes, "attn3d",
        [vi("Q", q), vi("Kt", kt), vi("V", v), vi("mask", [B, 1, 1, S]),
         vi("dO", [bh, pr, D])],
        [vi("O", [bh, pr, D]), vi("dQ", q), vi("dKt", kt), vi("dV", v)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid(MS, 1)])
    m.ir_version = 9
    m.graph.value_info.extend([vi("S3", [bh, S, S]), vi("S4", [B, H, S, S]),
                               vi("P0", [B, H, S, S]), vi("P3", [bh, pr, pc])])
    return m


def ortt_attention_fill(*, ninf=-3.4028234663852886e38, zero=0.0, bwd_mask="mask", B=2, H=2,
                        S=4, D=3, mask=None, mask_input=False):
    """MPT's ort-training spelling: S = MatMul(Q, K^T) -> Mul(c) -> Add(alibi bias) ->
    Where(mask, -big, .) -> Softmax -> MatMul(., V); backward SoftmaxGrad_13 -> Where(mask, 0, .)
    -> Identity (the bias Add) -> Mul(c) -> FusedMatMul x2. mask: causal (True = masked) unless
    given; mask_input: the mask is a graph input (computed at run time) instead."""
    c = float(1 / np.sqrt(D))
    mm = dict(domain=MS, alpha=1.0)
    nodes = [
        helper.make_node("MatMul", ["Q", "Kt"], ["S"], name="qk"),
        helper.make_node("Mul", ["S", "c"], ["Ss"], name="fwd_scale"),
        helper.make_node("Add", ["Ss", "alibi"], ["Sb"], name="fwd_bias"),
        helper.make_node("Where", ["mask", "ninf", "Sb"], ["Sm"], name="fwd_mask"),
        helper.make_node("Softmax", ["Sm"], ["P"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["P", "V"], ["O"], name="pv"),
        helper.make_node("FusedMatMul", ["P", "dO"], ["dV"], transA=1, transB=0, name="dv", **mm),
        helper.make_node("FusedMatMul", ["dO", "V"], ["dP"], transA=0, transB=1, name="dp", **mm),
        helper.make_node("SoftmaxGrad_13", ["dP", "P"], ["dS0"], axis=-1, domain=MS, name="sg"),
        helper.make_node("Where", [bwd_mask, "zero", "dS0"], ["dSw"], name="bwd_mask"),
        helper.make_node("Identity", ["dSw"], ["dSb"], name="bwd_bias"),
        helper.make_node("Mul", ["dSb", "c"], ["dS"], name="bwd_scale"),
        helper.make_node("FusedMatMul", ["dS", "Kt"], ["dQ"], transA=0, transB=1, name="dq", **mm),
        helper.make_node("FusedMatMul", ["Q", "dS"], ["dKt"], transA=1, transB=0, name="dk", **mm),
    ]
    causal = np.triu(np.ones((S, S), bool), 1)[None, None] if mask is None else mask
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.float32(c), "c"),
             numpy_helper.from_array(rng.standard_normal((1, H, S, S)).astype(np.float32),
                                     "alibi"),
             numpy_helper.from_array(np.ones_like(causal), "mask_all"),
             numpy_helper.from_array(np.float32(ninf), "ninf"),
             numpy_helper.from_array(np.float32(zero), "zero")]
    q, kt = [B, H, S, D], [B, H, D, S]
    mask_in = [vi("mask", list(causal.shape), TensorProto.BOOL)] if mask_input else []
    if not mask_input:
        inits.append(numpy_helper.from_array(causal, "mask"))
    g = helper.make_graph(
        nodes, "attn_fill", [vi("Q", q), vi("Kt", kt), vi("V", q), vi("dO", q), *mask_in],
        [vi("O", q), vi("dQ", q), vi("dKt", kt), vi("dV", q)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid(MS, 1)])
    m.ir_version = 9
    m.graph.value_info.extend([vi(t, [B, H, S, S]) for t in ("S", "Ss", "Sb", "Sm", "P")])
    return m


def ortt_layernorm_centred(*, B=2, S=3, N=8, mean_of="X", mean_axes=(-1,), sln_axis=-1,
                           sum_axes=(-1,), residual=True):
    """onnxruntime-training's LayerNorm without bias (MPT, ModernBERT): forward
    c = Sub(X, ReduceMean(X, [-1], keepdims=1)) -> SimplifiedLayerNormalization(c, gamma);
    backward SimplifiedLayerNormalizationGrad -> (dc, dGamma), the Sub's gradient Identity(dc)
    and ReduceSum(dc, [-1]) -> Neg -> Scale(Size(X) / Size(.)) -> Expand(Shape(X)), summed
    (with a residual gradient dR). mean_of / mean_axes / sln_axis / sum_axes spell it wrong."""
    x = [B, S, N]
    nodes = [
        helper.make_node("ReduceMean", [mean_of], ["mean"], axes=list(mean_axes), keepdims=1,
                         name="mean"),
        helper.make_node("Sub", ["X", "mean"], ["c"], name="centre"),
        helper.make_node("SimplifiedLayerNormalization", ["c", "gamma"], ["Y", "inv_std"],
                         axis=-1, epsilon=1e-5, name="sln"),
        helper.make_node("SimplifiedLayerNormalizationGrad", ["dY", "c", "gamma", "inv_std"],
                         ["dc", "dGamma"], axis=sln_axis, epsilon=1e-5, domain=MS,
                         name="sln_grad"),
        helper.make_node("Identity", ["dc"], ["dX1"], name="sub_grad_id"),
        helper.make_node("ReduceSum", ["dc", "axes_r"], ["rs"], keepdims=1, name="sub_grad_sum"),
        helper.make_node("Neg", ["rs"], ["dmean"], name="sub_grad_neg"),
        helper.make_node("Size", ["dmean"], ["size_g"], name="size_g"),
        helper.make_node("Size", ["X"], ["size_x"], name="size_x"),
        helper.make_node("Div", ["size_x", "size_g"], ["ratio"], name="ratio"),
        helper.make_node("Scale", ["dmean", "ratio"], ["scaled"], scale_down=1, domain=MS,
                         name="mean_grad_scale"),
        helper.make_node("Shape", ["X"], ["shape_x"], name="shape_x"),
        helper.make_node("Expand", ["scaled", "shape_x"], ["dX2"], name="mean_grad_expand"),
        helper.make_node("Sum", ["dX1", "dX2", "dR"] if residual else ["dX1", "dX2"], ["dX"],
                         name="sum"),
    ]
    rng = np.random.default_rng(0)
    inputs = [vi("X", x), vi("X2", x), vi("dY", x)] + ([vi("dR", x)] if residual else [])
    m = model(nodes, inputs, [vi("Y", x), vi("dX", x), vi("dGamma", [N])],
              [const("gamma", rng.uniform(0.5, 1.5, N)),
               const("axes_r", list(sum_axes), np.int64)])
    m.graph.value_info.extend([vi("mean", [B, S, 1]), vi("c", x), vi("inv_std", [B, S, 1])])
    return m


def chain_from_rule(rule, prefix, bind, consts=None):
    """The nodes and constant initializers of a rule's pattern, written as a graph: each rule
    node becomes a node of its first op (inputs in the listed order), each constrained constant
    an initializer with the rule's value (or ``consts[var]``, e.g. for a `kind: scalar`), each
    other variable a tensor named prefix + variable unless ``bind`` names it. Used to write the torch-joint activation-gradient chains (their
    rules ARE the exporter's formula) into synthetic fixtures."""
    from fusecli.engine.rules import var_name

    names = dict(bind)

    def t(v):
        return names.setdefault(var_name(v), prefix + var_name(v))

    nodes, inits = [], []
    for spec in rule.nodes:
        attrs = {k: c.equals for k, c in spec.attrs.items() if c.has_equals}
        nodes.append(helper.make_node(spec.ops[0], [t(v) for v in spec.inputs],
                                      [t(v) for v in spec.outputs], name=prefix + spec.id,
                                      domain=spec.alt(spec.ops[0]).domains[0], **attrs))
    for var, ts in rule.tensors.items():
        inits.append(const(t(var), (consts or {}).get(var, ts.const)))
    # a rule lists nodes in matching order; a graph needs them in dataflow order
    produced = {i.name for i in inits} | set(bind.values())
    ordered, pending = [], list(nodes)
    while pending:
        ready = [n for n in pending if all(i in produced for i in n.input)]
        if not ready:
            raise ValueError(f"{rule.name}: chain needs inputs {set(pending[0].input) - produced}")
        for n in ready:
            ordered.append(n)
            produced.update(n.output)
            pending.remove(n)
    return ordered, inits


def torch_linear_act(act_rule, *, layout="linear", three_d=False, bias=True, first=False,
                     frozen_w=False, B=2, S=3, N=5, K=4, act_consts=None):
    """torch-joint backward of Linear + activation: the activation gradient in standard ops
    (written from ``act_rule``, an act_*_grad_torch rule), then
      layout "linear":  dW = MatMul(Transpose(dZ), A) [N, K]; dA = MatMul(dZ, W), W [N, K]
      layout "conv1d":  dW = MatMul(Transpose(A), dZ) [K, N]; dA = MatMul(dZ, Transpose(W)),
                        W [K, N] (Hugging Face Conv1D through addmm)
      layout "at_t":    dW = Transpose(MatMul(Transpose(A), dZ)) [N, K]; dA = MatMul(dZ, W)
    bias grad ReduceSum(dZ, [0], keepdims=1) -> Reshape [N]. 3-D: dY/X [B, S, N] and dZ
    reshaped to [-1, N]; A is the 2-D view [B*S, K] the forward multiplied. act_consts: values
    of the activation chain's constants the rule does not fix (QuickGELU's scale c).
    frozen_w: no weight gradient (W with requires_grad=False: no dW MatMul, no A)."""
    M = B * S
    lead = [B, S] if three_d else [M]
    nodes, inits = chain_from_rule(act_rule, "act.", {"dY": "dY", "X": "X", "dZ": "dZ"},
                                   act_consts)
    dz = "dZ"
    if three_d:
        inits.append(const("shape_dz", [-1, N], np.int64))
        nodes.append(helper.make_node("Reshape", ["dZ", "shape_dz"], ["dZ2"], name="flat"))
        dz = "dZ2"
    if frozen_w:
        pass
    elif layout == "linear":
        nodes += [helper.make_node("Transpose", [dz], ["dZt"], perm=[1, 0], name="tz"),
                  helper.make_node("MatMul", ["dZt", "A"], ["dW"], name="wgrad")]
    else:
        nodes += [helper.make_node("Transpose", ["A"], ["At"], perm=[1, 0], name="ta"),
                  helper.make_node("MatMul", ["At", dz],
                                   ["dW" if layout == "conv1d" else "dWt"], name="wgrad")]
        if layout == "at_t":
            nodes.append(helper.make_node("Transpose", ["dWt"], ["dW"], perm=[1, 0],
                                          name="wgrad_t"))
    w_shape = [K, N] if layout == "conv1d" else [N, K]
    outputs = [] if frozen_w else [vi("dW", w_shape)]
    if bias:
        inits += [const("axes0", [0], np.int64), const("shape_b", [N], np.int64)]
        nodes += [helper.make_node("ReduceSum", [dz, "axes0"], ["dB1"], keepdims=1,
                                   name="bgrad"),
                  helper.make_node("Reshape", ["dB1", "shape_b"], ["dB"], name="bshape")]
        outputs.append(vi("dB", [N]))
    if not first:
        w = "W"
        if layout == "conv1d":
            nodes.append(helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0], name="wt"))
            w = "Wt"
        nodes.append(helper.make_node("MatMul", [dz, w], ["dA"], name="dgrad"))
        outputs.append(vi("dA", [M, K]))
    inputs = [vi("dY", lead + [N]), vi("X", lead + [N])] + ([] if frozen_w else [vi("A", [M, K])])
    if not first:
        inputs.append(vi("W", w_shape))
    return model(nodes, inputs, outputs, inits, opset=18, ms=False)


def with_probabilities_output(m):
    """A copy of `m` whose Softmax outputs are graph outputs too (a model that returns its
    attentions): the flash rules refuse there (P must exist), and the sdpa rules,
    which keep P, fuse the attention backward (the fixture of sdpa variants that flash would
    otherwise take first, e.g. attention without dK since issue 21's optional flash branches)."""
    import copy

    m = copy.deepcopy(m)
    for n in m.graph.node:
        if n.op_type == "Softmax":
            m.graph.output.append(helper.make_tensor_value_info(n.output[0], F, None))
    return m


def _cap_nodes(family, x, dx, c, one):
    """Gemma 2's soft cap on tensor x, c * tanh(x / c) (Div, Tanh, Mul: output x + "_cap"), and
    its gradient on dx as the exporters write it (Mul by c; ort-training's TanhGrad reading the
    forward's tanh, torch-joint's (1 - t * t) with `one` a constant 1; Div by c: output
    dx + "_cap"); c, one: initializer names."""
    def mk(o, ins, out):
        return helper.make_node(o, ins, [out], name=out,
                                domain="com.microsoft" if o == "TanhGrad" else "")

    t, dt, du = f"{x}_cap_t", f"{dx}_cap_dt", f"{dx}_cap_du"
    fwd = [mk("Div", [x, c], f"{x}_cap_in"), mk("Tanh", [f"{x}_cap_in"], t),
           mk("Mul", [t, c], f"{x}_cap")]
    der = ([mk("TanhGrad", [dt, t], du)] if family == "ortt" else
           [mk("Mul", [t, t], f"{dx}_cap_sq"), mk("Sub", [one, f"{dx}_cap_sq"], f"{dx}_cap_der"),
            mk("Mul", [dt, f"{dx}_cap_der"], du)])
    return fwd, [mk("Mul", [dx, c], dt), *der, mk("Div", [du, c], f"{dx}_cap")]


def _insert_after(nodes, t, new, out):
    """Every reader of tensor t in `nodes` reads `out` (the last of `new`) instead, and `new`
    goes right after t's producer (first without one), keeping the list topologically sorted."""
    for n in nodes:
        n.input[:] = [out if x == t else x for x in n.input]
    at = next((i + 1 for i, n in enumerate(nodes) if t in n.output), 0)
    nodes[at:at] = new


def _with_constants(m, **values):
    """A copy of m with float scalar initializers name=value added."""
    import copy

    m = copy.deepcopy(m)
    m.graph.initializer.extend(numpy_helper.from_array(np.array(v, np.float32), k)
                               for k, v in values.items())
    return m


def with_logit_scale(m, family, c=4.0, op="Div"):
    """A head + cross-entropy export (tests/data/make_lce.py, scripts/make_lce_spellings.py)
    with its logits multiplied by a constant before the loss, as Granite's `logits /
    logits_scaling` (op Div, c) or Cohere's `logits * logit_scale` (op Mul, c) are, or
    soft-capped as Gemma 2's `c * tanh(logits / c)` (op "softcap", _cap_nodes), and the logits'
    gradient through the same after the loss's backward (the chain rule, as the exporters write
    it): ort-training, between the head (+ bias) and the Reshape / SoftmaxCrossEntropyLoss, and
    between SoftmaxCrossEntropyLossGrad (+ its Reshape) and the head's gradients; torch-joint,
    before LogSoftmax and after the Sub that forms dZ."""
    m = _with_constants(m, logit_scale_c=c, logit_one=1.0)
    nodes = list(m.graph.node)

    def readers(t):
        return [n for n in nodes if t in n.input]

    if family == "ortt":
        sce = next(n for n in nodes if n.op_type == "SoftmaxCrossEntropyLoss")
        p = next((n for n in nodes if sce.input[0] in n.output), None)
        z = p.input[0] if p is not None and p.op_type == "Reshape" else sce.input[0]
        dl = next(n for n in nodes if n.op_type == "SoftmaxCrossEntropyLossGrad").output[0]
        r = [n for n in readers(dl) if n.op_type == "Reshape"]
        dz = r[0].output[0] if r else dl
    else:
        lsm = next(n for n in nodes if n.op_type == "LogSoftmax")
        z = lsm.input[0]
        exp = next(n for n in readers(lsm.output[0]) if n.op_type == "Exp")
        pmul = next(n for n in readers(exp.output[0]) if n.op_type == "Mul")
        dz = next(n for n in readers(pmul.output[0]) if n.op_type == "Sub").output[0]
    if op == "softcap":
        chains = zip((z, dz), _cap_nodes(family, z, dz, "logit_scale_c", "logit_one"))
    else:
        chains = ((t, [helper.make_node(op, [t, "logit_scale_c"], [f"{t}_cap"],
                                        name=f"{t}_cap")]) for t in (z, dz))
    return _spliced(m, nodes, chains)


def _inferred_dims(m) -> dict:
    """Every intermediate tensor's dims as onnx shape inference gives them."""
    from onnx import shape_inference

    return {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in shape_inference.infer_shapes(m).graph.value_info}


def with_logit_bias(m):
    """A torch-joint head + cross-entropy export with a frozen bias [1, V] added to the head's
    logits, as BART's (mBART's, Marian's, Pegasus's) final_logits_bias is (rules/lce_torch.yaml
    and rules/lce_torch_loss.yaml _fbias): Add(logits, bias) right after the head's MatMul,
    before any view or transform of the logits; its gradient is the logits' own (no node)."""
    import copy

    producer = {t: n for n in m.graph.node for t in n.output}
    z = next(n for n in m.graph.node if n.op_type == "LogSoftmax").input[0]
    while producer[z].op_type in ("Reshape", "Mul", "Div", "Tanh"):
        z = producer[z].input[0]
    assert producer[z].op_type == "MatMul", producer[z].op_type
    v = _inferred_dims(m)[z][-1]
    m = copy.deepcopy(m)
    m.graph.initializer.append(numpy_helper.from_array(
        (np.random.default_rng(0).standard_normal((1, v)) * 0.5).astype(np.float32),
        "logit_fbias"))
    add = helper.make_node("Add", [z, "logit_fbias"], [f"{z}_fbias"], name=f"{z}_fbias")
    return _spliced(m, list(m.graph.node), [(z, [add])])


def with_label_smoothing(m, reduce="mean", eps=0.1):
    """A torch-joint head + cross-entropy export with label smoothing eps added to its loss as
    the exporters write it (rules/lce_torch.yaml _smoothed, rules/lce_torch_loss.yaml
    _nllloss_smoothed): R = ReduceMean (gen_torch.cross_entropy's `lp.mean(-1)`) or ReduceSum
    (F.cross_entropy's `lp.sum(-1)`) of the log-probabilities over the classes, and the loss
    `loss + eps * sum(-R)`; in the backward, R's gradient (the constant -eps per row) added to
    every class of the log-probabilities' gradient: Expand(Unsqueeze(-eps)) [/ V for the mean]
    added to the tensor the softmax's backward Sub reads."""
    from onnx import shape_inference

    lp = next(n for n in m.graph.node if n.op_type == "LogSoftmax").output[0]
    n, v = _inferred_dims(m)[lp]
    m = _with_constants(m, smooth_eps=eps, smooth_v=float(v))
    m.graph.initializer.extend([
        numpy_helper.from_array(np.full(n, -eps, np.float32), "smooth_rg"),
        numpy_helper.from_array(np.array([-1], np.int64), "smooth_last"),
        numpy_helper.from_array(np.array([n, v], np.int64), "smooth_nv")])
    nodes = list(m.graph.node)

    def readers(t):
        return [x for x in nodes if t in x.input]

    exp = next(x for x in readers(lp) if x.op_type == "Exp")
    pmul = next(x for x in readers(exp.output[0]) if x.op_type == "Mul")
    s_one_hot = next(x for x in readers(pmul.output[0]) if x.op_type == "Sub").input[0]
    loss = next(x for x in nodes if "loss" in x.output)
    loss.output[:] = ["smooth_nll" if t == "loss" else t for t in loss.output]
    for x in nodes:
        x.input[:] = ["smooth_nll" if t == "loss" else t for t in x.input]
    op = "ReduceMean" if reduce == "mean" else "ReduceSum"
    fwd = [helper.make_node(op, [lp, "smooth_last"], ["smooth_r"], keepdims=0),
           helper.make_node("Neg", ["smooth_r"], ["smooth_rn"]),
           helper.make_node("ReduceSum", ["smooth_rn"], ["smooth_rs"], keepdims=0),
           helper.make_node("Mul", ["smooth_rs", "smooth_eps"], ["smooth_l"]),
           helper.make_node("Add", ["smooth_nll", "smooth_l"], ["loss"])]
    bwd = [helper.make_node("Unsqueeze", ["smooth_rg", "smooth_last"], ["smooth_ru"]),
           helper.make_node("Expand", ["smooth_ru", "smooth_nv"], ["smooth_re"])]
    if reduce == "mean":
        bwd.append(helper.make_node("Div", ["smooth_re", "smooth_v"], ["smooth_rd"]))
    bwd.append(helper.make_node("Add", [bwd[-1].output[0], s_one_hot], ["smooth_s"]))
    at = nodes.index(loss) + 1
    nodes[at:at] = fwd
    return shape_inference.infer_shapes(_spliced(m, nodes, [(s_one_hot, bwd)]))


def _spliced(m, nodes, chains):
    """m with its node list `nodes`, each (tensor, new nodes) of `chains` spliced in after the
    tensor (_insert_after: its readers read the chain's last output)."""
    for t, new in chains:
        _insert_after(nodes, t, new, new[-1].output[0])
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def with_pooled_logits(m, z, dz):
    """A copy of a torch-joint head + cross-entropy export whose loss reads one row of the head's
    logits per sequence, as a sequence classifier's last-token pooling is exported
    (rules/_lce_pool_torch.yaml): the [N, V] logits z viewed [N, 1, V] (N sequences of one
    token, so the loss and its labels are unchanged), GatherND at Concat(arange(N), Unsqueeze(
    pos)) with pos a new int64 input [N] (fed 0), and the logits' gradient dz ScatterND'd into
    zeros of the view and flattened back before the head's GEMMs."""
    import copy

    n, v = _inferred_dims(m)[z]
    m = copy.deepcopy(m)
    m.graph.input.append(helper.make_tensor_value_info("pool_pos", TensorProto.INT64, [n]))
    m.graph.initializer.extend([
        numpy_helper.from_array(np.arange(n, dtype=np.int64).reshape(n, 1), "pool_arange"),
        numpy_helper.from_array(np.array([n, 1, v], np.int64), "pool_view"),
        numpy_helper.from_array(np.array([n, v], np.int64), "pool_flat"),
        numpy_helper.from_array(np.array([1], np.int64), "pool_axis"),
        numpy_helper.from_array(np.zeros((n, 1, v), np.float32), "pool_zeros")])

    def mk(op, ins, out, **attrs):
        return helper.make_node(op, ins, [out], name=out, **attrs)

    fwd = [mk("Reshape", [z, "pool_view"], "pool_z3"),
           mk("Unsqueeze", ["pool_pos", "pool_axis"], "pool_pos_u"),
           mk("Concat", ["pool_arange", "pool_pos_u"], "pool_idx", axis=-1),
           mk("GatherND", ["pool_z3", "pool_idx"], "pool_z")]
    bwd = [mk("ScatterND", ["pool_zeros", "pool_idx", dz], "pool_dz3", reduction="add"),
           mk("Reshape", ["pool_dz3", "pool_flat"], "pool_dz")]
    from onnx import shape_inference

    return shape_inference.infer_shapes(_spliced(m, list(m.graph.node), [(z, fwd), (dz, bwd)]))


def with_attention_softcap(m, family, scores, dscores, c=2.0):
    """A copy of an attention export with one attention's scaled scores soft-capped, Gemma 2's
    `c * tanh(scores / c)` before its mask, and the scores' gradient through the cap before the
    scale's gradient (_cap_nodes): `scores` is the tensor the scale writes (the forward's scaled
    scores), `dscores` the one the scale's gradient reads (as a flash rule's match records
    them)."""
    cc, one = f"{scores}_softcap_c", f"{scores}_softcap_one"
    m = _with_constants(m, **{cc: c, one: 1.0})
    return _spliced(m, list(m.graph.node),
                    zip((scores, dscores), _cap_nodes(family, scores, dscores, cc, one)))
