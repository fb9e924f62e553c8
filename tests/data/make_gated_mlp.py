"""Regenerates tests/data/{ortt,torch}_{swiglu,swiglu_fused,geglu,geglu_tanh,gate_const,
gate_sigmoid}.onnx: two residual gated-MLP blocks written like transformers' LlamaMLP
(`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, no biases) on an input [2, 3, 8], hidden 8,
intermediate 16, MSE loss.

  swiglu        act = nn.SiLU (Llama / Mistral / Qwen)                    2 gated MLPs
  swiglu_fused  one gate_up_proj Linear(8, 32) chunked in two halves, `up * act(gate)`
                (Phi-3's Phi3MLP)                                          2 gated MLPs
  geglu         act = nn.GELU() (erf)                                      2 gated MLPs
  geglu_tanh    act = nn.GELU(approximate="tanh") (Gemma's gelu_pytorch_tanh)  2 gated MLPs
  geglu_new     act = transformers' NewGELUActivation (gelu_new, written with torch.pow;
                onnxruntime-training's pre-gradient fusion makes it FastGelu)  2 gated MLPs
  gate_const    look-alike: silu(gate_proj(x)) * a constant buffer (no up projection, no
                gradient for the other factor): no gate, 2 Linear+SiLU
  gate_sigmoid  look-alike: sigmoid(gate_proj(x)) * up_proj(x) (a GLU, not SwiGLU): no gate

Through the corpus exporters (scripts/corpus/gen.py), each checked against torch autograd:
build/venv-corpus-ortt/bin/python tests/data/make_gated_mlp.py ort-training
build/venv-corpus-torch/bin/python tests/data/make_gated_mlp.py torch-joint
"""

import math
import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "corpus"))
import gen  # noqa: E402

D, F = 8, 16


class NewGELU(nn.Module):
    """transformers' NewGELUActivation (gelu_new), as written there."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                           * (x + 0.044715 * torch.pow(x, 3.0))))


class GatedMLP(nn.Module):
    """LlamaMLP (separate gate/up projections) or Phi3MLP (one fused gate_up_proj)."""

    def __init__(self, act, fused=False, kind="gate"):
        super().__init__()
        self.fused, self.kind, self.act = fused, kind, act
        if fused:
            self.gate_up_proj = nn.Linear(D, 2 * F, bias=False)
        else:
            self.gate_proj = nn.Linear(D, F, bias=False)
            if kind == "const":
                self.register_buffer("scale", torch.linspace(0.5, 1.5, F))
            else:
                self.up_proj = nn.Linear(D, F, bias=False)
        self.down_proj = nn.Linear(F, D, bias=False)

    def forward(self, x):
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * self.act(gate))
        if self.kind == "const":
            return self.down_proj(self.act(self.gate_proj(x)) * self.scale)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Blocks(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.mlp1, self.mlp2 = make(), make()

    def forward(self, x):
        x = x + self.mlp1(x)
        return x + self.mlp2(x)


GRAPHS = {
    "swiglu": lambda: GatedMLP(nn.SiLU()),
    "swiglu_fused": lambda: GatedMLP(nn.SiLU(), fused=True),
    "geglu": lambda: GatedMLP(nn.GELU()),
    "geglu_tanh": lambda: GatedMLP(nn.GELU(approximate="tanh")),
    "geglu_new": lambda: GatedMLP(NewGELU()),
    "gate_const": lambda: GatedMLP(nn.SiLU(), kind="const"),
    "gate_sigmoid": lambda: GatedMLP(nn.Sigmoid()),
}


def main(family: str, names: list[str]) -> None:
    for name in names or GRAPHS:
        torch.manual_seed(0)
        gen.write_fixture(family, Blocks(GRAPHS[name]).train(), {"x": torch.randn(2, 3, D)},
                          name, HERE)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
