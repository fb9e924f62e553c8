"""The report as one self-contained HTML file: inline CSS, inline script, inline SVG drawings;
no fonts, images or scripts from anywhere (a Content-Security-Policy forbids every fetch), so it
opens from disk in any browser. Every name from the model is HTML-escaped here."""

from __future__ import annotations

import re
from html import escape

from fusecli.report.data import Chain, MissGroup, Node, ReportData, gc_paused
from fusecli.report.draw import chain_dot, miss_dot, render


def e(text) -> str:
    return escape(str(text), quote=True)


def mib(b: int | None) -> str:
    if b is None:
        return "? (symbolic shape)"
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 1024:.1f} KiB" if b >= 1024 \
        else f"{b} B"


_CSS = """
:root { --fg:#1d2330; --mut:#5c6475; --line:#d9dde6; --ok:#2f7d32; --bad:#b00020; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
       margin: 0; background: #fafbfc; }
header { background: #1d2330; color: #fff; padding: 14px 24px; }
header h1 { margin: 0; font-size: 20px; } header p { margin: 4px 0 0; color: #c8cede; }
main { padding: 12px 24px 40px; max-width: 1400px; }
h2 { font-size: 17px; margin: 26px 0 8px; border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 0 0 6px; }
table { border-collapse: collapse; background: #fff; margin: 6px 0 12px; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #eef1f6; font-weight: 600; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
code, .mono { font: 12px/1.35 ui-monospace, "DejaVu Sans Mono", monospace; overflow-wrap: anywhere; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 8px 14px; }
.card b { display: block; font-size: 18px; } .card > span { color: var(--mut); font-size: 12px; }
.PASS { color: var(--ok); font-weight: 600; } .FAIL, .INCONCLUSIVE { color: var(--bad); font-weight: 600; }
#controls { position: sticky; top: 0; z-index: 2; background: #fafbfc; padding: 8px 0;
            border-bottom: 1px solid var(--line); display: flex; gap: 10px; align-items: center; }
#search { width: 28em; padding: 5px 8px; font-size: 14px; }
#count { color: var(--mut); }
section.item { background: #fff; border: 1px solid var(--line); border-radius: 6px;
               padding: 10px 14px; margin: 12px 0; content-visibility: auto;
               contain-intrinsic-size: auto 420px; scroll-margin-top: 56px; }
section.item:target, tr:target { outline: 3px solid #f0b400; }
.drawing { overflow-x: auto; margin-top: 6px; }
.drawing svg { height: auto; }
.detail { color: var(--mut); }
.miss .why { color: var(--bad); }
.hidden { display: none !important; }
tr.hidden { display: none; }
"""

_JS = """
(function () {
  var search = document.getElementById('search');
  var pattern = document.getElementById('pattern');
  var count = document.getElementById('count');
  var items = Array.prototype.slice.call(document.querySelectorAll('[data-names]'));
  function apply() {
    var q = search.value.trim().toLowerCase(), p = pattern.value, shown = 0, total = 0;
    items.forEach(function (el) {
      var ok = (!p || el.getAttribute('data-pattern') === p) &&
               (!q || el.getAttribute('data-names').indexOf(q) >= 0);
      el.classList.toggle('hidden', !ok);
      if (el.tagName === 'SECTION') { total++; if (ok) shown++; }
    });
    count.textContent = (q || p) ? shown + ' of ' + total + ' drawings match' : total + ' drawings';
  }
  search.addEventListener('input', apply);
  pattern.addEventListener('change', apply);
  function reveal() {
    var id = decodeURIComponent(location.hash.slice(1));
    var el = id && document.getElementById(id);
    if (!el) return;
    var moved = false;
    if (el.closest('.hidden')) { search.value = ''; pattern.value = ''; apply(); moved = true; }
    var det = el.closest('details');
    if (det && !det.open) { det.open = true; moved = true; }
    if (moved) el.scrollIntoView();
  }
  window.addEventListener('hashchange', reveal);
  apply(); reveal();
})();
"""

_CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
        "img-src data:")
