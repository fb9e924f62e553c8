"""Run one ONNX model once in onnxruntime (standalone: numpy + onnxruntime + stdlib only).

usage: python fusecli/runtime/runtime_worker.py --model M.onnx --feeds feeds.npz [--feeds more.npz ...]
           --out out.npz [--library custom_ops.so] [--opt-level disable|basic|extended|all]
           [--threads N] [--deterministic [--reuse]] [--profile DIR] [--repeat N]

Runs under the main venv (onnxruntime) and under .venv-ortt (onnxruntime-training), which is
why it must not import the fusecli package. Writes to --out every graph output under its name
and, for every fed input, its value AFTER the run under 'fed/<input name>' (onnxruntime-training
writes gradients in place into the fed '*accumulation.buffer' arrays). Each further --feeds file
is run in a FRESH session of the same model (so seeded random ops draw what they drew in the
first run) and its results are written under 'run<k>/<name>' (k = 1, 2, ...).
--deterministic: one intra-op thread and onnxruntime's use_deterministic_compute, so that a run
does not depend on thread scheduling (e.g. the multi-threaded ScatterND of embedding gradients),
and no buffer reuse unless --reuse.
Prints one JSON line on stdout ({"runtime": ..., ...}); on error prints one line to stderr and
exits 2, control characters in it escaped (names in the runtime's message cannot forge lines).
Every key of the .npz files, both ways, is a name percent-encoded (``encode_key``: a tensor
name may hold newlines, '/', escape sequences; the key is plain ASCII without '/'), so
'fed/<name>' is 'fed/' + encode_key(name) and ``decode_key`` of the whole key gives it back.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from urllib.parse import quote, unquote

OPT_LEVELS = ("disable", "basic", "extended", "all")


def _runtime_name(ort) -> str:
    """'onnxruntime-training X' when the training build is installed, else 'onnxruntime X'.

    `import onnxruntime.training` itself needs torch (its optim helpers import it), which the
    run-time venv does not have; the presence of the subpackage identifies the training build.
    """
    import importlib.util

    try:
        import onnxruntime.training  # noqa: F401

        training = True
    except Exception:  # noqa: BLE001
        try:
            training = importlib.util.find_spec("onnxruntime.training") is not None
        except Exception:  # noqa: BLE001
            training = False
    return f"onnxruntime-training {ort.__version__}" if training else f"onnxruntime {ort.__version__}"


def session_options(ort, opt_level: str = "disable", threads: int = 0, library: str | None = None,
                    profile: str | None = None, spinning: bool = False, arena: bool = True,
                    deterministic: bool = False, reuse: bool = False):
    """SessionOptions shared by the run and bench workers (idle spinning off unless asked).
    ``deterministic``: one intra-op thread and use_deterministic_compute, and no buffer reuse
    unless ``reuse``."""
    so = ort.SessionOptions()
    if deterministic:
        threads = 1
        so.use_deterministic_compute = True
        # no buffer reuse: with symbolic dims, onnxruntime-training 1.19.2 lets later nodes
        # overwrite the buffers behind verify's probes (Identity copies to graph outputs) of
        # intermediates, e.g. a LayerNormalization's saved inv_std (measured: 3.4x off with
        # reuse, 1.3e-7 without). Without reuse it plans some graphs wrong instead (a speech
        # model's positional-conv LayerNorm backward: a Scale by 0), so verify judges outputs
        # that differ once more on runs without probes, with reuse (``reuse``)
        so.enable_mem_reuse = reuse
    spin = "1" if spinning else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", spin)
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[opt_level]
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if not arena:
        so.enable_cpu_mem_arena = False
    if profile:
        os.makedirs(profile, exist_ok=True)
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(profile, "ort_profile")
    if library:
        if not os.path.exists(library):
            raise FileNotFoundError(f"custom-op library not found: {library}")
        so.register_custom_ops_library(os.path.abspath(library))
    return so


def encode_key(name: str) -> str:
    """A name as an .npz key: percent-encoded UTF-8 (ASCII letters, digits and '_.-~' kept)."""
    return quote(name, safe="", errors="surrogateescape")


def decode_key(key: str) -> str:
    return unquote(key, errors="surrogateescape")


def save_arrays(path: str, arrays: dict) -> None:
    import numpy as np

    np.savez(path, **{encode_key(k): v for k, v in arrays.items()})


def load_feeds(path: str) -> dict:
    import numpy as np

    with np.load(path, allow_pickle=False) as z:
        return {decode_key(k): np.ascontiguousarray(z[k]) for k in z.files}


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)]}
_CONTROL.update({0x2028: "\\u2028", 0x2029: "\\u2029"})


def escape_line(text: str) -> str:
    """``text`` with whitespace runs (newlines included) as one space and every other control
    character (C0, DEL, C1, the Unicode line and paragraph separators) escaped: one printable
    line."""
    return " ".join(str(text).split()).translate(_CONTROL)


def input_names(sess, loaded: dict, label: str = "") -> list[str]:
    names = [i.name for i in sess.get_inputs()]
    missing = [n for n in names if n not in loaded]
    if missing:
        raise KeyError(f"feeds lack graph inputs{f' of model {label}' if label else ''}: "
                       f"{', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    return names


def report_error(prog: str, exc: BaseException) -> int:
    """The workers' failure contract: one line on stderr, exit code 2."""
    msg = escape_line(f"{type(exc).__name__}: {exc}")
    print(f"{prog}: error: {msg[:2000]}", file=sys.stderr)
    return 2


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--feeds", required=True, action="append",
                    help=".npz keyed by graph input name (repeatable: one fresh session each)")
    ap.add_argument("--out", required=True, help=".npz to write")
    ap.add_argument("--library", default=None, help="custom-op shared library to register")
    ap.add_argument("--opt-level", default="disable", choices=OPT_LEVELS)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = ORT default)")
    ap.add_argument("--deterministic", action="store_true",
                    help="one intra-op thread and use_deterministic_compute")
    ap.add_argument("--reuse", action="store_true",
                    help="with --deterministic: keep onnxruntime's buffer reuse")
    ap.add_argument("--profile", default=None, metavar="DIR", help="enable profiling into DIR")
    ap.add_argument("--repeat", type=int, default=0, help="time N extra runs (fresh feeds each)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        import numpy as np
        import onnxruntime as ort

        runtime = _runtime_name(ort)

        def session():
            so = session_options(ort, args.opt_level, args.threads, args.library, args.profile,
                                 deterministic=args.deterministic, reuse=args.reuse)
            return ort.InferenceSession(args.model, sess_options=so,
                                        providers=["CPUExecutionProvider"])

        sess = session()
        loaded = load_feeds(args.feeds[0])
        names = input_names(sess, loaded)
        # contiguous, writable arrays: ort-training writes gradients into them in place
        feeds = {n: np.require(loaded[n], requirements=["C", "W"]).copy() for n in names}
        out_names = [o.name for o in sess.get_outputs()]

        t0 = time.perf_counter()
        outs = sess.run(out_names, feeds)
        first_ms = (time.perf_counter() - t0) * 1e3
        result = {n: np.asarray(v) for n, v in zip(out_names, outs)}
        for n, v in feeds.items():
            result[f"fed/{n}"] = v
        for k, path in enumerate(args.feeds[1:], start=1):
            more = load_feeds(path)
            fresh = {n: np.require(more[n], requirements=["C", "W"]).copy()
                     for n in input_names(sess, more)}
            for n, v in zip(out_names, session().run(out_names, fresh)):
                result[f"run{k}/{n}"] = np.asarray(v)
            for n, v in fresh.items():
                result[f"run{k}/fed/{n}"] = v
        times = []
        for _ in range(max(args.repeat, 0)):
            fresh = {n: loaded[n].copy() for n in names}  # the buffers must start from the feed
            t0 = time.perf_counter()
            sess.run(out_names, fresh)
            times.append((time.perf_counter() - t0) * 1e3)
        if times:
            result["__times_ms__"] = np.asarray(times, dtype=np.float64)
        info = {"runtime": runtime, "model": args.model, "opt_level": args.opt_level,
                "library": args.library, "outputs": len(out_names),
                "deterministic": bool(args.deterministic),
                "first_run_ms": round(first_ms, 3)}
        if times:
            info["median_ms"] = round(float(np.median(times)), 3)
        if args.profile:
            prof = sess.end_profiling()
            result["__profile__"] = np.asarray(prof)
            info["profile"] = prof
        save_arrays(args.out, result)
    except Exception as e:  # noqa: BLE001 - one line to stderr, exit 2
        return report_error("runtime_worker", e)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
