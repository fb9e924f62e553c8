"""Regenerates tests/data/{ortt,torch}_lora_*.onnx: LoRA fine-tuning graphs (base weights frozen,
only the adapters train), through the corpus exporters (scripts/corpus/gen.py), each checked
against torch autograd:
ort-training: torch.onnx.export + generate_artifacts(requires_grad = the adapters only);
torch-joint: aot_export_module(trace_joint=True) with requires_grad=False on the base.

Models (tiny; the counts are what each fixture's test expects, from this model code: the
number of LoRA-wrapped Linear layers whose backward is in the graph):
  lora_qv       Block x2 (LayerNorm, q/k/v/o projections, 2-head attention, fc1-GELU-fc2), peft
                LoRA on q_proj/v_proj (peft's default targets), r=4, lora_alpha=8 (s = 2), no
                dropout: 4 adapters (no activation; block 1's q/v have no input gradient, as
                nothing below them trains)
  lora_all      the same with LoRA on every Linear (q,k,v,o,fc1,fc2): 12 adapters, fc1's with GELU
  lora_dropout  lora_qv with lora_dropout=0.1 (Dropout in front of lora_A): 4 adapters
  lora_hand     a hand-written LoRA MLP: fc1 (8->16) + GELU + fc2 (16->16) + ReLU + fc3 (16->4),
                each y = x W^T + b + s (x A^T) B^T with A, B nn.Parameters (s = 0.5): 3 adapters
                (fc1 with GELU and no input gradient, fc2 with ReLU, fc3 without activation)
  lora_hand_relu fc1 (8->16) + ReLU + fc2 (16->16) + GELU + fc3 (16->4), hand-written LoRA:
                3 adapters (fc1 with ReLU and no input gradient, fc2 with GELU, fc3 without)
  lora_notadapter (negative) a Linear plus a product that is no adapter:
                y = relu(x W^T + b + 0.5 relu(x C^T) D^T) -> Linear (a ReLU between the factors): 0
  lora_runtime_scale (negative) lora_hand with fc1's scale a graph input: 0 there, 2 (fc2, fc3)
  lora_basetrains (negative) fc1 + ReLU + fc2, hand-written LoRA whose base W and b train too:
                2 adapters,
                neither fused with its activation (the base's weight and bias gradients read
                dZ, and the op is not given them): fc1's adapter part fuses without the ReLU
                gradient (identity on dZ), fc2's fuses in ort-training (the base's gradients read
                dY and stay outside) and not in torch-joint (a training base's input gradient
                reads the 2-D view of dY, a spelling the rule does not cover)

lora_B starts random (peft's init_lora_weights=False), so the adapter's gradients are not zero.
Run with two venvs holding the corpus exporters' packages (scripts/corpus/requirements-*.txt:
torch 2.13.0, transformers 4.57.6, and onnxruntime-training-cpu 1.19.2 + onnx 1.16.2, or onnx
1.23.2 + onnxscript 0.7.2 + onnxruntime 1.31.1) plus peft (0.21.2 was used):
build/venv-lora-ortt/bin/python tests/data/make_lora.py ort-training
build/venv-lora-torch/bin/python tests/data/make_lora.py torch-joint
"""

import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "corpus"))
import gen  # noqa: E402

