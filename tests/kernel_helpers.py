"""Helpers for the custom-op kernel tests: tiny one-node fused models, standard-op (unfused)
subgraph builders, onnxruntime sessions with fusecli's library, an onnxruntime-training
subprocess runner, and the check that a fused model computes what its original does."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
import zlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import pytest

from fusecli.runtime import library
from fusecli.ops.contracts import infer_output_types
from fusecli.runtime.library import library_path, session_options

REPO = Path(__file__).resolve().parents[1]
DOMAIN = "com.fusecli"
OPSET = 18
ACTS = ["relu", "gelu", "gelu_tanh", "silu"]
F32, F16 = np.float32, np.float16

@pytest.fixture(autouse=True, scope="module")
def _built():
    library.library_path()  # fails clearly when the library is not built

def assert_verifies(tmp_path, original, fused):
    """`fusecli verify` of the fused model against the original (both saved under tmp_path)
    passes at 1e-5; returns the original's path."""
    import onnx

    from fusecli.runtime.verify import verify_models

    src, out = tmp_path / "m.onnx", tmp_path / "m.fused.onnx"
    onnx.save(original, src)
    onnx.save(fused, out)
    report = verify_models(src, out)
    assert report.ok and report.max_rel <= 1e-5, report
    return src


def _rng(*key):
    """A generator seeded by ``key`` alone, the same in every process: Python's hash() of a
    tuple holding strings changes with each interpreter's hash seed (PYTHONHASHSEED), which
    made every kernel test draw other data on each run."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


_NP2ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
            np.dtype(np.int64): TensorProto.INT64, np.dtype(np.bool_): TensorProto.BOOL}


def rand(rng, shape, dtype=np.float32, scale=1.0, positive=False):
    """Fresh random data (never zeros)."""
    a = rng.standard_normal(shape) * scale
    if positive:
        a = np.abs(a) + 0.5
    a = np.where(np.abs(a) < 1e-3, 1e-3, a)
    return a.astype(dtype)


def assert_close(got, ref, rtol=2e-4, atol_scale=2e-4, what=""):
    got = np.asarray(got)
    ref = np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype} != {ref.dtype}"
    # NaN entries must sit where the reference has them (assert_allclose's equal_nan); the
    # tolerance scales with the largest finite value
    scale = max(1.0, float(np.nanmax(np.abs(ref.astype(np.float64)), initial=0.0)))
    np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=rtol,
                               atol=atol_scale * scale, err_msg=what)


def assert_requested(present, got, ref, names=None, **tol):
    """Optional outputs: each requested one (present[i] true) matches its reference, each
    omitted one came back as None."""
    names = names or [str(i) for i in range(len(present))]
    for p, g, r, nm in zip(present, got, ref, names):
        if p:
            assert_close(g, r, what=nm, **tol)
        else:
            assert g is None, f"{nm} was not requested but came back"


def tol(dtype):
    return dict(rtol=2e-4, atol_scale=2e-4) if np.dtype(dtype) == np.float32 else \
        dict(rtol=1e-2, atol_scale=1e-2)


# --- fused one-node models -----------------------------------------------------------------

def fused_model(op_type, inputs, outputs, **attrs):
    """inputs: list of (name, array or None for an absent optional input); outputs: list of
    (name, dtype) or None for an omitted optional output."""
    in_names = [n if a is not None else "" for n, a in inputs]
    while in_names and in_names[-1] == "":
        in_names.pop()
    out_names = [o[0] if o else "" for o in outputs]
    node = helper.make_node(op_type, in_names, out_names, domain=DOMAIN, **attrs)
    g_in = [helper.make_tensor_value_info(n, _NP2ONNX[a.dtype], list(a.shape))
            for n, a in inputs if a is not None]
    g_out = [helper.make_tensor_value_info(o[0], _NP2ONNX[np.dtype(o[1])], None)
             for o in outputs if o]
    graph = helper.make_graph([node], f"{op_type}_test", g_in, g_out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid(DOMAIN, 1)], ir_version=9)


def ort_session(model, with_library=True, threads=None):
    if with_library:
        so = session_options(threads=threads, opt_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    else:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if threads is not None:
            so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_fused(op_type, inputs, outputs, **attrs):
    """Runs one fused node; returns the list of requested outputs (None where omitted)."""
    model = fused_model(op_type, inputs, outputs, **attrs)
    sess = ort_session(model)
    feeds = {n: a for n, a in inputs if a is not None}
    names = [o[0] for o in outputs if o]
    res = dict(zip(names, sess.run(names, feeds)))
    return [res[o[0]] if o else None for o in outputs]


# --- unfused standard-op subgraphs -----------------------------------------------------------

class Builder:
    """A tiny standard-ONNX graph builder (one output per node unless told)."""

    def __init__(self, dtype=np.float32):
        self.nodes, self.inits, self.inputs, self.feeds = [], [], [], {}
        self.dtype = np.dtype(dtype)
        self._n = 0

    def _name(self, p="t"):
        self._n += 1
        return f"{p}{self._n}"

    def input(self, name, arr):
        self.inputs.append(helper.make_tensor_value_info(name, _NP2ONNX[arr.dtype], list(arr.shape)))
        self.feeds[name] = arr
        return name

    def const(self, value, dtype=None):
        name = self._name("c")
        arr = np.asarray(value, dtype=dtype or self.dtype)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def ints(self, values):
        return self.const(np.asarray(values, dtype=np.int64), np.int64)

    def op(self, op_type, *inputs, n_out=1, **attrs):
        outs = [self._name() for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def mul(self, a, b):
        return self.op("Mul", a, b)

    def add(self, a, b):
        return self.op("Add", a, b)

    def sub(self, a, b):
        return self.op("Sub", a, b)

    def model(self, outputs):
        outs = [helper.make_tensor_value_info(o, _NP2ONNX[self.dtype], None) for o in outputs]
        graph = helper.make_graph(self.nodes, "unfused", self.inputs, outs, self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)

    def run(self, outputs):
        sess = ort_session(self.model(outputs), with_library=False)
        return sess.run(list(outputs), self.feeds)


def act_grad_subgraph(b: Builder, dy, x, act, alpha=1.0):
    """dY * act'(alpha X) from standard ops: the gradient of act(alpha x) / alpha (silu at
    alpha != 1, QuickGELU x sigmoid(alpha x), as autograd decomposes it: the product rule
    dY s + (dY x) s (1 - s) alpha, s = Sigmoid(alpha x))."""
    if act == "identity":
        return dy
    if act == "silu" and alpha != 1.0:
        s = b.op("Sigmoid", b.mul(x, b.const(alpha)))
        dsig = b.mul(b.mul(dy, x), b.mul(s, b.sub(b.const(1.0), s)))
        return b.add(b.mul(dy, s), b.mul(dsig, b.const(alpha)))
    if alpha != 1.0:
        x = b.mul(x, b.const(alpha))
    if act == "relu":
        return b.op("Where", b.op("Greater", x, b.const(0.0)), dy, b.const(0.0))
    if act == "gelu":
        cdf = b.mul(b.const(0.5), b.add(b.const(1.0), b.op("Erf", b.mul(x, b.const(1 / math.sqrt(2))))))
        pdf = b.mul(b.op("Exp", b.mul(b.const(-0.5), b.mul(x, x))), b.const(1 / math.sqrt(2 * math.pi)))
        return b.mul(dy, b.add(cdf, b.mul(x, pdf)))
    if act == "gelu_tanh":
        a, c = math.sqrt(2 / math.pi), 0.044715
        x2 = b.mul(x, x)
        t = b.op("Tanh", b.mul(b.const(a), b.mul(x, b.add(b.const(1.0), b.mul(b.const(c), x2)))))
        one_m_t2 = b.sub(b.const(1.0), b.mul(t, t))
        poly = b.mul(b.const(a), b.add(b.const(1.0), b.mul(b.const(3 * c), x2)))
        inner = b.add(b.add(b.const(1.0), t), b.mul(x, b.mul(one_m_t2, poly)))
        return b.mul(dy, b.mul(b.const(0.5), inner))
    if act == "silu":
        s = b.op("Sigmoid", x)
        return b.mul(dy, b.mul(s, b.add(b.const(1.0), b.mul(x, b.sub(b.const(1.0), s)))))
    raise ValueError(act)


# --- onnxruntime-training (1.19.2) subprocess -----------------------------------------------

def ortt_python() -> str:
    for cand in (REPO / ".venv-ortt" / "bin" / "python",
                 REPO / "build" / "venv-ortt-kernels" / "bin" / "python"):
        if cand.exists():
            return str(cand)
    raise AssertionError("no onnxruntime-training venv: run `make ortt-env`")


_ORTT_SCRIPT = r"""
import ctypes, json, sys
import numpy as np, onnxruntime as ort
cfg = json.load(open(sys.argv[1]))
lib = cfg["library"]
out = {"version": ort.__version__}
cd = ctypes.CDLL(lib)
cd.fusecli_kernel_calls.restype = ctypes.c_int64
cd.fusecli_kernel_calls.argtypes = [ctypes.c_char_p]
for job in cfg["jobs"]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if job.get("library"):
        so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(job["model"], so, providers=["CPUExecutionProvider"])
    feeds = dict(np.load(job["feeds"]))
    before = {op: cd.fusecli_kernel_calls(op.encode()) for op in job.get("count", [])}
    res = sess.run(job["outputs"], feeds)
    calls = {op: cd.fusecli_kernel_calls(op.encode()) - before[op] for op in before}
    np.savez(job["result"], *res)
    out.setdefault("calls", []).append(calls)
