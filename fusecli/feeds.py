"""Random feeds for a training graph of either family (ort-training or torch-joint).

make_feeds(model, manifest_entry, seed, dims) returns one array per graph input that is not an
initializer:
  * '*accumulation.buffer'       -> zeros (ort-training accumulates gradients into them)
  * bool inputs ('lazy_reset_grad') -> True
  * parameters                   -> values from '<sample>.params.npz' when the manifest entry
                                    names one (key = input name), else seeded random
  * integer inputs (labels)      -> uniform in the manifest range / [0, num_classes), else [0, 2)
  * other float inputs           -> seeded standard normal (never all zeros)
Symbolic dims are resolved from `dims`, else from defaults (batch 2, sequence 8, otherwise 2).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from .errors import FuseError

DEFAULT_DIMS = {"batch": 2, "batch_size": 2, "b": 2, "n": 2, "seq": 8, "sequence": 8,
                "seq_len": 8, "s": 8}
_REPO_SAMPLES = Path(__file__).resolve().parents[1] / "samples"
MAX_FEED_BYTES = 4 << 30       # all feeds together; checked before anything is allocated


def load_manifest(path: str | Path | None = None) -> dict[str, dict]:
    """Load samples/manifest.yaml; each entry gains 'name' and 'manifest_dir' keys."""
    import yaml

    p = Path(path) if path else _REPO_SAMPLES / "manifest.yaml"
    data = yaml.safe_load(p.read_text())
    samples = data.get("samples", data)
    out = {}
    for name, entry in samples.items():
        e = dict(entry)
        e.setdefault("name", name)
        e["manifest_dir"] = str(p.parent.resolve())
        out[name] = e
    return out


def _dim(d: onnx.TensorShapeProto.Dimension, dims: dict[str, int]) -> int:
    if d.HasField("dim_value") and d.dim_value > 0:
        return int(d.dim_value)
    key = d.dim_param if d.HasField("dim_param") else ""
    if key in dims:
        return int(dims[key])
    low = key.lower()
    for k, v in DEFAULT_DIMS.items():
        if low == k or low.startswith(k + "_") or low.startswith(k):
            if k in ("b", "n", "s") and low != k:
                continue
            return v
    return 2


def _params_file(entry: dict) -> Path | None:
    ref = entry.get("params")
    if not ref:
        return None
    cands = [Path(ref)]
    if entry.get("manifest_dir"):
        cands.insert(0, Path(entry["manifest_dir"]) / ref)
    cands.append(_REPO_SAMPLES / ref)
    for c in cands:
        if c.exists():
            return c
    raise FileNotFoundError(f"parameter file {ref!r} named by the manifest entry not found")


def _input_meta(entry: dict | None) -> dict[str, dict]:
    if not entry:
        return {}
    return {i["name"]: i for i in entry.get("inputs", []) if isinstance(i, dict) and "name" in i}


def make_feeds(model: onnx.ModelProto, manifest_entry: dict | None = None, seed: int = 0,
               dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Return {input name: array} for every graph input that is not an initializer."""
    rng = np.random.default_rng(seed)
    dims = dict(dims or {})
    entry = manifest_entry or {}
    meta = _input_meta(entry)
    params: dict[str, np.ndarray] = {}
    pf = _params_file(entry) if entry else None
    if pf is not None:
        with np.load(pf, allow_pickle=False) as z:
            params = {k: z[k] for k in z.files}
    inits = {i.name for i in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    total = 0
    for vi in model.graph.input:
        name = vi.name
        if name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        shape = tuple(_dim(d, dims) for d in tt.shape.dim)
        total += int(np.prod(shape, dtype=object)) * dtype.itemsize
        if total > MAX_FEED_BYTES:
            raise FuseError(f"the random feeds would take over {MAX_FEED_BYTES >> 30} GiB (input "
                            f"{name!r} has shape {list(shape)}); pass smaller --dim values")
        info = meta.get(name, {})
        role = info.get("role", "")
        if name in params:
            v = params[name]
            feeds[name] = np.array(v, dtype=dtype, copy=True).reshape(shape if shape else v.shape)
        elif name.endswith("accumulation.buffer") or role == "grad_buffer":
            feeds[name] = np.zeros(shape, dtype=dtype)
        elif dtype == np.bool_:
            feeds[name] = np.ones(shape, dtype=np.bool_)
        elif np.issubdtype(dtype, np.integer):
            lo, hi = 0, 2
            if "range" in info:
                lo, hi = int(info["range"][0]), int(info["range"][1])
            elif entry.get("num_classes"):
                hi = int(entry["num_classes"])
            feeds[name] = rng.integers(lo, hi, size=shape).astype(dtype)
        elif np.issubdtype(dtype, np.floating):
            scale = 0.1 if role in ("parameter", "frozen_parameter") else 1.0
            v = rng.standard_normal(shape) * scale
            if role == "frozen_parameter" and "var" in name:
                v = np.abs(v) + 1.0  # a running variance must be positive
            feeds[name] = v.astype(dtype)
        else:
            raise FuseError(f"input {name!r} has element type {dtype}, which fusecli cannot "
                            "make random feeds for (float, integer and bool inputs only)")
    return feeds


def parse_dims(items) -> dict[str, int]:
    """`--dim NAME=VALUE` options as {name: positive int}; a one-line FuseError otherwise."""
    dims: dict[str, int] = {}
    for item in items or ():
        name, sep, value = str(item).partition("=")
        if not sep or not name.strip():
            raise FuseError(f"--dim {item!r}: expected NAME=VALUE, e.g. --dim batch=4")
        try:
            v = int(value)
        except ValueError:
            raise FuseError(f"--dim {item!r}: VALUE must be a positive integer") from None
        if v <= 0:
            raise FuseError(f"--dim {item!r}: VALUE must be a positive integer")
        dims[name.strip()] = v
    return dims
