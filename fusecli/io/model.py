"""Loading and saving models safely.

Confinement: nothing is read outside the model's folder and nothing is written outside the
output's folder. The model's folder is the folder of the path as the user gave it (where onnx
and onnxruntime look for external data, even when the model file is a symbolic link), resolved
once; an external-data location must be relative, without '..', and resolve (symbolic links
followed) to a regular file inside that folder, long enough for the offset/length its tensor
names, with a length that agrees with the tensor's dims. The output's folder is resolved once
and fusecli writes only plain file names in it; an -o that is a symbolic link is refused.

Loading never reads external data (a 2 GB+ model is optimised without loading its weights),
except small tensors (<= INLINE_LIMIT bytes, constants that rules match on), which are read in.

Saving is transactional: the model and every data file it owns are written under temporary
names in the output's folder; only when all are complete are they renamed into place (signals
held off meanwhile), the model last. On any failure before that nothing at the final names has
changed; a failure during the renames puts the previous files back; temporary files are removed
on every Python-level failure, Ctrl-C and SIGTERM included. The renames run under an
exclusive flock of the output's folder, so concurrent writers commit one after the other (the
last wins, the folder holding one complete model + data set), and the data files the previous
output owned that the new one does not reference are removed. Data files are named after the
output (``OUT.data``, ``OUT.2.data``, ...; where that name is too long for the file system, a
shortened OUT + '~' + a hash of the whole name), so a file of another model is never replaced. When
the output goes to the model's folder the data files are reused as they are (nothing written);
elsewhere they are reflinked (copy-on-write clone) or copied hole-aware (a sparse 2.5 GB file
stays sparse). Hard links are deliberately not used: an in-place update of one model's weights
(training writes weights back) would silently change the other's.

Outputs get the input's permission bits (read/write only), never wider, and never wider than
the umask allows. Every OS-level failure reaches the user as a one-line ModelError (exit 2).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import stat
import tempfile
from pathlib import Path

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from fusecli.errors import ModelError
from fusecli.io.userfiles import os_reason

_MAX_PROTO = 2**31 - 1
_FICLONE = 0x40049409          # linux/fs.h: _IOW(0x94, 9, int)
_CHUNK = 8 << 20
INLINE_LIMIT = 4096            # external tensors up to this size are read in (constants)
INLINE_TOTAL = 16 << 20        # ... up to this much in all
_TMP_PREFIX = ".fusecli-"      # temporary files in the output's folder: .fusecli-XXXXXXXX.tmp
_OLD_MODEL_MAX = 64 << 20      # a previous output read for its data files' names: up to this


# --- paths -------------------------------------------------------------------------------------

def _stat(p: Path, what: str, follow: bool = True) -> os.stat_result | None:
    """os.stat (or lstat); None when nothing is there (or a part of the path is a file); a
    ModelError for any other failure."""
    try:
        return os.stat(p) if follow else os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ModelError(f"cannot use {what} {p}: {os_reason(exc)}") from None


def _resolve(p: Path, what: str) -> Path:
    try:
        return p.resolve(strict=True)
    except FileNotFoundError:
        raise ModelError(f"{what} {p} does not exist") from None
    except RuntimeError:           # Python 3.11: a symlink loop
        raise ModelError(f"cannot use {what} {p}: symbolic link loop") from None
    except OSError as exc:
        raise ModelError(f"cannot use {what} {p}: {os_reason(exc)}") from None


def model_folder(path: str | os.PathLike) -> Path:
    """The folder a model's external data is read from: the folder of the path as given (not
    of a symlink's target, as onnx and onnxruntime do), resolved once."""
    return _resolve(Path(os.path.dirname(os.fspath(path)) or "."), "the model's folder")


def _inside(p: Path, folder: Path) -> bool:
    return p != folder and p.is_relative_to(folder)


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
            if not all(isinstance(x, str) for e in t.external_data for x in (e.key, e.value)):
                # protobuf hands back bytes for a string field that is not valid UTF-8
                raise ModelError(f"tensor {t.name!r} has external-data entries that are not "
                                 "valid UTF-8 text; the file is damaged (re-export the model)")
            yield t, {e.key: e.value for e in t.external_data}


