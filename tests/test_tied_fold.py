"""The embedding tables' gradients (fusecli/engine/tied.py). A tied head's: the embedding's
rows scattered into the fused head's dW instead of into zeros and then added: one [V, D] table
at the end of the backward instead of three. Real exports of both families
(scripts/make_lce_spellings.py); the folded graph verified against the original on its runtime;
NumPy for the whole table's gradient: tests/test_lce_spellings.py::test_fused_head_matches_numpy
[reducemean_neg_tied]. An untied one's (ort-training GatherGrad): written with a static shape so
that onnxruntime plans it; real exports verified, the rewrite against NumPy's np.add.at."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fusecli import FusionPass
from fusecli.engine.tied import fold_tied_gradients, plan_embedding_gradients
from fusecli.runtime.verify import verify_models

from conftest import run_cli, run_cli_json

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
    # the embedding's scatter into zeros is gone (a positional table's GatherGrad is planned:
    # a ScatterND into ConstantOfShape, below)
    ops = [n.op_type for n in m.graph.node]
    unfolded = [n.op_type for n in _fused(name).graph.node]
    assert ops.count("ScatterND") == unfolded.count("ScatterND") + unfolded.count("GatherGrad")
    assert "GatherGrad" not in ops
    assert not any(n.op_type in ("Add", "Sum") and head.output[2] in n.input
                   for n in m.graph.node)
    onnx.save(m, tmp_path / "fused.onnx")
    report = verify_models(DATA / f"{name}.onnx", tmp_path / "fused.onnx")
    assert report.ok and report.max_rel <= 1e-5, report


def _fused(name):
    """The fixture fused by the rules with the fold and the planning undone: the tied head's
    Add / Sum of the fused dW and the embedding's scatter, the GatherGrads, as the rules leave
    them (the guards below run fold_tied_gradients / plan_embedding_gradients directly)."""
    m = onnx.load(DATA / f"{name}.onnx")
    with mock.patch("fusecli.engine.fusion.fold_tied_gradients", lambda model: []), \
            mock.patch("fusecli.engine.fusion.plan_embedding_gradients", lambda model: []):
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


# ---- untied tables: GatherGrad -> ScatterND into ConstantOfShape (plan_embedding_gradients) ----

# real ort-training exports with an untied table's GatherGrad: (file, the table's gradient)
UNTIED = [("ortt_lces_hf_llama_loss", "net.model.embed_tokens.weight_grad"),
          ("ortt_lces_lm_shift_ce", "net.emb.weight_grad")]


def test_cli_reports_the_planned_gradient(tmp_path):
    """`fusecli optimize` says it in the text report and in the JSON."""
    src = DATA / "ortt_lces_lm_shift_ce.onnx"
    text = run_cli("optimize", src, "-o", tmp_path / "a.onnx").stdout
    assert "embedding gradients: scattered into a statically shaped table, planned with the " \
           "step's buffers: net.emb.weight_grad" in text
    d = run_cli_json("optimize", src, "-o", tmp_path / "b.onnx")
    assert d["embedding_gradients_planned"] == ["net.emb.weight_grad"]


@pytest.mark.parametrize("name,grad", UNTIED)
def test_untied_embedding_gradient_is_planned(name, grad, tmp_path):
    m = onnx.load(DATA / f"{name}.onnx")
    (gg,) = [n for n in m.graph.node if n.op_type == "GatherGrad"]
    fp = FusionPass()
    fp.run(m)
    assert fp.stats.embedding_planned == [grad]
    assert fp.stats.as_dict()["embedding_gradients_planned"] == [grad]
    assert not any(n.op_type in ("GatherGrad", "Shape") and n.output[0] == gg.input[0]
                   for n in m.graph.node)
    (scat,) = [n for n in m.graph.node if grad in n.output]
    assert scat.op_type == "ScatterND"
    # the point: the table's shape is known before the run (onnx's own inference)
    inferred = onnx.shape_inference.infer_shapes(m)
    (vi,) = [v for v in inferred.graph.value_info if v.name == grad]
    table = next(i for i in m.graph.input if i.name == grad.removesuffix("_grad"))
    assert [d.dim_value for d in vi.type.tensor_type.shape.dim] == \
        [d.dim_value for d in table.type.tensor_type.shape.dim]
    onnx.save(m, tmp_path / "fused.onnx")
    report = verify_models(DATA / f"{name}.onnx", tmp_path / "fused.onnx")
    assert report.ok and report.max_rel <= 1e-5, report


def _gather_grad_graph(ids_type=onnx.TensorProto.INT64, opset=17, axis=0, start=None,
                       table_dims=(7, 3), elem=onnx.TensorProto.FLOAT, ids_dims=(2, 4),
                       rows_dims=(2, 4, 3), computed_ids=False):
    """E [7, 3] (a graph input), ids [2, 4], rows [2, 4, 3]:
    GatherGrad{axis}(Shape(E), ids, rows) -> dE (a graph output). With ``computed_ids`` the
    ids are computed in the graph (an Identity of the input), as position ids are."""
    shape_attrs = {} if start is None else {"start": start}
    ids = "ids_computed" if computed_ids else "ids"
    nodes = [helper.make_node("Identity", ["ids"], [ids])] if computed_ids else []
    nodes += [helper.make_node("Shape", ["E"], ["E_shape"], **shape_attrs),
              helper.make_node("GatherGrad", ["E_shape", ids, "rows"], ["dE"],
                               domain="com.microsoft", axis=axis)]
    g = helper.make_graph(nodes, "gg", [
        helper.make_tensor_value_info("E", elem, list(table_dims)),
        helper.make_tensor_value_info("ids", ids_type, list(ids_dims)),
        helper.make_tensor_value_info("rows", elem, list(rows_dims))],
        [helper.make_tensor_value_info("dE", elem, None)],
        value_info=[helper.make_tensor_value_info(ids, ids_type, list(ids_dims))]
        if computed_ids else None)
    return helper.make_model(g, ir_version=9, opset_imports=[helper.make_opsetid("", opset),
                                               helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("ids_type", [onnx.TensorProto.INT64, onnx.TensorProto.INT32],
                         ids=["int64", "int32"])
def test_planned_table_matches_numpy(ids_type):
    """The rewrite alone (standard ops: ConstantOfShape, [Cast,] Reshape, Slice, ScatterND{add})
    on onnxruntime against NumPy's unbuffered scatter-add, repeated ids included."""
    import onnxruntime as ort

    m = _gather_grad_graph(ids_type)
    assert plan_embedding_gradients(m) == ["dE"]
    assert {n.op_type for n in m.graph.node} == (
        {"ConstantOfShape", "Reshape", "Slice", "ScatterND"} |
        ({"Cast"} if ids_type == onnx.TensorProto.INT32 else set()))
    rng = np.random.default_rng(0)
    ids = np.array([[0, 3, 3, 6], [1, 3, 0, 5]])
    rows = rng.standard_normal((2, 4, 3)).astype(np.float32)
    feeds = {"E": np.zeros((7, 3), np.float32),
             "ids": ids.astype(np.int32 if ids_type == onnx.TensorProto.INT32 else np.int64),
             "rows": rows}
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, feeds)
    want = np.zeros((7, 3), np.float64)
    np.add.at(want, ids.reshape(-1), rows.reshape(-1, 3).astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_planned_table_reads_the_rows_gathergrad_reads(tmp_path):
    """Position ids [1, 4] against a [2, 4, 3] gradient (the rows broadcast over a batch the
    ids lack): onnxruntime-training's GatherGrad reads the first 4 rows only, and so must the
    rewrite. Both graphs on onnxruntime-training (verify), and NumPy."""
    orig = _gather_grad_graph(ids_dims=(1, 4), rows_dims=(2, 4, 3))
    onnx.save(orig, tmp_path / "orig.onnx")
    planned = onnx.ModelProto()
    planned.CopyFrom(orig)
    assert plan_embedding_gradients(planned) == ["dE"]
    onnx.save(planned, tmp_path / "planned.onnx")
    rng = np.random.default_rng(1)
    ids = np.array([[0, 3, 3, 6]])
    rows = rng.standard_normal((2, 4, 3)).astype(np.float32)
    np.savez(tmp_path / "feeds.npz", E=np.zeros((7, 3), np.float32), ids=ids, rows=rows)
    report = verify_models(tmp_path / "orig.onnx", tmp_path / "planned.onnx",
                           feeds_file=tmp_path / "feeds.npz")
    assert report.ok and report.max_rel <= 1e-6, report
    import onnxruntime as ort

    sess = ort.InferenceSession(planned.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"E": np.zeros((7, 3), np.float32), "ids": ids, "rows": rows})
    want = np.zeros((7, 3), np.float64)
    np.add.at(want, ids.reshape(-1), rows[0].astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fed,rows_batch", [((2, 4), 2), ((3, 4), 3), ((1, 4), 2)],
                         ids=["batch2", "batch3", "rows_broadcast"])
