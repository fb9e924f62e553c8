"""Every shipped rule: a positive fixture (it fires on a real sample) and one negative fixture
per guard, made by mutating exactly one matched instance of that real sample:

- wrong attribute: an attribute the rule constrains, on a required node, changed;
- wrong constant: a constant the rule checks, replaced (for that node only) by another value;
- wrong domain: the anchor node moved to another domain;
- extra consumer: an outside node (and graph output) reading an intermediate of the match;
- graph-output intermediate: an intermediate of the match made a graph output.

Each mutated instance must not be fused by the rule (the other instances still are), and
`explain` must name the real reason. Synthetic fixtures cover variants the samples lack.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import builders
from conftest import SAMPLES

from fusecli import FusionPass, load_rules
from fusecli.engine.explain import explain_model
from fusecli.engine.fusion import has_required_ops
from fusecli.engine.rules import DEFERRED_KINDS, var_name
from test_lce import with_run_time_seed

RULES = load_rules()
SAMPLE_MODELS = {p.stem: onnx.load(p) for p in sorted(SAMPLES.glob("*.onnx"))}
# variants the samples lack (a 3-D SiLU MLP in the ort-training spelling; torch-joint Linears
# whose weight grad is A^T dZ: Hugging Face Conv1D [in, out] weights through addmm)
SAMPLE_MODELS["synthetic_ortt_silu_3d"] = builders.ortt_linear_act_matmul("silu")
# a 3-D Linear exported as Gemm on a 2-D Reshape (GPT-2's Conv1D), every ort-training activation
for _act in ("relu", "gelu", "gelu_fast", "silu", "quick_gelu"):
    SAMPLE_MODELS[f"synthetic_ortt_{_act}_gemm2d"] = builders.ortt_linear_act_gemm2d(_act)
_BY_NAME = {r.name: r for r in RULES}
for _act in ("relu", "gelu", "gelu_tanh", "silu"):
    SAMPLE_MODELS[f"synthetic_torch_{_act}_conv1d"] = builders.torch_linear_act(
        _BY_NAME[f"act_{_act}_grad_torch"], layout="conv1d", three_d=True)
# real torch 2.13 exports (tests/data/make_torch_gelu_new.py): gelu_new written with torch.pow
# after nn.Linear, and the GPT-2 MLP (Hugging Face Conv1D through addmm, gelu_new); QuickGELU
# x * sigmoid(1.702 x) between two nn.Linear (CLIP's MLP) in both families, 3-D and (ort-training
# Gemm) 2-D, and x * sigmoid(x) written by hand (tests/data/make_quick_gelu.py)
DATA = Path(__file__).parent / "data"
# and BLOOM's GELU (tests/data/make_torch_bloom_gelu.py: a custom autograd.Function whose
# hand-written backward shares the forward's tanh) after nn.Linear
EXPORTS = {"torch_gelu_new": {"linear_gelu_tanh_torch": 1},
           "torch_conv1d_gelu_new": {"linear_gelu_tanh_torch_at": 1},
           "ortt_quick_gelu": {"linear_quick_gelu_ortt_matmul": 1},
           "ortt_quick_gelu_2d": {"linear_quick_gelu_ortt_gemm": 1},
           "torch_quick_gelu": {"linear_quick_gelu_torch": 1},
           "torch_silu_product": {"linear_silu_torch": 1},
           "torch_bloom_gelu": {"linear_gelu_tanh_torch": 1},
           # erf-GELU written out as a function (tests/data/make_gelu_written.py: ESM's `gelu`,
           # x * 0.5 * (1 + erf(x / sqrt 2))), both families
           "torch_gelu_erf_written": {"linear_gelu_torch": 1},
           "ortt_gelu_erf_written": {"linear_gelu_ortt_matmul": 1},
           # nn.LayerNorm(bias=False) (tests/data/make_torch_layernorm_nobias.py): no dBeta
           "torch_layernorm_nobias": {"layernorm_torch": 1},
           # nn.LayerNorm(elementwise_affine=False): no dY * gamma, no dGamma, no dBeta
           "torch_layernorm_noaffine": {"layernorm_torch": 1}}
for _name in EXPORTS:
    SAMPLE_MODELS[f"export_{_name}"] = onnx.load(DATA / f"{_name}.onnx")
# fine-tuning exports with frozen parameters (tests/data/make_frozen.py; counts and verify in
# tests/test_frozen.py): Linear+activation backward without the weight gradient, and a first
# layer whose bias gradient is all there is
# (and attention without dK: k_proj and everything below it frozen)
# LayerNorms written out (tests/data/make_layernorm_written.py; counts and verify in
# tests/test_sweep_rules.py): layernorm_torch_written
SAMPLE_MODELS["export_torch_layernorm_written"] = onnx.load(DATA / "torch_layernorm_written.onnx")
for _name in ("ortt_frozen_mlp", "ortt_frozen_first", "torch_frozen_mlp", "torch_frozen_first",
              "ortt_frozen_block", "torch_frozen_block"):
    SAMPLE_MODELS[f"export_{_name}"] = onnx.load(DATA / f"{_name}.onnx")
# attention without dK (without dQ, dV, with dQ or dK alone) where the flash rules refuse (P a
# graph output): the sdpa variants without those gradients (counts: tests/test_frozen.py)
for _name in ("frozen_block", "frozen_block_no_q", "frozen_block_no_v", "frozen_block_no_kv",
              "frozen_block_no_qv"):
    for _fam in ("ortt", "torch"):
        SAMPLE_MODELS[f"export_{_fam}_{_name}_p_output"] = builders.with_probabilities_output(
            onnx.load(DATA / f"{_fam}_{_name}.onnx"))
    # with attention dropout, torch-joint's dropout spelling (ort-training's is optional in the
    # variants above)
    _drop = _name.replace("frozen_block", "frozen_block_dropout")
    SAMPLE_MODELS[f"export_torch_{_drop}"] = onnx.load(DATA / f"torch_{_drop}.onnx")
# attention masked by Where (tests/data/make_flash_mask.py; counts and verify in
# tests/test_flash_mask.py): the flash rules' Where variants (GPT-2's causal where, + an additive
# padding mask, masked_fill, grouped K / V); and the samples' masked_fill attention returning
# its probabilities (`_attentions` below), where flash refuses and the sdpa rules that took it
# before still do
# K / V of one head broadcast by the matmuls (Falcon's multi-query: flash_torch_mqa_*) in every
# mask spelling, and MPT's bias-then-mask (`*_mask_where`, `*_mask_masked_fill`) on full heads,
# repeat_kv's groups and the broadcast
# CodeGen's mask before the scale and CTRL's two additive masks (`*_mask_prescale`, `*_mask2`:
# the bias computed by the replacement's prepare node); BLOOM's and GPT-NeoX-Japanese's scores
# on [B * H] views (`flash_*_bmm_*`: every variant, one layer each)
for _name in ("flash_where_causal", "flash_where_gpt2_pad", "flash_fill_window_ninf",
              "flash_fill_causal_pad", "flash_gqa_where_all", "flash_mqa_all", "flash_alibi_all",
              "flash_bias_prescale_pad", "flash_bias2_causal_pad", "flash_bmm_all"):
    for _fam in ("ortt", "torch"):
        SAMPLE_MODELS[f"export_{_fam}_{_name}"] = onnx.load(DATA / f"{_fam}_{_name}.onnx")
# torch's scaled_dot_product_attention through torch.onnx (ort-training only): a bool mask's NaN
# guard (flash_ortt_mask_nanguard; returning its attentions, the sdpa rule that took it before)
SAMPLE_MODELS["export_ortt_flash_sdpa_all"] = onnx.load(DATA / "ortt_flash_sdpa_all.onnx")
# OpenAI GPT's mask multiplied on, then added (flash_ortt_mulmask; ort-training only)
SAMPLE_MODELS["export_ortt_flash_mulmask_causal"] = onnx.load(
    DATA / "ortt_flash_mulmask_causal.onnx")
# ... and in a torch-joint graph, exported under SDPBackend.MATH: _safe_softmax's guard
# (flash_torch{,_gqa,_mqa}_{mask,plain}_safe)
SAMPLE_MODELS["export_torch_flash_sdpa_math_all"] = onnx.load(
    DATA / "torch_flash_sdpa_math_all.onnx")
# the frozen-weight variants of every activation the exports lack (dA [+ dB] without dW; the
# first layer's dB alone, also on GPT-2's 2-D view)
for _act in ("relu", "gelu", "gelu_fast", "silu", "quick_gelu"):
    SAMPLE_MODELS[f"synthetic_ortt_{_act}_gemm_frozen_w"] = builders.ortt_linear_act(
        _act, frozen_w=True)
    SAMPLE_MODELS[f"synthetic_ortt_{_act}_gemm_frozen_w_first"] = builders.ortt_linear_act(
        _act, frozen_w=True, first=True)
    SAMPLE_MODELS[f"synthetic_ortt_{_act}_matmul_frozen_w"] = builders.ortt_linear_act_matmul(
        _act, frozen_w=True)
    SAMPLE_MODELS[f"synthetic_ortt_{_act}_gemm2d_frozen_w"] = builders.ortt_linear_act_gemm2d(
        _act, frozen_w=True)
    SAMPLE_MODELS[f"synthetic_ortt_{_act}_gemm2d_frozen_w_first"] = (
        builders.ortt_linear_act_gemm2d(_act, frozen_w=True, first=True))
for _act in ("relu", "gelu", "gelu_tanh", "silu"):
    for _first in (False, True):
        SAMPLE_MODELS[f"synthetic_torch_{_act}_frozen_w{'_first' * _first}"] = (
            builders.torch_linear_act(_BY_NAME[f"act_{_act}_grad_torch"], frozen_w=True,
                                      first=_first))
for _first in (False, True):
    SAMPLE_MODELS[f"synthetic_torch_quick_gelu_frozen_w{'_first' * _first}"] = (
        builders.torch_linear_act(_BY_NAME["act_silu_scaled_grad_torch"], frozen_w=True,
                                  first=_first, act_consts={"c": 1.702}))
# (after the real exports, which are the QuickGELU stage's fixture)
# QuickGELU x * sigmoid(1.702 x) behind a Conv1D (no real export has that layout)
SAMPLE_MODELS["synthetic_torch_quick_gelu_conv1d"] = builders.torch_linear_act(
    _BY_NAME["act_silu_scaled_grad_torch"], layout="conv1d", three_d=True, act_consts={"c": 1.702})
# attention spellings the samples lack, from the committed corpus of real architectures:
# timm ViT (scale on Q only, no mask), GPT-2 (causal where + padding mask + dropout), BERT
# (additive mask + dropout), Llama (repeat_kv grouped-query attention), Llama through
# F.scaled_dot_product_attention (NaN guard under a causal mask), GPT-Neo (causal where, no
# dropout); listed last so that rules the samples cover keep those fixtures
CORPUS = Path(__file__).parents[1] / "corpus"
for _name in ("ortt_timm_vit", "ortt_gpt2", "ortt_llama", "torch_bert", "torch_gpt2",
              "torch_llama", "ortt_llama_sdpa", "torch_gpt_neo"):
    SAMPLE_MODELS[f"corpus_{_name}"] = onnx.load(CORPUS / f"{_name}.onnx")


def _with_attentions(m):
    """The model with every Softmax output also a graph output (a model that returns its
    attentions): the flash rules refuse it (its probabilities must exist), so the sdpa rules
    keep their fixtures among the samples the flash rules take."""
    m = copy.deepcopy(m)
    m.graph.output.extend(helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT,
                                                        None)
                          for n in m.graph.node if n.op_type == "Softmax")
    return m


for _name in ("ortt_block", "ortt_block_sdpa", "corpus_ortt_timm_vit", "corpus_ortt_llama",
              "torch_v_attn", "corpus_torch_llama", "ortt_block_mul", "torch_block",
              "corpus_torch_gpt_neo"):
    SAMPLE_MODELS[f"{_name}_attentions"] = _with_attentions(SAMPLE_MODELS[_name])
# K/V broadcast inside the MatMuls, torch-joint (tests/data/make_gqa.py)
SAMPLE_MODELS["gqa_torch_bcast"] = onnx.load(DATA / "gqa" / "torch_gqa_bcast_kv2.onnx")
# repeat_kv without a mask, torch-joint (flash_torch_gqa_plain)
SAMPLE_MODELS["gqa_torch_expand"] = onnx.load(DATA / "gqa" / "torch_gqa_expand_kv2.onnx")
# masked_fill with the scale on the scores and an additive bias (MPT's ort-training spelling):
# flash_ortt_mask_masked_fill; returning its attentions, sdpa_ortt_scores_fill
SAMPLE_MODELS["synthetic_ortt_attention_fill"] = builders.ortt_attention_fill()
SAMPLE_MODELS["synthetic_ortt_attention_fill_attentions"] = _with_attentions(
    SAMPLE_MODELS["synthetic_ortt_attention_fill"])
# TorchScript's sdpa NaN guard returning its attentions: sdpa_ortt_runtime_nanguard
SAMPLE_MODELS["export_ortt_flash_sdpa_all_attentions"] = _with_attentions(
    SAMPLE_MODELS["export_ortt_flash_sdpa_all"])
# a LayerNorm without bias, ort-training: Sub(mean) + SimplifiedLayerNormalization
SAMPLE_MODELS["synthetic_ortt_layernorm_centred"] = builders.ortt_layernorm_centred()
# gated MLPs (helper "gated", issue 23): real exports of LlamaMLP / Phi3MLP mirrors in both
# families (tests/data/make_gated_mlp.py; counts, verification and guards: tests/test_gated_mlp.py)
for _fam in ("ortt", "torch"):
    for _name in ("swiglu", "swiglu_fused", "geglu", "geglu_tanh", "geglu_new"):
        SAMPLE_MODELS[f"gated_{_fam}_{_name}"] = onnx.load(DATA / f"{_fam}_{_name}.onnx")
# rotary embeddings on Q and K of one Llama-style attention layer (tests/data/make_rope.py;
# counts, verification and guards: tests/test_rope.py)
for _fam in ("ortt", "torch"):
    SAMPLE_MODELS[f"rope_{_fam}_half"] = onnx.load(DATA / f"{_fam}_rope_half.onnx")
SAMPLE_MODELS["rope_torch_interleaved"] = onnx.load(DATA / "torch_rope_interleaved.onnx")
# (ort-training with symbolic batch and sequence: the half point computed at run time)
SAMPLE_MODELS["rope_ortt_half_symbolic"] = onnx.load(DATA / "ortt_rope_half_symbolic.onnx")
# ... and the spellings of tests/data/make_rope_spellings.py (counts, verification, guards:
# tests/test_rope_spellings.py): ort-training opset-12 rotate-half (Slice + SliceGrad with static
# shapes), GPT-J's rotate_every_two at opset 16 and 12 (Squeeze / Unsqueeze axes as an input or
# an attribute); torch-joint rotate-half written with chunk (Split forward, Slice + Concat
# backward)
# and torch-joint's dX summed in the other orders (X * cos last: rot(x) * sin + x * cos, RoFormer)
for _name in ("ortt_rope_sp_llama_opset12", "ortt_rope_sp_gptj", "ortt_rope_sp_gptj_opset12",
              "torch_rope_sp_chunk", "torch_rope_sp_sin_first", "torch_rope_sp_sin_first_hi",
              "torch_rope_sp_gptj_sin_first", "torch_rope_sp_roformer"):
    SAMPLE_MODELS[f"rope_sp_{_name}"] = onnx.load(DATA / f"{_name}.onnx")
# Conv + BN + ReLU6 / SiLU / hardswish (two spellings), ort-training exports of MobileNet-style
# blocks (tests/data/make_conv_act.py; counts and look-alikes in tests/test_conv_act.py)
for _name in ("ortt_conv_mbv2", "ortt_conv_effnet_silu", "ortt_conv_mbv3_hswish"):
    SAMPLE_MODELS[f"export_{_name}"] = onnx.load(DATA / f"{_name}.onnx")
# LoRA fine-tuning exports, base frozen (tests/data/make_lora.py, tests/test_lora.py): hand-written
# LoRA MLPs (GELU / ReLU first layer, then ReLU / GELU, then no activation) and peft LoRA on q/v
# of a 2-block decoder (no-activation adapters with and without input gradient), both families
for _name in ("ortt_lora_hand", "ortt_lora_hand_relu", "ortt_lora_qv", "torch_lora_hand",
              "torch_lora_hand_relu", "torch_lora_qv"):
    SAMPLE_MODELS[f"lora_{_name}"] = onnx.load(DATA / f"{_name}.onnx")

# language-model head + cross-entropy, both families (tests/data/make_lce.py; counts,
# verification, training and the run-time guards: tests/test_lce.py)
for _fam in ("ortt", "torch"):
    for _name in ("untied", "bias_sum", "frozen", "sum", "bias", "frozen_sum"):
        SAMPLE_MODELS[f"lce_{_fam}_{_name}"] = onnx.load(DATA / f"{_fam}_lce_{_name}.onnx")
# ... with the loss's gradient fed at run time (ort-training's _seed) or computed from the
# loss (_split, both families)
for _fam, _how, _names in (("ortt", "input", ("untied", "bias_sum", "frozen", "frozen_sum")),
                           ("ortt", "loss", ("untied", "bias_sum", "frozen", "frozen_sum")),
                           ("torch", "loss", ("untied", "bias_sum", "frozen", "sum", "bias",
                                              "frozen_sum"))):
    for _name in _names:
        SAMPLE_MODELS[f"lce_{_fam}_{_name}_seed_{_how}"] = with_run_time_seed(
            _fam, _how, f"lce_{_name}")
# F.cross_entropy's spelling with its coefficient computed from the loss (rules/lce_torch_loss.yaml
# _nllloss_split)
SAMPLE_MODELS["lces_torch_ce_sum_seed_loss"] = with_run_time_seed("torch", "loss", "lces_ce_sum")
# ... and the per-token losses' spellings (rules/lce_torch_rows.yaml, lce_torch_shift.yaml's
# gather: _split; the shifted logits' transforms are on their [B, S, V] view, as exported)
for _name in ("ce_none_mean", "seqlevel", "shift_logits", "shift_logits_div",
              "shift_logits_softcap"):
    SAMPLE_MODELS[f"lces_torch_{_name}_seed_loss"] = with_run_time_seed("torch", "loss",
                                                                        f"lces_{_name}")
# ... under a frozen head (make_lce_spellings.py FROZEN: the _frozen_3d variants of
# rules/lce_torch_loss.yaml, lce_torch_rows.yaml, lce_torch_shift.yaml)
for _name in ("ce_sum", "ce_none_mean", "seqlevel", "shift_logits", "shift_logits_div",
              "shift_logits_softcap"):
    _name = _name.replace("shift_logits", "shift_logits_frozen_head") if "shift" in _name \
        else f"{_name}_frozen_head"
    SAMPLE_MODELS[f"lces_torch_{_name}_seed_loss"] = with_run_time_seed("torch", "loss",
                                                                        f"lces_{_name}")
# the loss spellings of real exports (scripts/make_lce_spellings.py; counts, verification and
# guards: tests/test_lce_spellings.py): ReduceMean / ReduceSum of the gathered log-probabilities,
# F.cross_entropy's NegativeLogLikelihoodLoss (Hugging Face's loss with num_items_in_batch: the
# _split variant), the per-token losses the graph reduces itself (F.cross_entropy(reduction=
# 'none').mean(), a sequence-level loss: rules/lce_torch_rows.yaml; the logits shifted:
# rules/lce_torch_shift.yaml, with F.cross_entropy too; ort-training's: rules/lce_ortt_shift.yaml),
# ort-training classifier heads written as one Gemm
for _name in ("torch_lces_reducemean", "torch_lces_reducemean_neg_tied",
              "torch_lces_reducesum_const", "torch_lces_ce_sum", "torch_lces_hf_llama_items",
              "torch_lces_ce_none_mean", "torch_lces_seqlevel", "torch_lces_shift_logits",
              "torch_lces_shift_ce_sum_tied", "ortt_lces_cls_mlp", "ortt_lces_cls_mlp_ii",
              "ortt_lces_lm_shift_ce", "ortt_lces_lm_shift_ce_frozen_head",
              # ... with the logits transformed before the loss (/ 4, * 0.5, 3 tanh(z / 3))
              "torch_lces_shift_logits_div", "torch_lces_shift_logits_softcap",
              "torch_lces_shift_ce_sum_tied_mul", "torch_lces_shift_ce_sum_tied_softcap",
              "torch_lces_ce_none_mean_mul", "torch_lces_ce_none_mean_softcap",
              "torch_lces_seqlevel_div", "torch_lces_seqlevel_softcap",
              "ortt_lces_lm_shift_ce_div", "ortt_lces_lm_shift_ce_tied_softcap",
              "ortt_lces_lm_shift_ce_frozen_head_div", "ortt_lces_lm_shift_ce_frozen_head_softcap",
              "ortt_lces_cls_mlp_div", "ortt_lces_cls_mlp_ii_div", "ortt_lces_cls_mlp_softcap",
              "ortt_lces_cls_mlp_ii_softcap",
              # ... under a frozen head (LoRA fine-tuning, frozen embeddings: _frozen_3d)
              *(f"torch_lces_{_n}_frozen_head" for _n in (
                  "reducemean", "reducesum_const", "ce_sum", "ce_none_mean", "seqlevel",
                  "shift_logits", "shift_ce", "smoothed_ce_sum", "hf_gpt2_mean_tied")),
              *(f"torch_lces_shift_{_n}" for _n in (
                  "logits_frozen_head_div", "logits_frozen_head_softcap",
                  "ce_frozen_head_mul", "ce_frozen_head_softcap"))):
    SAMPLE_MODELS[f"export_{_name}"] = onnx.load(DATA / f"{_name}.onnx")
# (the shifted ones' transforms are real exports: on the [B, S, V] view before the Slice)
_FROZEN_HEADS = tuple(f"export_torch_lces_{_n}_frozen_head" for _n in (
    "reducemean", "reducesum_const", "ce_sum", "ce_none_mean", "seqlevel",
    "hf_gpt2_mean_tied")) + tuple(
    f"lces_torch_{_n}_frozen_head_seed_loss" for _n in ("ce_sum", "ce_none_mean", "seqlevel"))
# the logits times a constant before the loss and their gradient times it after (Granite's
# logits / logits_scaling, Cohere's logits * logit_scale: the _scaled variants of rules/lce_ortt,
# lce_torch and lce_torch_loss), or soft-capped (Gemma 2's c tanh(z / c): _softcap); real
# exports: tests/test_lce_spellings.py): each head + loss sample of those rules above with that
# Div, or Mul, in both places, and with the soft cap
LCE_TRANSFORMED = [k for k in SAMPLE_MODELS if k.startswith("lce_") or k in (
    "export_torch_lces_reducemean", "export_torch_lces_reducemean_neg_tied",
    "export_torch_lces_reducesum_const", "export_torch_lces_ce_sum",
    "export_torch_lces_hf_llama_items", "lces_torch_ce_sum_seed_loss",
    "lces_torch_ce_none_mean_seed_loss", "lces_torch_seqlevel_seed_loss", *_FROZEN_HEADS)]
for _i, _name in enumerate(LCE_TRANSFORMED):
    _fam = "ortt" if "ortt" in _name else "torch"
    SAMPLE_MODELS[f"{_name}_scaled"] = builders.with_logit_scale(
        SAMPLE_MODELS[_name], _fam, *((4.0, "Div") if _i % 2 == 0 else (0.5, "Mul")))
    SAMPLE_MODELS[f"{_name}_softcap"] = builders.with_logit_scale(
        SAMPLE_MODELS[_name], _fam, 3.0, "softcap")
# label smoothing (rules/lce_torch.yaml _smoothed: the written-out loss's row mean of the
# log-probabilities; rules/lce_torch_loss.yaml _nllloss_smoothed: F.cross_entropy's row sum;
# real exports: tests/test_lce_spellings.py): each torch-joint head + loss sample of those
# rules, with and without its logits transformed, with the smoothing term added
_F_CROSS_ENTROPY = ("export_torch_lces_ce_sum", "export_torch_lces_shift_ce_sum_tied",
                    "export_torch_lces_shift_ce_frozen_head")
for _name in [k for k in SAMPLE_MODELS if k.startswith(("lce_torch", *_F_CROSS_ENTROPY))
              and "_seed_" not in k]:
    SAMPLE_MODELS[f"{_name}_smoothed"] = builders.with_label_smoothing(
        SAMPLE_MODELS[_name], "sum" if _name.startswith(_F_CROSS_ENTROPY) else "mean")
# a frozen bias added to the logits (rules/lce_torch.yaml, lce_torch_loss.yaml _fbias: BART's
# final_logits_bias; real exports: tests/test_lce_spellings.py): each torch-joint head + loss
# sample of those rules whose head has no bias, in every variant made above
_FBIAS_BASES = ("lce_torch_untied", "lce_torch_sum", "export_torch_lces_reducemean",
                "export_torch_lces_reducesum_const", "export_torch_lces_ce_sum",
                "lces_torch_ce_sum_seed_loss",
                # (the frozen heads' too: as a frozen BART / Marian head with its bias)
                "export_torch_lces_hf_gpt2_mean_tied_frozen_head",
                "lces_torch_ce_sum_frozen_head_seed_loss")
for _name in [k for k in SAMPLE_MODELS if k.startswith(_FBIAS_BASES)]:
    SAMPLE_MODELS[f"{_name}_fbias"] = builders.with_logit_bias(SAMPLE_MODELS[_name])


def _upto(rule_name):
    """The shipped rules up to and including ``rule_name`` in application order, so that a
    rule's fusions are not absorbed by a later rule that builds on them."""
    rule = next(r for r in RULES if r.name == rule_name)
    return [r for r in RULES if (r.order, r.name) <= (rule.order, rule.name)]


