"""The matcher's search: backjumping prunes only what cannot match.

FusionPass's matcher (explain=False) returns from a failed subtree straight to the latest rule
node the failure depends on (conflict-directed backjumping, Matcher._search); explain's matcher
tries every binding. These tests check that the two find the same thing on real graphs, and
that the pruning turns the exponential search over optional branches into a linear one.
"""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from builders import model, vi
from conftest import REPO, SAMPLES

from fusecli import load_rules
from fusecli.engine.fusion import has_required_ops
from fusecli.engine.graph import GraphIndex
from fusecli.engine.matcher import Matcher
from fusecli.engine.rules import parse_rule

K = 6  # optional branch nodes in the synthetic rule


def _rule(name: str, nodes: list[str]):
    """A rule of these nodes (YAML flow mappings) with a stand-in replacement: these tests look
    at the search, not at the fused op."""
    return parse_rule("\n".join([
        f"name: {name}", f"pattern: {name}", "order: 1", "nodes:", *(f"  - {n}" for n in nodes),
        "replace: {op: ActivationGrad, inputs: [x, x], outputs: [v], attrs: {activation: relu}}"]),
        f"{name}.yaml")


def _branches_rule():
    """A ReLU whose output K optional Neg branches may read, then Sigmoid -> Exp."""
    return _rule("branches", ["{id: a, op: Relu, inputs: [x], outputs: [y]}",
                              *(f"{{id: b{k}, op: Neg, inputs: [y], outputs: [z{k}], "
                                "optional: true}" for k in range(K)),
                              "{id: c, op: Sigmoid, inputs: [y], outputs: [w]}",
                              "{id: d, op: Exp, inputs: [w], outputs: [v]}"])


def _branches_graph(last: str) -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    nodes += [helper.make_node("Neg", ["y"], [f"n{k}"], name=f"neg{k}") for k in range(K)]
    nodes += [helper.make_node("Sigmoid", ["y"], ["w"], name="sig"),
              helper.make_node(last, ["w"], ["v"], name="last")]
    return model(nodes, [vi("x", [2, 3])], [vi("v", [2, 3])], ms=False)


def _count_binds(monkeypatch) -> list[int]:
    calls = [0]
    bind = Matcher._bind

    def counted(self, *args):
        calls[0] += 1
        yield from bind(self, *args)

    monkeypatch.setattr(Matcher, "_bind", counted)
    return calls


def test_backjumping_skips_the_optional_branches_a_failure_does_not_depend_on(monkeypatch):
    rule = _branches_rule()  # the graph has the Negs, but a Tanh where the rule wants Exp
    index = GraphIndex(_branches_graph("Tanh").graph)
    anchor = index.candidates("Relu", "")[0]
    calls = _count_binds(monkeypatch)
    full = Matcher(index, rule, explain=True).match_at(anchor)
    exhaustive = calls[0]
    calls[0] = 0
    fast = Matcher(index, rule, explain=False)
    res = fast.match_at(anchor)
    # every optional Neg may take any free Neg or be absent: ~10^5 combinations, each failing
    # at d; d's failure depends on c's binding alone and c's on a's, so the pruned search binds
    # each branch once (each trying the Negs the earlier ones left) and returns
    assert exhaustive > 10_000
    assert calls[0] <= (K + 1) * (K + 2) // 2 + 3, calls[0]
    assert res.match is None and full.match is None
    assert fast.reached == len(rule.nodes) - 1


def test_backjumping_still_finds_the_match():
    rule = _branches_rule()
    index = GraphIndex(_branches_graph("Exp").graph)
    res = Matcher(index, rule, explain=False).match_at(index.candidates("Relu", "")[0])
    assert res.match is not None
    # the branches bind first-found, present before absent: each Neg to one branch
    assert sorted(res.match.nodes[f"b{k}"].name for k in range(K)) == [f"neg{k}"
                                                                         for k in range(K)]


