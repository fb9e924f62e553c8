"""Property test: random training-like graphs built from the pattern fragments of builders.py
(several per graph, some chained, plus random distractor consumers and graph outputs attached
to any of their tensors) go through FusionPass. It never crashes, the result passes
onnx.checker, keeps the graph interface, stays topologically sorted, and a fragment is fused
exactly when nothing outside reads (or exports) one of its critical intermediates."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import helper

import builders
from conftest import REPO, cli_in_process, exit_0_or_one_line, fuzz_examples
from fusecli import FusionPass
from fusecli.engine.sanity import check_graph

_RULES = None


def _pass():
    global _RULES
    from fusecli.io.rulefiles import load_rules

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


def _compose(specs, choose):
    """The graph of fragments ``specs`` (fragment_specs' tuples) with distractors: ``choose``
    (the strategy's draw, or a fixed list for a regression case) picks, from the candidates
    (fragment index, tensor), up to four (target, 'consumer' | 'graph_output')."""
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
    picks = choose(targets, inter)
    extra_nodes, extra_outputs = [], []
    declared = {v.name for f in frags for v in f.outputs + f.inputs} | {
        t.name for f in frags for t in f.inits}
    touched: set[str] = set()
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for f in frags for v in f.inputs + f.outputs}
    shapes.update({i.name: list(i.dims) for f in frags for i in f.inits})
    for f in frags:
        shapes.update(f.shapes)
    for k, ((_fi, t), how) in enumerate(picks):
        touched.add(t)
        # declared with their real shapes: the shape guard trusts what a graph declares
        if how == "consumer":
            extra_nodes.append(helper.make_node("Neg", [t], [f"d{k}/out"], name=f"d{k}/neg"))
            extra_outputs.append(helper.make_tensor_value_info(f"d{k}/out", _dtype(t), shapes[t]))
        elif t not in declared:
            extra_outputs.append(helper.make_tensor_value_info(t, _dtype(t), shapes[t]))
    m = builders.compose(frags, extra_nodes, extra_outputs)
    expected = {f.anchor: not (set(f.critical) & touched) for f in frags}
    return m, expected


@st.composite
def graphs(draw):
    specs = draw(st.lists(fragment_specs(), min_size=1, max_size=5))

    def choose(targets, inter):
        where = st.one_of(st.sampled_from(targets), st.sampled_from(inter)) if inter else \
            st.sampled_from(targets)
        return draw(st.lists(st.tuples(where, st.sampled_from(["consumer", "graph_output"])),
                             max_size=4, unique_by=lambda x: x[0][1]))

    return _compose(specs, choose)


def _fixed(*picks):
    """A regression case's distractors: (fragment index, tensor, how), tensor named without
    its fragment prefix."""
    return lambda targets, inter: [((fi, f"f{fi}/{t}"), how) for fi, t, how in picks]


def _interface(g):
    return ([(v.name, v.type.SerializeToString()) for v in g.input],
            [(v.name, v.type.SerializeToString()) for v in g.output])


_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
_LIN = ("linear", "relu", False, True, True, False)      # fragment_specs' tuples
_LIN_GELU_CHAINED = ("linear", "gelu", True, True, True, True)


# every example a property test found is kept as an explicit case (issue 33; they run first, in
# `make test` and `make fuzz` alike): distractor outputs declared with their real shapes (the
# shape guard trusts declared shapes) on a critical and on a soft intermediate
@settings(max_examples=fuzz_examples(50), **_SETTINGS)
@given(graphs())
@example(_compose([_LIN], _fixed((0, "dZ", "consumer"))))
@example(_compose([_LIN, _LIN_GELU_CHAINED, ("layernorm", True)],
                  _fixed((0, "db_raw", "graph_output"), (1, "dZ", "graph_output"),
                         (2, "dX0", "consumer"))))
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


# --- fuzzing: hostile models and rule YAML (issue 11) ------------------------------------------
# Every input, however mangled, ends in exit 0 or in exit 2 with ONE 'fusecli: error:' line:
# never a traceback, never exit 4, nothing written beside the input. The CLI runs in-process
# (the console script's main()) so that a few dozen examples take seconds.

_GOOD_RULE = (REPO / "rules" / "linear_act_ortt_gemm.yaml").read_text()
_HOSTILE_VALUES = ["9" * 5000, "2001-13-45", "[" * 3000 + "]" * 3000, "*undefined", "&x [*x]",
                   "[1, {a: 2}]", "null", "{attr: [1]}", "{const: [x]}", ".nan", "-.inf",
                   "!!binary AAAA", "yes", "1e999", "''", "{}", "[]", "!!python/name:os.system",
                   "\"\\x00\"", "\"a\\nb\"", "0x7fffffffffffffffffff", "{if_matched: act}"]
_YAML_TOKENS = ["&a ", "*a", "[", "]", "{", "}", "- ", ": ", ", ", "\n", "  ", "\t", "'", '"',
                "#", "<<: *a", "? ", "|", "\x00", "\x1b[31m", "é"]
_VALUE_STARTS = [i + 2 for i in range(len(_GOOD_RULE)) if _GOOD_RULE.startswith(": ", i)]


@settings(max_examples=fuzz_examples(60), **_SETTINGS)
# found: a replace.op that is not a string (a rule error, not an internal one)
@example(values=[(_GOOD_RULE.index("op: LinearActivationGrad") + 4, "[1, {a: 2}]")], edits=[])
@given(values=st.lists(st.tuples(st.sampled_from(_VALUE_STARTS), st.sampled_from(_HOSTILE_VALUES)),
                       min_size=1, max_size=2),
       edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 20),
                                st.sampled_from(_YAML_TOKENS)), max_size=3))
def test_fuzzed_rule_yaml(values, edits):
    """Hostile values where the rule has values (the value up to the next ',', '}' or line end
    is replaced), then random token edits."""
    text = _GOOD_RULE
    for start, value in sorted(values, reverse=True):
        end = start
        while end < len(text) and text[end] not in ",}\n":
            end += 1
        text = text[:start] + value + text[end:]
    for where, drop, token in edits:
        i = int(where * len(text))
        text = text[:i] + token + text[i + drop:]
    with tempfile.TemporaryDirectory() as tmp:
        rule = Path(tmp) / "rule.yaml"
        rule.write_text(text, encoding="utf-8", errors="surrogateescape")
        rc, err = cli_in_process("rules", "validate", rule)
        exit_0_or_one_line(rc, err)


def _weights_model(folder: Path) -> onnx.ModelProto:
    """The ortt Linear+ReLU chain with A and W stored in 'weights.bin' beside it."""
    import numpy as np
    from onnx import numpy_helper

    m = builders.ortt_linear_act("relu", M=8, N=4, K=6)
    keep = [i for i in m.graph.input if i.name not in ("A", "W")]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    rng = np.random.default_rng(0)
    m.graph.initializer.extend([
        numpy_helper.from_array(rng.standard_normal((8, 6)).astype(np.float32), "A"),
        numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "W")])
    onnx.save_model(m, folder / "m.onnx", save_as_external_data=True, location="weights.bin",
                    all_tensors_to_one_file=True, size_threshold=0)
    return onnx.load(folder / "m.onnx", load_external_data=False)


_LOCATIONS = ["../weights.bin", "/etc/hostname", "weights.bin/x", "", "x" * 300, "a\nb",
              "missing.bin", "./weights.bin", "sub/../weights.bin", "\\weights.bin", "."]
_NUMBERS = ["-1", "0", "7", "99999999999999999999999", "abc", "", "1e3", " 8", "9" * 5000]


def _mutate(m: onnx.ModelProto, kind: str, k: int, pick: str) -> None:
    g = m.graph
    inits = list(g.initializer)
    t = inits[k % len(inits)]
    node = g.node[k % len(g.node)]
    vis = list(g.input) + list(g.output) + list(g.value_info)
    if kind == "location":
        for e in t.external_data:
            if e.key == "location":
                e.value = _LOCATIONS[k % len(_LOCATIONS)]
    elif kind in ("offset", "length"):
        t.data_location = onnx.TensorProto.EXTERNAL
        kept = [e for e in t.external_data if e.key != kind]
        del t.external_data[:]
        t.external_data.extend(kept)
        t.external_data.add(key=kind, value=pick)
    elif kind == "dims":
        t.dims[:] = [int(x) if x.lstrip("-").isdigit() and len(x) < 20 else -1
                     for x in pick.split()] or [-1]
    elif kind == "tensor_type":
        t.data_type = k % 25
    elif kind == "value_type" and vis:
        vis[k % len(vis)].type.tensor_type.elem_type = k % 25
    elif kind == "value_dim" and vis:
        shape = vis[k % len(vis)].type.tensor_type.shape
        if shape.dim:
            shape.dim[0].dim_value = [0, 1, 2**62, 2**40][k % 4]
    elif kind == "rename":
        node.output[0] = g.node[(k + 1) % len(g.node)].output[0]
    elif kind == "opset":
        m.opset_import[k % len(m.opset_import)].version = [0, 1, 99, -5][k % 4]
    elif kind == "name":
        node.name = pick + "\n\x1b" + node.name


def _in(token: bytes, offset: int = 2) -> float:
    """A flip position (test_fuzzed_models' float) at byte ``offset`` of the first ``token`` in
    the serialized _weights_model (mutations that change no length leave it there)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = _weights_model(Path(tmp)).SerializeToString()
    return (data.index(token) + offset + 0.5) / len(data)


@settings(max_examples=fuzz_examples(40), **_SETTINGS)
# found by the property tests (kept as explicit cases): an initializer of an undefined element
# type; a non-UTF-8 external-data location; (issue 33, `make test` red) an initializer's element
# type changed and one byte flipped inside an op type (0xFF: not UTF-8), which reached the
# gradient-node check as bytes (exit 4); the same flip in a node output and in a node name;
# (make fuzz, 2000 examples) a small external initializer retyped STRING, read in as raw bytes
# that numpy_helper could not shape (exit 4)
@example(mutations=[("tensor_type", 0, "0")], flips=[])
@example(mutations=[], flips=[(_in(b"weights.bin"), 0xFF)])
@example(mutations=[("tensor_type", 8, "0")], flips=[(_in(b"ReluGrad"), 0xFF)])
@example(mutations=[("tensor_type", 1, "0")], flips=[(_in(b"ReluGrad"), 0xFF)])
@example(mutations=[], flips=[(_in(b"dZ", 1), 0xC3)])
@example(mutations=[], flips=[(_in(b"act_grad", 0), 0xFE)])
@example(mutations=[("tensor_type", 633, "-1")], flips=[])
@given(mutations=st.lists(st.tuples(st.sampled_from(
           ["location", "offset", "length", "dims", "tensor_type", "value_type", "value_dim",
            "rename", "opset", "name"]), st.integers(0, 1000), st.sampled_from(_NUMBERS)),
           min_size=1, max_size=3),
       flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                      max_size=4))
def test_fuzzed_models(mutations, flips):
    """A model with external data, mutated where the proto has meaning (locations, offsets,
    lengths, dims, element types, names, opsets), then a few random bytes flipped."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "in"
        folder.mkdir()
        m = _weights_model(folder)
        for kind, k, pick in mutations:
            _mutate(m, kind, k, pick)
        data = bytearray(m.SerializeToString())
        for where, value in flips:
            data[int(where * len(data))] = value
        (folder / "m.onnx").write_bytes(bytes(data))
        before = sorted(p.name for p in Path(tmp).rglob("*"))
        rc, err = cli_in_process("stats", folder / "m.onnx", "--json")
        exit_0_or_one_line(rc, err)
        rc, err = cli_in_process("optimize", folder / "m.onnx", "-o", Path(tmp) / "out.onnx")
        exit_0_or_one_line(rc, err)
        after = sorted(p.name for p in Path(tmp).rglob("*"))
        assert after == before + (["out.onnx", "out.onnx.data"] if rc == 0 else []) or (
            rc == 0 and after == sorted([*before, "out.onnx"])), after
