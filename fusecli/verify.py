"""Numerical checks that a fused model computes what the original did.

Both checks run in the model's own runtime (onnxruntime, or onnxruntime-training from the
``.venv-ortt`` environment) through ``runtime_worker.py`` in a subprocess.

``verify_models`` runs the original and the fused model on the same feeds (``feeds.plan_feeds``:
the user's ``--feeds`` file, a sample's parameters, else realistic values recognised from the
graph), graph optimizations off, and judges:

- every graph output, every fed buffer the runtime updates in place (ort-training gradient
  accumulation buffers) and every tensor at a fused node's boundary that both graphs compute;
- against max(tolerance, noise floor): the noise floor of a tensor is how far it moves when the
  ORIGINAL is re-run with every float input moved by one unit in the last place (times
  ``NOISE_FACTOR``). A graph output whose noise floor exceeds ``NOISE_LIMIT`` (relative) cannot
  be judged on the whole model; then every fusion is checked at its boundary instead
  (``check_fusions`` on the original's real tensors, plus the fused kernel itself on them);
- deterministically: one intra-op thread and onnxruntime's use_deterministic_compute, and every
  stochastic op (Dropout, Random*Like, Bernoulli, ...) gets the same seed in both models (in
  temporary copies), so ``verify G G`` passes on graphs with dropout or ScatterND;
- never vacuously: an original output that is NaN/Inf, all compared outputs zero, or a fused
  node whose every output is zero in the original (masked out) leaves the check INCONCLUSIVE
  (exit 5), not passed.
A fused model that fails to run where the original runs is the fusion's fault (``CheckFailed``,
exit 1, naming the fused node from the runtime's message).

``check_fusions``: per fusion, the tensors at the fused node's boundary are read from a run of
the ORIGINAL model, and the fused op's NumPy reference is evaluated on those inputs. A mismatch
names the rule and the nodes it replaced. This needs no C++ at all.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from .contracts import FUSED_DOMAIN
from .errors import CheckFailed, FuseError
from .feeds import FeedPlan, guessed_dims, load_manifest, plan_feeds, read_feeds_file
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



# Whole-model judgement: a tensor may differ by NOISE_FACTOR times what a one-ulp change of the
# inputs moves it by; a graph output that moves by more than NOISE_LIMIT (relative to its
# largest value) under that change is too ill-conditioned to judge on the whole model.
NOISE_FACTOR = 8.0
NOISE_LIMIT = 1e-3
DETERMINISM = "1 intra-op thread, use_deterministic_compute"

# Stochastic ops and the type of their `seed` attribute.
STOCHASTIC = {"Dropout": "int", "BitmaskDropout": "int", "BiasDropout": "int",
              "BitmaskBiasDropout": "int", "BiasSoftmaxDropout": "int",
              "TrainableDropout": "int", "RandomUniform": "float", "RandomNormal": "float",
              "RandomUniformLike": "float", "RandomNormalLike": "float", "Bernoulli": "float",
              "Multinomial": "float"}


class RunFailed(FuseError):
    """A model did not run in its runtime; ``detail`` is the runtime's one-line message."""

    def __init__(self, model_path, detail: str):
        super().__init__(f"running {Path(model_path).name} failed: {detail}")
        self.detail = detail


def run_in_runtime(model_path: str | os.PathLike, feeds: dict[str, np.ndarray], python: str,
                   library: str | None = None, opt_level: str = "disable",
                   extra: list[str] | None = None,
                   more_feeds: list[dict[str, np.ndarray]] = ()) -> tuple[dict[str, np.ndarray],
                                                                         dict]:
    """Run a model once through runtime_worker.py in ``python``; return (outputs, info).
    Each of ``more_feeds`` is run in a fresh session; its results are keyed 'run<k>/<name>'."""
    import json

    with tempfile.TemporaryDirectory(prefix="fusecli-run-") as tmp:
        fpath, opath = Path(tmp) / "feeds.npz", Path(tmp) / "out.npz"
        np.savez(fpath, **feeds)
        cmd = [python, str(WORKER), "--model", str(model_path), "--feeds", str(fpath),
               "--out", str(opath), "--opt-level", opt_level] + (extra or [])
        for k, more in enumerate(more_feeds, start=1):
            mpath = Path(tmp) / f"feeds{k}.npz"
            np.savez(mpath, **more)
            cmd += ["--feeds", str(mpath)]
        if library:
            cmd += ["--library", library]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RunFailed(model_path, worker_error(proc))
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
    noise: float = 0.0          # max |original - original on 1-ulp-perturbed inputs|
    limit: float = 0.0          # the max_abs allowed: max(atol + rtol * max_ref, noise term)
    status: str = "ok"          # ok | MISMATCH | zero | non-finite | not judged (noise)

    @property
    def rel(self) -> float:
        return self.max_abs / self.max_ref if self.max_ref > 0 else float(self.max_abs > 0)

    @property
    def noise_rel(self) -> float:
        return self.noise / self.max_ref if self.max_ref > 0 else 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "max_abs": self.max_abs, "max_rel": self.rel,
                "max_ref": self.max_ref, "ok": self.ok, "status": self.status,
                "noise_floor": self.noise, "noise_floor_rel": self.noise_rel,
                "allowed_abs": self.limit, "upstream_fused": self.upstream_fused}


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


