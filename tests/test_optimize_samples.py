"""Every shipped sample through the real `fusecli optimize`: fused counts equal the counts taken
from the model code (manifest), the output passes the checker whenever the input does (and
never gains a checker error), graph interfaces are unchanged, and semantics are preserved."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from conftest import SAMPLES, Lazy, grouped, run_cli

from fusecli import CANONICAL_PATTERNS, FusionPass
from fusecli.runtime.verify import check_fusions

SAMPLE_NAMES = sorted(p.stem for p in SAMPLES.glob("*.onnx"))
SAMPLE_PARAMS = [grouped(f"sample-{n}", n) for n in SAMPLE_NAMES]


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    """{sample: (fused path, --json report)} of the real `fusecli optimize`, per sample when a
    test first asks for it."""
    out_dir = tmp_path_factory.mktemp("fused")

    def optimize(name):
        out = out_dir / f"{name}.fused.onnx"
        proc = run_cli("optimize", SAMPLES / f"{name}.onnx", "-o", out, "--json")
        return out, json.loads(proc.stdout)

    return Lazy(optimize)


@pytest.mark.parametrize("name", SAMPLE_PARAMS)
def test_fused_counts_equal_architecture_counts(name, optimized, manifest):
    entry = next(e for e in manifest.values() if e["file"] == f"{name}.onnx")
    _, report = optimized[name]
    assert set(CANONICAL_PATTERNS) <= set(report["patterns"])
    fused = {p: report["patterns"][p]["fused"] for p in CANONICAL_PATTERNS}
    assert fused == {p: entry["patterns"].get(p, 0) for p in CANONICAL_PATTERNS}
    assert report["total_fused"] == sum(fused.values())
    assert report["nodes_after"] < report["nodes_before"]


def _checker_error(model) -> str | None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # noqa: BLE001
        return str(exc).splitlines()[0]
    return None


@pytest.mark.parametrize("name", SAMPLE_PARAMS)
def test_output_checker_never_worse(name, optimized):
    out, _ = optimized[name]
    before = _checker_error(onnx.load(SAMPLES / f"{name}.onnx"))
    after = _checker_error(onnx.load(out))
    assert after == before  # None stays None; a pre-existing error is not joined by another


@pytest.mark.parametrize("name", SAMPLE_PARAMS)
def test_interface_order_and_cleanup(name, optimized):
    src = onnx.load(SAMPLES / f"{name}.onnx")
    dst = onnx.load(optimized[name][0])
    assert [i.SerializeToString() for i in src.graph.input] == \
           [i.SerializeToString() for i in dst.graph.input]
    assert [o.SerializeToString() for o in src.graph.output] == \
           [o.SerializeToString() for o in dst.graph.output]
    assert dst.ir_version == src.ir_version
    assert any(o.domain == "com.fusecli" for o in dst.opset_import)
    # topologically sorted, every input defined
    defined = {i.name for i in dst.graph.input} | {t.name for t in dst.graph.initializer}
    for node in dst.graph.node:
        assert all(i in defined for i in node.input if i), node.name
        defined.update(o for o in node.output if o)
    # no dead initializer or value_info left behind by the rewrite
    used = {i for n in dst.graph.node for i in n.input} | {o.name for o in dst.graph.output}
    src_used = {i for n in src.graph.node for i in n.input} | {o.name for o in src.graph.output}
    graph_inputs = {i.name for i in dst.graph.input}
    for t in dst.graph.initializer:
        assert t.name in used or t.name not in src_used or t.name in graph_inputs, t.name
    produced = {o for n in dst.graph.node for o in n.output} | defined
    assert all(v.name in produced for v in dst.graph.value_info)


def test_fused_node_takes_the_place_of_the_first_replaced_node():
    m = onnx.load(SAMPLES / "ortt_mlp.onnx")
    order = {n.name: i for i, n in enumerate(m.graph.node)}
    fp = FusionPass()
    fp.run(m)
    new_order = [n.name for n in m.graph.node]
    for rec in fp.stats.fusions:
        first = min(rec.replaced, key=order.__getitem__)
        # every node before the first replaced one keeps its relative position
        before = [n for n in new_order if n in order and order[n] < order[first]]
        assert before == sorted(before, key=order.__getitem__)
        assert new_order.index(rec.fused_node) == len(
            [n for n in new_order[:new_order.index(rec.fused_node)]])
        assert all(order[n] < order[first] for n in new_order[:new_order.index(rec.fused_node)]
                   if n in order)


@pytest.mark.parametrize("name", SAMPLE_PARAMS)
def test_every_fusion_matches_its_reference_on_real_tensors(name):
    """Semantics before any C++: boundary tensors from the ORIGINAL graph run in its runtime
    (onnxruntime or onnxruntime-training), the fused op's NumPy reference on its inputs."""
    m = onnx.load(SAMPLES / f"{name}.onnx")
    fp = FusionPass()
    fp.run(m)
    checks = check_fusions(SAMPLES / f"{name}.onnx", fp.stats.fusions, atol=1e-6)
    assert len(checks) == fp.stats.total_fused
    bad = [(c.rule, d.name, d.max_abs, d.rel) for c in checks for d in c.outputs if not d.ok]
    assert not bad


