"""fusecli's Python API: what every command does, as calls an export pipeline can make.

    import fusecli
    result = fusecli.optimize("training_model.onnx")          # load -> check -> fuse
    print(result.fused, result.skipped, result.bytes_removed)
    fusecli.save(result, "training_model.fused.onnx")         # the CLI's transactional write
    report = fusecli.verify("training_model.onnx", "training_model.fused.onnx")
    assert report.verdict == "PASS"

Errors are the exception classes the CLI maps to exit codes (``fusecli.errors``): a
``ModelError`` / ``RuleError`` / ``FuseError`` for bad input (exit 2), ``CheckFailed`` for a
mismatch (exit 1). The CLI (``fusecli.commands``) only parses options and prints what these
return.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from fusecli.engine import fusion
from fusecli.engine.rules import Rule
from fusecli.errors import FuseError, ModelError
from fusecli.io.rulefiles import load_rules

PathLike = str | os.PathLike
RulesArg = Sequence[PathLike] | Sequence[Rule] | PathLike | None


def _rules(rules: RulesArg) -> list[Rule]:
    if isinstance(rules, (str, os.PathLike)):
        return load_rules([rules])
    rules = list(rules or ())
    if rules and all(isinstance(r, Rule) for r in rules):
        return rules
    return load_rules(rules or None)


class FusionPass(fusion.FusionPass):
    """The engine's pass with rule loading: ``FusionPass()`` uses the shipped rules; ``rules``
    may be ``Rule`` objects or rule file/folder paths (``fusecli.load_rules``)."""

    def __init__(self, rules: RulesArg = None, only: Iterable[str] = (),
                 skip: Iterable[str] = (), progress: Callable[[str], None] | None = None,
                 kernels: Iterable[str] | None = None, provider: str = "any"):
        super().__init__(_rules(rules), only=only, skip=skip, progress=progress,
                         kernels=kernels, provider=provider)


def fusion_pass(rules: RulesArg = None, only: Iterable[str] = (), skip: Iterable[str] = (),
                provider: str = "any") -> FusionPass:
    """A FusionPass over ``rules`` that refuses unknown ``only``/``skip`` names and, with
    ``provider`` "cpu" or "cuda", fuses only where the library has a kernel for it, and only
    the element types that provider's kernels implement ("any": the types both implement)."""
    loaded = _rules(rules)
    known = {r.pattern for r in loaded} | {r.name for r in loaded}
    for name in list(only) + list(skip):
        if name not in known:
            raise FuseError(f"--only/--skip: no rule or pattern named '{name}'; see "
                            "`fusecli rules list`")
    kernels = None
    if provider != "any":
        from fusecli.runtime.library import kernel_ops

        kernels = kernel_ops(provider)
    return FusionPass(loaded, only=only, skip=skip, kernels=kernels, provider=provider)


@dataclass
class Result:
    """What ``optimize`` did: the fused model and the run's statistics."""

    model: onnx.ModelProto                 # the fused model (the input, rewritten)
    source: Path | None                    # the file it was loaded from (external data)
    stats: fusion.Stats                    # per-pattern / per-rule counters of this run
    warnings: list[str] = field(default_factory=list)   # non-fatal graph problems
    verify: object | None = None           # a VerifyReport when optimize(verify=True)
    saved_to: Path | None = None
    budget: object | None = None           # a recompute.BudgetReport with max_memory

    @property
    def fused(self) -> dict[str, int]:
        """Fused chains per pattern (canonical order)."""
        return {k: v.fused for k, v in self.stats.patterns.items()}

    @property
    def total_fused(self) -> int:
        return self.stats.total_fused

    @property
    def skipped(self) -> list[dict]:
        """Every detected chain left unfused: rule, pattern, anchor node, reason, detail."""
        return [{"rule": s.rule, "pattern": s.pattern, "anchor": s.anchor,
                 **s.failure.as_dict()} for s in self.stats.skips]

    @property
    def bytes_removed(self) -> int | None:
        """Bytes of the intermediate tensors the fused chains no longer write (None when a
        shape is symbolic). A sum of buffer sizes, not a peak-memory figure: see
        `saved_activations` and bench."""
        return self.stats.bytes_eliminated

    @property
    def saved_activations(self) -> dict:
        """Saved activations (tensors the forward writes and the backward reads, which live
        from forward to backward and so set the step's peak; fusecli/engine/saved.py) that
        the fusion removed and added: counts, and bytes as an int, a polynomial in the
        symbolic dimensions ('8*S*S'), or None when a shape is unknown; `net_bytes_removed`
        = removed - added."""
        return self.stats.saved_dict()

    @property
    def has_gradient_nodes(self) -> bool:
        for n in self.model.graph.node:
            if ("Grad" in n.op_type or any("_grad" in o for o in n.output)
                    or n.domain == fusion.FUSED_DOMAIN):
                return True
        return False

    def as_dict(self) -> dict:
        """The JSON report of ``fusecli optimize --json``."""
        d = self.stats.as_dict(str(self.source) if self.source else "")
        if self.verify is not None:
            d["verify"] = self.verify.as_dict()
        if self.budget is not None:
            d["memory_budget"] = self.budget.as_dict()
            d["nodes_after"] = len(self.model.graph.node)
        return d


