"""Conv + BatchNorm + activation backward beyond ReLU (rules/conv_bn_relu_ortt.yaml: relu6,
silu, hardswish in two spellings) on real onnxruntime-training exports of MobileNet-style blocks
(tests/data/make_conv_act.py): depthwise, grouped and pointwise convolutions, with and without
conv bias, the first layer, frozen conv weights and BN affine, Conv+BN without activation
(conv_bn); and the look-alike activations whose gradient must be left alone (a Clip that is not
0..6, QuickGELU, a shifted or rescaled hardswish: their Conv+BN fuses as conv_bn, the
activation gradient stays) and a Hardsigmoid-gated squeeze-excitation (no BatchNorm: nothing). Expected counts come from the model code
(tests/data/conv_act_expected.json, written by the generator)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import onnx
import pytest

from fusecli import CANONICAL_PATTERNS, FusionPass
from fusecli.ops.contracts import FUSED_DOMAIN
from fusecli.engine.explain import explain_model

DATA = Path(__file__).resolve().parent / "data"
EXPECTED = json.loads((DATA / "conv_act_expected.json").read_text())
pytestmark = pytest.mark.ortt

# every rule of the file (and so every variant) has a positive fixture here: name -> rule
# (conv_bn_ortt: the projections / linear bottlenecks; in the look-alikes every Conv+BN)
POSITIVE = {"ortt_conv_mbv2": {"conv_bn_relu6_ortt": 7, "conv_bn_ortt": 3},
            "ortt_conv_mbv2_frozen": {"conv_bn_relu6_ortt": 7, "conv_bn_ortt": 3},
            "ortt_conv_effnet_silu": {"conv_bn_silu_ortt": 5, "conv_bn_ortt": 1},
            # stem and head: x relu6(x + 3) / 6; the V3 block's expand and depthwise: timm's
            # x (relu6(x + 3) / 6)
            "ortt_conv_mbv3_hswish": {"conv_bn_hardswish_ortt": 2,
                                      "conv_bn_hardswish_div_ortt": 2, "conv_bn_ortt": 1},
            "ortt_conv_negatives": {"conv_bn_ortt": 7}}


def _fuse(name):
    m = onnx.load(DATA / f"{name}.onnx")
    fp = FusionPass()
    fp.run(m)
    return m, fp.stats


def _fused_nodes(m):
    return [n for n in m.graph.node if n.domain == FUSED_DOMAIN]


def _attr(node, name):
    a = next((a for a in node.attribute if a.name == name), None)
    return None if a is None else onnx.helper.get_attribute_value(a)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_counts_are_the_model_code_counts(name):
    _, stats = _fuse(name)
    got = {p: stats.patterns[p].fused if p in stats.patterns else 0 for p in EXPECTED[name]}
    assert got == EXPECTED[name]
    # nothing else fuses in these graphs (their Linear head has no activation)
    assert stats.total_fused == sum(EXPECTED[name].values())
    assert set(EXPECTED[name]) <= set(CANONICAL_PATTERNS)


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_every_variant_fires_and_the_fused_graph_verifies(name, tmp_path):
    from fusecli.runtime.verify import verify_models

    m, stats = _fuse(name)
    by_rule: dict[str, int] = {}
    for f in stats.fusions:
        by_rule[f.rule] = by_rule.get(f.rule, 0) + 1
    assert by_rule == POSITIVE[name]
    acts = {"conv_bn_relu6_ortt": "relu6", "conv_bn_silu_ortt": "silu",
            "conv_bn_hardswish_ortt": "hardswish", "conv_bn_hardswish_div_ortt": "hardswish",
            "conv_bn_ortt": "identity"}
    want = sorted(acts[r] for r, k in POSITIVE[name].items() for _ in range(k))
    assert sorted(_attr(n, "activation").decode() for n in _fused_nodes(m)) == want
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(DATA / f"{name}.onnx", out)
    assert report.ok, report
    assert report.fused_kernel_runs == {"ConvBnReluGrad": sum(POSITIVE[name].values())}


def test_depthwise_grouped_bias_and_first_layer_keep_their_geometry():
    """The fused nodes carry each conv's group (depthwise = channels, 4 groups, dense), the
    first layer's dX is absent and only the biased head conv writes dBc (model code:
    make_conv_act.mbv2 / effnet_silu)."""
    m, _ = _fuse("ortt_conv_mbv2")
    nodes = {n.input[3]: n for n in _fused_nodes(m)}  # by conv weight
    groups = {w: _attr(n, "group") for w, n in nodes.items()}
    assert groups == {"features.0.0.weight": 1, "features.1.conv.0.0.weight": 8,
                      "features.1.conv.1.0.weight": 1,
                      "features.2.conv.0.0.weight": 1, "features.2.conv.1.0.weight": 32,
                      "features.2.conv.2.0.weight": 1,
                      "features.3.conv.0.0.weight": 1, "features.3.conv.1.0.weight": 48,
                      "features.3.conv.2.0.weight": 1, "features.4.0.weight": 1}
    # the projections: activation identity, no Y
    proj = {w for w in groups if w.startswith("features.") and w.split(".")[3:4] in (["1"], ["2"])
            and w.split(".")[2] == "conv" and groups[w] == 1 and w != "features.2.conv.0.0.weight"
            and w != "features.3.conv.0.0.weight"}
    assert proj == {"features.1.conv.1.0.weight", "features.2.conv.2.0.weight",
                    "features.3.conv.2.0.weight"}
    for w, n in nodes.items():
        assert (_attr(n, "activation") == b"identity") == (w in proj), w
        assert (n.input[1] == "") == (w in proj), w
    assert [w for w, n in nodes.items() if not n.output[0]] == ["features.0.0.weight"]
    assert [w for w, n in nodes.items() if n.output[2]] == ["features.4.0.weight"]
    m, _ = _fuse("ortt_conv_effnet_silu")
    assert sorted(_attr(n, "group") for n in _fused_nodes(m)) == [1, 1, 1, 1, 4, 16]


def test_frozen_conv_weights_have_no_dw():
    """make_conv_act.mbv2_frozen freezes three chain convs' weights (the stride-2 block's expand,
    the residual block's depthwise, the head with its bias): their fused nodes compute no dW (the
    wgrad GEMM is skipped), the others do; the frozen BN affines' dGamma/dBeta are the per-
    channel sums dC needs anyway (onnxruntime-training's BatchNormalizationGrad always writes
    them; nothing reads them there)."""
    m, _ = _fuse("ortt_conv_mbv2_frozen")
    frozen_w = {"features.2.conv.0.0.weight", "features.3.conv.1.0.weight", "features.4.0.weight"}
    nodes = _fused_nodes(m)
    assert len(nodes) == 10
    for n in nodes:
        assert (n.output[1] == "") == (n.input[3] in frozen_w), (n.input[3], list(n.output))
        if n.input[3] == "features.4.0.weight":
            assert n.output[2] == ""  # frozen conv bias: no dBc
    graph_inputs = {i.name for i in m.graph.input}
    for w in frozen_w:
        assert f"{w}_grad.accumulation.buffer" not in graph_inputs


def test_squeeze_excitation_is_left_alone():
    """MobileNetV3's SE (1x1 convs with bias, ReLU, Hardsigmoid gate, product with the features)
    has no BatchNorm: every one of its nodes, forward and backward, is still in the fused graph
    (the projection conv after it fuses, reading its output and writing that output's
    gradient)."""
    for name, se in (("ortt_conv_mbv3_hswish", "/features/features.1/se/"),
                     ("ortt_conv_negatives", "/features/features.6/")):
        orig = onnx.load(DATA / f"{name}.onnx")
        m, stats = _fuse(name)
        se_nodes = {n.name for n in orig.graph.node if n.name.startswith(se)}
        assert len(se_nodes) > 20, (name, len(se_nodes))  # forward and backward
        assert se_nodes <= {n.name for n in m.graph.node}
        assert not [f for f in stats.fusions if se_nodes & set(f.replaced)]


# look-alikes of make_conv_act.negatives, by module, and the guard that refuses each
NEGATIVE_GUARDS = [
    ("features.0", "conv_bn_relu6_ortt", "mask_le", "constant"),       # Clip(0, 4): hi
    ("features.1", "conv_bn_relu6_ortt", "mask_ge", "constant"),       # Clip(-1, 6): lo
    ("features.2", "conv_bn_silu_ortt", "act", "attribute"),           # QuickGelu alpha 1.702
    ("features.3", "conv_bn_hardswish_ortt", "fwd_add", "constant"),   # relu6(x + 2): three
    ("features.4", "conv_bn_hardswish_ortt", "scale", "constant"),     # / 5: six
    ("features.7", "conv_bn_relu6_ortt", "mask_le", "constant"),       # Clip(0, 4) again
]


@pytest.mark.parametrize("module,rule,node,reason", NEGATIVE_GUARDS,
                         ids=[f"{g[0]}-{g[1]}" for g in NEGATIVE_GUARDS])
def test_look_alikes_fail_on_their_guard(module, rule, node, reason):
    m = onnx.load(DATA / "ortt_conv_negatives.onnx")
    misses = [x for x in explain_model(m, FusionPass(), include_shallow=True)
              if x["rule"] == rule and f"/{module}/" in x["anchor"]]
    assert misses, rule
    assert any(x["node"] == node and x["reason"] == reason for x in misses), misses


def test_a_clip_that_is_not_relu6_after_a_real_chain_is_refused():
    """The positive MobileNetV2 fixture with one Clip's upper bound changed to 4 (a constant
    fed by value): exactly that chain is no longer fused."""
    m = onnx.load(DATA / "ortt_conv_mbv2.onnx")
    fp = FusionPass()
    fp.run(copy.deepcopy(m))
    first = fp.stats.fusions[0]
    le = next(n for n in m.graph.node if n.name == first.nodes["mask_le"])
    four = onnx.helper.make_tensor("four__test", onnx.TensorProto.FLOAT, [], [4.0])
    m.graph.initializer.append(four)
    le.input[1] = "four__test"
    fp = FusionPass()
    fp.run(m)
    assert fp.stats.patterns["conv_bn_relu6"].fused == 6
    assert fp.stats.patterns["conv_bn"].fused == 4  # that chain's Conv+BN, without the Clip
    assert all(le.name not in f.replaced for f in fp.stats.fusions)
    assert any(n.name == le.name for n in m.graph.node)


def test_look_alike_activation_gradients_stay_in_front_of_conv_bn():
    """In the look-alikes every Conv+BN fuses as conv_bn (activation identity), and every
    activation-gradient node of the original is still there, feeding the fused op's dY."""
    orig = onnx.load(DATA / "ortt_conv_negatives.onnx")
    m, _ = _fuse("ortt_conv_negatives")
    kinds = ("And", "GreaterOrEqual", "LessOrEqual", "QuickGeluGrad", "Div", "Sum")
    count = {k: sum(n.op_type == k for n in orig.graph.node) for k in kinds}
    assert count == {k: sum(n.op_type == k for n in m.graph.node) for k in kinds}
    assert count["QuickGeluGrad"] == 1 and count["And"] >= 6
    nodes = _fused_nodes(m)
    assert [_attr(n, "activation") for n in nodes] == [b"identity"] * 7
    assert all(n.input[1] == "" for n in nodes)