def judge(name: str, ref: np.ndarray, got: np.ndarray | None, perturbed: np.ndarray | None,
          rtol: float, atol: float, base: np.ndarray | None = None) -> OutputDiff:
    """One tensor's verdict against max(atol + rtol * max|ref|, NOISE_FACTOR * noise floor);
    the noise floor is max |perturbed - base| (``base`` defaults to ``ref``: the same
    computation on unperturbed inputs)."""
    if got is None:
        return OutputDiff(name, float("inf"), 0.0, False, status="MISMATCH")
    max_abs, max_ref, ok = compare(ref, got, rtol, atol)
    d = OutputDiff(name, max_abs, max_ref, ok, limit=atol + rtol * max_ref)
    ref = np.asarray(ref)
    if ref.dtype.kind not in "fc":
        d.status = "ok" if ok else "MISMATCH"
        return d
    if ref.size and not np.isfinite(ref).all():  # no verdict on NaN/Inf: inconclusive
        d.status, d.ok = "non-finite", True
        return d
    if perturbed is not None:
        d.noise, _, _ = compare(ref if base is None else base, perturbed, 0.0, 0.0)
        if not math.isfinite(d.noise):
            d.noise = float("inf")
        d.limit = max(d.limit, NOISE_FACTOR * d.noise)
    if max_ref > atol and d.noise > NOISE_LIMIT * max_ref:  # (numerically zero: atol judges)
        d.ok = math.isfinite(max_abs)
        d.status = "not judged (noise)" if d.ok else "MISMATCH"
        return d
    d.ok = max_abs <= d.limit
    d.status = "MISMATCH" if not d.ok else ("zero" if max_ref <= atol else "ok")
    return d


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
class FusionCheck:
    rule: str
    fused_node: str
    replaced: list[str]
    outputs: list[OutputDiff]
    kernel: list[OutputDiff] = field(default_factory=list)  # the fused kernel on the same inputs

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.outputs + self.kernel)

    def as_dict(self) -> dict:
        return {"rule": self.rule, "fused_node": self.fused_node, "replaced": self.replaced,
                "ok": self.ok, "reference": [d.as_dict() for d in self.outputs],
                "kernel": [d.as_dict() for d in self.kernel]}


@dataclass
class VerifyReport:
    runtime: str
    outputs: list[OutputDiff]
    rtol: float
    atol: float
    fused_kernel_runs: dict[str, int] = field(default_factory=dict)  # from the ORT profile
    boundaries: list[OutputDiff] = field(default_factory=list)   # fused nodes' boundary tensors
    fusion_checks: list[FusionCheck] | None = None               # the per-fusion fallback
    inconclusive: list[str] = field(default_factory=list)        # why no verdict is possible
    feeds: dict[str, str] = field(default_factory=dict)          # input -> feed policy
    feed_lines: list[str] = field(default_factory=list)
    seeds_pinned: list[str] = field(default_factory=list)        # stochastic nodes seeded
    deterministic: str = DETERMINISM

    @property
    def mismatched(self) -> bool:
        return (not all(d.ok for d in self.outputs + self.boundaries)
                or any(not c.ok for c in self.fusion_checks or ()))

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.inconclusive

    @property
    def verdict(self) -> str:
        return "FAIL" if self.mismatched else "INCONCLUSIVE" if self.inconclusive else "PASS"

    @property
    def noisy(self) -> list[OutputDiff]:
        return [d for d in self.outputs if d.status.startswith("not judged")]

    @property
    def max_rel(self) -> float:
        """Max relative error over outputs that are not (numerically) zero."""
        return max((d.rel for d in self.outputs if d.max_ref > self.atol), default=0.0)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "verdict": self.verdict, "runtime": self.runtime,
                "rtol": self.rtol, "atol": self.atol, "max_rel": self.max_rel,
                "noise_factor": NOISE_FACTOR, "noise_limit": NOISE_LIMIT,
                "deterministic": self.deterministic, "seeds_pinned": self.seeds_pinned,
                "feeds": self.feeds, "inconclusive": self.inconclusive,
                "fused_kernel_runs": self.fused_kernel_runs,
                "outputs": [d.as_dict() for d in self.outputs],
                "boundaries": [d.as_dict() for d in self.boundaries],
                "fusion_checks": (None if self.fusion_checks is None
                                  else [c.as_dict() for c in self.fusion_checks])}


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


