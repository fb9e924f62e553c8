"""Regenerates the torch-joint fixtures in tests/data (loss mean(out^2)):

- torch_gelu_new.onnx: nn.Linear(8->16) + gelu_new written with torch.pow (Hugging Face
  NewGELUActivation) + nn.Linear(16->4), input [6, 8];
- torch_conv1d_gelu_new.onnx: the GPT-2 MLP spelling: Hugging Face Conv1D layers (weight
  [in, out], torch.addmm on the 2-D view) 8->8, 8->16, gelu_new, 16->8, input [2, 3, 8].

torch 2.13.0 (CPU), onnx, onnxscript: make_fx with core_aten_decompositions of a function that
returns the loss and torch.autograd.grad of it, then torch.onnx.export(dynamo=True).
Run with a venv that has torch: python tests/data/make_torch_gelu_new.py
"""

import math
from pathlib import Path

import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx


def gelu_new(h):
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                       * (h + 0.044715 * torch.pow(h, 3.0))))


class Conv1D(torch.nn.Module):
    """transformers.pytorch_utils.Conv1D"""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.weight.size(-1),)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class LinearMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(gelu_new(self.l1(x)))


class Conv1DMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c0, self.c1, self.c2 = Conv1D(8, 8), Conv1D(16, 8), Conv1D(8, 16)

    def forward(self, x):
        return self.c2(gelu_new(self.c1(self.c0(x))))


def export(m, x, name):
    params = dict(m.named_parameters())

    def f(x, *ps):
        out = torch.func.functional_call(m, dict(zip(params, ps)), (x,))
        loss = (out * out).mean()
        return (loss, *torch.autograd.grad(loss, ps))

    gm = make_fx(f, decomposition_table=core_aten_decompositions())(x, *params.values())
    prog = torch.onnx.export(gm, (x, *params.values()), dynamo=True)
    prog.save(str(Path(__file__).with_name(name)))


def main():
    torch.manual_seed(0)
    export(LinearMLP(), torch.randn(6, 8), "torch_gelu_new.onnx")
    export(Conv1DMLP(), torch.randn(2, 3, 8), "torch_conv1d_gelu_new.onnx")


if __name__ == "__main__":
    main()