def _fusions(model, rule=None):
    fp = FusionPass(rules=_upto(rule) if rule else None)
    fp.run(model)
    return fp.stats.fusions if rule is None else [f for f in fp.stats.fusions if f.rule == rule]


# (domain, op) of every node a sample has or a rule's replacement can create: a rule one of whose
# required nodes matches none of them cannot fire on that sample (the search is not run)
_MADE = {(rep.domain, rep.op) for r in RULES for rep in r.replace.nodes}


def _ops_of(m):
    return {("" if n.domain == "ai.onnx" else n.domain, n.op_type) for n in m.graph.node} | _MADE


_SAMPLE_OPS = {name: _ops_of(m) for name, m in SAMPLE_MODELS.items()}


def _may_fire(rule, name) -> bool:
    return has_required_ops(rule, lambda d, op: (d, op) in _SAMPLE_OPS[name])


def _first_instance(rule):
    """(sample name, model, FusionRecord) of the rule's first fusion on a shipped sample."""
    for name, model in SAMPLE_MODELS.items():
        if not _may_fire(rule, name):
            continue
        recs = _fusions(copy.deepcopy(model), rule.name)
        if recs:
            return name, model, recs[0], len(recs)
    return None


FIRST = {r.name: _first_instance(r) for r in RULES
         if not r.name.endswith("_softcap") and "_pooled" not in r.name}


