"""Embedding tables' gradients after fusion: a tied head's scattered into the fused head's dW,
an untied one's given a static shape.

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

An untied embedding's gradient (ort-training): GatherGrad{axis 0}(Shape(E), ids, rows) has no
shape onnxruntime can infer before the run, so its [V, D] table is allocated when the
backward reaches it, on top of the step's planned buffers, which are still held then (onnxruntime
plans every statically shaped tensor into one block per run). ``plan_embedding_gradients``
writes it ScatterND(ConstantOfShape([V, D]), ids, rows){add}, the same table (the rows added
into zeros; float rounding only), whose shape is known: planned with the others, into the
space the fused head's dW left (measured, scripts/flash/memory.sh: the ort-training Llama step
at S 1024 peaked 62.5 MiB, the table, above the planned block; 210.4 -> 181.5 MiB). Taken where
E's shape is static and the opset has ScatterND's reduction, and the ids' count is static, or
symbolic for token ids fed as a graph input (``_fed_ids``: the count is then Size(ids) at run
time); the rows are read as GatherGrad reads them (``_scatter_rows``). The ort-training
Llama-style step of scripts/flash/memory.sh with its 1024 dims made a symbol peaked at 206.9
MiB fused (0.369x of 560.1) with its GatherGrad kept, 178.2 MiB (0.318x) with it planned.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fusecli.ops.contracts import FUSED_DOMAIN


# ConstantOfShape's zero, by element type (the tables a GatherGrad writes: floating point)
_ZERO_OF = {onnx.TensorProto.FLOAT: np.zeros(1, np.float32),
            onnx.TensorProto.FLOAT16: np.zeros(1, np.float16),
            onnx.TensorProto.DOUBLE: np.zeros(1, np.float64)}


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


def _gather_grad_of(n: onnx.NodeProto, producer: dict, opset: int):
    """The table a GatherGrad{axis 0}(Shape(T), ids, rows) scatters into: T, or None."""
    if n.domain != "com.microsoft" or n.op_type != "GatherGrad" or _attr(n, "axis", 0) != 0 \
            or opset < 16:
        return None
    p = producer.get(n.input[0])
    whole = p is not None and p.op_type == "Shape" and _attr(p, "start", 0) == 0 \
        and _attr(p, "end") is None  # the whole shape (opset 15's start / end: the defaults)
    return p.input[0] if whole else None


def _id_count(shapes: dict, ids: str) -> int | None:
    """How many ids a tensor holds, where its recorded shape is static (1 for a scalar)."""
    dims = shapes.get(ids)
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    return int(np.prod(dims))


def _scatter_rows(g: onnx.GraphProto, elem: dict, table: str, gg: onnx.NodeProto, out: str,
                  suffix: str, count: int | None, row_dims: list[int]) -> list[onnx.NodeProto]:
    """ScatterND(table, ids as a column, rows){add} -> out: a GatherGrad gg's rows (of
    ``row_dims``, the table's trailing dims) added into ``table`` (ids cast to int64 when they
    are int32): Reshape(ids, [N, 1]) and the rows as GatherGrad{axis 0} reads them, its first N
    (onnxruntime-training 1.19.2 reads no more when the rows hold more, e.g. the position ids'
    [1, S] against a [B, S, D] gradient: the first sequence's; tests/test_tied_fold.py):
    Slice(Reshape(rows, [-1, *row_dims]), 0, N). N is ``count``, or with ``count`` None (a
    symbolic count) Size(ids) at run time and the ids' column Reshape(ids, [-1, 1])."""
    col = out + "_ids_column"
    ids = gg.input[1]
    pre = []
    if elem.get(ids) == onnx.TensorProto.INT32:
        pre.append(helper.make_node("Cast", [ids], [ids + "_int64"], to=onnx.TensorProto.INT64))
        ids = ids + "_int64"
    rows = gg.input[2]

    def const(name: str, values: list[int]) -> str:
        g.initializer.append(numpy_helper.from_array(np.array(values, np.int64), out + name))
        return out + name

    if count is None:  # N = Size(ids) at run time, as a 1-D end for the Slice
        pre += [helper.make_node("Size", [ids], [out + "_ids_count"]),
                helper.make_node("Reshape", [out + "_ids_count", const("_one", [1])],
                                 [out + "_rows_end"])]
        end = out + "_rows_end"
    else:
        end = const("_rows_end", [count])
    pre += [helper.make_node("Reshape", [ids, const("_ids_shape", [-1 if count is None
                                                                    else count, 1])], [col]),
            helper.make_node("Reshape", [rows, const("_rows_shape", [-1, *row_dims])],
                             [out + "_all_rows"]),
            helper.make_node("Slice", [out + "_all_rows", const("_rows_start", [0]), end,
                                       const("_rows_axis", [0])], [out + "_rows"])]
    rows = out + "_rows"
    return [*pre, helper.make_node("ScatterND", [table, col, rows], [out], name=gg.name + suffix,
                                   reduction="add")]


def _fed_ids(shapes: dict, inputs: set, ids: str, rows: str, table: list[int]) -> bool:
    """Symbolic ids whose count is taken at run time (Size(ids)): token ids that are a graph
    input, every dim named, and rows recorded with exactly those dims and the table's row
    dims. Ids computed in the graph (position ids sliced from a buffer, token-type ids
    expanded) keep their GatherGrad: measured on tests/data/ortt_bert_tokens_symbolic.onnx,
    its position ids [1, S] meet a [B, S, D] gradient recorded with the ids' own dims, and there the
    original's GatherGrad run (onnxruntime-training 1.19.2) disturbed a buffer that `fusecli
    verify` probes (a FlashAttentionGrad boundary tensor read 6.4e-3 off in the original
    only, while every output matched), so the rewrite could not be verified."""
    d = shapes.get(ids)
    return (ids in inputs and bool(d) and None not in d
            and shapes.get(rows) == [*d, *table[1:]])


def _static(dims) -> bool:
    return bool(dims) and all(isinstance(d, int) for d in dims)


def _types(g: onnx.GraphProto) -> tuple[dict, dict]:
    """Recorded shapes (a symbolic dim as its name, None for an unnamed one) and element types,
    by tensor name."""
    typed = [v for v in [*g.input, *g.value_info, *g.output] if v.type.HasField("tensor_type")
             and v.type.tensor_type.HasField("shape")]
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                       for d in v.type.tensor_type.shape.dim] for v in typed}
    shapes.update((i.name, list(i.dims)) for i in g.initializer)
    elem = {v.name: v.type.tensor_type.elem_type for v in typed}
    elem.update((i.name, i.data_type) for i in g.initializer)
    return shapes, elem


