"""Exports with symbolic batch and sequence, both families.

ort-training (TorchScript `dynamic_axes`): the exporter computes the views' targets and
`x.size(-1)` at run time from Shape, and records the dims it could not compute as names it made
up, the heads and head size included. Before the shape engine read the static entries of
run-time view targets and of run-time Slices of shapes, GPT-2 fused neither its attention (its
scale `Div(S, Pow(Cast(Slice(Shape(V), -1)), 0.5))`) nor its MLP (the gradient viewed back
through Shape(X)), and Qwen3 none of its rotary embeddings (the half point `x.shape[-1] // 2`
is a constant there, but the sliced tensor's last dim was a name).

torch-joint (torch.export with `dynamic_shapes`, then the joint graph): the LM head's logits
[N, V] keep transformers' `logits.view(-1, V)` (and their gradient the same view back) as a
Reshape [-1, V] that the static export folds away; before the linear + cross-entropy rules
passed through that identity view, no LM head fused (0 of the 11 graphs of SWEEP.md's
torch-joint symbolic sweep).

Fixtures: `scripts/corpus/gen.py --out DIR --symbolic FAMILY ARCH` (the corpus architectures,
each checked against torch autograd by gen.py), copied to
tests/data/{ortt,torch}_symbolic_{arch}.onnx, and the counts gen.py derived from the model code
(its JSON fragments' 'expected') to tests/data/symbolic_expected.json.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from fusecli import FusionPass, load_rules
from fusecli.engine.explain import explain_model
from fusecli.runtime.verify import verify_models

DATA = Path(__file__).parent / "data"
# (the exporters' names for the labels' dims: the flattened tokens, a classifier's batch)
DIMS = {"batch": 2, "sequence": 16, "Reshapeoutput_dim_0": 32, "Gemmoutput_dim_0": 2}
# per graph: the counts gen.py derived from the model code (data about the graph, beside it)
EXPECTED = json.loads((DATA / "symbolic_expected.json").read_text())["graphs"]


def _fused(m):
    fp = FusionPass()
    fp.run(m)
    return {p: s.fused for p, s in fp.stats.patterns.items() if s.fused}, fp


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_symbolic_exports_fuse_what_the_model_code_has_and_verify(name, tmp_path):
    """Every chain the model code has fuses; its attention calls as flash attention (no
    dropout, the probabilities read by nothing else)."""
    src = DATA / f"{name}.onnx"
    m = onnx.load(src)
    counts, fp = _fused(m)
    attention = counts.pop("flash_attention", 0)
    assert counts == EXPECTED[name]["counts"]
    assert attention == EXPECTED[name]["attention"]
    assert not any(s.skipped for s in fp.stats.patterns.values())
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(src, out, dims=DIMS)
    assert report.ok and report.max_rel <= 1e-5, report


def test_a_run_time_view_back_to_another_width_is_not_a_flatten():
    """The MLP's gradient is viewed back to Shape(X) of the 2-D [N, 4D] activation: a run-time
    target [M, n] flattens only when n is the gradient's own static last dim. Pointed at
    Shape of the [N, 3D] attention projection instead, that layer's MLP does not fuse, and
    explain says why."""
    m = onnx.load(DATA / "ortt_symbolic_gpt2_lm.onnx")
    shape = next(n for n in m.graph.node if n.op_type == "Shape"
                 and n.output[0] == "/net/transformer/h.0/mlp/c_fc/Reshape_1_Grad/x_shape")
    shape.input[0] = "/net/transformer/h.0/attn/c_attn/Gemm_output_0"
    counts, _ = _fused(copy.deepcopy(m))
    assert counts["linear_gelu"] == 1
    rules = load_rules()
    this = next(r for r in rules if r.name == "linear_gelu_tanh_ortt_matmul")
    misses = explain_model(m, FusionPass(rules=[r for r in rules if r.order <= this.order]),
                           node_names=["GPT2Gelu_Grad/FastGeluGrad_0"])
    mine = [x for x in misses if x["rule"] == this.name]
    assert [x["reason"] for x in mine] == ["constant"]
    assert "here computed at run time: [M, n], n the data's static last dim" in mine[0]["detail"]


def test_a_logits_view_that_is_no_flatten_is_not_passed_through():
    """torch-joint: the LM head's logits reach LogSoftmax through Reshape [-1, V], the identity
    on [N, V]. Given a 3-D target [-1, 1, V] instead, the view is no longer the identity, the
    head does not fuse, and explain names the shape."""
    m = onnx.load(DATA / "torch_symbolic_llama_lm.onnx")
    lsm = next(n for n in m.graph.node if n.op_type == "LogSoftmax")
    view = next(n for n in m.graph.node if n.output[0] == lsm.input[0])
    assert view.op_type == "Reshape"
    m.graph.initializer.append(onnx.numpy_helper.from_array(
        np.array([-1, 1, 101], np.int64), "not_a_flatten"))
    view.input[1] = "not_a_flatten"
    counts, _ = _fused(copy.deepcopy(m))
    assert "linear_cross_entropy" not in counts
    assert counts["swiglu"] == 2  # the rest fuses as before
    rules = load_rules()
    this = next(r for r in rules if r.name == "lce_torch_mean")
    misses = explain_model(m, FusionPass(rules=[r for r in rules if r.order <= this.order]),
                           node_names=[lsm.name])
    mine = [x for x in misses if x["rule"] == this.name]
    assert [x["reason"] for x in mine] == ["constant"]
    assert "a shape that flattens the leading dims" in mine[0]["detail"]


def test_a_run_time_pairs_view_must_split_the_last_dim_in_half():
    """torch-joint, rotate-every-two (Helium): the rotation's gradient is viewed to pairs
    [..., n/2, 2] by a target computed at run time, Concat(batch, heads, sequence, n/2, 2).
    With n/2 replaced by 1 the view no longer pairs the last dim: those rotated tensors do not
    fuse, and explain says why."""
    m = onnx.load(DATA / "torch_symbolic_helium_lm.onnx")
    rope = next(r for r in load_rules() if r.name == "rope_interleaved_torch")
    prod = {o: n for n in m.graph.node for o in n.output}
    views = [n for n in m.graph.node if n.op_type == "Reshape" and n.input[1] in prod
             and prod[n.input[1]].op_type == "Concat" and len(prod[n.input[1]].input) == 5]
    assert views
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "one"))
    for v in views:
        prod[v.input[1]].input[3] = "one"
    counts, _ = _fused(copy.deepcopy(m))
    assert "rope" not in counts
    assert counts["rmsnorm"] == 5  # the rest fuses as before
    misses = explain_model(m, FusionPass(rules=[rope]))
    details = [x["detail"] for x in misses if x["reason"] == "constant"]
    assert any("here computed at run time" in d for d in details), details


def test_a_run_time_arange_must_count_the_batch():
    """torch-joint, a pooled sequence classifier (Llama's): the pairs of GatherND are
    Concat(arange(B), positions), arange computed at run time from the batch dim of
    attention_mask. Counting the sequence dim instead, it is no arange of the logits' view's
    first dim: the head does not fuse, and explain says why."""
    m = onnx.load(DATA / "torch_symbolic_llama_seqcls.onnx")
    prod = {o: n for n in m.graph.node for o in n.output}
    lsm = next(n for n in m.graph.node if n.op_type == "LogSoftmax")
    gnd = prod[prod[lsm.input[0]].input[0]]  # LogSoftmax <- the pooled logits' flatten
    assert gnd.op_type == "GatherND"
    unsq = prod[prod[gnd.input[1]].input[0]]
    rng = prod[unsq.input[0]]
    assert (unsq.op_type, rng.op_type) == ("Unsqueeze", "Range")
    mask = next(i.name for i in m.graph.input if i.name == "attention_mask")
    m.graph.node.extend([
        onnx.helper.make_node("Shape", [mask], ["seq_dim_v"], start=1, end=2),
        onnx.helper.make_node("Squeeze", ["seq_dim_v"], ["seq_dim"])])
    rng.input[1] = "seq_dim"
    # keep the graph sorted: the two new nodes before the Range
    nodes = list(m.graph.node)
    at = nodes.index(rng)
    nodes = nodes[:at] + nodes[-2:] + nodes[at:-2]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    counts, _ = _fused(copy.deepcopy(m))
    assert "linear_cross_entropy" not in counts
    this = next(r for r in load_rules() if r.name == "lce_torch_nllloss_pooled")
    misses = explain_model(m, FusionPass(rules=[this]))
    details = [x["detail"] for x in misses if x["reason"] == "constant"]
    assert any("computed at run time" in d and "sequence" in d for d in details), details


def test_a_round_trip_of_views_must_end_in_its_input_shape():
    """torch-joint, Falcon's multi-query attention under symbolic dims: the scaled scores go
    [B, H, S, S] -> [B * H, S, S] -> [B, H, S, S] before the mask (and dS the same way before
    the scale's gradient), the identity, passed through (`same_shape_as`). Ending the round
    trip in another shape, [B, H, S * S, 1], it is no identity: that layer's attention is not
    fused as flash attention, and explain names the two shapes."""
    m = onnx.load(DATA / "torch_symbolic_falcon_lm.onnx")
    prod = {o: n for n in m.graph.node for o in n.output}
    sm = [n for n in m.graph.node if n.op_type == "Softmax"][0]
    add = prod[sm.input[0]]
    back = next(prod[t] for t in add.input if t in prod and prod[t].op_type == "Reshape")
    assert prod[back.input[0]].op_type == "Reshape"  # the round trip's two views
    out = back.output[0]
    vi = next(v for v in m.graph.value_info if v.name == out)
    dims = vi.type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_value = "sequence*sequence", 1
    counts, _ = _fused(copy.deepcopy(m))
    assert counts.get("flash_attention", 0) == 1
    rules = load_rules()
    this = next(r for r in rules if r.name == "flash_torch_mqa_mask")
    misses = explain_model(m, FusionPass(rules=[this]), node_names=[sm.name])
    assert any("the other end of its chain of views" in x["detail"]
               and "'sequence*sequence', 1]" in x["detail"] for x in misses), misses


def test_lora_base_gradient_viewed_back_must_take_the_adapters_shape():
    """torch-joint, peft LoRA under symbolic dims: the frozen base's input gradient is computed
    on a 2-D view of dZ and viewed back before the Add with the adapter's; that view back is
    absorbed only where it gives the adapter's dX shape (`same_shape_as`). Recorded as another
    shape, it is not: the layer still fuses, on the two 2-D gradients (the op writes them
    apart), and the view back and the Add stay in the graph."""
    m = onnx.load(DATA / "torch_symbolic_llama_lora.onnx")
    rule = next(r for r in load_rules() if r.name == "lora_identity_torch_dx")
    fp = FusionPass(rules=[rule])
    fp.run(copy.deepcopy(m))
    rec = fp.stats.fusions[0]
    back, flat = rec.tensors["dXb"], rec.tensors["dXb2"]
    assert back != flat  # the view back is absorbed
    vi = next(v for v in m.graph.value_info if v.name == back)
    vi.type.tensor_type.shape.dim[2].dim_value = 7
    fp = FusionPass(rules=[rule])
    fp.run(m)
    recs = [r for r in fp.stats.fusions if r.tensors.get("dXb2") == flat]
    assert len(recs) == 1 and recs[0].tensors["dXb"] == flat  # fused without the view back
    assert any(back in n.output for n in m.graph.node)