def _softcap_sample(rule):
    """The sample of the flash rule `rule`'s uncapped twin with that match's scores soft-capped
    (Gemma 2's attention: tests/builders.py with_attention_softcap), or None."""
    twin = FIRST.get(rule.name[: -len("_softcap")])
    if twin is None:
        return None
    spec = {s.id: s for s in _BY_NAME[rule.name[: -len("_softcap")]].nodes}
    # (an absent scale, a pass-through, binds its input and output to one tensor)
    scores = twin[2].tensors[var_name(spec["fwd_scale"].outputs[0])]
    dscores = twin[2].tensors[var_name(spec["bwd_scale"].inputs[0])]
    return builders.with_attention_softcap(
        twin[1], "ortt" if rule.family == "ort-training" else "torch", scores, dscores)


# the soft-capped attention variants (rules/flash_*.yaml _softcap): each on its uncapped twin's
# sample with the cap added to the matched attention
for _r in RULES:
    if _r.name.endswith("_softcap") and _r.pattern == "flash_attention":
        _m = _softcap_sample(_r)
        if _m is not None:
            SAMPLE_MODELS[f"softcap_{_r.name}"] = _m
            _SAMPLE_OPS[f"softcap_{_r.name}"] = _ops_of(_m)
FIRST.update({r.name: _first_instance(r) for r in RULES if r.name.endswith("_softcap")})
# the pooled classifier heads (rules/_lce_pool_torch.yaml): each on its unpooled twin's sample
# with that match's logits pooled one row per sequence (real exports of Llama's and GPT-2's
# sequence classifiers: tests/test_lce_spellings.py)
for _r in RULES:
    _twin = FIRST.get(_r.name.replace("_pooled", "")) if "_pooled" in _r.name else None
    if _twin is not None:
        SAMPLE_MODELS[f"pooled_{_r.name}"] = builders.with_pooled_logits(
            _twin[1], _twin[2].tensors["Z"], _twin[2].tensors["dZ"])
        _SAMPLE_OPS[f"pooled_{_r.name}"] = _ops_of(SAMPLE_MODELS[f"pooled_{_r.name}"])
FIRST.update({r.name: _first_instance(r) for r in RULES if "_pooled" in r.name})


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_fires_on_a_sample(rule):
    assert FIRST[rule.name] is not None, f"{rule.name} fuses nothing in samples/"


# --- mutation helpers -----------------------------------------------------------------------

def _node(model, name):
    return next(n for n in model.graph.node if n.name == name)


def _required_specs(rule):
    """Rule nodes that every match binds to an ORIGINAL graph node (not kept context, not an
    op that an earlier rule created)."""
    return [s for s in rule.nodes if not s.optional and not s.keep
            and "com.fusecli" not in s.domains]


def _mutated_attr_value(v):
    if isinstance(v, bytes):
        return v + b"_x"
    if isinstance(v, float):
        return v * 2.0 + 1.0
    if isinstance(v, int):
        return v + 1
    if isinstance(v, list):
        return [x + 1 for x in v] if v else [1]
    return None


