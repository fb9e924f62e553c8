"""``fusecli report MODEL [FUSED] -o report.html``: what fused, drawn (fusecli.report)."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import click

from fusecli.commands.options import FEEDS, ONLY, PROVIDER, RULES, SKIP
from fusecli.commands.output import log, report_mismatches, verify_exit

REPORT = click.option("--report", "report_file", type=click.Path(path_type=Path),
                      help="Also write the HTML report of this run here (as `fusecli report`).")
SUMMARY_MD = click.option(
    "--summary-md", "summary_md", type=click.Path(path_type=Path),
    help="Append a short Markdown summary (pattern table, top near misses) to this file, e.g. "
         "$GITHUB_STEP_SUMMARY.")


def write_reports(data, report_file, summary_md, quiet: bool = False) -> None:
    """Write the HTML report and/or append the Markdown summary of ``data``, saying so."""
    from fusecli.report import write_report

    write_report(data, report_file, summary_md)
    if report_file is not None:
        log(quiet, f"wrote {report_file}")
    if summary_md is not None:
        log(quiet, f"appended the summary to {summary_md}")


def check_report_options(report_file, summary_md) -> None:
    """Refuse a report path that cannot be written and a missing dot before any work."""
    from fusecli.io.model import check_text_output
    from fusecli.report import dot_program

    if report_file is not None:
        check_text_output(report_file, True)
        dot_program()
    if summary_md is not None:
        check_text_output(summary_md, True)


def check_made_from(fused_model, result, fused, model) -> None:
    """FUSED must hold the fused nodes that fusing MODEL (``result``) made, by name."""
    from fusecli.errors import FuseError
    from fusecli.ops.contracts import FUSED_DOMAIN

    mine = sorted(n.name for n in result.model.graph.node if n.domain == FUSED_DOMAIN)
    theirs = sorted(n.name for n in fused_model.graph.node if n.domain == FUSED_DOMAIN)
    if mine != theirs:
        raise FuseError(f"{fused} is not what fusing {model} with these rules gives "
                        f"({len(theirs)} fused nodes, {len(mine)} expected): pass the "
                        "--rules/--only/--skip/--provider it was made with")


@click.command("report")
@click.argument("model", type=click.Path(path_type=Path))
@click.argument("fused", required=False, type=click.Path(path_type=Path))
@click.option("-o", "--output", "report_file", type=click.Path(path_type=Path),
              help="Where to write the HTML report.")
@SUMMARY_MD
@RULES
@ONLY
@SKIP
@PROVIDER
@click.option("--verify", "do_verify", is_flag=True,
              help="Verify the fused model against MODEL and show the result (exit 1 on a "
                   "mismatch, 5 if it cannot judge, as `fusecli verify`; after writing).")
@click.option("--bench", "do_bench", is_flag=True,
              help="Time the fused model against MODEL (`fusecli bench`) and show the result.")
@FEEDS
@click.option("-q", "--quiet", is_flag=True, help="No log lines on stderr.")
def report(model, fused, report_file, summary_md, rules, only, skip, provider, do_verify,
           do_bench, feeds_file, quiet):
    """Write an HTML report of what fuses in MODEL (-o) and/or a Markdown summary (--summary-md).

    The report (one self-contained file: no network, opens from disk) holds the per-pattern
    summary, a drawing of every fused chain beside the fused node that replaced it, every near
    miss (`fusecli explain`) drawn with its failing node highlighted, and a search box and
    pattern filter. MODEL is fused in memory with the given rules; FUSED, if given, must be the
    result of that (it is what --verify and --bench measure). The drawings need Graphviz's dot.
    """
    from fusecli import api
    from fusecli.report import collect

    if report_file is None and summary_md is None:
        raise click.UsageError("missing -o/--output FILE.html (and/or --summary-md FILE)")
    if feeds_file is not None and not do_verify:
        raise click.UsageError("--feeds is for --verify; add --verify")
    check_report_options(report_file, summary_md)
    original = api.load(model)
    result = api.optimize(copy.deepcopy(original), rules, only, skip, provider=provider,
                          log=None if quiet else lambda m: log(quiet, m))
    result.source = model
    if fused is not None:
        check_made_from(api.load(fused), result, fused, model)
    bench = None
    with tempfile.TemporaryDirectory(prefix="fusecli-report-") as tmp:
        target = fused
        if (do_verify or do_bench) and target is None:
            target = api.save(result, Path(tmp) / "fused.onnx", source=model)
        if do_verify:
            result.verify = api.verify(model, target, feeds=feeds_file)
        if do_bench:
            bench = api.bench(model, target)
    data = collect(model, result, original=original, fused_path=fused, rules=rules,
                   only=only, skip=skip, provider=provider, bench=bench)
    write_reports(data, report_file, summary_md, quiet)
    click.echo(f"{model}: {len(data.chains)} fused chain(s), {len(data.misses)} near miss(es)"
               + (f"; report: {report_file}" if report_file else ""))
    if result.verify is not None:     # written first: a failing verify is in the report too
        report_mismatches(result.verify)
        verify_exit(result.verify)
