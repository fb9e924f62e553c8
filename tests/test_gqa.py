"""Grouped- and multi-query attention in the spellings real code repeats K/V with
(tests/data/make_gqa.py: one attention layer, 4 query heads over 2 or 1 key/value heads, both
families through the corpus exporters):

- expand (transformers' repeat_kv: Unsqueeze -> Expand -> Reshape) and, in torch-joint,
  repeat_interleave (exported the same way): the *_gqa variants take K/V before the repeat and
  sum dK/dV over each group inside AttentionGrad;
- K/V broadcast inside the MatMuls (q viewed [B, Hkv, g, S, D]): ort-training's ReduceSum
  (keepdims=0) + Reshape back to K/V's shape, torch-joint's expanded bmm views and their
  Reshape -> ReduceSum(keepdims=1) [-> Transpose] are absorbed, the op sums the group;
- the rest fuses the attention on the repeated K/V and leaves the repeat's backward (the group
  sum) outside: ort-training's repeat_interleave (Unsqueeze -> Tile -> Reshape), and Tile (`x.repeat(1, g, 1, 1)`: head h uses kv head
  h % Hkv, not the contract's h // g, so it can never be summed inside).

Every fused graph must verify against the original in its runtime, and every fusion must match
its NumPy reference on the original's tensors.
"""
from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from fusecli import FusionPass
from fusecli.engine.graph import GraphIndex
from fusecli.runtime.verify import check_fusions, verify_models

DATA = Path(__file__).parent / "data" / "gqa"

# fixture -> (rule that fuses its attention, dK/dV summed over the group inside the op)
CASES = {
    "ortt_gqa_expand_kv2": ("sdpa_ortt_scores_plain_gqa", True),
    "ortt_gqa_expand_kv1": ("sdpa_ortt_scores_plain_gqa", True),
    "ortt_gqa_bcast_kv2": ("sdpa_ortt_scores_plain", True),
    "ortt_gqa_bcast_kv1": ("sdpa_ortt_scores_plain", True),
    "ortt_gqa_interleave_kv2": ("sdpa_ortt_scores_plain", False),
    "ortt_gqa_tile_kv2": ("sdpa_ortt_scores_plain", False),
    "torch_gqa_expand_kv2": ("sdpa_torch_plain_gqa", True),
    "torch_gqa_expand_kv1": ("sdpa_torch_plain_gqa", True),
    "torch_gqa_interleave_kv2": ("sdpa_torch_plain_gqa", True),
    "torch_gqa_bcast_kv2": ("sdpa_torch_plain_bcast", True),
    "torch_gqa_bcast_kv1": ("sdpa_torch_plain_bcast", True),
    "torch_gqa_tile_kv2": ("sdpa_torch_plain", False),
}


def _param(name):
    return pytest.param(name, marks=pytest.mark.ortt) if name.startswith("ortt") else name


def _fuse(name):
    m = onnx.load(DATA / f"{name}.onnx")
    # the sdpa rules' grouped-K/V spellings: without the flash rules, which take the
    # ort-training graphs first (tests/test_flash.py fuses and verifies them)
    fp = FusionPass(skip=["flash_attention"])
    fp.run(m)
    return m, fp.stats


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("name", [_param(n) for n in sorted(CASES)])
def test_gqa_spelling_fuses_and_verifies(name, tmp_path):
    rule, inside = CASES[name]
    m, stats = _fuse(name)
    recs = [r for r in stats.fusions if r.pattern == "sdpa"]
    assert [r.rule for r in recs] == [rule]
    # summed inside: the op's K and V hold fewer heads than Q (P's batch); outside: as many
    index = GraphIndex(m.graph)
    node = next(n for n in m.graph.node if n.op_type == "AttentionGrad")
    q, k, v = (index.shape(node.input[i]) for i in (1, 2, 3))
    assert None not in (q, k, v), (q, k, v)
    fewer = _numel(k) < _numel(q) and _numel(v) < _numel(q)
    assert fewer == inside, (q, k, v)
    out = tmp_path / f"{name}.fused.onnx"
    onnx.save(m, out)
    report = verify_models(DATA / f"{name}.onnx", out)
    assert report.ok, [d.as_dict() for d in report.diffs if not d.ok]
    checks = check_fusions(DATA / f"{name}.onnx", stats.fusions, atol=1e-6)
    assert len(checks) == stats.total_fused
    assert not [(c.rule, d.name) for c in checks for d in c.outputs if not d.ok]


@pytest.mark.ortt
def test_broadcast_head_sum_reshaped_to_another_shape_is_refused(tmp_path):
    """ort-training's broadcast-MatMul gradient sums with keepdims=0 and Reshapes back to K/V's
    shape; a Reshape to any other shape must not become the op's dV (shape guard). The rules
    refuse dV there; the variant without a dV branch (sdpa_ortt_scores_plain_nov) fuses dQ and
    dK and leaves the dV GEMM, its sum and that Reshape as they are (they read only P and dO;
    the mutated graph itself does not run: the Squeeze after that Reshape refuses its shape).
    The same partial fusion on a graph that runs verifies: tests/test_frozen.py
    (test_a_variant_never_drops_a_gradient_the_graph_computes)."""
    from onnx import numpy_helper

    m = onnx.load(DATA / "ortt_gqa_bcast_kv2.onnx")
    index = GraphIndex(m.graph)
    v_sum = next(n for n in m.graph.node if n.op_type == "ReduceSum"
                 and index.producer[n.input[0]].name == "/MatMul_1_Grad/FusedMatMul_1")
    view = index.consumers[v_sum.output[0]][0]
    assert view.op == "Reshape"
    m.graph.initializer.append(numpy_helper.from_array(
        __import__("numpy").array([2, 1, 2, 4, 4], dtype="int64"), "wrong_shape"))
    view.proto.input[1] = "wrong_shape"
    for vi in [vi for vi in m.graph.value_info if vi.name == view.outputs[0]]:
        m.graph.value_info.remove(vi)  # its recorded shape would no longer be true
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    fp = FusionPass(only={"sdpa_ortt_scores_plain"})
    fp.run(onnx.load(src))
    assert fp.stats.patterns["sdpa"].fused == 0
    assert "shape_mismatch" in fp.stats.patterns["sdpa"].skipped
    fp = FusionPass()
    fp.run(m)
    assert [f.rule for f in fp.stats.fusions] == ["sdpa_ortt_scores_plain_nov"]
    (n,) = [n for n in m.graph.node if n.op_type == "AttentionGrad"]
    assert len(n.output) < 3 or not n.output[2]  # no dV
    assert [n.op_type for n in m.graph.node if view.outputs[0] in n.output] == ["Reshape"]
