"""Regenerates tests/data/torch_gelu_new.onnx: a torch-joint graph of Linear(8->16) + gelu_new
written with torch.pow (Hugging Face NewGELUActivation) + Linear(16->4), loss mean(out^2).

torch 2.13.0 (CPU), onnx, onnxscript: make_fx with core_aten_decompositions of a function that
returns the loss and torch.autograd.grad of it, then torch.onnx.export(dynamo=True).
Run with a venv that has torch: python tests/data/make_torch_gelu_new.py
"""

import math
from pathlib import Path

import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.l1(x)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                        * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.l2(h)


def main():
    torch.manual_seed(0)
    m = M()
    params = dict(m.named_parameters())

    def f(x, *ps):
        out = torch.func.functional_call(m, dict(zip(params, ps)), (x,))
        loss = (out * out).mean()
        return (loss, *torch.autograd.grad(loss, ps))

    x = torch.randn(6, 8)
    gm = make_fx(f, decomposition_table=core_aten_decompositions())(x, *params.values())
    prog = torch.onnx.export(gm, (x, *params.values()), dynamo=True)
    prog.save(str(Path(__file__).with_name("torch_gelu_new.onnx")))


if __name__ == "__main__":
    main()
