"""``fusecli report``: what fused, as one self-contained HTML file (summary, a drawing of every
fused chain beside its fused node, every near miss drawn with the failing node highlighted,
search and a pattern filter) and a short Markdown summary for CI job summaries.

Built from the API's ``Result`` (an optimize run) and explain's near misses; the drawings are
laid out by Graphviz's dot (``draw.py``). Layer: above ``api``, below the commands.
"""

from __future__ import annotations

import copy

from collections.abc import Callable, Iterable
from pathlib import Path

import onnx

from fusecli import api
from fusecli.engine.explain import explain_model
from fusecli.report.data import ReportData, build, gc_paused
from fusecli.report.draw import dot_program
from fusecli.report.html import render_html
from fusecli.report.markdown import render_markdown

__all__ = ["ReportData", "collect", "dot_program", "render_html", "render_markdown",
           "write_report", "write_text"]


def collect(model: api.PathLike, result: api.Result | None = None, *,
            original: onnx.ModelProto | None = None, fused_path: api.PathLike | None = None,
            rules: api.RulesArg = None, only: Iterable[str] = (), skip: Iterable[str] = (),
            provider: str = "any", bench: dict | None = None,
            log: Callable[[str], None] | None = None) -> ReportData:
    """Gather a report of ``model`` (a path): fuse it in memory (or take ``result``, an
    optimize run of it whose model is the fused graph) and find its near misses with the same
    rules; ``bench``: an ``api.bench`` summary of original vs fused to show."""
    if original is None:
        original = api.load(model)
    if result is None:
        work = copy.deepcopy(original)
        result = api.optimize(work, rules, only, skip, provider=provider, log=log)
        result.source = Path(model)
    fp = api.fusion_pass(rules, provider=provider)
    # with every rule the optimize result is the model explain would fuse for its stages
    staged = result.model if not (only or skip) else None
    with gc_paused():
        misses = explain_model(original, fp, staged=staged)
    return build(str(model), original, result, misses,
                 str(fused_path) if fused_path is not None else None, bench)


def write_report(data: ReportData, html: api.PathLike | None = None,
                 summary_md: api.PathLike | None = None) -> list[Path]:
    """Write the HTML report of ``data`` to ``html`` (atomically) and append its Markdown
    summary to ``summary_md`` (a CI job summary); returns the paths written.

        data = fusecli.report.collect("model.onnx")              # fuses in memory
        fusecli.write_report(data, "report.html", summary_md=os.environ["GITHUB_STEP_SUMMARY"])
    """
    out = []
    if html is not None:
        out.append(write_text(html, render_html(data)))
    if summary_md is not None:
        out.append(write_text(summary_md, render_markdown(data, str(html) if html else None),
                              append=True))
    return out


def write_text(path: api.PathLike, text: str, append: bool = False) -> Path:
    """Write ``text`` to ``path`` (atomically, or appended to it for a CI job summary)."""
    from fusecli.io.model import save_text

    p = Path(path)
    if append:
        with open(p, "a", encoding="utf-8") as f:
            f.write(text)
        return p
    save_text(text, p, True)
    return p