def test_a_candidate_taken_by_an_earlier_node_is_a_conflict_with_that_node():
    # b takes the first Neg (the one Exp reads); c can only take the other, whose reader is a
    # Tanh, and fails at d. That failure depends on b having taken the first Neg: the search
    # must go back to b (which then takes the second Neg, or is absent), not past it.
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"),
             helper.make_node("Neg", ["y"], ["n1"], name="neg_exp"),
             helper.make_node("Neg", ["y"], ["n0"], name="neg_tanh"),
             helper.make_node("Exp", ["n1"], ["v"], name="exp"),
             helper.make_node("Tanh", ["n0"], ["t"], name="tanh")]
    g = model(nodes, [vi("x", [2, 3])], [vi("v", [2, 3]), vi("t", [2, 3])], ms=False)
    index = GraphIndex(g.graph)
    rule = _rule("taken", ["{id: a, op: Relu, inputs: [x], outputs: [y]}",
                           "{id: b, op: Neg, inputs: [y], outputs: [z1], optional: true}",
                           "{id: c, op: Neg, inputs: [y], outputs: [z2]}",
                           "{id: d, op: Exp, inputs: [z2], outputs: [v]}"])
    res = Matcher(index, rule, explain=False).match_at(index.candidates("Relu", "")[0])
    # found: b = neg_tanh, c = neg_exp (then refused by the guard: tanh reads b's output)
    assert res.structural
    assert res.guard_failure.bound == {"a": "relu", "b": "neg_tanh", "c": "neg_exp", "d": "exp"}


# every sample and test graph: optional branches (frozen weights, LoRA, absent attention
# gradients), raw exports (constants by value), both families
GRAPHS = sorted(str(p) for p in (*SAMPLES.glob("*.onnx"), *(REPO / "tests" / "data").glob("*.onnx"))
                if ".fused." not in p.name)


def _outcome(m: Matcher, anchor) -> tuple:
    res = m.match_at(anchor)
    match = None if res.match is None else (
        sorted((k, n.uid) for k, n in res.match.nodes.items()), sorted(res.match.tensors.items()))
    guard = None if res.guard_failure is None else (res.guard_failure.reason,
                                                    res.guard_failure.detail)
    return match, res.structural, guard, m.reached


@pytest.mark.parametrize("path", GRAPHS, ids=lambda p: p.rsplit("/", 1)[-1])
def test_the_pruned_search_finds_what_the_exhaustive_search_finds(path):
    index = GraphIndex(onnx.load(path).graph)
    index.bypass_passthrough()
    present = lambda d, op: bool(index.by_op.get((d, op)))  # noqa: E731
    tried = 0
    for rule in load_rules():
        if not has_required_ops(rule, present):
            continue
        spec = rule.anchor
        fast, full = Matcher(index, rule, explain=False), Matcher(index, rule, explain=True)
        for anchor in (n for op in spec.ops for d in spec.alt(op).domains
                       for n in index.candidates(op, d)):
            assert _outcome(fast, anchor) == _outcome(full, anchor), (rule.name, anchor.name)
            tried += 1
    assert tried


def test_attribute_defaults_are_asked_of_onnx_only_for_its_domains():
    """Matcher reads an absent attribute's default from onnx.defs only for the domains onnx
    describes (its first lookup loads onnx's whole schema registry)."""
    import onnx.defs

    from fusecli.engine import matcher

    domains = {s.domain for s in onnx.defs.get_all_schemas_with_history()}
    assert domains == matcher._ONNX_DOMAINS
    assert matcher._op_default("ReduceSum", "", "keepdims") == 1
    assert matcher._op_default("ActivationGrad", "com.fusecli", "alpha") is None


def test_a_guard_that_refuses_every_binding_stops_the_search_after_max_bindings():
    """An intermediate of a grouped-kv flash attention (tests/data/torch_flash_sdpa_math_all:
    the [B*H] view of the scores) also read outside: the guard refuses every complete binding,
    and each combination of the rule's optional views is one (122,241 of them at one anchor,
    5 s, before the bound). The search stops after MAX_BINDINGS; the chain stays unfused with
    the guard's reason, and the other layers still fuse."""
    from fusecli.engine import matcher as M

    m = onnx.load(REPO / "tests" / "data" / "torch_flash_sdpa_math_all.onnx")
    m.graph.node.append(helper.make_node("Identity", ["_unsafe_view_17"], ["reader_out"],
                                         name="reader"))
    m.graph.output.append(helper.make_tensor_value_info("reader_out", TensorProto.FLOAT, None))
    rule = next(r for r in load_rules() if r.name == "flash_torch_gqa_mask_safe")
    index = GraphIndex(m.graph)
    index.bypass_passthrough()
    matcher = Matcher(index, rule, explain=False)
    anchors = index.candidates("Softmax", "")
    results = [(a, matcher.match_at(a), matcher._bindings) for a in anchors]
    refused = [(r, b) for a, r, b in results if r.match is None and r.structural]
    assert refused and all(b == M.MAX_BINDINGS for _, b in refused)
    assert all(r.guard_failure.reason == "intermediate_consumed_outside" for r, _ in refused)
    assert any(r.match is not None for _, r, _ in results)
