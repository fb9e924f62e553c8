"""Drawings of fused chains and near misses: one small DOT graph each, laid out by Graphviz's
``dot`` into SVG. Never the whole model: a drawing holds a chain's nodes and their boundary
tensors only, so a 34k-node graph costs as many small layouts as it has chains.

``dot -Tsvg`` reads many graphs from stdin and writes one SVG document per graph, in order, so
the graphs go to a few ``dot`` processes (one per core, each a slice of the list) rather than
one process each. Every name is escaped for DOT here, and Graphviz escapes it for SVG/XML.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from fusecli.errors import EXIT_INTERNAL, FuseError
from fusecli.report.data import Chain, Miss, Node, Tensor

DOT_ENV = "FUSECLI_DOT"         # path of the dot program to use (default: dot on PATH)
_LABEL_MAX = 40
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)]}
_CONTROL.update({0x2028: "\\u2028", 0x2029: "\\u2029"})
# colours: replaced nodes, fused nodes, tensors, the failing node of a near miss
_REPLACED, _FUSED, _TENSOR, _FAIL, _BOUND = "#dbe8f6", "#d7f0d2", "#f4f4f4", "#ffd6d6", "#eef0f8"


class DotMissing(FuseError):
    """Graphviz's dot is not installed (exit 2)."""


class DotFailed(FuseError):
    """dot refused a drawing fusecli wrote: a bug (exit 4)."""

    exit_code = EXIT_INTERNAL


def dot_program() -> str:
    """The dot executable, or a one-line DotMissing saying how to get it."""
    wanted = os.environ.get(DOT_ENV) or "dot"
    path = shutil.which(wanted)
    if path is None:
        raise DotMissing(f"the report's drawings are laid out by Graphviz's `dot`, which is not "
                         f"installed (not found: {wanted}): install graphviz (Debian/Ubuntu: "
                         "apt-get install graphviz) or set FUSECLI_DOT to its path")
    return path


def _short(text: str, limit: int = _LABEL_MAX) -> str:
    """At most ``limit`` characters: a long name keeps its start and its (telling) end."""
    text = text.translate(_CONTROL)
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head] + "\u2026" + text[len(text) - (limit - head - 1):]


def q(text: str) -> str:
    """A DOT double-quoted string of ``text``: backslashes and quotes escaped (so Graphviz's
    own escapes such as \\N or \\l cannot be forged), control characters made visible."""
    return '"' + text.translate(_CONTROL).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _label(*lines: str) -> str:
    """A multi-line DOT label (each line escaped and shortened, joined by DOT's \\n)."""
    return '"' + "\\n".join(q(_short(x))[1:-1] for x in lines if x) + '"'


class _Dot:
    """A small DOT graph builder: ids are generated (n0, n1, ...), never taken from names."""

    def __init__(self, gid: str, rankdir: str = "TB"):
        self.lines = [f"digraph {q(gid)} {{",
                      f'  graph [rankdir={rankdir}, fontname="Helvetica", fontsize=10, '
                      'nodesep=0.2, ranksep=0.3, margin=0.05];',
                      '  node [fontname="Helvetica", fontsize=9, margin="0.06,0.03", '
                      'height=0.3];',
                      '  edge [fontname="Helvetica", fontsize=8, arrowsize=0.6];']
        self.count = 0

    def node(self, label: str, tooltip: str, **attrs: str) -> str:
        nid = f"n{self.count}"
        self.count += 1
        extra = "".join(f", {k}={v}" for k, v in attrs.items())
        self.lines.append(f"  {nid} [label={label}, tooltip={q(tooltip)}{extra}];")
        return nid

    def edge(self, a: str, b: str, **attrs: str) -> None:
        extra = ", ".join(f"{k}={v}" for k, v in attrs.items())
        self.lines.append(f"  {a} -> {b}" + (f" [{extra}]" if extra else "") + ";")

    def raw(self, line: str) -> None:
        self.lines.append(line)

    def text(self) -> str:
        return "\n".join(self.lines + ["}"]) + "\n"


def _tensor_node(d: _Dot, t: Tensor | None, name: str) -> str:
    dtype = t.label if t is not None else "type unknown"
    return d.node(_label(name, dtype), f"{name}: {dtype}", shape="note", style="filled",
                  fillcolor=q(_TENSOR), color=q("#999999"))


def _op_node(d: _Dot, n: Node, fill: str, heading: str = "", **attrs: str) -> str:
    op = n.op if not n.domain or n.domain == "ai.onnx" else f"{n.domain}.{n.op}"
    lines = [heading, op, n.name] if heading else [op, n.name]
    lines += n.attrs[:3] if fill == _FUSED else []
    style = {"shape": "box", "style": q("rounded,filled"), "fillcolor": q(fill)}
    style.update(attrs)
    return d.node(_label(*lines), f"{op} {n.name}" + (f" \u2014 {n.doc}" if n.doc else ""),
                  **style)


