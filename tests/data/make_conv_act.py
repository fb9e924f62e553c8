"""Regenerates tests/data/ortt_conv_*.onnx: MobileNet-style Conv -> BatchNorm -> activation
blocks at tiny size, written by hand after torchvision's MobileNetV2 (InvertedResidual: 1x1
expand, 3x3 depthwise, 1x1 linear projection, residual), EfficientNet's MBConv (SiLU) and
MobileNetV3 (Hardswish, a squeeze-excitation gated by Hardsigmoid), plus look-alikes that are no
pattern. onnxruntime-training 1.19.2 has no gradient for the HardSwish / HardSigmoid ops, so
Hardswish and Hardsigmoid are written out as MobileNetV3 ports write them
(`x * F.relu6(x + 3) / 6`, timm's `x * (F.relu6(x + 3) / 6)`, `F.relu6(x + 3) / 6`).

Through the corpus exporter (scripts/corpus/gen.py: torch.onnx.export + generate_artifacts,
checked against torch autograd). Needs torch 2.13 + onnxruntime-training-cpu 1.19.2 + onnx
1.16.2 (build/venv-gen-ortt of scripts/make_samples.sh, or build/venv-corpus-ortt):
build/venv-gen-ortt/bin/python tests/data/make_conv_act.py

The expected counts (printed, and written to tests/data/conv_act_expected.json) are counted
from the model code: each ConvBNAct module is one chain, whatever is frozen (its backward is in
the graph as long as a gradient flows through it): of its activation's pattern, or conv_bn when
it has no activation or a look-alike one (the Conv + BN backward fuses without the activation
gradient, which stays in front of the fused op).
"""

from __future__ import annotations

import json
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
from archs import PATTERN_KEYS  # noqa: E402


class HSwish(nn.Module):  # MobileNetV3 ports: x * relu6(x + 3) / 6
    PATTERN = "conv_bn_hardswish"

    def forward(self, x):
        return x * F.relu6(x + 3.0) / 6.0


class HSwishDiv(nn.Module):  # timm's hard_swish: x * (relu6(x + 3) / 6)
    PATTERN = "conv_bn_hardswish"

    def forward(self, x):
        return x * (F.relu6(x + 3.0) / 6.0)


class HSigmoid(nn.Module):
    def forward(self, x):
        return F.relu6(x + 3.0) / 6.0


# look-alikes: no activation pattern (PATTERN None: the Conv + BN part is a conv_bn)
class Clip04(nn.Module):  # a Clip that is not 0..6
    PATTERN = None

    def forward(self, x):
        return torch.clamp(x, 0.0, 4.0)


class ClipM16(nn.Module):  # Clip(-1, 6): the lower bound differs
    PATTERN = None

    def forward(self, x):
        return torch.clamp(x, -1.0, 6.0)


class QuickGELU(nn.Module):  # x * sigmoid(1.702 x): QuickGelu{alpha=1.702}, not SiLU
    PATTERN = None

    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class HSwishShift2(nn.Module):  # x * relu6(x + 2) / 6: not hardswish
    PATTERN = None

    def forward(self, x):
        return x * F.relu6(x + 2.0) / 6.0


class HSwishDiv5(nn.Module):  # x * relu6(x + 3) / 5: not hardswish
    PATTERN = None

    def forward(self, x):
        return x * F.relu6(x + 3.0) / 5.0


PATTERN_OF = {nn.ReLU: "conv_bn_relu", nn.ReLU6: "conv_bn_relu6", nn.SiLU: "conv_bn_silu"}


