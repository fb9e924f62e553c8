"""Regenerates tests/data/torch_bloom_gelu.onnx (loss mean(out^2)): nn.Linear(8->16) + BLOOM's
GELU (transformers' BloomGelu in training mode: a torch.autograd.Function whose forward is
tanh-GELU x * 0.5 * (1 + tanh(0.79788456 x (1 + 0.044715 x x))) and whose backward is the
hand-written bloom_gelu_back, copied below from transformers 4.57.6 modeling_bloom.py) +
nn.Linear(16->4), input [6, 8]. The backward shares the forward's tanh (after CSE) and spells
the derivative 0.5 x ((1 - t t) (0.79788456 + 0.1070322243 x x)) + 0.5 (1 + t).

torch 2.13.0 (CPU), onnx, onnxscript: make_fx with core_aten_decompositions of a function that
returns the loss and torch.autograd.grad of it, then torch.onnx.export(dynamo=True), as
tests/data/make_torch_gelu_new.py. Run with a venv that has torch (build/venv-corpus-torch):
python tests/data/make_torch_bloom_gelu.py
"""

import torch
from make_torch_gelu_new import export  # the shared make_fx + dynamo export of a loss function


def bloom_gelu_forward(x):
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def bloom_gelu_back(g, x):
    x = x[0]
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (
        1 + tanh_out)
    return ff * g


class GeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return bloom_gelu_forward(x)

    @staticmethod
    def backward(ctx, grad_output):
        return bloom_gelu_back(grad_output, ctx.saved_tensors)


class BloomMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(GeLUFunction.apply(self.l1(x)))


def main():
    torch.manual_seed(0)
    export(BloomMLP(), torch.randn(6, 8), "torch_bloom_gelu.onnx")


if __name__ == "__main__":
    main()
