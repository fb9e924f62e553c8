"""Constants by value, wherever they come from.

Rules compare constants by value. Exporters do not always leave them as initializers or Constant
nodes: `torch.onnx.export(..., dynamo=True, optimize=False)` computes them with small subgraphs
(scalar_tensor arithmetic, Cast, Reshape of Constant nodes), and a real-size torch-joint graph
keeps the SiLU gradient's `1` as an Expand of a scalar. GraphIndex.const_value folds such
subgraphs lazily (nothing in the graph changes) and never materialises a large broadcast.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import builders
from conftest import SAMPLES

from fusecli import FusionPass
from fusecli.engine.constfold import MAX_ELEMENTS
from fusecli.engine.graph import GraphIndex
from fusecli.runtime.feeds import make_feeds
from fusecli.runtime.library import session_options
from fusecli.runtime.verify import manifest_entry_for

F = TensorProto.FLOAT


def _index(nodes, inputs=(), inits=(), value_info=()):
    g = helper.make_graph(nodes, "g", list(inputs), [], initializer=list(inits),
                          value_info=list(value_info))
    return GraphIndex(g)


def _c(name, value, dtype=np.float32):
    return helper.make_node("Constant", [], [name],
                            value=numpy_helper.from_array(np.asarray(value, dtype), name + "_v"))


def test_scalar_tensor_arithmetic_cast_reshape():
    """The dynamo optimize=False spelling of 1/sqrt(2): doubles, Cast, Sqrt, Reciprocal,
    Reshape to a scalar."""
    ix = _index([_c("two", 2.0, np.float64),
                 helper.make_node("Cast", ["two"], ["two_f"], to=F),
                 helper.make_node("Sqrt", ["two_f"], ["s"]),
                 helper.make_node("Reciprocal", ["s"], ["r"]),
                 _c("shape", [], np.int64),
                 helper.make_node("Reshape", ["r", "shape"], ["out"])])
    v = ix.const_value("out")
    assert v.shape == () and v.dtype == np.float32
    assert float(v) == pytest.approx(0.70710678, rel=1e-7)


def test_shape_ops_and_integer_arithmetic():
    x = helper.make_tensor_value_info("x", F, [2, 3, 4])
    ix = _index([helper.make_node("Shape", ["x"], ["sh"]),
                 _c("i", [2], np.int64),
                 helper.make_node("Gather", ["sh", "i"], ["last"], axis=0),
                 _c("m1", [-1], np.int64),
                 helper.make_node("Concat", ["m1", "last"], ["target"], axis=0),
                 _c("zero", 0, np.int64), _c("three", 3, np.int64), _c("one", 1, np.int64),
                 helper.make_node("Range", ["zero", "three", "one"], ["rng"]),
                 _c("ax", [0], np.int64),
                 helper.make_node("Unsqueeze", ["three", "ax"], ["u"]),
                 _c("seven", -7, np.int64), _c("two", 2, np.int64),
                 helper.make_node("Div", ["seven", "two"], ["q"]),
                 helper.make_node("ConstantOfShape", ["u"], ["cos"],
                                  value=numpy_helper.from_array(np.array([1.5], np.float32)))],
                inputs=[x])
    assert ix.const_value("target").tolist() == [-1, 4]
    assert ix.const_value("rng").tolist() == [0, 1, 2]
    assert ix.const_value("u").tolist() == [3]
    assert int(ix.const_value("q")) == -3  # ONNX integer Div truncates
    assert ix.const_value("cos").tolist() == [1.5, 1.5, 1.5]
    assert ix.const_value("x") is None  # a graph input is not a constant


def test_a_large_expand_of_a_scalar_stays_a_scalar_view():
    big = [4096, 4096]
    ix = _index([_c("one", 1.0), _c("shape", big, np.int64),
                 helper.make_node("Expand", ["one", "shape"], ["ones"]),
                 _c("half", 0.5),
                 helper.make_node("Mul", ["ones", "half"], ["halves"]),
                 helper.make_node("Cast", ["halves"], ["h16"], to=TensorProto.FLOAT16)])
    for name, want in (("ones", 1.0), ("halves", 0.5), ("h16", 0.5)):
        v = ix.const_value(name)
        assert list(v.shape) == big and v.strides == (0, 0)  # no 16M-element buffer
        assert float(v.flat[0]) == want


def test_large_materialised_results_and_non_constants_are_not_constants():
    n = MAX_ELEMENTS + 1
    ix = _index([_c("a", np.arange(n, dtype=np.float32)),
                 helper.make_node("Neg", ["a"], ["neg"]),  # materialised: over the cap
                 helper.make_node("Add", ["a", "x"], ["y"]),
                 helper.make_node("Identity", ["w"], ["wi"])],
                inputs=[helper.make_tensor_value_info("x", F, [n]),
                        helper.make_tensor_value_info("w", F, [1])],
                inits=[numpy_helper.from_array(np.ones(1, np.float32), "w")])
    assert ix.const_value("neg") is None
    assert ix.const_value("y") is None
    assert ix.const_value("wi") is None  # an initializer that is also a graph input


def test_deep_chains_do_not_recurse():
    nodes = [helper.make_node("Neg", ["t0"], ["t1"])]
    nodes += [helper.make_node("Neg", [f"t{i}"], [f"t{i + 1}"]) for i in range(1, 20000)]
    ix = _index([_c("t0", 2.0)] + nodes)
    assert float(ix.const_value("t20000")) == 2.0
    ix2 = _index(nodes, inputs=[helper.make_tensor_value_info("t0", F, [])])
    assert ix2.const_value("t20000") is None


# --- whole graphs: the same fusions when constants are subgraphs -----------------------------

def _as_constant_subgraphs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every small initializer and Constant output re-expressed as the dynamo optimize=False
    exporter writes constants: a float64/int32 Constant, Cast, arithmetic, Reshape; one-element
    floats as an Expand of a scalar."""
    m = copy.deepcopy(model)
    g = m.graph
    inputs = {i.name for i in g.input}
    values = {t.name: numpy_helper.to_array(t) for t in g.initializer
              if t.name not in inputs and numpy_helper.to_array(t).size <= 16}
    for n in g.node:
        if n.op_type == "Constant" and n.attribute[0].name == "value":
            values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    new_nodes, renamed = [], {}
    for name, v in values.items():
        p = f"cs.{name}."
        dt = helper.np_dtype_to_tensor_dtype(v.dtype)
        if v.dtype.kind == "f":
            new_nodes += [_c(p + "d", v.astype(np.float64) * 2.0, np.float64),
                          helper.make_node("Cast", [p + "d"], [p + "f"], to=dt),
                          _c(p + "two", 2.0, v.dtype),
                          helper.make_node("Div", [p + "f", p + "two"], [p + "v"])]
        else:
            new_nodes += [_c(p + "d", v.astype(np.int32), np.int32),
                          helper.make_node("Cast", [p + "d"], [p + "v"], to=dt)]
        new_nodes.append(_c(p + "shape", list(v.shape), np.int64))
        if v.dtype.kind == "f" and v.size == 1:
            new_nodes += [_c(p + "scalar", [], np.int64),
                          helper.make_node("Reshape", [p + "v", p + "scalar"], [p + "s"]),
                          helper.make_node("Expand", [p + "s", p + "shape"], [p + "out"])]
        else:
            new_nodes.append(helper.make_node("Reshape", [p + "v", p + "shape"], [p + "out"]))
        renamed[name] = p + "out"
    for n in g.node:
        for i, t in enumerate(n.input):
            n.input[i] = renamed.get(t, t)
    nodes = new_nodes + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    return m


