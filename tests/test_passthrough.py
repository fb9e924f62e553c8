"""Pass-through nodes between the nodes of a chain.

A raw dynamo export (`torch.onnx.export(..., dynamo=True, optimize=False)`) keeps torch's
detach / clone / alias as Identity nodes and views that change nothing as Reshape or Expand to
the input's own shape. FusionPass takes such nodes out of its index (GraphIndex.
bypass_passthrough) so that rules see the dataflow without them, and puts back at write-back the
ones the result still reads. These tests thread pass-through nodes through every tensor of real
samples: the same chains must fuse, the result must be a valid graph that computes what the
unfused one does (onnxruntime, graph optimizations off), and the pass-through nodes that only
fused nodes read must be gone.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import SAMPLES

from fusecli import FusionPass
from fusecli.runtime.feeds import make_feeds
from fusecli.engine.graph import GraphIndex
from fusecli.runtime.library import session_options
from fusecli.runtime.verify import manifest_entry_for

F = TensorProto.FLOAT
KINDS = ("Identity", "Reshape", "Expand")


def _shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    out = {}
    for v in list(g.value_info) + list(g.input) + list(g.output):
        t = v.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            out[v.name] = [d.dim_value for d in t.shape.dim]
    return out


def with_passthrough(model: onnx.ModelProto, every: int = 1) -> onnx.ModelProto:
    """Every `every`-th node output of static shape that another node reads goes through a
    pass-through node (Identity, Reshape to its own shape, Expand to its own shape, in
    rotation) before its readers see it; the pass-through output carries no value_info (as in
    a raw export)."""
    m = copy.deepcopy(model)
    g = m.graph
    shapes = _shapes(model)
    outputs = {o.name for o in g.output}
    read = {t for n in g.node for t in n.input}
    nodes, renamed, k = [], {}, 0
    for n in g.node:
        for i, t in enumerate(n.input):
            n.input[i] = renamed.get(t, t)
        nodes.append(n)
        for t in n.output:
            if not t or t not in read or t in outputs or t not in shapes or n.domain not in (
                    "", "ai.onnx") and n.op_type not in ("FusedMatMul",):
                continue
            k += 1
            if k % every:
                continue
            kind = KINDS[k % len(KINDS)]
            new = f"pt{k}.{t}"
            if kind == "Identity":
                nodes.append(helper.make_node("Identity", [t], [new], name=f"pt{k}"))
            else:
                shape = numpy_helper.from_array(np.asarray(shapes[t], np.int64), f"pt{k}.s")
                nodes.append(helper.make_node("Constant", [], [f"pt{k}.shape"], value=shape))
                nodes.append(helper.make_node(kind, [t, f"pt{k}.shape"], [new], name=f"pt{k}"))
            renamed[t] = new
    del g.node[:]
    g.node.extend(nodes)
    return m


def _check_sorted(model: onnx.ModelProto) -> None:
    """Every node input is a graph input, an initializer or an earlier node's output (the
    checker's test, without its op registry: ort-training graphs carry ops it does not know)."""
    g = model.graph
    known = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    for n in g.node:
        missing = [t for t in n.input if t not in known]
        assert not missing, f"{n.name} reads {missing} before they are produced"
        known.update(n.output)
    assert all(o.name in known for o in g.output)


def _fused(model) -> dict[str, int]:
    fp = FusionPass()
    fp.run(model)
    return {p: s.fused for p, s in fp.stats.patterns.items() if s.fused}


