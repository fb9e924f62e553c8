"""``fusecli stats MODEL``: what would fuse, what was skipped and why (api.stats)."""

from __future__ import annotations

from pathlib import Path

import click

from fusecli.commands.options import JSON, PROVIDER, RULES
from fusecli.commands.output import echo_json, echo_line, log, one_line


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@RULES
@JSON
@PROVIDER
def stats(model, rules, as_json, provider):
    """Report what would fuse in MODEL, what was skipped and why, and fused ops present.

    Nothing is written. On an already fused model it lists the fused ops it holds.
    """
    from fusecli import api
    from fusecli.engine.report import inventory_table, stats_table

    d = api.stats(model, rules, provider=provider, log=lambda m: log(False, m))
    if as_json:
        echo_json(d)
        return
    click.echo(stats_table(d, one_line(f"{model}: {d['total_fused']} chains would fuse")))
    for s in d["skips"]:
        echo_line(f"  skipped {s['rule']} at {s['anchor']}: {s['reason']}: {s['detail']}")
    inv = {k: {one_line(name): n for name, n in v.items()}      # op and rule names: one line
           for k, v in d["already_fused"].items()}
    if inv["fused_ops"]:
        click.echo(inventory_table(inv, "fused ops already in the model:"))
