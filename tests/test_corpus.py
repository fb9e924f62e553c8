"""The corpus of real third-party architectures (corpus/, `make corpus`; scripts/corpus/).

For every corpus graph: the fused counts per pattern equal EXACTLY the architecture's counts
(derived from the model's code at generation) minus the manifest's `known_gaps`; the fused graph
loads and runs in its runtime wherever the original runs and computes the same outputs
(`fusecli verify`); every fusion matches its NumPy reference on the original's tensors; and the
look-alikes that are not patterns (RMSNorm, Linear+Tanh, Conv+BN without activation, Conv+BN+ReLU6
as conv_bn_relu) are left alone.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from conftest import REPO, fused_corpus, grouped, run_cli

from fusecli import CANONICAL_PATTERNS
from fusecli.ops.contracts import FUSED_DOMAIN, load_contracts
from fusecli.runtime.feeds import load_manifest
from fusecli.runtime.verify import check_fusions

CORPUS = REPO / "corpus"
MANIFEST = load_manifest(CORPUS / "manifest.yaml")
PATTERNS = CANONICAL_PATTERNS  # the op contracts' patterns, in canonical order


def _param(name: str):
    marks = [pytest.mark.ortt] if MANIFEST[name]["family"] == "ort-training" else []
    return grouped(f"corpus-{name}", name, *marks)


NAMES = [_param(n) for n in sorted(MANIFEST)]


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return fused_corpus(tmp_path_factory.mktemp("corpus-fused"), CORPUS, MANIFEST)


def test_corpus_covers_the_architectures_it_promises():
    archs = {e["architecture"] for e in MANIFEST.values()}
    assert len(archs) >= 10, sorted(archs)
    fams = {e["family"] for e in MANIFEST.values()}
    assert fams == {"ort-training", "torch-joint"}
    for name, e in MANIFEST.items():
        assert set(e["expected"]) == set(PATTERNS), name
        assert (CORPUS / e["file"]).exists() and (CORPUS / e["params"]).exists(), name
        assert {"torch", e["library"]} <= set(e["versions"]), name
        # checked against torch autograd at generation (gen.py's per-tensor limit; a wrong
        # export, torch 2.13's F.cross_entropy, was off by 40.1): every graph agrees to 1.3e-4
        assert e["max_abs_grad_err_vs_torch"] is not None, name
        assert e["max_abs_grad_err_vs_torch"] <= 1e-3, name
        for p, gap in e["known_gaps"].items():
            assert 0 < gap["count"] <= e["expected"][p] and gap["reason"].strip(), (name, p)
            assert "UNEXPLAINED" not in gap["reason"], (name, p)


@pytest.mark.parametrize("name", NAMES)
def test_fused_counts_are_architecture_counts_minus_known_gaps(name, fused):
    e = MANIFEST[name]
    stats = fused[name][1]
    got = {p: stats.patterns[p].fused if p in stats.patterns else 0 for p in PATTERNS}
    want = {p: e["expected"][p] - e["known_gaps"].get(p, {}).get("count", 0) for p in PATTERNS}
    assert got == want


@pytest.mark.parametrize("name", NAMES)
def test_fused_graph_runs_where_the_original_runs_and_verifies(name, fused):
    """`fusecli verify` runs the original and the fused graph in the graph's runtime
    (onnxruntime-training for ort-training, stock onnxruntime for torch-joint) on the same feeds
    and compares every output and every in-place gradient buffer."""
    e = MANIFEST[name]
    proc = run_cli("verify", CORPUS / e["file"], fused[name][0], "--json", timeout=300)
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["runtime"].startswith(e["runtime"] + " "), report["runtime"]
    assert report["outputs"], "nothing compared"


@pytest.mark.parametrize("name", NAMES)
def test_every_fusion_matches_its_reference(name, fused):
    stats = fused[name][1]
    if not stats.fusions:
        assert stats.total_fused == 0
        return
    checks = check_fusions(CORPUS / MANIFEST[name]["file"], stats.fusions, atol=1e-6)
    assert len(checks) == stats.total_fused
    bad = [(c.rule, d.name, d.max_abs, d.rel) for c in checks for d in c.outputs if not d.ok]
    assert not bad


def _fused_nodes(path: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(path).graph.node if n.domain == FUSED_DOMAIN]


def _reads(node: onnx.NodeProto, prefix: str) -> bool:
    return any(prefix in i for i in node.input)


@pytest.mark.parametrize("name", [_param(n) for n in sorted(MANIFEST)
                                  if MANIFEST[n]["expected"].get("rmsnorm")])
def test_rmsnorm_is_not_layernorm(name, fused):
    stats = fused[name][1]
    assert MANIFEST[name]["expected"]["layernorm"] == 0
    assert stats.patterns["layernorm"].fused == 0
    assert not [n for n in _fused_nodes(fused[name][0]) if n.op_type == "LayerNormGrad"]


@pytest.mark.parametrize("name", [_param(n) for n in sorted(MANIFEST)
                                  if MANIFEST[n]["architecture"] == "bert"])
def test_linear_tanh_pooler_is_not_linear_gelu(name, fused):
    """BERT's pooler is Linear+Tanh: its weight must not feed any fused Linear op."""
    nodes = _fused_nodes(fused[name][0])
    assert not [n.name for n in nodes if _reads(n, "pooler.")
                or any("pooler." in o for o in n.output)]


@pytest.mark.parametrize("name", [_param(n) for n in sorted(MANIFEST)
                                  if MANIFEST[n]["architecture"] in ("timm_resnet",
                                                                     "tv_mobilenet_v2")])