@pytest.mark.parametrize("name", [p for p in SAMPLE_PARAMS if p.values[0].startswith("torch_")])
def test_torch_joint_fused_model_runs_in_reference_evaluator(name, optimized, manifest):
    """The whole fused torch-joint model in onnx.reference with the NumPy fused ops, against
    the original in onnxruntime 1.31.1 with graph optimizations off."""
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    from fusecli.runtime.feeds import make_feeds
    from fusecli.ops.reference import reference_ops

    entry = next(e for e in manifest.values() if e["file"] == f"{name}.onnx")
    src = onnx.load(SAMPLES / f"{name}.onnx")
    feeds = make_feeds(src, entry, seed=3)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(src.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = sess.run(None, feeds)
    got = ReferenceEvaluator(onnx.load(optimized[name][0]), new_ops=reference_ops()).run(
        None, feeds)
    for out, a, b in zip(sess.get_outputs(), ref, got):
        scale = max(float(np.abs(a).max()), 1e-3)
        assert float(np.abs(a - b).max()) <= 1e-5 * scale, out.name


def test_fused_outputs_get_recorded_types():
    """Weight gradients written by fused ops carry value_info (onnxruntime-training plans
    memory only for tensors whose shapes it knows), in the parameter's layout."""
    m = onnx.load(SAMPLES / "ortt_mlp.onnx")
    params = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    FusionPass().run(m)
    recorded = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
                for v in m.graph.value_info}
    for layer in ("fc1", "fc2", "fc3", "fc4"):
        assert recorded[f"{layer}.weight_grad"] == params[f"{layer}.weight"]


@pytest.mark.parametrize("name", SAMPLE_PARAMS)
def test_fused_ops_name_their_workspace_outputs(name, optimized):
    """Every output a contract marks `workspace` (LinearActivationGrad's dZ, ConvBnReluGrad's dC:
    the op's working buffer, which onnxruntime may place in dY's memory) is named by the rewriter:
    a fresh tensor, read by nobody, not a graph output, typed like dY."""
    from fusecli.ops.contracts import load_contracts

    ops = load_contracts().ops
    m = onnx.load(optimized[name][0])
    producers = [o for n in m.graph.node for o in n.output if o]
    consumed = {i for n in m.graph.node for i in n.input}
    types = {v.name: v.type for v in list(m.graph.value_info) + list(m.graph.input)}
    orig = onnx.load(SAMPLES / f"{name}.onnx")
    orig_names = ({o for n in orig.graph.node for o in n.output} | {i.name for i in orig.graph.input}
                  | {t.name for t in orig.graph.initializer})
    seen = 0
    for n in m.graph.node:
        if n.op_type not in ops:
            continue
        for i, port in enumerate(ops[n.op_type].outputs):
            if not port.workspace:
                continue
            seen += 1
            ws = n.output[i] if i < len(n.output) else ""
            assert ws and ws not in orig_names and producers.count(ws) == 1, (n.name, ws)
            assert ws not in consumed and ws not in {o.name for o in m.graph.output}, ws
            if n.input[0] in types:
                assert types[ws] == types[n.input[0]], ws
    fused_kinds = {n.op_type for n in m.graph.node} & {"LinearActivationGrad", "ConvBnReluGrad"}
    assert (seen > 0) == bool(fused_kinds)


def test_weight_transposes_are_folded_into_the_fused_op():
    """The Transpose+MatMul Linear form: the fused op reads the weight itself and writes its
    gradient in the weight's layout; no Transpose is left on the gradient path."""
    m = onnx.load(SAMPLES / "ortt_block.onnx")
    FusionPass(only=["linear_gelu"]).run(m)
    fused = next(n for n in m.graph.node if n.op_type == "LinearActivationGrad")
    assert "fc1.weight" in fused.input and "fc1.weight_grad" in fused.output
    attrs = {a.name: a.i for a in fused.attribute if a.name.startswith("trans")}
    assert attrs == {"trans_w": 0, "trans_dw": 0}
