"""Flash-style attention in torch-joint graphs (issue 22 item 1: rules/flash_torch.yaml): each
variant on a real export (positive), one negative per guard (P read elsewhere, attention
dropout, a learned bias taking dS, a masked_fill mask), fine-tuning exports without dQ, dK or
dV (optional branches), and the fused graphs against the originals in onnxruntime. Expected
counts are the models' attention layers."""

from __future__ import annotations

import copy
from pathlib import Path

import onnx
import pytest

from conftest import SAMPLES

from fusecli import FusionPass
from test_flash import assert_verifies

CORPUS = SAMPLES.parent / "corpus"
DATA = Path(__file__).parent / "data"
GQA = DATA / "gqa"

# graph -> (flash rule, attention layers in the model code); the corpus graphs have 2 layers
# (scripts/corpus/archs.py LAYERS), the tests/data/make_gqa.py graphs one attention
POSITIVE = {
    "torch_llama": ("flash_torch_gqa_mask", 2),      # repeat_kv (2 KV heads) + causal mask
    "torch_mistral": ("flash_torch_gqa_mask", 2),    # repeat_kv (1 KV head) + causal mask
    "torch_qwen2": ("flash_torch_gqa_mask", 2),
    "torch_llama_raw": ("flash_torch_mask", 2),      # raw export: repeated K/V viewed in 4-D
    "torch_vit": ("flash_torch_plain", 2),           # no mask, Mul scale
    "torch_timm_vit": ("flash_torch_plain", 2),
    "torch_gqa_expand_kv2": ("flash_torch_gqa_plain", 1),
    # fine-tuning: layer 0 of a LoRA-q/v model has no dK (k_proj and everything below frozen)
    "torch_llama_lora": ("flash_torch_gqa_mask", 2),
    "torch_bert_lora": ("flash_torch_mask", 2),
    "torch_frozen_block": ("flash_torch_plain", 1),  # tests/data/make_frozen.py: no dK
    # tests/data/make_gqa.py: one projection frozen (x needs no gradient): no dQ / dK / dV
    "torch_gqa_expand_kv2_frozen_q": ("flash_torch_gqa_plain", 1),
    "torch_gqa_expand_kv2_frozen_k": ("flash_torch_gqa_plain", 1),
    "torch_gqa_expand_kv2_frozen_v": ("flash_torch_gqa_plain", 1),
}


def _load(name):
    for d in (CORPUS, GQA, DATA, SAMPLES):
        if (d / f"{name}.onnx").exists():
            return d / f"{name}.onnx"
    raise FileNotFoundError(name)


def _fuse(m, **kw):
    fused = copy.deepcopy(m)
    fp = FusionPass(**kw)
    fp.run(fused)
    return fused, fp.stats


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_flash_torch_variants_on_real_exports(name):
    rule, layers = POSITIVE[name]
    m = onnx.load(_load(name))
    softmax = {n.output[0] for n in m.graph.node if n.op_type == "Softmax"}
    fused, stats = _fuse(m)
    assert stats.rules[rule].fused == layers
    assert stats.patterns["flash_attention"].fused == layers
    assert stats.patterns["sdpa"].fused == 0
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("FlashAttention") == ops.count("FlashAttentionGrad") == layers
    # the probabilities are gone: no Softmax left, nothing reads its old outputs
    assert "Softmax" not in ops
    assert not softmax & {t for n in fused.graph.node for t in (*n.input, *n.output)}


def test_flash_torch_gqa_takes_kv_before_the_repeat():
    """repeat_kv absorbed: the fused ops read K0 / V0 [B, Hkv, S, D] (k_transposed 0) and write
    dK0 / dV0; no Expand of K / V stays for the attention."""
    m = onnx.load(_load("torch_llama"))
    fused, _ = _fuse(m)
    fwd = [n for n in fused.graph.node if n.op_type == "FlashAttention"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in fwd[0].attribute}
    assert attrs["k_transposed"] == 0
    prod = {o: n for n in fused.graph.node for o in n.output}
    for n in fwd:
        for t in n.input[1:3]:
            assert prod[t].op_type != "Expand"


def test_flash_torch_sample_layers():
    """torch_v_attn (scripts/samples/models.py AttnStack): the additive-mask, unmasked and
    masked_fill layers are all flash (3): the flash ops read masked_fill's bool mask."""
    fused, stats = _fuse(onnx.load(SAMPLES / "torch_v_attn.onnx"))
    assert stats.rules["flash_torch_mask"].fused == 1
    assert stats.rules["flash_torch_plain"].fused == 1
    assert stats.rules["flash_torch_masked_fill"].fused == 1
    assert stats.patterns["sdpa"].fused == 0


# --- negatives: one per guard; today's sdpa fusion applies instead ---------------------------

def test_flash_torch_refused_where_p_is_an_output():
    """A model that outputs its attentions (output_attentions): P is a graph output, so the
    flash rule refuses that layer and sdpa fuses it; the other layer is still flash."""
    m = onnx.load(_load("torch_llama"))
    p = next(n.output[0] for n in m.graph.node if n.op_type == "Softmax")
    m.graph.output.append(onnx.helper.make_empty_tensor_value_info(p))
    fused, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 1
    assert stats.patterns["flash_attention"].skipped == {"intermediate_is_graph_output": 1}
    assert stats.patterns["sdpa"].fused == 1


