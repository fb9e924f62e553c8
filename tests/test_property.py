"""Property test: random training-like graphs built from the pattern fragments of builders.py
(several per graph, some chained, plus random distractor consumers and graph outputs attached
to any of their tensors) go through FusionPass. It never crashes, the result passes
onnx.checker, keeps the graph interface, stays topologically sorted, and a fragment is fused
exactly when nothing outside reads (or exports) one of its critical intermediates."""

from __future__ import annotations

import contextlib
import io
import signal
import tempfile
from pathlib import Path

import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import builders
from conftest import REPO, SAMPLES
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
            extra_outputs.append(helper.make_tensor_value_info(t, _dtype(t), ["n"]))
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


# --- fuzzing: hostile model bytes and rule YAML (issue 11) -------------------------------------
# Every input, however mangled, ends in exit 0 or in exit 2 with ONE 'fusecli: error:' line:
# never a traceback, never exit 4. The CLI runs in-process (the console script's main()) so
# that a few dozen examples take seconds.

_FUZZ_MODELS = [SAMPLES / "ortt_mlp.onnx", SAMPLES / "torch_v_gelutanh.onnx"]
_GOOD_RULE = (REPO / "rules" / "linear_relu_ortt_gemm.yaml").read_text()
_YAML_TOKENS = ["&a ", "*a", "[", "]", "{", "}", "- ", ": ", ", ", "\n", "  ", "!!python/name:os.system",
                "!!binary AAAA", "1e999", "9" * 5000, ".nan", "null", "~", "<<: *a", "? ", "|",
                "\t", "'", '"', "#", "2001-13-45", "0x1F", "yes", "op", "attrs", "inputs",
                "outputs", "replace", "nodes", "tensors", "const", "kind", "one_of", "if_matched",
                "\x00", "\x1b[31m", "é"]


def _cli(*argv) -> tuple[int, str]:
    """fusecli's main() in-process: (exit code, stderr). Signal handlers are restored after."""
    from fusecli.cli import main

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([str(a) for a in argv])
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return rc, err.getvalue()


def _exit_0_or_one_line(rc: int, err: str) -> None:
    assert rc in (0, 2), (rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fusecli: error: "), err


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(_FUZZ_MODELS),
       flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                      max_size=12),
       cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzzed_model_bytes(which, flips, cut):
    data = bytearray(which.read_bytes())
    for where, value in flips:
        data[int(where * len(data))] = value
    if cut is not None:
        data = data[: int(cut * len(data))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.onnx"
        path.write_bytes(bytes(data))
        rc, err = _cli("stats", path, "--json")
        _exit_0_or_one_line(rc, err)
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["fuzz.onnx"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 40),
                                st.sampled_from(_YAML_TOKENS)), min_size=1, max_size=6))
def test_fuzzed_rule_yaml(edits):
    text = _GOOD_RULE
    for where, drop, token in edits:
        i = int(where * len(text))
        text = text[:i] + token + text[i + drop:]
    with tempfile.TemporaryDirectory() as tmp:
        rule = Path(tmp) / "rule.yaml"
        rule.write_text(text, encoding="utf-8", errors="surrogateescape")
        rc, err = _cli("rules", "validate", rule)
        _exit_0_or_one_line(rc, err)