def _plan(orig: onnx.ModelProto, original, seed, dims, feeds_file) -> FeedPlan:
    given = read_feeds_file(feeds_file, orig) if feeds_file else None
    try:
        return plan_feeds(orig, manifest_entry_for(original), seed=seed, dims=dims, given=given)
    except (FileNotFoundError, NotImplementedError, ValueError) as exc:
        raise FuseError(f"cannot build feeds for {original}: {exc}") from None


def _dims_hint(orig: onnx.ModelProto, dims, plan: FeedPlan) -> str:
    """Where the original fails on generated feeds, the symbolic dims that were guessed."""
    given = {n for n, pol in plan.policy.items() if pol in ("file", "params file")}
    guessed = guessed_dims(orig, dims or {}, given)
    if not guessed:
        return ""
    return (f" (the symbolic dims {', '.join(guessed)} of generated inputs were fed as 2: give "
            f"their sizes with --dim NAME=N, or the inputs with --feeds FILE.npz)")


def _prepare(original, seed, dims, runtime_python, feeds_file=None):
    """The original model, the Python whose onnxruntime runs it, and one feed plan."""
    orig = _load_checked(original)
    python = pick_runtime(orig, runtime_python)
    return orig, python, _plan(orig, original, seed, dims, feeds_file)


# --- temporary copies: seeds pinned, boundary tensors exposed --------------------------------

