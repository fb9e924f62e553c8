"""The short Markdown summary a CI step appends to its job summary ($GITHUB_STEP_SUMMARY):
the per-pattern table and the top near misses. Names are escaped for Markdown tables."""

from __future__ import annotations

from fusecli.report.data import ReportData
from fusecli.report.html import mib

TOP_MISSES = 10
_CONTROL = {c: " " for c in [*range(0x20), *range(0x7f, 0xa0), 0x2028, 0x2029]}


def md(text) -> str:
    """Text safe inside a Markdown table cell: one line, pipes, backticks and HTML escaped."""
    s = str(text).translate(_CONTROL)
    for ch, rep in (("\\", "\\\\"), ("|", "\\|"), ("`", "\\`"), ("<", "&lt;"), (">", "&gt;"),
                    ("*", "\\*"), ("_", "\\_"), ("[", "\\["), ("]", "\\]")):
        s = s.replace(ch, rep)
    return s


def render_markdown(d: ReportData, report_file: str | None = None) -> str:
    s = d.stats
    lines = [f"### fusecli: {md(d.model)}", "",
             f"**{s['total_fused']} chain(s) fused**, nodes {s['nodes_before']} \u2192 "
             f"{s['nodes_after']}, intermediates removed: {s['buffers_eliminated']} "
             f"({mib(d.intermediate_bytes)}), saved tensors no longer read: "
             f"{mib(d.saved_bytes)}"]
    if d.verify is not None:
        lines[-1] += f", verify: **{md(d.verify['verdict'])}**"
    if d.bench is not None:
        b = d.bench
        lines[-1] += (f", step {b['original']['median_ms']:.2f} \u2192 "
                      f"{b['fused']['median_ms']:.2f} ms ({b['speedup']:.2f}x)")
        if b["original"]["peak_bytes"] and b["fused"]["peak_bytes"]:
            lines[-1] += (f", peak memory {mib(b['original']['peak_bytes'])} \u2192 "
                          f"{mib(b['fused']['peak_bytes'])}")
    lines += ["", "| pattern | detected | fused | skipped | near misses |",
              "|---|---:|---:|---|---:|"]
    for r in d.pattern_rows():
        if r["detected"] or r["fused"] or r["misses"]:
            sk = ", ".join(f"{md(k)}: {v}" for k, v in sorted(r["skipped"].items())) or "-"
            lines.append(f"| {md(r['pattern'])} | {r['detected']} | {r['fused']} | {sk} | "
                         f"{r['misses']} |")
    groups = d.miss_groups()
    if groups:
        top = groups[:TOP_MISSES]
        lines += ["", f"**Top near misses** ({len(d.misses)} at {len(groups)} distinct partial "
                  f"matches; deepest first{f', {len(top)} shown' if len(top) < len(groups) else ''})",
                  "", "| rule | failed at rule node | places | first place: failed constraint |",
                  "|---|---|---:|---|"]
        for g in top:
            m = g.first
            lines.append(f"| {md(m.rule)} | {md(m.failing_spec or 'guard')} | {len(g.misses)} | "
                         f"{md(m.anchor_node)}: {md(m.reason)}: {md(m.detail)} |")
    if report_file:
        lines += ["", f"Drawings of every chain and near miss: {md(report_file)}"]
    return "\n".join(lines) + "\n"
