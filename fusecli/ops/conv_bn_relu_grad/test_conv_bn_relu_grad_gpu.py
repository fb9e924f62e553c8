"""ConvBnReluGrad's CUDA launchers (through fusecli/ops/gpu.py, torch device pointers) against torch on
random data. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, check_requested, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu
from fusecli.ops.conv_bn_relu_grad.gpu import conv_bn_relu_grad, ref_conv  # noqa: E402
from fusecli.ops.gpu import ACT  # noqa: E402

CONV = [
    (1, 1, 1, 1, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),
    (2, 3, 7, 9, 4, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 1),
    (3, 4, 11, 10, 6, 3, 2, (2, 1), (1, 0, 2, 1), (2, 1), 2),
    (2, 6, 9, 9, 6, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 6),
    (2, 8, 8, 8, 16, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1), 1),
    (8, 32, 28, 28, 64, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1),
]


def _conv_inputs(n, cin, hin, win, c, kh, kw, strides, pads, dil, group):
    x = rand(n, cin, hin, win)
    w = rand(c, cin // group, kh, kw, scale=0.5)
    h = (hin + pads[0] + pads[2] - dil[0] * (kh - 1) - 1) // strides[0] + 1
    wd = (win + pads[1] + pads[3] - dil[1] * (kw - 1) - 1) // strides[1] + 1
    cv = rand(n, c, h, wd, scale=1.5) + 0.2
    mean = cv.mean((0, 2, 3))
    inv_std = 1 / torch.sqrt(cv.var((0, 2, 3), unbiased=False) + 1e-5)
    gamma = rand(c).abs() + 0.5
    y = rand(n, c, h, wd, scale=4.0)  # the activation's input: spans relu6's and hardswish's bounds
    return rand(n, c, h, wd), y, x, w, cv, gamma, mean, inv_std


@pytest.mark.parametrize("activation", list(ACT))  # every activation of domain.yaml
@pytest.mark.parametrize("case", CONV)
def test_conv_bn_relu_grad(case, activation):
    *dims, strides, pads, dil, group = case
    ins = _conv_inputs(*dims, strides, pads, dil, group)
    got = conv_bn_relu_grad(*ins, strides, pads, dil, group, activation)
    ref = ref_conv(*(t.double() for t in ins), strides, pads, dil, group, activation)
    for g, r, nm in zip(got, ref, "dX dW dBc dGamma dBeta".split()):
        close(g, r, 1e-3, nm)


@pytest.mark.parametrize("dc", [None, "out", "inplace"])
@pytest.mark.parametrize("want", [(1, 1, 1, 1, 1), (0, 1, 1, 1, 1), (1, 1, 0, 1, 1),
                                  (0, 0, 0, 1, 1), (1, 0, 0, 0, 0), (0, 0, 0, 0, 0)])
def test_conv_bn_relu_grad_optional(want, dc):
    """Any subset of outputs, plus output 5 (dC) separate or in dY's own buffer as
    onnxruntime's in-place plan may place it."""
    *dims, strides, pads, dil, group = CONV[1]
    ins = _conv_inputs(*dims, strides, pads, dil, group)
    got = conv_bn_relu_grad(*ins, strides, pads, dil, group, "relu", want, dc=dc)
    ref = ref_conv(*(t.double() for t in ins), strides, pads, dil, group, "relu")
    check_requested(list(want) + ([1] if dc else []), got, ref, 1e-3)