_SVG_IDS = re.compile(r'\bid="(?:page\d+,\d+_)?(graph|node|edge|clust|a_node|a_edge)(\d+)"')


_SVG_NOISE = re.compile(r"<!--[^>]*-->\n|<title>[^<]*</title>\n")


def _svg(svg: str, prefix: str) -> str:
    """An inline SVG with Graphviz's per-drawing ids (node1, edge1, ...) made page-unique and
    without its comments and DOT-id titles (n0, n0->n1: tooltips carry the names)."""
    return _SVG_IDS.sub(lambda m: f'id="{prefix}-{m.group(1)}{m.group(2)}"',
                        _SVG_NOISE.sub("", svg))


def _names_attr(pattern: str, names) -> str:
    return f' data-pattern="{e(pattern)}" data-names="{e(chr(10).join(names).lower())}"'


def _ports(n: Node, tensors) -> str:
    def row(kind, t):
        if not t:
            return ""
        tt = tensors.get(t)
        return (f"<tr><td>{kind}</td><td class=mono>{e(t)}</td><td>{e(tt.dtype if tt else '?')}"
                f"</td><td class=mono>{e(tt.shape if tt else '?')}</td></tr>")
    return ("<table><tr><th></th><th>tensor</th><th>dtype</th><th>shape</th></tr>"
            + "".join(row("in", t) for t in n.inputs) + "".join(row("out", t) for t in n.outputs)
            + "</table>")


def _chain_section(c: Chain, svg: str, tensors) -> str:
    f = c.fused[0]
    attrs = f", attributes: <code>{e(', '.join(f.attrs))}</code>" if f.attrs else ""
    return (f'<section class="item chain" id="{c.anchor}"{_names_attr(c.pattern, c.names)}>'
            f"<h3>#{c.index} {e(c.pattern)}: <code>{e(f.name)}</code></h3>"
            f'<p class="detail">rule <code>{e(c.rule)}</code>, fused op <code>{e(f.domain)}.'
            f"{e(f.op)}</code>{attrs}; replaced {len(c.replaced)} node(s): "
            + ", ".join(f"<code>{e(n.name)}</code>" for n in c.replaced)
            + f"; intermediates removed: {len(c.intermediates)} ({mib(c.intermediate_bytes)})"
            + (f"; saved tensors no longer read: {len(c.saved)} ({mib(c.saved_bytes)})"
               if c.saved else "") + "</p>"
            + f"<details><summary>fused node ports</summary>{_ports(f, tensors)}</details>"
            + f'<div class="drawing">{_svg(svg, c.anchor)}</div></section>')


def _miss_section(g: MissGroup, svg: str) -> str:
    m = g.first
    where = (f"rule node <code>{e(m.failing_spec)}</code>" if m.failing_spec
             else "a guard of the whole match")
    cand = f" (here <code>{e(m.candidate.name)}</code>, a {e(m.candidate.op)})" \
        if m.candidate else ""
    bound = ", ".join(f"{e(k)}=<code>{e(n.name)}</code>" for k, n in m.bound.items()) or "nothing"
    names = [x for mm in g.misses for x in (mm.anchor_node, *mm.names)]
    rows = "".join(
        f'<tr id="{x.anchor}"><td class=n>{x.index}</td><td><code>{e(x.anchor_node)}</code></td>'
        f"<td>{e(x.detail)}</td></tr>" for x in g.misses)
    many = (f"; the same partial match at {len(g.misses)} places (drawn: the first)"
            if len(g.misses) > 1 else "")
    return (f'<section class="item miss" id="{g.anchor}"{_names_attr(m.pattern, names)}>'
            f"<h3>near miss: {e(m.rule)} ({e(m.pattern)}) fails at {where}{many}</h3>"
            f'<p class="detail">matched {m.depth} node(s): {bound}</p>'
            f'<p class="why">failed{cand}: [{e(m.reason)}] {e(m.detail)}</p>'
            f'<div class="drawing">{_svg(svg, g.anchor)}</div>'
            f"<details{' open' if len(g.misses) <= 3 else ''}><summary>every place "
            f"({len(g.misses)})</summary><table><tr><th>#</th><th>anchor</th><th>failed "
            f"constraint</th></tr>{rows}</table></details></section>")