def _attr_cases():
    out = []
    for r in RULES:
        for s in _required_specs(r):
            for attr, c in s.attrs.items():
                if c.has_equals or c.one_of is not None:
                    out.append(pytest.param(r, s.id, attr, id=f"{r.name}-{s.id}.{attr}"))
                    break
            else:
                continue
            break
    return out


def _const_cases():
    out = []
    for r in RULES:
        required_inputs = {var_name(t): s.id for s in _required_specs(r) for t in s.inputs}
        for var, spec in r.tensors.items():
            # (a kind on a data tensor, checked against another bound tensor, constrains no
            # value: its negatives are the rule's own tests, e.g. tests/test_flash_mask.py)
            if var in required_inputs and spec.kind not in DEFERRED_KINDS:
                out.append(pytest.param(r, required_inputs[var], var, id=f"{r.name}-{var}"))
                break
    return out


def _intermediate_cases():
    out = []
    for r in RULES:
        first = FIRST[r.name]
        if first is None:
            continue
        rec = first[2]
        # an intermediate produced by a required node that no chain of optional pass-through
        # nodes can turn into a fused-op output (else the rule legitimately fuses around it)
        required = {s.id for s in _required_specs(r)}
        node_of = {v: k for k, v in rec.nodes.items()}
        var_of = {t: v for v, t in rec.tensors.items()}
        through = {var_name(s.inputs[0]): var_name(s.outputs[0])
                   for s in r.nodes if s.optional == "passthrough"}
        model = first[1]
        for t in rec.intermediates:
            prod = next((n for n in model.graph.node if t in n.output), None)
            if prod is None or node_of.get(prod.name) not in required:
                continue
            v, reach = var_of.get(t), set()
            while v is not None and v not in reach:
                reach.add(v)
                v = through.get(v)
            # (every variable bound to t counts: absent pass-throughs alias several)
            reach |= {w for w, tt in rec.tensors.items() if tt == t}
            if not reach & set(r.replace.outputs):
                out.append(pytest.param(r, t, id=f"{r.name}-{t[-30:]}"))
                break
    return out


def _expect_one_fewer(rule, mutated, first, reason=None, node=None):
    _, _, _, count = first
    recs = _fusions(copy.deepcopy(mutated), rule.name)
    assert len(recs) == count - 1, [f.replaced for f in recs]
    if node is not None:
        assert all(node not in f.replaced for f in recs)
    if reason is not None:
        fp = FusionPass(rules=_upto(rule.name))
        misses = explain_model(mutated, fp, node_names=[node] if node else (),
                               include_shallow=True)
        assert any(m["rule"] == rule.name and m["reason"] == reason for m in misses), misses


def _mutable(rule, spec_id):
    """(first instance, its record, a copy of its sample, the copy's node bound to spec_id)."""
    first = FIRST[rule.name]
    mutated = copy.deepcopy(first[1])
    return first, first[2], mutated, _node(mutated, first[2].nodes[spec_id])


@pytest.mark.parametrize("rule,spec_id,attr", _attr_cases())
def test_negative_wrong_attribute(rule, spec_id, attr):
    first, _, mutated, node = _mutable(rule, spec_id)
    old = next((a for a in node.attribute if a.name == attr), None)
    value = helper.get_attribute_value(old) if old is not None else None
    new = _mutated_attr_value(value) if value is not None else 7
    if old is not None:
        node.attribute.remove(old)
    node.attribute.append(helper.make_attribute(attr, new))
    _expect_one_fewer(rule, mutated, first, "attribute", node.name)


@pytest.mark.parametrize("rule,spec_id,var", _const_cases())
def test_negative_wrong_constant(rule, spec_id, var):
    first, rec, mutated, node = _mutable(rule, spec_id)
    tensor = rec.tensors[var]
    idx = list(node.input).index(tensor)
    spec = rule.tensors[var]
    # a value that the constraint refuses, of the dtype the slot holds
    old = None
    for t in mutated.graph.initializer:
        if t.name == tensor:
            old = numpy_helper.to_array(t)
    if old is None:
        prod = next(n for n in mutated.graph.node if tensor in n.output)
        old = (numpy_helper.to_array(helper.get_attribute_value(prod.attribute[0]))
               if prod.attribute else np.zeros(1, np.float32))  # ConstantOfShape's default 0
    if spec.kind in ("scalar", "large_negative"):
        bad = np.asarray([1.0, 2.0], dtype=old.dtype)  # not a scalar
    elif old.dtype.kind in "iu":
        bad = np.full((3,), 5, dtype=old.dtype)
    else:
        bad = np.asarray(old, dtype=old.dtype) * 3.0 + 2.0
    new_name = f"{tensor}__mutated"
    mutated.graph.initializer.append(numpy_helper.from_array(np.asarray(bad), new_name))
    node.input[idx] = new_name
    _expect_one_fewer(rule, mutated, first, "constant", node.name)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_negative_wrong_domain(rule):
    first, _, mutated, node = _mutable(rule, _required_specs(rule)[0].id)
    node.domain = "com.example"
    mutated.opset_import.append(helper.make_opsetid("com.example", 1))
    _expect_one_fewer(rule, mutated, first, "domain", node.name)


@pytest.mark.parametrize("rule,tensor", _intermediate_cases())
def test_negative_extra_consumer(rule, tensor):
    first = FIRST[rule.name]
    mutated = copy.deepcopy(first[1])
    mutated.graph.node.append(helper.make_node("Identity", [tensor], ["distractor_out"],
                                               name="distractor"))
    mutated.graph.output.append(helper.make_tensor_value_info("distractor_out",
                                                              onnx.TensorProto.FLOAT, None))
    _expect_one_fewer(rule, mutated, first, "intermediate_consumed_outside")
    out = copy.deepcopy(mutated)
    FusionPass().run(out)
    assert any(tensor in n.output for n in out.graph.node)  # still produced for its reader


@pytest.mark.parametrize("rule,tensor", _intermediate_cases())
def test_negative_graph_output_intermediate(rule, tensor):
    first = FIRST[rule.name]
    mutated = copy.deepcopy(first[1])
    mutated.graph.output.append(helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT,
                                                              None))
    _expect_one_fewer(rule, mutated, first, "intermediate_is_graph_output")
    out = copy.deepcopy(mutated)
    FusionPass().run(out)
    assert any(tensor in n.output for n in out.graph.node)


def test_every_rule_has_guard_fixtures():
    """Each rule is covered by the intermediate guards; constants and attributes where the
    rule constrains them on a required node."""
    covered = {p.values[0].name for p in _intermediate_cases()}
    missing = {r.name for r in RULES} - covered
    # rules whose every intermediate sits behind an optional node are covered by the
    # synthetic fixtures below; a test module elsewhere that covers a rule's guards names it in
    # its GUARD_FIXTURE_RULES (e.g. tests/test_rmsnorm.py, tests/test_variants.py)
    assert missing <= {"layernorm_ortt", "layernorm_torch_params"} | _guarded_elsewhere(), missing


def _guarded_elsewhere() -> set[str]:
    """The rule names listed by `GUARD_FIXTURE_RULES = (...)` in the other test modules."""
    import ast

    names: set[str] = set()
    repo = Path(__file__).resolve().parents[1]
    for path in [*repo.glob("tests/test_*.py"), *repo.glob("fusecli/ops/*/test_*.py")]:
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None) == "GUARD_FIXTURE_RULES"):
                names |= set(ast.literal_eval(node.value))
    return names


# --- synthetic variants (bias-free, first layer, no Identity) and exact guard reasons --------

@pytest.mark.parametrize("act,pattern", [("relu", "linear_relu"), ("gelu", "linear_gelu"),
                                         ("silu", "linear_silu")])
@pytest.mark.parametrize("variant", [{}, {"first": True}, {"bias": False},
                                     {"identity": False}, {"first": True, "bias": False}])
def test_ortt_linear_gemm_variants_fuse(act, pattern, variant):
    m = builders.ortt_linear_act(act, **variant)
    fp = FusionPass()
    assert fp.run(m) == 1
    assert fp.stats.patterns[pattern].fused == 1
    fused = [n for n in m.graph.node if n.domain == "com.fusecli"]
    assert [n.op_type for n in fused] == ["LinearActivationGrad"]
    assert list(fused[0].output)[:1] == ([""] if variant.get("first") else ["dA"])
    assert len(m.graph.node) == 1


@pytest.mark.parametrize("act,pattern", [("relu", "linear_relu"), ("gelu", "linear_gelu"),
                                         ("silu", "linear_silu")])
@pytest.mark.parametrize("variant", [{}, {"first": True}, {"bias": False},
                                     {"three_d": False, "bias": False},
                                     {"three_d": False, "first": True}])
def test_ortt_linear_matmul_variants_fuse(act, pattern, variant):
    m = builders.ortt_linear_act_matmul(act, **variant)
    fp = FusionPass()
    assert fp.run(m) == 1
    assert fp.stats.patterns[pattern].fused == 1
    assert fp.stats.rules[f"linear_{act}_ortt_matmul"].fused == 1
    assert len(m.graph.node) == 1
    fused = m.graph.node[0]
    assert {a.name: helper.get_attribute_value(a) for a in fused.attribute}["trans_w"] == 1


@pytest.mark.parametrize("extra,reason", [
    ("consumer", "intermediate_consumed_outside"),
    ("graph_output", "intermediate_is_graph_output"),
    ("wrong_const", "intermediate_consumed_outside"),
])
def test_ortt_linear_guards_name_their_reason(extra, reason):
    m = builders.ortt_linear_act("relu", extra=extra)
    fp = FusionPass()
    assert fp.run(m) == 0
    assert fp.stats.patterns["linear_relu"].skipped == {reason: 1}
    assert fp.stats.patterns["linear_relu"].detected == 1


def test_ortt_linear_structural_negatives_are_not_detected():
    m = builders.ortt_linear_act("relu", extra="wrong_domain")
    fp = FusionPass()
    assert fp.run(m) == 0
    assert fp.stats.patterns["linear_relu"].detected == 0


