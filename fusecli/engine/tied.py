"""A tied head's weight gradient: the embedding's part scattered into the fused head's dW.

With the LM head tied to the token embedding, the table's gradient is the head's dW (which the
fused LinearCrossEntropy writes in the forward) plus the embedding's: a scatter-add of the
token rows' gradients into zeros of the table's shape, then an Add (torch-joint: ScatterND
{add} into zeros, Add; ort-training: GatherGrad, Sum). At the end of the backward that holds
three [V, D] tables at once (the head's dW, the scattered zeros, the sum): on a GPT-2-sized
vocabulary more than the whole fused step's activations. ``fold_tied_gradients`` scatters
the rows into the head's dW instead, ScatterND(dW, ids, rows){add}, which onnxruntime runs in
dW's own buffer when nothing else reads it: one table instead of three, the same sum (the
rows added to dW rather than to zeros first: float rounding only).

Taken only where one operand of the Add is an output of a fused node (LinearCrossEntropy's
dW: the rewrite reads no op name, only the fused domain and the shapes) with a recorded static
shape, nothing else reads either operand, and the other is the embedding's scatter into a table
of that shape: torch-joint a ScatterND{add} whose data is zeros of that shape (a zero
initializer or ConstantOfShape); ort-training a GatherGrad{axis 0} into Shape(T), T an input of
the same fused node (the head's weight W) of that shape, in a model whose ai.onnx opset has
ScatterND's reduction (16 and above).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusecli.ops.contracts import FUSED_DOMAIN


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _attr(node: onnx.NodeProto, name: str, default=None):
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else helper.get_attribute_value(a)


def _is_zeros(name: str, producer: dict, inits: dict, shape: list[int]) -> bool:
    """Whether ``name`` is all zeros of ``shape`` (an initializer, or a ConstantOfShape of a
    constant shape with a zero value)."""
    if name in inits:
        arr = numpy_helper.to_array(inits[name])
        return list(arr.shape) == shape and not np.any(arr)
    p = producer.get(name)
    if p is None or p.op_type != "ConstantOfShape" or p.domain not in ("", "ai.onnx"):
        return False
    value = _attr(p, "value")
    if value is not None and np.any(numpy_helper.to_array(value)):
        return False
    dims = inits.get(p.input[0])
    return dims is not None and numpy_helper.to_array(dims).tolist() == shape


def fold_tied_gradients(model: onnx.ModelProto) -> list[str]:
    """Rewrite every tied head's gradient sum as above; returns the gradients rewritten."""
    g = model.graph
    nodes = list(g.node)
    heads = {o: n for n in nodes if n.domain == FUSED_DOMAIN for o in n.output if o}
    adds = [n for n in nodes if n.domain in ("", "ai.onnx") and n.op_type in ("Add", "Sum")
            and len(n.input) == 2 and any(t in heads for t in n.input)]
    if not adds:  # the usual case: no fused output is summed (nothing more is indexed)
        return []
    producer = {o: n for n in nodes for o in n.output if o}
    readers = Counter(t for n in nodes for t in n.input)
    outputs = {o.name for o in g.output}
    inits = {i.name: i for i in g.initializer}
    typed = [v for v in [*g.input, *g.value_info, *g.output] if v.type.HasField("tensor_type")]
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None
                       for d in v.type.tensor_type.shape.dim] for v in typed}
    shapes.update((i.name, list(i.dims)) for i in g.initializer)
    elem = {v.name: v.type.tensor_type.elem_type for v in typed}
    opset = _opset(model)
    drop: set[int] = set()
    orphans: list[str] = []  # what only a dropped scatter may have read
    put: dict[int, list[onnx.NodeProto]] = {}
    folded = []
    for add in adds:
        dw = next(t for t in add.input if t in heads)
        other = add.input[1] if add.input[0] == dw else add.input[0]
        if other == dw or readers.get(dw) != 1 or readers.get(other) != 1 \
                or dw in outputs or other in outputs:
            continue
        scat = producer.get(other)
        head = heads[dw]
        w_shape = shapes.get(dw)
        if scat is None or id(scat) in drop or not w_shape or None in w_shape:
            continue
        if (scat.domain in ("", "ai.onnx") and scat.op_type == "ScatterND"
                and _attr(scat, "reduction", b"none") == b"add"
                and _is_zeros(scat.input[0], producer, inits, w_shape)):
            new = helper.make_node("ScatterND", [dw, scat.input[1], scat.input[2]],
                                   [add.output[0]], name=scat.name + "_into_head_dw",
                                   reduction="add")
            put[id(add)] = [new]
        elif (scat.domain == "com.microsoft" and scat.op_type == "GatherGrad"
              and _attr(scat, "axis", 0) == 0 and opset >= 16
              and getattr(producer.get(scat.input[0]), "op_type", None) == "Shape"
              and producer[scat.input[0]].input[0] in head.input
              and shapes.get(producer[scat.input[0]].input[0]) == w_shape):
            col = add.output[0] + "_ids_column"
            axes = add.output[0] + "_last_axis"
            g.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), axes))
            ids = scat.input[1]
            pre = []
            if elem.get(ids) == onnx.TensorProto.INT32:
                pre.append(helper.make_node("Cast", [ids], [ids + "_int64"],
                                            to=onnx.TensorProto.INT64))
                ids = ids + "_int64"
            put[id(add)] = [*pre,
                            helper.make_node("Unsqueeze", [ids, axes], [col]),
                            helper.make_node("ScatterND", [dw, col, scat.input[2]],
                                             [add.output[0]], name=scat.name + "_into_head_dw",
                                             reduction="add")]
        else:
            continue
        drop.update((id(add), id(scat)))
        orphans.append(scat.input[0])
        folded.append(add.output[0])
    if not folded:
        return []
    out = []
    for n in nodes:
        if id(n) in put:
            out.extend(put[id(n)])
        elif id(n) not in drop:
            out.append(n)
    # the zeros (initializer, or ConstantOfShape and its shape) or Shape(W) that only the
    # dropped scatter read
    inputs = {i.name for i in g.input}
    gone: set[str] = set()
    while orphans:
        name = orphans.pop()
        if name in gone or name in outputs or any(name in n.input for n in out):
            continue
        gone.add(name)
        p = next((n for n in out if name in n.output), None)
        if p is not None and p.op_type in ("Shape", "ConstantOfShape"):
            out.remove(p)
            orphans.extend(p.input)
    del g.node[:]
    g.node.extend(out)
    keep = [i for i in g.initializer if i.name not in gone or i.name in inputs]
    del g.initializer[:]
    g.initializer.extend(keep)
    return folded
