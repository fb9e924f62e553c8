"""Regenerates tests/data/torch_layernorm_nobias.onnx (loss mean(out^2)): nn.Linear(8->16) ->
nn.LayerNorm(16, bias=False) (a weight, no bias: MPT, ModernBERT) -> nn.Linear(16->4), input
[6, 8]. Its backward has dGamma = ReduceSum(dY xhat) but no dBeta = ReduceSum(dY).
And tests/data/torch_layernorm_noaffine.onnx: the same with nn.LayerNorm(16,
elementwise_affine=False) (OLMo's F.layer_norm(x, shape, None, None)): no dGamma, no dBeta, and
no dY * gamma.

torch 2.13.0 (CPU), onnx, onnxscript: make_fx with core_aten_decompositions of a function that
returns the loss and torch.autograd.grad of it, then torch.onnx.export(dynamo=True), as
tests/data/make_torch_gelu_new.py. Run with a venv that has torch (build/venv-corpus-torch):
python tests/data/make_torch_layernorm_nobias.py
"""

import torch
from make_torch_gelu_new import export  # the shared make_fx + dynamo export of a loss function


class LinearLN(torch.nn.Module):
    def __init__(self, **ln):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.ln = torch.nn.LayerNorm(16, **ln)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(self.ln(self.l1(x)))


def export_ln(name, **ln):
    torch.manual_seed(0)
    m, x = LinearLN(**ln), torch.randn(6, 8)
    if m.ln.weight is not None:
        with torch.no_grad():
            m.ln.weight.uniform_(0.5, 1.5)  # not all ones: dX depends on gamma
    export(m, x, f"{name}.onnx")


def main():
    export_ln("torch_layernorm_nobias", bias=False)
    export_ln("torch_layernorm_noaffine", elementwise_affine=False)


if __name__ == "__main__":
    main()
