"""The fusecli command line: a thin layer over the Python API.

Exit codes (shared by every command): 0 success; 1 a check failed; 2 bad input or usage;
3 a CI expectation was not met; 4 internal error.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import click

from . import errors
from .errors import FuseError


def _echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=None, sort_keys=False))


def _log(ctx_quiet: bool, msg: str) -> None:
    if not ctx_quiet:
        click.echo(msg, err=True)


def _load_pass(rules, only=(), skip=()):
    from .fusion import FusionPass
    from .rules import load_rules

    loaded = load_rules(list(rules) or None)
    known = {r.pattern for r in loaded} | {r.name for r in loaded}
    for name in list(only) + list(skip):
        if name not in known:
            raise FuseError(f"--only/--skip: no rule or pattern named '{name}'; see "
                            "`fusecli rules list`")
    return FusionPass(rules=loaded, only=only, skip=skip)


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
@click.option("--rules", "rules", multiple=True, type=click.Path(path_type=Path),
              help="Rule file or folder (repeatable). Default: the shipped rules.")
@click.option("--only", multiple=True, help="Apply only this pattern or rule (repeatable).")
@click.option("--skip", multiple=True, help="Do not apply this pattern or rule (repeatable).")
@click.option("--dry-run", is_flag=True, help="Match and report, write nothing.")
@click.option("--in-place", is_flag=True, help="Allow -o to be the input file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="No log lines on stderr.")
def optimize(model, output, rules, only, skip, dry_run, in_place, as_json, quiet):
    """Fuse MODEL and write the result to OUTPUT.

    MODEL is an ONNX training graph (onnxruntime-training artifact or torch joint graph).
    Prints a per-pattern table (or JSON with --json). The input file is never modified.
    """
    from .modelio import check_output_path, load_model, save_model
    from .report import stats_table

    if output is None and not dry_run:
        raise click.UsageError("missing -o/--output (or pass --dry-run)")
    dest = check_output_path(model, output, in_place) if output is not None else None
    fp = _load_pass(rules, only, skip)
    m = load_model(model)
    fp.run(m)
    d = fp.stats.as_dict(str(model))
    if fp.stats.total_fused == 0 and not _has_gradient_nodes(m):
        _log(quiet, f"note: {model} has no gradient nodes; nothing to fuse (is it a training "
             "graph?)")
    if not dry_run:
        save_model(m, dest, model)
        _log(quiet, f"wrote {dest}")
    if as_json:
        _echo_json(d)
    else:
        verb = "would fuse" if dry_run else "fused"
        click.echo(stats_table(d, f"{model}: {verb} {d['total_fused']} chains"))


def _has_gradient_nodes(model) -> bool:
    for n in model.graph.node:
        if "Grad" in n.op_type or "_grad" in "".join(n.output) or n.domain == "com.fusecli":
            return True
    return False


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--rules", "rules", multiple=True, type=click.Path(path_type=Path),
              help="Rule file or folder (repeatable). Default: the shipped rules.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def stats(model, rules, as_json):
    """Report what would fuse in MODEL, what was skipped and why, and fused ops present.

    Nothing is written. On an already fused model it lists the fused ops it holds.
    """
    from .modelio import load_model
    from .report import fused_inventory, inventory_table, stats_table

    fp = _load_pass(rules)
    m = load_model(model)
    inv = fused_inventory(m)
    fp.run(copy.deepcopy(m) if len(m.graph.node) < 50_000 else m)
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


@cli.group("rules")
def rules_group():
    """List, show and validate rule files."""


@rules_group.command("list")
@click.option("--rules", "rules", multiple=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
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
@click.option("--rules", "rules", multiple=True, type=click.Path(path_type=Path))
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


@cli.command("library-path")
def library_path_cmd():
    """Print the absolute path of fusecli's onnxruntime custom-op library."""
    from .library import library_path

    click.echo(library_path())


def main(argv=None) -> int:
    try:
        cli.main(args=argv, prog_name="fusecli", standalone_mode=False)
        return errors.EXIT_OK
    except FuseError as exc:
        click.echo(f"fusecli: error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        click.echo(f"fusecli: error: {exc.format_message()} (see --help)", err=True)
        return errors.EXIT_BAD_INPUT
    except click.Abort:
        click.echo("fusecli: aborted", err=True)
        return errors.EXIT_BAD_INPUT
    except KeyboardInterrupt:
        click.echo("fusecli: interrupted; no output was written", err=True)
        return 130
    except Exception as exc:  # noqa: BLE001 - last resort: one line, exit 4
        if os.environ.get("FUSECLI_DEBUG"):
            raise
        click.echo(f"fusecli: internal error: {type(exc).__name__}: {exc} (set FUSECLI_DEBUG=1 "
                   "for a traceback and report it)", err=True)
        return errors.EXIT_INTERNAL
