"""`fusecli report` / `optimize --report --summary-md`: the HTML report holds a drawing of every
fused chain (the replaced nodes beside the fused node) and of every near miss (the failing node
highlighted), names are escaped wherever they go (DOT, SVG, HTML, Markdown), the Markdown
summary holds the pattern table and the top near misses, and fused nodes describe themselves in
their doc_string (what Netron shows). The browser checks are in test_report_browser.py."""

from __future__ import annotations

import copy
import re
from html import escape, unescape

import onnx
import pytest

import builders
from conftest import REPO, SAMPLES, grouped, run_cli

from fusecli import api
from fusecli.engine.fusion import DOC_MAX_NAMES, fused_doc, replaced_of, rule_of
from fusecli.ops.contracts import FUSED_DOMAIN
from fusecli.report import collect, render_html, render_markdown
from fusecli.runtime.feeds import load_manifest

CORPUS = REPO / "corpus"
MANIFEST = load_manifest(CORPUS / "manifest.yaml")
# both families; attention, norms, Linear+activation, Conv+BN, absorbed activation-grad fusions
MODELS = ["ortt_bert", "ortt_llama", "ortt_timm_resnet", "torch_bert", "torch_llama",
          "torch_timm_vit"]
REPLACED_FILL, FUSED_FILL = 'fill="#dbe8f6"', 'fill="#d7f0d2"'


def report_of(path, **kw):
    """(ReportData, html, result, original) of a model file, made as `fusecli report` does."""
    original = api.load(path)
    result = api.optimize(copy.deepcopy(original), **kw)
    data = collect(path, result, original=original)
    return data, render_html(data), result, original


def sections(html: str, kind: str) -> dict[str, str]:
    """id -> the HTML of each <section class="item KIND"> of the page."""
    out = {}
    for m in re.finditer(rf'<section class="item {kind}" id="([^"]+)"', html):
        out[m.group(1)] = html[m.start():html.index("</section>", m.start())]
    return out


def expected_counts(name: str) -> dict[str, int]:
    """The architecture's counts from its code (manifest) minus the known gaps."""
    e = MANIFEST[name]
    gaps = {k: v["count"] for k, v in (e.get("known_gaps") or {}).items()}
    return {k: v - gaps.get(k, 0) for k, v in e["expected"].items() if v - gaps.get(k, 0)}


@pytest.fixture(scope="module")
def reports():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = report_of(CORPUS / MANIFEST[name]["file"])
        return cache[name]
    return get


@pytest.mark.parametrize("name", [grouped(f"report-{n}", n) for n in MODELS])
def test_every_fused_chain_is_drawn_beside_its_fused_node(reports, name):
    data, html, result, original = reports(name)
    chains = sections(html, "chain")
    per_pattern: dict[str, int] = {}
    for sec in chains.values():
        p = re.search(r'data-pattern="([^"]+)"', sec).group(1)
        per_pattern[p] = per_pattern.get(p, 0) + 1
    assert per_pattern == expected_counts(name)
    orig_names = {n.name for n in original.graph.node}
    fused_nodes = {n.name: n for n in result.model.graph.node if n.domain == FUSED_DOMAIN}
    for c in data.chains:
        sec = chains[c.anchor]
        assert sec.count("<svg") == 1
        # every replaced node is drawn (one box each) and named in the section; a name that is
        # not in the original graph is a fused node an earlier rule made (and this one absorbed)
        assert sec.count(REPLACED_FILL) == len(c.replaced)
        assert sec.count(FUSED_FILL) == len(c.fused)
        for n in c.replaced:
            assert f"<code>{escape(n.name)}</code>" in sec
            assert n.name in orig_names or (n.domain == FUSED_DOMAIN and n.found), n.name
        # the fused node is in the fused model, and says what it replaced
        f = fused_nodes[c.fused[0].name]
        names = [n.name for n in c.replaced]
        assert rule_of(f) == c.rule and replaced_of(f) == names[:DOC_MAX_NAMES]
        more = len(names) - DOC_MAX_NAMES
        assert f.doc_string.endswith(f", ... ({more} more)") == (more > 0)
        # its summary row links to its drawing
        assert f'<a href="#{c.anchor}">' in html


