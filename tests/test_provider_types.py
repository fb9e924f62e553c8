"""--provider gates element types by the contracts: `types` (the CPU kernels), `cuda_types` (the
CUDA kernels, default `types`), and for `any` the types both implement. A float16 / bfloat16
LayerNorm backward (onnxruntime-training's LayerNormalizationGrad, float32 statistics as
ort-training saves them) fuses where the provider's kernels take its type and is skipped with
reason unsupported_type where they do not."""

from __future__ import annotations

import pytest
from onnx import TensorProto

import builders
from fusecli import FusionPass
from fusecli.api import fusion_pass
from fusecli.ops.contracts import load_contracts

LN = load_contracts().ops["LayerNormGrad"]
NAMES = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


def _layernorm(elem):
    """The layernorm fixture with its data in `elem`; mean / inv_std stay float32."""
    m = builders.compose([builders.frag_ortt_layernorm("a_", residual=True)])
    for v in list(m.graph.input) + list(m.graph.output):
        if not v.name.endswith(("mean", "inv_std")):
            v.type.tensor_type.elem_type = elem
    return m


def _fused(provider, elem) -> int:
    fp = FusionPass(only=["layernorm"], provider=provider)
    m = _layernorm(elem)
    n = fp.run(m)
    assert n == sum(node.op_type == "LayerNormGrad" for node in m.graph.node)
    if not n:
        assert fp.stats.patterns["layernorm"].skipped == {"unsupported_type": 1}
    return n


def test_the_contract_declares_what_this_test_relies_on():
    assert "bfloat16" in LN.cuda_types and "bfloat16" not in LN.types
    assert "float16" in LN.cuda_types and "float16" in LN.types


@pytest.mark.parametrize("provider,fuses", [("cuda", True), ("cpu", False), ("any", False)])
def test_bfloat16_fuses_only_for_the_cuda_kernels(provider, fuses):
    assert _fused(provider, TensorProto.BFLOAT16) == int(fuses)


@pytest.mark.parametrize("provider", ["cuda", "cpu", "any"])
def test_float16_fuses_where_both_kernels_take_it(provider):
    assert _fused(provider, TensorProto.FLOAT16) == 1


def test_float32_is_unchanged():
    for provider in ("cuda", "cpu", "any"):
        assert _fused(provider, TensorProto.FLOAT) == 1


def test_types_for_each_provider():
    for c in load_contracts().ops.values():
        assert c.types_for("cpu") == c.types
        assert c.types_for("cuda") == c.cuda_types
        assert set(c.types_for("any")) == set(c.types) & set(c.cuda_types)
        assert "float32" in c.types_for("any")
    with pytest.raises(ValueError, match="unknown execution provider"):
        LN.types_for("tpu")


def test_the_api_passes_the_provider_on(monkeypatch):
    """fusecli.api.fusion_pass(provider="cuda") gates by cuda_types (the library's CUDA kernels
    stubbed as present: this machine may have none)."""
    import fusecli.runtime.library as library

    monkeypatch.setattr(library, "kernel_ops", lambda p: set(load_contracts().ops))
    for provider, want in (("cuda", 1), ("cpu", 0)):
        fp = fusion_pass(only=["layernorm"], provider=provider)
        assert fp.provider == provider
        assert fp.run(_layernorm(TensorProto.BFLOAT16)) == want