def test_flash_torch_refused_where_p_is_read_elsewhere():
    """Another reader of P (here a ReduceMax of the probabilities into a graph output)."""
    m = onnx.load(_load("torch_vit"))
    p = next(n.output[0] for n in m.graph.node if n.op_type == "Softmax")
    m.graph.node.append(onnx.helper.make_node("ReduceMax", [p], ["p_max"], keepdims=0))
    m.graph.output.append(onnx.helper.make_empty_tensor_value_info("p_max"))
    _, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 1
    assert stats.patterns["flash_attention"].skipped == {"intermediate_consumed_outside": 1}
    assert stats.patterns["sdpa"].fused == 1


@pytest.mark.parametrize("name,reason,layers", [
    ("torch_bert", None, 2),          # attention dropout on P: the chain is not flash's
    ("torch_gpt2", None, 2),          # dropout + GPT-2's causal where
    ("torch_t5", "intermediate_consumed_outside", 2),    # learned position bias takes dS
    ("torch_swin", "intermediate_consumed_outside", 3),  # relative-position bias takes dS
    # K / V broadcast over a 5-D group view [B, kv, 1, D, S] against the 4-D query heads
    # (flash_torch_mqa_* matches; the shape guard refuses K's extra batch dim)
    ("torch_gqa_bcast_kv2", "shape_mismatch", 1),
    # Tile's grouping (head h uses kv head h % Hkv, not the op's h // g)
    ("torch_gqa_tile_kv2", "shape_mismatch", 1),
])
def test_flash_torch_leaves_the_rest_to_sdpa(name, reason, layers):
    """Dropout, learned biases and other K / V groupings: no flash, and sdpa fuses
    every attention layer as before."""
    _, stats = _fuse(onnx.load(_load(name)))
    assert stats.patterns["flash_attention"].fused == 0
    if reason is None:
        assert stats.patterns["flash_attention"].detected == 0
    else:
        assert reason in stats.patterns["flash_attention"].skipped
    assert stats.patterns["sdpa"].fused == layers


# --- numerics ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["torch_llama", "torch_vit", "torch_llama_raw",
                                  "torch_gqa_expand_kv1", "torch_v_attn",
                                  # Where masks: masked_fill(finfo.min) of a run-time padding
                                  # mask, GPT-Neo's causal where + padding mask
                                  "torch_distilbert", "torch_gpt_neo"])
def test_flash_torch_fused_graph_verifies(name, tmp_path):
    src = _load(name)
    fused, stats = _fuse(onnx.load(src))
    assert stats.patterns["flash_attention"].fused >= 1
    assert_verifies(src, fused, stats, tmp_path)


# --- fine-tuning: any of dQ, dK, dV absent (issue 21) ---------------------------------------

def _given(node):
    """Which of FlashAttentionGrad's dQ, dK, dV the node computes (trailing "" dropped)."""
    return [bool(t) for t in (list(node.output) + ["", "", ""])[:3]]


@pytest.mark.parametrize("name,given", [
    ("torch_gqa_expand_kv2_frozen_q", [[False, True, True]]),
    ("torch_gqa_expand_kv2_frozen_k", [[True, False, True]]),
    ("torch_gqa_expand_kv2_frozen_v", [[True, True, False]]),
    ("torch_frozen_block", [[True, False, True]]),
    # LoRA on q / v: layer 0's K has no gradient (nothing below it trains), layer 1's has
    ("torch_llama_lora", [[True, False, True], [True, True, True]]),
    ("torch_bert_lora", [[True, False, True], [True, True, True]]),
])
def test_flash_torch_without_some_gradients(name, given, tmp_path):
    """The absent branch (with its views and repeat_kv's group sum) is not computed: the fused
    node leaves that output empty, and the fused graph verifies against the original."""
    src = _load(name)
    fused, stats = _fuse(onnx.load(src))
    bwd = [n for n in fused.graph.node if n.op_type == "FlashAttentionGrad"]
    assert sorted(_given(n) for n in bwd) == sorted(given)  # (in any layer order)
    assert "Softmax" not in [n.op_type for n in fused.graph.node]
    assert_verifies(src, fused, stats, tmp_path)


@pytest.mark.parametrize("name,read", [
    # dK absent, but dS is read by another node (a dK computed another way)
    ("torch_gqa_expand_kv2_frozen_k", "dS"),
    # dV absent, but P's batched view is read by another node (a dV computed another way)
    ("torch_gqa_expand_kv2_frozen_v", "P3"),
])
def test_flash_torch_absent_branch_is_no_licence_to_drop_a_reader(name, read):
    """An absent gradient branch is a node that is not there, not one the rule may remove: a
    reader of dS or P outside the match keeps the attention out of the flash rule."""
    m = onnx.load(_load(name))
    if read == "P3":  # the batched view of the probabilities, which the P @ V MatMul reads
        p4 = next(n.output[0] for n in m.graph.node if n.op_type == "Softmax")
        t = next(n.output[0] for n in m.graph.node if n.op_type == "Reshape" and n.input[0] == p4)
    else:  # dS: the softmax backward's Sub (dP * P - P * sum(dP * P)), after P's Muls
        p4 = next(n.output[0] for n in m.graph.node if n.op_type == "Softmax")
        p_muls = {n.output[0] for n in m.graph.node if n.op_type == "Mul" and p4 in n.input}
        t = next(n.output[0] for n in m.graph.node
                 if n.op_type == "Sub" and set(n.input) <= p_muls)
    m.graph.node.append(onnx.helper.make_node("ReduceMax", [t], ["extra"], keepdims=0))
    m.graph.output.append(onnx.helper.make_empty_tensor_value_info("extra"))
    fused, stats = _fuse(m)
    assert stats.patterns["flash_attention"].fused == 0
    assert stats.patterns["flash_attention"].skipped == {"intermediate_consumed_outside": 1}
    assert "FlashAttention" not in [n.op_type for n in fused.graph.node]
