"""Loading and saving models safely.

- Loading never reads external data: weights stay on disk (a 2 GB+ model is optimised without
  loading them), and every external-data location is checked to stay inside the model's folder
  (relative, no '..', no symlink leading out), to exist, and to be long enough for the
  offset/length the tensor names. Tensors in sparse initializers, tensor attributes and
  subgraphs are checked too.
- Saving writes to a temporary file in the target folder and renames it, so an interrupted run
  leaves either the old file or the new one (a temporary file that was being written is removed
  on any Python-level failure, Ctrl-C included). External data files that the output still
  refers to are placed next to the output with their relative paths: nothing is copied when the
  output folder is the input folder (the same file is reused); otherwise the file is reflinked
  (copy-on-write clone, instant, on btrfs/xfs) or copied hole-aware (only the data extents are
  copied, so a sparse 2.5 GB file stays sparse), via a temporary file + rename as well.
  Hard links are deliberately not used: the input's and output's weights would then be one file,
  and an in-place update of one (training writes weights back) would silently change the other.
- Every OS-level failure reaches the user as a one-line ModelError (exit 2).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from .errors import ModelError

_MAX_PROTO = 2**31 - 1
_FICLONE = 0x40049409          # linux/fs.h: _IOW(0x94, 9, int)
_CHUNK = 8 << 20
INLINE_LIMIT = 4096            # external tensors up to this size are read in (constants)
INLINE_TOTAL = 16 << 20        # ... up to this much in all


# --- external data ---------------------------------------------------------------------------

def _all_tensors(model: onnx.ModelProto):
    """Every TensorProto of the model that may hold data: initializers, sparse initializers,
    tensor attributes (TENSOR, TENSORS, SPARSE_TENSOR, SPARSE_TENSORS), in subgraphs too."""
    A = onnx.AttributeProto

    def sparse(st):
        yield st.values
        yield st.indices

    def walk(graph):
        yield from graph.initializer
        for st in graph.sparse_initializer:
            yield from sparse(st)
        for node in graph.node:
            for a in node.attribute:
                if a.type == A.TENSOR:
                    yield a.t
                elif a.type == A.TENSORS:
                    yield from a.tensors
                elif a.type == A.SPARSE_TENSOR:
                    yield from sparse(a.sparse_tensor)
                elif a.type == A.SPARSE_TENSORS:
                    for st in a.sparse_tensors:
                        yield from sparse(st)
                elif a.type == A.GRAPH:
                    yield from walk(a.g)
                elif a.type == A.GRAPHS:
                    for g in a.graphs:
                        yield from walk(g)
    yield from walk(model.graph)


def _external_entries(model: onnx.ModelProto):
    """(tensor, {key: value}) for every tensor stored as external data."""
    for t in _all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            yield t, {e.key: e.value for e in t.external_data}


def external_locations(model: onnx.ModelProto) -> set[str]:
    return {info["location"] for _, info in _external_entries(model) if "location" in info}


def _check_location(loc: str, base: Path) -> Path:
    if not loc or "\x00" in loc:
        raise ModelError(f"external data location {loc!r} is not a valid relative file name")
    p = Path(loc)
    if p.is_absolute() or ".." in p.parts or loc.startswith(("/", "\\")) or ".." in loc.split("\\"):
        raise ModelError(f"external data location '{loc}' points outside the model's folder; "
                         "fusecli only reads external data stored beside the model (relative "
                         "path, no '..')")
    full = (base / p).resolve()
    if not str(full).startswith(str(base.resolve()) + os.sep):
        raise ModelError(f"external data location '{loc}' resolves outside the model's folder "
                         f"({full}); refusing to read it")
    return full


def _int_field(info: dict, key: str, tname: str) -> int | None:
    if key not in info:
        return None
    try:
        v = int(info[key])
    except ValueError:
        v = -1
    if v < 0:
        raise ModelError(f"tensor '{tname}': external data {key} {info[key]!r} is not a "
                         "non-negative integer")
    return v


def check_external_data(model: onnx.ModelProto, base: Path, label: str) -> None:
    """Check every external-data reference without reading any data (only stat())."""
    sizes: dict[str, int] = {}
    for t, info in _external_entries(model):
        loc = info.get("location")
        if loc is None:
            raise ModelError(f"tensor '{t.name}' of {label} is marked as external data but has no "
                             "location; re-save the model with onnx.save_model")
        full = _check_location(loc, base)
        if loc not in sizes:
            if not full.is_file():
                raise ModelError(f"external data file '{loc}' of {label} is missing (looked in "
                                 f"{base}); copy it next to the model")
            sizes[loc] = full.stat().st_size
        offset = _int_field(info, "offset", t.name) or 0
        length = _int_field(info, "length", t.name)
        end = offset + (length or 0)
        if offset > sizes[loc] or end > sizes[loc]:
            raise ModelError(f"external data of tensor '{t.name}' (bytes {offset}..{end}) goes "
                             f"past the end of '{loc}' ({sizes[loc]} bytes); the data file is "
                             "truncated or belongs to another model")


# --- loading -----------------------------------------------------------------------------------

def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model without its external data; raise ModelError with a fix hint."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"no such file: {p}")
    if p.is_dir():
        raise ModelError(f"{p} is a directory; give the path of an .onnx model file")
    if not p.is_file():
        raise ModelError(f"{p} is not a regular file; give the path of an .onnx model file")
    try:
        size = p.stat().st_size
        if size == 0:
            raise ModelError(f"{p} is empty (0 bytes); re-export the model")
        data = p.read_bytes()
    except PermissionError:
        raise ModelError(f"cannot read {p}: permission denied") from None
    except OSError as exc:
        raise ModelError(f"cannot read {p}: {exc.strerror or exc}") from None
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelError(f"{p} is not a valid ONNX model (protobuf parse failed: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'truncated or corrupt'}); "
                         "check the file is complete") from None
    del data
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelError(f"{p} parsed but holds no graph; is it really an ONNX model?")
    base = p.resolve().parent
    check_external_data(model, base, str(p))
    _inline_small_constants(model, base)
    return model


def _external_nbytes(t: onnx.TensorProto, info: dict) -> int | None:
    if "length" in info:
        return int(info["length"])
    try:
        item = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    if t.data_type == onnx.TensorProto.STRING:
        return None
    n = 1
    for d in t.dims:
        n *= d
    return n * item


def _inline_small_constants(model: onnx.ModelProto, base: Path) -> None:
    """Read the few small external tensors in (<= INLINE_LIMIT bytes each).

    Rules match on small constants (reduce axes, reshape targets, scalars); a model saved with
    ``size_threshold=0`` keeps even those outside the proto. They are read (bounded, from a file
    already checked to be inside the model's folder) and stored inline in the output; weights
    stay on disk.
    """
    total = 0
    for t, info in _external_entries(model):
        n = _external_nbytes(t, info)
        if n is None or n > INLINE_LIMIT or total + n > INLINE_TOTAL:
            continue
        full = _check_location(info["location"], base)
        offset = int(info.get("offset", 0) or 0)
        try:
            with open(full, "rb") as f:
                f.seek(offset)
                data = f.read(n)
        except OSError as exc:
            raise ModelError(f"cannot read external data '{info['location']}': "
                             f"{exc.strerror or exc}") from None
        if len(data) != n:
            raise ModelError(f"external data of tensor '{t.name}' is truncated in "
                             f"'{info['location']}'")
        total += n
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
        t.raw_data = data


# --- saving ------------------------------------------------------------------------------------

def _new_file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _mkstemp_for(dest: Path) -> tuple[int, str]:
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        mode = dest.stat().st_mode & 0o7777 if dest.exists() else _new_file_mode()
        os.fchmod(fd, mode)     # mkstemp makes 0600; the output gets the usual permissions
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd, tmp


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write_bytes(dest: Path, data: bytes) -> None:
    fd, tmp = _mkstemp_for(dest)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(dest.parent)


def _try_reflink(fin: int, fout: int) -> bool:
    try:
        import fcntl
        fcntl.ioctl(fout, _FICLONE, fin)
        return True
    except (ImportError, OSError):
        return False


def _copy_range(fin: int, fout: int, start: int, end: int) -> None:
    pos = start
    use_cfr = hasattr(os, "copy_file_range")
    while pos < end:
        n = min(_CHUNK, end - pos)
        if use_cfr:
            try:
                done = os.copy_file_range(fin, fout, n, pos, pos)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                                     errno.EPERM):
                    raise
                use_cfr = False
                continue
            if done == 0:
                raise ModelError("external data file shrank while it was being copied")
        else:
            buf = os.pread(fin, n, pos)
            if not buf:
                raise ModelError("external data file shrank while it was being copied")
            done = os.pwrite(fout, buf, pos)
        pos += done


def _data_extents(fin: int, size: int):
    """(start, end) of the data extents of a file; the whole file where holes are unknown."""
    if not (hasattr(os, "SEEK_DATA") and hasattr(os, "SEEK_HOLE")):
        yield 0, size
        return
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fin, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:      # only a hole is left
                return
            if pos == 0:                      # filesystem without SEEK_DATA: copy everything
                yield 0, size
                return
            raise
        end = min(os.lseek(fin, start, os.SEEK_HOLE), size)
        if end <= start:
            return
        yield start, end
        pos = end


def _clone_file(src: Path, fout: int) -> None:
    """Copy src into the open (empty) file fout: reflink, else hole-aware copy."""
    with open(src, "rb") as f:
        fin = f.fileno()
        size = os.fstat(fin).st_size
        if _try_reflink(fin, fout):
            return
        for start, end in _data_extents(fin, size):
            _copy_range(fin, fout, start, end)
        os.ftruncate(fout, size)   # trailing hole


def _atomic_copy(src: Path, dest: Path) -> None:
    fd, tmp = _mkstemp_for(dest)
    try:
        try:
            _clone_file(src, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
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
    if d.exists() and not d.is_file():
        raise ModelError(f"output {dest} exists and is not a regular file; choose another -o")
    parent = d.parent
    if not parent.exists():
        # an ancestor may be a regular file (e.g. -o some_file/out.onnx)
        for anc in parent.parents:
            if anc.exists():
                if not anc.is_dir():
                    raise ModelError(f"output folder {parent} cannot be created: {anc} is a "
                                     "file, not a folder")
                break
        raise ModelError(f"output folder {parent} does not exist; create it first")
    if not parent.is_dir():
        raise ModelError(f"output folder {parent} is a file, not a folder; choose another -o")
    if not os.access(parent, os.W_OK):
        raise ModelError(f"output folder {parent} is not writable")
    return d


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def save_model(model: onnx.ModelProto, dest: str | os.PathLike, src: str | os.PathLike) -> None:
    """Save atomically; place external data files still referenced beside ``dest``.

    Raises ModelError (one line) for every failure; on failure the previous ``dest`` is intact
    and no temporary file is left.
    """
    d = Path(dest).resolve()
    src_base = Path(src).resolve().parent
    if model.ByteSize() > _MAX_PROTO:
        raise ModelError("the output model is over 2 GB without external data; save the input "
                         "with external data (onnx.save_model(..., save_as_external_data=True))")
    plan: list[tuple[Path, Path]] = []
    for loc in sorted(external_locations(model)):
        s_file = _check_location(loc, src_base)
        d_file = d.parent / loc
        if _same_file(d, s_file) or _same_file(d, d_file):
            raise ModelError(f"output {dest} is the external data file '{loc}' of the model; "
                             "choose another -o")
        if _same_file(d_file, s_file):
            continue                      # output beside the input: reuse the same data file
        plan.append((s_file, d_file))
    target = d
    try:
        for s_file, d_file in plan:
            target = d_file
            d_file.parent.mkdir(parents=True, exist_ok=True)
            _atomic_copy(s_file, d_file)
        target = d
        _atomic_write_bytes(d, model.SerializeToString())
    except OSError as exc:
        raise ModelError(f"cannot write {target}: {exc.strerror or exc}; the previous file (if "
                         "any) was left unchanged") from None
