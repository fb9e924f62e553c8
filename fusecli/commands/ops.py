"""``fusecli ops [NAME]`` and ``fusecli library-path``: the fused ops and their library."""

from __future__ import annotations

import click

from fusecli.errors import FuseError


@click.command("ops")
@click.argument("name", required=False)
def ops_cmd(name):
    """List the fused ops, or print the contract of the op NAME.

    The contracts live in fusecli/ops/<op>/contract.yaml, shared by the rules, the NumPy
    references and the C++/CUDA kernels.
    """
    from fusecli.ops.contracts import load_contracts

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


@click.command("library-path")
def library_path_cmd():
    """Print the absolute path of fusecli's onnxruntime custom-op library."""
    from fusecli.runtime.library import library_path

    click.echo(library_path())
