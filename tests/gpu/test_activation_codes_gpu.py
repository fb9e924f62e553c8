"""Every CUDA launcher that takes an activation code (`int act` in its contract's args) accepts
every activation ops/domain.yaml declares and computes it as the torch reference does, so the
next activation added to the domain cannot be forgotten in a launcher: the list of activations
and the list of such launchers are both derived from the contracts, and a launcher with an
`int act` parameter that this file does not know how to call fails the coverage test.
GPU machine only (tests/gpu/run_gpu_checks.sh); skipped elsewhere."""

from __future__ import annotations

import pytest

from gpu_helpers import _seed, close, rand, torch_or_skip

torch = torch_or_skip()  # skips this module where torch.cuda is unavailable
pytestmark = pytest.mark.gpu

from fusecli.ops.activation_grad.gpu import activation_grad  # noqa: E402
from fusecli.ops.contracts import load_contracts  # noqa: E402
from fusecli.ops.conv_bn_relu_grad.gpu import conv_bn_relu_grad, ref_conv  # noqa: E402
from fusecli.ops.gated_activation_grad.gpu import gated_activation_grad, ref_gated  # noqa: E402
from fusecli.ops.gpu import ACT, ref_act_grad  # noqa: E402
from fusecli.ops.linear_activation_grad.gpu import linear_activation_grad, ref_linear  # noqa: E402
from fusecli.ops.lora_linear_grad.gpu import lora_linear_grad, ref_lora  # noqa: E402


def _act_launchers() -> dict[str, object]:
    """launcher name -> its op contract, for every launcher with an `int act` parameter."""
    return {ln.name: c for c in load_contracts().ops.values() for ln in c.launchers
            if ("int", "act") in ln.params()}


TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _act_grad(act, dtype):
    dy, x = rand(7, 129, dtype=dtype), rand(7, 129, dtype=dtype, scale=4.0)
    close(activation_grad(dy, x, act), ref_act_grad(dy.double(), x.double(), act), TOL[dtype],
          act)


def _linear(act, dtype):
    dy, x = rand(37, 65, dtype=dtype), rand(37, 65, dtype=dtype, scale=4.0)
    a, w = rand(37, 24, dtype=dtype), rand(65, 24, dtype=dtype, scale=0.3)
    got = linear_activation_grad(dy, x, a, w, act, 0, dz="out")
    ref = ref_linear(dy.double(), x.double(), a.double(), w.double(), act, 0)
    tol = 5e-4 if dtype == torch.float32 else TOL[dtype]
    for g, r, nm in zip(got, ref, "dA dW dB".split()):
        close(g, r, tol, f"{act} {nm}")
    close(got[3], ref_act_grad(dy.double(), x.double(), act), TOL[dtype], f"{act} dZ")


def _lora(act, dtype):
    m, n, k, r = 33, 17, 65, 4
    dy, x = rand(m, n, dtype=dtype), rand(m, n, dtype=dtype, scale=4.0)
    a, w = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype)
    la, lb = rand(r, k, dtype=dtype), rand(n, r, dtype=dtype)
    h = a @ la.t()
    got = lora_linear_grad(dy, x, a, w, la, lb, h, None, act, 2.0, 0, 0)
    ref = ref_lora(*(t.double() for t in (dy, x, a, w, la, lb, h)), None, act, 2.0, 0, 0)
    for g, r_, nm in zip(got, ref, "dX dXa dLa dLb dW dB".split()):
        close(g, r_, 5e-4 if dtype == torch.float32 else TOL[dtype], f"{act} {nm}")


def _conv(act, _dtype):
    x, w = rand(2, 3, 7, 9), rand(4, 3, 3, 3, scale=0.5)
    cv = rand(2, 4, 4, 5, scale=1.5) + 0.2
    mean, inv_std = cv.mean((0, 2, 3)), 1 / torch.sqrt(cv.var((0, 2, 3), unbiased=False) + 1e-5)
    ins = (rand(2, 4, 4, 5), rand(2, 4, 4, 5, scale=4.0), x, w, cv, rand(4).abs() + 0.5, mean,
           inv_std)
    geo = ((2, 2), (1, 1, 1, 1), (1, 1), 1)
    got = conv_bn_relu_grad(*ins, *geo, act)
    ref = ref_conv(*(t.double() for t in ins), *geo, act)
    for g, r, nm in zip(got, ref, "dX dW dBc dGamma dBeta".split()):
        close(g, r, 1e-3, f"{act} {nm}")


def _gated(act, dtype):
    dh, a, b = rand(5, 33, dtype=dtype), rand(5, 33, dtype=dtype, scale=3.0), \
        rand(5, 33, dtype=dtype)
    got = gated_activation_grad(dh, a, b, act)
    ref = ref_gated(dh.double(), a.double(), b.double(), act)
    for g, r, nm in zip(got, ref, ("dA", "dB")):
        close(g, r, TOL[dtype], f"{act} {nm}")


# launcher family -> (how to call it for one activation and element type, which activations):
# "domain" = every activation of domain.yaml; "contract" = those its op's contract lists (a
# gated activation's forward is part of its math: its launcher takes the gated ones only).
# A family's launchers are NAME (float32), NAME_f16 (float16) and NAME_bf16 (bfloat16); the
# op's gpu.py wrapper picks the launcher from the tensors' dtype.
CALLS = {
    "fusecli_launch_activation_grad": (_act_grad, "domain"),
    "fusecli_launch_linear_activation_grad": (_linear, "domain"),
    "fusecli_launch_lora_linear_grad": (_lora, "domain"),
    "fusecli_launch_conv_bn_relu_grad": (_conv, "domain"),
    "fusecli_launch_gated_activation_grad": (_gated, "contract"),
}
SUFFIX_DTYPE = {"_bf16": "bfloat16", "_f16": "float16", "": "float32"}


def _family(name: str) -> tuple[str, str]:
    """(family, dtype name) of a launcher name."""
    for suffix, dtype in SUFFIX_DTYPE.items():
        if suffix and name.endswith(suffix):
            return name[: -len(suffix)], dtype
    return name, "float32"


def test_every_launcher_with_an_activation_is_covered():
    families = {_family(n)[0] for n in _act_launchers()}
    missing = sorted(families - set(CALLS))
    stale = sorted(set(CALLS) - families)
    assert not missing, f"launchers with `int act` this test does not call: {missing}: add them"
    assert not stale, f"CALLS names launchers the contracts no longer declare: {stale}"


def _cases():
    for name, contract in _act_launchers().items():
        family, dtype = _family(name)
        if family not in CALLS:
            continue
        fn, which = CALLS[family]
        if which == "domain":
            acts = list(ACT)
        else:
            acts = list(contract.attributes["activation"]["values"])
        for act in acts:
            yield pytest.param(fn, act, dtype, id=f"{name.removeprefix('fusecli_launch_')}-{act}")


@pytest.mark.parametrize("fn,act,dtype", list(_cases()))
def test_launcher_takes_every_activation(fn, act, dtype):
    fn(act, getattr(torch, dtype))


def test_an_unknown_activation_code_is_refused():
    dy = rand(4, 8)
    from fusecli.ops.gpu import launch

    with pytest.raises(RuntimeError, match="cudaError 1$"):
        launch("fusecli_launch_activation_grad", dy=dy, x=dy, dx=torch.empty_like(dy),
               n=dy.numel(), act=len(ACT), alpha=1.0)
