"""Saved activations (fusecli/engine/saved.py): the tensors a forward writes for its backward,
before and after fusion, with their bytes; what `fusecli optimize` prints and --json carries
(issue 22 item 3). Expected sets and sizes come from the graphs' construction."""

from __future__ import annotations

import copy
import json

import onnx
from onnx import helper

from conftest import SAMPLES, run_cli
from test_flash import ortt_attention_masked

from builders import model, vi
from fusecli import FusionPass
from fusecli.engine.saved import SavedDiff, saved_activations, size_json, total


def _chain():
    """loss = sum(relu(x) * w); backward reads relu's output (saved) and the mask of x > 0
    (saved); the forward's internal product `h` is not read by the backward."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Mul", ["r", "w"], ["h"]),
        helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0),
        helper.make_node("Greater", ["x", "zero"], ["pos"]),      # not on the loss path
        helper.make_node("Mul", ["r", "dh"], ["dw"]),             # backward reads r
        helper.make_node("Where", ["pos", "dh", "zero"], ["dx"]),
    ]
    m = model(nodes, [vi("x", [2, 3]), vi("w", [2, 3]), vi("dh", [2, 3]), vi("zero", [])],
              [vi("loss", []), vi("dw", [2, 3]), vi("dx", [2, 3])], [])
    m.graph.value_info.extend([vi("r", [2, 3]), vi("h", [2, 3])])
    return m


def test_saved_activations_are_forward_tensors_the_backward_reads():
    g = _chain().graph
    # r: written on the loss path, read by dw's Mul; h stays inside the forward; `pos` is
    # not on the loss path (backward work), x / w are inputs, not activations
    assert saved_activations(g) == {"r"}
    assert size_json(total({"r"}, {v.name: v.type for v in g.value_info})) == 2 * 3 * 4


def test_flash_removes_p_and_adds_its_row_statistics():
    """ort-training attention (B=2, H=2, S=5, D=4): P [2, 2, 5, 5] float32 is what the
    backward reads (SoftmaxGrad, dV); flash keeps O [2, 2, 5, 4] and LSE [2, 2, 5] instead."""
    m = ortt_attention_masked()
    m.graph.value_info.append(vi("P", [2, 2, 5, 5]))
    assert saved_activations(m.graph) == {"P"}
    fp = FusionPass()
    fp.run(m)
    d = fp.stats.as_dict()["saved_activations"]
    assert fp.stats.saved.removed == ["P"]
    assert d["removed"] == 1 and d["removed_bytes"] == 2 * 2 * 5 * 5 * 4
    assert d["added"] == 2 and d["added_bytes"] == 2 * 2 * 5 * 4 * 4 + 2 * 2 * 5 * 4
    assert d["net_bytes_removed"] == 400 - 320 - 80


def _gone(m):
    """The model's graph with every node removed (so every saved activation is 'removed')."""
    after = copy.deepcopy(m)
    del after.graph.node[:]
    return after


def test_symbolic_sizes_are_polynomials_and_unknown_shapes_unknown():
    m = ortt_attention_masked()
    m.graph.value_info.append(helper.make_tensor_value_info("P", onnx.TensorProto.FLOAT,
                                                            ["B", 2, "S", "S"]))
    diff = SavedDiff(m)
    diff.finish(_gone(m))
    assert diff.as_dict()["removed_bytes"] == "8*B*S*S"          # 2 heads x float32
    assert size_json({("S", "S"): 8, ("S",): 16, (): 4}) == "8*S*S + 16*S + 4"
    assert size_json(total(["x"], {})) is None                    # no recorded type: unknown


def test_unrecorded_shapes_are_inferred():
    """P's shape is not recorded (ort-training records few intermediate shapes): onnx shape
    inference gives it from Q [2, 2, 5, 4] and K^T [2, 2, 4, 5]."""
    m = ortt_attention_masked()
    assert "P" not in {v.name for v in m.graph.value_info}
    diff = SavedDiff(m)
    diff.finish(_gone(m))
    assert diff.as_dict()["removed_bytes"] == 2 * 2 * 5 * 5 * 4
    assert diff.as_dict()["removed_unsized"] == 0


def test_unknown_sizes_are_counted_apart():
    """A saved activation whose shape cannot be known (Q without a shape): its bytes are not
    guessed; it is counted in removed_unsized."""
    m = ortt_attention_masked()
    q = next(i for i in m.graph.input if i.name == "Q")
    q.type.tensor_type.ClearField("shape")
    del m.graph.value_info[:]
    diff = SavedDiff(m)
    diff.finish(_gone(m))
    d = diff.as_dict()
    assert d["removed"] == 1 and d["removed_unsized"] == 1 and d["removed_bytes"] == 0


def test_optimize_prints_and_reports_saved_activations(tmp_path):
    """torch_v_attn (3 attention layers of [B=2, 2 heads, S=4], all flash since the flash ops
    read masked_fill's bool mask): no layer keeps P for the backward; the CLI line and --json
    say so."""
    src = SAMPLES / "torch_v_attn.onnx"
    proc = run_cli("optimize", src, "-o", tmp_path / "o.onnx")
    line = [ln for ln in proc.stdout.splitlines() if "saved activations" in ln]
    assert len(line) == 1 and "forward tensors the backward reads" in line[0]
    assert "not a memory figure" in proc.stdout
    d = json.loads(run_cli("optimize", src, "-o", tmp_path / "p.onnx", "--json").stdout)
    sa = d["saved_activations"]
    m = onnx.load(src)
    probs = {n.output[0] for n in m.graph.node if n.op_type == "Softmax"}
    fp = FusionPass()
    fp.run(m)
    removed = set(fp.stats.saved.removed)
    assert len(probs & removed) == 3          # the three flash layers' P
    assert sa["removed"] == len(removed) and isinstance(sa["removed_bytes"], int)
    assert sa["removed_bytes"] >= 3 * (2 * 2 * 4 * 4 * 4)
