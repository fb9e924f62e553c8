"""``fusecli optimize MODEL -o OUTPUT``: fuse, write, optionally verify and gate (api.optimize)."""

from __future__ import annotations

from pathlib import Path

import click

from fusecli import errors
from fusecli.commands.options import DIMS, FEEDS, JSON, ONLY, PROVIDER, RULES, SIZE, SKIP
from fusecli.commands.report import REPORT, SUMMARY_MD, check_report_options, write_reports
from fusecli.commands.output import (echo_json, echo_line, one_line, print_verify, report_mismatches,
                                     verify_exit)


@click.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Where to write the fused "
              "model (required unless --dry-run).")
@RULES
@ONLY
@SKIP
@click.option("--dry-run", is_flag=True, help="Match and report, write nothing.")
@click.option("--in-place", is_flag=True, help="Allow -o to be the input file.")
@JSON
@click.option("-q", "--quiet", is_flag=True, help="No log lines on stderr.")
@click.option("--verify", "do_verify", is_flag=True,
              help="Run `fusecli verify` on the written output (exit 1 on a mismatch).")
@click.option("--expect", type=click.Path(path_type=Path),
              help="YAML/JSON mapping pattern-or-rule -> minimum fused count (exit 3 if below).")
@click.option("--baseline", type=click.Path(path_type=Path),
              help="A previous --json report; exit 3 if any fused count drops below it.")
@FEEDS
@PROVIDER
@click.option("--max-memory", "max_memory", type=SIZE, metavar="SIZE",
              help="Memory budget for one training step (512MiB, 1.5GB, bytes): recompute the "
                   "cheapest forward tensors in the backward until the step's peak, measured "
                   "on onnxruntime as `fusecli bench` does, fits (docs/memory-budget.md); exit "
                   "2 if it cannot.")
@click.option("--estimate-only", is_flag=True,
              help="With --max-memory: bound the estimated saved activations instead, without "
                   "running the model.")
@DIMS
@REPORT
@SUMMARY_MD
def optimize(model, output, rules, only, skip, dry_run, in_place, as_json, quiet, do_verify,
             expect, baseline, feeds_file, provider, max_memory, estimate_only, dims, report_file,
             summary_md):
    """Fuse MODEL and write the result to OUTPUT.

    MODEL is an ONNX training graph (onnxruntime-training artifact or torch joint graph).
    Prints a per-pattern table (or JSON with --json) on stdout; logs go to stderr. The input
    file is never modified; the output is written atomically.
    """
    from fusecli import api
    from fusecli.engine.report import stats_table
    from fusecli.io.expectations import load_baseline, load_expectations

    if output is None and not dry_run:
        raise click.UsageError("missing -o/--output (or pass --dry-run)")
    if do_verify and dry_run:
        raise click.UsageError("--verify needs a written output; drop --dry-run")
    if feeds_file is not None and not do_verify and (max_memory is None or estimate_only):
        raise click.UsageError("--feeds is for --verify and a measured --max-memory; add one")
    from fusecli.runtime.feeds import parse_dims

    dims = parse_dims(dims)
    if (dims or estimate_only) and max_memory is None:
        raise click.UsageError(f"{'--dim' if dims else '--estimate-only'} is for --max-memory; "
                               "add --max-memory SIZE")
    dest = api.output_path(model, output, in_place) if output is not None else None
    wanted = load_expectations(expect) if expect else {}
    base = load_baseline(baseline) if baseline else None
    check_report_options(report_file, summary_md)
    original = api.load(model) if report_file or summary_md else None
    result = api.optimize(model, rules, only, skip, provider=provider,
                          output=None if dry_run else dest, in_place=True, verify=do_verify,
                          feeds=feeds_file, max_memory=max_memory, dims=dims,
                          estimate_only=estimate_only,
                          log=None if quiet else lambda m: echo_line(m, err=True))
    if original is not None:
        from fusecli.report import collect

        write_reports(collect(model, result, original=original, fused_path=result.saved_to,
                              rules=rules, only=only, skip=skip, provider=provider),
                      report_file, summary_md, quiet)
    d = result.as_dict()
    d["model"] = str(model)
    report = result.verify
    if as_json:
        echo_json(d)
    else:
        verb = "would fuse" if dry_run else "fused"
        click.echo(stats_table(d, one_line(f"{model}: {verb} {d['total_fused']} chain(s)")))
        if report is not None and not quiet:
            print_verify(report, model, result.saved_to)
    if report is not None:
        report_mismatches(report)
    problems = api.regressions(d, wanted, base)
    for line in problems:
        click.echo(f"fusecli: regression: {line}", err=True)
    if problems:
        raise SystemExit(errors.EXIT_EXPECTATION)
    if report is not None:
        verify_exit(report)
