"""The fused-op contracts (``ops/contracts.yaml``) as Python objects."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

CONTRACTS_FILE = Path(__file__).parent / "ops" / "contracts.yaml"


@dataclass(frozen=True)
class Port:
    name: str
    optional: bool
    doc: str
    # an output the rewriter always names (a fresh tensor nobody reads): the op's working buffer,
    # which the runtime may place in an input's memory (the kernel's in-place pair)
    workspace: bool = False


@dataclass(frozen=True)
class OpContract:
    name: str
    summary: str
    types: tuple[str, ...]
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: dict
    math: str


@dataclass(frozen=True)
class Contracts:
    domain: str
    version: int
    ops: dict[str, OpContract]


def _ports(items) -> tuple[Port, ...]:
    return tuple(Port(p["name"], bool(p.get("optional", False)), p.get("doc", ""),
                      bool(p.get("workspace", False))) for p in items)


@functools.cache
def load_contracts() -> Contracts:
    data = yaml.safe_load(CONTRACTS_FILE.read_text())
    ops = {
        name: OpContract(name, spec["summary"], tuple(spec["types"]), _ports(spec["inputs"]),
                         _ports(spec["outputs"]), dict(spec.get("attributes") or {}), spec["math"])
        for name, spec in data["ops"].items()
    }
    return Contracts(data["domain"], int(data["version"]), ops)


FUSED_DOMAIN = "com.fusecli"


def infer_output_types(node, type_of) -> list:
    """Tensor types of a fused node's outputs, derived from its inputs' recorded types.

    ``type_of(name)`` returns an ``onnx.TypeProto`` or None. Returns one TypeProto or None per
    output. Used to record value_info for fused outputs, so that runtimes that plan memory
    from static shapes (onnxruntime-training) can plan the fused op's outputs.
    """
    import onnx

    ins = list(node.input)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    def like(i):
        return type_of(ins[i]) if i < len(ins) and ins[i] else None

    def transposed(t):
        if t is None or len(t.tensor_type.shape.dim) != 2:
            return None
        out = onnx.TypeProto()
        out.CopyFrom(t)
        d0, d1 = (onnx.TensorShapeProto.Dimension(), onnx.TensorShapeProto.Dimension())
        d0.CopyFrom(t.tensor_type.shape.dim[1])
        d1.CopyFrom(t.tensor_type.shape.dim[0])
        del out.tensor_type.shape.dim[:]
        out.tensor_type.shape.dim.extend([d0, d1])
        return out

    def vector_like(t, axis):
        if t is None or not t.tensor_type.shape.dim:
            return None
        out = onnx.TypeProto()
        out.tensor_type.elem_type = t.tensor_type.elem_type
        dims = list(t.tensor_type.shape.dim)[axis:] if axis is not None else []
        out.tensor_type.shape.dim.extend(dims)
        return out

    op = node.op_type
    if op == "ActivationGrad":
        types = [like(0)]
    elif op == "LinearActivationGrad":
        trans_w = attrs.get("trans_w", 0)
        trans_dw = attrs.get("trans_dw", trans_w)
        w = like(3)
        dw = w if trans_dw == trans_w else transposed(w)
        if dw is None and like(0) is not None and like(2) is not None:  # [N, K] from dY, A
            dims = [like(0).tensor_type.shape.dim, like(2).tensor_type.shape.dim]
            if all(len(d) for d in dims):
                dw = onnx.TypeProto()
                dw.tensor_type.elem_type = like(0).tensor_type.elem_type
                nk = [dims[0][-1], dims[1][-1]]
                dw.tensor_type.shape.dim.extend(nk[::-1] if trans_dw else nk)
        types = [like(2), dw, vector_like(like(0), -1), like(0)]
    elif op == "AttentionGrad":
        types = [like(1), like(2), like(3), like(4)]
    elif op == "ConvBnReluGrad":
        types = [like(2), like(3), like(5), like(5), like(5), like(0)]
    elif op == "LayerNormGrad":
        gamma = like(2) or vector_like(like(1), attrs.get("axis", -1))
        types = [like(1), gamma, gamma]
    else:
        types = []
    return [types[i] if i < len(types) else None for i in range(len(node.output))]
