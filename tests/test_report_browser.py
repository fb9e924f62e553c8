"""The HTML report in a real browser: Debian's chromium, headless, driven over the DevTools
protocol on a pipe (tests/browser.py). `make test` installs chromium (make system-deps); a
machine without it fails here rather than skipping.

From file://, the report loads with no console error, no exception and no request but its own
document; every drawing is present and laid out (a non-zero box); a click on a summary link
brings its drawing into view as the :target; typing in the search box and choosing a pattern
filter the drawings. Every corpus model's report and a deep stack of over 20k nodes load
cleanly and show every drawing. FUSECLI_UPDATE_SCREENSHOT=1 rewrites the README's screenshot
(docs/report.png) from the sample report.
"""

from __future__ import annotations

import copy
import os
import struct

import onnx
import pytest

from browser import Browser
from conftest import REPO, SAMPLES

from fusecli import api
from fusecli.bench.deepgraph import deep_graph
from fusecli.report import collect, render_html
from fusecli.runtime.feeds import load_manifest

SCREENSHOT = REPO / "docs" / "report.png"
CORPUS = REPO / "corpus"
SAMPLE = "torch_block"


def write_report(model_path, out_path):
    original = api.load(model_path)
    result = api.optimize(copy.deepcopy(original))
    data = collect(model_path, result, original=original)
    out_path.write_text(render_html(data), encoding="utf-8")
    return data


# what the page's drawings look like: id, pattern, searchable names, displayed, box size
_DRAWINGS = """(() => Array.from(document.querySelectorAll('section.item')).map(s => {
  const svg = s.querySelector('.drawing svg'), r = svg ? svg.getBoundingClientRect() : null,
        st = getComputedStyle(s);
  return {id: s.id, pattern: s.dataset.pattern, names: s.dataset.names,
          shown: !s.classList.contains('hidden') && st.display !== 'none'
                 && st.visibility === 'visible',
          w: r ? r.width : 0, h: r ? r.height : 0};
}))()"""


# The page lays out a drawing when it nears the viewport (content-visibility: auto), so that a
# report of hundreds of drawings opens fast; asking each one's box on a large page forces a
# layout per drawing (a minute for 800). With ``all_at_once`` the page lays them all out first.
_LAY_OUT_ALL = """(() => { const s = document.createElement('style');
  s.textContent = 'section.item { content-visibility: visible !important; }';
  document.head.appendChild(s); return true; })()"""


def check_loads_cleanly(b: Browser, path, n_drawings: int, all_at_once: bool = False
                        ) -> list[dict]:
    url = path.as_uri()
    b.open(url)
    assert b.problems() == []
    assert b.requests() == [url]                # the document itself, nothing else
    if all_at_once:
        last = b.js("(() => { const s = document.querySelectorAll('section.item');"
                    " const e = s[s.length - 1]; e.scrollIntoView();"
                    " const r = e.querySelector('svg').getBoundingClientRect();"
                    " return [r.width, r.height, r.top]; })()")
        assert last[0] > 0 and last[1] > 0 and 0 <= last[2] < b.js("innerHeight"), last
        b.js(_LAY_OUT_ALL)
    drawings = b.js(_DRAWINGS)
    assert len(drawings) == n_drawings
    for d in drawings:
        assert d["shown"] and d["w"] > 0 and d["h"] > 0, d
    return drawings


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium per test worker, shared by this module's tests."""
    with Browser(width=1200, height=900) as b:
        yield b


def test_sample_report_in_the_browser(browser, tmp_path):
    b = browser
    path = tmp_path / "report.html"
    data = write_report(SAMPLES / f"{SAMPLE}.onnx", path)
    groups = data.miss_groups()
    drawings = check_loads_cleanly(b, path, len(data.chains) + len(groups))
    assert [d["id"] for d in drawings] == ([c.anchor for c in data.chains]
                                           + [g.anchor for g in groups])
    # the near misses' failing nodes are drawn
    assert b.js("document.querySelectorAll('svg g.node.failing').length") == len(groups)

    # a click on a summary link: its drawing becomes the :target, in view
    target = data.chains[-1].anchor
    b.js(f"document.querySelector('a[href=\"#{target}\"]').scrollIntoView({{block: 'center'}})")
    x, y = b.js(f"(() => {{ const r = document.querySelector('a[href=\"#{target}\"]')"
                ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
    b.click(x, y)
    b.js("new Promise(r => setTimeout(r, 100))")
    assert b.js("location.hash") == f"#{target}"
    assert b.js("document.querySelector(':target').id") == target
    top = b.js(f"document.getElementById('{target}').getBoundingClientRect().top")
    assert 0 <= top < b.js("innerHeight")

    # search: typing a node name of one chain keeps the drawings that involve it
    name = data.chains[0].replaced[-1].name
    b.js("document.getElementById('search').focus()")
    b.type_text(name)
    shown = [d for d in b.js(_DRAWINGS) if d["shown"]]
    assert data.chains[0].anchor in {d["id"] for d in shown}
    assert shown and all(name.lower() in d["names"] for d in shown)
    assert len(shown) < len(drawings)
    assert "match" in b.js("document.getElementById('count').textContent")
    # the pattern filter (search cleared)
    b.js("(() => { const s = document.getElementById('search'); s.value = '';"
         " s.dispatchEvent(new Event('input')); })()")
    pattern = data.chains[0].pattern
    b.js(f"(() => {{ const p = document.getElementById('pattern'); p.value = '{pattern}';"
         " p.dispatchEvent(new Event('change')); })()")
    shown = [d for d in b.js(_DRAWINGS) if d["shown"]]
    assert shown and {d["pattern"] for d in shown} == {pattern}
    assert len(shown) == sum(c.pattern == pattern for c in data.chains) + sum(
        g.first.pattern == pattern for g in groups)
    assert b.problems() == []

    # a screenshot of the report (the README's, with FUSECLI_UPDATE_SCREENSHOT=1)
    b.open("about:blank")
    b.open(path.as_uri() + f"#{data.chains[0].anchor}")
    png = b.screenshot()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (1200, 900)
    if os.environ.get("FUSECLI_UPDATE_SCREENSHOT"):
        SCREENSHOT.parent.mkdir(exist_ok=True)
        SCREENSHOT.write_bytes(png)


@pytest.mark.parametrize("name", sorted(load_manifest(CORPUS / "manifest.yaml")))
def test_corpus_reports_in_the_browser(browser, tmp_path, name):
    path = tmp_path / f"{name}.html"
    data = write_report(CORPUS / load_manifest(CORPUS / "manifest.yaml")[name]["file"], path)
    drawings = check_loads_cleanly(browser, path, len(data.chains) + len(data.miss_groups()))
    assert sum(d["id"].startswith("chain-") for d in drawings) == len(data.chains) > 0


def test_deep_stack_report_in_the_browser(browser, tmp_path):
    model, info = deep_graph("torch-joint", 20_000)
    assert info["nodes"] > 20_000
    src = tmp_path / "deep.onnx"
    onnx.save(model, src)
    path = tmp_path / "deep.html"
    data = write_report(src, path)
    # every chain the stacked samples' model code says fuses is drawn
    assert len(data.chains) == info["expected_total"]
    html = path.read_text()
    assert html.count('<section class="item chain"') == info["expected_total"]
    check_loads_cleanly(browser, path, len(data.chains) + len(data.miss_groups()),
                        all_at_once=True)
    assert browser.problems() == []
