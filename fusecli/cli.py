"""The fusecli command line: a thin layer over the Python API.

Exit codes (shared by every command): 0 success; 1 a check failed; 2 bad input or usage;
3 a CI expectation was not met; 4 internal error; 5 verify could not judge (inconclusive).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import click

from . import errors
from .errors import FuseError
from .options import RUNTIME_PYTHON, SEED, TOLERANCE


def _echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=None, sort_keys=False))


def _log(ctx_quiet: bool, msg: str) -> None:
    if not ctx_quiet:
        click.echo(msg, err=True)


_RULES = click.option("--rules", "rules", multiple=True, type=click.Path(path_type=Path),
                      help="Rule file or folder (repeatable). Default: the shipped rules.")
_JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
_FEEDS = click.option("--feeds", "feeds_file", type=click.Path(path_type=Path),
                      help="NumPy .npz of arrays keyed by graph input name; the inputs it "
                           "lacks are generated from the graph (README: Verify).")
_PROVIDER = click.option(
    "--provider", type=click.Choice(["any", "cpu", "cuda"]), default="any", show_default=True,
    help="Fuse only where fusecli's library has a kernel for this execution provider.")


def _load_pass(rules, only=(), skip=(), provider="any"):
    from .fusion import FusionPass
    from .library import kernel_ops
    from .rules import load_rules

    loaded = load_rules(list(rules) or None)
    known = {r.pattern for r in loaded} | {r.name for r in loaded}
    for name in list(only) + list(skip):
        if name not in known:
            raise FuseError(f"--only/--skip: no rule or pattern named '{name}'; see "
                            "`fusecli rules list`")
    kernels = None if provider == "any" else kernel_ops(provider)
    return FusionPass(rules=loaded, only=only, skip=skip, kernels=kernels)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fusecli")
def cli():
    """Fuse backward chains of ONNX training graphs into fused custom ops.

    Rules are YAML files (rules/); fused ops run through fusecli's onnxruntime custom-op
    library (`fusecli library-path`).
    """


@cli.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Where to write the fused "
              "model (required unless --dry-run).")
@_RULES
@click.option("--only", multiple=True, help="Apply only this pattern or rule (repeatable).")
@click.option("--skip", multiple=True, help="Do not apply this pattern or rule (repeatable).")
@click.option("--dry-run", is_flag=True, help="Match and report, write nothing.")
@click.option("--in-place", is_flag=True, help="Allow -o to be the input file.")
@_JSON
@click.option("-q", "--quiet", is_flag=True, help="No log lines on stderr.")
@click.option("--verify", "do_verify", is_flag=True,
              help="Run `fusecli verify` on the written output (exit 1 on a mismatch).")
@click.option("--expect", type=click.Path(path_type=Path),
              help="YAML/JSON mapping pattern-or-rule -> minimum fused count (exit 3 if below).")
@click.option("--baseline", type=click.Path(path_type=Path),
              help="A previous --json report; exit 3 if any fused count drops below it.")
@_FEEDS
@_PROVIDER
def optimize(model, output, rules, only, skip, dry_run, in_place, as_json, quiet, do_verify,
             expect, baseline, feeds_file, provider):
    """Fuse MODEL and write the result to OUTPUT.

    MODEL is an ONNX training graph (onnxruntime-training artifact or torch joint graph).
    Prints a per-pattern table (or JSON with --json) on stdout; logs go to stderr. The input
    file is never modified; the output is written atomically.
    """
    from .ci import check_expectations, load_baseline, load_expectations
    from .modelio import check_output_path, load_model, save_model
    from .report import stats_table

    if output is None and not dry_run:
        raise click.UsageError("missing -o/--output (or pass --dry-run)")
    if do_verify and dry_run:
        raise click.UsageError("--verify needs a written output; drop --dry-run")
    if feeds_file is not None and not do_verify:
        raise click.UsageError("--feeds is for --verify; add --verify")
    dest = check_output_path(model, output, in_place) if output is not None else None
    wanted = load_expectations(expect) if expect else {}
    base = load_baseline(baseline) if baseline else None
    fp = _load_pass(rules, only, skip, provider)
    m = load_model(model)
    _sanity(m, quiet)
    if len(m.graph.node) >= 5000 and not quiet:
        click.echo(f"fusecli: {len(m.graph.node)} nodes, matching {len(fp.rules)} rules ...",
                   err=True)
        fp.progress = lambda msg: click.echo(f"fusecli: {msg}", err=True)
    fp.run(m)
    d = fp.stats.as_dict(str(model))
    if fp.stats.total_fused == 0 and not _has_gradient_nodes(m):
        _log(quiet, f"note: {model} has no gradient nodes; nothing to fuse (is it a training "
             "graph?)")
    if not dry_run:
        save_model(m, dest, model)
        _log(quiet, f"wrote {dest}")
    report = None
    if do_verify:
        from .verify import verify_models

        report = verify_models(model, dest, feeds_file=feeds_file)
    if as_json:
        if report is not None:
            d["verify"] = report.as_dict()
        _echo_json(d)
    else:
        verb = "would fuse" if dry_run else "fused"
        click.echo(stats_table(d, f"{model}: {verb} {d['total_fused']} chain(s)"))
        if report is not None and not quiet:
            _print_verify(report, model, dest)
    if report is not None:
        _report_mismatches(report)
    problems = check_expectations(d, wanted, base)
    for line in problems:
        click.echo(f"fusecli: regression: {line}", err=True)
    if problems:
        raise SystemExit(errors.EXIT_EXPECTATION)
    if report is not None:
        _verify_exit(report)


def _sanity(model, quiet: bool) -> None:
    """Fatal graph problems raise a one-line ModelError; the rest are warnings on stderr."""
    from .sanity import check_graph

    for warning in check_graph(model):
        _log(quiet, f"warning: {warning}")


def _print_verify(report, original, fused) -> None:
    click.echo(f"verify: {Path(original).name} vs {Path(fused).name} in {report.runtime} "
               f"(graph optimizations off, {report.deterministic}, rtol={report.rtol:g}, "
               f"atol={report.atol:g})")
    click.echo("  feeds: " + "; ".join(report.feed_lines))
    if report.seeds_pinned:
        click.echo(f"  stochastic ops seeded alike in both models: "
                   f"{', '.join(report.seeds_pinned)}")
    w = max((len(d.name) for d in report.outputs), default=10)
    for d in report.outputs:
        # an output whose reference is (numerically) zero is judged by atol alone
        zero = d.max_ref <= report.atol
        rel = "  (zero)  " if zero else f"{d.rel:.3e}"
        noise = "   -   " if zero else f"{d.noise_rel:.1e}"
        click.echo(f"  {d.name:<{w}}  max_abs {d.max_abs:.3e}  max_rel {rel}  "
                   f"noise {noise}  {d.status}")
    bad = [d for d in report.boundaries if not d.ok]
    click.echo(f"  fused-node boundary tensors: {len(report.boundaries)} compared, "
               f"{len(bad)} mismatched" + "".join(f"; {d.name} (max_rel {d.rel:.3e}, at "
                                                  f"{', '.join(d.upstream_fused)})" for d in bad[:3]))
    if report.fusion_checks is not None:
        nbad = sum(not c.ok for c in report.fusion_checks)
        click.echo(f"  {len(report.noisy)} output(s) too sensitive to judge on the whole model "
                   f"(noise floor > {report.as_dict()['noise_limit']:g}): checked each of "
                   f"{len(report.fusion_checks)} fusion(s) at its boundary instead (NumPy "
                   f"reference and fused kernel on the original's tensors): {nbad} failed")
    runs = ", ".join(f"{k} x{v}" for k, v in sorted(report.fused_kernel_runs.items()))
    click.echo(f"  fused kernels executed: {runs or 'none'}")
    for why in report.inconclusive:
        click.echo(f"  cannot judge: {why}")
    floor = max((d.noise_rel for d in report.outputs if d.max_ref > report.atol), default=0.0)
    click.echo(f"  max relative error {report.max_rel:.3e} (noise floor up to {floor:.1e}): "
               f"{report.verdict}")


def _report_mismatches(report) -> None:
    for d in report.outputs:
        if not d.ok:
            click.echo(f"fusecli: mismatch in {d.name} (max abs {d.max_abs:.3e}); fused nodes "
                       f"upstream: {', '.join(d.upstream_fused) or 'none'}", err=True)
    bad = [d for d in report.boundaries if not d.ok]
    for d in bad[:5]:
        click.echo(f"fusecli: mismatch at fused-node boundary tensor {d.name} (max abs "
                   f"{d.max_abs:.3e}); fused nodes: {', '.join(d.upstream_fused)}", err=True)
    if len(bad) > 5:
        click.echo(f"fusecli: ... and {len(bad) - 5} more fused-node boundary tensors (--json "
                   "lists them)", err=True)
    for c in report.fusion_checks or ():
        if not c.ok:
            click.echo(f"fusecli: mismatch in fused node {c.fused_node} (rule {c.rule}) on the "
                       "original's boundary tensors", err=True)
    if not report.mismatched:
        for why in report.inconclusive:
            click.echo(f"fusecli: inconclusive: {why}; pass --feeds FILE.npz with real inputs",
                       err=True)


def _verify_exit(report) -> None:
    if report.mismatched:
        raise SystemExit(errors.EXIT_CHECK_FAILED)
    if report.inconclusive:
        raise SystemExit(errors.EXIT_INCONCLUSIVE)


@cli.command()
@click.argument("original", type=click.Path(path_type=Path))
@click.argument("fused", type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True, type=SEED,
              help="Seed of the random feeds.")
@click.option("--rtol", default=1e-5, show_default=True, type=TOLERANCE,
              help="Relative tolerance (of max |ref|).")
@click.option("--atol", default=1e-6, show_default=True, type=TOLERANCE,
              help="Absolute tolerance.")
@click.option("--dim", "dims", multiple=True, help="Symbolic dimension NAME=VALUE (repeatable).")
@click.option("--runtime-python", type=RUNTIME_PYTHON,
              help="Python whose onnxruntime runs the models (default: picked by the graph).")
@_FEEDS
@_JSON
def verify(original, fused, seed, rtol, atol, dims, runtime_python, feeds_file, as_json):
    """Check that FUSED computes what ORIGINAL computes.

    Runs both models on the same feeds in the same runtime (onnxruntime-training for
    ort-training graphs), graph optimizations off, one intra-op thread, stochastic ops seeded
    alike, and judges every output (with the gradients written in place into accumulation
    buffers) and every fused node's boundary tensors against max(tolerance, the original's own
    noise floor). Feeds: --feeds FILE.npz, else a sample's parameters, else realistic values
    recognised from the graph (fan-in scaled weights, norm scales 1, biases 0, token ids and
    labels in range, causal/padding masks). Exit 1 on a mismatch, 5 when it cannot judge.
    """
    from .feeds import parse_dims
    from .verify import verify_models

    report = verify_models(original, fused, seed=seed, rtol=rtol, atol=atol,
                           dims=parse_dims(dims),
                           runtime_python=str(runtime_python) if runtime_python else None,
                           feeds_file=feeds_file)
    if as_json:
        _echo_json(report.as_dict())
    else:
        _print_verify(report, original, fused)
    _report_mismatches(report)
    _verify_exit(report)


def _has_gradient_nodes(model) -> bool:
    for n in model.graph.node:
        if "Grad" in n.op_type or any("_grad" in o for o in n.output) or n.domain == "com.fusecli":
            return True
    return False


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@_RULES
@_JSON
@_PROVIDER
def stats(model, rules, as_json, provider):
    """Report what would fuse in MODEL, what was skipped and why, and fused ops present.

    Nothing is written. On an already fused model it lists the fused ops it holds.
    """
    from .modelio import load_model
    from .report import fused_inventory, inventory_table, stats_table

    fp = _load_pass(rules, provider=provider)
    m = load_model(model)
    _sanity(m, False)
    inv = fused_inventory(m)
    fp.run(m)  # detection only: the rewritten model is reported on, never written
    d = fp.stats.as_dict(str(model))
    d["already_fused"] = inv
    d["skips"] = [{"rule": s.rule, "pattern": s.pattern, "anchor": s.anchor,
                   **s.failure.as_dict()} for s in fp.stats.skips]
    if as_json:
        _echo_json(d)
        return
    click.echo(stats_table(d, f"{model}: {d['total_fused']} chains would fuse"))
    for s in fp.stats.skips:
        click.echo(f"  skipped {s.rule} at {s.anchor}: {s.failure.reason}: {s.failure.detail}")
    if inv["fused_ops"]:
        click.echo(inventory_table(inv, "fused ops already in the model:"))


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@_RULES
@click.option("--rule", "rule_names", multiple=True, help="Explain only this rule (repeatable).")
@click.option("--node", "node_names", multiple=True,
              help="Explain only candidates that involve this node (repeatable).")
@_JSON
@_PROVIDER
def explain(model, rules, rule_names, node_names, as_json, provider):
    """Explain why rules did not fuse in MODEL.

    For every candidate where a rule started to match and failed: the deepest partial match
    (rule node -> graph node) and the exact constraint that failed. With --rule or --node,
    candidates that failed on their first node are listed too.
    """
    from .explain import explain_model
    from .modelio import load_model

    fp = _load_pass(rules, only=rule_names, provider=provider)
    m = load_model(model)
    misses = explain_model(m, fp, node_names=node_names,
                           include_shallow=bool(rule_names or node_names))
    if as_json:
        _echo_json({"model": str(model), "misses": misses})
        return
    if not misses:
        click.echo(f"{model}: no near misses" + (" for the selection" if rule_names or node_names
                                                  else ""))
        return
    for miss in misses:
        bound = ", ".join(f"{k}={v}" for k, v in miss["bound"].items()) or "(nothing bound)"
        where = f" at rule node '{miss['node']}'" if miss["node"] else ""
        click.echo(f"{miss['rule']} ({miss['pattern']}) anchored at {miss['anchor']}:")
        click.echo(f"  matched {miss['depth']} node(s): {bound}")
        click.echo(f"  failed{where}: [{miss['reason']}] {miss['detail']}")


@cli.group("rules")
def rules_group():
    """List, show and validate rule files."""


def _attach_commands() -> None:
    from .bench.command import bench
    from .rulegen import rules_new

    rules_group.add_command(rules_new)
    cli.add_command(bench)


_attach_commands()


@rules_group.command("list")
@_RULES
@_JSON
def rules_list(rules, as_json):
    """List rules in application order."""
    from .rules import load_rules

    loaded = load_rules(list(rules) or None)
    if as_json:
        _echo_json([{"name": r.name, "pattern": r.pattern, "order": r.order, "family": r.family,
                     "fused_op": r.replace.op, "file": r.source} for r in loaded])
        return
    for r in loaded:
        click.echo(f"{r.order:>5}  {r.name:<28} {r.pattern:<14} -> {r.replace.op:<22} "
                   f"{r.family or ''}")


@rules_group.command("show")
@click.argument("name")
@_RULES
def rules_show(name, rules):
    """Print the rule NAME (its YAML file)."""
    from .rules import load_rules

    for r in load_rules(list(rules) or None):
        if r.name == name:
            click.echo(f"# {r.source}")
            click.echo(r.text.rstrip())
            return
    raise FuseError(f"no rule named '{name}'; see `fusecli rules list`")


@rules_group.command("validate")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
def rules_validate(paths):
    """Validate rule files or folders (default: the shipped rules)."""
    from .rules import load_rules

    loaded = load_rules(list(paths) or None)
    click.echo(f"{len(loaded)} rule(s) valid")


@cli.command("ops")
@click.argument("name", required=False)
def ops_cmd(name):
    """List the fused ops, or print the contract of the op NAME.

    The contracts live in fusecli/ops/<op>/contract.yaml, shared by the rules, the NumPy
    references and the C++/CUDA kernels.
    """
    from .contracts import load_contracts

    c = load_contracts()
    if name is None:
        for op in c.ops.values():
            click.echo(f"{c.domain}::{op.name:<22} {op.summary}")
        return
    if name not in c.ops:
        raise FuseError(f"no fused op named '{name}'; known: {', '.join(sorted(c.ops))}")
    op = c.ops[name]
    click.echo(f"{c.domain}::{op.name} (opset {c.version}) - {op.summary}")
    click.echo(f"  types: {', '.join(op.types)}")
    for kind, ports in (("inputs", op.inputs), ("outputs", op.outputs)):
        click.echo(f"  {kind}:")
        for i, p in enumerate(ports):
            click.echo(f"    {i}. {p.name}{' (optional)' if p.optional else ''}: {p.doc}")
    if op.attributes:
        click.echo("  attributes:")
        for k, v in op.attributes.items():
            click.echo(f"    {k}: {v}")
    click.echo("  math:")
    for line in op.math.rstrip().splitlines():
        click.echo(f"    {line}")


@cli.command("library-path")
def library_path_cmd():
    """Print the absolute path of fusecli's onnxruntime custom-op library."""
    from .library import library_path

    click.echo(library_path())


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    # the first SIGINT/SIGTERM unwinds (temporary files are removed on the way); later ones are
    # ignored so that the clean-up is not cut short and no traceback is printed
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise errors.Interrupted(signum)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7f]}