def test_symbolic_token_ids_are_counted_at_run_time(fed, rows_batch, tmp_path):
    """Token ids fed as a graph input [batch, 4], rows recorded [batch, 4, 3]: the count is
    Size(ids) at run time and the rows are read up to it, so one graph serves every batch, and
    ids [1, 4] against a [2, 4, 3] gradient (the recorded shape not holding) read the first 4
    rows, as GatherGrad does. The rewrite on onnxruntime against NumPy, and against GatherGrad
    on onnxruntime-training (verify)."""
    import onnxruntime as ort

    orig = _gather_grad_graph(ids_dims=("batch", 4), rows_dims=("batch", 4, 3))
    m = onnx.ModelProto()
    m.CopyFrom(orig)
    assert plan_embedding_gradients(m) == ["dE"]
    assert "Size" in [n.op_type for n in m.graph.node]
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 7, fed)
    rows = rng.standard_normal((rows_batch, 4, 3)).astype(np.float32)
    feeds = {"E": np.zeros((7, 3), np.float32), "ids": ids, "rows": rows}
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, feeds)
    want = np.zeros((7, 3), np.float64)
    np.add.at(want, ids.reshape(-1), rows.reshape(-1, 3)[:ids.size].astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for g in (orig, m):   # verify checks feeds against the recorded dims: record the truth
        rows_in = next(i for i in g.graph.input if i.name == "rows")
        rows_in.type.tensor_type.shape.dim[0].dim_param = "rows_batch"
    onnx.save(orig, tmp_path / "orig.onnx")
    onnx.save(m, tmp_path / "planned.onnx")
    np.savez(tmp_path / "feeds.npz", **feeds)
    report = verify_models(tmp_path / "orig.onnx", tmp_path / "planned.onnx",
                           feeds_file=tmp_path / "feeds.npz")
    assert report.ok and report.max_rel <= 1e-6, report


@pytest.mark.parametrize("change", ["opset15", "axis1", "shape_start", "symbolic",
                                    "computed_ids", "rows_other_dims", "unnamed_ids_dim",
                                    "bfloat16"])
def test_gathergrad_guards(change):
    """Left as it is: no ScatterND reduction (opset < 16), another axis, a partial Shape, a
    table of unknown size, symbolic ids computed in the graph (position ids), symbolic ids
    whose rows are recorded with other dims or with an unnamed dim, an element type without a
    ConstantOfShape zero here."""
    kw = {"opset15": {"opset": 15}, "axis1": {"axis": 1}, "shape_start": {"start": 1},
          "symbolic": {"table_dims": ("V", 3)},
          "computed_ids": {"ids_dims": ("batch", 4), "rows_dims": ("batch", 4, 3),
                           "computed_ids": True},
          "rows_other_dims": {"ids_dims": ("batch", 4), "rows_dims": ("rows", 4, 3)},
          "unnamed_ids_dim": {"ids_dims": ("", 4), "rows_dims": ("", 4, 3)},
          "bfloat16": {"elem": onnx.TensorProto.BFLOAT16}}[change]
    m = _gather_grad_graph(**kw)
    assert plan_embedding_gradients(m) == []
    assert [n.op_type for n in m.graph.node if n.op_type != "Identity"] == \
        ["Shape", "GatherGrad"]


def test_gathergrad_control():
    """The guards' graph itself is planned (each guard above changes one thing)."""
    assert plan_embedding_gradients(_gather_grad_graph()) == ["dE"]
