"""Numerical checks that a fused model computes what the original did.

Two checks, both run in the model's own runtime (onnxruntime, or onnxruntime-training from the
``.venv-ortt`` environment) through ``runtime_worker.py`` in a subprocess:

- ``verify_models``: the original and the fused model on the same random feeds, graph
  optimizations off; every graph output and every fed buffer that the runtime updates in place
  (ort-training gradient accumulation buffers) is compared.
- ``check_fusions``: per fusion, the tensors at the fused node's boundary are read from a run
  of the ORIGINAL model, and the fused op's NumPy reference is evaluated on those inputs. A
  mismatch names the rule and the nodes it replaced. This needs no C++ at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from .contracts import FUSED_DOMAIN
from .errors import FuseError
from .feeds import load_manifest, make_feeds
from .modelio import load_model
from .sanity import check_graph

WORKER = Path(__file__).resolve().parent / "runtime_worker.py"

# Ops only onnxruntime-training registers (stock onnxruntime refuses models holding them).
_TRAINING_OPS = {"InPlaceAccumulator", "InPlaceAccumulatorV2", "ConcatTraining",
                 "BatchNormInternal", "SliceGrad", "Scale", "GatherGrad", "YieldOp",
                 "SoftmaxCrossEntropyLossInternal", "SoftmaxCrossEntropyLossInternalGrad",
                 "SoftmaxGrad", "SoftmaxGrad_13", "LogSoftmaxGrad", "LogSoftmaxGrad_13"}


def needs_training_runtime(model: onnx.ModelProto) -> bool:
    for n in model.graph.node:
        if n.op_type in _TRAINING_OPS or (n.op_type.endswith("Grad")
                                          and n.domain in ("com.microsoft", "", "ai.onnx")):
            return True
    return False


def pick_runtime(model: onnx.ModelProto, override: str | None = None) -> str:
    """Python interpreter whose onnxruntime can run ``model``."""
    from .library import training_python

    if override or needs_training_runtime(model):
        return training_python(override)
    return sys.executable


def manifest_entry_for(path: str | os.PathLike) -> dict | None:
    """The entry of a sample in the ``manifest.yaml`` beside it (shipped samples: their
    parameters and labels), or None."""
    import yaml

    p = Path(path).resolve()
    manifest = p.parent / "manifest.yaml"
    if not manifest.is_file():
        return None
    try:
        entries = load_manifest(manifest)
    except (OSError, yaml.YAMLError, ValueError, AttributeError, TypeError):
        return None  # not a fusecli sample manifest
    for entry in entries.values():
        if entry.get("file") == p.name:
            return entry
    return None


def worker_error(proc: subprocess.CompletedProcess) -> str:
    """The one-line reason a worker subprocess failed: its last stderr line (the workers print
    exactly one), or its exit code."""
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def run_in_runtime(model_path: str | os.PathLike, feeds: dict[str, np.ndarray], python: str,
                   library: str | None = None, opt_level: str = "disable",
                   extra: list[str] | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """Run a model once through runtime_worker.py in ``python``; return (outputs, info)."""
    import json

    with tempfile.TemporaryDirectory(prefix="fusecli-run-") as tmp:
        fpath, opath = Path(tmp) / "feeds.npz", Path(tmp) / "out.npz"
        np.savez(fpath, **feeds)
        cmd = [python, str(WORKER), "--model", str(model_path), "--feeds", str(fpath),
               "--out", str(opath), "--opt-level", opt_level] + (extra or [])
        if library:
            cmd += ["--library", library]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise FuseError(f"running {Path(model_path).name} failed: {worker_error(proc)}")
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        with np.load(opath, allow_pickle=False) as z:
            outs = {k: z[k] for k in z.files}
    return outs, info


@dataclass
class OutputDiff:
    name: str
    max_abs: float
    max_ref: float
    ok: bool
    upstream_fused: list[str] = field(default_factory=list)

    @property
    def rel(self) -> float:
        return self.max_abs / self.max_ref if self.max_ref > 0 else float(self.max_abs > 0)

    def as_dict(self) -> dict:
        return {"name": self.name, "max_abs": self.max_abs, "max_rel": self.rel,
                "max_ref": self.max_ref, "ok": self.ok, "upstream_fused": self.upstream_fused}


def compare(ref: np.ndarray, got: np.ndarray, rtol: float, atol: float) -> tuple[float, float, bool]:
    ref = np.asarray(ref)
    got = np.asarray(got)
    if ref.shape != got.shape:
        return float("inf"), 0.0, False
    if ref.dtype.kind not in "fc":
        same = bool(np.array_equal(ref, got))
        return (0.0 if same else 1.0), 1.0, same
    r = ref.astype(np.float64)
    g = got.astype(np.float64)
    if not np.array_equal(np.isfinite(r), np.isfinite(g)):
        return float("inf"), 0.0, False
    diff = np.abs(np.where(np.isfinite(r), r - g, 0.0))
    max_abs = float(diff.max()) if diff.size else 0.0
    finite = np.isfinite(r)
    max_ref = float(np.abs(r[finite]).max()) if finite.any() else 0.0
    return max_abs, max_ref, max_abs <= atol + rtol * max_ref


def _upstream_fused(model: onnx.ModelProto, tensor: str) -> list[str]:
    producer = {o: n for n in model.graph.node for o in n.output if o}
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    # an in-place buffer: start from the nodes that consume it (the accumulator)
    start = [producer[tensor]] if tensor in producer else consumers.get(tensor, [])
    seen, out, stack = set(), [], list(start)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.domain == FUSED_DOMAIN:
            out.append(n.name)
        stack.extend(producer[i] for i in n.input if i in producer)
    return sorted(out)


@dataclass
class VerifyReport:
    runtime: str
    outputs: list[OutputDiff]
    rtol: float
    atol: float
    fused_kernel_runs: dict[str, int] = field(default_factory=dict)  # from the ORT profile

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.outputs)

    @property
    def max_rel(self) -> float:
        """Max relative error over outputs that are not (numerically) zero."""
        return max((d.rel for d in self.outputs if d.max_ref > self.atol), default=0.0)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "runtime": self.runtime, "rtol": self.rtol, "atol": self.atol,
                "max_rel": self.max_rel, "fused_kernel_runs": self.fused_kernel_runs,
                "outputs": [d.as_dict() for d in self.outputs]}


def _kernel_runs(profile_path: str, fused_ops: set[str]) -> dict[str, int]:
    """Count the fused ops' kernel executions in an onnxruntime profile."""
    import json

    counts: dict[str, int] = {}
    with open(profile_path) as f:
        events = json.load(f)
    for e in events:
        op = e.get("args", {}).get("op_name")
        if e.get("cat") == "Node" and op in fused_ops and e.get("name", "").endswith("_kernel_time"):
            counts[op] = counts.get(op, 0) + 1
    return counts