json.dump(out, open(cfg["report"], "w"))
"""


def run_in_ortt(jobs):
    """jobs: list of dict(model=onnx.ModelProto, feeds=dict, outputs=[names], library=bool,
    count=[op names]). Runs all in one onnxruntime-training subprocess; returns (version,
    [list of outputs per job], [kernel-call deltas per job]). A test that calls it is marked
    `ortt` (tests/test_op_folders.py checks that): onnxruntime-training 1.19.2 has no ARM64
    wheel, `make test-arm64` deselects those tests and runs their stock-onnxruntime twins."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.fail(f"onnxruntime-training 1.19.2 publishes no {platform.machine()} wheel: "
                    "this test must be marked ortt (make test-arm64 deselects those)")
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        cfg = {"library": library_path(), "report": str(td / "report.json"), "jobs": []}
        for i, job in enumerate(jobs):
            mp, fp, rp = td / f"m{i}.onnx", td / f"f{i}.npz", td / f"r{i}.npz"
            mp.write_bytes(job["model"].SerializeToString())
            np.savez(fp, **job["feeds"])
            cfg["jobs"].append({"model": str(mp), "feeds": str(fp), "result": str(rp),
                                "outputs": job["outputs"], "library": job.get("library", False),
                                "count": job.get("count", [])})
        (td / "cfg.json").write_text(json.dumps(cfg))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        proc = subprocess.run([ortt_python(), "-c", _ORTT_SCRIPT, str(td / "cfg.json")],
                              capture_output=True, text=True, timeout=120, env=env, cwd=str(td))
        assert proc.returncode == 0, f"onnxruntime-training run failed:\n{proc.stderr[-4000:]}"
        report = json.loads((td / "report.json").read_text())
        results = []
        for i in range(len(jobs)):
            with np.load(td / f"r{i}.npz") as z:
                results.append([z[f"arr_{j}"] for j in range(len(z.files))])
        return report["version"], results, report.get("calls", [])


