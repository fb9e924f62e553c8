"""RotaryEmbeddingGrad on the GPU: its launcher called by parameter name (fusecli/ops/gpu.py),
the output allocated with torch, the torch reference and its timing case for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import launch


def rotary_embedding_grad(dy, cos, sin, interleaved=0):
    """dX = dY cos + rot^T(dY sin); cos and sin (laid out alike) broadcast to dY."""
    import torch

    dx = torch.empty_like(dy)
    d = dy.shape[-1]
    cos_b = cos.contiguous().expand(dy.shape)
    launch("fusecli_launch_rotary_embedding_grad", dy=dy, cos=cos.contiguous(),
           sin=sin.contiguous(), dx=dx, rows=dy.numel() // d, d=d, dims=list(dy.shape),
           cs_strides=list(cos_b.stride()), rank=dy.dim(), interleaved=int(interleaved))
    return dx


def _rotate(t, interleaved):
    import torch

    if interleaved:
        out = torch.empty_like(t)
        out[..., 0::2], out[..., 1::2] = -t[..., 1::2], t[..., 0::2]
        return out
    h = t.shape[-1] // 2
    return torch.cat([-t[..., h:], t[..., :h]], dim=-1)


def ref_rope(dy, cos, sin, interleaved=0):
    """torch autograd through the forward X cos + rot(X) sin (float64)."""
    import torch

    x = torch.zeros(dy.shape, dtype=torch.float64, device=dy.device, requires_grad=True)
    y = x * cos.double() + _rotate(x, interleaved) * sin.double()
    (g,) = torch.autograd.grad(y, x, dy.double())
    return g


def bench(add, r):
    """Llama-style Q: [8, 32, 2048, 128], cos/sin [1, 1, 2048, 128] broadcast."""
    b, h, s, d = 8, 32, 2048, 128
    dy, cos, sin = r(b, h, s, d), r(1, 1, s, d), r(1, 1, s, d)
    add("RotaryEmbeddingGrad", [b, h, s, d], lambda: rotary_embedding_grad(dy, cos, sin),
        lambda: dy * cos + _rotate(dy * sin, 0) * -1.0, 2 * dy.numel() * 4, None)