def _fused(model):
    fp = FusionPass()
    fp.run(model)
    return {p: s.fused for p, s in fp.stats.patterns.items() if s.fused}


@pytest.mark.parametrize("sample", ["torch_mlp", "torch_block", "torch_v_attn",
                                    "torch_v_gelutanh", "ortt_mlp", "ortt_v_gelutanh"])
def test_constant_subgraphs_fuse_like_constants(sample):
    original = onnx.load(SAMPLES / f"{sample}.onnx")
    model = _as_constant_subgraphs(original)
    assert sum(n.op_type == "Expand" for n in model.graph.node) > 0
    want = _fused(copy.deepcopy(original))
    assert _fused(model) == want and want
    # the constant subgraphs that fed only fused nodes are gone, not left dangling
    used = {t for n in model.graph.node for t in n.input} | {o.name for o in model.graph.output}
    assert all(any(o in used for o in n.output) for n in model.graph.node)
    if sample.startswith("torch"):  # stock onnxruntime runs this family: compare numerically
        feeds = make_feeds(original, manifest_entry_for(SAMPLES / f"{sample}.onnx"))
        want = _run(_as_constant_subgraphs(original), feeds)
        got = _run(model, feeds)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _run(model, feeds):
    import onnxruntime as ort

    so = session_options(opt_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v for k, v in feeds.items()
                           if k in {i.name for i in sess.get_inputs()}})