def one_line(text: str) -> str:
    """The text with control characters (newlines included) escaped: it stays one line."""
    return str(text).translate(_CONTROL)


def _error(msg: str) -> None:
    try:
        click.echo(f"fusecli: {one_line(msg)}", err=True)
    except (OSError, ValueError):      # stderr closed too: the exit code says it
        pass


def main(argv=None) -> int:
    for sig in _SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _on_signal)     # an ignored signal (nohup) stays ignored
    try:
        return _main(argv)
    except errors.Interrupted as exc:
        _error(f"interrupted by {signal.Signals(exc.signum).name}; nothing half-written was "
               "left behind")
        return exc.exit_code


def _main(argv) -> int:
    if sys.stdout is None:         # started with file descriptor 1 closed
        return _stdout_closed()
    try:
        cli.main(args=argv, prog_name="fusecli", standalone_mode=False)
        sys.stdout.flush()
        return errors.EXIT_OK
    except FuseError as exc:
        _error(f"error: {exc}")
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:  # a command's documented exit code (1 check failed, 3 CI)
        if type(sys.stdout).__name__ == "_PacifyFlushWrapper":   # click met EPIPE on stdout
            return _stdout_closed()
        return exc.code if isinstance(exc.code, int) else errors.EXIT_INTERNAL
    except click.ClickException as exc:
        _error(f"error: {exc.format_message()} (see --help)")
        return errors.EXIT_BAD_INPUT
    except (click.Abort, KeyboardInterrupt):
        _error("interrupted; nothing half-written was left behind")
        return 130
    except BrokenPipeError:
        return _stdout_closed()
    except OSError as exc:     # the environment refused (a path, a file system): not a defect
        where = f" {exc.filename}" if exc.filename else ""
        _error(f"error: cannot use{where}: {exc.strerror or exc}; check the path and the file "
               "system")
        return errors.EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - last resort: one line, exit 4
        if os.environ.get("FUSECLI_DEBUG"):
            raise
        _error(f"internal error: {type(exc).__name__}: {exc} (set FUSECLI_DEBUG=1 for a "
               "traceback and report it)")
        return errors.EXIT_INTERNAL


def _stdout_closed() -> int:
    _error("error: standard output is closed (or its reader went away); run fusecli with "
           "stdout open, e.g. redirected to a file")
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - nothing more may fail at exit
    return errors.EXIT_BAD_INPUT