def test_ortt_linear_wrong_weight_grad_is_no_frozen_weight():
    """A weight-grad Gemm with the wrong attribute fits no rule node; the frozen-weight variant
    variants (dA and dB without dW; dB alone) then see the chain and refuse it: dZ is read by
    that Gemm."""
    m = builders.ortt_linear_act("relu", extra="wrong_attr")
    fp = FusionPass()
    assert fp.run(m) == 0
    assert fp.stats.patterns["linear_relu"].skipped == {"intermediate_consumed_outside": 1}
    # (the chain's one skip is the variant's that would have replaced the most nodes)
    assert [s.rule for s in fp.stats.skips] == ["linear_relu_ortt_gemm_frozen_w"]


def test_layernorm_residual_guard():
    """LayerNormGrad with its residual Sum: an outside reader of the LN's own dX keeps the Sum
    outside (the fused op then produces that dX), never drops it. (The other LayerNorm, on the
    model input, has a dX that nothing reads: onnxruntime-training computes it, the fused op
    does not.)"""
    m = copy.deepcopy(SAMPLE_MODELS["ortt_block"])
    ln = next(n for n in m.graph.node if n.op_type == "LayerNormalizationGrad"
              and any(c.op_type == "Sum" and n.output[0] in c.input for c in m.graph.node))
    dx = ln.output[0]
    read = {t for n in m.graph.node for t in n.input} | {o.name for o in m.graph.output} | {dx}
    m.graph.output.append(helper.make_tensor_value_info(dx, onnx.TensorProto.FLOAT, None))
    lns = {n.name: n.output[0] for n in m.graph.node if n.op_type == "LayerNormalizationGrad"}
    recs = _fusions(m, "layernorm_ortt")
    assert len(recs) == 2
    for r in recs:
        (orig,) = [lns[n] for n in r.replaced if n in lns]
        assert (r.node.output[0] != "") == (orig in read)
    assert any(dx in r.node.output for r in recs)


def test_stats_reset_on_every_run():
    fp = FusionPass()
    fp.run(copy.deepcopy(SAMPLE_MODELS["ortt_mlp"]))
    first = fp.stats.as_dict()
    fp.run(copy.deepcopy(SAMPLE_MODELS["ortt_mlp"]))
    assert fp.stats.as_dict() == first
    fp.run(copy.deepcopy(SAMPLE_MODELS["ortt_cnn"]))
    assert fp.stats.patterns["linear_relu"].fused == 0
    assert fp.stats.patterns["conv_bn_relu"].fused == 2


def test_shortcut_conv_bn_without_relu_is_not_conv_bn_relu():
    m = copy.deepcopy(SAMPLE_MODELS["ortt_cnn"])
    shortcut_bn = [n.name for n in m.graph.node if n.op_type == "BatchNormalizationGrad"
                   and not any(p.op_type == "ReluGrad" and p.output[0] == n.input[0]
                               for p in m.graph.node)]
    assert shortcut_bn
    recs = _fusions(m, "conv_bn_relu_ortt")
    assert all(not set(shortcut_bn) & set(r.replaced) for r in recs)
    # the shortcut is a conv_bn: BN + conv backward without an activation (identity, no Y)
    [rec] = _fusions(copy.deepcopy(m), "conv_bn_ortt")
    assert set(shortcut_bn) <= set(rec.replaced)
    assert [a.s for a in rec.node.attribute if a.name == "activation"] == [b"identity"]
    assert rec.node.input[1] == ""


def test_missing_kernel_for_the_chosen_provider_is_a_skip_reason():
    m = copy.deepcopy(SAMPLE_MODELS["ortt_block"])
    fp = FusionPass(kernels={"LayerNormGrad"})  # as if only LayerNormGrad had a kernel
    assert fp.run(m) == 2
    assert fp.stats.patterns["sdpa"].skipped == {"missing_kernel": 1}
    assert fp.stats.patterns["linear_gelu"].skipped == {"missing_kernel": 1}
    misses = explain_model(SAMPLE_MODELS["ortt_block"], FusionPass(kernels=set()))
    kernel_misses = [m for m in misses if m["reason"] == "missing_kernel"]
    missed = {m["pattern"] for m in kernel_misses}
    # the attention: first the flash rule (forward + backward), then the sdpa rule
    assert "flash_attention" in missed
    assert missed - {"flash_attention"} == {"sdpa", "linear_gelu", "layernorm"}


# --- shapes: a fused op must compute exactly the tensors it replaces -------------------------

def test_attention_scale_as_mul_or_div():
    """One rule node, two spellings: Div by c and Mul by 1/c give the same fused scale."""
    scales = []
    for op in ("Div", "Mul"):
        m = builders.ortt_attention(scale_op=op)
        assert FusionPass(only=["sdpa_ortt_scores_plain"]).run(m) == 1
        fused = next(n for n in m.graph.node if n.op_type == "AttentionGrad")
        scales.append({a.name: helper.get_attribute_value(a) for a in fused.attribute})
    assert scales[0] == scales[1]
    assert scales[0]["scale_q"] == pytest.approx(1 / np.sqrt(3), rel=1e-6)


def _read_unsummed_gradients(m):
    """The head sums spelled ReduceSum(keepdims=0) -> Unsqueeze, which the rule does not absorb:
    the only binding left is dK/dV to the un-summed tensors."""
    for n in [n for n in m.graph.node if n.op_type == "ReduceSum"]:
        n.attribute.remove(next(a for a in n.attribute if a.name == "keepdims"))
        n.attribute.append(helper.make_attribute("keepdims", 0))
        out = n.output[0]
        n.output[0] = out + "_sq"
        m.graph.node.append(helper.make_node("Unsqueeze", [out + "_sq", "head_axis"], [out],
                                             name=out + "_unsqueeze"))
    return m


@pytest.mark.parametrize("op", ["FlashAttentionGrad", "AttentionGrad"])
@pytest.mark.parametrize("record_backward", [False, True])
def test_multi_query_attention_fuses_with_the_head_sum_absorbed(record_backward, op, tmp_path):
    """One K/V head broadcast inside the MatMuls: onnxruntime computes dK^T/dV at the full head
    count and sums them (ReduceSum keepdims=1). The rule (flash_ortt, or sdpa_ortt with flash
    skipped) binds K/V before the broadcast and dK/dV after the sum; the fused graph computes
    the same."""
    from fusecli.runtime.verify import verify_models

    m = builders.ortt_attention(kv_heads=1, heads=2, record_backward=record_backward)
    fused = copy.deepcopy(m)
    skip = ["flash_attention"] if op == "AttentionGrad" else []
    assert FusionPass(skip=skip).run(fused) == 1
    [node] = [n for n in fused.graph.node if n.op_type == op]
    assert list(node.output[1:3]) == ["dKt", "dV"]
    assert not {n.op_type for n in fused.graph.node} & {"ReduceSum", "FusedMatMul"}
    src, out = tmp_path / "m.onnx", tmp_path / "m.fused.onnx"
    onnx.save(m, src)
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


@pytest.mark.parametrize("record_backward", [False, True])
def test_multi_query_attention_is_not_fused_into_unsummed_gradients(record_backward):
    """Where the sum cannot be absorbed, binding dK/dV to the un-summed tensors would write
    them at one head: refused by the shape guard, with the reason."""
    m = _read_unsummed_gradients(
        builders.ortt_attention(kv_heads=1, heads=2, record_backward=record_backward))
    fp = FusionPass()
    assert fp.run(copy.deepcopy(m)) == 0
    assert fp.stats.patterns["sdpa"].skipped == {"shape_mismatch": 1}
    misses = explain_model(m, FusionPass(only=["sdpa_ortt_scores_plain"]))
    assert [x["reason"] for x in misses] == ["shape_mismatch"]
    # the op takes a broadcast K/V (it sums the group), but not into the un-summed tensors nor
    # into the keepdims=0 sums (a rank lower than K/V: only a Reshape back would be absorbed)
    assert any(f"would write '{t}'" in misses[0]["detail"]
               for t in ("dKt_full", "dV_full", "dKt_sq", "dV_sq")), misses


def test_attention_inputs_must_fit_the_op():
    from fusecli.engine.shapes import input_problem

    p, q = [2, 4, 5, 5], [2, 4, 5, 3]
    assert input_problem("AttentionGrad", {}, [q, q, [2, 2, 5, 3], [2, 1, 5, 3], p], []) is None
    assert "neither equal nor divide" in input_problem(
        "AttentionGrad", {}, [q, q, [2, 3, 5, 3], q, p], [])
    assert "differ from" in input_problem("AttentionGrad", {}, [q, [2, 1, 5, 3], q, q, p], [])
    assert "rows/columns" in input_problem("AttentionGrad", {"k_transposed": 1},
                                           [q, q, [2, 4, 5, 3], q, p], [])


def test_output_shape_guard_alone_refuses_unsummed_gradients(monkeypatch):
    """Even where the op accepts broadcast inputs, an output whose shape differs from the
    tensor it replaces (dK^T [B,1,D,S] for a [B,H,D,S] tensor) is refused."""
    import fusecli.engine.shapes

    monkeypatch.setattr(fusecli.engine.shapes, "input_problem", lambda *a: None)
    m = _read_unsummed_gradients(builders.ortt_attention(kv_heads=1, heads=2))
    fp = FusionPass()
    assert fp.run(m) == 0
    # (the flash rule is refused the same way: its dK^T / dV are K's / V's shape too)
    [skip] = [s for s in fp.stats.skips if s.pattern == "sdpa"]
    assert skip.failure.reason == "shape_mismatch"
    # the un-summed tensor, or the keepdims=0 sum (rank 3 for a rank-4 dK^T)
    assert any(f"would write '{t}'" in skip.failure.detail for t in ("dKt_full", "dKt_sq")), \
        skip.failure.detail