def _run(model, feeds):
    import onnxruntime as ort

    so = session_options(opt_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


@pytest.mark.parametrize("sample", ["torch_mlp", "torch_block", "torch_v_attn", "torch_llama",
                                    "torch_v_gelutanh"])
@pytest.mark.parametrize("every", [1, 3])
def test_passthrough_nodes_between_chain_nodes_fuse_the_same(sample, every):
    original = onnx.load(SAMPLES / f"{sample}.onnx")
    unfused = with_passthrough(original, every)
    n_pt = sum(n.name.startswith("pt") for n in unfused.graph.node)
    assert n_pt > 10
    want = _fused(copy.deepcopy(original))
    fused = copy.deepcopy(unfused)
    assert _fused(fused) == want and want
    onnx.checker.check_model(fused)  # topologically sorted, every input defined
    _check_sorted(fused)
    # pass-through nodes that only fused nodes read are gone; the others stay
    fused_nodes = [n for n in fused.graph.node if n.domain == "com.fusecli"]
    kept = [n for n in fused.graph.node if n.name.startswith("pt")]
    assert len(kept) < n_pt
    read = {t for n in fused.graph.node for t in n.input} | {o.name for o in fused.graph.output}
    assert all(n.output[0] in read for n in kept)
    assert all(not t.startswith("pt") for n in fused_nodes for t in n.input)
    # a pass-through node is not kept just to rename a fused output nothing else reads: the
    # fused node writes the pass-through node's output name itself
    fused_out = {t for n in fused_nodes for t in n.output}
    readers = [t for n in fused.graph.node for t in n.input]
    assert not [n.name for n in kept if n.input[0] in fused_out and readers.count(n.input[0]) == 1]
    feeds = make_feeds(original, manifest_entry_for(SAMPLES / f"{sample}.onnx"))
    for w, g in zip(_run(unfused, feeds), _run(fused, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_ortt_identity_chains_fuse_the_same():
    """ort-training gradients carry Identity nodes the rules list as optional pass-throughs;
    extra ones anywhere change nothing."""
    for sample in ("ortt_mlp", "ortt_block"):
        original = onnx.load(SAMPLES / f"{sample}.onnx")
        want = _fused(copy.deepcopy(original))
        model = with_passthrough(original, 2)
        assert _fused(model) == want and want
        _check_sorted(model)


def _index(nodes, inputs, outputs=(), value_info=()):
    g = helper.make_graph(nodes, "g", list(inputs), list(outputs), value_info=list(value_info))
    return GraphIndex(g)


def test_which_nodes_are_bypassed():
    x = helper.make_tensor_value_info("x", F, [2, 3])
    out = helper.make_tensor_value_info("idg", F, [2, 3])
    c = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(
        np.asarray(v, np.int64), n + "_v")) for n, v in
        (("same", [2, 3]), ("flat", [6]), ("big", [4, 2, 3]), ("bcast", [1, 3]))]
    ix = _index(c + [
        helper.make_node("Identity", ["x"], ["id"]),
        helper.make_node("Reshape", ["id", "same"], ["r_same"]),
        helper.make_node("Reshape", ["r_same", "flat"], ["r_flat"]),       # changes the shape
        helper.make_node("Expand", ["x", "big"], ["e_big"]),               # broadcasts
        helper.make_node("Expand", ["x", "bcast"], ["e_same"]),            # [2,3] stays [2,3]
        helper.make_node("Identity", ["x"], ["idg"]),                      # a graph output
        helper.make_node("Add", ["r_flat", "r_flat"], ["y1"]),
        helper.make_node("Add", ["e_big", "e_same"], ["y2"]),
    ], [x], [out])
    assert ix.bypass_passthrough() == 3
    assert sorted(n.outputs[0] for n in ix.bypassed) == ["e_same", "id", "r_same"]
    add2 = ix.producer["y2"]
    assert add2.inputs == ["e_big", "x"] and add2.proto.input == ["e_big", "e_same"]
    assert ix.producer["r_flat"].inputs[0] == "x"
    assert "idg" in ix.producer


def test_restored_node_moves_after_the_fused_node_that_now_feeds_it():
    """A pass-through node that read a fused-away node's output, still read by an unfused node,
    comes back after the fused node that produces its input now (a fused node is placed before
    its first reader, which may be after the pass-through node's old place)."""
    x = helper.make_tensor_value_info("x", F, [2])
    nodes = [helper.make_node("Neg", ["x"], ["a"], name="p"),
             helper.make_node("Identity", ["a"], ["a_id"], name="id"),
             helper.make_node("Abs", ["x"], ["b"], name="q"),
             helper.make_node("Exp", ["a_id"], ["y"], name="r")]
    ix = _index(nodes, [x])
    ix.bypass_passthrough()
    p = ix.producer["a"]
    ix.remove_node(p)
    fused = ix.add_node(helper.make_node("Neg", ["x"], ["a"], name="f"), 2.5)  # after q
    back = ix.restore_bypassed(ix.alive_nodes())
    assert [n.name for n in back] == ["id"]
    order = [n.name for n in ix.alive_nodes()]
    assert order.index("f") < order.index("id") < order.index("r")
    assert fused.key < back[0].key
