"""``fusecli rules list|show|validate|new``: the rule files."""

from __future__ import annotations

from pathlib import Path

import click

from fusecli.commands.options import JSON, RULES
from fusecli.commands.output import echo_json
from fusecli.errors import FuseError


@click.group("rules")
def rules_group():
    """List, show and validate rule files."""


@rules_group.command("list")
@RULES
@JSON
def rules_list(rules, as_json):
    """List rules in application order."""
    from fusecli.io.rulefiles import load_rules

    loaded = load_rules(list(rules) or None)
    if as_json:
        echo_json([{"name": r.name, "pattern": r.pattern, "order": r.order, "family": r.family,
                    "fused_op": r.replace.op, "file": r.source} for r in loaded])
        return
    for r in loaded:
        click.echo(f"{r.order:>5}  {r.name:<28} {r.pattern:<14} -> {r.replace.op:<22} "
                   f"{r.family or ''}")


@rules_group.command("show")
@click.argument("name")
@RULES
@click.option("--expanded", is_flag=True,
              help="Print every variant as the concrete pattern the matcher uses.")
def rules_show(name, rules, expanded):
    """Print the rule NAME: its YAML file as written, or with --expanded every variant as the
    concrete pattern the matcher uses (parameters substituted). NAME is a rule name
    (`fusecli rules list`) or a rule file's name without .yaml (--expanded: all its variants)."""
    from fusecli.engine.rules import expanded_text
    from fusecli.io.rulefiles import load_rules

    loaded = load_rules(list(rules) or None)
    by_name = [r for r in loaded if r.name == name]
    by_file = [r for r in loaded if Path(r.source).stem == name]
    hit = (by_file or by_name) if expanded else (by_name or by_file)
    if not hit:
        raise FuseError(f"no rule or rule file named '{name}'; see `fusecli rules list`")
    if not expanded:
        click.echo(f"# {hit[0].source}")
        click.echo(hit[0].text.rstrip())
        return
    for r in hit:
        click.echo(f"# {r.name} (from {r.source})")
        click.echo(expanded_text(r).rstrip())
        click.echo("---")


@rules_group.command("validate")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
def rules_validate(paths):
    """Validate rule files or folders (default: the shipped rules)."""
    from fusecli.io.rulefiles import load_rules

    loaded = load_rules(list(paths) or None)
    click.echo(f"{len(loaded)} rule(s) valid")


@rules_group.command("new")
@click.option("--from", "model_path", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="ONNX model holding an example of the pattern.")
@click.option("--nodes", "nodes", required=True,
              help="Comma-separated names of the example's nodes (as in the model).")
@click.option("--name", "name", required=True, help="Rule name (lower-case, digits, '_').")
@click.option("--op", "fused_op", default=None,
              help="Fused op to replace the subgraph with (default: one whose port counts fit).")
@click.option("--pattern", "pattern", default=None,
              help="Pattern name for --only/--skip and stats (default: from the fused op).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the draft here (default: print it).")
@click.option("--force", is_flag=True, help="Overwrite -o if it exists.")
def rules_new(model_path, nodes, name, fused_op, pattern, output, force):
    """Write a DRAFT rule from an example subgraph of MODEL (--nodes N1,N2,...).

    The draft matches the example; review the points listed in its header comment (input order
    of the fused op, its attributes, constraints to relax) before adding it to a rules folder.
    """
    from fusecli.engine.rulegen import count_matches, draft_rule
    from fusecli.io.model import check_text_output, load_model, save_text

    if output is not None:     # refused as `optimize -o` refuses: links, folders, special files
        check_text_output(output, force)
    model = load_model(model_path)
    text = draft_rule(model, nodes.split(","), name, fused_op=fused_op, pattern=pattern)
    n = count_matches(model, text)
    if output is None:
        click.echo(text, nl=False)
    else:
        save_text(text, output, force)
        click.echo(f"wrote {output}", err=True)
    more = f"; it also matches {n - 1} other place(s)" if n > 1 else ""
    click.echo(f"draft rule {name} matches its example in {model_path}{more}", err=True)