# --- in-place pairs ----------------------------------------------------------------------

def _inplace_model(op, inputs, outs, intermediates, keep=(), elem=F32, **attrs):
    """(model, feeds): `op` in a graph where each input named in `intermediates` is
    Add(<name>_p, <name>_q) of two graph inputs (an intermediate the runtime may reuse; those in
    `keep` are also graph outputs, so they must survive the node) and every fused output goes
    through Neg (a graph output is never placed in an input's buffer). inputs: list of
    (name, array) in port order."""
    onnx_t = helper.np_dtype_to_tensor_dtype(np.dtype(elem))
    vi = lambda n, shape=None: helper.make_tensor_value_info(n, onnx_t, shape)  # noqa: E731
    nodes, g_in, feeds, inner = [], [], {}, []
    for name, arr in inputs:
        if name in intermediates:
            half = (arr / 2).astype(arr.dtype)
            feeds[f"{name}_p"], feeds[f"{name}_q"] = half, (arr - half).astype(arr.dtype)
            g_in += [vi(f"{name}_p", arr.shape), vi(f"{name}_q", arr.shape)]
            nodes.append(helper.make_node("Add", [f"{name}_p", f"{name}_q"], [name]))
            inner.append(vi(name, arr.shape))
        else:
            feeds[name] = arr
            g_in.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape))
    fused = [f"f_{o}" if o else "" for o in outs]  # None: an output the node does not ask for
    fnode = helper.make_node(op, [n for n, _ in inputs], fused, domain="com.fusecli", **attrs)
    nodes.append(fnode)
    outs = [o for o in outs if o]
    nodes += [helper.make_node("Neg", [f"f_{o}"], [o]) for o in outs]
    # the fused outputs' types, recorded as fusecli's rewriter records them: onnxruntime places an
    # output in an input's buffer only when it knows both sizes
    types = {v.name: v.type for v in g_in + inner}
    for f, t in zip(fused, infer_output_types(fnode, types.get)):
        if f and t is not None:
            inner.append(helper.make_value_info(f, t))
    g_out = [vi(o) for o in outs] + [vi(k, dict(inputs)[k].shape) for k in keep]
    g = helper.make_graph(nodes, "inplace", g_in, g_out, value_info=inner)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET),
                                                helper.make_opsetid("com.fusecli", 1)], ir_version=9)
    return model, feeds


def _inplace_run(op, inputs, outs, intermediates, keep=(), elem=F32, **attrs):
    """Runs _inplace_model here; returns (negated-back outputs, kernel calls, in-place calls)."""
    model, feeds = _inplace_model(op, inputs, outs, intermediates, keep, elem, **attrs)
    library.reset_kernel_calls()
    got = ort_session(model).run([o for o in outs if o], feeds)
    return [-g for g in got], library.kernel_calls(op), library.kernel_calls(f"{op}/inplace")