@pytest.mark.parametrize("name", [grouped(f"report-{n}", n) for n in MODELS])
def test_every_near_miss_is_listed_and_drawn_with_the_failing_node_highlighted(reports, name):
    data, html, result, original = reports(name)
    misses = api.explain(CORPUS / MANIFEST[name]["file"])
    assert misses  # (140 rules on a real model: other patterns' rules start and fail)
    assert [(m.rule, m.anchor_node, m.detail) for m in data.misses] == \
        [(m["rule"], m["anchor"], m["detail"]) for m in misses]
    drawn = sections(html, "miss")
    groups = data.miss_groups()
    assert len(drawn) == len(groups) and sum(len(g.misses) for g in groups) == len(misses)
    for g in groups:
        sec = drawn[g.anchor]
        assert sec.count("<svg") == 1
        for m in g.misses:                     # every place listed, with its own anchor
            assert f'<tr id="{m.anchor}">' in sec and escape(m.detail) in sec
        # exactly one node is drawn as failing: the candidate that did not fit the rule node
        failing = re.findall(r'<g id="[^"]*" class="node failing">\s*<g[^>]*><a xlink:title="'
                             r'([^"]*)"', sec)
        assert len(failing) == 1, sec[:300]
        first = g.first
        want = first.candidate.name if first.candidate else first.anchor_node
        assert escape(want, quote=True) in failing[0] or want in failing[0]
        assert f'id="{g.anchor}-failing"' in unescape(sec)       # dot writes - as &#45;


def test_names_are_escaped_in_dot_svg_html_and_markdown(tmp_path):
    m = builders.ortt_linear_act("relu")
    hostile = {"act_grad": '</svg><script>alert(1)</script>', "bgrad": 'q"uote\\N\\l{}[];->',
               "wgrad": "line\nbreak\x1b[31m", "dgrad": "|pipe|`tick`*star*"}
    tensors = {"dZ": '<b>dZ</b> "x" \\G'}
    for n in m.graph.node:
        n.name = hostile.get(n.name, "" if n.name == "bgrad_id" else n.name)   # one unnamed
        for i, t in enumerate(n.input):
            n.input[i] = tensors.get(t, t)
        for i, t in enumerate(n.output):
            n.output[i] = tensors.get(t, t)
    path = tmp_path / "hostile.onnx"
    onnx.save(m, path)
    data, html, result, _ = report_of(path)
    assert result.total_fused == 1 and len(data.chains) == 1
    assert html.count("<script>") == 1 and "alert(1)</script>" not in html
    assert "<b>dZ</b>" not in html and escape('<b>dZ</b>') in html
    sec = sections(html, "chain")["chain-1"]
    assert sec.count(REPLACED_FILL) == len(m.graph.node) and sec.count("<svg") == 1
    assert all(n.found for n in data.chains[0].replaced)    # the unnamed one too
    assert "&lt;Identity #2&gt;" in sec                         # under the engine's name
    assert [n.op for n in data.chains[0].replaced] == [n.op_type for n in m.graph.node]
    text = render_markdown(data)
    row = next(line for line in text.splitlines() if line.startswith("| linear_relu") or
               line.startswith("| linear\\_relu"))
    assert row.count("|") - row.count("\\|") == 6           # 5 cells: no forged column
    assert "\n" not in data.model and "\x1b" not in text


def test_markdown_summary_has_the_pattern_table_and_the_top_near_misses(reports):
    data, _, result, _ = reports("ortt_bert")
    text = render_markdown(data, "report.html")
    assert text.startswith("### fusecli: ")
    for pattern, n in expected_counts("ortt_bert").items():
        cell = pattern.replace("_", "\\_")              # Markdown-escaped
        assert re.search(rf"^\| {re.escape(cell)} \| \d+ \| {n} \|", text, re.M), pattern
    assert "report.html" in text
    groups = data.miss_groups()
    assert f"**Top near misses** ({len(data.misses)} at {len(groups)} distinct" in text
    first = groups[0].first
    row = (rf"^\| {re.escape(first.rule.replace('_', chr(92) + '_'))} \| [^|]+ \| "
           rf"{len(groups[0].misses)} \| [^\n]+ \|$")
    assert re.search(row, text, re.M), row


