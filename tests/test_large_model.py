"""A model with over 2 GB of external weights goes through the real `fusecli optimize` without
the weights ever being loaded: the child's peak RSS stays far below their size, and the output's
external data file is placed beside the output (cheaply: the same file when the output folder is
the input folder, else a reflink or a hole-aware copy, so a sparse file stays sparse).

The weights file is sparse (made with truncate), so the test needs almost no disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto

import builders
from conftest import FUSECLI

N, K, M = 20480, 32768, 4                       # W: N x K float32 = 2.5 GiB
W_BYTES = N * K * 4
A_OFFSET = W_BYTES                               # A: M x K right after W (4096-aligned)
A_BYTES = M * K * 4
DATA = "weights/big.bin"
HEAD = b"fusecli-large-model-test"               # real bytes at the start of W, and of A
RSS_LIMIT_MB = 500

_RSS_WRAPPER = """
import resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - t
rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(repr((p.returncode, p.stdout, p.stderr, rss_kb, wall)))
"""


def run_measured(*args):
    """Run the real console script under a wrapper that reports the child's peak RSS (KiB)."""
    out = subprocess.run([sys.executable, "-c", _RSS_WRAPPER, str(FUSECLI), *map(str, args)],
                         capture_output=True, text=True, check=True, timeout=600)
    import ast
    rc, stdout, stderr, rss_kb, wall = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return rc, stdout, stderr, rss_kb / 1024, wall


def _external(t: onnx.TensorProto, offset: int, length: int) -> None:
    t.data_location = TensorProto.EXTERNAL
    t.ClearField("raw_data")
    for k, v in (("location", DATA), ("offset", str(offset)), ("length", str(length))):
        t.external_data.add(key=k, value=v)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("large")
    if shutil.disk_usage(root).free < 2 << 30:
        pytest.skip("needs ~2 GiB free for safety (the sparse file itself takes ~no space)")
    m = builders.ortt_linear_act("relu", M=M, N=N, K=K)
    keep = [i for i in m.graph.input if i.name not in ("A", "W")]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    for name, dims, off, n in (("W", [N, K], 0, W_BYTES), ("A", [M, K], A_OFFSET, A_BYTES)):
        t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims)
        _external(t, off, n)
        m.graph.initializer.append(t)
    (root / "weights").mkdir()
    with open(root / DATA, "wb") as f:
        f.write(HEAD)
        f.seek(A_OFFSET)
        f.write(HEAD)
        f.truncate(A_OFFSET + A_BYTES)           # sparse: the rest is a hole
    (root / "big.onnx").write_bytes(m.SerializeToString())
    st = os.stat(root / DATA)
    assert st.st_size > 2 << 30
    return root, st


def _locations(path):
    m = onnx.load(path, load_external_data=False)
    return {t.name: {e.key: e.value for e in t.external_data} for t in m.graph.initializer
            if t.data_location == TensorProto.EXTERNAL}


def _check_output(src_root, out, report_line, data_location=DATA):
    """data_location: the output's data file (the input's beside it; its own elsewhere)."""
    proto = onnx.load(out, load_external_data=False)
    assert [n.op_type for n in proto.graph.node] == ["LinearActivationGrad"]
    want = _locations(src_root / "big.onnx")
    for info in want.values():
        info["location"] = data_location
    assert _locations(out) == want
    data = out.parent / data_location
    assert data.stat().st_size == (src_root / DATA).stat().st_size
    with open(data, "rb") as f:
        assert f.read(len(HEAD)) == HEAD
        f.seek(A_OFFSET)
        assert f.read(len(HEAD)) == HEAD
        f.seek(W_BYTES // 2)
        assert f.read(16) == b"\0" * 16
    print(report_line)


def test_optimize_over_2gb_without_loading_weights(big_model, tmp_path):
    root, st = big_model
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "big.fused.onnx"
    rc, stdout, stderr, rss_mb, wall = run_measured("optimize", root / "big.onnx", "-o", out,
                                                    "--json")
    assert rc == 0, stderr
    assert json.loads(stdout)["total_fused"] == 1
    data = out_dir / "big.fused.onnx.data"         # named after (owned by) the output
    disk_mb = data.stat().st_blocks * 512 / 2**20
    _check_output(root, out, f"\n[large model] weights {st.st_size / 2**30:.2f} GiB, "
                  f"output in another folder: peak RSS {rss_mb:.0f} MiB, wall {wall:.1f} s, "
                  f"output data file occupies {disk_mb:.1f} MiB on disk", data.name)
    assert rss_mb < RSS_LIMIT_MB
    assert disk_mb < 64                           # the copy kept the holes
    assert os.stat(data).st_ino != st.st_ino      # a copy, never a hard link to the input's
    assert os.stat(root / DATA).st_mtime_ns == st.st_mtime_ns


def test_optimize_over_2gb_same_folder_reuses_weights(big_model):
    root, st = big_model
    out = root / "big.fused.onnx"
    try:
        rc, stdout, stderr, rss_mb, wall = run_measured("optimize", root / "big.onnx", "-o", out)
        assert rc == 0, stderr
        _check_output(root, out, f"\n[large model] same folder: peak RSS {rss_mb:.0f} MiB, "
                      f"wall {wall:.1f} s, weights file reused")
        assert rss_mb < RSS_LIMIT_MB
        after = os.stat(root / DATA)
        assert (after.st_ino, after.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    finally:
        out.unlink(missing_ok=True)


def test_stats_over_2gb(big_model):
    root, _ = big_model
    rc, stdout, stderr, rss_mb, wall = run_measured("stats", root / "big.onnx", "--json")
    assert rc == 0, stderr
    assert json.loads(stdout)["total_fused"] == 1
    print(f"\n[large model] stats: peak RSS {rss_mb:.0f} MiB, wall {wall:.1f} s")
    assert rss_mb < RSS_LIMIT_MB