def test_silu_one_as_an_expand_to_the_activation_shape():
    """The real-size torch-joint Llama: the SiLU gradient's `1` is Expand(1.0, Shape(s)) of the
    [B, S, 4H]-sized activation (static shape recorded), never materialised."""
    m = onnx.load(SAMPLES / "torch_mlp.onnx")
    g = m.graph
    sub = next(n for n in g.node if n.op_type == "Sub"
               and any(c.op_type == "Sigmoid" and c.output[0] == n.input[1] for c in g.node))
    s = sub.input[1]
    g.value_info.append(helper.make_tensor_value_info(s, F, [1024, 4096]))  # "real size"
    nodes = [_c("llama.one", 1.0), helper.make_node("Shape", [s], ["llama.shape"]),
             helper.make_node("Expand", ["llama.one", "llama.shape"], ["llama.ones"])]
    sub.input[0] = "llama.ones"
    at = list(g.node).index(sub)
    for k, n in enumerate(nodes):
        g.node.insert(at + k, n)
    ix = GraphIndex(g)
    v = ix.const_value("llama.ones")
    assert v.shape == (1024, 4096) and v.strides == (0, 0)
    assert _fused(m) == _fused(onnx.load(SAMPLES / "torch_mlp.onnx"))


def test_synthetic_ortt_linear_with_subgraph_axes():
    m = _as_constant_subgraphs(builders.ortt_linear_act("gelu"))
    assert FusionPass().run(m) == 1


def _ones_like_nodes(p, like):
    """torch's raw dynamo spelling of `ones_like(like)` (the SiLU gradient's `1` in a
    torch.onnx.export(..., dynamo=True, optimize=False) graph): full_like through an
    empty_like, each an Expand of a CastLike to the run-time tensor's type, to its Shape."""
    return [_c(p + "zero", 0, np.int64),
            helper.make_node("CastLike", [p + "zero", like], [p + "z"]),
            helper.make_node("Shape", [like], [p + "sh"]),
            helper.make_node("Expand", [p + "z", p + "sh"], [p + "empty"]),
            _c(p + "one", 1, np.int64),
            helper.make_node("CastLike", [p + "one", p + "empty"], [p + "v"]),
            helper.make_node("Shape", [p + "empty"], [p + "sh2"]),
            helper.make_node("Expand", [p + "v", p + "sh2"], [p + "ones"])]


def test_castlike_to_a_runtime_tensor_is_a_constant():
    x = helper.make_tensor_value_info("x", F, [2, 3])
    ix = _index(_ones_like_nodes("a.", "x"), inputs=[x])
    v = ix.const_value("a.ones")
    assert v.dtype == np.float32 and v.shape == (2, 3) and v.strides == (0, 0)
    assert float(v.flat[0]) == 1.0
    assert ix.const_value("x") is None  # the tensor it is cast like stays a run-time value
    # the element type of a tensor with no recorded type, followed back through its producer
    s = helper.make_node("Sigmoid", ["x"], ["s"])
    ix2 = _index([s] + _ones_like_nodes("b.", "s"), inputs=[x])
    assert ix2.const_value("b.ones").dtype == np.float32
    # an unknown element type: not a constant (never guessed)
    y = helper.make_tensor_value_info("y", 0, None)
    ix3 = _index([_c("one", 1, np.int64), helper.make_node("CastLike", ["one", "y"], ["c"])],
                 inputs=[y])
    assert ix3.const_value("c") is None