def test_a_known_near_miss_is_drawn_at_its_failing_node(tmp_path):
    """A Linear + ReLU backward whose weight-gradient Gemm has transA=0 (not a weight gradient):
    linear_relu_ortt_gemm fails at that Gemm, which the drawing marks as the failing node and
    the Markdown row names with the constraint."""
    path = tmp_path / "wrong_attr.onnx"
    onnx.save(builders.ortt_linear_act("relu", extra="wrong_attr"), path)
    data, html, result, _ = report_of(path)
    assert result.total_fused == 0
    (miss,) = [m for m in data.misses if m.rule == "linear_relu_ortt_gemm"]
    assert miss.candidate.name == "wgrad" and "transA = 0, rule wants 1" in miss.detail
    (group,) = [g for g in data.miss_groups() if miss in g.misses]
    sec = sections(html, "miss")[group.anchor]
    failing = re.findall(r'<g id="[^"]*" class="node failing">\s*<g[^>]*><a xlink:title="'
                         r'([^"]*)"', sec)
    assert len(failing) == 1 and "wgrad" in failing[0]
    assert f'<tr id="{miss.anchor}">' in sec and escape(miss.detail) in sec
    text = render_markdown(data)
    assert re.search(r"^\| linear\\_relu\\_ortt\\_gemm \| [^|]+ \| 1 \| act\\_grad: [^|]*"
                     r"transA = 0, rule wants 1 \|$", text, re.M), text


def test_fused_nodes_describe_themselves_for_netron(reports):
    _, _, result, _ = reports("ortt_bert")
    fused = [n for n in result.model.graph.node if n.domain == FUSED_DOMAIN]
    assert fused
    for n in fused:
        rec = next(r for r in result.stats.fusions if r.fused_node == n.name)
        assert n.doc_string.startswith(f"fusecli rule {rec.rule}, pattern {rec.pattern}, "
                                       f"replaced {len(rec.replaced)} node(s): ")
        assert n.name.endswith(f"/fused_{rec.pattern}") and rec.replaced[0] in n.name


def test_long_replaced_lists_are_cut_in_the_doc_string():
    names = [f"n{i}" for i in range(DOC_MAX_NAMES + 5)]
    doc = fused_doc("r", "p", names)
    assert doc.endswith(", ... (5 more)") and f"replaced {len(names)} node(s)" in doc
    node = onnx.helper.make_node("X", [], [], doc_string=doc)
    assert rule_of(node) == "r" and replaced_of(node) == names[:DOC_MAX_NAMES]


# -- the command line --------------------------------------------------------------------------
def test_report_command_writes_html_and_appends_markdown(tmp_path, manifest):
    sample = SAMPLES / "torch_block.onnx"
    want = sum(next(e for e in manifest.values() if e["file"] == sample.name)
               ["patterns"].values())                     # counted from the model code
    out, md = tmp_path / "r.html", tmp_path / "summary.md"
    md.write_text("# job summary\n")
    p = run_cli("report", sample, "-o", out, "--summary-md", md, "--verify")
    assert f"{want} fused chain(s)" in p.stdout
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>") and "Content-Security-Policy" in html
    assert not re.search(r'(src|href)="(https?:)?//', html)     # nothing fetched
    assert len(sections(html, "chain")) == want and '<h2>Verify: <span class="PASS">' in html
    # optimize --report/--summary-md: the same report of the run, the summary appended
    run_cli("optimize", sample, "-o", tmp_path / "f.onnx", "-q", "--report",
            tmp_path / "o.html", "--summary-md", md)
    assert len(sections((tmp_path / "o.html").read_text(), "chain")) == want
    text = md.read_text()
    assert text.startswith("# job summary\n") and text.count("### fusecli: ") == 2
    assert "verify: **PASS**" in text.split("### fusecli: ")[1]


@pytest.mark.parametrize("args, words", [
    (["missing.onnx", "-o", "r.html"], "missing.onnx"),
    (["{sample}"], "-o/--output"),
    (["{sample}", "{sample}", "-o", "r.html"], "is not what fusing"),
])
def test_report_bad_input_is_one_line_exit_2(tmp_path, args, words):
    sample = SAMPLES / "torch_block.onnx"
    p = run_cli("report", *[str(a).format(sample=sample) for a in args], check_rc=2,
                cwd=tmp_path)
    assert words in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr


def test_report_without_graphviz_says_to_install_it(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "FUSECLI_DOT"}
    env["PATH"] = str(tmp_path)           # no dot on it
    p = run_cli("report", SAMPLES / "torch_block.onnx", "-o", tmp_path / "r.html", check_rc=2,
                env=env)
    assert "graphviz" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "r.html").exists()
    # optimize --report refuses before fusing or writing anything
    p = run_cli("optimize", SAMPLES / "torch_block.onnx", "-o", tmp_path / "f.onnx", "--report",
                tmp_path / "r.html", check_rc=2, env=env)
    assert "graphviz" in p.stderr and not (tmp_path / "f.onnx").exists()
    # the Markdown summary needs no drawing
    run_cli("report", SAMPLES / "torch_block.onnx", "--summary-md", tmp_path / "s.md", env=env)
