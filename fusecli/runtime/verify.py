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

This module orchestrates; the numeric judgement of one tensor (``compare``, ``judge``,
``OutputDiff``, the noise floor) is ``fusecli.runtime.compare``, running a model in its runtime
(``run_in_runtime``, ``pick_runtime``) ``fusecli.runtime.runner``.
"""

from __future__ import annotations

import os
import re
import tempfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from fusecli.ops.contracts import FUSED_DOMAIN
from fusecli.errors import CheckFailed, FuseError
from fusecli.runtime.compare import NOISE_FACTOR, NOISE_LIMIT, OutputDiff, judge
from fusecli.runtime.feeds import FeedPlan, guessed_dims, plan_feeds, read_feeds_file
from fusecli.io.model import load_model, model_folder
from fusecli.engine.sanity import check_graph
from fusecli.runtime.runner import RunFailed, manifest_entry_for, pick_runtime, run_in_runtime

DETERMINISM = "1 intra-op thread, use_deterministic_compute, no memory reuse"

# Stochastic ops and the type of their `seed` attribute.
STOCHASTIC = {"Dropout": "int", "BitmaskDropout": "int", "BiasDropout": "int",
              "BitmaskBiasDropout": "int", "BiasSoftmaxDropout": "int",
              "TrainableDropout": "int", "RandomUniform": "float", "RandomNormal": "float",
              "RandomUniformLike": "float", "RandomNormalLike": "float", "Bernoulli": "float",
              "Multinomial": "float"}


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
    with open(profile_path, encoding="utf-8", errors="replace") as f:
        events = json.load(f, strict=False)  # onnxruntime writes node names unescaped
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
    # (and a tensor only the fused graph computes, e.g. a mask a rule's prepare node casts to
    # bool, from the fused graph's)
    for source in (types_from, model):
        if not any(t not in typed and t not in inits for t in todo):
            break
        try:
            inferred = onnx.shape_inference.infer_shapes(source).graph.value_info
            typed.update({v.name: v for v in inferred if v.name not in typed
                          and v.type.tensor_type.elem_type})
        except Exception:  # noqa: BLE001 - custom ops onnx cannot infer: FLOAT as before
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


def _has_fused(model: onnx.ModelProto) -> bool:
    return any(n.domain == FUSED_DOMAIN for n in model.graph.node)


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
                if _has_external(model):   # beside the path as given, as onnxruntime reads it
                    p = model_folder(source) / f".fusecli-{os.getpid()}-{k}.onnx"
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
    from fusecli.runtime.runtime_worker import escape_line

    m = re.search(r"Name:'([^']+)'", detail)
    names = {escape_line(n.name): n.name for n in fused_nodes}  # as the worker's line has them
    if m and m.group(1) in names:
        return names[m.group(1)]
    for name in sorted(names, key=len, reverse=True):
        if name and name in detail:
            return names[name]
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
    from fusecli.engine.fusion import rule_of
    from fusecli.runtime.library import library_path

    orig, python, plan = _prepare(original, seed, dims, runtime_python, feeds_file)
    fmodel = _load_checked(fused)
    fnodes = [n for n in fmodel.graph.node if n.domain == FUSED_DOMAIN]
    lib = library_path() if fnodes or _has_fused(orig) else None   # registered for both sides
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
            ref, info = run_in_runtime(ppath, plan.feeds, python, library=lib,
                                       extra=["--deterministic"],
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
    diffs = _output_diffs(orig, fmodel, plan.feeds, ref, got, rtol, atol)
    boundaries = []
    for t in wanted:
        d = judge(t, ref[t], got.get(t), ref.get(f"run1/{t}"), rtol, atol)
        d.upstream_fused = sorted(n for n, (ins, outs) in bounds.items() if t in ins + outs)
        boundaries.append(d)
    if wanted and any(d.status == "MISMATCH" for d in diffs):
        # onnxruntime-training 1.19.2 plans some graphs wrong without buffer reuse, and lets
        # buffers behind probes be overwritten with it (runtime_worker.session_options): the
        # outputs are judged once more on both models as they are (their stochastic ops seeded
        # alike, no probes), buffer reuse on
        plain = []
        for model in (orig, fmodel):
            seeded = onnx.ModelProto()
            seeded.CopyFrom(model)
            pin_seeds(seeded)
            plain.append(seeded)
        with _written([(plain[0], original), (plain[1], fused)]) as paths:
            plain = [run_in_runtime(path, plan.feeds, python, library=lib,
                                    extra=["--deterministic", "--reuse"],
                                    more_feeds=[_perturbed(plan.feeds, seed)] * (k == 0))[0]
                     for k, path in enumerate(paths)]
        again = _output_diffs(orig, fmodel, plan.feeds, *plain, rtol, atol)
        if all(d.ok for d in again):
            diffs = again
            for d in boundaries:
                if not d.ok:
                    d.ok, d.status = True, PROBES_DIFFER
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


# a boundary tensor's status when only the runs with probes differ there (verify_models)
PROBES_DIFFER = "not judged (the runs with probes differ; the outputs without probes agree)"


def _output_diffs(orig: onnx.ModelProto, fmodel: onnx.ModelProto, feeds: dict, ref: dict,
                  got: dict, rtol: float, atol: float) -> list[OutputDiff]:
    """Every graph output of the original, and every fed buffer a run wrote into
    (ort-training's gradient buffers), judged: the fused run's against the original's."""
    inplace = sorted(k for k in ref if k.startswith("fed/") and (
        not np.array_equal(ref[k], feeds[k[4:]])
        or (k in got and not np.array_equal(got[k], feeds[k[4:]]))))
    diffs = []
    for name in [o.name for o in orig.graph.output] + inplace:
        d = judge(name, ref[name], got.get(name), ref.get(f"run1/{name}"), rtol, atol)
        if not d.ok:
            d.upstream_fused = _upstream_fused(fmodel, name.removeprefix("fed/"))
        diffs.append(d)
    return diffs


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

    from fusecli.ops.reference import reference_ops

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
    from fusecli.engine.fusion import replaced_of, rule_of

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
        replaced = replaced_of(n)
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
    lib = None
    if _has_fused(orig):       # an original that already holds fused ops
        from fusecli.runtime.library import library_path

        lib = library_path()
    with _written([(probe, original_path)]) as (ppath,):
        values, _ = run_in_runtime(ppath, plan.feeds, python, library=lib,
                                   extra=["--deterministic"])
    values = _unprobe(values)
    values.update(plan.feeds)
    # replace.prepare's standard nodes (a mask divided by the scale), which a later record's
    # fused nodes may read too: their outputs first, from the original's tensors
    for n in (n for _, n in nodes if n.domain != FUSED_DOMAIN):
        values.update(_reference_outputs(n, values, known))
    checks = []
    for r in records:
        diffs = _reference_diffs(r.node, values, known, rtol, atol)
        extra = [n for n in getattr(r, "extra", ()) if n.domain == FUSED_DOMAIN]
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

    from fusecli.ops.reference import reference_ops

    got = ReferenceEvaluator(_single_node_model(node, values), new_ops=reference_ops()).run(
        None, {i: values[i] for i in node.input if i})
    return {o: g for o, g in zip([o for o in node.output if o], got) if o not in known}