def plan_embedding_gradients(model: onnx.ModelProto) -> list[str]:
    """Rewrite every GatherGrad{axis 0} into Shape(E), E of a static shape, as a ScatterND{add}
    into ConstantOfShape(E's shape) (see above); returns the gradients rewritten."""
    g = model.graph
    opset = _opset(model)
    nodes = list(g.node)
    if not any(n.op_type == "GatherGrad" for n in nodes):
        return []
    producer = {o: n for n in nodes for o in n.output if o}
    shapes, elem = _types(g)
    inputs = {i.name for i in g.input}
    out: list[onnx.NodeProto] = []
    planned = []
    for n in nodes:
        table = _gather_grad_of(n, producer, opset)
        if table is None:
            out.append(n)
            continue
        dims, count = shapes.get(table), _id_count(shapes, n.input[1])
        # a static table, and a static count of ids or token ids fed as a graph input (the
        # rows are read up to the count either way: a recorded shape of the rows is not
        # trusted, exporters record the forward's)
        if not _static(dims) or elem.get(table) not in _ZERO_OF or (
                count is None and not _fed_ids(shapes, inputs, n.input[1], n.input[2], dims)):
            out.append(n)
            continue
        shape = n.output[0] + "_table_shape"
        g.initializer.append(numpy_helper.from_array(np.array(dims, np.int64), shape))
        zeros = n.output[0] + "_zeros"
        out.append(helper.make_node("ConstantOfShape", [shape], [zeros],
                                    value=numpy_helper.from_array(_ZERO_OF[elem[table]])))
        out.extend(_scatter_rows(g, elem, zeros, n, n.output[0], "_planned", count, dims[1:]))
        planned.append(n.output[0])
    if planned:
        del g.node[:]
        g.node.extend(out)
        _drop_unread(g, [n.input[0] for n in nodes if n.op_type == "GatherGrad"
                         and n.output[0] in planned])
    return planned


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
    shapes, elem = _types(g)
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
        if scat is None or id(scat) in drop or not _static(w_shape):
            continue
        if (scat.domain in ("", "ai.onnx") and scat.op_type == "ScatterND"
                and _attr(scat, "reduction", b"none") == b"add"
                and _is_zeros(scat.input[0], producer, inits, w_shape)):
            new = helper.make_node("ScatterND", [dw, scat.input[1], scat.input[2]],
                                   [add.output[0]], name=scat.name + "_into_head_dw",
                                   reduction="add")
            put[id(add)] = [new]
        elif ((table := _gather_grad_of(scat, producer, opset)) in head.input
              and shapes.get(table) == w_shape):
            put[id(add)] = _scatter_rows(g, elem, dw, scat, add.output[0], "_into_head_dw",
                                         _id_count(shapes, scat.input[1]), w_shape[1:])
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
    del g.node[:]
    g.node.extend(out)
    # the zeros (initializer, or ConstantOfShape and its shape) or Shape(W) that only the
    # dropped scatter read
    _drop_unread(g, orphans)
    return folded


def _drop_unread(g: onnx.GraphProto, names: list[str]) -> None:
    """Remove what no node reads any more among ``names``: their Shape / ConstantOfShape
    producers (and, in turn, what only those read) and initializers (not graph inputs or
    outputs)."""
    out = list(g.node)
    keep_names = {i.name for i in g.input} | {o.name for o in g.output}
    gone: set[str] = set()
    while names:
        name = names.pop()
        if name in gone or name in keep_names or any(name in n.input for n in out):
            continue
        gone.add(name)
        p = next((n for n in out if name in n.output), None)
        if p is not None and p.op_type in ("Shape", "ConstantOfShape"):
            out.remove(p)
            names.extend(p.input)
    del g.node[:]
    g.node.extend(out)
    keep = [i for i in g.initializer if i.name not in gone]
    del g.initializer[:]
    g.initializer.extend(keep)
