"""``fusecli explain MODEL``: why rules did not fuse (api.explain)."""

from __future__ import annotations

from pathlib import Path

import click

from fusecli.commands.options import JSON, PROVIDER, RULES
from fusecli.commands.output import echo_json, echo_line


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@RULES
@click.option("--rule", "rule_names", multiple=True, help="Explain only this rule (repeatable).")
@click.option("--node", "node_names", multiple=True,
              help="Explain only candidates that involve this node (repeatable).")
@JSON
@PROVIDER
def explain(model, rules, rule_names, node_names, as_json, provider):
    """Explain why rules did not fuse in MODEL.

    For every candidate where a rule started to match and failed: the deepest partial match
    (rule node -> graph node) and the exact constraint that failed. With --rule or --node,
    candidates that failed on their first node are listed too.
    """
    from fusecli import api

    misses = api.explain(model, rules, rule_names=rule_names, node_names=node_names,
                         provider=provider)
    if as_json:
        echo_json({"model": str(model), "misses": misses})
        return
    if not misses:
        echo_line(f"{model}: no near misses" + (" for the selection" if rule_names or node_names
                                                  else ""))
        return
    for miss in misses:
        bound = ", ".join(f"{k}={v}" for k, v in miss["bound"].items()) or "(nothing bound)"
        where = f" at rule node '{miss['node']}'" if miss["node"] else ""
        echo_line(f"{miss['rule']} ({miss['pattern']}) anchored at {miss['anchor']}:")
        echo_line(f"  matched {miss['depth']} node(s): {bound}")
        echo_line(f"  failed{where}: [{miss['reason']}] {miss['detail']}")
