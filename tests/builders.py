"""Small synthetic training-graph fragments, built the way each exporter spells them.

Used as rule fixtures: one positive fixture per rule variant and one negative fixture per guard.
Every builder returns a ModelProto that passes onnx.checker (custom/training domains aside).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"
F = TensorProto.FLOAT


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


def ortt_linear_act(act="relu", *, first=False, bias=True, identity=True, M=6, N=5, K=4,
                    extra=None):
    """onnxruntime-training backward of Gemm(transB=1)+activation.

    extra: None | "consumer" (dZ also feeds an outside node) | "graph_output" (dZ is an output)
           | "wrong_attr" (weight Gemm transA=0) | "wrong_const" (ReduceSum over axis 1)
           | "wrong_domain" (activation grad in the default domain)
    """
    op = {"relu": "ReluGrad", "gelu": "GeluGrad", "silu": "QuickGeluGrad"}[act]
    kw = {"alpha": 1.0} if act == "silu" else {}
    domain = "" if extra == "wrong_domain" else MS
    nodes = [helper.make_node(op, ["dY", "X"], ["dZ"], name="act_grad", domain=domain, **kw)]
    outputs = [vi("dW", [N, K])]
    inits = []
    if bias:
        inits.append(const("axes0", [1] if extra == "wrong_const" else [0], np.int64))
        nodes.append(helper.make_node("ReduceSum", ["dZ", "axes0"],
                                      ["db_raw" if identity else "db"], keepdims=0))
        if identity:
            nodes.append(helper.make_node("Identity", ["db_raw"], ["db"]))
        outputs.append(vi("db", [N] if extra != "wrong_const" else [M]))
    nodes.append(helper.make_node("Gemm", ["dZ", "A"], ["dW"], name="wgrad",
                                  transA=0 if extra == "wrong_attr" else 1, transB=0, beta=0.0))
    if not first:
        nodes.append(helper.make_node("Gemm", ["dZ", "W"], ["dA"], name="dgrad"))
        outputs.append(vi("dA", [M, K]))
    if extra == "consumer":
        nodes.append(helper.make_node("Neg", ["dZ"], ["dZ_neg"], name="outside"))
        outputs.append(vi("dZ_neg", [M, N]))
    if extra == "graph_output":
        outputs.append(vi("dZ", [M, N]))
    inputs = [vi("dY", [M, N]), vi("X", [M, N]), vi("A", [M, K]), vi("W", [N, K])]
    return model(nodes, inputs, outputs, inits)
