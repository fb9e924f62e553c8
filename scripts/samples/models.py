"""Tiny PyTorch models shared by the sample generators (both families).

Each model documents its canonical pattern counts in PATTERNS; the counts are read off the
model code (see samples/manifest.yaml for the count rule), not off any exported graph.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Benchmark ("realistic") sizes used by `gen_*.py --bench OUTDIR` (fusecli.bench.samples):
# transformer d=512, 8 heads, seq 128, FF 2048, batch 4; MLP 1024 wide, batch 256;
# CNN 32/64 channels on 32x32, batch 16.
BENCH_BLOCK = dict(d_model=512, n_heads=8, seq=128, ff=2048)
BENCH_BLOCK_BATCH = 4
BENCH_MLP = dict(inp=1024, hid=1024, out=1024)
BENCH_MLP_BATCH = 256
BENCH_CNN = dict(c1=32, c2=64)
BENCH_CNN_BATCH, BENCH_CNN_HW = 16, 32
# Real-size models, built only when asked for by name (`gen_ortt.py --bench OUTDIR NAME`):
# ResNet-50 on 64x64 images, batch 8.
REAL_RESNET50_BATCH, REAL_RESNET50_HW = 8, 64


def patterns(**kw: int) -> dict[str, int]:
    """A model's pattern counts (names: the `patterns` of fusecli/ops/<op>/contract.yaml; a
    pattern not listed counts 0; tests/test_samples.py checks the names)."""
    return dict(kw)


class MLP(nn.Module):
    """2-D input [B, 16] -> [B, 8]; Linear+ReLU, Linear+GELU(erf), Linear+SiLU, Linear(no bias)+ReLU, Linear."""

    IN, HID, OUT = 16, 32, 8
    PATTERNS = patterns(linear_relu=2, linear_gelu=1, linear_silu=1)

    def __init__(self, inp: int | None = None, hid: int | None = None, out: int | None = None) -> None:
        super().__init__()
        # sizes default to the class constants (the shipped samples); bigger ones for benchmarks
        self.IN, self.HID, self.OUT = inp or self.IN, hid or self.HID, out or self.OUT
        self.fc1 = nn.Linear(self.IN, self.HID)
        self.fc2 = nn.Linear(self.HID, self.HID)
        self.fc3 = nn.Linear(self.HID, self.HID)
        self.fc4 = nn.Linear(self.HID, self.HID, bias=False)
        self.head = nn.Linear(self.HID, self.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.gelu(self.fc2(x))  # erf GELU
        x = F.silu(self.fc3(x))
        x = F.relu(self.fc4(x))  # bias-free Linear + ReLU
        return self.head(x)


D_MODEL, N_HEADS, SEQ, FF = 32, 2, 8, 64


class Block(nn.Module):
    """Pre-LN transformer block, input [B, S=8, D=32], 2 heads of 16.

    attn variants:
      "explicit": separate q/k/v Linears, scores = (q @ k^T) / sqrt(dh) (Div), + additive causal mask
      "mul":      separate q/k/v Linears, scores = (q * dh**-0.5) @ k^T, masked_fill(causal, -inf) (Where)
      "sdpa":     fused qkv Linear(D, 3D) + chunk, F.scaled_dot_product_attention(is_causal=True)
    """

    PATTERNS = patterns(linear_gelu=1, sdpa=1, layernorm=2)
    # softmax is shift-invariant per row, so the key bias gets an exactly-zero gradient
    ZERO_GRAD = ["k.bias"]

    def __init__(self, attn: str = "explicit", d_model: int = D_MODEL, n_heads: int = N_HEADS,
                 seq: int = SEQ, ff: int = FF) -> None:
        super().__init__()
        assert attn in ("explicit", "mul", "sdpa")
        self.d_model, self.n_heads = d_model, n_heads
        if attn == "sdpa":
            self.ZERO_GRAD = []  # the fused qkv.bias is only partly (its k third) zero
        self.attn = attn
        self.dh = d_model // n_heads
        self.ln1 = nn.LayerNorm(d_model)
        if attn == "sdpa":
            self.qkv = nn.Linear(d_model, 3 * d_model)
        else:
            self.q = nn.Linear(d_model, d_model)
            self.k = nn.Linear(d_model, d_model)
            self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ff)
        self.fc2 = nn.Linear(ff, d_model)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        if attn == "explicit":
            # additive mask, 0 on/below the diagonal, -1e4 above it
            self.register_buffer("mask", causal.float() * -1e4, persistent=False)
        elif attn == "mul":
            self.register_buffer("mask", causal, persistent=False)
            # the masked_fill (Where) attention: flash_attention (the flash ops read the bool
            # mask; nothing but the attention's own backward reads P)
            self.PATTERNS = patterns(linear_gelu=1, flash_attention=1, layernorm=2)

    def _heads(self, t: torch.Tensor, b: int, s: int) -> torch.Tensor:
        return t.reshape(b, s, self.n_heads, self.dh).transpose(1, 2)  # [B, H, S, dh]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        h = self.ln1(x)
        if self.attn == "sdpa":
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            q, k, v = (self._heads(t, b, s) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q = self._heads(self.q(h), b, s)
            k = self._heads(self.k(h), b, s)
            v = self._heads(self.v(h), b, s)
            if self.attn == "explicit":
                scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.dh)
                scores = scores + self.mask
            else:
                scores = torch.matmul(q * (self.dh ** -0.5), k.transpose(-2, -1))
                scores = scores.masked_fill(self.mask, float("-inf"))
            p = torch.softmax(scores, dim=-1)
            a = torch.matmul(p, v)
        a = a.transpose(1, 2).reshape(b, s, self.d_model)
        x = x + self.o(a)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x


class CNN(nn.Module):
    """Input [B, 3, 8, 8] -> logits [B, 4].

    stem: Conv(3->8, 3x3, bias=False) + BN + ReLU              (conv_bn_relu #1)
    body: Conv(8->8, 3x3) + BN + ReLU                           (conv_bn_relu #2)
    shortcut: Conv(8->8, 1x1) + BN, NO ReLU, added to the body  (conv_bn #1, no conv_bn_relu)
    MaxPool 2x2, mean over H,W, Linear(8 -> 4) + cross-entropy (linear_cross_entropy #1: in
    ort-training one Gemm straight into SoftmaxCrossEntropyLoss).
    """

    NUM_CLASSES = 4
    PATTERNS = patterns(conv_bn_relu=2, conv_bn=1, linear_cross_entropy=1)
    # a conv bias right before a training-mode BatchNorm gets an exactly-zero gradient
    ZERO_GRAD = ["conv2.bias", "conv_s.bias"]

    def __init__(self, c1: int = 8, c2: int = 8) -> None:
        super().__init__()
        # c1/c2: stem and body channels (8/8 in the shipped sample; bigger for benchmarks)
        self.conv1 = nn.Conv2d(3, c1, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c2)
        self.conv_s = nn.Conv2d(c1, c2, 1)
        self.bn_s = nn.BatchNorm2d(c2)
        self.head = nn.Linear(c2, self.NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(h))) + self.bn_s(self.conv_s(h))
        y = F.max_pool2d(y, 2)
        y = y.mean(dim=(2, 3))
        return self.head(y)


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck: 1x1 reduce, 3x3 (stride here), 1x1 expand x4; BN after each conv,
    ReLU after the first two (conv_bn_relu x2) and after the residual add (conv3 + bn3 and the
    downsample Conv + BN: conv_bn)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return F.relu(h + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """ResNet-50 in plain torch (torchvision's layout: stem 7x7/2 conv + BN + ReLU + 3x3/2
    max-pool, stages of [3, 4, 6, 3] bottlenecks of width 64..512, global average pool, fc).
    Used at real size by the benchmark suite (64x64 input, batch 8), never shipped."""

    NUM_CLASSES = 1000
    # conv_bn: each bottleneck's conv3 + bn3 (16) and the first block of each stage's
    # downsample (4)
    PATTERNS = patterns(conv_bn_relu=1 + 2 * (3 + 4 + 6 + 3), conv_bn=(3 + 4 + 6 + 3) + 4)

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks, cin = [], 64
        for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(n):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, self.NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.blocks(x)
        return self.fc(x.mean(dim=(2, 3)))


# --- variants (other sizes, depths, masks, layouts, activations) ----------------------------
# Used by the variant samples (samples/manifest.yaml: *_v_*) and by the robustness checks that
# generate more of them into build/variants/. The classes above stay exactly as they are so the
# original samples reproduce byte-identically.


class ReluMLP(nn.Module):
    """Linear+ReLU MLP with odd widths: [B, 17] -> 33 -> 33 (bias-free) -> 5 (head, no act)."""

    def __init__(self, inp: int = 17, hid: int = 33, out: int = 5) -> None:
        super().__init__()
        self.IN, self.OUT = inp, out
        self.fc1 = nn.Linear(inp, hid)
        self.fc2 = nn.Linear(hid, hid)
        self.fc3 = nn.Linear(hid, hid, bias=False)
        self.head = nn.Linear(hid, out)
        self.PATTERNS = patterns(linear_relu=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        return self.head(x)


class GeluTanhMLP(nn.Module):
    """GPT-2 style MLP with tanh-approximated GELU, [B, S, D] -> [B, S, D]:
    Linear(D, 4D) + GELU(tanh) on the 3-D input (exported as Transpose + MatMul + Add), then a
    2-D view [B*S, 4D] -> Linear(4D, D) + GELU(tanh) (a 2-D Linear: Gemm in the TorchScript
    export) -> Linear(D, D) (no activation), reshaped back to [B, S, D]. Two linear_gelu."""

    def __init__(self, d: int = 8, seq: int = 4) -> None:
        super().__init__()
        self.D, self.SEQ = d, seq
        self.fc1 = nn.Linear(d, 4 * d)
        self.act1 = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(4 * d, d)
        self.act2 = nn.GELU(approximate="tanh")
        self.head = nn.Linear(d, d)
        self.PATTERNS = patterns(linear_gelu=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        h = self.act1(self.fc1(x)).reshape(-1, 4 * self.D)
        return self.head(self.act2(self.fc2(h))).reshape(b, s, self.D)


class AttnStack(nn.Module):
    """Attention-only residual layers (no LayerNorm, no MLP) on [B, S, D], one per entry of
    `kinds`, each x = x + o(softmax(scores) v) with separate q/k/v/o Linears and scores:
      "additive_div": (q @ k^T) / sqrt(dh) + additive float causal mask (-1e4 above the diagonal)
      "bool_div":     masked_fill((q @ k^T) / sqrt(dh), causal, -inf)
      "none_mulq":    (q * dh**-0.5) @ k^T, no mask
      "none_div":     (q @ k^T) / sqrt(dh), no mask
    One attention per layer; the key bias of every layer gets an exactly-zero gradient."""

    def __init__(self, kinds=("additive_div", "bool_div", "none_mulq"), d_model: int = 8,
                 n_heads: int = 2, seq: int = 4) -> None:
        super().__init__()
        self.kinds, self.D, self.SEQ = list(kinds), d_model, seq
        self.n_heads, self.dh = n_heads, d_model // n_heads
        self.q = nn.ModuleList(nn.Linear(d_model, d_model) for _ in kinds)
        self.k = nn.ModuleList(nn.Linear(d_model, d_model) for _ in kinds)
        self.v = nn.ModuleList(nn.Linear(d_model, d_model) for _ in kinds)
        self.o = nn.ModuleList(nn.Linear(d_model, d_model) for _ in kinds)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask_add", causal.float() * -1e4, persistent=False)
        self.register_buffer("mask_bool", causal, persistent=False)
        # every layer: flash_attention (nothing else reads P; the flash ops take additive
        # masks and masked_fill's bool mask alike)
        self.PATTERNS = patterns(flash_attention=len(self.kinds))
        self.ZERO_GRAD = [f"k.{i}.bias" for i in range(len(self.kinds))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, s, self.n_heads, self.dh).transpose(1, 2)

        for i, kind in enumerate(self.kinds):
            q, k, v = heads(self.q[i](x)), heads(self.k[i](x)), heads(self.v[i](x))
            if kind == "none_mulq":
                scores = torch.matmul(q * (self.dh ** -0.5), k.transpose(-2, -1))
            else:
                scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.dh)
            if kind == "additive_div":
                scores = scores + self.mask_add
            elif kind == "bool_div":
                scores = scores.masked_fill(self.mask_bool, float("-inf"))
            a = torch.matmul(torch.softmax(scores, dim=-1), v)
            x = x + self.o[i](a.transpose(1, 2).reshape(b, s, self.D))
        return x


class VLayer(nn.Module):
    """Pre-LN transformer layer with the variant knobs of VBlock."""

    def __init__(self, d_model: int, n_heads: int, seq: int, ff: int, mask: str, bias: bool,
                 act: str) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.dh = d_model, n_heads, d_model // n_heads
        self.mask_kind, self.act = mask, act
        self.ln1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model, bias=bias)
        self.k = nn.Linear(d_model, d_model, bias=bias)
        self.v = nn.Linear(d_model, d_model, bias=bias)
        self.o = nn.Linear(d_model, d_model, bias=bias)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ff, bias=bias)
        self.fc2 = nn.Linear(ff, d_model, bias=bias)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        if mask == "additive":
            self.register_buffer("mask", causal.float() * -1e4, persistent=False)
        elif mask == "bool":
            self.register_buffer("mask", causal, persistent=False)

    def _heads(self, t: torch.Tensor, b: int, s: int) -> torch.Tensor:
        return t.reshape(b, s, self.n_heads, self.dh).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        h = self.ln1(x)
        q = self._heads(self.q(h), b, s)
        k = self._heads(self.k(h), b, s)
        v = self._heads(self.v(h), b, s)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.dh)
        if self.mask_kind == "additive":
            scores = scores + self.mask
        elif self.mask_kind == "bool":
            scores = scores.masked_fill(self.mask, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        a = torch.matmul(p, v).transpose(1, 2).reshape(b, s, self.d_model)
        x = x + self.o(a)
        approx = "tanh" if self.act == "gelu_tanh" else "none"
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=approx))


class VBlock(nn.Module):
    """`depth` pre-LN layers; explicit attention softmax(q k^T / sqrt(dh) [+ mask]) v.

    mask: "none" | "additive" (float causal mask, -1e4 above the diagonal, added to the
    scores) | "bool" (masked_fill(causal, -inf)); bias: every Linear with/without bias;
    act: "gelu" (erf) | "gelu_tanh".
    """

    def __init__(self, d_model: int = 32, n_heads: int = 2, seq: int = 8, ff: int = 64,
                 depth: int = 1, mask: str = "none", bias: bool = True, act: str = "gelu") -> None:
        super().__init__()
        self.SEQ, self.D = seq, d_model
        self.layers = nn.ModuleList(VLayer(d_model, n_heads, seq, ff, mask, bias, act)
                                    for _ in range(depth))
        self.PATTERNS = patterns(linear_gelu=depth, sdpa=depth, layernorm=2 * depth)
        self.ZERO_GRAD = [f"layers.{i}.k.bias" for i in range(depth)] if bias else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class CNN3(nn.Module):
    """Input [B, 3, 12, 12] -> logits [B, 4]; three Conv+BN+ReLU blocks:
    stem Conv(3->8, 3x3, stride 2, pad 1) + BN + ReLU; depthwise Conv(8->8, 3x3, groups=8,
    pad 1) + BN + ReLU; pointwise Conv(8->16, 1x1, stride 2, no bias) + BN + ReLU;
    mean over H, W; Linear(16 -> 4)."""

    NUM_CLASSES = 4

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn2 = nn.BatchNorm2d(8)
        self.conv3 = nn.Conv2d(8, 16, 1, stride=2, bias=False)
        self.bn3 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, self.NUM_CLASSES)
        self.PATTERNS = patterns(conv_bn_relu=3)
        self.ZERO_GRAD = ["conv1.bias", "conv2.bias"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        return self.head(x.mean(dim=(2, 3)))


class RMSNorm(nn.Module):
    """Llama / Mistral / T5 RMSNorm: x * rsqrt(mean(x^2, -1) + eps), times a weight when
    `scale` (LlamaRMSNorm / T5LayerNorm); without a weight when not. `div`: written
    x / sqrt(mean(x^2) + eps) instead (another backward spelling)."""

    def __init__(self, d: int, eps: float = 1e-6, scale: bool = True, div: bool = False) -> None:
        super().__init__()
        self.eps, self.div = eps, div
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.pow(2).mean(-1, keepdim=True) + self.eps
        h = x / torch.sqrt(v) if self.div else x * torch.rsqrt(v)
        return self.weight * h if self.weight is not None else h


class LlamaStack(nn.Module):
    """Llama-style pre-norm residual layers [B, S=8, D=32] with RMSNorm: five layers
    x = x + W_l(rms_l(x)), then a final RMSNorm with weight. Six rmsnorm: the first over the
    model input (only its weight needs a gradient); with a residual gradient: rsqrt with and
    without weight, x / sqrt(...) with and without weight; the final one without."""

    def __init__(self, d: int = D_MODEL) -> None:
        super().__init__()
        norms = [RMSNorm(d), RMSNorm(d), RMSNorm(d, scale=False), RMSNorm(d, div=True),
                 RMSNorm(d, scale=False, div=True)]
        self.norms = nn.ModuleList(norms)
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in norms)
        self.norm = RMSNorm(d)
        self.PATTERNS = patterns(rmsnorm=len(norms) + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for n, lin in zip(self.norms, self.lins):
            x = x + lin(n(x))
        return self.norm(x)
