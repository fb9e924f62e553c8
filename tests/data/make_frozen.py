"""Regenerates the fine-tuning fixtures tests/data/{ortt,torch}_frozen_*.onnx: small models with
some parameters frozen (requires_grad=False), so that their backward lacks those gradients.

- frozen_mlp: Linear(8->16) ReLU Linear(16->16) GELU Linear(16->16) SiLU Linear(16->4), input
  [4, 8]. fc1 trains its weight only (bias frozen: dW, no dB; first layer: no dA); fc2 is frozen
  entirely (the gradient flows through it to fc1: dA only); fc3 has a frozen weight and a
  trainable bias (dA and dB, no dW); fc4 trains. Linear+activation chains whose backward is in
  the graph: (fc1, ReLU), (fc2, GELU), (fc3, SiLU): linear_relu 1, linear_gelu 1, linear_silu 1.
- frozen_first: Linear(8->16) GELU Linear(16->4), input [4, 8], fc1's weight frozen, its bias
  trainable (the first layer's bias gradient alone): linear_gelu 1.
- frozen_norms: Linear(8->16) LayerNorm(16) Linear(16->16) RMSNorm(16) (Llama's
  x * rsqrt(mean(x^2) + eps) * weight) Linear(16->4), input [2, 3, 8], the norms' gamma/beta
  frozen, the Linears trainable (the gradient flows through both norms): layernorm 1,
  rmsnorm 1.
- frozen_block: a pre-norm transformer block (LayerNorm, q/k/v/o Linear, explicit attention
  softmax(q k^T / sqrt(4)) v with 2 heads, residual, LayerNorm, Linear(8->16) GELU
  Linear(16->8), residual), input [2, 4, 8] (no gradient), ln1, k_proj and ln2 frozen: the
  attention backward has no dK (k_proj and everything below it frozen), ln1 has no backward,
  ln2's has no dGamma/dBeta: sdpa 1, layernorm 1, linear_gelu 1.
- frozen_block_no_{q,v,kv,qv,qk}: the same block with other projections frozen in place of
  k_proj (ln1, ln2 and the input as above), so that the attention backward lacks those
  gradients: no_q (q_proj frozen: dK, dV), no_v (dQ, dK), no_kv (dQ only), no_qv (dK only),
  no_qk (dV only: no softmax backward at all).
- frozen_block_dropout[_no_{q,v,kv,qv}]: frozen_block[_no_...] with Dropout(0.1) on the
  attention probabilities (the flash rules refuse it: the sdpa rules' fixtures as exported).
- frozen_block_b1, frozen_block_no_kv_b1: frozen_block, frozen_block_no_kv at batch 1 (input
  [1, 4, 8]): torch's exporter folds Q's and dS's batched views, each read by one MatMul once dK
  is absent, into broadcasting MatMuls (the first layer under LoRA at batch 1).

Through the corpus exporters (scripts/corpus/gen.py; parameters with requires_grad=False are
frozen: `generate_artifacts(requires_grad=[trainable only], frozen_params=[the rest])` and
aot_export_module's joint graph without their gradients), each checked against torch autograd.
Run with the corpus venvs (torch 2.13 + onnxruntime-training 1.19.2, or + onnxscript):
build/venv-corpus-ortt/bin/python tests/data/make_frozen.py ort-training
build/venv-corpus-torch/bin/python tests/data/make_frozen.py torch-joint
"""

import functools
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "scripts" / "corpus"))
import gen  # noqa: E402


class RMSNorm(torch.nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(n) + 0.1 * torch.randn(n)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class FrozenMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)
        self.fc3, self.fc4 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        for p in (self.fc1.bias, self.fc2.weight, self.fc2.bias, self.fc3.weight):
            p.requires_grad_(False)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.nn.functional.gelu(self.fc2(x))
        return self.fc4(torch.nn.functional.silu(self.fc3(x)))


class FrozenFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.fc1.weight.requires_grad_(False)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class FrozenNorms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)
        self.fc2, self.rms, self.fc3 = torch.nn.Linear(16, 16), RMSNorm(16), torch.nn.Linear(16, 4)
        with torch.no_grad():  # not the identity affine
            self.ln.weight.add_(0.1 * torch.randn(16))
            self.ln.bias.add_(0.1 * torch.randn(16))
        for p in (self.ln.weight, self.ln.bias, self.rms.weight):
            p.requires_grad_(False)

    def forward(self, x):
        return self.fc3(self.rms(self.fc2(self.ln(self.fc1(x)))))


class FrozenBlock(torch.nn.Module):
    """Pre-norm transformer block, explicit attention softmax(q k^T / sqrt(d)) v, 2 heads of 4."""

    def __init__(self, d=8, heads=2, frozen="k", attn_dropout=0.0):
        super().__init__()
        self.drop = torch.nn.Dropout(attn_dropout)
        self.h, self.dh = heads, d // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.add_(0.1 * torch.randn(d))
                ln.bias.add_(0.1 * torch.randn(d))
        for m in (self.ln1, *(getattr(self, c) for c in frozen), self.ln2):
            for p in m.parameters():
                p.requires_grad_(False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln1(x)

        def heads(t):
            return t.view(b, s, self.h, self.dh).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        p = self.drop(torch.softmax(q @ k.transpose(-2, -1) / self.dh ** 0.5, dim=-1))
        x = x + self.o((p @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


GRAPHS = [("frozen_mlp", FrozenMLP, (4, 8)), ("frozen_first", FrozenFirst, (4, 8)),
          ("frozen_norms", FrozenNorms, (2, 3, 8)), ("frozen_block", FrozenBlock, (2, 4, 8))]
# the block without the gradients of the projections it freezes (frozen_block: no dK)
GRAPHS += [(f"frozen_block_no_{c}", functools.partial(FrozenBlock, frozen=c), (2, 4, 8))
           for c in ("q", "v", "kv", "qv", "qk")]
# ... and with attention-probability dropout (p = 0.1, as BERT), which the flash rules
# refuse: frozen_block_dropout (no dK), frozen_block_dropout_no_{q,v,kv,qv}
GRAPHS += [(f"frozen_block_dropout{f'_no_{c}' if c != 'k' else ''}",
            functools.partial(FrozenBlock, frozen=c, attn_dropout=0.1), (2, 4, 8))
           for c in ("k", "q", "v", "kv", "qv")]
# ... at batch 1 without dK (torch-joint: Q's and dS's views folded into broadcasting MatMuls)
GRAPHS += [("frozen_block_b1", FrozenBlock, (1, 4, 8)),
           ("frozen_block_no_kv_b1", functools.partial(FrozenBlock, frozen="kv"), (1, 4, 8))]
# ... and with attention dropout (the sdpa rules: GPT-2 / BERT under LoRA at batch 1)
GRAPHS += [("frozen_block_dropout_b1", functools.partial(FrozenBlock, attn_dropout=0.1),
            (1, 4, 8)),
           ("frozen_block_dropout_no_kv_b1",
            functools.partial(FrozenBlock, frozen="kv", attn_dropout=0.1), (1, 4, 8))]


def main(family: str, only: list[str]) -> None:
    prefix = gen.PREFIX[family]
    builder = gen.build_ortt if family == "ort-training" else gen.build_torch
    arch = types.SimpleNamespace(library="torch", input_ranges={})
    for name, cls, shape in GRAPHS:
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model, inputs = cls().train(), {"x": torch.randn(*shape)}
        dropout = model.drop.p > 0 if isinstance(model, FrozenBlock) else False
        err = gen.dropout_twin_error(builder, arch, model, inputs) if dropout else None
        with tempfile.TemporaryDirectory() as td:
            res = builder(arch, model, inputs, f"{prefix}_{name}", Path(td), not dropout)
            shutil.copy(Path(td) / f"{prefix}_{name}.onnx", HERE / f"{prefix}_{name}.onnx")
        err = err if dropout else res["max_abs_grad_err_vs_torch"]
        print(f"{prefix}_{name}: max |grad - torch| {err:.3g}{' (p = 0 twin)' * dropout}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
