"""Regenerates tests/data/{ortt,torch}_gelu_erf_written.onnx and torch_gelu_erf_megatron.onnx:
nn.Linear(8->16) + erf-GELU written out as a function + nn.Linear(16->4), MSE loss, input
[2, 3, 8]:

  gelu_erf_written  transformers' ESM `gelu`: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
                    (older BERT code's too); linear_gelu 1
  gelu_erf_megatron a look-alike, Megatron-LM's erf_gelu: x * 0.5 * (erf(x / 1.41421) +
                    ones_like(x)), whose constant is not sqrt 2 (not the GELU the op computes;
                    torch-joint only); linear_gelu 0

Through the corpus exporters (scripts/corpus/gen.py), each checked against torch autograd:
build/venv-corpus-ortt/bin/python tests/data/make_gelu_written.py ort-training
build/venv-corpus-torch/bin/python tests/data/make_gelu_written.py torch-joint
"""

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "corpus"))
import gen  # noqa: E402  (first: it sets transformers up as the corpus does)
from transformers.models.esm import modeling_esm as esm  # noqa: E402


def megatron_erf_gelu(x):
    return x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + torch.ones_like(x).to(dtype=x.dtype))


class MLP(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def main(family: str) -> None:
    graphs = [("gelu_erf_written", esm.gelu)] + (
        [("gelu_erf_megatron", megatron_erf_gelu)] if family == "torch-joint" else [])
    for name, act in graphs:
        torch.manual_seed(0)
        gen.write_fixture(family, MLP(act).train(), {"x": torch.randn(2, 3, 8)}, name, HERE)


if __name__ == "__main__":
    main(sys.argv[1])