def _load_checked(path) -> onnx.ModelProto:
    model = load_model(path)
    check_graph(model)  # fatal problems raise a one-line ModelError
    return model


def _prepare(original, seed, dims, runtime_python) -> tuple[onnx.ModelProto, str, dict]:
    """The original model, the Python whose onnxruntime runs it, and one set of feeds."""
    orig = _load_checked(original)
    python = pick_runtime(orig, runtime_python)
    return orig, python, make_feeds(orig, manifest_entry_for(original), seed=seed, dims=dims)


def verify_models(original: str | os.PathLike, fused: str | os.PathLike, seed: int = 0,
                  rtol: float = 1e-5, atol: float = 1e-6, dims: dict[str, int] | None = None,
                  runtime_python: str | None = None) -> VerifyReport:
    """Run both models on the same feeds in the same runtime and compare every output."""
    from .library import library_path

    orig, python, feeds = _prepare(original, seed, dims, runtime_python)
    fmodel = _load_checked(fused)
    lib = library_path() if any(n.domain == FUSED_DOMAIN for n in fmodel.graph.node) else None
    ref, info = run_in_runtime(original, feeds, python)
    with tempfile.TemporaryDirectory(prefix="fusecli-prof-") as pdir:
        got, finfo = run_in_runtime(fused, feeds, python, library=lib, extra=["--profile", pdir])
        fused_ops = {n.op_type for n in fmodel.graph.node if n.domain == FUSED_DOMAIN}
        runs = _kernel_runs(finfo["profile"], fused_ops) if finfo.get("profile") else {}
    # fed buffers count as outputs when a run wrote into them (ort-training gradient buffers)
    inplace = sorted(k for k in ref if k.startswith("fed/") and (
        not np.array_equal(ref[k], feeds[k[4:]])
        or (k in got and not np.array_equal(got[k], feeds[k[4:]]))))
    diffs = []
    for name in [o.name for o in orig.graph.output] + inplace:
        if name not in got:
            diffs.append(OutputDiff(name, float("inf"), 0.0, False))
            continue
        max_abs, max_ref, ok = compare(ref[name], got[name], rtol, atol)
        d = OutputDiff(name, max_abs, max_ref, ok)
        if not ok:
            d.upstream_fused = _upstream_fused(fmodel, name.removeprefix("fed/"))
        diffs.append(d)
    return VerifyReport(info["runtime"], diffs, rtol, atol, runs)


