"""LinearActivationGrad's CUDA launcher (through fusecli/ops/gpu.py, torch device pointers)
against torch on random data. GPU machine only (tests/gpu/run_gpu_checks.sh); skipped
elsewhere."""

from __future__ import annotations

import itertools

import pytest

from gpu_helpers import _seed, check_requested, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.gpu import ACT, quick_gelu_grad, ref_act_grad  # noqa: E402
from fusecli.ops.linear_activation_grad.gpu import (linear_activation_grad,  # noqa: E402
                                                    ref_linear)

ACTS = [a for a in ACT if a != "identity"]


@pytest.mark.parametrize("trans_w", [0, 1])
@pytest.mark.parametrize("dz", [None, "inplace"])
def test_linear_activation_grad_quick_gelu(trans_w, dz):
    dy, x, a = rand(2, 37, 65), rand(2, 37, 65, scale=4.0), rand(2, 37, 24)
    w = rand(*((24, 65) if trans_w else (65, 24)), scale=0.3)
    got = linear_activation_grad(dy, x, a, w, "silu", trans_w, dz=dz, alpha=1.702)
    dz_ref = quick_gelu_grad(dy.double(), x.double(), 1.702)
    ref = ref_linear(dz_ref, x.double(), a.double(), w.double(), "identity", trans_w)
    for g, r, nm in zip(got, ref, "dA dW dB".split()):
        close(g, r, 5e-4, nm)
    if dz:
        close(got[3], dz_ref, 2e-4, "dZ")


@pytest.mark.parametrize("act", ACTS + ["identity"])
@pytest.mark.parametrize("trans_w", [0, 1])
@pytest.mark.parametrize("lead,n,k", [((1,), 1, 1), ((3,), 17, 5), ((2, 3), 17, 33),
                                      ((512,), 257, 384)])
def test_linear_activation_grad(act, trans_w, lead, n, k):
    dy, x, a = rand(*lead, n), rand(*lead, n, scale=2.0), rand(*lead, k)
    w = rand(*((k, n) if trans_w else (n, k)), scale=0.3)
    got = linear_activation_grad(dy, x, a, w, act, trans_w)
    ref = ref_linear(dy.double(), x.double(), a.double(), w.double(), act, trans_w)
    for g, r, nm in zip(got, ref, "dA dW dB".split()):
        close(g, r, 5e-4, nm)


@pytest.mark.parametrize("act", ["gelu", "identity"])
@pytest.mark.parametrize("dz", ["out", "inplace"])
def test_linear_activation_grad_dz_output(act, dz):
    """Output 3 (dZ), separate or in dY's own buffer as onnxruntime's in-place plan may place it."""
    dy, x, a, w = rand(33, 19), rand(33, 19, scale=2.0), rand(33, 11), rand(19, 11)
    got = linear_activation_grad(dy, x, a, w, act, 0, dz=dz)
    ref = ref_linear(dy.double(), x.double(), a.double(), w.double(), act, 0)
    for g, r, nm in zip(got, ref, "dA dW dB".split()):
        close(g, r, 5e-4, nm)
    close(got[3], ref_act_grad(dy.double(), x.double(), act), 2e-4, "dZ")


@pytest.mark.parametrize("want", [m for m in itertools.product([0, 1], repeat=3) if any(m)])
def test_linear_activation_grad_optional(want):
    dy, x, a, w = rand(9, 19), rand(9, 19), rand(9, 11), rand(19, 11)
    got = linear_activation_grad(dy, x, a, w, "gelu", 0, want)
    ref = ref_linear(dy.double(), x.double(), a.double(), w.double(), "gelu", 0)
    check_requested(want, got, ref)
