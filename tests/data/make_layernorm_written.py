"""Regenerates tests/data/{ortt,torch}_layernorm_written.onnx: LayerNorms written out in the
model code, as the TF-style BertLayerNorm and DeBERTa's DebertaLayerNorm are
(u = x.mean(-1), s = (x - u).pow(2).mean(-1), (x - u) / sqrt(s + eps), then weight * x
[+ bias]). Three of them on [2, 6, 16] (loss mean(out^2)):
- ln1 after a Linear(8->16), with weight and bias;
- ln2 in a pre-norm residual block h + Linear(ln2(h)): its input's gradient gets the
  residual's added (the rule's dR);
- ln3 with a weight and no bias, before the last Linear(16->4).
Counts from the model code: layernorm 3 (each input needs a gradient), nothing else.
ort-training's pre-pass turns the written-out forward into LayerNormalization where it can;
torch-joint keeps the ops and their autograd backward (rules/layernorm_torch_written.yaml).

Through the corpus exporters (scripts/corpus/gen.py), each checked against torch autograd.
Run with the corpus venvs:
build/venv-corpus-ortt/bin/python tests/data/make_layernorm_written.py ort-training
build/venv-corpus-torch/bin/python tests/data/make_layernorm_written.py torch-joint
"""

import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "corpus"))
import gen  # noqa: E402


class WrittenLayerNorm(torch.nn.Module):
    """DeBERTa's DebertaLayerNorm (the epsilon inside the square root)."""

    def __init__(self, size, bias=True, eps=1e-12):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(size).uniform_(0.5, 1.5))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(size)) if bias else None
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        y = self.weight * ((x - mean) / torch.sqrt(variance + self.eps))
        return y if self.bias is None else y + self.bias


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 16),
                                     torch.nn.Linear(16, 4))
        # (eps 1e-7 as DeBERTa's; 1e-12 as BERT's, which torch's exporter drops from the
        # float32 variance)
        self.ln1, self.ln2, self.ln3 = (WrittenLayerNorm(16, eps=1e-7), WrittenLayerNorm(16),
                                        WrittenLayerNorm(16, bias=False, eps=1e-7))

    def forward(self, x):
        h = self.ln1(self.l1(x))
        h = h + self.l2(self.ln2(h))
        return self.l3(self.ln3(h))


def main(family: str) -> None:
    builder = gen.build_ortt if family == "ort-training" else gen.build_torch
    name = f"{gen.PREFIX[family]}_layernorm_written"
    torch.manual_seed(0)
    model, inputs = Blocks().train(), {"x": torch.randn(2, 6, 8)}
    arch = types.SimpleNamespace(library="torch", input_ranges={})
    with tempfile.TemporaryDirectory() as td:
        res = builder(arch, model, inputs, name, Path(td), True)
        shutil.copy(Path(td) / f"{name}.onnx", HERE / f"{name}.onnx")
    print(f"{name}: max |grad - torch| {res['max_abs_grad_err_vs_torch']:.3g}")


if __name__ == "__main__":
    main(sys.argv[1])
