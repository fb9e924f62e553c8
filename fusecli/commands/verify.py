"""``fusecli verify ORIGINAL FUSED``: does the fused model compute what the original does
(api.verify)."""

from __future__ import annotations

from pathlib import Path

import click

from fusecli.commands.options import FEEDS, JSON, RUNTIME_PYTHON, SEED, TOLERANCE
from fusecli.commands.output import echo_json, print_verify, report_mismatches, verify_exit


@click.command()
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
@FEEDS
@JSON
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
    from fusecli import api
    from fusecli.runtime.feeds import parse_dims

    report = api.verify(original, fused, seed=seed, rtol=rtol, atol=atol,
                        dims=parse_dims(dims),
                        runtime_python=str(runtime_python) if runtime_python else None,
                        feeds=feeds_file)
    if as_json:
        echo_json(report.as_dict())
    else:
        print_verify(report, original, fused)
    report_mismatches(report)
    verify_exit(report)
