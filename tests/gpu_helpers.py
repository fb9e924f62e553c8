"""Shared by the op folders' GPU tests (fusecli/ops/<op>/test_<op>_gpu.py): the CUDA check that
skips them where torch.cuda is unavailable, comparisons against the torch references and
random inputs on the device. Run them with tests/gpu/run_gpu_checks.sh on a GPU machine."""

from __future__ import annotations

import pytest

SKIP_REASON = ("torch.cuda is unavailable (GPU machine only: tests/gpu/run_gpu_checks.sh runs "
               "fusecli/ops/*/test_*_gpu.py)")


def cuda_available() -> bool:
    try:
        import torch
    except Exception:  # torch not installed: no CUDA either
        return False
    return bool(torch.cuda.is_available())


def torch_or_skip():
    """torch, or skip the calling test module (one skip for the module, not one per case)."""
    if not cuda_available():
        pytest.skip(SKIP_REASON, allow_module_level=True)
    import torch

    return torch


def close(got, ref, tol=2e-4, what=""):
    import torch

    ref = ref.to(got.dtype)
    scale = max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def check_requested(want, got, ref, tol=2e-4):
    """Each requested output matches its reference; each omitted one came back as None."""
    for wnt, g, r in zip(want, got, ref):
        assert (g is None) == (not wnt)
        if wnt:
            close(g, r, tol)


def rand(*shape, dtype=None, scale=1.0, gen=None):
    """Device normals (float64 drawn, |x| >= 1e-3), as `dtype` (float32 by default)."""
    import torch

    t = torch.randn(*shape, device="cuda", dtype=torch.float64, generator=gen) * scale
    t = torch.where(t.abs() < 1e-3, torch.full_like(t, 1e-3), t)
    return t.to(dtype or torch.float32)


@pytest.fixture(autouse=True)
def _seed():
    """Every GPU test starts from the same torch seed (a test module imports this fixture)."""
    import torch

    torch.manual_seed(1234)


# Tolerances of a launcher's output against float64 torch, by element type: float32 math with
# the output rounded once to the type (half an ulp: 2^-11 float16, 2^-8 bfloat16), with margin.
TOL = {"float32": 2e-4, "float16": 1e-3, "bfloat16": 1e-2}


def tol_of(dtype) -> float:
    """TOL for a torch dtype or its name."""
    return TOL[str(dtype).removeprefix("torch.")]


@pytest.fixture(params=["scalar", "vec"])
def memk_path(request, monkeypatch):
    """Runs a test on both memory-bound kernel paths: the scalar kernels (the default) and the
    vectorised ones (FUSECLI_MEMK_PATH=vec, opt-in until measured on a GPU; read at launch)."""
    if request.param == "vec":
        monkeypatch.setenv("FUSECLI_MEMK_PATH", "vec")
    else:
        monkeypatch.delenv("FUSECLI_MEMK_PATH", raising=False)
    return request.param
