"""LoRA fine-tuning graphs (rules/lora_ortt.yaml, rules/lora_torch.yaml -> LoraLinearGrad).

Fixtures: real exports of both families, tests/data/{ortt,torch}_lora_*.onnx, made by
tests/data/make_lora.py (peft LoRA on q/v and on every Linear of a tiny 2-block decoder, with and
without lora_dropout; hand-written LoRA MLPs; negatives). Expected instances come from the model
code in make_lora.py: every LoRA-wrapped Linear whose backward is in the graph, with its
activation and whether its input gradient exists (nothing trains below block 1's q/k/v and
below each MLP's fc1). Every fused graph must verify against its original.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import pytest
from onnx import helper

from fusecli import FusionPass, load_rules
from fusecli.engine.explain import explain_model
from fusecli.runtime.verify import verify_models

DATA = Path(__file__).parent / "data"
FAMILIES = ("ortt", "torch")
RULES = load_rules()
LORA_RULES = {r.name for r in RULES if r.pattern == "lora"}


def _upto(rule_name):
    """The rules that apply up to and including ``rule_name`` (what explain needs to see its
    misses before a later rule takes the chain)."""
    rule = next(r for r in RULES if r.name == rule_name)
    return [r for r in RULES if (r.order, r.name) <= (rule.order, rule.name)]

# fixture -> Counter of (activation, has input gradient) over its LoRA-wrapped Linear layers,
# read off the model code (make_lora.py)
POSITIVE = {
    # 2 blocks x (q, v): block 1's without dX, block 2's with
    "lora_qv": Counter({("identity", False): 2, ("identity", True): 2}),
    # 2 blocks x (q, k, v, o, fc1 + GELU, fc2): block 1's q/k/v without dX
    "lora_all": Counter({("identity", False): 3, ("identity", True): 7, ("gelu", True): 2}),
    "lora_dropout": Counter({("identity", False): 2, ("identity", True): 2}),
    # fc1 + GELU (first layer), fc2 + ReLU, fc3
    "lora_hand": Counter({("gelu", False): 1, ("relu", True): 1, ("identity", True): 1}),
    # fc1 + ReLU (first layer), fc2 + GELU, fc3
    "lora_hand_relu": Counter({("relu", False): 1, ("gelu", True): 1, ("identity", True): 1}),
}


def _attr(node, name):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _fuse(name):
    m = onnx.load(DATA / f"{name}.onnx")
    fp = FusionPass()
    fp.run(m)
    return m, fp


def _lora_nodes(m):
    return [n for n in m.graph.node if n.op_type == "LoraLinearGrad"]


def _kinds(m):
    return Counter((_attr(n, "activation").decode(), bool(n.output[0])) for n in _lora_nodes(m))


def _assert_verifies(tmp_path, name, m):
    out = tmp_path / f"{name}.fused.onnx"
    onnx.save(m, out)
    report = verify_models(DATA / f"{name}.onnx", out)
    assert report.ok and report.max_rel <= 1e-5, report
    return report


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fixture", sorted(POSITIVE))
def test_lora_fixtures_fuse_every_adapter_and_verify(family, fixture, tmp_path):
    name = f"{family}_{fixture}"
    m, fp = _fuse(name)
    assert _kinds(m) == POSITIVE[fixture]
    assert fp.stats.patterns["lora"].fused == sum(POSITIVE[fixture].values())
    # the scale came from the graph: peft's lora_alpha / r = 8 / 4, the hand-written 0.5
    for n in _lora_nodes(m):
        assert _attr(n, "scale") == pytest.approx(2.0 if "lora_hand" not in fixture else 0.5)
    _assert_verifies(tmp_path, name, m)


def test_every_lora_rule_variant_has_a_positive_fixture():
    fired = set()
    for family in FAMILIES:
        for fixture in POSITIVE:
            fired |= {f.rule for f in _fuse(f"{family}_{fixture}")[1].stats.fusions}
    assert LORA_RULES <= fired, sorted(LORA_RULES - fired)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_dx_split_and_sum(family):
    """Input gradients that meet in a two-input Sum/Add are absorbed (split_dx=0); block 2's q/v
    share their input with k_proj, so their gradients go into a larger sum: split_dx=1, dXa
    written. With dropout the adapter's dX goes through the dropout's backward: always split."""
    m, _ = _fuse(f"{family}_lora_hand")
    assert all(_attr(n, "split_dx") == 0 and not n.output[1] for n in _lora_nodes(m))
    m, _ = _fuse(f"{family}_lora_dropout")
    with_dx = [n for n in _lora_nodes(m) if n.output[0]]
    assert len(with_dx) == 2
    assert all(_attr(n, "split_dx") == 1 and n.output[1] for n in with_dx)
    # the adapter path's dX feeds the dropout's backward, the Xd input is the Dropout's output
    producers = {o: n for n in m.graph.node for o in n.output}
    for n in with_dx:
        assert producers[n.input[7]].op_type == "Dropout"
        assert producers[n.input[7]].input[0] == n.input[2]


@pytest.mark.parametrize("family,rule,depth,where", [
    ("ortt", "lora_relu_ortt_nodx", 7, ("la_flat_dh", "la_tdh")),
    ("torch", "lora_act_torch_nodx", 5, ("fwd_h",))])
def test_lora_negative_not_an_adapter(family, rule, depth, where, tmp_path):
    """A ReLU between the two factors of the product: no adapter, nothing fused as LoRA;
    explain shows the match of the lora_B half breaking where the ReLU sits: ort-training's
    rule (which reads lora_B's backward first) where lora_A's gradient should read dH (it reads
    the ReLU's gradient of dH instead); torch-joint's (which checks the context first) where
    lora_B's weight gradient should read the adapter's hidden x A^T (it reads a view of the
    ReLU's output)."""
    name = f"{family}_lora_notadapter"
    m, fp = _fuse(name)
    assert not _lora_nodes(m) and fp.stats.patterns["lora"].fused == 0
    misses = explain_model(onnx.load(DATA / f"{name}.onnx"), FusionPass(rules=_upto(rule)))
    assert any(x["rule"] == rule and x["reason"] == "op_type" and x["depth"] >= depth
               and x["node"] in where for x in misses), misses
    _assert_verifies(tmp_path, name, m)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_negative_scale_not_constant(family, tmp_path):
    """fc1's scale is a graph input: its backward is not fused (explain: the scale constraint);
    fc2's and fc3's are."""
    name = f"{family}_lora_runtime_scale"
    m, _ = _fuse(name)
    assert _kinds(m) == Counter({("relu", True): 1, ("identity", True): 1})
    misses = explain_model(onnx.load(DATA / f"{name}.onnx"), FusionPass(), include_shallow=True)
    assert any(x["rule"] in LORA_RULES and x["reason"] == "constant" and "(s)" in x["detail"]
               for x in misses), misses
    _assert_verifies(tmp_path, name, m)


@pytest.mark.parametrize("family,fused,act_rule", [("ortt", 2, "lora_relu_ortt_nodx"),
                                                   ("torch", 1, "lora_act_torch_nodx")])
def test_lora_negative_base_trains(family, fused, act_rule, tmp_path):
    """Base W and b train too: the op is not given the base's gradients, so no activation
    gradient is absorbed (they read dZ outside the match); what fuses leaves them outside."""
    name = f"{family}_lora_basetrains"
    m, _ = _fuse(name)
    assert all(_attr(n, "activation") == b"identity" for n in _lora_nodes(m))
    assert len(_lora_nodes(m)) == fused
    misses = explain_model(onnx.load(DATA / f"{name}.onnx"), FusionPass(rules=_upto(act_rule)))
    assert any(x["rule"] == act_rule and x["reason"] == "intermediate_consumed_outside"
               for x in misses), misses
    _assert_verifies(tmp_path, name, m)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapter_dx_read_elsewhere(family, tmp_path):
    """The base + adapter input-gradient sum is absorbed, but the adapter's part is also read
    outside (here a graph output): the op writes it as dXa besides the summed dX."""
    name = f"{family}_lora_hand"
    m = onnx.load(DATA / f"{name}.onnx")
    fp = FusionPass()
    fp.run(onnx.load(DATA / f"{name}.onnx"))
    summed = [f for f in fp.stats.fusions if "xsum" in f.nodes]
    assert len(summed) == 2  # fc2, fc3: each one's input feeds only its base and its adapter
    dxa = summed[0].tensors["dXa"]
    m.graph.node.append(helper.make_node("Identity", [dxa], ["adapter_dx_copy"]))
    m.graph.output.append(helper.make_tensor_value_info("adapter_dx_copy", onnx.TensorProto.FLOAT,
                                                        None))
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    FusionPass().run(m)
    [node] = [n for n in _lora_nodes(m) if n.output[1] == dxa]
    assert _attr(node, "split_dx") == 0 and node.output[0] == summed[0].tensors["dX"]
    out = tmp_path / "m.fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report