def pin_seeds(model: onnx.ModelProto) -> list[str]:
    """Give every stochastic node of ``model`` (a copy: it is changed in place) a seed derived
    from its first output's name, so two models that share the node draw the same numbers.
    Returns the seeded nodes' names (or first outputs)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    pinned = []
    for n in model.graph.node:
        kind = STOCHASTIC.get(n.op_type)
        if kind is None or not n.output:
            continue
        if n.op_type == "Dropout" and n.domain in ("", "ai.onnx") and opset < 12:
            continue  # Dropout-7/10: no seed, no training mode
        seed = zlib.crc32(n.output[0].encode()) & 0xFFFFFF  # exact as a float too
        for a in [a for a in n.attribute if a.name == "seed"]:
            n.attribute.remove(a)
        n.attribute.append(helper.make_attribute("seed", seed if kind == "int" else float(seed)))
        pinned.append(n.name or n.output[0])
    return pinned


PROBE = "fusecli.probe/"


def _expose(model: onnx.ModelProto, tensors: list[str], types_from: onnx.ModelProto) -> None:
    """Make ``tensors`` (not graph inputs) readable after a run: each is copied by an Identity
    node into a graph output named PROBE + name (onnxruntime-training 1.19 crashes when some
    tensors, e.g. a MaxPoolGrad result, are graph outputs themselves). ``_unprobe`` renames
    the results back."""
    existing = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    typed = {v.name: v for g in (types_from.graph, model.graph)
             for v in list(g.value_info) + list(g.input) + list(g.output)}
    # tensors without a recorded type (a bool fill mask that is an initializer, a Constant's
    # output or a computed tensor) take it from the initializers or shape inference
    inits = {i.name: i.data_type for g in (types_from.graph, model.graph) for i in g.initializer}
    todo = [t for t in dict.fromkeys(tensors) if t not in existing]
    if any(t not in typed and t not in inits for t in todo):
        try:
            inferred = onnx.shape_inference.infer_shapes(types_from).graph.value_info
            typed.update({v.name: v for v in inferred if v.name not in typed
                          and v.type.tensor_type.elem_type})
        except Exception:  # custom ops onnx cannot infer: FLOAT as before
            pass
    for t in todo:
        if t in typed:
            elem = typed[t].type.tensor_type.elem_type
        else:
            elem = inits.get(t, onnx.TensorProto.FLOAT)
        model.graph.node.append(helper.make_node("Identity", [t], [PROBE + t],
                                                 name=PROBE + t))
        model.graph.output.append(helper.make_tensor_value_info(PROBE + t, elem, None))


def _unprobe(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k.replace(PROBE, "", 1) if PROBE in k else k: v for k, v in values.items()}


def _has_external(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


@contextmanager
def _written(pairs):
    """Write (model, source path) pairs where onnxruntime can read them: a temporary folder, or
    a hidden file beside the source when the model keeps external data there (the data's
    locations are relative to it). Yields the paths; removes them afterwards."""
    with tempfile.TemporaryDirectory(prefix="fusecli-verify-") as tmp:
        paths = []
        try:
            for k, (model, source) in enumerate(pairs):
                if _has_external(model):
                    p = Path(source).resolve().parent / f".fusecli-{os.getpid()}-{k}.onnx"
                else:
                    p = Path(tmp) / f"model{k}.onnx"
                paths.append(p)
                onnx.save(model, str(p))
            yield paths
        finally:
            for p in paths:
                if p.parent != Path(tmp):
                    p.unlink(missing_ok=True)


def _perturbed(feeds: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Every non-zero float input moved by one unit in the last place, in a random direction."""
    rng = np.random.default_rng([seed, 0x5EED])
    out = {}
    for k, v in feeds.items():
        if v.dtype.kind == "f" and v.size:
            to = np.where(rng.random(v.shape) < 0.5, -np.inf, np.inf).astype(v.dtype)
            out[k] = np.where(v == 0, v, np.nextafter(v, to)).astype(v.dtype)
        else:
            out[k] = v
    return out


