"""Gated MLPs (swiglu, geglu: rules/swiglu_geglu_{ortt,torch}.yaml -> GatedActivationGrad).

Positive fixtures: real exports of two residual gated-MLP blocks in both families
(tests/data/make_gated_mlp.py: LlamaMLP with SiLU, erf-GELU, tanh-GELU and gelu_new, and
Phi3MLP's one fused gate_up projection), each fused and verified against its original. The
expected counts come from the model code (two gated MLPs per graph). Look-alikes from the same
script (a SiLU Linear times a constant buffer, a sigmoid GLU) must not fuse as gates. One
negative per guard on mutated copies of the positive fixtures: the kept forward activation of
another tensor, a forward product that is not the gate's, the two backward products reading
different upstream gradients; explain names the reason.
"""

from __future__ import annotations

import copy
from pathlib import Path

import onnx
import pytest
from onnx import helper

from fusecli import FusionPass, load_rules
from fusecli.engine.explain import explain_model
from fusecli.runtime.verify import verify_models

DATA = Path(__file__).parent / "data"
RULES = load_rules()
GATED = [r.name for r in RULES if r.pattern in ("swiglu", "geglu")]
GUARD_FIXTURE_RULES = ("swiglu_gated_ortt", "geglu_gated_ortt", "geglu_fast_gated_ortt",
                       "geglu_tanh_gated_ortt", "swiglu_gated_torch", "geglu_gated_torch",
                       "geglu_tanh_gated_torch", "geglu_new_gated_torch")

# fused counts per pattern, from the model code (make_gated_mlp.py: two blocks per graph)
EXPECTED = {
    "swiglu": {"swiglu": 2},
    "swiglu_fused": {"swiglu": 2},
    "geglu": {"geglu": 2},
    "geglu_tanh": {"geglu": 2},
    "geglu_new": {"geglu": 2},
    # silu(gate_proj(x)) * constant: no gate; the Linear + SiLU backward fuses as such
    "gate_const": {"linear_silu": 2},
    # sigmoid(gate_proj(x)) * up_proj(x): a GLU with a sigmoid, neither swiglu nor geglu
    "gate_sigmoid": {},
}
# the rule each positive fixture exercises, per family
RULE_OF = {
    ("ortt", "swiglu"): "swiglu_gated_ortt", ("ortt", "swiglu_fused"): "swiglu_gated_ortt",
    ("ortt", "geglu"): "geglu_gated_ortt", ("ortt", "geglu_tanh"): "geglu_tanh_gated_ortt",
    ("ortt", "geglu_new"): "geglu_fast_gated_ortt",
    ("torch", "swiglu"): "swiglu_gated_torch", ("torch", "swiglu_fused"): "swiglu_gated_torch",
    ("torch", "geglu"): "geglu_gated_torch", ("torch", "geglu_tanh"): "geglu_tanh_gated_torch",
    ("torch", "geglu_new"): "geglu_new_gated_torch",
}
CASES = [(fam, name) for fam in ("ortt", "torch") for name in EXPECTED]


def _load(fam, name):
    return onnx.load(DATA / f"{fam}_{name}.onnx")


def _run(m):
    fp = FusionPass()
    fp.run(m)
    return fp


def test_guard_fixture_rules_are_the_gated_rules():
    assert sorted(GUARD_FIXTURE_RULES) == sorted(GATED)


@pytest.mark.parametrize("fam,name", CASES, ids=lambda v: v)
def test_gated_exports_fuse_as_the_model_code_says_and_verify(fam, name, tmp_path):
    m = _load(fam, name)
    fp = _run(m)
    got = {p: s.fused for p, s in fp.stats.patterns.items() if s.fused}
    assert got == EXPECTED[name]
    if (fam, name) in RULE_OF:
        assert {f.rule for f in fp.stats.fusions} == {RULE_OF[fam, name]}
        assert [n.op_type for n in m.graph.node if n.domain == "com.fusecli"] == \
            ["GatedActivationGrad"] * 2
    if got:
        out = tmp_path / "fused.onnx"
        onnx.save(m, out)
        report = verify_models(DATA / f"{fam}_{name}.onnx", out)
        assert report.ok and report.max_rel <= 1e-5, report


def _record(m, fam, name):
    fp = FusionPass()
    fp.run(copy.deepcopy(m))
    return next(f for f in fp.stats.fusions if f.rule == RULE_OF[fam, name])


def _nodes(m, names):
    return [n for n in m.graph.node if n.name in names]


def _producer(m, tensor):
    return next(n for n in m.graph.node if tensor in n.output)


def _mutate(m, rec, case):
    """A copy of m with one gate's guard broken (rec: that gate's fusion record; the kept
    forward nodes are found from the tensors it bound)."""
    m = copy.deepcopy(m)
    t = rec.tensors
    if case == "act_of_other":  # S's producer reads the up projection B in place of its
        n = _producer(m, t["S"])  # first computed input: S is no longer act(A)
        made = {o for p in m.graph.node for o in p.output}
        i = next(i for i, x in enumerate(n.input) if x in made)
        n.input[i] = t["B"]
    elif case == "product_not_gate":  # the forward product multiplies S by A, not by B
        (n,) = [n for n in m.graph.node if t["S"] in n.input and t["B"] in n.input
                and n.name != rec.nodes["mul_b"]]
        n.input[list(n.input).index(t["B"])] = t["A"]
    elif case == "other_upstream":  # dB's product reads -dH, not dH
        (n,) = [n for n in m.graph.node if n.name == rec.nodes["mul_b"]]
        at = next(i for i, x in enumerate(m.graph.node) if t["dH"] in x.output)
        m.graph.node.insert(at + 1, helper.make_node("Neg", [t["dH"]], ["dH_neg"], name="neg_dh"))
        n.input[list(n.input).index(t["dH"])] = "dH_neg"
    return m


GUARDS = ["act_of_other", "product_not_gate", "other_upstream"]


@pytest.mark.parametrize("case", GUARDS)
@pytest.mark.parametrize("fam,name", sorted(RULE_OF), ids=lambda v: v)
def test_gated_guards(fam, name, case):
    """Each guard, broken on one of the two gates: that gate is left unfused (the other still
    fuses) and explain names the failing check for the broken one."""
    m = _load(fam, name)
    rec = _record(m, fam, name)
    bad = _mutate(m, rec, case)
    fp = _run(copy.deepcopy(bad))
    rule = RULE_OF[fam, name]
    recs = [f for f in fp.stats.fusions if f.rule == rule]
    assert len(recs) == 1 and rec.nodes["act_grad"] not in recs[0].replaced
    assert fp.stats.patterns[rec.pattern].fused == 1
    this = next(r for r in RULES if r.name == rule)
    upto = [r for r in RULES if (r.order, r.name) <= (this.order, this.name)]
    misses = explain_model(bad, FusionPass(rules=upto), include_shallow=True)
    mine = [x for x in misses if x["rule"] == rule]
    # the failing check: a tensor bound twice to different things (dataflow), or, where the
    # forward chain is several nodes, the node found in its place (op_type) or a constant that
    # is not there (the matcher tried the chain along another path)
    assert mine and {x["reason"] for x in mine} <= {"dataflow", "op_type", "constant", "no_candidate"}, misses
