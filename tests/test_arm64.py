"""Fused torch-joint corpus graphs on ARM64 (`make test-arm64`: scripts/test_arm64.sh runs this
file with Debian's arm64 CPython under qemu-aarch64-static, onnxruntime's aarch64 wheel and the
cross-built library named by FUSECLI_LIBRARY).

Each graph is fused here, by the ARM64 Python (FusionPass is pure Python: the same rewrite as on
x86-64), and `fusecli verify`'s check (``verify_models``) runs the original and the fused graph
in stock onnxruntime on the same feeds, at the tolerance tests/test_corpus.py holds the x86-64
run to (verify's defaults: rtol 1e-5, atol 1e-6, above each output's noise floor; a PASS, not
an inconclusive verdict). The fused ops must have run: verify's profile counts each fused op's
kernel calls.

CI time: under emulation one graph takes ~1-2 minutes (three onnxruntime sessions under qemu),
so this runs a subset of the torch-joint graphs that holds every fused op and every pattern the
torch-joint corpus fuses (ARM64_GRAPHS; test_the_subset_covers_the_torch_joint_patterns checks
the cover against the manifest). FUSECLI_ARM64_GRAPHS=all runs every torch-joint graph.

On x86-64 the module is skipped: tests/test_corpus.py checks the same graphs there."""
from __future__ import annotations

import os
import platform
from collections import Counter

import onnx
import pytest

from conftest import REPO, fused_corpus, grouped

from fusecli.ops.contracts import FUSED_DOMAIN
from fusecli.runtime.feeds import load_manifest
from fusecli.runtime.library import library_path
from fusecli.runtime.verify import verify_models

if platform.machine() != "aarch64":
    pytest.skip("ARM64 only (make test-arm64); tests/test_corpus.py checks these graphs on "
                "x86-64", allow_module_level=True)

CORPUS = REPO / "corpus"
MANIFEST = load_manifest(CORPUS / "manifest.yaml")
TORCH_JOINT = sorted(n for n, e in MANIFEST.items() if e["family"] == "torch-joint")
# BERT with a padding mask and dropout: AttentionGrad, LayerNormGrad, LinearActivationGrad (gelu);
# BERT + LoRA: FlashAttention(+Grad), LoraLinearGrad; Llama with its LM head: RMSNormGrad,
# GatedActivationGrad, RotaryEmbeddingGrad, LinearCrossEntropy(+Grad); T5: LinearActivationGrad
# (relu), the RMSNorm-with-attention-bias encoder
ARM64_GRAPHS = ["torch_bert", "torch_bert_lora", "torch_llama_lm", "torch_t5"]
GRAPHS = TORCH_JOINT if os.environ.get("FUSECLI_ARM64_GRAPHS") == "all" else ARM64_GRAPHS
NAMES = [grouped(f"arm64-{n}", n) for n in GRAPHS]


def _expected_patterns(name: str) -> set[str]:
    e = MANIFEST[name]
    return {p for p, c in e["expected"].items()
            if c - e["known_gaps"].get(p, {}).get("count", 0) > 0}


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return fused_corpus(tmp_path_factory.mktemp("arm64-fused"), CORPUS, MANIFEST)


def test_runs_on_arm64_with_the_arm64_library():
    """The interpreter, onnxruntime and the library all are ARM64 (ELF e_machine 183)."""
    import onnxruntime as ort

    assert platform.machine() == "aarch64"
    lib = library_path()
    with open(lib, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183, lib
    assert ort.__version__ == "1.31.1", ort.__version__


def test_the_subset_covers_the_torch_joint_patterns():
    """Every pattern some torch-joint graph fuses is fused by a graph this file runs."""
    every = set().union(*(_expected_patterns(n) for n in TORCH_JOINT))
    ours = set().union(*(_expected_patterns(n) for n in ARM64_GRAPHS))
    assert every and every <= ours, sorted(every - ours)
    assert all(MANIFEST[n]["family"] == "torch-joint" for n in ARM64_GRAPHS)


@pytest.mark.parametrize("name", NAMES)
def test_fused_graph_computes_what_the_original_computes(name, fused):
    e = MANIFEST[name]
    path, stats = fused[name]
    got = {p for p, s in stats.patterns.items() if s.fused}
    assert got == _expected_patterns(name)  # the same rewrite as on x86-64 (test_corpus)
    ops = Counter(n.op_type for n in onnx.load(path).graph.node if n.domain == FUSED_DOMAIN)
    report = verify_models(CORPUS / e["file"], path)
    assert report.runtime.startswith("onnxruntime 1.31.1"), report.runtime
    assert report.ok, report.as_dict()
    assert (report.rtol, report.atol) == (1e-5, 1e-6)
    assert report.outputs, "nothing compared"
    # every fused node ran its ARM64 kernel (onnxruntime's profile of the fused run)
    assert report.fused_kernel_runs == dict(ops), (report.fused_kernel_runs, dict(ops))
