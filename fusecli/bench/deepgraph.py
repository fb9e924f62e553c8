"""Deep training graphs (about 5k, 10k, 20k, 40k nodes) for the optimiser-speed benchmark.

A deep graph of one family is a stack of copies of that family's shipped samples (real exporter
output: ort-training artifacts or torch joint graphs), used in rotation:

  ort-training: ortt_mlp, ortt_block, ortt_block_mul, ortt_block_sdpa, ortt_cnn
  torch-joint:  torch_mlp, torch_block

Every tensor, node and graph input/output of copy i is renamed with the prefix ``c<i>.`` (so the
copies share nothing and each keeps its own parameters and gradient buffers), and copy i's data
input is made to DEPEND on copy i-1's loss: ``c<i>.input = Add(input_i, Mul(loss_{i-1}, 0))``,
so the graph is one long dependency chain (depth grows with the copy count) rather than many
independent subgraphs. Those two link nodes per copy are distractors no rule may touch, as are all
the unfusible nodes of the samples themselves (forward passes, losses, the CNN's BatchNorm
shortcut without ReLU, the bias-free Linear's missing bias grad, optimizer-free accumulators ...).

``expected`` counts come from the samples' manifest entries (the counts read off the model code),
so FusionPass on a deep graph must fuse exactly ``copies x per-sample counts``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

FAMILIES = {
    "ort-training": ["ortt_mlp", "ortt_block", "ortt_block_mul", "ortt_block_sdpa", "ortt_cnn"],
    "torch-joint": ["torch_mlp", "torch_block"],
}
SIZES = (5_000, 10_000, 20_000, 40_000)
_SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def _prefixed(model: onnx.ModelProto, p: str) -> onnx.GraphProto:
    g = onnx.GraphProto()
    g.CopyFrom(model.graph)

    def ren(name: str) -> str:
        return p + name if name else name

    for k, n in enumerate(g.node):
        for a in n.attribute:
            if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                raise ValueError("deepgraph: samples with subgraphs are not supported")
        n.name = ren(n.name or f"{n.op_type}_{k}")
        for i, t in enumerate(n.input):
            n.input[i] = ren(t)
        for i, t in enumerate(n.output):
            n.output[i] = ren(t)
    for coll in (g.input, g.output, g.value_info):
        for v in coll:
            v.name = ren(v.name)
    for t in g.initializer:
        t.name = ren(t.name)
    return g


def _load_sample(name: str, samples_dir: Path) -> tuple[onnx.ModelProto, dict]:
    from fusecli.runtime.feeds import load_manifest

    entry = next(e for e in load_manifest(samples_dir / "manifest.yaml").values()
                 if e["file"] == f"{name}.onnx")
    return onnx.load(str(samples_dir / f"{name}.onnx")), entry


def deep_graph(family: str, target_nodes: int, samples_dir: str | Path | None = None
               ) -> tuple[onnx.ModelProto, dict]:
    """Stack sample copies until the graph holds at least ``target_nodes`` nodes.

    Returns (model, info) with info = {"family", "nodes", "copies", "per_sample": {name: n},
    "expected": {pattern: count}, "expected_total": int}.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
    sdir = Path(samples_dir) if samples_dir else _SAMPLES
    srcs = [_load_sample(n, sdir) for n in FAMILIES[family]]
    first = srcs[0][0]
    nodes, inputs, outputs, inits, vinfo = [], [], [], [], []
    expected: Counter = Counter()
    per_sample: Counter = Counter()
    prev_loss = None
    zero = "deep.zero"
    inits.append(numpy_helper.from_array(np.zeros((), np.float32), zero))
    i = 0
    while len(nodes) < target_nodes:
        model, entry = srcs[i % len(srcs)]
        name = FAMILIES[family][i % len(srcs)]
        p = f"c{i}."
        g = _prefixed(model, p)
        data_in = p + "input"
        if prev_loss is not None:
            # copy i's forward input depends on copy i-1's loss (value unchanged: + loss * 0)
            raw = p + "input.raw"
            for n in g.node:
                for k, t in enumerate(n.input):
                    if t == data_in:
                        n.input[k] = raw
            scaled = p + "link.scaled_loss"
            nodes.append(helper.make_node("Mul", [prev_loss, zero], [scaled], name=p + "link.mul"))
            nodes.append(helper.make_node("Add", [data_in, scaled], [raw], name=p + "link.add"))
        nodes.extend(g.node)
        inputs.extend(g.input)
        outputs.extend(g.output)
        inits.extend(g.initializer)
        vinfo.extend(g.value_info)
        prev_loss = g.output[0].name
        for k, v in entry["patterns"].items():
            expected[k] += int(v)
        per_sample[name] += 1
        i += 1
    graph = helper.make_graph(nodes, f"deep_{family}_{len(nodes)}", inputs, outputs,
                              initializer=inits, value_info=vinfo)
    m = helper.make_model(graph, opset_imports=list(first.opset_import))
    m.ir_version = first.ir_version  # onnx's default IR version is too new for onnxruntime
    info = {"family": family, "nodes": len(m.graph.node), "copies": i,
            "per_sample": dict(per_sample), "expected": dict(expected),
            "expected_total": int(sum(expected.values()))}
    return m, info


def write_deep_graphs(out_dir: str | Path, sizes=SIZES, families=tuple(FAMILIES),
                      samples_dir: str | Path | None = None) -> list[dict]:
    """Write deep_<family>_<size>.onnx files; return their info dicts (with 'path')."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    infos = []
    for fam in families:
        for size in sizes:
            m, info = deep_graph(fam, size, samples_dir)
            path = out / f"deep_{fam.replace('-', '_')}_{size // 1000}k.onnx"
            onnx.save(m, str(path))
            info["path"] = str(path)
            info["target"] = size
            infos.append(info)
    return infos


if __name__ == "__main__":  # python -m fusecli.bench.deepgraph OUT_DIR
    import json
    import sys

    for inf in write_deep_graphs(sys.argv[1] if len(sys.argv) > 1 else "build/deep-graphs"):
        print(json.dumps(inf))