def test_conv_bn_without_relu_is_not_conv_bn_relu(name, fused):
    """ResNet's 1x1 Conv+BN downsample shortcuts and MobileNetV2's Conv+BN linear bottlenecks
    are Conv->BN without activation (conv_bn: activation identity, no Y), and MobileNetV2's
    Conv+BN+ReLU6 is no Conv->BN->ReLU: each fused ConvBnReluGrad carries its chain's
    activation."""
    nodes = [n for n in _fused_nodes(fused[name][0]) if n.op_type == "ConvBnReluGrad"]
    acts = {n.name: next((a.s.decode() for a in n.attribute if a.name == "activation"), "relu")
            for n in nodes}
    stats = fused[name][1].patterns
    for act, pattern in (("relu", "conv_bn_relu"), ("relu6", "conv_bn_relu6"),
                         ("identity", "conv_bn")):
        assert list(acts.values()).count(act) == stats[pattern].fused, act
    assert len(nodes) == sum(stats[p].fused for p in stats
                             if p == "conv_bn" or p.startswith("conv_bn_"))
    for n in nodes:
        assert (acts[n.name] == "identity") == (n.input[1] == ""), n.name
    # ResNet: every downsample is a conv_bn
    down = [n.name for n in nodes if _reads(n, ".downsample.")]
    assert all(acts[d] == "identity" for d in down)
    if MANIFEST[name]["architecture"] == "timm_resnet":
        assert len(down) == 4
    if MANIFEST[name]["architecture"] == "tv_mobilenet_v2":
        assert MANIFEST[name]["expected"]["conv_bn_relu"] == 0 and "relu" not in acts.values()
        # the projections (features.N.conv.2, features.1.conv.1 for t=1: Conv+BN, no
        # activation) and nothing else are identity
        proj = {n.name for n in nodes if n.input[3].endswith(".conv.2.weight")
                or n.input[3] == "features.1.conv.1.weight"}
        assert len(proj) == 4
        assert proj == {k for k, a in acts.items() if a == "identity"}


# --- LM heads (issue 33): verify must see a 1% error on any output of a fused LinearCrossEntropy --
LCE_NAMES = [n for n in sorted(MANIFEST) if MANIFEST[n]["expected"]["linear_cross_entropy"]]
LCE_OUTPUTS = tuple(p.name for p in load_contracts().ops["LinearCrossEntropy"].outputs)


def test_lm_head_graphs_cover_both_families():
    """The corruption test below is not vacuous: LM-head graphs of several architectures in both
    families (llama_lm, gpt2_lm, bert_mlm: V 101, S 16, B 2; distilbert_tokens_ce)."""
    fams = {MANIFEST[n]["family"] for n in LCE_NAMES}
    assert fams == {"ort-training", "torch-joint"}, LCE_NAMES
    assert len(LCE_NAMES) >= 7, LCE_NAMES
    assert {"llama_lm", "gpt2_lm", "bert_mlm"} <= {MANIFEST[n]["architecture"]
                                                   for n in LCE_NAMES}


def _scaled_copy(path: Path, node_name: str, port: int, dest: Path, factor: float = 1.01) -> str:
    """A copy of the fused graph in which output `port` of the node `node_name` is `factor`
    times what the op writes (the op's output renamed, a Mul writing the old name: every
    reader, graph output and accumulation buffer sees the scaled tensor). Returns the tensor."""
    m = onnx.load(path)
    nodes = list(m.graph.node)
    node = next(n for n in nodes if n.name == node_name)
    t = node.output[port]
    node.output[port] = t + ".exact"
    m.graph.initializer.append(numpy_helper.from_array(
        np.array(factor, np.float32), t + ".corrupt_scale"))
    m.graph.node.insert(nodes.index(node) + 1, helper.make_node(
        "Mul", [t + ".exact", t + ".corrupt_scale"], [t], name=node_name + ".corrupt"))
    onnx.save(m, dest)
    return t


@pytest.mark.parametrize("name", [_param(n) for n in LCE_NAMES])
def test_verify_fails_on_every_lm_head_output_off_by_one_percent(name, fused, tmp_path):
    """For every output the fused LinearCrossEntropy writes (loss, dH, dW, dB), a copy of the fused
    graph with that output times 1.01 fails `fusecli verify` on its default feeds (exit 1, ok
    false, a mismatched output downstream of the LinearCrossEntropy), where the fused graph
    itself passes on the same default feeds
    (test_fused_graph_runs_where_the_original_runs_and_verifies runs it on every corpus graph,
    these included). A 1% error is 1000x verify's rtol and far above the graphs' noise floors."""
    e = MANIFEST[name]
    path = fused[name][0]
    lce = [n for n in _fused_nodes(path) if n.op_type == "LinearCrossEntropy"]
    assert len(lce) == e["expected"]["linear_cross_entropy"] == fused[name][1].patterns[
        "linear_cross_entropy"].fused
    ports = [(n.name, i) for n in lce for i, t in enumerate(n.output) if t]
    # every corpus LM head trains under a trained body: the loss, dH and dW at least
    written = [LCE_OUTPUTS[i] for _, i in ports]
    assert {"loss", "dH", "dW"} <= set(written), written
    assert len(ports) == len(written) >= 3
    failed = []
    for k, (node, port) in enumerate(ports):
        copy = tmp_path / f"corrupt{k}.onnx"
        tensor = _scaled_copy(path, node, port, copy)
        proc = run_cli("verify", CORPUS / e["file"], copy, "--json", check_rc=None, timeout=300)
        report = json.loads(proc.stdout)
        bad = [o["name"] for o in report["outputs"]
               if not o["ok"] and node in o["upstream_fused"]]
        if not (proc.returncode == 1 and report["ok"] is False and report["verdict"] == "FAIL"
                and bad):
            failed.append((LCE_OUTPUTS[port], tensor, proc.returncode, report["verdict"]))
    assert not failed, failed