def test_silu_one_as_raw_ones_like_fuses_and_computes_the_same():
    m = onnx.load(SAMPLES / "torch_mlp.onnx")
    g = m.graph
    subs = [n for n in g.node if n.op_type == "Sub"
            and any(c.op_type == "Sigmoid" and c.output[0] == n.input[1] for c in g.node)]
    assert subs
    for k, sub in enumerate(subs):
        nodes = _ones_like_nodes(f"raw{k}.", sub.input[1])
        sub.input[0] = nodes[-1].output[0]
        at = list(g.node).index(sub)
        for j, n in enumerate(nodes):
            g.node.insert(at + j, n)
    unfused = copy.deepcopy(m)
    assert _fused(m) == _fused(onnx.load(SAMPLES / "torch_mlp.onnx"))
    assert not any(n.output[0].startswith("raw") for n in m.graph.node)  # no dead leftovers
    feeds = make_feeds(unfused, manifest_entry_for(SAMPLES / "torch_mlp.onnx"))
    for w, got in zip(_run(unfused, feeds), _run(m, feeds)):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def _symbolic_heads(record_symbolic: bool = True):
    """TorchScript's head split under dynamic axes: x [batch, seq, 32] viewed as [batch, seq,
    4, 8] through a target built at run time, Concat(Unsqueeze(Gather(Shape(x), 0)),
    Unsqueeze(Gather(Shape(x), 1)), [4], [8]), then transposed to [batch, 4, seq, 8]; the
    exporter records the view's dims as names it made up."""
    x = helper.make_tensor_value_info("x", F, ["batch", "seq", 32])
    vi = [helper.make_tensor_value_info(t, F, [f"unk_{t}_{i}" for i in range(4)])
          for t in ("heads", "heads_t")] if record_symbolic else []
    nodes = [helper.make_node("Shape", ["x"], ["sh"]),
             _c("i0", 0, np.int64), _c("i1", 1, np.int64), _c("ax", [0], np.int64),
             helper.make_node("Gather", ["sh", "i0"], ["b"], axis=0),
             helper.make_node("Gather", ["sh", "i1"], ["s"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]),
             helper.make_node("Unsqueeze", ["s", "ax"], ["s1"]),
             _c("h", [4], np.int64), _c("d", [8], np.int64),
             helper.make_node("Concat", ["b1", "s1", "h", "d"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["heads"]),
             helper.make_node("Transpose", ["heads"], ["heads_t"], perm=[0, 2, 1, 3]),
             helper.make_node("Shape", ["heads_t"], ["sh_t"]),
             _c("m1", [-1], np.int64), _c("big", [2**62], np.int64),
             _c("zero", [0], np.int64), _c("one", [1], np.int64), _c("two", [2], np.int64),
             helper.make_node("Slice", ["sh_t", "m1", "big"], ["last"]),
             helper.make_node("Slice", ["sh_t", "zero", "one"], ["first"]),
             helper.make_node("Slice", ["sh_t", "one", "big", "zero", "two"], ["every_2nd"])]
    return _index(nodes, inputs=[x], value_info=vi)


def test_a_run_time_view_target_gives_its_static_dims_even_where_names_are_recorded():
    """The static entries of a target computed at run time (the heads and head size) replace
    the names the exporter recorded (``refined``; ``shape`` is what is recorded); the
    run-time entries keep their recorded names."""
    ix = _symbolic_heads()
    assert ix.shape_vector("target") == [None, None, 4, 8]
    assert ix.shapes.shape("heads") == [f"unk_heads_{i}" for i in range(4)]
    assert ix.shapes.refined("heads") == ["unk_heads_0", "unk_heads_1", 4, 8]
    assert ix.shapes.refined("heads_t") == ["unk_heads_t_0", 4, "unk_heads_t_2", 8]
    assert ix.shape_vector("sh_t") == [None, 4, None, 8]
    assert _symbolic_heads(record_symbolic=False).shapes.refined("heads_t")[1::2] == [4, 8]


def test_a_slice_of_a_symbolic_shape_is_a_constant_where_it_reads_static_dims():
    """`x.size(-1)` spelled Slice(Shape(x), -1, big) is the head size 8, though batch and
    sequence are symbolic; a slice that reads a symbolic dim, or one with a step, is not a
    constant."""
    ix = _symbolic_heads()
    assert ix.const_value("last").tolist() == [8]
    assert ix.is_constant("last")
    assert ix.const_value("first") is None and not ix.is_constant("first")
    assert ix.const_value("every_2nd") is None


def test_concat_shapes_are_inferred_where_refined():
    a = helper.make_tensor_value_info("a", F, ["n", 3])
    b = helper.make_tensor_value_info("b", F, ["n", 5])
    ix = _index([helper.make_node("Concat", ["a", "b"], ["ab"], axis=1),
                 helper.make_node("Concat", ["a", "a"], ["aa"], axis=0)], inputs=[a, b])
    assert ix.shapes.refined("ab") == ["n", 8]
    assert ix.shapes.refined("aa") == [None, 3]   # n + n: not a static dim


def test_slice_unsqueeze_squeeze_shapes_are_inferred_where_refined_as_onnxruntime_runs_them():
    """Rotate-every-two's pairs under symbolic dims: the even and odd halves of the head dim
    (Slice with step 2 on the static last dim), each unsqueezed to [..., D/2, 1] and stacked.
    ``refined`` gives the static dims onnxruntime computes and keeps the symbolic ones
    unknown; a step-3 slice and a Squeeze back are inferred as they run."""
    extra = [_c("m1a", [-1], np.int64), _c("three", [3], np.int64),
             helper.make_node("Slice", ["heads_t", "zero", "big", "m1a", "two"], ["even"]),
             helper.make_node("Slice", ["heads_t", "one", "big", "m1a", "two"], ["odd"]),
             helper.make_node("Slice", ["heads_t", "one", "big", "m1a", "three"], ["third"]),
             helper.make_node("Unsqueeze", ["even", "m1a"], ["even1"]),
             helper.make_node("Unsqueeze", ["odd", "m1a"], ["odd1"]),
             helper.make_node("Concat", ["even1", "odd1"], ["pairs"], axis=-1),
             helper.make_node("Squeeze", ["even1", "m1a"], ["even_back"])]
    outs = ["even", "odd", "third", "even1", "pairs", "even_back"]
    x = helper.make_tensor_value_info("x", F, ["batch", "seq", 32])
    base = _symbolic_heads(record_symbolic=False)
    nodes = [n.proto for n in base.nodes] + extra
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info(o, F, None)
                                            for o in outs])
    ix = GraphIndex(g)
    want = {"even": [None, 4, None, 4], "odd": [None, 4, None, 4], "third": [None, 4, None, 3],
            "even1": [None, 4, None, 4, 1], "pairs": [None, 4, None, 4, 2],
            "even_back": [None, 4, None, 4]}
    assert {o: ix.shapes.refined(o) for o in outs} == want
    assert all(ix.shapes.shape(o) is None for o in outs)   # refined only (see shapes.py)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        outs, {"x": np.zeros((2, 3, 32), np.float32)})
    for o, arr in zip(outs, got):
        assert [d if w is None else w for d, w in zip(arr.shape, want[o])] == list(arr.shape), o