def test_a_graph_that_would_not_run_is_never_written(monkeypatch, tmp_path, capsys):
    """With the match guard switched off (as a rule bug would), the pass's final check stops
    the run: exit 4, one line, nothing written."""
    import fusecli.engine.matcher
    from fusecli.commands.main import main

    monkeypatch.setattr(fusecli.engine.matcher, "fusion_problem", lambda *a: None)
    src, out = tmp_path / "mqa.onnx", tmp_path / "mqa.fused.onnx"
    m = _read_unsummed_gradients(builders.ortt_attention(kv_heads=1, heads=2))
    # the un-summed gradients' shapes recorded (B=2, H=2, S=4, D=3): the final check sees
    # the one-head tensors the fused op would write in their place
    m.graph.value_info.extend([helper.make_tensor_value_info("dKt_full", onnx.TensorProto.FLOAT,
                                                             [2, 2, 3, 4]),
                               helper.make_tensor_value_info("dV_full", onnx.TensorProto.FLOAT,
                                                             [2, 2, 4, 3])])
    onnx.save(m, src)
    assert main(["optimize", str(src), "-o", str(out), "-q"]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    # the first attention rule that fuses it (the flash rule, before the sdpa rules)
    assert len(err) == 1 and "would not run" in err[0] and "flash_ortt_plain" in err[0], err
    assert not out.exists()


# --- Linear layouts and activation spellings, run numerically --------------------------------

def _run_ort(model, feeds):
    import onnxruntime as ort

    from fusecli.runtime.library import session_options

    so = session_options(opt_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return {o.name: v for o, v in zip(sess.get_outputs(), sess.run(None, feeds))}


def _feeds(model, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        out[i.name] = rng.standard_normal(shape).astype(np.float32)
    return out


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "gelu_tanh_pow", "silu"])
@pytest.mark.parametrize("layout,trans", [("linear", (0, 0)), ("conv1d", (1, 1)),
                                          ("at_t", (0, 0))])
@pytest.mark.parametrize("variant", [{}, {"three_d": True}, {"first": True}, {"bias": False},
                                     {"frozen_w": True}, {"frozen_w": True, "three_d": True},
                                     {"frozen_w": True, "bias": False, "three_d": True}])
def test_torch_linear_layouts_fuse_and_compute_the_same(act, layout, trans, variant):
    """W [out, in] (nn.Linear) or [in, out] (Conv1D through addmm), weight grad dZ^T A or
    A^T dZ (transposed back or not), 2-D or 3-D, with or without bias, first layer or not,
    frozen weight (no dW; 3-D: the op writes the 2-D dA, flat_da): one LinearActivationGrad
    that computes what the unfused graph computes (onnxruntime, graph optimizations off)."""
    m = builders.torch_linear_act(_BY_NAME[f"act_{act}_grad_torch"], layout=layout, **variant)
    fused = copy.deepcopy(m)
    fp = FusionPass()
    assert fp.run(fused) == 1
    assert fp.stats.patterns[f"linear_{act.split('_')[0]}"].fused == 1
    [node] = [n for n in fused.graph.node if n.domain == "com.fusecli"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if not variant.get("first"):
        assert attrs["trans_w"] == trans[0]
    assert attrs.get("trans_dw", attrs["trans_w"]) == trans[1]
    assert attrs["activation"].decode() == act.removesuffix("_pow")
    feeds = _feeds(m)
    want, got = _run_ort(m, feeds), _run_ort(fused, feeds)
    assert set(want) == set(got)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def _fused_once(m, pattern):
    """A copy of m with its one chain fused as `pattern`, and the fused node's attributes."""
    fused = copy.deepcopy(m)
    fp = FusionPass()
    assert fp.run(fused) == 1
    assert fp.stats.patterns[pattern].fused == 1
    [node] = [n for n in fused.graph.node if n.domain == "com.fusecli"]
    return fused, {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("c,stage,pattern", [(1.702, "act_silu_scaled_grad_torch", "linear_gelu"),
                                             (0.5, "act_silu_scaled_grad_torch", "linear_gelu"),
                                             (1.0, "act_silu_product_grad_torch", "linear_silu")])
@pytest.mark.parametrize("layout", ["linear", "conv1d", "at_t"])
@pytest.mark.parametrize("variant", [{}, {"three_d": True}, {"first": True}])
def test_torch_quick_gelu_fuses_and_computes_the_same(c, stage, pattern, layout, variant):
    """x * sigmoid(c x) in torch-joint's product-rule backward (QuickGELU at c = 1.702, any
    scalar c; c = 1 without the scale: x * sigmoid(x) by hand, SiLU): one LinearActivationGrad
    {silu, alpha=c} that computes what the unfused graph computes."""
    m = builders.torch_linear_act(_BY_NAME[stage], layout=layout, act_consts={"c": c},
                                  **variant)
    fused, attrs = _fused_once(m, pattern)
    assert attrs["activation"] == b"silu"
    assert attrs.get("alpha", 1.0) == pytest.approx(c)
    feeds = _feeds(m)
    feeds["X"] *= 10.0  # pre-activations up to |x| ~ 40: the sigmoid saturates
    want, got = _run_ort(m, feeds), _run_ort(fused, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def _quick_gelu_scales(m):
    """The forward scale Mul(X, c) and the backward Mul(., c) of a QuickGELU chain."""
    return [n for n in m.graph.node if n.name in ("act.fwd_scale", "act.bwd_scale")]


@pytest.mark.parametrize("case,reason", [("bwd_other_value", "constant"),
                                         ("bwd_not_constant", "dataflow"),
                                         ("fwd_missing", "no_candidate"),
                                         ("fwd_not_scalar", "constant")])
def test_torch_quick_gelu_scale_guards(case, reason):
    """The stage rule needs the SAME scalar constant c on the forward Mul(x, c) (the sigmoid's
    input) and on the backward Mul: another value, a run-time tensor, a missing forward scale
    (the sigmoid reads x itself: the backward's extra factor is not a SiLU derivative) or a
    non-scalar c is left unfused, and explain names the reason."""
    m = builders.torch_linear_act(_BY_NAME["act_silu_scaled_grad_torch"],
                                  act_consts={"c": 1.702})
    fwd, bwd = _quick_gelu_scales(m)
    c_name = fwd.input[1]
    if case == "bwd_other_value":
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(2.0, np.float32), "c2"))
        bwd.input[1] = "c2"
    elif case == "bwd_not_constant":
        m.graph.input.append(helper.make_tensor_value_info("c_rt", onnx.TensorProto.FLOAT, []))
        bwd.input[1] = "c_rt"
    elif case == "fwd_missing":
        sig = next(n for n in m.graph.node if n.op_type == "Sigmoid")
        sig.input[0] = "X"
        m.graph.node.remove(fwd)
    else:
        init = next(i for i in m.graph.initializer if i.name == c_name)
        init.CopyFrom(numpy_helper.from_array(np.full((5,), 1.702, np.float32), c_name))
    fp = FusionPass()
    assert fp.run(copy.deepcopy(m)) == 0
    assert fp.stats.patterns["linear_gelu"].fused == 0
    misses = explain_model(m, FusionPass(rules=_upto("act_silu_scaled_grad_torch")),
                           include_shallow=True)
    mine = [x for x in misses if x["rule"] == "act_silu_scaled_grad_torch"]
    assert [x["reason"] for x in mine] == [reason], mine


@pytest.mark.parametrize("alpha,rule", [(1.0, "linear_silu_ortt_gemm"),
                                        (1.702, "linear_quick_gelu_ortt_gemm"),
                                        (0.5, "linear_quick_gelu_ortt_gemm")])
def test_ortt_quick_gelu_grad_alpha_picks_the_pattern(alpha, rule):
    """QuickGeluGrad{alpha=1} is SiLU (linear_silu), any other alpha QuickGELU (linear_gelu,
    alpha taken by the fused op); the quick_gelu rule refuses alpha = 1 (explain says so)."""
    m = builders.ortt_linear_act("silu")
    node = next(n for n in m.graph.node if n.op_type == "QuickGeluGrad")
    next(a for a in node.attribute if a.name == "alpha").f = alpha
    fp = FusionPass()
    assert fp.run(copy.deepcopy(m)) == 1
    assert [f.rule for f in fp.stats.fusions] == [rule]
    if alpha == 1.0:
        misses = explain_model(m, FusionPass(rules=_upto("linear_quick_gelu_ortt_gemm")),
                               include_shallow=True)
        [miss] = [x for x in misses if x["rule"] == "linear_quick_gelu_ortt_gemm"]
        assert miss["reason"] == "attribute" and "any value but 1.0" in miss["detail"], miss


def test_activation_grad_with_alpha_is_not_fused_as_unscaled():
    """A LinearActivationGrad rule takes an ActivationGrad only at alpha 1, except QuickGELU
    (silu at alpha != 1): ActivationGrad{gelu, alpha=0.5} is left alone, never fused as gelu."""
    m = builders.torch_linear_act(_BY_NAME["act_gelu_grad_torch"])
    fp = FusionPass(rules=_upto("act_silu_grad_torch"))
    fp.run(m)
    [ag] = [n for n in m.graph.node if n.op_type == "ActivationGrad"]
    ag.attribute.append(helper.make_attribute("alpha", 0.5))
    fp = FusionPass()
    assert fp.run(m) == 0
    assert [n.op_type for n in m.graph.node if n.domain == "com.fusecli"] == ["ActivationGrad"]


@pytest.mark.parametrize("act,activation,pattern", [
    ("relu", "relu", "linear_relu"), ("gelu", "gelu", "linear_gelu"),
    ("gelu_fast", "gelu_tanh", "linear_gelu"), ("silu", "silu", "linear_silu"),
    ("quick_gelu", "silu", "linear_gelu")])
@pytest.mark.parametrize("build", ["ortt_linear_act", "ortt_linear_act_matmul",
                                   "ortt_linear_act_gemm2d"])
def test_ortt_activation_spellings_fuse_and_compute_the_same(act, activation, pattern, build,
                                                             tmp_path):
    """onnxruntime-training's activation gradients (FastGeluGrad: gelu_new after ORT's
    pre-gradient FastGelu fusion, the same tanh formula; QuickGeluGrad{alpha=1}: SiLU;
    QuickGeluGrad{alpha=1.702}: QuickGELU, a GELU approximation, silu at input scale alpha),
    Gemm and MatMul layouts; the fused graph runs in onnxruntime-training with the same results."""
    from fusecli.runtime.verify import verify_models

    m = getattr(builders, build)(act)
    fused, attrs = _fused_once(m, pattern)
    assert attrs["activation"].decode() == activation
    assert attrs.get("alpha", 1.0) == pytest.approx(1.702 if act == "quick_gelu" else 1.0)
    src, out = tmp_path / "m.onnx", tmp_path / "m.fused.onnx"
    onnx.save(m, src)
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report


# --- the rule language: variants, alternatives, repeats ---------------------------------------

_LANG_RULE = """
name: t_${act}_chain
pattern: activation_grad
order: 1
params: {extra: null}
variants: $variants
nodes:
  - id: grad
    op: $op
    inputs: [dY, X]
    outputs: [g]
  - id: ids
    op: Identity
    inputs: [g]
    outputs: [g2]
    optional: passthrough
    repeat: 2
  - id: scale
    op: [Div, {op: Mul, value: {c: reciprocal}}]
    commutative: true
    inputs: [g2, c]
    outputs: [dZ]
  - $extra
tensors:
  c: {const: 2.0, tol: 1.0e-6}
replace:
  op: ActivationGrad
  inputs: [dY, X]
  outputs: [dZ]
  attrs: {activation: $act}
"""


def _lang(variants):
    from fusecli.engine.rules import parse_rules

    return parse_rules(_LANG_RULE.replace("$variants", variants), "<lang>")


def _lang_graph(op="ReluGrad", n_identity=1, scale=("Div", 2.0), swap=False):
    nodes = [helper.make_node(op, ["dY", "X"], ["g0"], domain="com.microsoft")]
    for i in range(n_identity):
        nodes.append(helper.make_node("Identity", [f"g{i}"], [f"g{i + 1}"]))
    ins = [f"g{n_identity}", "c"]
    nodes.append(helper.make_node(scale[0], ins[::-1] if swap else ins, ["dZ"]))
    return builders.model(nodes, [builders.vi(t, [3, 4]) for t in ("dY", "X")],
                          [builders.vi("dZ", [3, 4])], [builders.const("c", scale[1])])


def test_variants_expand_with_substitution_and_splicing():
    rules = _lang("[{act: relu, op: [{op: ReluGrad, domain: com.microsoft}]},"
                  " {act: gelu, op: [{op: GeluGrad, domain: com.microsoft}],"
                  "  extra: [{id: tail, op: Neg, inputs: [dZ], outputs: [n]}]}]")
    assert [r.name for r in rules] == ["t_relu_chain", "t_gelu_chain"]
    assert [s.id for s in rules[0].nodes] == ["grad", "ids", "ids_2", "scale"]
    assert [s.id for s in rules[1].nodes][-1] == "tail"
    crossed = _lang("{cross: [[{act: relu}, {act: gelu}], [{op: [ReluGrad]}]]}")
    assert [r.name for r in crossed] == ["t_relu_chain", "t_gelu_chain"]


# one rule node (the activation gradient) -> ActivationGrad{activation, alpha}
_GRAD_RULE_BODY = """
nodes:
  - id: grad
    op: $grad
    inputs: [dY, X]
    outputs: [dZ]
replace:
  op: ActivationGrad
  inputs: [dY, X]
  outputs: [dZ]
  attrs: {activation: $act, alpha: $alpha}
"""

_ALPHA_RULE = """
name: t_${tag}
pattern: activation_grad
order: 1
params: {alpha: null, act: silu}
variants:
  - {tag: plain, grad: [{op: QuickGeluGrad, domain: com.microsoft, attrs: {alpha: 1.0}}]}
  - {tag: scaled, alpha: {attr: a},
     grad: [{op: QuickGeluGrad, domain: com.microsoft, attrs: {alpha: {not: 1.0, capture: a}}}]}
""" + _GRAD_RULE_BODY


def test_null_parameter_drops_a_key_and_alternatives_capture():
    """`key: $p` with p null leaves the key out (the plain variant writes no alpha); a capture
    made by every op alternative of a node is usable in replace.attrs; `not` refuses a value."""
    from fusecli.errors import RuleError
    from fusecli.engine.rules import parse_rules

    rules = parse_rules(_ALPHA_RULE, "<alpha>")
    assert [r.name for r in rules] == ["t_plain", "t_scaled"]
    assert "alpha" not in rules[0].replace.attrs
    assert rules[1].replace.attrs["alpha"] == ("attr", "a")
    for alpha, name in [(1.0, "t_plain"), (1.702, "t_scaled"), (0.5, "t_scaled")]:
        m = builders.model([helper.make_node("QuickGeluGrad", ["dY", "X"], ["dZ"],
                                             domain="com.microsoft", alpha=alpha)],
                           [builders.vi(t, [3, 4]) for t in ("dY", "X")],
                           [builders.vi("dZ", [3, 4])])
        fp = FusionPass(rules=rules)
        assert fp.run(m) == 1
        assert [f.rule for f in fp.stats.fusions] == [name]
        attrs = {a.name: helper.get_attribute_value(a) for a in m.graph.node[0].attribute}
        assert attrs.get("alpha", 1.0) == pytest.approx(alpha)
    one_alt = _ALPHA_RULE.replace("domain: com.microsoft, attrs: {alpha: {not",
                                  "domain: com.microsoft}, {op: GeluGrad, domain: com.microsoft,"
                                  " attrs: {alpha: {not")
    with pytest.raises(RuleError, match="no attribute captured as 'a'"):
        parse_rules(one_alt, "<alpha>")


_NESTED_RULE = """
name: t_${kind}${sfx}
pattern: activation_grad
order: 1
params: {alpha: null}
variants:
  cross:
    - - {kind: relu, grad_op: ReluGrad}
      - {kind: gelu, grad_op: GeluGrad}
    - - {sfx: "", grad: [{op: $grad_op, domain: com.microsoft}], act: $kind}
      - {sfx: _ms, grad: [{op: $grad_op, domain: com.microsoft, attrs: {x: 1}}], act: silu}
""" + _GRAD_RULE_BODY


def test_a_parameter_may_use_parameters_of_another_cross_list():
    """A value set by one list of a cross may use parameters that another list sets (a
    replacement node that differs by variant and by the other list's tensors, as lce_ortt's
    _split gradient node uses dw and ii_value); a value that uses itself is refused."""
    from fusecli.errors import RuleError
    from fusecli.engine.rules import parse_rules

    rules = {r.name: r for r in parse_rules(_NESTED_RULE, "<nested>")}
    assert sorted(rules) == ["t_gelu", "t_gelu_ms", "t_relu", "t_relu_ms"]
    for name, op, act in [("t_relu", "ReluGrad", "relu"), ("t_gelu_ms", "GeluGrad", "silu")]:
        assert rules[name].nodes[0].ops == (op,)
        assert rules[name].replace.attrs["activation"] == ("literal", act)
    assert "x" in rules["t_relu_ms"].nodes[0].alt("ReluGrad").attrs
    looped = _NESTED_RULE.replace("{kind: relu, grad_op: ReluGrad}",
                                  "{kind: relu, grad_op: $grad}")
    with pytest.raises(RuleError, match=re.escape("parameter 'grad' uses itself (through "
                                                  "grad -> grad_op -> grad)")):
        parse_rules(looped, "<nested>")


def test_times_multiplies_a_second_constant_into_an_attribute():
    """`{const: c, fn: reciprocal, default: 1.0, times: kf}` (rules/flash_torch.yaml's scale):
    1 / c times kf's value, each 1 when its optional node is absent; a `times` that names no
    constant tensor is refused when the rule is read."""
    from fusecli.errors import RuleError
    from fusecli.engine.rules import parse_rules

    rule = next(r for r in RULES if r.name == "flash_torch_gqa_mask")
    assert rule.replace.attrs["scale"] == ("const", "c", "reciprocal", 1.0, "kf")
    text = Path(rule.source).read_text()  # (flash_torch.yaml includes no fragment)
    assert "k_fold_scale: kf" in text
    text = text.replace("k_fold_scale: kf", "k_fold_scale: nope")
    with pytest.raises(RuleError, match="times 'nope' is not a tensor"):
        parse_rules(text, rule.source)


def test_exclude_drops_the_combinations_it_names():
    """`variants: {cross: [...], exclude: [...]}` drops every combination that sets each
    parameter of one exclude mapping to its value; one that drops nothing, or drops all, is
    refused in one line."""
    from fusecli.errors import RuleError
    from fusecli.engine.rules import parse_rules

    def names(exclude):
        text = _NESTED_RULE.replace("act: silu}\n", f"act: silu}}\n  exclude: {exclude}\n")
        return sorted(r.name for r in parse_rules(text, "<nested>"))

    assert names("[{kind: gelu, sfx: _ms}]") == ["t_gelu", "t_relu", "t_relu_ms"]
    assert names("[{sfx: _ms}]") == ["t_gelu", "t_relu"]
    with pytest.raises(RuleError, match="matches no combination"):
        names("[{kind: silu}]")
    with pytest.raises(RuleError, match="drops every combination"):
        names("[{sfx: ''}, {sfx: _ms}]")
    with pytest.raises(RuleError, match="non-empty mappings"):
        names("[{}]")


@pytest.mark.parametrize("variants,message", [
    ("[{act: relu}]", "unknown parameter 'op'"),
    ("[{act: relu, op: Neg, typo: 1}]", "sets ['typo'], which the rule never uses"),
    ("[]", "non-empty list"),
])
def test_variant_errors_name_the_problem(variants, message):
    from fusecli.errors import RuleError

    with pytest.raises(RuleError, match=re.escape(message)):
        _lang(variants)


@pytest.mark.parametrize("n_identity,fused", [(0, True), (1, True), (2, True), (3, False)])
@pytest.mark.parametrize("scale,swap", [(("Div", 2.0), False), (("Mul", 0.5), False),
                                        (("Mul", 0.5), True)])
def test_repeated_passthrough_and_scale_alternatives(n_identity, fused, scale, swap):
    from fusecli.engine.graph import GraphIndex
    from fusecli.engine.matcher import Matcher

    [rule] = _lang("[{act: relu, op: [{op: ReluGrad, domain: com.microsoft}]}]")
    m = _lang_graph(n_identity=n_identity, scale=scale, swap=swap)
    # the rule language alone: `repeat: 2` binds at most two Identity nodes
    index = GraphIndex(m.graph)
    anchor = index.candidates("ReluGrad", "com.microsoft")[0]
    assert (Matcher(index, rule).match_at(anchor).match is not None) == fused
    # FusionPass takes every Identity out of its index first (graph.bypass_passthrough):
    # any number of them is the same dataflow
    assert FusionPass(rules=[rule]).run(m) == 1


def test_alternative_value_transform_is_explained():
    [rule] = _lang("[{act: relu, op: [{op: ReluGrad, domain: com.microsoft}]}]")
    m = _lang_graph(scale=("Mul", 2.0))  # Mul by 2 is Div by 0.5, not by 2
    assert FusionPass(rules=[rule]).run(copy.deepcopy(m)) == 0
    [miss] = explain_model(m, FusionPass(rules=[rule]))
    assert miss["reason"] == "constant" and "as reciprocal of its value, Mul" in miss["detail"]
    assert FusionPass(rules=[rule]).run(_lang_graph(scale=("Div", 2.0), swap=True)) == 0


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_real_exports_fuse_and_verify(name, tmp_path):
    from fusecli.runtime.verify import verify_models

    m = onnx.load(DATA / f"{name}.onnx")
    fp = FusionPass()
    fp.run(m)
    assert {f.rule: 1 for f in fp.stats.fusions} == EXPORTS[name]
    assert fp.stats.total_fused == 1
    out = tmp_path / "fused.onnx"
    onnx.save(m, out)
    report = verify_models(DATA / f"{name}.onnx", out)
    assert report.ok and report.max_rel <= 1e-5, report


def test_erf_gelu_written_with_another_constant_is_no_gelu():
    """Megatron-LM's erf_gelu divides by 1.41421, not sqrt 2: a different function from the
    GELU ActivationGrad computes, so it stays unfused and explain names the constant."""
    m = onnx.load(DATA / "torch_gelu_erf_megatron.onnx")
    assert FusionPass().run(copy.deepcopy(m)) == 0
    rule = _BY_NAME["act_gelu_erf_written_grad_torch"]
    [miss] = explain_model(m, FusionPass(rules=[rule]))
    assert miss["reason"] == "constant" and "(c_s)" in miss["detail"], miss


# --- kind: shape (a Reshape target of symbolic dims, issue 21) ----------------------------------

def test_shape_kind_accepts_a_run_time_shape_computation_and_nothing_else():
    from onnx import TensorProto, helper, numpy_helper

    from fusecli.engine.graph import GraphIndex

    i64 = TensorProto.INT64
    nodes = [
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Gather", ["sh", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "zero1"], ["bu"]),
        helper.make_node("Mul", ["bu", "four"], ["bh"]),
        helper.make_node("Concat", ["bh", "m1", "m1"], ["target"], axis=0),  # [b*4, -1, -1]
        helper.make_node("Concat", ["ids", "m1"], ["from_data"], axis=0),    # a graph input's values
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
             (("zero", 0), ("zero1", [0]), ("four", [4]), ("m1", [-1]))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["batch", 4, 8, 8]),
                                       helper.make_tensor_value_info("ids", i64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=inits)
    index = GraphIndex(g)
    assert index.is_shape_computation("target")
    assert index.is_shape_computation("m1")          # a constant is one too
    assert not index.is_shape_computation("from_data")
    assert not index.is_shape_computation("x")


def test_a_constant_broadcast_to_a_run_time_shape_matches_as_its_value():
    # torch's ones_like(x) under symbolic dims: Expand(1.0, Shape(x)); ConstantOfShape too
    from onnx import TensorProto, helper, numpy_helper

    from fusecli.engine.graph import GraphIndex

    nodes = [helper.make_node("Shape", ["x"], ["sh"]),
             helper.make_node("Expand", ["one", "sh"], ["ones"]),
             helper.make_node("ConstantOfShape", ["sh"], ["halves"],
                              value=numpy_helper.from_array(np.array([0.5], np.float32))),
             helper.make_node("Expand", ["pair", "sh"], ["not_one_number"])]
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "pair")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["batch", 2])],
                          [helper.make_tensor_value_info("ones", TensorProto.FLOAT, None)],
                          initializer=inits)
    index = GraphIndex(g)
    assert index.const_value("ones") is None           # not a constant: its shape is not known
    assert float(index.broadcast_scalar("ones")) == 1.0
    assert float(index.broadcast_scalar("halves")) == 0.5
    assert index.broadcast_scalar("not_one_number") is None
    assert index.broadcast_scalar("sh") is None


