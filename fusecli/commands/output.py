"""What the commands print: JSON, log lines, and the verify report (shared by optimize and
verify). Printing only; the numbers come from the API's results."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fusecli import errors


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)]}
_CONTROL.update({0x2028: "\\u2028", 0x2029: "\\u2029"})


def one_line(text: str) -> str:
    """The text with control characters (newlines, C1 controls such as CSI, the Unicode line
    separators included) escaped: it stays one printable line."""
    return str(text).translate(_CONTROL)


def echo_line(line: str, err: bool = False) -> None:
    """Print one line built from names of the user's model: it cannot forge another line or
    send an escape sequence to the terminal."""
    click.echo(one_line(line), err=err)


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=None, sort_keys=False))


def log(quiet: bool, msg: str) -> None:
    if not quiet:
        click.echo(msg, err=True)


def print_verify(report, original, fused) -> None:
    from fusecli.runtime.verify import PROBES_DIFFER

    echo_line(f"verify: {Path(original).name} vs {Path(fused).name} in {report.runtime} "
               f"(graph optimizations off, {report.deterministic}, rtol={report.rtol:g}, "
               f"atol={report.atol:g})")
    echo_line("  feeds: " + "; ".join(report.feed_lines))
    if report.seeds_pinned:
        echo_line(f"  stochastic ops seeded alike in both models: "
                   f"{', '.join(report.seeds_pinned)}")
    w = max((len(d.name) for d in report.outputs), default=10)
    for d in report.outputs:
        # an output whose reference is (numerically) zero is judged by atol alone
        zero = d.max_ref <= report.atol
        rel = "  (zero)  " if zero else f"{d.rel:.3e}"
        noise = "   -   " if zero else f"{d.noise_rel:.1e}"
        echo_line(f"  {d.name:<{w}}  max_abs {d.max_abs:.3e}  max_rel {rel}  "
                   f"noise {noise}  {d.status}")
    bad = [d for d in report.boundaries if not d.ok]
    unjudged = [d for d in report.boundaries if d.status == PROBES_DIFFER]
    echo_line(f"  fused-node boundary tensors: {len(report.boundaries)} compared, "
               f"{len(bad)} mismatched" + "".join(f"; {d.name} (max_rel {d.rel:.3e}, at "
                                                  f"{', '.join(d.upstream_fused)})" for d in bad[:3]))
    if unjudged:
        echo_line(f"  {len(unjudged)} of them not judged: onnxruntime computed them differently "
                   "with the probes that read them, and the two models' outputs, run again "
                   "without probes (buffer reuse on), agree")
    if report.fusion_checks is not None:
        nbad = sum(not c.ok for c in report.fusion_checks)
        echo_line(f"  {len(report.noisy)} output(s) too sensitive to judge on the whole model "
                   f"(noise floor > {report.as_dict()['noise_limit']:g}): checked each of "
                   f"{len(report.fusion_checks)} fusion(s) at its boundary instead (NumPy "
                   f"reference and fused kernel on the original's tensors): {nbad} failed")
    runs = ", ".join(f"{k} x{v}" for k, v in sorted(report.fused_kernel_runs.items()))
    echo_line(f"  fused kernels executed: {runs or 'none'}")
    for why in report.inconclusive:
        echo_line(f"  cannot judge: {why}")
    floor = max((d.noise_rel for d in report.outputs if d.max_ref > report.atol), default=0.0)
    echo_line(f"  max relative error {report.max_rel:.3e} (noise floor up to {floor:.1e}): "
               f"{report.verdict}")


def report_mismatches(report) -> None:
    for d in report.outputs:
        if not d.ok:
            echo_line(f"fusecli: mismatch in {d.name} (max abs {d.max_abs:.3e}); fused nodes "
                       f"upstream: {', '.join(d.upstream_fused) or 'none'}", err=True)
    bad = [d for d in report.boundaries if not d.ok]
    for d in bad[:5]:
        echo_line(f"fusecli: mismatch at fused-node boundary tensor {d.name} (max abs "
                   f"{d.max_abs:.3e}); fused nodes: {', '.join(d.upstream_fused)}", err=True)
    if len(bad) > 5:
        echo_line(f"fusecli: ... and {len(bad) - 5} more fused-node boundary tensors (--json "
                   "lists them)", err=True)
    for c in report.fusion_checks or ():
        if not c.ok:
            echo_line(f"fusecli: mismatch in fused node {c.fused_node} (rule {c.rule}) on the "
                       "original's boundary tensors", err=True)
    if not report.mismatched:
        for why in report.inconclusive:
            echo_line(f"fusecli: inconclusive: {why}; pass --feeds FILE.npz with real inputs",
                       err=True)


def verify_exit(report) -> None:
    if report.mismatched:
        raise SystemExit(errors.EXIT_CHECK_FAILED)
    if report.inconclusive:
        raise SystemExit(errors.EXIT_INCONCLUSIVE)
