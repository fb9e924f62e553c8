"""ConvBnReluGrad on the GPU: its launcher called by parameter name (fusecli/ops/gpu.py), the
outputs allocated with torch, the unfused torch reference and its timing case for
tests/gpu/bench_cuda.py."""

from __future__ import annotations

from fusecli.ops.gpu import ACT, launch, ref_act_grad, workspace


def conv_bn_relu_grad(dy, y, x, w, cv, gamma, mean, inv_std, strides=(1, 1), pads=(0, 0, 0, 0),
                      dilations=(1, 1), group=1, activation="relu", want=(1, 1, 1, 1, 1), dc=None):
    """dc: None, "out" (a separate dC output) or "inplace" (dC written over a copy of dY, as
    onnxruntime's in-place plan does); with dc the result has a 6th item."""
    import torch

    c = dy.shape[1]
    shapes = [x.shape, w.shape, (c,), (c,), (c,)]
    outs = [torch.empty(s, device=dy.device, dtype=dy.dtype) if w_ else None
            for s, w_ in zip(shapes, want)]
    dy, dc_t = workspace(dy, dc)
    launch("fusecli_launch_conv_bn_relu_grad", dy=dy, y=y, x=x, w=w, cv=cv, gamma=gamma,
           mean=mean, inv_std=inv_std, dx=outs[0], dw=outs[1], dbc=outs[2], dgamma=outs[3],
           dbeta=outs[4], dc=dc_t, n=dy.shape[0], c=c, h=dy.shape[2], wd=dy.shape[3],
           cin=x.shape[1], hin=x.shape[2], win=x.shape[3], kh=w.shape[2], kw=w.shape[3],
           stride_h=strides[0], stride_w=strides[1], pad_t=pads[0], pad_l=pads[1],
           pad_b=pads[2], pad_r=pads[3], dil_h=dilations[0], dil_w=dilations[1], group=group,
           act=ACT[activation])
    return outs if dc is None else outs + [dc_t]


def ref_conv(dy, y, x, w, cv, gamma, mean, inv_std, strides, pads, dilations, group,
             activation="relu"):
    import torch

    d = ref_act_grad(dy, y, activation)  # every activation of domain.yaml (relu: Y's sign)
    sh = (1, -1, 1, 1)
    xhat = (cv - mean.view(sh)) * inv_std.view(sh)
    r = cv.shape[0] * cv.shape[2] * cv.shape[3]
    dbeta = d.sum((0, 2, 3))
    dgamma = (d * xhat).sum((0, 2, 3))
    dc = (gamma * inv_std / r).view(sh) * (r * d - dbeta.view(sh) - xhat * dgamma.view(sh))
    # asymmetric pads: pad X explicitly, then a symmetric-free conv
    pt, pl, pb, pr = pads
    xp = torch.nn.functional.pad(x, (pl, pr, pt, pb))
    dxp = torch.nn.grad.conv2d_input(xp.shape, w, dc, stride=strides, dilation=dilations,
                                     groups=group)
    dx = dxp[:, :, pt:pt + x.shape[2], pl:pl + x.shape[3]]
    dw = torch.nn.grad.conv2d_weight(xp, w.shape, dc, stride=strides, dilation=dilations,
                                     groups=group)
    return dx, dw, dc.sum((0, 2, 3)), dgamma, dbeta, dc


def bench(add, r):
    """N=32, 64->64 channels, 56x56, 3x3 pad 1."""
    import torch

    nb, cin, c, hw = 32, 64, 64, 56
    x = r(nb, cin, hw, hw)
    w = r(c, cin, 3, 3) * 0.1
    cv = r(nb, c, hw, hw)
    mean, istd = cv.mean((0, 2, 3)), 1 / torch.sqrt(cv.var((0, 2, 3)) + 1e-5)
    gamma, y, dy = r(c).abs() + 0.5, torch.relu(r(nb, c, hw, hw)), r(nb, c, hw, hw)
    args = (dy, y, x, w, cv, gamma, mean, istd)
    add("ConvBnReluGrad", [nb, cin, c, hw, hw, 3, 3],
        lambda: conv_bn_relu_grad(*args, (1, 1), (1, 1, 1, 1)),
        lambda: ref_conv(*args, (1, 1), (1, 1, 1, 1), (1, 1), 1, "relu"),
        flops=2 * 2 * nb * c * hw * hw * cin * 9,
        tf32=lambda: ref_conv(*args, (1, 1), (1, 1, 1, 1), (1, 1), 1, "relu"))