def _tensors_of(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    return ({o for n in g.node for o in n.output if o} | {i.name for i in g.input}
            | {t.name for t in g.initializer})


def _boundary(fnode: onnx.NodeProto, known: set[str], inputs: set[str]) -> tuple[list, list]:
    """A fused node's inputs and outputs that the original graph computes (graph inputs and
    the fused op's own workspace outputs excluded)."""
    ins = [t for t in fnode.input if t and t in known and t not in inputs]
    outs = [t for t in fnode.output if t and t in known]
    return ins, outs


def _fused_node_error(detail: str, fused_nodes: list[onnx.NodeProto]) -> str:
    """The fused node a runtime message names ('... Name:'X' ...'), else any fused node name
    it mentions."""
    m = re.search(r"Name:'([^']+)'", detail)
    names = {n.name for n in fused_nodes}
    if m and m.group(1) in names:
        return m.group(1)
    for name in sorted(names, key=len, reverse=True):
        if name and name in detail:
            return name
    return ""


def _failing_fused_node(fnodes: list[onnx.NodeProto], values: dict, python: str,
                        lib: str | None) -> str:
    """The first fused node that fails on its own, on the original's boundary tensors."""
    for n in fnodes:
        if not all(i in values for i in n.input if i):
            continue
        km, kfeeds, _ = _kernel_model([n], values)
        try:
            with _written([(km, ".")]) as (kpath,):
                run_in_runtime(kpath, kfeeds, python, library=lib, extra=["--deterministic"])
        except RunFailed:
            return n.name
    return ""


def verify_models(original: str | os.PathLike, fused: str | os.PathLike, seed: int = 0,
                  rtol: float = 1e-5, atol: float = 1e-6, dims: dict[str, int] | None = None,
                  runtime_python: str | None = None,
                  feeds_file: str | os.PathLike | None = None) -> VerifyReport:
    """Run both models on the same feeds in the same runtime and judge every output."""
    from .fusion import rule_of
    from .library import library_path

    orig, python, plan = _prepare(original, seed, dims, runtime_python, feeds_file)
    fmodel = _load_checked(fused)
    fnodes = [n for n in fmodel.graph.node if n.domain == FUSED_DOMAIN]
    lib = library_path() if fnodes else None
    known, inputs = _tensors_of(orig), {i.name for i in orig.graph.input}
    bounds = {n.name: _boundary(n, known, inputs) for n in fnodes}
    wanted = list(dict.fromkeys(t for ins, outs in bounds.values() for t in ins + outs))
    probe, fcopy = onnx.ModelProto(), onnx.ModelProto()
    probe.CopyFrom(orig)
    fcopy.CopyFrom(fmodel)
    _expose(probe, wanted, orig)
    # fused nodes' inputs only the fused graph has (constants a rule added, tensors of nodes
    # around the fused ones): the per-fusion check reads them from the fused graph
    finits = {t.name: t for t in fmodel.graph.initializer}
    fonly = [t for n in fnodes for t in n.input
             if t and t not in known and t not in finits]
    fconst = {i: onnx.numpy_helper.to_array(finits[i]) for n in fnodes for i in n.input
              if i in finits and finits[i].data_location != onnx.TensorProto.EXTERNAL}
    _expose(fcopy, wanted + fonly, orig)
    pinned = pin_seeds(probe)
    pin_seeds(fcopy)
    with _written([(probe, original), (fcopy, fused)]) as (ppath, fpath), \
            tempfile.TemporaryDirectory(prefix="fusecli-prof-") as pdir:
        try:  # the original, then the original on 1-ulp-perturbed inputs (a fresh session)
            ref, info = run_in_runtime(ppath, plan.feeds, python, extra=["--deterministic"],
                                       more_feeds=[_perturbed(plan.feeds, seed)])
            ref = _unprobe(ref)
        except RunFailed as exc:
            raise FuseError(f"the original model {Path(original).name} does not run: "
                            f"{exc.detail}{_dims_hint(orig, dims, plan)}") from None
        try:
            got, finfo = run_in_runtime(fpath, plan.feeds, python, library=lib,
                                        extra=["--deterministic", "--profile", pdir])
            got = _unprobe(got)
        except RunFailed as exc:
            node = _fused_node_error(exc.detail, fnodes) or _failing_fused_node(
                fnodes, {**ref, **plan.feeds, **fconst}, python, lib)
            where = (f"at fused node {node} (rule {rule_of(next(n for n in fnodes if n.name == node))})"
                     if node else f"(fused nodes: {', '.join(n.name for n in fnodes) or 'none'})")
            raise CheckFailed(f"the fused model {Path(fused).name} does not run where the "
                              f"original does, {where}: {exc.detail}") from None
        fused_ops = {n.op_type for n in fnodes}
        runs = _kernel_runs(finfo["profile"], fused_ops) if finfo.get("profile") else {}
    # fed buffers count as outputs when a run wrote into them (ort-training gradient buffers)
    feeds = plan.feeds
    inplace = sorted(k for k in ref if k.startswith("fed/") and (
        not np.array_equal(ref[k], feeds[k[4:]])
        or (k in got and not np.array_equal(got[k], feeds[k[4:]]))))
    diffs = []
    for name in [o.name for o in orig.graph.output] + inplace:
        d = judge(name, ref[name], got.get(name), ref.get(f"run1/{name}"), rtol, atol)
        if not d.ok:
            d.upstream_fused = _upstream_fused(fmodel, name.removeprefix("fed/"))
        diffs.append(d)
    boundaries = []
    for t in wanted:
        d = judge(t, ref[t], got.get(t), ref.get(f"run1/{t}"), rtol, atol)
        d.upstream_fused = sorted(n for n, (ins, outs) in bounds.items() if t in ins + outs)
        boundaries.append(d)
    report = VerifyReport(info["runtime"], diffs, rtol, atol, runs, boundaries,
                          feeds=dict(plan.policy), feed_lines=plan.lines(),
                          seeds_pinned=pinned)
    report.inconclusive = _vacuity(diffs, bounds, ref)
    if any(d.status == "non-finite" for d in diffs):
        # the original itself is NaN/Inf: differences downstream of that say nothing
        for d in diffs + boundaries:
            if not d.ok:
                d.ok, d.status = True, "not judged (original non-finite)"
    if report.noisy and not report.mismatched and not any(d.status == "non-finite"
                                                          for d in diffs):
        fvals = {**ref, **{t: got[t] for t in fonly if t in got}, **fconst}
        report.fusion_checks = _boundary_checks(fnodes, fvals, plan.feeds, python, lib, rtol,
                                                atol, seed)
        for c in report.fusion_checks:
            if c.ok and c.kernel and all(d.status.startswith("not judged") for d in c.kernel):
                report.inconclusive.append(f"fused node {c.fused_node}: every output is too "
                                           "sensitive to its inputs to judge at its boundary")
    return report


def _vacuity(diffs: list[OutputDiff], bounds: dict, values: dict) -> list[str]:
    """Why the comparison cannot tell a right fusion from a wrong one (empty: it can)."""
    why = []
    bad = [d.name for d in diffs if d.status == "non-finite"]
    if bad:
        why.append(f"the original computes NaN/Inf in {', '.join(bad[:4])}"
                   + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""))
    floats = [d for d in diffs if np.asarray(values[d.name]).dtype.kind == "f"
              and d.status != "non-finite"]
    if floats and not bad and all(d.max_ref == 0 for d in floats):
        why.append("every compared output is zero")
    for node, (_, outs) in bounds.items():
        vals = [np.asarray(values[t]) for t in outs if t in values]
        vals = [v for v in vals if v.dtype.kind == "f" and v.size]
        if vals and all(not np.any(v) for v in vals):
            why.append(f"every output of fused node {node} is zero in the original (masked "
                       "out?), so an error in it could not show")
    return why