def test_split_and_broadcast_shapes_are_inferred_where_refined_as_onnxruntime_runs_them():
    """A Split's outputs take the split sizes on their axis; a static dim n > 1 broadcast
    against a symbolic one is n (the other can only be 1 or n where the graph runs: CodeGen's
    rotary half times a cos table viewed through a run-time target). ``shape`` keeps both
    unknown; ``refined`` agrees with onnxruntime on the static dims."""
    x = helper.make_tensor_value_info("x", F, ["batch", "seq", 8])
    y = helper.make_tensor_value_info("y", F, ["batch", "seq", "d"])
    nodes = [_c("sizes", [3, 5], np.int64),
             helper.make_node("Split", ["x", "sizes"], ["lo", "hi"], axis=-1),
             helper.make_node("Mul", ["x", "y"], ["xy"]),
             helper.make_node("Split", ["xy"], ["h1", "h2"], axis=2, num_outputs=2)]
    outs = ["lo", "hi", "xy", "h1", "h2"]
    g = helper.make_graph(nodes, "g", [x, y], [helper.make_tensor_value_info(o, F, None)
                                                for o in outs])
    ix = GraphIndex(g)
    want = {"lo": ["batch", "seq", 3], "hi": ["batch", "seq", 5], "xy": ["batch", "seq", 8],
            "h1": ["batch", "seq", 4], "h2": ["batch", "seq", 4]}
    assert {o: ix.shapes.refined(o) for o in outs} == want
    assert ix.shapes.shape("xy") == ["batch", "seq", None] and ix.shapes.shape("lo") is None
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        outs, {"x": np.zeros((2, 3, 8), np.float32), "y": np.zeros((2, 3, 1), np.float32)})
    for o, arr in zip(outs, got):
        assert list(arr.shape[2:]) == want[o][2:], o
