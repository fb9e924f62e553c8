"""Regenerates tests/data/{ortt,torch}_quick_gelu.onnx, ortt_quick_gelu_2d.onnx and
torch_silu_product.onnx: nn.Linear(8->16) + QuickGELU x * sigmoid(1.702 x) (as transformers'
QuickGELUActivation and OpenAI CLIP's quick_gelu write it) + nn.Linear(16->4), MSE loss; input
[2, 3, 8] (a 3-D Linear: MatMul + Add in the ort-training export) and, `_2d`, [6, 8] (Gemm);
`silu_product`: the same with x * sigmoid(x) written by hand.

Through the corpus exporters (scripts/corpus/gen.py), each checked against torch autograd:
ort-training: torch.onnx.export + onnxruntime-training generate_artifacts (ORT's pre-gradient
QuickGeluFusion makes the chain QuickGelu{alpha=1.702}, its gradient QuickGeluGrad{alpha=1.702});
torch-joint: aot_export_module(trace_joint=True) + torch.onnx.export(dynamo=True) (the product
rule through Mul(x, 1.702) -> Sigmoid, decomposed). Run with the corpus venvs:
build/venv-corpus-ortt/bin/python tests/data/make_quick_gelu.py ort-training
build/venv-corpus-torch/bin/python tests/data/make_quick_gelu.py torch-joint
"""

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "corpus"))
import gen  # noqa: E402


class QuickGELU(torch.nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class SiLUProduct(torch.nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class MLP(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(8, 16), act, torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def main(family: str) -> None:
    graphs = [("quick_gelu", QuickGELU, (2, 3, 8))] + (
        [("quick_gelu_2d", QuickGELU, (6, 8))] if family == "ort-training" else
        [("silu_product", SiLUProduct, (2, 3, 8))])
    for name, act, shape in graphs:
        torch.manual_seed(0)
        gen.write_fixture(family, MLP(act()).train(), {"x": torch.randn(*shape)}, name, HERE)


if __name__ == "__main__":
    main(sys.argv[1])