def _single_node_model(node: onnx.NodeProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(
        i, helper.np_dtype_to_tensor_dtype(values[i].dtype), values[i].shape)
        for i in node.input if i]
    outs = [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
            for o in node.output if o]
    g = helper.make_graph([node], "one", ins, outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid(FUSED_DOMAIN, 1)])


def _kernel_model(nodes: list[onnx.NodeProto], values: dict[str, np.ndarray]):
    """All fused nodes side by side, each reading its own copy of its boundary inputs (renamed
    'k<i>/<name>') so that none reads another's result. Returns (model, feeds, output map)."""
    new_nodes, feeds, outmap, ins, outs = [], {}, {}, [], []
    for i, n in enumerate(nodes):
        c = onnx.NodeProto()
        c.CopyFrom(n)
        for j, t in enumerate(n.input):
            if t:
                c.input[j] = f"k{i}/{t}"
                feeds[c.input[j]] = values[t]
                ins.append(helper.make_tensor_value_info(
                    c.input[j], helper.np_dtype_to_tensor_dtype(values[t].dtype),
                    values[t].shape))
        for j, t in enumerate(n.output):
            if t:
                c.output[j] = f"k{i}/{t}"
                if t in values:  # a tensor the original computes (not a workspace output)
                    outmap[c.output[j]] = (n.name, t)
                    outs.append(helper.make_tensor_value_info(
                        c.output[j], helper.np_dtype_to_tensor_dtype(values[t].dtype), None))
        new_nodes.append(c)
    g = helper.make_graph(new_nodes, "fused_nodes", ins, outs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid(FUSED_DOMAIN, 1)])
    m.ir_version = 8  # onnxruntime-training 1.19 reads up to IR 9
    return m, feeds, outmap


def _reference_diffs(node: onnx.NodeProto, values: dict, known: set[str], rtol: float,
                     atol: float, perturbed: dict | None = None,
                     base: dict | None = None) -> list[OutputDiff]:
    """The fused op's NumPy reference on the original's boundary inputs, against the
    original's boundary outputs (``perturbed`` vs ``base``: the op's outputs on
    1-ulp-perturbed and on the real inputs, its local noise floor)."""
    from onnx.reference import ReferenceEvaluator

    from .ops.reference import reference_ops

    m = _single_node_model(node, values)
    got = ReferenceEvaluator(m, new_ops=reference_ops()).run(
        None, {i: values[i] for i in node.input if i})
    return [judge(name, values[name], g, (perturbed or {}).get(name), rtol, atol,
                  (base or {}).get(name))
            for name, g in zip([o for o in node.output if o], got) if name in known]