class ConvBNAct(nn.Sequential):
    """Conv -> BatchNorm -> activation (None: a linear bottleneck / shortcut, no pattern)."""

    def __init__(self, cin, cout, k=3, s=1, groups=1, act=None, bias=False):
        layers = [nn.Conv2d(cin, cout, k, s, (k - 1) // 2, groups=groups, bias=bias),
                  nn.BatchNorm2d(cout)]
        super().__init__(*layers, *([act] if act is not None else []))
        # (a plain attribute, not the module: a Sequential runs every registered child)
        self.pattern = "conv_bn" if act is None else (
            PATTERN_OF.get(type(act), getattr(act, "PATTERN", None)) or "conv_bn")


class InvertedResidual(nn.Module):
    """MobileNetV2's block (torchvision layout): [1x1 expand] -> 3x3 depthwise -> 1x1 linear
    projection (Conv+BN, no activation) [+ x]."""

    def __init__(self, cin, cout, stride, t, act=nn.ReLU6):
        super().__init__()
        hid = cin * t
        layers = [ConvBNAct(cin, hid, 1, act=act())] if t != 1 else []
        layers += [ConvBNAct(hid, hid, 3, stride, groups=hid, act=act()),
                   ConvBNAct(hid, cout, 1)]
        self.conv = nn.Sequential(*layers)
        self.res = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.res else self.conv(x)


class SqueezeExcite(nn.Module):
    """MobileNetV3's SE: x * hsigmoid(fc2(relu(fc1(mean(x))))) (1x1 convs with bias, no BN)."""

    def __init__(self, c, r):
        super().__init__()
        self.fc1, self.fc2, self.gate = nn.Conv2d(c, r, 1), nn.Conv2d(r, c, 1), HSigmoid()

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * self.gate(self.fc2(F.relu(self.fc1(s))))


class V3Block(nn.Module):
    """MobileNetV3's block: 1x1 expand (hswish) -> depthwise (hswish) -> SE -> projection."""

    def __init__(self, cin, hid, cout, act):
        super().__init__()
        self.expand = ConvBNAct(cin, hid, 1, act=act())
        self.dw = ConvBNAct(hid, hid, 3, 1, groups=hid, act=act())
        self.se = SqueezeExcite(hid, 4)
        self.project = ConvBNAct(hid, cout, 1)

    def forward(self, x):
        return x + self.project(self.se(self.dw(self.expand(x))))


class Net(nn.Module):
    def __init__(self, features, c_out):
        super().__init__()
        self.features = nn.Sequential(*features)
        self.fc = nn.Linear(c_out, 4)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def mbv2():
    """stem 3x3 s2 + ReLU6 (first layer: no dX); t=1 block (dw + projection, residual); t=4
    stride-2 block; t=4 residual block; 1x1 head conv WITH bias + ReLU6."""
    return Net([ConvBNAct(3, 8, 3, 2, act=nn.ReLU6()), InvertedResidual(8, 8, 1, 1),
                InvertedResidual(8, 12, 2, 4), InvertedResidual(12, 12, 1, 4),
                ConvBNAct(12, 16, 1, act=nn.ReLU6(), bias=True)], 16)


def mbv2_frozen():
    """mbv2 fine-tuned with parts frozen: the t=4 stride-2 block's expand conv weight and its
    depthwise BN affine, the residual block's projection conv and every BN affine of the head;
    the stem trains (so every chain's backward is in the graph)."""
    net = mbv2()
    f = net.features
    f[2].conv[0][0].weight.requires_grad_(False)     # expand conv W frozen: no dW
    f[2].conv[1][1].requires_grad_(False)            # depthwise BN affine frozen
    f[3].conv[1][0].weight.requires_grad_(False)     # depthwise conv W frozen
    f[3].conv[1][1].requires_grad_(False)            # ... and its BN affine: dX only
    f[4][0].requires_grad_(False)                    # head conv W and bias frozen
    f[4][1].requires_grad_(False)
    return net


def effnet_silu():
    """EfficientNet-style: stem + SiLU, MBConv (expand, depthwise, projection) with SiLU, a
    grouped 3x3 conv (4 groups) + SiLU, 1x1 head with bias + SiLU."""
    return Net([ConvBNAct(3, 8, 3, 2, act=nn.SiLU()), InvertedResidual(8, 8, 1, 2, nn.SiLU),
                ConvBNAct(8, 16, 3, 1, groups=4, act=nn.SiLU()),
                ConvBNAct(16, 16, 1, act=nn.SiLU(), bias=True)], 16)


def mbv3_hswish():
    """MobileNetV3-style: stem + hardswish (x relu6(x+3)/6), a block with timm's spelling
    (expand, depthwise, Hardsigmoid SE, projection), 1x1 head + hardswish."""
    return Net([ConvBNAct(3, 8, 3, 2, act=HSwish()), V3Block(8, 16, 8, HSwishDiv),
                ConvBNAct(8, 16, 1, act=HSwish())], 16)


def negatives():
    """Conv+BN followed by look-alikes (Clip 0..4, Clip -1..6, QuickGELU, relu6(x+2)/6,
    relu6(x+3)/5), a Conv+BN without activation, and a Hardsigmoid-gated SE: no activation
    gradient is absorbed (each Conv+BN fuses as conv_bn, the SE not at all)."""
    return Net([ConvBNAct(3, 8, 3, 1, act=Clip04()), ConvBNAct(8, 8, 3, 1, act=ClipM16()),
                ConvBNAct(8, 8, 3, 1, groups=8, act=QuickGELU()),
                ConvBNAct(8, 8, 1, act=HSwishShift2()), ConvBNAct(8, 8, 1, act=HSwishDiv5()),
                ConvBNAct(8, 8, 1), SqueezeExcite(8, 4), ConvBNAct(8, 8, 1, act=Clip04())], 8)


GRAPHS = {"ortt_conv_mbv2": mbv2, "ortt_conv_mbv2_frozen": mbv2_frozen,
          "ortt_conv_effnet_silu": effnet_silu, "ortt_conv_mbv3_hswish": mbv3_hswish,
          "ortt_conv_negatives": negatives}
# the ConvBnReluGrad patterns, from the contracts (archs reads the canonical list)
PATTERNS = [p for p in PATTERN_KEYS if p.startswith("conv_bn")]


def expected(model: nn.Module) -> dict[str, int]:
    counts = dict.fromkeys(PATTERNS, 0)
    for m in model.modules():
        if isinstance(m, ConvBNAct):
            counts[m.pattern] += 1
    return counts


def main(names) -> None:
    arch = types.SimpleNamespace(library="torch", input_ranges={})
    out = {}
    for name in names or GRAPHS:
        torch.manual_seed(0)
        model = GRAPHS[name]().train()
        inputs = {"x": torch.randn(2, 3, 12, 12)}
        with tempfile.TemporaryDirectory() as td:
            res = gen.build_ortt(arch, model, inputs, name, Path(td), True)
            shutil.copy(Path(td) / f"{name}.onnx", HERE / f"{name}.onnx")
        out[name] = expected(model)
        print(f"{name}: {len(res['model'].graph.node)} nodes, max |grad - torch| = "
              f"{res['max_abs_grad_err_vs_torch']:.3g}, expected {out[name]}")
        assert res["max_abs_grad_err_vs_torch"] < 1e-4, name
    path = HERE / "conv_act_expected.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **out}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
