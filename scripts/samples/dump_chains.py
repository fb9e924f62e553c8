"""Print a graph's nodes compactly: idx op[domain] {attrs} (inputs) -> (outputs).

usage: python scripts/samples/dump_chains.py SAMPLE_OR_PATH [--grep SUBSTR] [--stats]
SAMPLE is a name under samples/ (e.g. ortt_block) or a path to an .onnx file. Small
constants (initializers / Constant nodes with <= 8 elements) are printed inline as =[values].
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]


def _attr(a: onnx.AttributeProto) -> str:
    if a.type == onnx.AttributeProto.TENSOR:
        v = numpy_helper.to_array(a.t)
        return f"{a.name}=T{list(v.shape)}{np.round(v.ravel()[:8], 6).tolist()}"
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, float):
        v = round(v, 8)
    return f"{a.name}={v}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sample")
    ap.add_argument("--grep", default=None)
    ap.add_argument("--stats", action="store_true")
    a = ap.parse_args()
    p = Path(a.sample)
    if not p.exists():
        p = ROOT / "samples" / f"{a.sample}.onnx"
    m = onnx.load(p)
    g = m.graph
    consts: dict[str, str] = {}
    for i in g.initializer:
        if np.prod(i.dims) <= 8:
            consts[i.name] = str(np.round(numpy_helper.to_array(i).ravel(), 6).tolist())
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR:
            v = numpy_helper.to_array(n.attribute[0].t)
            if v.size <= 8:
                consts[n.output[0]] = str(np.round(v.ravel(), 6).tolist())

    def nm(t: str) -> str:
        if t == "":
            return "''"
        return f"{t}={consts[t]}" if t in consts else t

    print(f"# {p.name}: ir_version={m.ir_version} opsets="
          f"{[(o.domain or 'ai.onnx', o.version) for o in m.opset_import]} nodes={len(g.node)}")
    print("# inputs:", ", ".join(i.name for i in g.input))
    print("# outputs:", ", ".join(o.name for o in g.output))
    if a.stats:
        c = collections.Counter((n.domain or "ai.onnx", n.op_type) for n in g.node)
        for (d, o), k in sorted(c.items()):
            print(f"{k:4d} {d}.{o}")
        return
    for idx, n in enumerate(g.node):
        dom = f"[{n.domain}]" if n.domain else ""
        attrs = " {" + ", ".join(_attr(x) for x in n.attribute) + "}" if n.attribute else ""
        line = (f"{idx:4d} {n.op_type}{dom}{attrs} ({', '.join(nm(t) for t in n.input)})"
                f" -> ({', '.join(nm(t) for t in n.output)})  #{n.name}")
        if a.grep is None or a.grep in line:
            print(line)


if __name__ == "__main__":
    sys.exit(main())
