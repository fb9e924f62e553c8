"""Property test: random training-like graphs built from the pattern fragments of builders.py
(several per graph, some chained, plus random distractor consumers and graph outputs attached
to any of their tensors) go through FusionPass. It never crashes, the result passes
onnx.checker, keeps the graph interface, stays topologically sorted, and a fragment is fused
exactly when nothing outside reads (or exports) one of its critical intermediates."""

from __future__ import annotations

import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import builders
from fusecli import FusionPass
from fusecli.sanity import check_graph

_RULES = None


def _pass():
    global _RULES
    from fusecli.rules import load_rules

    if _RULES is None:
        _RULES = load_rules()
    return FusionPass(rules=_RULES)


@st.composite
def fragment_specs(draw):
    kind = draw(st.sampled_from(["linear", "linear", "layernorm"]))
    if kind == "linear":
        return ("linear", draw(st.sampled_from(["relu", "gelu", "silu"])), draw(st.booleans()),
                draw(st.booleans()), draw(st.booleans()), draw(st.booleans()))
    return ("layernorm", draw(st.booleans()))


def _build(spec, i):
    p = f"f{i}/"
    if spec[0] == "linear":
        _, act, first, bias, identity, _chain = spec
        return builders.frag_ortt_linear_act(p, act, first=first, bias=bias, identity=identity,
                                             M=6, N=5, K=5)
    return builders.frag_ortt_layernorm(p, residual=spec[1])


def _dtype(t):
    return onnx.TensorProto.INT64 if t.endswith("axes0") else onnx.TensorProto.FLOAT


@st.composite
def graphs(draw):
    specs = draw(st.lists(fragment_specs(), min_size=1, max_size=5))
    frags = [_build(s, i) for i, s in enumerate(specs)]
    # chain: a linear fragment's incoming gradient is the previous fragment's outgoing one
    for i in range(1, len(frags)):
        prev, cur = frags[i - 1], frags[i]
        if specs[i][0] == "linear" and specs[i][-1] and prev.out_grad and prev.kind != "layernorm":
            old = cur.dy
            cur.inputs = [v for v in cur.inputs if v.name != old]
            for n in cur.nodes:
                for k, x in enumerate(n.input):
                    if x == old:
                        n.input[k] = prev.out_grad
            cur.dy = prev.out_grad
    # distractors on any tensor of any fragment
    targets = [(fi, t) for fi, f in enumerate(frags) for t in f.tensors]
    inter = [(fi, t) for fi, f in enumerate(frags) for t in f.critical + f.soft]
    where = st.one_of(st.sampled_from(targets), st.sampled_from(inter)) if inter else \
        st.sampled_from(targets)
    picks = draw(st.lists(st.tuples(where, st.sampled_from(["consumer", "graph_output"])),
                          max_size=4, unique_by=lambda x: x[0][1]))
    extra_nodes, extra_outputs = [], []
    declared = {v.name for f in frags for v in f.outputs + f.inputs} | {
        t.name for f in frags for t in f.inits}
    touched: set[str] = set()
    for k, ((fi, t), how) in enumerate(picks):
        touched.add(t)
        if how == "consumer":
            extra_nodes.append(helper.make_node("Neg", [t], [f"d{k}/out"], name=f"d{k}/neg"))
            extra_outputs.append(helper.make_tensor_value_info(f"d{k}/out", _dtype(t), ["n"]))
        elif t not in declared:
            # declared with its true rank: a wrong one would rightly make the shape guard
            # refuse a fused op that writes the tensor (the undeclared 1-D ones: bias grads)
            rank = 1 if t.rsplit("/", 1)[1] in ("db_raw", "db", "axes0") else 2
            extra_outputs.append(helper.make_tensor_value_info(t, _dtype(t), ["n", "m"][:rank]))
    m = builders.compose(frags, extra_nodes, extra_outputs)
    expected = {f.anchor: not (set(f.critical) & touched) for f in frags}
    return m, expected


def _interface(g):
    return ([(v.name, v.type.SerializeToString()) for v in g.input],
            [(v.name, v.type.SerializeToString()) for v in g.output])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_fusion_pass_properties(case):
    m, expected = case
    onnx.checker.check_model(m)
    before = _interface(m.graph)
    fp = _pass()
    fp.run(m)                                   # never raises
    onnx.checker.check_model(m)                 # custom domains have opset_import entries
    assert any(o.domain == "com.fusecli" for o in m.opset_import) == (fp.stats.total_fused > 0)
    assert _interface(m.graph) == before
    check_graph(m)                              # topologically sorted, nothing dangling
    available = {v.name for v in m.graph.input} | {t.name for t in m.graph.initializer}
    for n in m.graph.node:
        assert all(x in available for x in n.input if x), n.name
        available.update(n.output)
    alive = {n.name for n in m.graph.node}
    fused = {a for a in expected if a not in alive}
    assert fused == {a for a, ok in expected.items() if ok}
    assert fp.stats.total_fused == len(fused)