def test_a_static_dim_read_from_a_symbolic_shape_is_a_constant():
    # Gather(Shape(x), 3) with x [batch, 2, sequence, 8]: 8 (the Range end of a symbolic-dim
    # rotate-half's scatter indices); the symbolic dims stay run-time values
    from onnx import TensorProto, helper, numpy_helper

    from fusecli.engine.graph import GraphIndex

    nodes = [helper.make_node("Shape", ["x"], ["sh"]),
             helper.make_node("Gather", ["sh", "three"], ["d"], axis=0),
             helper.make_node("Gather", ["sh", "zero"], ["b"], axis=0),
             helper.make_node("Shape", ["x"], ["tail"], start=1),
             helper.make_node("Gather", ["tail", "two"], ["d2"], axis=0),
             helper.make_node("Shape", ["x"], ["last"], start=-1)]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n)
             for n, v in (("three", 3), ("zero", 0), ("two", 2))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["batch", 2, "sequence", 8])],
        [helper.make_tensor_value_info("d", TensorProto.INT64, [])], initializer=inits)
    index = GraphIndex(g)
    assert int(index.const_value("d")) == 8 and int(index.const_value("d2")) == 8
    assert index.const_value("last").tolist() == [8]
    assert index.const_value("b") is None and index.const_value("sh") is None


