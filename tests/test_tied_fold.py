"""A tied head's gradient (fusecli/engine/tied.py): the embedding's rows scattered into the
fused head's dW instead of into zeros and then added: one [V, D] table at the end of the
backward instead of three. Real exports of both families (scripts/make_lce_spellings.py);
the folded graph verified against the original on its runtime; NumPy for the whole table's
gradient: tests/test_lce_spellings.py::test_fused_head_matches_numpy[reducemean_neg_tied]."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusecli import FusionPass
from fusecli.engine.tied import fold_tied_gradients
from fusecli.runtime.verify import verify_models

DATA = Path(__file__).parent / "data"
# the tied fixtures: (file, the table's gradient output, the op the embedding's part was)
TIED = [("ortt_lces_lm_shift_ce_tied", "net.emb.weight_grad", "GatherGrad"),
        ("ortt_lces_hf_gpt2_loss_tied", "net.transformer.wte.weight_grad", "GatherGrad"),
        ("torch_lces_shift_ce_sum_tied", "emb.weight_grad", "ScatterND"),
        ("torch_lces_reducemean_neg_tied", "emb.weight_grad", "ScatterND")]


@pytest.mark.parametrize("name,grad,op", TIED)
def test_tied_gradient_is_scattered_into_the_heads_dw(name, grad, op, tmp_path):
    m = onnx.load(DATA / f"{name}.onnx")
    before = [n.op_type for n in m.graph.node]
    assert op in before and ("Sum" in before or "Add" in before)
    fp = FusionPass()
    fp.run(m)
    assert fp.stats.tied_folded == [grad]
    assert fp.stats.as_dict()["tied_gradients_folded"] == [grad]
    (head,) = [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"
               and len(n.output) > 2 and n.output[2]]
    (scat,) = [n for n in m.graph.node if head.output[2] in n.input]
    assert scat.op_type == "ScatterND" and scat.output[0] == grad
    assert [a.s for a in scat.attribute if a.name == "reduction"] == [b"add"]
    assert scat.input[0] == head.output[2]
    # the embedding's scatter into zeros is gone (a positional table's GatherGrad stays)
    ops = [n.op_type for n in m.graph.node]
    unfolded = [n.op_type for n in _fused(name).graph.node]
    assert ops.count(op) == unfolded.count(op) - (op == "GatherGrad")
    assert not any(n.op_type in ("Add", "Sum") and head.output[2] in n.input
                   for n in m.graph.node)
    onnx.save(m, tmp_path / "fused.onnx")
    report = verify_models(DATA / f"{name}.onnx", tmp_path / "fused.onnx")
    assert report.ok and report.max_rel <= 1e-5, report


def _fused(name):
    """The fixture fused by the rules with the fold undone: the tied head's Add / Sum of the
    fused dW and the embedding's scatter, as the rules leave it (fold_tied_gradients runs on
    it directly in the guards below)."""
    m = onnx.load(DATA / f"{name}.onnx")
    with mock.patch("fusecli.engine.fusion.fold_tied_gradients", lambda model: []):
        FusionPass().run(m)
    return m


def test_control_the_guards_start_from_a_foldable_graph():
    for name, grad, _ in TIED:
        assert fold_tied_gradients(_fused(name)) == [grad]


def test_dw_read_elsewhere_is_not_folded():
    """The head's dW also a graph output: it must stay the head's part alone."""
    m = _fused("ortt_lces_lm_shift_ce_tied")
    head = next(n for n in m.graph.node if n.op_type == "LinearCrossEntropy")
    m.graph.output.append(helper.make_tensor_value_info(head.output[2], onnx.TensorProto.FLOAT,
                                                        None))
    assert fold_tied_gradients(m) == []
    assert "Sum" in [n.op_type for n in m.graph.node]


def test_opset_without_scatter_reduction_is_not_folded():
    """ScatterND's reduction needs ai.onnx 16: below it the GatherGrad and Sum stay."""
    m = _fused("ortt_lces_lm_shift_ce_tied")
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = 15
    assert fold_tied_gradients(m) == []


def test_gathergrad_into_another_shape_is_not_folded():
    """The GatherGrad must scatter into Shape(W) of the fused head's own weight."""
    m = _fused("ortt_lces_lm_shift_ce_tied")
    gg = next(n for n in m.graph.node if n.op_type == "GatherGrad")
    m.graph.initializer.append(numpy_helper.from_array(np.array([50, 16], np.int64), "shp"))
    gg.input[0] = "shp"
    assert fold_tied_gradients(m) == []


def test_scatter_into_nonzero_data_is_not_folded():
    """torch-joint: the scatter's data must be zeros (here a ones table of the same shape:
    the Add would then add the ones too)."""
    m = _fused("torch_lces_reducemean_neg_tied")
    sc = next(n for n in m.graph.node if n.op_type == "ScatterND"
              and any(a.name == "reduction" and a.s == b"add" for a in n.attribute))
    head = next(n for n in m.graph.node if n.op_type == "LinearCrossEntropy")
    w = next(i for i in m.graph.input if i.name == head.input[1])
    shape = [d.dim_value for d in w.type.tensor_type.shape.dim]
    m.graph.initializer.append(numpy_helper.from_array(np.ones(shape, np.float32), "ones"))
    sc.input[0] = "ones"
    assert fold_tied_gradients(m) == []


def test_dw_of_unknown_shape_is_not_folded():
    """The fused output's shape must be recorded and static (the Add may broadcast)."""
    m = _fused("torch_lces_reducemean_neg_tied")
    head = next(n for n in m.graph.node if n.op_type == "LinearCrossEntropy")
    keep = [v for v in m.graph.value_info if v.name != head.output[2]]
    del m.graph.value_info[:]
    m.graph.value_info.extend(keep)
    assert fold_tied_gradients(m) == []
