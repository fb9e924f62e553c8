"""Text fields of a model file that are not valid UTF-8 (issue 33): every kind of string field
fusecli reads (op type, domain, node / tensor / value names, attribute strings and names, doc
strings, metadata, producer, opset domains, in functions too) with one byte flipped to one
that UTF-8 never uses, through every command that loads a model: exit 2 and ONE line that
names the field and where it is; never exit 4 or a traceback. The model is a shipped sample
(real exporter output); the CLI runs in-process so that the ~80 runs take seconds."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from conftest import SAMPLES, cli_in_process, exit_0_or_one_line

SAMPLE = SAMPLES / "torch_block.onnx"
MARK = "ZQXMARKZQX"        # set into the field, then its 'M' flipped to 0xFF in the file
BAD = MARK.replace("M", "\udcff").encode("utf-8", "surrogateescape")


def _node_with_text_attr(m):
    for i, n in enumerate(m.graph.node):
        for a in n.attribute:
            if a.type == onnx.AttributeProto.STRING:
                return i, n, a
    raise AssertionError("the sample has no string attribute")


def _function(m):
    f = m.functions.add()
    f.name, f.domain = "helper_fn", "local.fns"
    f.input.append("x")
    f.output.append("y")
    f.node.append(helper.make_node("Relu", ["x"], ["y"], name=MARK))
    m.opset_import.add(domain="local.fns", version=1)
    return "function 0 ('helper_fn'): node 0"


def _set(kind: str, m: onnx.ModelProto) -> str:
    """Put MARK into one field of ``kind``; returns the words the error must hold."""
    g = m.graph
    k = len(g.node) // 2
    n = g.node[k]
    if kind == "op type":
        n.op_type = MARK
        return f"node {k} ({n.name!r}): op type"
    if kind == "node domain":
        n.domain = MARK
        return f"node {k} ({n.name!r}): domain"
    if kind == "node name":
        n.name = MARK
        return f"node {k}"
    if kind == "node input":
        n.input[0] = MARK
        return f"node {k} ({n.name!r}): input 0"
    if kind == "node output":
        n.output[0] = MARK
        return f"node {k} ({n.name!r}): output 0"
    if kind == "initializer name":
        g.initializer[0].name = MARK
        return "initializer 0"
    if kind == "graph input name":
        g.input[0].name = MARK
        return "graph input 0"
    if kind == "value_info dim":
        g.input[0].type.tensor_type.shape.dim[0].dim_param = MARK
        return f"graph input 0 ({g.input[0].name!r}): dim 0: dim param"
    if kind == "attribute string":
        i, n, a = _node_with_text_attr(m)
        a.s = MARK.encode()
        return f"node {i} ({n.name!r}): attribute {a.name!r}"
    if kind == "attribute name":
        i, n, a = _node_with_text_attr(m)
        a.name = MARK
        return f"node {i} ({n.name!r}): attribute"
    if kind == "doc string":
        n.doc_string = MARK
        return f"node {k} ({n.name!r}): doc string"
    if kind == "metadata":
        m.metadata_props.add(key="origin", value=MARK)
        return "metadata entry 0 ('origin'): value"
    if kind == "producer":
        m.producer_name = MARK
        return "producer name"
    if kind == "opset domain":
        m.opset_import.add(domain=MARK, version=1)
        return f"opset import {len(m.opset_import) - 1}"
    if kind == "function node":
        return _function(m)
    raise AssertionError(kind)


KINDS = ["op type", "node domain", "node name", "node input", "node output", "initializer name",
         "graph input name", "value_info dim", "attribute string", "attribute name", "doc string",
         "metadata", "producer", "opset domain", "function node"]


def _write(tmp_path, kind: str, flip: bool = True):
    m = onnx.load(SAMPLE)
    where = _set(kind, m)
    data = m.SerializeToString()
    assert data.count(MARK.encode()) == 1
    if flip:
        data = data.replace(MARK.encode(), BAD)      # same length: the proto stays well-formed
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    return path, where


def _commands(bad, good, tmp_path):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return {"stats": ["stats", bad], "explain": ["explain", bad],
            "optimize": ["optimize", bad, "-o", out / "o.onnx"],
            "report": ["report", bad, "--summary-md", out / "r.md"],
            "verify (original)": ["verify", bad, good],
            "verify (fused)": ["verify", good, bad]}


@pytest.mark.parametrize("kind", KINDS)
def test_text_field_not_utf8_is_refused_by_every_command(tmp_path, kind):
    bad, where = _write(tmp_path, kind)
    good = tmp_path / "good.onnx"          # beside no manifest: verify reads no sample's params
    good.write_bytes(SAMPLE.read_bytes())
    for cmd, argv in _commands(bad, good, tmp_path).items():
        rc, err = cli_in_process(*argv)
        exit_0_or_one_line(rc, err)
        assert rc == 2, (cmd, err)
        assert f"{where}" in err and "is not valid UTF-8" in err, (cmd, err)
        assert not any((tmp_path / "out").iterdir()), cmd     # nothing written


@pytest.mark.parametrize("kind", ["node domain", "metadata", "producer", "doc string"])
def test_the_same_fields_valid_are_accepted(tmp_path, kind):
    """The control: the same field holding the marker unflipped loads and runs."""
    good, _ = _write(tmp_path, kind, flip=False)
    rc, err = cli_in_process("stats", good)
    assert rc == 0, err


def test_every_string_field_of_the_proto_is_checked():
    """A field ONNX adds later (a new string or message field) is checked without a change:
    the walk reads the descriptors. Each string field of the messages a model holds is found
    by the check's table."""
    from fusecli.io.model import _fields_of

    seen, todo = set(), [onnx.ModelProto.DESCRIPTOR]
    while todo:
        d = todo.pop()
        if d.full_name in seen:
            continue
        seen.add(d.full_name)
        strs, msgs = _fields_of(d)
        names = {f.name for f in d.fields if f.type == f.TYPE_STRING}
        assert names <= {n for n, _ in strs}, d.full_name
        todo.extend(d.fields_by_name[n].message_type for n, _ in msgs)
    assert {"onnx.NodeProto", "onnx.AttributeProto", "onnx.FunctionProto",
            "onnx.TensorShapeProto.Dimension", "onnx.StringStringEntryProto"} <= seen