# --- per-fusion check against the NumPy references ------------------------------------------

@dataclass
class FusionCheck:
    rule: str
    fused_node: str
    replaced: list[str]
    outputs: list[OutputDiff]

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.outputs)


def _single_node_model(node: onnx.NodeProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(
        i, helper.np_dtype_to_tensor_dtype(values[i].dtype), values[i].shape)
        for i in node.input if i]
    outs = [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
            for o in node.output if o]
    g = helper.make_graph([node], "one", ins, outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid(FUSED_DOMAIN, 1)])


def check_fusions(original_path: str | os.PathLike, records, seed: int = 0, rtol: float = 1e-5,
                  atol: float = 1e-6, dims: dict[str, int] | None = None,
                  runtime_python: str | None = None) -> list[FusionCheck]:
    """Evaluate each fusion's reference op on the boundary tensors of an original-model run."""
    from onnx.reference import ReferenceEvaluator

    from .ops.reference import reference_ops

    orig, python, feeds = _prepare(original_path, seed, dims, runtime_python)
    probe = onnx.ModelProto()
    probe.CopyFrom(orig)
    existing = {o.name for o in probe.graph.output}
    typed = {v.name: v for v in list(probe.graph.value_info) + list(probe.graph.input)}
    # tensors of the original graph (a fused op's workspace output, e.g. dZ, is not one of them)
    known = ({o for n in probe.graph.node for o in n.output}
             | {i.name for i in probe.graph.input} | {t.name for t in probe.graph.initializer})
    wanted = []
    for r in records:
        for t in list(r.node.input) + list(r.node.output):
            if t and t in known and t not in existing and t not in wanted:
                wanted.append(t)
    for t in wanted:
        elem = (typed[t].type.tensor_type.elem_type if t in typed
                else onnx.TensorProto.FLOAT)
        probe.graph.output.append(helper.make_tensor_value_info(t, elem, None))
    with tempfile.TemporaryDirectory(prefix="fusecli-probe-") as tmp:
        ppath = Path(tmp) / "probe.onnx"
        base = Path(original_path).resolve().parent
        # keep external data resolvable: write the probe next to nothing, point at the original
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in probe.graph.initializer):
            ppath = base / f".fusecli-probe-{os.getpid()}.onnx"
        try:
            onnx.save(probe, str(ppath))
            values, _ = run_in_runtime(ppath, feeds, python)
        finally:
            if ppath.parent == base:
                ppath.unlink(missing_ok=True)
    values.update(feeds)
    checks = []
    for r in records:
        m = _single_node_model(r.node, values)
        got = ReferenceEvaluator(m, new_ops=reference_ops()).run(
            None, {i: values[i] for i in r.node.input if i})
        diffs = []
        for name, g in zip([o for o in r.node.output if o], got):
            if name not in known:
                continue
            max_abs, max_ref, ok = compare(values[name], g, rtol, atol)
            diffs.append(OutputDiff(name, max_abs, max_ref, ok))
        checks.append(FusionCheck(r.rule, r.fused_node, r.replaced, diffs))
    return checks