D, HEADS, FF = 16, 2, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q_proj, self.k_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.v_proj, self.o_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)

        def heads(t):
            return t.view(b, s, HEADS, D // HEADS).transpose(1, 2)

        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))
        p = torch.softmax(q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5, dim=-1)
        x = x + self.o_proj((p @ v).transpose(1, 2).reshape(b, s, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for blk in self.layers:
            x = blk(x)
        return x


def peft_model(targets, dropout):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = Decoder()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout,
                     init_lora_weights=False)
    m = get_peft_model(base, cfg)  # freezes every base parameter
    return m.base_model.model  # the wrapped Decoder: parameter names without peft's prefixes


class HandLoRA(nn.Module):
    def __init__(self, k, n, r, s, runtime_scale=False, base_trains=False):
        super().__init__()
        self.base = nn.Linear(k, n)
        self.base.requires_grad_(base_trains)
        self.A = nn.Parameter(torch.randn(r, k) * 0.3)
        self.B = nn.Parameter(torch.randn(n, r) * 0.3)
        self.s, self.runtime_scale = s, runtime_scale

    def forward(self, x, s=None):
        return self.base(x) + (x @ self.A.t()) @ self.B.t() * (s if self.runtime_scale else self.s)


class HandMLP(nn.Module):
    """fc1 (8->16) + GELU + fc2 (16->16) + ReLU + fc3 (16->4), each a hand-written LoRA."""

    def __init__(self, runtime_scale=False):
        super().__init__()
        self.fc1 = HandLoRA(8, 16, 2, 0.5, runtime_scale)
        self.fc2 = HandLoRA(16, 16, 2, 0.5)
        self.fc3 = HandLoRA(16, 4, 2, 0.5)

    def forward(self, x, *s):
        return self.fc3(torch.relu(self.fc2(F.gelu(self.fc1(x, *s)))))


class ReluGeluMLP(nn.Module):
    """fc1 (8->16) + ReLU + fc2 (16->16) + GELU + fc3 (16->4), each a hand-written LoRA."""

    def __init__(self):
        super().__init__()
        self.fc1 = HandLoRA(8, 16, 2, 0.5)
        self.fc2 = HandLoRA(16, 16, 2, 0.5)
        self.fc3 = HandLoRA(16, 4, 2, 0.5)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(torch.relu(self.fc1(x)))))


class ReluMLP(nn.Module):
    """fc1 + ReLU + fc2, hand-written LoRA (base_trains: the base weights and biases train too)."""

    def __init__(self, base_trains=False):
        super().__init__()
        self.fc1 = HandLoRA(8, 16, 2, 0.5, base_trains=base_trains)
        self.fc2 = HandLoRA(16, 4, 2, 0.5, base_trains=base_trains)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class NotAdapter(nn.Module):
    """y = relu(x W^T + b + s relu(x C^T) D^T) -> Linear: the product has an activation between
    its two factors (a small MLP branch, not a low-rank adapter)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 16)
        self.base.requires_grad_(False)
        self.C = nn.Parameter(torch.randn(2, 8) * 0.3)
        self.D = nn.Parameter(torch.randn(16, 2) * 0.3)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.base(x) + torch.relu(x @ self.C.t()) @ self.D.t() * 0.5))


def models():
    x3 = {"x": torch.randn(2, 4, D)}
    torch.manual_seed(1)
    xm = {"x": torch.randn(2, 3, 8)}
    return [
        ("lora_qv", lambda: peft_model(["q_proj", "v_proj"], 0.0), x3),
        ("lora_all", lambda: peft_model(["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"],
                                        0.0), x3),
        ("lora_dropout", lambda: peft_model(["q_proj", "v_proj"], 0.1), x3),
        ("lora_hand", lambda: HandMLP(), xm),
        ("lora_notadapter", lambda: NotAdapter(), xm),
        ("lora_runtime_scale", lambda: HandMLP(runtime_scale=True),
         {**xm, "s": torch.tensor(0.5)}),
        ("lora_hand_relu", lambda: ReluGeluMLP(), xm),
        ("lora_basetrains", lambda: ReluMLP(base_trains=True), xm),
    ]


def main(family: str, only: list[str]) -> None:
    prefix = gen.PREFIX[family]
    builder = gen.build_ortt if family == "ort-training" else gen.build_torch
    arch = types.SimpleNamespace(library="torch", input_ranges={})
    for name, make, inputs in models():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model = make().train()
        if name == "lora_dropout":  # check the exporter on a twin without dropout
            twin = make().train()
            for mod in twin.modules():
                if isinstance(mod, nn.Dropout):
                    mod.p = 0.0
            with tempfile.TemporaryDirectory() as td:
                err = builder(arch, twin, inputs, "twin", Path(td), True)[
                    "max_abs_grad_err_vs_torch"]
        with tempfile.TemporaryDirectory() as td:
            res = builder(arch, model, inputs, f"{prefix}_{name}", Path(td),
                          name != "lora_dropout")
            shutil.copy(Path(td) / f"{prefix}_{name}.onnx", HERE / f"{prefix}_{name}.onnx")
        if name != "lora_dropout":
            err = res["max_abs_grad_err_vs_torch"]
        print(f"{prefix}_{name}.onnx: {len(res['model'].graph.node)} nodes, "
              f"trainable {[n for n, p in model.named_parameters() if p.requires_grad]}, "
              f"max |grad - torch| = {err:.3g}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
