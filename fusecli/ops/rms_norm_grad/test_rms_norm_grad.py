"""RMSNormGrad: its kernels (fusecli/lib/libfusecli_ops.so) against the NumPy reference and
against the unfused subgraphs it replaces: the torch-joint standard-op chain in onnxruntime
and onnxruntime-training's SimplifiedLayerNormalizationGrad (+ residual Sum) in
onnxruntime-training 1.19.2, both with graph optimizations off."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from fusecli.ops.rms_norm_grad.reference import rms_norm_grad

# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import (F16, F32, OPSET, Builder, _built, _inplace_run, _rng, assert_close,
                            assert_requested, fused_model, ort_session, rand, run_fused,
                            run_in_ortt, tol)

EPS = 1e-6


def _rms_inputs(rng, shape, axis, dtype, stat_dtype=F32, with_dr=True, with_gamma=True,
                with_rms=True):
    ax = axis % len(shape)
    n = int(np.prod(shape[ax:]))
    x = rand(rng, shape, dtype, scale=2.0) + dtype(0.3)
    x64 = x.astype(np.float64).reshape(-1, n)
    inv_rms = 1 / np.sqrt((x64 * x64).mean(1) + EPS)
    stat_shape = (*shape[:ax], *([1] * (len(shape) - ax)))
    return dict(dY=rand(rng, shape, dtype), X=x,
                gamma=rand(rng, shape[ax:], dtype) if with_gamma else None,
                inv_rms=inv_rms.reshape(stat_shape).astype(stat_dtype) if with_rms else None,
                dR=rand(rng, shape, dtype) if with_dr else None)


def _ref(ins, axis=-1):
    return rms_norm_grad(ins["dY"], ins["X"], ins["gamma"], ins["inv_rms"], ins["dR"], axis, EPS)


SHAPES = [((1, 1), -1), ((3, 17), -1), ((2, 5, 33), -1), ((4, 3, 17), -2), ((1, 1023), 1),
          ((512, 768), -1)]
F16_TOL = dict(rtol=2e-2, atol_scale=2e-2)  # dGamma sums M rows: relative to its magnitude


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("with_dr,with_gamma,with_rms", [(True, True, True), (False, True, True),
                                                         (True, False, True), (False, True, False),
                                                         (True, False, False)])
@pytest.mark.parametrize("shape,axis", SHAPES)
def test_rms_norm_grad_vs_reference(dtype, with_dr, with_gamma, with_rms, shape, axis):
    """Every combination of the optional inputs: dR, gamma (absent: no scale) and inv_rms
    (absent: recomputed from X and epsilon)."""
    rng = _rng("rms", str(dtype), with_dr, with_gamma, with_rms, shape, axis)
    ins = _rms_inputs(rng, shape, axis, dtype, with_dr=with_dr, with_gamma=with_gamma,
                      with_rms=with_rms)
    got = run_fused("RMSNormGrad", list(ins.items()), [("dX", dtype), ("dGamma", dtype)],
                    axis=axis, epsilon=EPS)
    ref = _ref(ins, axis)
    for g, r, nm in zip(got, ref, ["dX", "dGamma"]):
        assert_close(g, r, **(tol(dtype) if dtype == F32 else F16_TOL), what=nm)


def test_rms_norm_grad_fp16_with_fp16_stats():
    rng = _rng("rms-f16-stats")
    ins = _rms_inputs(rng, (6, 40), -1, F16, stat_dtype=F16)
    got = run_fused("RMSNormGrad", list(ins.items()), [("dX", F16), ("dGamma", F16)])
    for g, r in zip(got, _ref(ins)):
        assert_close(g, r, **F16_TOL)


def test_rms_norm_grad_epsilon_default_and_attribute():
    """Without inv_rms the kernel uses its epsilon attribute (default 1e-5, the contract's)."""
    rng = _rng("rms-eps")
    ins = _rms_inputs(rng, (5, 8), -1, F32, with_rms=False)
    ins["X"] = (ins["X"] * F32(1e-3)).astype(F32)  # small rows: epsilon matters
    default = run_fused("RMSNormGrad", list(ins.items()), [("dX", F32), ("dGamma", F32)])
    big = run_fused("RMSNormGrad", list(ins.items()), [("dX", F32), ("dGamma", F32)], epsilon=0.5)
    args = (ins["dY"], ins["X"], ins["gamma"], None, ins["dR"], -1)
    for g, r in zip(default, rms_norm_grad(*args, epsilon=1e-5)):
        assert_close(g, r)
    for g, r in zip(big, rms_norm_grad(*args, epsilon=0.5)):
        assert_close(g, r)
    assert not np.allclose(default[0], big[0], rtol=1e-3)


@pytest.mark.parametrize("outs", [(1, 0), (0, 1)])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("with_rms", [True, False])
def test_rms_norm_grad_optional_outputs(outs, dtype, with_rms):
    rng = _rng("rms-opt", outs, str(dtype), with_rms)
    ins = _rms_inputs(rng, (5, 67), -1, dtype, with_dr=outs[0] == 1, with_rms=with_rms)
    req = [(nm, dtype) if o else None for nm, o in zip(["dX", "dGamma"], outs)]
    got = run_fused("RMSNormGrad", list(ins.items()), req, epsilon=EPS)
    assert_requested(outs, got, _ref(ins), ["dX", "dGamma"],
                     **(tol(dtype) if dtype == F32 else F16_TOL))


def _torch_joint_chain(b: Builder, ins, with_gamma=True, with_dr=True):
    """The torch-joint backward of x * rsqrt(mean(x^2) + eps) (* gamma), as torch 2.13 exports
    it (samples/torch_llama.onnx): forward Pow/ReduceMean/Add/Sqrt/Reciprocal for inv_rms,
    then Pow(r, 3) * -0.5 * ReduceSum(g X) / N * 2 Pow(X, 1) + g r (+ residual)."""
    dy, x = b.input("dY", ins["dY"]), b.input("X", ins["X"])
    last = b.ints([-1])
    r = b.op("Reciprocal", b.op("Sqrt", b.add(b.op("ReduceMean", b.op("Pow", x, b.const(2.0)),
                                                     last, keepdims=1), b.const(EPS))))
    xhat = b.mul(x, r)
    outs = []
    g = dy
    if with_gamma:
        gam = b.input("gamma", ins["gamma"])
        g = b.mul(dy, gam)
        rows = b.ints(list(range(ins["X"].ndim - 1)))
        sg = b.op("ReduceSum", b.mul(dy, xhat), rows, keepdims=1)
        outs.append(b.op("Reshape", sg, b.ints([ins["X"].shape[-1]])))
    s = b.op("ReduceSum", b.mul(g, x), last, keepdims=1)
    t = b.mul(b.mul(s, b.const(-0.5)), b.op("Pow", r, b.const(3.0)))
    te = b.op("Expand", t, b.ints(list(ins["X"].shape)))
    second = b.mul(b.op("Div", te, b.const(float(ins["X"].shape[-1]))),
                   b.mul(b.op("Pow", x, b.const(1.0)), b.const(2.0)))
    direct = b.mul(g, r)
    if with_dr:
        direct = b.add(b.input("dR", ins["dR"]), direct)
    return [b.add(direct, second)] + outs


@pytest.mark.parametrize("with_gamma,with_dr", [(True, True), (True, False), (False, True)])
def test_rms_norm_grad_vs_unfused_torch_joint(with_gamma, with_dr):
    rng = _rng("rms-unfused", with_gamma, with_dr)
    ins = _rms_inputs(rng, (3, 21, 96), -1, F32, with_dr=with_dr, with_gamma=with_gamma)
    b = Builder()
    ref = b.run(_torch_joint_chain(b, ins, with_gamma, with_dr))
    outs = [("dX", F32)] + ([("dGamma", F32)] if with_gamma else [])
    for with_rms in (True, False):  # the saved inv_rms, and recomputed from X and epsilon
        feed = dict(ins, inv_rms=ins["inv_rms"] if with_rms else None)
        got = run_fused("RMSNormGrad", list(feed.items()), outs, epsilon=EPS)
        for g, r, nm in zip(got, ref, ["dX", "dGamma"]):
            assert_close(g, r, what=f"{nm} (inv_rms {'saved' if with_rms else 'recomputed'})")


def _ortt_chain(ins, with_dr):
    """com.microsoft SimplifiedLayerNormalizationGrad (+ the residual Sum), onnxruntime-training."""
    names = ["dY", "X", "gamma", "inv_rms"]
    nodes = [helper.make_node("SimplifiedLayerNormalizationGrad", names,
                              ["dX0" if with_dr else "dX", "dGamma"], domain="com.microsoft",
                              axis=-1, epsilon=EPS)]
    if with_dr:
        names.append("dR")
        nodes.append(helper.make_node("Sum", ["dX0", "dR"], ["dX"]))
    g_in = [helper.make_tensor_value_info(k, 1, list(ins[k].shape)) for k in names]
    g_out = [helper.make_tensor_value_info(o, 1, None) for o in ["dX", "dGamma"]]
    return helper.make_model(helper.make_graph(nodes, "rms_ortt", g_in, g_out), ir_version=9,
                             opset_imports=[helper.make_opsetid("", OPSET),
                                            helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.ortt
def test_rms_norm_grad_vs_unfused_ortt_chain_and_same_so_in_ortt():
    """SimplifiedLayerNormalizationGrad (+ Sum) in onnxruntime-training 1.19.2 vs the fused op
    there (same .so) and here, float32, with and without the residual gradient."""
    jobs, here, cases = [], [], []
    for with_dr, shape in ((True, (2, 8, 32)), (False, (7, 130))):
        ins = _rms_inputs(_rng("rms-ortt", with_dr), shape, -1, F32, with_dr=with_dr)
        feeds = {k: v for k, v in ins.items() if v is not None}
        jobs.append(dict(model=_ortt_chain(ins, with_dr), feeds=feeds, outputs=["dX", "dGamma"]))
        fused = fused_model("RMSNormGrad", list(ins.items()), [("dX", F32), ("dGamma", F32)],
                            epsilon=EPS)
        jobs.append(dict(model=fused, feeds=feeds, outputs=["dX", "dGamma"], library=True,
                         count=["RMSNormGrad"]))
        here.append(ort_session(fused).run(["dX", "dGamma"], feeds))
        cases.append(ins)
    version, results, calls = run_in_ortt(jobs)
    assert version == "1.19.2"
    for i, (ins, h) in enumerate(zip(cases, here)):
        unfused, fused = results[2 * i], results[2 * i + 1]
        assert calls[2 * i + 1] == {"RMSNormGrad": 1}
        for nm, u, f, hh, r in zip(["dX", "dGamma"], unfused, fused, h, _ref(ins)):
            assert_close(u, r, what=f"case {i} {nm}: ort-training's own kernel vs reference")
            assert_close(f, u, what=f"case {i} {nm}: fused vs unfused")
            assert_close(f, hh, rtol=1e-5, atol_scale=1e-5, what=f"{nm}: same .so, two runtimes")


@pytest.mark.parametrize("with_dr,shape", [(True, (2, 8, 32)), (False, (7, 130))])
def test_rms_norm_grad_vs_unfused_standard_op_chain_on_the_ortt_cases(with_dr, shape):
    """The previous test's cases (its inputs, the saved inv_rms fed to the fused op) against the
    unfused standard-op chain in stock onnxruntime and the reference: `make test-arm64`'s check
    in place of onnxruntime-training's SimplifiedLayerNormalizationGrad (no ARM64 wheel)."""
    ins = _rms_inputs(_rng("rms-ortt", with_dr), shape, -1, F32, with_dr=with_dr)
    b = Builder()
    unfused = b.run(_torch_joint_chain(b, ins, True, with_dr))  # [dX, dGamma]
    got = run_fused("RMSNormGrad", list(ins.items()), [("dX", F32), ("dGamma", F32)], epsilon=EPS)
    for nm, u, g, r in zip(["dX", "dGamma"], unfused, got, _ref(ins)):
        assert_close(u, r, what=f"{nm}: unfused vs reference")
        assert_close(g, u, what=f"{nm}: fused vs unfused")
        assert_close(g, r, what=f"{nm}: fused vs reference")


@pytest.mark.parametrize("dead,expect", [({"dY"}, 1), ({"dR"}, 1), ((), 0)])
def test_rms_norm_grad_dx_in_place(dead, expect):
    """The pairs dY -> dX, then dR -> dX: dX lands in whichever of the two is dead after the
    node, and dGamma (which reads dY) stays right."""
    rng = _rng("rms-inplace", tuple(dead))
    ins = _rms_inputs(rng, (6, 33), -1, F32)
    live = {"dY", "dR"} - set(dead)
    got, calls, inplace = _inplace_run("RMSNormGrad", list(ins.items()), ["dX", "dGamma"],
                                       {"dY", "dR"}, live, elem=F32, epsilon=EPS)
    for g, r, nm in zip(got, _ref(ins), ["dX", "dGamma"]):
        assert_close(g, r, what=nm)
    assert (calls, inplace) == (1, expect)


@pytest.mark.parametrize("n", [2048, 2049])
def test_rms_norm_grad_large_rows_stream_stores(n):
    """dX over 16 MiB takes the non-temporal store path (aligned rows at n = 2048; mostly
    unaligned rows at n = 2049 fall back to plain stores)."""
    rng = _rng("rms-large", n)
    ins = _rms_inputs(rng, (2050, n), -1, F32, with_dr=True)
    got = run_fused("RMSNormGrad", list(ins.items()), [("dX", F32), ("dGamma", F32)], epsilon=EPS)
    for g, r, nm in zip(got, _ref(ins), ["dX", "dGamma"]):
        assert_close(g, r, what=nm)
