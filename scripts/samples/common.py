"""Helpers shared by the sample generators (runs in the generator venvs: numpy + onnx only)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"
BUILD = ROOT / "build" / "samples"


def np_dtype_name(elem_type: int) -> str:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name


def input_specs(model: onnx.ModelProto) -> list[dict]:
    inits = {i.name for i in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = []
        for d in tt.shape.dim:
            shape.append(d.dim_param if d.HasField("dim_param") else int(d.dim_value))
        out.append({"name": vi.name, "shape": shape, "dtype": np_dtype_name(tt.elem_type)})
    return out


def assign_roles(specs: list[dict], trainable: set[str], frozen: set[str],
                 data: dict[str, list[int] | None], labels_range: list[int] | None = None) -> None:
    """Give each input spec its manifest role (see samples/manifest.yaml): the named data
    inputs (with their integer `range` where given), parameters, frozen parameters, gradient
    buffers, the lazy_reset_grad flag, integer labels, and the target."""
    for s in specs:
        n = s["name"]
        if n in data:
            s["role"] = "data"
            if data[n]:
                s["range"] = data[n]
        elif n in trainable:
            s["role"] = "parameter"
        elif n in frozen:
            s["role"] = "frozen_parameter"
        elif n.endswith(".accumulation.buffer"):
            s["role"] = "grad_buffer"
        elif n == "lazy_reset_grad":
            s["role"] = "flag"
        elif s["dtype"].startswith("int"):
            s["role"] = "labels"
            s["range"] = labels_range
        else:
            s["role"] = "target"


def write_fragment(name: str, entry: dict) -> None:
    """Each generator writes one JSON fragment per sample; write_manifest.py merges them."""
    BUILD.mkdir(parents=True, exist_ok=True)
    (BUILD / f"{name}.json").write_text(json.dumps(entry, indent=1))


def run_jobs(jobs: dict, which: list[str], reseed) -> None:
    """Run the named sample jobs (all of them when `which` is empty), each after reseed(), so a
    sample comes out the same whether it is built alone or with the others."""
    for n in which or list(jobs):
        reseed()
        jobs[n]()