def external_locations(model: onnx.ModelProto) -> set[str]:
    return {info["location"] for _, info in _external_entries(model) if "location" in info}


def _check_location(loc: str, base: Path) -> Path:
    """The resolved data file of a location, confined to ``base`` (already resolved)."""
    if not loc or "\x00" in loc:
        raise ModelError(f"external data location {loc!r} is not a valid relative file name")
    p = Path(loc)
    if p.is_absolute() or ".." in p.parts or loc.startswith(("/", "\\")) or ".." in loc.split("\\"):
        raise ModelError(f"external data location {loc!r} points outside the model's folder; "
                         "fusecli only reads external data stored beside the model (relative "
                         "path, no '..')")
    try:
        full = (base / p).resolve()
    except RuntimeError:
        raise ModelError(f"external data location {loc!r}: symbolic link loop") from None
    except OSError as exc:
        raise ModelError(f"external data location {loc!r}: {os_reason(exc)}") from None
    if not _inside(full, base):
        raise ModelError(f"external data location {loc!r} resolves outside the model's folder "
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
        raise ModelError(f"tensor {tname!r}: external data {key} {info[key][:40]!r} is not a "
                         "non-negative integer")
    return v


def _dims_nbytes(t: onnx.TensorProto) -> int | None:
    """Bytes the tensor's dims and type call for (None: a type without a fixed size)."""
    if any(d < 0 for d in t.dims):
        raise ModelError(f"tensor {t.name!r} stored as external data has a negative dimension "
                         f"{list(t.dims)}; a stored tensor needs a fixed shape (re-export it)")
    if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        item = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    n = 1
    for d in t.dims:
        n *= d
    if t.data_type in _PACKED_4BIT:
        return (n + 1) // 2
    return n * item


_PACKED_4BIT = {getattr(onnx.TensorProto, k) for k in ("INT4", "UINT4", "FLOAT4E2M1")
                if hasattr(onnx.TensorProto, k)}


def check_external_data(model: onnx.ModelProto, base: Path,
                        label: str) -> list[tuple[onnx.TensorProto, Path, int, int | None]]:
    """Check every external-data reference without reading any data (only stat()).

    Returns (tensor, data file, offset, byte length or None) for each external tensor."""
    sizes: dict[Path, int] = {}
    out = []
    for t, info in _external_entries(model):
        loc = info.get("location")
        if loc is None:
            raise ModelError(f"tensor {t.name!r} of {label} is marked as external data but has "
                             "no location; re-save the model with onnx.save_model")
        full = _check_location(loc, base)
        if full not in sizes:
            st = _stat(full, "external data file")
            if st is None or not stat.S_ISREG(st.st_mode):
                raise ModelError(f"external data file {loc!r} of {label} is "
                                 f"{'missing' if st is None else 'not a regular file'} (looked "
                                 f"in {base}); copy the data file next to the model")
            sizes[full] = st.st_size
        offset = _int_field(info, "offset", t.name) or 0
        length = _int_field(info, "length", t.name)
        want = _dims_nbytes(t)
        if length is not None and want is not None and length != want:
            raise ModelError(f"external data of tensor {t.name!r} is {length} bytes long but its "
                             f"dims {list(t.dims)} need {want}; the model is corrupt (re-save it)")
        n = length if length is not None else want
        end = offset + (n or 0)
        if offset > sizes[full] or end > sizes[full]:
            raise ModelError(f"external data of tensor {t.name!r} (bytes {offset}..{end}) goes "
                             f"past the end of {loc!r} ({sizes[full]} bytes); the data file is "
                             "truncated or belongs to another model")
        out.append((t, full, offset, n))
    return out


# --- loading -----------------------------------------------------------------------------------

def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model without its external data; raise ModelError with a fix hint."""
    p = Path(path)
    st = _stat(p, "model")
    if st is None:
        raise ModelError(f"no such file: {p}")
    if stat.S_ISDIR(st.st_mode):
        raise ModelError(f"{p} is a directory; give the path of an .onnx model file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{p} is not a regular file; give the path of an .onnx model file")
    if st.st_size == 0:
        raise ModelError(f"{p} is empty (0 bytes); re-export the model")
    if st.st_size > _MAX_PROTO:
        raise ModelError(f"{p} is {st.st_size} bytes, over protobuf's 2 GB limit; save the "
                         "model with external data (onnx.save_model(..., "
                         "save_as_external_data=True))")
    base = model_folder(p)
    try:
        with open(p, "rb") as f:
            data = f.read(_MAX_PROTO + 1)
    except OSError as exc:
        raise ModelError(f"cannot read {p}: {os_reason(exc)}") from None
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
    check_strings(model, str(p))
    _inline_small_constants(check_external_data(model, base, str(p)))
    return model


# --- text fields -------------------------------------------------------------------------------
# protobuf (upb) hands back a proto2 `string` field that is not valid UTF-8 as bytes, and an
# attribute's text (`s`, `strings`) is a `bytes` field that fusecli decodes: both are checked here,
# once, so that nothing downstream meets bytes where it expects text.

_TEXT_BYTES = {("onnx.AttributeProto", "s"), ("onnx.AttributeProto", "strings")}
_FIELDS: dict = {}     # message descriptor -> (text fields, message fields), each [(name, repeated)]


def _fields_of(desc):
    got = _FIELDS.get(desc)
    if got is None:
        strs, msgs = [], []
        for f in desc.fields:
            rep = getattr(f, "is_repeated", None)
            if rep is None:                      # protobuf before 5.28
                rep = f.label == FieldDescriptor.LABEL_REPEATED
            if f.type == FieldDescriptor.TYPE_STRING or (desc.full_name, f.name) in _TEXT_BYTES:
                strs.append((f.name, rep))
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                msgs.append((f.name, rep))
        got = _FIELDS[desc] = (tuple(strs), tuple(msgs))
    return got


def _is_text(v) -> bool:
    if type(v) is str:
        return True
    try:
        v.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _bad_text(msg, path: tuple):
    """(path, field name, index) of the first text field of ``msg`` (walked depth first) that
    is not valid UTF-8, else None; ``path`` is the chain (parent path, field, index, message)
    down to ``msg``. Only text and message fields are read (never a tensor's data)."""
    strs, msgs = _fields_of(msg.DESCRIPTOR)
    for name, rep in strs:
        v = getattr(msg, name)
        if rep:
            if v and not all(type(x) is str for x in v):
                for i, x in enumerate(v):
                    if not _is_text(x):
                        return path, name, i
        elif type(v) is not str and not _is_text(v):
            return path, name, None
    for name, rep in msgs:
        if rep:
            v = getattr(msg, name)
            for i, sub in enumerate(v):
                found = _bad_text(sub, (path, name, i, sub))
                if found:
                    return found
        elif msg.HasField(name):
            sub = getattr(msg, name)
            found = _bad_text(sub, (path, name, None, sub))
            if found:
                return found
    return None


def _shown(v) -> str:
    """A name for a message: quoted, cut to 40 characters, undecodable bytes escaped."""
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    return repr(v if len(v) <= 40 else v[:40] + "...")


_WHERE = {"graph": None, "node": "node", "initializer": "initializer", "input": "graph input",
          "output": "graph output", "value_info": "value_info", "functions": "function",
          "sparse_initializer": "sparse initializer", "metadata_props": "metadata entry",
          "opset_import": "opset import", "attribute": "attribute", "training_info": "training info",
          "t": "tensor", "tensors": "tensor", "g": "subgraph", "graphs": "subgraph",
          "external_data": "external data entry", "dim": "dim", "type": None, "tensor_type": None,
          "sparse_tensor_type": None, "sequence_type": None, "map_type": None,
          "optional_type": None, "elem_type": None, "value_type": None, "shape": None}


def _describe(path: tuple, field: str, index) -> str:
    steps = []
    while path:
        path, *step = path
        steps.append(step)
    parts = []
    for name, i, sub in reversed(steps):
        what = _WHERE.get(name, name)
        if what is None:
            continue
        label = getattr(sub, "name", None) or getattr(sub, "key", None) or (
            getattr(sub, "domain", None) if name == "opset_import" else None)
        if what == "attribute" and label:
            parts.append(f"attribute {_shown(label)}")
            continue
        part = what if i is None else f"{what} {i}"
        parts.append(part + (f" ({_shown(label)})" if label else ""))
    if steps and steps[0][0] == "attribute" and field in ("s", "strings"):
        # the attribute's value: "attribute 'auto_pad'", "attribute 'names' (string 2)"
        if index is not None:
            parts[-1] += f" (string {index})"
        return ": ".join(parts)
    parts.append(field.replace("_", " ") + (f" {index}" if index is not None else ""))
    return ": ".join(parts)


def check_strings(model: onnx.ModelProto, label: str) -> None:
    """Refuse (ModelError, one line naming the field and where it is) a model with a text field
    that is not valid UTF-8: op types, domains, node / tensor / value names, attribute strings,
    doc strings, metadata, in subgraphs and functions too."""
    found = _bad_text(model, ())
    if found:
        raise ModelError(f"{label}: {_describe(*found)} is not valid UTF-8; re-export the model "
                         "or fix the file")


def _inline_small_constants(entries) -> None:
    """Read the few small external tensors in (<= INLINE_LIMIT bytes each).

    Rules match on small constants (reduce axes, reshape targets, scalars); a model saved with
    ``size_threshold=0`` keeps even those outside the proto. They are read (bounded, from a file
    already checked to be inside the model's folder and long enough) and stored inline in the
    output; weights stay on disk.
    """
    total = 0
    for t, full, offset, n in entries:
        if n is None or n > INLINE_LIMIT or total + n > INLINE_TOTAL:
            continue
        try:
            with open(full, "rb") as f:
                f.seek(offset)
                data = f.read(n)
        except OSError as exc:
            raise ModelError(f"cannot read external data {full.name!r}: "
                             f"{os_reason(exc)}") from None
        if len(data) != n:
            raise ModelError(f"external data of tensor {t.name!r} is truncated in {full.name!r}")
        total += n
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
        t.raw_data = data


# --- saving ------------------------------------------------------------------------------------

def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _mode_like(src: Path) -> int:
    """The input's read/write permission bits, never wider than the umask allows."""
    st = _stat(src, "input")
    bits = st.st_mode if st is not None else 0o666
    return bits & 0o666 & ~_umask()


def _new_temp(folder: Path, mode: int) -> tuple[int, Path]:
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, Path(tmp)


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


def check_output_path(src: str | os.PathLike, dest: str | os.PathLike, in_place: bool,
                      data_files: bool = True) -> Path:
    """The output path to write (its folder resolved once, its name not), after refusing what
    cannot or must not be written: the input itself (without --in-place), a folder, a special
    file, a symbolic link, a missing or read-only folder, a name too long for the file system.
    (A name the file system takes is never refused for its data files' sake: they get names
    that fit, see ``_owned_data_name``.)"""
    d = Path(dest)
    name = d.name
    if name in ("", ".", ".."):
        raise ModelError(f"output {dest} is not a file name; give one such as model.fused.onnx")
    given = Path(os.path.dirname(os.fspath(d)) or ".")
    st = _stat(given, "output folder")
    if st is None:
        for anc in given.parents:      # an ancestor may be a regular file (-o a_file/out.onnx)
            ast = _stat(anc, "output folder")
            if ast is not None:
                if not stat.S_ISDIR(ast.st_mode):
                    raise ModelError(f"output folder {given} cannot be created: {anc} is a "
                                     "file, not a folder")
                break
        raise ModelError(f"output folder {given} does not exist; create it first")
    if not stat.S_ISDIR(st.st_mode):
        raise ModelError(f"output folder {given} is a file, not a folder; choose another -o")
    folder = _resolve(given, "output folder")
    out = folder / name
    name_max = _name_max(folder)
    if len(os.fsencode(name)) > name_max:
        raise ModelError(f"output file name is {len(os.fsencode(name))} bytes long; this file "
                         f"system allows {name_max}: choose a name of at most {name_max} bytes")
    lst = _stat(out, "output", follow=False)
    if lst is not None:
        if stat.S_ISLNK(lst.st_mode):
            raise ModelError(f"output {dest} is a symbolic link; fusecli writes only regular "
                             "files in the output's folder: remove the link or choose another -o")
        if stat.S_ISDIR(lst.st_mode):
            raise ModelError(f"output {dest} is a directory; give a file name such as "
                             f"{Path(dest) / Path(src).name}")
        if not stat.S_ISREG(lst.st_mode):
            raise ModelError(f"output {dest} exists and is not a regular file; choose another -o")
        if _same_file(out, Path(src)) and not in_place:
            raise ModelError(f"output {dest} is the input file; choose another -o or pass "
                             "--in-place")
    if not os.access(folder, os.W_OK):
        raise ModelError(f"output folder {given} is not writable")
    return out


def check_text_output(dest: str | os.PathLike, force: bool) -> Path:
    """The path to write a text file (``rules new -o``) at, refused as ``optimize -o`` is (a
    symbolic link, dangling or not, a folder, a special file, a missing or read-only folder),
    and an existing file without ``force``."""
    out = check_output_path(dest, dest, in_place=True, data_files=False)
    if os.path.lexists(out) and not force:
        raise ModelError(f"{dest} exists; pass --force to overwrite it")
    return out


def save_text(text: str, dest: str | os.PathLike, force: bool) -> None:
    """Write ``text`` to ``dest`` as ``save_model`` writes a model: checked as
    ``check_text_output``, a temporary file in the destination's folder renamed into place."""
    out = check_text_output(dest, force)
    fd, tmp = _new_temp(out.parent, 0o666 & ~_umask())
    try:
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            with _signals_held():
                os.replace(tmp, out)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)            # gone already when it was renamed into place
    except OSError as exc:
        raise ModelError(f"cannot write {dest}: {os_reason(exc)}") from None


def _same_file(a: Path, b: Path) -> bool:
    ida = _file_id(a)
    return ida is not None and ida == _file_id(b)


def _file_id(p: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(p)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _name_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return 255


def _owned_data_name(out: Path, k: int, name_max: int = 255) -> str:
    """The name of the k-th data file ``out`` owns: ``OUT.data``, ``OUT.2.data``, ...; where
    that is longer than the file system allows, the output's name cut to fit (at a character
    boundary) + '~' + 12 hex digits of the hash of the whole name (so two long names sharing a
    prefix get different files) + the same suffix. The model records the name it uses."""
    suffix = ".data" if k == 0 else f".{k + 1}.data"
    full = out.name + suffix
    if len(os.fsencode(full)) <= name_max:
        return full
    tag = "~" + hashlib.sha256(os.fsencode(out.name)).hexdigest()[:12]
    room = max(name_max - len(tag) - len(suffix), 1)
    stem = os.fsencode(out.name)[:room].decode("utf-8", "ignore") or "m"
    return stem + tag + suffix


def _plan_data(model: onnx.ModelProto, out: Path, src: Path) -> list[tuple[Path, Path]]:
    """(source data file, owned destination) for every data file to write beside ``out``; the
    model's locations are pointed at the owned names. Beside the input nothing is written."""
    src_base = model_folder(src)
    folder = out.parent
    by_loc = {loc: _check_location(loc, src_base) for loc in sorted(external_locations(model))}
    for loc, s_file in by_loc.items():
        if _same_file(out, s_file):
            raise ModelError(f"output {out} is the external data file {loc!r} of the model; "
                             "choose another -o")
    if folder == src_base or not by_loc:
        return []
    inputs = {_file_id(f) for f in [src, *by_loc.values()]} - {None}
    targets: dict[Path, str] = {}
    plan = []
    name_max = _name_max(folder)
    for s_file in by_loc.values():
        if s_file in targets:
            continue
        new = _owned_data_name(out, len(targets), name_max)
        d_file = folder / new
        if _file_id(d_file) in inputs:
            raise ModelError(f"the data file {new} that {out.name} would own is a file of the "
                             "input model; choose another -o")
        targets[s_file] = new
        plan.append((s_file, d_file))
    renamed = {loc: targets[s_file] for loc, s_file in by_loc.items()}
    for t, _ in _external_entries(model):
        for e in t.external_data:
            if e.key == "location" and e.value in renamed:
                e.value = renamed[e.value]
    return plan


@contextlib.contextmanager
def _folder_locked(folder: Path):
    """An exclusive flock on the output's folder while a writer commits: two fusecli runs
    writing the same output (or outputs in one folder) rename their files in turn, so the
    folder always holds one writer's complete model + data set (the last to commit wins)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield
        return
    try:
        try:
            import fcntl
            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):   # a file system without flock: as before
            pass
        yield
    finally:
        os.close(fd)                     # releases the lock


def _owned_references(out: Path, inputs: set) -> set[str]:
    """The data files the model now at ``out`` references that ``out`` owns (named as
    ``_owned_data_name`` names them) and that are no file of the input: what a new output
    replaces. Empty where there is no readable previous model."""
    st = _stat(out, "output", follow=False)
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size > _OLD_MODEL_MAX:
        return set()
    old = onnx.ModelProto()
    try:
        with open(out, "rb") as f:
            old.ParseFromString(f.read(_OLD_MODEL_MAX))
        locs = external_locations(old)
    except (OSError, DecodeError, RuntimeError, ValueError, ModelError):
        return set()
    name_max = _name_max(out.parent)
    owned = {_owned_data_name(out, k, name_max) for k in range(len(locs))}
    return {loc for loc in locs & owned if _file_id(out.parent / loc) not in inputs}


def _remove_stale(folder: Path, names: set[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(folder / name)


@contextlib.contextmanager
def _signals_held():
    """SIGINT/SIGTERM wait (they are delivered afterwards) while the renames run."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _commit(renames: list[tuple[Path, Path]], folder: Path) -> None:
    """Rename every (temporary, final) pair, the last one (the model) last. If one fails, the
    files already renamed are put back as they were, and the error is raised."""
    done: list[tuple[Path, Path | None]] = []   # (final, backup of what it replaced)
    try:
        for tmp, final in renames[:-1]:
            backup = None
            if os.path.lexists(final):
                fd, b = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".tmp", dir=folder)
                os.close(fd)
                backup = Path(b)
                try:
                    os.replace(final, backup)
                except BaseException as exc:
                    with contextlib.suppress(OSError):
                        os.unlink(backup)
                    if not isinstance(exc, FileNotFoundError):
                        raise
                    backup = None                # gone meanwhile: nothing to put back
            done.append((final, backup))
            os.replace(tmp, final)
        tmp, final = renames[-1]
        os.replace(tmp, final)
    except BaseException:
        for final, backup in reversed(done):
            with contextlib.suppress(OSError):
                if backup is not None:
                    os.replace(backup, final)
                else:
                    os.unlink(final)
        raise
    for _, backup in done:
        if backup is not None:
            with contextlib.suppress(OSError):
                os.unlink(backup)


def save_model(model: onnx.ModelProto, dest: str | os.PathLike, src: str | os.PathLike) -> None:
    """Save transactionally; place the external data files the model owns beside ``dest``.

    Raises ModelError (one line) for every failure; on failure the previous output (model and
    data) is byte-identical and no temporary file is left.
    """
    src = Path(src)
    out = check_output_path(src, dest, in_place=True)
    if model.ByteSize() > _MAX_PROTO:
        raise ModelError("the output model is over 2 GB without external data; save the input "
                         "with external data (onnx.save_model(..., save_as_external_data=True))")
    plan = _plan_data(model, out, src)
    folder = out.parent
    temps: list[Path] = []
    renames: list[tuple[Path, Path]] = []
    target = out
    try:
        try:
            for s_file, d_file in plan:
                target = d_file
                fd, tmp = _new_temp(folder, _mode_like(s_file))
                temps.append(tmp)
                try:
                    _clone_file(s_file, fd)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                renames.append((tmp, d_file))
            target = out
            fd, tmp = _new_temp(folder, _mode_like(src))
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(model.SerializeToString())
                f.flush()
                os.fsync(f.fileno())
            renames.append((tmp, out))
            with _signals_held(), _folder_locked(folder):
                inputs = {_file_id(f) for f in [src, *(s for s, _ in plan)]} - {None}
                stale = _owned_references(out, inputs) - external_locations(model)
                _commit(renames, folder)
                _remove_stale(folder, stale)
        finally:
            for tmp in temps:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)        # gone already when it was renamed into place
    except OSError as exc:
        raise ModelError(f"cannot write {target}: {os_reason(exc)}; the previous output (model "
                         "and data, if any) was left unchanged") from None
    _fsync_dir(folder)