def _cards(d: ReportData) -> str:
    s = d.stats
    cards = [(e(s["total_fused"]), "chains fused"),
             (e(f"{s['nodes_before']} \u2192 {s['nodes_after']}"), "nodes before \u2192 after"),
             (e(mib(d.intermediate_bytes)),
              f"intermediates removed ({s['buffers_eliminated']} buffers)"),
             (e(mib(d.saved_bytes)), "saved tensors no longer read"),
             (e(len(d.misses)), "near misses")]
    if d.verify is not None:
        v = e(d.verify["verdict"])
        cards.append((f'<span class="{v}">{v}</span>',
                      f"verify (max rel {d.verify.get('max_rel', float('nan')):.1e})"))
    if d.bench is not None:
        cards.append((e(f"{d.bench['speedup']:.2f}x"), "step speed-up (median)"))
    return '<div class="cards">' + "".join(
        f'<div class="card"><b>{v}</b><span>{e(k)}</span></div>' for v, k in cards) + "</div>"


def _bench_table(b: dict) -> str:
    rows = "".join(
        f"<tr><td>{k}</td><td class=n>{b[k]['median_ms']:.3f}</td><td class=n>"
        f"{b[k]['min_ms']:.3f}</td><td class=n>{b[k]['max_ms']:.3f}</td><td class=n>"
        f"{mib(b[k]['peak_bytes']) if b[k]['peak_bytes'] is not None else 'n/a'}</td></tr>"
        for k in ("original", "fused"))
    return ("<h2>Bench (original vs fused, interleaved runs)</h2>"
            f"<p>{e(b['runtime'])}, {b['threads']} threads, {b['runs']} runs each; speed-up "
            f"{b['speedup']:.3f}x</p><table><tr><th>model</th><th>median ms</th><th>min ms</th>"
            f"<th>max ms</th><th>peak memory</th></tr>{rows}</table>")


def _verify_table(v: dict) -> str:
    rows = "".join(f"<tr><td class=mono>{e(o['name'])}</td><td class=n>{o['max_abs']:.3e}</td>"
                   f"<td class=n>{o['max_rel']:.3e}</td><td>{e(o['status'])}</td></tr>"
                   for o in v.get("outputs", [])[:50])
    outs = v.get("outputs", [])
    bad = sum(not o["ok"] for o in outs)
    return (f'<h2>Verify: <span class="{e(v["verdict"])}">{e(v["verdict"])}</span></h2>'
            f"<p>{e(v.get('runtime', ''))}, graph optimizations off: {len(outs)} outputs "
            f"compared, {bad} mismatched, max relative error {v.get('max_rel', 0):.3e}</p>"
            f"<details{' open' if bad else ''}><summary>outputs</summary><table><tr><th>"
            f"output</th><th>max abs</th><th>max rel</th><th>status</th></tr>{rows}</table>"
            "</details>")


def _pattern_table(d: ReportData) -> str:
    rows = []
    for r in d.pattern_rows():
        if not (r["detected"] or r["fused"] or r["misses"]):
            continue
        sk = ", ".join(f"{e(k)}: {v}" for k, v in sorted(r["skipped"].items())) or "-"
        rows.append(f"<tr{_names_attr(r['pattern'], [])}><td>{e(r['pattern'])}</td>"
                    f"<td class=n>{r['detected']}</td><td class=n>{r['fused']}</td><td>{sk}"
                    f"</td><td class=n>{r['misses']}</td><td class=n>"
                    f"{e(mib(r['intermediate_bytes'])) if r['fused'] else '-'}</td><td class=n>"
                    f"{e(mib(r['saved_bytes'])) if r['fused'] else '-'}</td></tr>")
    return ("<table><tr><th>pattern</th><th>detected</th><th>fused</th><th>skipped (reason)</th>"
            "<th>near misses</th><th>intermediates removed</th><th>saved tensors no longer read"
            "</th></tr>"
            + "".join(rows) + "</table>")


