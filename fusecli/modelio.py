"""Loading and saving models safely.

- Loading never reads external data: weights stay on disk (a 2 GB+ model is optimised without
  loading them), and every external-data location is checked to stay inside the model's folder.
- Saving writes to a temporary file in the target folder and renames it, so an interrupted run
  leaves either the old file or the new one. External data files that the output still refers to
  are copied next to the output with their relative paths (same way: temp file + rename).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from .errors import ModelError

_MAX_PROTO = 2**31 - 1


def external_locations(model: onnx.ModelProto) -> set[str]:
    locs = set()
    for t in _all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    locs.add(e.value)
    return locs


def _all_tensors(model: onnx.ModelProto):
    def walk(graph):
        yield from graph.initializer
        for node in graph.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t
                elif a.type == onnx.AttributeProto.GRAPH:
                    yield from walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for g in a.graphs:
                        yield from walk(g)
    yield from walk(model.graph)


def _check_location(loc: str, base: Path) -> Path:
    p = Path(loc)
    if p.is_absolute() or ".." in p.parts or loc.startswith(("/", "\\")):
        raise ModelError(f"external data location '{loc}' points outside the model's folder; "
                         "fusecli only reads external data stored beside the model (relative "
                         "path, no '..')")
    full = (base / p).resolve()
    if not str(full).startswith(str(base.resolve()) + os.sep):
        raise ModelError(f"external data location '{loc}' resolves outside the model's folder "
                         f"({full}); refusing to read it")
    return full


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model without its external data; raise ModelError with a fix hint."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"no such file: {p}")
    if p.is_dir():
        raise ModelError(f"{p} is a directory; give the path of an .onnx model file")
    try:
        size = p.stat().st_size
        if size == 0:
            raise ModelError(f"{p} is empty (0 bytes); re-export the model")
        data = p.read_bytes()
    except PermissionError:
        raise ModelError(f"cannot read {p}: permission denied") from None
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelError(f"{p} is not a valid ONNX model (protobuf parse failed: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'truncated or corrupt'}); "
                         "check the file is complete") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelError(f"{p} parsed but holds no graph; is it really an ONNX model?")
    base = p.resolve().parent
    for loc in external_locations(model):
        full = _check_location(loc, base)
        if not full.is_file():
            raise ModelError(f"external data file '{loc}' of {p} is missing (looked in {base}); "
                             "copy it next to the model")
    return model


def _atomic_write_bytes(dest: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_copy(src: Path, dest: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)  # sparse-unaware but streaming: memory stays flat
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_output_path(src: str | os.PathLike, dest: str | os.PathLike, in_place: bool) -> Path:
    s, d = Path(src).resolve(), Path(dest).resolve()
    if s == d and not in_place:
        raise ModelError(f"output {dest} is the input file; choose another -o or pass --in-place")
    if d.is_dir():
        raise ModelError(f"output {dest} is a directory; give a file name such as "
                         f"{Path(dest) / Path(src).name}")
    if not d.parent.is_dir():
        raise ModelError(f"output folder {d.parent} does not exist; create it first")
    if not os.access(d.parent, os.W_OK):
        raise ModelError(f"output folder {d.parent} is not writable")
    return d


def save_model(model: onnx.ModelProto, dest: str | os.PathLike, src: str | os.PathLike) -> None:
    """Save atomically; copy external data files still referenced to beside ``dest``."""
    d = Path(dest).resolve()
    src_base = Path(src).resolve().parent
    for loc in sorted(external_locations(model)):
        s_file = _check_location(loc, src_base)
        d_file = d.parent / loc
        if d_file.resolve() == s_file:
            continue
        d_file.parent.mkdir(parents=True, exist_ok=True)
        _atomic_copy(s_file, d_file)
    if model.ByteSize() > _MAX_PROTO:
        raise ModelError("the output model is over 2 GB without external data; save the input "
                         "with external data (onnx.save_model(..., save_as_external_data=True))")
    _atomic_write_bytes(d, model.SerializeToString())