def test_rules_whose_ops_the_graph_lacks_are_not_tried(monkeypatch):
    """The pass skips a rule when a node it requires has no op of its kind in the graph as it
    is at that rule's turn: on a torch-joint graph no rule that needs a com.microsoft op (an
    ort-training gradient op) is searched, while rules that match the fused ops earlier rules
    created (ActivationGrad, from the act_*_grad_torch stage) still fire."""
    from fusecli.engine.matcher import Matcher

    tried: set[str] = set()
    match_at = Matcher.match_at

    def spy(self, anchor):
        tried.add(self.rule.name)
        return match_at(self, anchor)

    monkeypatch.setattr(Matcher, "match_at", spy)
    fp = FusionPass(load_rules())
    m = onnx.load(SAMPLES / "torch_mlp.onnx")
    # torch_mlp: Linear+ReLU, Linear+GELU, Linear+SiLU, Linear(bias=False)+ReLU, then the head
    assert fp.run(m) == 4
    def needs_microsoft(rule) -> bool:  # a required node only a com.microsoft op can be
        return any(not s.optional and all(s.alt(op).domains == ("com.microsoft",)
                                           for op in s.ops) for s in rule.nodes)

    ms_rules = {r.name for r in fp.rules if needs_microsoft(r)}
    assert len(ms_rules) > 20 and tried and not tried & ms_rules
    assert any(r.rule.startswith("linear_") and r.rule.endswith("_torch")
               for r in fp.stats.fusions)


def test_rules_that_start_alike_share_their_dead_ends(monkeypatch):
    """Variants of one rule file share their first nodes (lora_identity_torch_dx and _nodx differ
    only in the input-gradient nodes at the end): where the first one's search never got past
    those shared nodes, the second is not searched at that anchor. A constraint that differs
    (the ignore_index attribute of lce_ortt vs lce_ortt_ii's first node) makes the keys differ.
    The fused graph is the same as without the sharing."""
    from collections import Counter

    from fusecli.engine.fusion import prefix_keys
    from fusecli.engine.matcher import Matcher

    by_name = {r.name: r for r in load_rules()}
    dx, nodx = (prefix_keys(by_name[f"lora_identity_torch_{v}"]) for v in ("dx", "nodx"))
    shared = len(by_name["lora_identity_torch_nodx"].nodes)
    assert dx[:shared] == nodx and len(dx) > shared
    assert prefix_keys(by_name["lce_ortt"])[0] != prefix_keys(by_name["lce_ortt_ii"])[0]

    calls: Counter = Counter()
    match_at = Matcher.match_at

    def spy(self, anchor):
        calls[self.rule.name] += 1
        return match_at(self, anchor)

    monkeypatch.setattr(Matcher, "match_at", spy)
    shared_run, alone_run = FusionPass(load_rules()), FusionPass(load_rules())
    alone_run._keys = lambda rule: [hash((rule.name, i))   # nothing shared
                                    for i in range(len(rule.nodes))]
    a, b = (onnx.load(SAMPLES / "torch_llama.onnx") for _ in range(2))
    shared_run.run(a)
    with_sharing = dict(calls)
    calls.clear()
    alone_run.run(b)
    assert with_sharing["lora_identity_torch_dx"] == calls["lora_identity_torch_dx"] > 0
    assert with_sharing.get("lora_identity_torch_nodx", 0) < calls["lora_identity_torch_nodx"]
    assert a.SerializeToString() == b.SerializeToString()
    assert shared_run.stats.as_dict() == alone_run.stats.as_dict()


@pytest.mark.parametrize("name", sorted(k for k in SAMPLE_MODELS if k.startswith("softcap_")))
def test_softcap_sample_computes_what_the_original_does(name, tmp_path):
    """Each soft-capped attention sample (every mask kind, grouped K / V, both families) fused
    by its _softcap rule verifies against its unfused original (the cap before the mask, its
    derivative in the backward)."""
    from fusecli.runtime.verify import verify_models

    m = copy.deepcopy(SAMPLE_MODELS[name])
    onnx.save(m, tmp_path / "orig.onnx")
    rule = name[len("softcap_"):]
    assert rule in {f.rule for f in _fusions(m)}
    onnx.save(m, tmp_path / "fused.onnx")
    report = verify_models(tmp_path / "orig.onnx", tmp_path / "fused.onnx")
    # (verify's verdict: each output within its noise floor; the key bias's gradient is ~0 by
    # the softmax's shift invariance, so a relative error there says nothing)
    assert report.ok, report
