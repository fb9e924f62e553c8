"""Soft-capped scores (issue 36: every spelling real exports use): Gemma 2's attention
(attn_logit_softcapping, c tanh(scale Q K^T / c) before the mask) and LM head
(final_logit_softcapping) fuse into FlashAttention / FlashAttentionGrad and LinearCrossEntropy
with their `softcap` / `logit_softcap` attribute (rules/flash_*.yaml and rules/lce_*.yaml
_softcap), on real Gemma2ForCausalLM exports of both families (scripts/corpus/archs.py
gemma2_lm, scripts/corpus/gen.py: 2 layers, one of them sliding-window), and the fused graphs
compute what the originals do. The kernels against their references: fusecli/ops/
flash_attention_grad/test_flash_attention_grad.py, fusecli/ops/linear_cross_entropy/; every
_softcap variant's positive and guard fixtures: tests/test_rules.py."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import helper

from fusecli import FusionPass
from fusecli.runtime.verify import verify_models

DATA = Path(__file__).parent / "data"
# the model code (transformers' Gemma2Config defaults): attn_logit_softcapping 50 in each of
# the 2 layers, final_logit_softcapping 30 on the tied head
ATTN_CAP, LOGIT_CAP, LAYERS = 50.0, 30.0, 2


def _attrs(n):
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


@pytest.mark.parametrize("family", ["ortt", "torch"])
def test_gemma2_attention_and_head_fuse_with_their_caps_and_verify(family, tmp_path):
    src = DATA / f"{family}_lces_gemma2_lm.onnx"
    m = onnx.load(src)
    fp = FusionPass()
    fp.run(m)
    assert fp.stats.patterns["flash_attention"].fused == LAYERS
    assert fp.stats.patterns["linear_cross_entropy"].fused == 1
    ops = [n.op_type for n in m.graph.node]
    assert not set(ops) & {"TanhGrad", "Softmax", "SoftmaxGrad_13", "LogSoftmax",
                           "SoftmaxCrossEntropyLoss"}
    # every cap's Tanh (reading its Div by the cap) is gone; the MLP's tanh-GELU forward,
    # where the graph keeps it, reads a Mul
    producer = {o: n for n in m.graph.node for o in n.output}
    assert not [n for n in m.graph.node if n.op_type == "Tanh"
                and producer[n.input[0]].op_type == "Div"]
    flash = [n for n in m.graph.node if n.op_type in ("FlashAttention", "FlashAttentionGrad")]
    assert len(flash) == 2 * LAYERS
    assert all(_attrs(n)["softcap"] == pytest.approx(ATTN_CAP) for n in flash)
    lce = [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"]
    assert [_attrs(n)["logit_softcap"] for n in lce] == [pytest.approx(LOGIT_CAP)]
    onnx.save(m, tmp_path / "fused.onnx")
    report = verify_models(src, tmp_path / "fused.onnx")
    assert report.ok and report.max_rel <= 1e-5, report