def load(path: PathLike) -> onnx.ModelProto:
    """Load a model file as fusecli does: checked, one-line ``ModelError`` on a bad file,
    external data left on disk (``save`` copies it)."""
    from fusecli.io.model import load_model

    return load_model(path)


def check(model: onnx.ModelProto) -> list[str]:
    """Fatal graph problems raise ``ModelError``; the rest come back as warnings."""
    from fusecli.engine.sanity import check_graph

    return list(check_graph(model))


def output_path(model: PathLike, output: PathLike, in_place: bool = False) -> Path:
    """The path ``save`` will write for a model loaded from ``model``, after refusing what must
    not be written (the input itself unless ``in_place``, a folder, a link, a missing folder)."""
    from fusecli.io.model import check_output_path

    return check_output_path(model, output, in_place)


def optimize(model: PathLike | onnx.ModelProto, rules: RulesArg = None,
             only: Iterable[str] = (), skip: Iterable[str] = (), *, provider: str = "any",
             verify: bool = False, output: PathLike | None = None, in_place: bool = False,
             feeds: PathLike | None = None, max_memory: int | str | None = None,
             dims: dict[str, int] | None = None, estimate_only: bool = False,
             log: Callable[[str], None] | None = None) -> Result:
    """Fuse ``model`` (a path, or a ModelProto that is rewritten in place) with ``rules``
    (default: the shipped rules); ``only``/``skip`` select patterns or rules by name.

    With ``output`` the result is saved there (``save``); with ``verify`` the saved result is
    checked against the original on its runtime (``verify``; without ``output`` it is written
    to a temporary folder for that). ``feeds``: an .npz of inputs for verify and for the
    measured memory budget. ``log`` receives
    the lines the CLI prints on stderr (warnings, progress on large graphs, "wrote PATH").
    Raises the ``fusecli.errors`` exceptions; a failed verify is reported in
    ``result.verify``, not raised.

    ``max_memory`` (bytes, or a size such as "512MiB" / "1.5GB"): after fusion, recompute
    forward tensors in the backward until the step's peak, measured on onnxruntime as
    ``fusecli bench`` measures it, fits (with ``estimate_only``: until the estimated saved
    activations fit, nothing run); docs/memory-budget.md; ``result.budget`` says what was
    recomputed; an unreachable budget raises FuseError. ``dims``: values of symbolic
    dimensions for the estimate and the measurement's feeds.
    """
    say = log or (lambda _msg: None)
    budget = None
    if max_memory is not None:
        from fusecli.engine.recompute import parse_size

        budget = parse_size(max_memory)
    dest = None
    if isinstance(model, onnx.ModelProto):
        if in_place:
            raise FuseError("in_place needs a model path")
        m, source = model, None
    else:
        source = Path(model)
        if output is not None:
            dest = output_path(source, output, in_place)
    fp = fusion_pass(rules, only, skip, provider)
    if source is not None:
        m = load(source)
    warnings = check(m)
    for w in warnings:
        say(f"warning: {w}")
    if log is not None and len(m.graph.node) >= 5000:
        say(f"fusecli: {len(m.graph.node)} nodes, matching {len(fp.rules)} rules ...")
        fp.progress = lambda msg: say(f"fusecli: {msg}")
    fp.run(m)
    result = Result(m, source, fp.stats, warnings)
    if budget is not None and estimate_only:
        from fusecli.engine.recompute import apply_budget

        result.budget = apply_budget(m, budget, dims)
    elif budget is not None:
        from fusecli.runtime.budget import measured_budget

        result.budget = measured_budget(m, budget, dims, source, feeds, log=say)
    if budget is not None:
        for line in result.budget.lines():
            say(line)
    if result.total_fused == 0 and not result.has_gradient_nodes:
        say(f"note: {source or 'the model'} has no gradient nodes; nothing to fuse (is it a "
            "training graph?)")
    if output is not None:
        save(result, dest or output, in_place=in_place)
        say(f"wrote {result.saved_to}")
    if verify:
        result.verify = _verify_result(result, feeds)
    return result


def _verify_result(result: Result, feeds: PathLike | None):
    """Verify ``result`` against the file it came from; an unsaved result is written to a
    temporary folder for it (and ``saved_to`` stays None)."""
    if result.source is None:
        raise FuseError("verify needs the original model as a file: pass a path to "
                        "optimize() (the ModelProto given was rewritten in place)")
    if result.saved_to is not None:
        return verify(result.source, result.saved_to, feeds=feeds)
    with tempfile.TemporaryDirectory(prefix="fusecli-verify-") as tmp:
        fused = save(result, Path(tmp) / "fused.onnx")
        result.saved_to = None
        return verify(result.source, fused, feeds=feeds)