def _chain_rows(d: ReportData) -> str:
    rows = "".join(
        f"<tr{_names_attr(c.pattern, c.names)}><td class=n>{c.index}</td><td>{e(c.pattern)}</td>"
        f'<td><a href="#{c.anchor}"><code>{e(c.fused[0].name)}</code></a></td><td class=n>'
        f"{len(c.replaced)}</td><td class=n>{e(mib(c.intermediate_bytes))}</td></tr>"
        for c in d.chains)
    return ("<table id=chains><tr><th>#</th><th>pattern</th><th>fused node</th><th>replaced"
            "</th><th>intermediates</th></tr>" + rows + "</table>")


def _miss_rows(groups: list[MissGroup]) -> str:
    rows = "".join(
        f"<tr{_names_attr(g.first.pattern, [x for m in g.misses for x in (m.anchor_node, *m.names)])}>"
        f"<td>{e(g.first.rule)}</td><td>{e(g.first.failing_spec or 'guard')}</td>"
        f"<td>{e(g.first.reason)}</td><td class=n>{g.first.depth}</td><td class=n>"
        f'{len(g.misses)}</td><td><a href="#{g.anchor}"><code>{e(g.first.anchor_node)}</code>'
        f"</a>: {e(g.first.detail)}</td></tr>" for g in groups)
    return ("<table id=misses><tr><th>rule</th><th>failed at rule node</th><th>reason</th>"
            "<th>matched</th><th>places</th><th>first place: failed constraint</th></tr>"
            + rows + "</table>")


def render_html(d: ReportData, jobs: int | None = None) -> str:
    """The whole page; the drawings are laid out here (one dot run over all of them)."""
    with gc_paused():
        return _page(d, jobs)


def _page(d: ReportData, jobs: int | None) -> str:
    groups = d.miss_groups()
    svgs = render([chain_dot(c, d.tensors) for c in d.chains]
                  + [miss_dot(g.first, d.tensors, g.anchor) for g in groups], jobs)
    chain_svgs, miss_svgs = svgs[:len(d.chains)], svgs[len(d.chains):]
    patterns = sorted({c.pattern for c in d.chains} | {m.pattern for m in d.misses})
    options = "".join(f'<option value="{e(p)}">{e(p)}</option>' for p in patterns)
    fused = f"; fused model <code>{e(d.fused_path)}</code>" if d.fused_path else ""
    warn = "".join(f"<li>{e(w)}</li>" for w in d.warnings)
    parts = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name=viewport content="width=device-width, initial-scale=1">',
        f"<title>fusecli report: {e(d.model)}</title><style>{_CSS}</style></head><body>",
        f"<header><h1>fusecli report</h1><p>{e(d.model)}{fused}</p></header><main>",
        "<h2>Summary</h2>", _cards(d),
        (f"<p>graph warnings:</p><ul>{warn}</ul>" if warn else ""),
        _pattern_table(d),
        _bench_table(d.bench) if d.bench is not None else "",
        _verify_table(d.verify) if d.verify is not None else "",
        '<div id=controls><input id=search type=search placeholder="search node names" '
        'aria-label="search node names"><select id=pattern aria-label="filter by pattern">'
        f'<option value="">all patterns</option>{options}</select><span id=count></span></div>',
        f"<h2>Fused chains ({len(d.chains)})</h2>", _chain_rows(d),
        f"<h2>Near misses ({len(d.misses)} at {len(groups)} distinct partial matches)</h2>",
        "<p class=detail>Where a rule started to match and failed (<code>fusecli explain"
        "</code>): the partial match, each node headed by the rule node it bound, the node "
        "that failed in red beside the constraint it failed.</p>" if d.misses else "",
        _miss_rows(groups) if d.misses else "<p>none</p>",
        "<h2>Drawings of the fused chains</h2>",
        *(_chain_section(c, s, d.tensors) for c, s in zip(d.chains, chain_svgs)),
        "<h2>Drawings of the near misses</h2>" if d.misses else "",
        *(_miss_section(g, s) for g, s in zip(groups, miss_svgs)),
        f"</main><script>{_JS}</script></body></html>\n",
    ]
    return "".join(parts)