def _subgraph(d: _Dot, nodes: list[Node], tensors: dict[str, Tensor], fill: str,
              marks: dict[str, dict] | None = None, headings: dict[str, str] | None = None
              ) -> dict[str, str]:
    """Draw ``nodes`` with the tensors they exchange as edges and the tensors entering or
    leaving them as tensor boxes; returns graph node name -> DOT id."""
    marks, headings = marks or {}, headings or {}
    ids, made = {}, {}
    for n in nodes:
        key = id(n)
        ids[key] = _op_node(d, n, fill, headings.get(n.name, ""), **marks.get(n.name, {}))
        for t in n.outputs:
            if t:
                made[t] = key
    read = {t for n in nodes for t in n.inputs if t}
    ins: dict[str, str] = {}
    for n in nodes:
        for t in n.inputs:
            if not t:
                continue
            if t in made:
                tt = tensors.get(t)
                d.edge(ids[made[t]], ids[id(n)], label=q(_short(tt.shape if tt else "?", 24)),
                       tooltip=q(f"{t}: {tt.label if tt else '?'}"))
            else:
                if t not in ins:
                    ins[t] = _tensor_node(d, tensors.get(t), t)
                d.edge(ins[t], ids[id(n)])
    for n in nodes:
        for t in n.outputs:
            if t and t not in read:
                d.edge(ids[id(n)], _tensor_node(d, tensors.get(t), t))
    return {n.name: ids[id(n)] for n in nodes}


def chain_dot(c: Chain, tensors: dict[str, Tensor]) -> str:
    """The replaced subgraph (left) beside the fused node(s) that took its place (right)."""
    d = _Dot(c.anchor, rankdir="TB")
    d.raw(f"  subgraph cluster_replaced {{ label={q(f'replaced: {len(c.replaced)} node(s)')}; "
          'style="rounded"; color="#7a9cc6";')
    _subgraph(d, c.replaced, tensors, _REPLACED)
    d.raw("  }")
    d.raw(f"  subgraph cluster_fused {{ label={q(f'fused: {c.rule}')}; style=\"rounded\"; "
          'color="#5aa05a";')
    _subgraph(d, c.fused, tensors, _FUSED,
              marks={n.name: {"id": q(f"{c.anchor}-fused")} for n in c.fused[:1]})
    d.raw("  }")
    return d.text()


def miss_dot(m: Miss, tensors: dict[str, Tensor], gid: str) -> str:
    """The partial match, each node headed by the rule node it bound; the node that failed
    (or, for a guard, the anchor) is drawn red with the failed constraint beside it."""
    d = _Dot(gid, rankdir="TB")
    nodes = list({n.name: n for n in m.bound.values()}.values())
    heads = {n.name: f"rule node {spec}" for spec, n in m.bound.items()}
    failing = m.candidate.name if m.candidate is not None else None
    if m.candidate is not None and m.candidate.name not in heads:
        nodes.append(m.candidate)
        heads[m.candidate.name] = f"does not fit rule node {m.failing_spec}"
    if failing is None:       # a guard over the whole match, or no candidate at all
        failing = m.anchor_node if m.anchor_node in heads else (nodes[0].name if nodes else None)
    mark = {"color": q("#d00000"), "penwidth": "2.5", "fillcolor": q(_FAIL),
            "class": q("failing"), "id": q(f"{gid}-failing")}
    ids = _subgraph(d, nodes, tensors, _BOUND, marks={failing: mark} if failing else {},
                    headings=heads)
    note = d.node(_label(f"failed: {m.reason}", *_wrap(m.detail)), m.detail, shape="box",
                  style="filled", fillcolor=q("#fff3c4"), color=q("#d00000"))
    if failing in ids:
        d.edge(note, ids[failing], style="dashed", color=q("#d00000"), arrowhead="none",
               constraint="false")
    return d.text()


def _wrap(text: str, width: int = _LABEL_MAX, lines: int = 4) -> list[str]:
    words, out, cur = text.translate(_CONTROL).split(" "), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            out.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    out.append(cur)
    return out[:lines - 1] + ["\u2026"] if len(out) > lines else out


def _svgs(text: str) -> list[str]:
    """Split dot's output (one XML document per graph) into the <svg> elements."""
    out = []
    for doc in text.split("</svg>")[:-1]:
        start = doc.find("<svg")
        out.append(doc[start:] + "</svg>")
    return out


def _run_dot(dot: str, graphs: list[str]) -> list[str]:
    p = subprocess.run([dot, "-Tsvg"], input="".join(graphs), capture_output=True,
                       text=True, encoding="utf-8", check=False)
    svgs = _svgs(p.stdout)
    if p.returncode != 0 or len(svgs) != len(graphs):
        why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[0]
        raise DotFailed(f"internal: Graphviz dot failed on a drawing: {why} (please report "
                        "this)")
    return svgs


def render(graphs: list[str], jobs: int | None = None) -> list[str]:
    """SVG of each DOT graph, in order: the list is cut into one slice per job, each laid out
    by one dot process; the processes run in parallel."""
    if not graphs:
        return []
    dot = dot_program()
    jobs = max(1, min(jobs or os.cpu_count() or 1, (len(graphs) + 19) // 20))
    size = -(-len(graphs) // jobs)
    parts = [graphs[i:i + size] for i in range(0, len(graphs), size)]
    with ThreadPoolExecutor(len(parts)) as pool:
        return [svg for part in pool.map(lambda p: _run_dot(dot, p), parts) for svg in part]