def save(result: Result | onnx.ModelProto, path: PathLike, source: PathLike | None = None,
         in_place: bool = False) -> Path:
    """Write a fused model transactionally (the CLI's write: a complete model and its external
    data, or the previous file untouched; never the input unless ``in_place``)."""
    from fusecli.io.model import check_output_path, external_locations, save_model

    if isinstance(result, Result):
        model, src = result.model, source or result.source
    else:
        model, src = result, source
    if src is None:             # a ModelProto built or loaded in memory: no input file to keep
        if external_locations(model):
            raise ModelError("this model keeps its weights in external data files: give "
                             "source=PATH of the file it was loaded from")
        src, in_place = Path(path), True
    dest = check_output_path(src, path, in_place)
    save_model(model, dest, src)
    if isinstance(result, Result):
        result.saved_to = dest
    return dest


def verify(original: PathLike, fused: PathLike, *, seed: int = 0, rtol: float = 1e-5,
           atol: float = 1e-6, dims: dict[str, int] | None = None,
           runtime_python: str | None = None, feeds: PathLike | None = None):
    """Check that ``fused`` computes what ``original`` computes (``fusecli verify``): both run on
    the same feeds in the graph's runtime, optimizations off; returns a ``VerifyReport``
    (``.verdict`` is "PASS", "FAIL" or "INCONCLUSIVE"; ``.mismatched``, ``.inconclusive``)."""
    from fusecli.runtime.verify import verify_models

    return verify_models(original, fused, seed=seed, rtol=rtol, atol=atol, dims=dims or {},
                         runtime_python=runtime_python, feeds_file=feeds)


def stats(model: PathLike | onnx.ModelProto, rules: RulesArg = None,
          provider: str = "any", log: Callable[[str], None] | None = None) -> dict:
    """What would fuse (nothing is written, a ModelProto given is not changed), what was
    skipped and why, and the fused ops the model already holds (``fusecli stats --json``);
    ``log`` receives the graph's warnings."""
    from fusecli.engine.report import fused_inventory

    fp = fusion_pass(rules, provider=provider)
    if isinstance(model, onnx.ModelProto):
        m = onnx.ModelProto()
        m.CopyFrom(model)
    else:
        m = load(model)
    for w in check(m):
        if log is not None:
            log(f"warning: {w}")
    inv = fused_inventory(m)
    fp.run(m)
    d = fp.stats.as_dict(str(model) if not isinstance(model, onnx.ModelProto) else "")
    d["already_fused"] = inv
    d["skips"] = Result(m, None, fp.stats).skipped
    return d


def explain(model: PathLike | onnx.ModelProto, rules: RulesArg = None,
            rule_names: Iterable[str] = (), node_names: Iterable[str] = (),
            provider: str = "any") -> list[dict]:
    """Near misses (``fusecli explain``): per candidate, the deepest partial match and the
    constraint that failed. With ``rule_names`` or ``node_names``, shallow misses too."""
    from fusecli.engine.explain import explain_model

    rule_names, node_names = tuple(rule_names), tuple(node_names)
    fp = fusion_pass(rules, only=rule_names, provider=provider)
    m = load(model) if not isinstance(model, onnx.ModelProto) else model
    return explain_model(m, fp, node_names=node_names,
                         include_shallow=bool(rule_names or node_names))


def regressions(result: Result | dict, expect: PathLike | dict[str, int] | None = None,
                baseline: PathLike | dict | None = None) -> list[str]:
    """The CI gate of ``fusecli optimize --expect/--baseline``: one line per pattern or rule
    that fused fewer chains than ``expect`` (a mapping name -> minimum count, or a YAML/JSON
    file of one) or than ``baseline`` (a previous ``--json`` report, or its file) says; an
    empty list when every expectation holds."""
    from fusecli.io.expectations import check_expectations, load_baseline, load_expectations

    if expect is not None and not isinstance(expect, dict):
        expect = load_expectations(expect)
    if baseline is not None and not isinstance(baseline, dict):
        baseline = load_baseline(baseline)
    report = result.as_dict() if isinstance(result, Result) else result
    return check_expectations(report, expect or {}, baseline)


def bench(original: PathLike, fused: PathLike, **options) -> dict:
    """Time ``fused`` against ``original`` side by side (``fusecli bench``); ``options`` as
    ``fusecli.runtime.bench.run_bench``. Returns its summary (medians, speed-up, peak memory)."""
    from fusecli.runtime.bench import run_bench, summary

    res = run_bench(original, fused, **options)
    s = summary(res)
    s["feed_lines"] = res.get("feed_lines", [])
    return s