def _boundary_checks(fnodes: list[onnx.NodeProto], values: dict, feeds: dict, python: str,
                     lib: str | None, rtol: float, atol: float, seed: int = 0
                     ) -> list[FusionCheck]:
    """The per-fusion fallback: each fused node's NumPy reference AND its kernel, on the
    original's real boundary tensors, against the original's boundary outputs; each output
    judged against the op's own noise floor (the kernel re-run on 1-ulp-perturbed inputs:
    e.g. BatchNorm's input gradient over 2 values per channel is zero up to rounding)."""
    from .fusion import DOC_PREFIX, rule_of

    vals = {**values, **feeds}
    runnable = [n for n in fnodes if all(i in vals for i in n.input if i)]
    kernel_out: dict = {}
    kernel_pert: dict = {}
    if runnable:
        km, kfeeds, outmap = _kernel_model(runnable, vals)
        with _written([(km, ".")]) as (kpath,):
            kout, _ = run_in_runtime(kpath, kfeeds, python, library=lib,
                                     extra=["--deterministic"],
                                     more_feeds=[_perturbed(kfeeds, seed)])
        for key, (node, t) in outmap.items():
            kernel_out.setdefault(node, {})[t] = kout[key]
            kernel_pert.setdefault(node, {})[t] = kout[f"run1/{key}"]
    checks = []
    known = set(vals)
    for n in fnodes:
        doc = n.doc_string[len(DOC_PREFIX):].split(":", 1) if n.doc_string.startswith(
            DOC_PREFIX) else ["", ""]
        replaced = [r.strip() for r in doc[1].split(",") if r.strip()] if len(doc) > 1 else []
        if n not in runnable:
            checks.append(FusionCheck(rule_of(n) or n.op_type, n.name, replaced, [
                OutputDiff(i, float("inf"), 0.0, False, status="MISMATCH")
                for i in n.input if i and i not in vals]))
            continue
        pert, base = kernel_pert.get(n.name, {}), kernel_out.get(n.name, {})
        ref_diffs = _reference_diffs(n, vals, known, rtol, atol, pert, base)
        kdiffs = [judge(t, vals[t], v, pert.get(t), rtol, atol, v)
                  for t, v in base.items() if t in known]
        checks.append(FusionCheck(rule_of(n) or n.op_type, n.name, replaced, ref_diffs, kdiffs))
    return checks


# --- per-fusion check against the NumPy references ------------------------------------------

def check_fusions(original_path: str | os.PathLike, records, seed: int = 0, rtol: float = 1e-5,
                  atol: float = 1e-6, dims: dict[str, int] | None = None,
                  runtime_python: str | None = None) -> list[FusionCheck]:
    """Evaluate each fusion's reference op on the boundary tensors of an original-model run."""
    orig, python, plan = _prepare(original_path, seed, dims, runtime_python)
    probe = onnx.ModelProto()
    probe.CopyFrom(orig)
    known = _tensors_of(orig)
    inputs = {i.name for i in orig.graph.input}
    nodes = [(r, n) for r in records for n in (r.node, *getattr(r, "extra", ()))]
    wanted = list(dict.fromkeys(t for _, n in nodes for t in list(n.input) + list(n.output)
                                if t and t in known and t not in inputs))
    _expose(probe, wanted, orig)
    pin_seeds(probe)
    with _written([(probe, original_path)]) as (ppath,):
        values, _ = run_in_runtime(ppath, plan.feeds, python, extra=["--deterministic"])
    values = _unprobe(values)
    values.update(plan.feeds)
    checks = []
    for r in records:
        diffs = _reference_diffs(r.node, values, known, rtol, atol)
        extra = getattr(r, "extra", ())
        if extra:  # replace.then: later fused nodes read the earlier ones' reference outputs
            vals = dict(values)
            vals.update(_reference_outputs(r.node, vals, known))
            for n in extra:
                diffs += _reference_diffs(n, vals, known, rtol, atol)
                vals.update(_reference_outputs(n, vals, known))
        checks.append(FusionCheck(r.rule, r.fused_node, r.replaced, diffs))
    return checks


def _reference_outputs(node: onnx.NodeProto, values: dict, known: set[str]) -> dict:
    """The fused op's NumPy reference outputs that the original does not have (a tensor the
    replacement created, e.g. FlashAttention's LSE), for the fused nodes that read them."""
    from onnx.reference import ReferenceEvaluator

    from .ops.reference import reference_ops

    got = ReferenceEvaluator(_single_node_model(node, values), new_ops=reference_ops()).run(
        None, {i: values[i] for i in node.input if i})
    return {o: g for o, g in zip([o for o in node.output if o], got) if o not in known}
