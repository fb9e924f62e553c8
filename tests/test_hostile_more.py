"""The second round of hostile inputs (issue 24), through the real `fusecli` console script
where the class is about the command line: symlinked models whose data exists twice,
concurrent writers of one output, output names near the file-system limit, a misbehaving
runtime interpreter, verify on already-fused and empty-tensor graphs, `rules new -o` through
symbolic links, names holding control characters, and half-precision graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import builders
from conftest import FUSECLI, SAMPLES, run_cli
from test_bad_input import one_line_error, snapshot
from test_hostile import _feeds_for, _initializers, _linear_model, _to_float16

SAMPLE = SAMPLES / "ortt_mlp.onnx"


def _linked(tmp_path: Path, how: str = "absolute") -> Path:
    """a/m.onnx is a symbolic link to b/m.onnx; a/weights.bin and b/weights.bin both exist and
    hold different values (same layout). onnx and onnxruntime read a/weights.bin."""
    beside, _ = _linear_model(tmp_path / "a", seed=1)
    target, _ = _linear_model(tmp_path / "b", seed=5)
    beside.unlink()
    if how == "absolute":
        os.symlink(target, beside)
    elif how == "relative":
        os.symlink(os.path.join("..", "b", "m.onnx"), beside)
    else:                                       # a link to a link
        os.symlink(target, tmp_path / "b" / "hop.onnx")
        os.symlink(tmp_path / "b" / "hop.onnx", beside)
    return beside


# --- 1. a symlinked model whose external data exists beside the link and the target ------------

@pytest.mark.parametrize("how", ["absolute", "relative", "chain"])
def test_verify_of_a_symlinked_model_reads_the_data_onnxruntime_reads(tmp_path, how):
    link = _linked(tmp_path, how)
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    run_cli("optimize", link, "-o", out)
    np.testing.assert_array_equal(_initializers(out)["W"], _initializers(link)["W"])
    proc = run_cli("verify", link, out, "--json", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "PASS"


def test_optimize_verify_through_a_symlink(tmp_path):
    link = _linked(tmp_path)
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    proc = run_cli("optimize", link, "-o", out, "--verify", "--quiet", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr


def test_verify_link_against_a_real_file_of_the_same_folder(tmp_path):
    """a/copy.onnx (a regular file, the same proto) reads a/weights.bin as the link does: the
    two are the same model."""
    link = _linked(tmp_path)
    copy = link.parent / "copy.onnx"
    copy.write_bytes(link.read_bytes())
    proc = run_cli("verify", link, copy, "--json", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    proc = run_cli("verify", copy, link, "--json", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr


# --- 2. concurrent writers of one output -------------------------------------------------------

def _data_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name.endswith(".data")}


def _consistent(out: Path, candidates: list[dict]) -> None:
    """The folder holds the model, exactly the data files it references, no temporary file, and
    the weights it loads are all those of one of the candidates."""
    m = onnx.load(out, load_external_data=False)
    locs = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    assert {p.name for p in out.parent.iterdir()} == {out.name, *locs}
    got = _initializers(out)
    assert any(all(np.array_equal(got[k], v) for k, v in c.items()) for c in candidates), \
        "the model's weights mix several inputs"


def test_a_writer_that_commits_while_another_is_committing(tmp_path, monkeypatch):
    """Writer B runs completely while writer A is between renaming its data and its model. The
    output must still be one complete model with its own data (B waits for A, then wins)."""
    from fusecli.io import model as modelio

    src1, v1 = _linear_model(tmp_path / "v1", seed=0)
    src2, v2 = _linear_model(tmp_path / "v2", seed=7)
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    real_replace = os.replace
    state = {"armed": True}
    errors = []

    def writer_b():
        try:
            modelio.save_model(modelio.load_model(src2), out, src2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def replace(a, b, *args, **kw):
        r = real_replace(a, b, *args, **kw)
        if state["armed"] and Path(b).name.endswith(".data") and ".fusecli-" in str(a):
            state["armed"] = False
            t = threading.Thread(target=writer_b)
            t.start()
            t.join(3.0)                 # B either finishes meanwhile or waits for A
            state["thread"] = t
        return r

    monkeypatch.setattr(modelio.os, "replace", replace)
    modelio.save_model(modelio.load_model(src1), out, src1)
    state["thread"].join(30)
    assert not errors, errors
    _consistent(out, [v2])


def _two_file_model(folder: Path, seed: int) -> tuple[Path, dict]:
    """The linear model with A and W in two data files (all_tensors_to_one_file=False)."""
    path, values = _linear_model(folder, seed=seed)
    m = onnx.load(path)
    for f in folder.iterdir():
        if f.name != path.name:
            f.unlink()
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=False,
                    size_threshold=0)
    return path, values


def test_rewriting_an_output_leaves_no_stale_data_file(tmp_path):
    src2, v2 = _two_file_model(tmp_path / "two", seed=3)
    src1, v1 = _linear_model(tmp_path / "one", seed=4)
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    run_cli("optimize", src2, "-o", out)
    assert _data_files(out.parent) == {"fused.onnx.data", "fused.onnx.2.data"}
    run_cli("optimize", src1, "-o", out)
    _consistent(out, [v1])
    run_cli("optimize", src2, "-o", out)
    _consistent(out, [v2])


def test_concurrent_cli_runs_on_one_output(tmp_path):
    inputs = [_linear_model(tmp_path / f"in{i}", seed=i + 1) for i in range(3)]
    inputs.append(_two_file_model(tmp_path / "in3", seed=11))
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    for _ in range(3):
        procs = [subprocess.Popen([str(FUSECLI), "optimize", str(src), "-o", str(out),
                                   "--quiet"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for src, _ in inputs]
        for p in procs:
            err = p.communicate(timeout=120)[1]
            assert p.returncode == 0, err
        _consistent(out, [v for _, v in inputs])


def test_concurrent_cli_runs_of_one_model_with_external_data(tmp_path):
    """Issue 33: several processes optimizing ONE model whose weights are in an external data
    file to one output leave exactly the model and the data file it names, nothing else, and
    that data holds the model's weights; from an empty folder and over a previous result."""
    src, values = _linear_model(tmp_path / "in", seed=5)
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    for _ in range(2):
        procs = [subprocess.Popen([str(FUSECLI), "optimize", str(src), "-o", str(out),
                                   "--quiet"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
        for p in procs:
            err = p.communicate(timeout=120)[1]
            assert p.returncode == 0, err
        _consistent(out, [values])
        assert _data_files(out.parent) == {"fused.onnx.data"}


# --- 3. output names near the file-system limit ------------------------------------------------

@pytest.mark.parametrize("stem,two_files", [("n" * 245, False), ("n" * 246, False),
                                            ("n" * 250, True), ("\u00e9" * 125, True),
                                            ("x" * 200 + "\u20ac" * 16 + "y" * 2, False)])
def test_long_output_names_get_a_data_file_name_that_fits(tmp_path, stem, two_files):
    name = stem + ".onnx"
    assert len(name.encode()) <= 255
    src, values = (_two_file_model if two_files else _linear_model)(tmp_path / "in", seed=2)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / name
    run_cli("optimize", src, "-o", out)
    got = _initializers(out)
    for k, v in values.items():
        np.testing.assert_array_equal(got[k], v)
    names = [p.name for p in out_dir.iterdir()]
    assert all(len(n.encode()) <= 255 for n in names)
    assert len(names) == (3 if two_files else 2)
    _consistent(out, [values])
    run_cli("optimize", src, "-o", out)               # rewriting it leaves no stray file
    _consistent(out, [values])
    run_cli("verify", src, out)


def test_long_names_sharing_a_prefix_get_distinct_data_files(tmp_path):
    src1, v1 = _linear_model(tmp_path / "a", seed=1)
    src2, v2 = _linear_model(tmp_path / "b", seed=2)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    o1, o2 = out_dir / ("p" * 249 + "1.onnx"), out_dir / ("p" * 249 + "2.onnx")
    run_cli("optimize", src1, "-o", o1)
    run_cli("optimize", src2, "-o", o2)
    assert len(_data_files(out_dir)) == 2
    for o, v in ((o1, v1), (o2, v2)):
        got = _initializers(o)
        for k in v:
            np.testing.assert_array_equal(got[k], v[k])


# --- 4. a misbehaving runtime interpreter ------------------------------------------------------

def _fake_python(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "fakepython"
    p.write_text(body)
    p.chmod(0o755)
    return p


_REAL = sys.executable
FAKES = {
    "garbage": "#!/bin/sh\necho 'garbage, not json'\n",
    "nothing": "#!/bin/sh\nexit 0\n",
    "exits_early": "#!/bin/sh\nexit 1\n",
    "json_no_results": "#!/bin/sh\necho '{\"runtime\": \"onnxruntime 9\"}'\n",
    "json_not_an_object": "#!/bin/sh\necho '[1, 2]'\n",
    "junk_results": (f"#!{_REAL}\nimport sys\na = sys.argv\n"
                     "open(a[a.index('--out') + 1], 'wb').write(b'PK junk')\n"
                     "print('{\"runtime\": \"onnxruntime 9\"}')\n"),
    "killed": "#!/bin/sh\nkill -9 $$\n",
}


@pytest.mark.parametrize("kind", sorted(FAKES))
def test_misbehaving_runtime_python_is_bad_input(tmp_path, kind):
    python = _fake_python(tmp_path, FAKES[kind])
    before = snapshot(tmp_path)
    proc = run_cli("verify", SAMPLE, SAMPLE, "--runtime-python", python, check_rc=None,
                   timeout=60)
    one_line_error(proc, 2, str(python))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["folder", "not_executable", "garbage"])
def test_misbehaving_runtime_python_from_the_environment(tmp_path, kind):
    python = tmp_path / "envpython"
    if kind == "folder":
        python.mkdir()
    else:
        python.write_text(FAKES["garbage"])
        python.chmod(0o644 if kind == "not_executable" else 0o755)
    env = {**os.environ, "FUSECLI_ORTT_PYTHON": str(python)}
    proc = run_cli("verify", SAMPLE, SAMPLE, check_rc=None, env=env, timeout=60)
    one_line_error(proc, 2, str(python))


@pytest.mark.parametrize("kind", ["garbage", "nothing", "exits_early"])
def test_misbehaving_runtime_python_in_bench(tmp_path, kind):
    python = _fake_python(tmp_path, FAKES[kind])
    proc = run_cli("bench", SAMPLE, SAMPLE, "--runs", "1", "--warmup", "0",
                   "--runtime-python", python, check_rc=None, timeout=60)
    one_line_error(proc, 2, str(python))


# --- 5. verify outside the common case ---------------------------------------------------------

@pytest.fixture(scope="module")
def fused_sample(tmp_path_factory):
    d = tmp_path_factory.mktemp("fused")
    out = d / "fused.onnx"
    run_cli("optimize", SAMPLE, "-o", out)
    assert any(n.domain == "com.fusecli" for n in onnx.load(out).graph.node)
    return out


def test_verify_an_original_that_holds_fused_ops(fused_sample):
    proc = run_cli("verify", fused_sample, fused_sample, "--json", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "PASS"


def test_reoptimise_a_fused_model_with_verify(tmp_path, fused_sample):
    proc = run_cli("optimize", fused_sample, "-o", tmp_path / "again.onnx", "--verify",
                   "--quiet", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr


def test_verify_a_partly_fused_original_against_the_fully_fused_one(tmp_path):
    m = builders.compose([builders.frag_ortt_linear_act("f1/", "relu"),
                          builders.frag_ortt_layernorm("ln/")])
    src = tmp_path / "two.onnx"
    src.write_bytes(m.SerializeToString())
    part, full = tmp_path / "part.onnx", tmp_path / "full.onnx"
    d = json.loads(run_cli("optimize", src, "-o", part, "--only", "layernorm", "--json").stdout)
    assert d["total_fused"] == 1
    d = json.loads(run_cli("optimize", part, "-o", full, "--json").stdout)
    assert d["total_fused"] == 1
    proc = run_cli("verify", part, full, "--json", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "PASS"


def _with_empty_branch(m: onnx.ModelProto, shape) -> onnx.ModelProto:
    """Add an input with a static zero dimension that a Relu and a ReduceSum read (onnxruntime
    runs both: the Relu's output is empty, the sum over the empty axis is zeros)."""
    m.graph.input.append(builders.vi("E", shape))
    m.graph.node.extend([helper.make_node("Relu", ["E"], ["E_relu"], name="e_relu"),
                         helper.make_node("ReduceSum", ["E"], ["E_sum"], name="e_sum",
                                          keepdims=0)])
    m.graph.output.extend([builders.vi("E_relu", shape), builders.vi("E_sum", [])])
    return m


@pytest.mark.parametrize("shape", [[0, 4], [3, 0], [0]])
def test_verify_a_graph_with_empty_tensors(tmp_path, shape):
    m = _with_empty_branch(builders.ortt_linear_act("relu"), shape)
    src, out = tmp_path / "empty.onnx", tmp_path / "out.onnx"
    src.write_bytes(m.SerializeToString())
    assert json.loads(run_cli("optimize", src, "-o", out, "--json").stdout)["total_fused"] == 1
    proc = run_cli("verify", src, out, "--json", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "PASS"


def test_verify_a_fusion_whose_tensors_are_empty(tmp_path):
    """One fused chain works on a layer of 0 units (dZ is [M, 0], dW [0, K], db [0]; with dA
    onnxruntime's own Gemm refuses the empty contraction, so the first layer): the rest of the
    graph is judged (here: the non-empty chain)."""
    m = builders.compose([builders.frag_ortt_linear_act("z/", "relu", N=0, first=True),
                          builders.frag_ortt_linear_act("f/", "relu")])
    src, out = tmp_path / "zero.onnx", tmp_path / "out.onnx"
    src.write_bytes(m.SerializeToString())
    assert json.loads(run_cli("optimize", src, "-o", out, "--json").stdout)["total_fused"] == 2
    proc = run_cli("verify", src, out, "--json", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "PASS"


# --- 6. `rules new -o` through a symbolic link -------------------------------------------------

def _rules_new(model, out, *extra):
    return run_cli("rules", "new", "--from", model, "--nodes", "act_grad,wgrad", "--name",
                   "draft", "-o", out, *extra, check_rc=None)


@pytest.fixture
def rulegen_model(tmp_path):
    p = tmp_path / "lin.onnx"
    p.write_bytes(builders.ortt_linear_act("relu").SerializeToString())
    return p


@pytest.mark.parametrize("target", ["absolute", "relative", "existing", "existing_force",
                                    "folder"])
def test_rules_new_output_through_a_symlink_is_refused(tmp_path, rulegen_model, target):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    link = work / "draft.yaml"
    extra = []
    if target == "absolute":
        os.symlink(elsewhere / "x.yaml", link)
    elif target == "relative":
        os.symlink("../elsewhere/x.yaml", link)
    elif target.startswith("existing"):
        (elsewhere / "x.yaml").write_text("keep me\n")
        os.symlink(elsewhere / "x.yaml", link)
        extra = ["--force"] if target == "existing_force" else []
    else:
        os.symlink(elsewhere, link)
        extra = ["--force"]
    before = snapshot(tmp_path)
    proc = _rules_new(rulegen_model, link, *extra)
    one_line_error(proc, 2, "is a directory" if target == "folder" else "symbolic link")
    assert snapshot(tmp_path) == before


def test_rules_new_output_still_written_and_guarded(tmp_path, rulegen_model):
    out = tmp_path / "draft.yaml"
    assert _rules_new(rulegen_model, out).returncode == 0
    text = out.read_text()
    assert "draft" in text
    one_line_error(_rules_new(rulegen_model, out), 2, "exists", "--force")
    assert _rules_new(rulegen_model, out, "--force").returncode == 0
    one_line_error(_rules_new(rulegen_model, tmp_path / "nope" / "d.yaml"), 2, "does not exist")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --- 7. names that are not plain text ----------------------------------------------------------

_NASTY = ["new\nline", "cr\rname", "esc\x1b[31mred\x1b[0m", "nel\x85x", "sep\u2028x",
          "tab\tand/slash", "bell\x07"]


def _renamed(m: onnx.ModelProto, suffix: str) -> onnx.ModelProto:
    """Every tensor and node name of ``m`` with ``suffix`` appended."""
    ren = lambda s: s + suffix if s else s  # noqa: E731
    g = m.graph
    for n in g.node:
        n.name = ren(n.name)
        n.input[:] = [ren(s) for s in n.input]
        n.output[:] = [ren(s) for s in n.output]
    for v in [*g.input, *g.output, *g.value_info, *g.initializer]:
        v.name = ren(v.name)
    return m


def _printable(text: str) -> bool:
    return not any((ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f
                   or c in "\u2028\u2029" for c in text)


@pytest.mark.parametrize("suffix", _NASTY)
def test_control_characters_in_names_cross_the_worker_boundary(tmp_path, suffix):
    plain = tmp_path / "plain.onnx"
    plain.write_bytes(builders.ortt_linear_act("relu").SerializeToString())
    src = tmp_path / "nasty.onnx"
    src.write_bytes(_renamed(builders.ortt_linear_act("relu"), suffix).SerializeToString())
    out, pout = tmp_path / "out.onnx", tmp_path / "pout.onnx"
    run_cli("optimize", src, "-o", out)
    run_cli("optimize", plain, "-o", pout)
    proc = run_cli("verify", src, out, check_rc=None)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert _printable(proc.stdout) and _printable(proc.stderr)
    ref = run_cli("verify", plain, pout)
    assert len(proc.stdout.splitlines()) == len(ref.stdout.splitlines())
    d = json.loads(run_cli("verify", src, out, "--json").stdout)
    assert {o["name"] for o in d["outputs"]} == {o.name for o in onnx.load(src).graph.output}
    for cmd in (["stats", src], ["explain", src]):
        p = run_cli(*cmd)
        assert _printable(p.stdout) and _printable(p.stderr), cmd


@pytest.mark.parametrize("suffix", _NASTY[:3])
def test_control_characters_in_names_of_a_failing_fused_model(tmp_path, suffix):
    """The fused model fails to run: the runtime's message (naming the fused node) comes back as
    one line, exit 1, naming the node with its control characters escaped."""
    src = tmp_path / "nasty.onnx"
    src.write_bytes(_renamed(builders.ortt_linear_act("relu"), suffix).SerializeToString())
    out = tmp_path / "out.onnx"
    run_cli("optimize", src, "-o", out)
    m = onnx.load(out)
    fnode = next(n for n in m.graph.node if n.domain == "com.fusecli")
    fnode.attribute.append(helper.make_attribute("bogus", 1))
    fnode.op_type = "NoSuchFusedOp"
    out.write_bytes(m.SerializeToString())
    proc = run_cli("verify", src, out, check_rc=None)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusecli: error: "), proc.stderr
    assert _printable(proc.stderr)


# --- 8. half precision -------------------------------------------------------------------------

def _half_layernorm(dtype=TensorProto.FLOAT16, B=8, D=16):
    m = builders.compose([builders.frag_ortt_layernorm("ln/", B=B, D=D)])
    _to_float16(m, keep={"ln/mean", "ln/inv_std"})
    if dtype != TensorProto.FLOAT16:
        for v in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
            if v.type.tensor_type.elem_type == TensorProto.FLOAT16:
                v.type.tensor_type.elem_type = dtype
    return m


def _half_relu():
    zero = [numpy_helper.from_array(np.array(0, np.float16), n) for n in ("zero", "zero2")]
    return builders.model([helper.make_node("LessOrEqual", ["X", "zero"], ["mask"], name="le"),
                           helper.make_node("Where", ["mask", "zero2", "dY"], ["dZ"],
                                            name="wh")],
                          [builders.vi("X", [16, 24], TensorProto.FLOAT16),
                           builders.vi("dY", [16, 24], TensorProto.FLOAT16)],
                          [builders.vi("dZ", [16, 24], TensorProto.FLOAT16)], zero, ms=False)


def _layernorm_feeds(m, tmp_path: Path) -> Path:
    """Realistic LayerNorm inputs: X, and the mean / inv_std of X (float32, as exported)."""
    f = _feeds_for(m)
    x = f["ln/X"].astype(np.float32)
    f["ln/mean"] = x.mean(-1, keepdims=True).astype(np.float32)
    f["ln/inv_std"] = (1 / np.sqrt(x.var(-1, keepdims=True) + 1e-5)).astype(np.float32)
    f["ln/gamma"] = np.ones_like(f["ln/gamma"])
    p = tmp_path / "feeds.npz"
    np.savez(p, **f)
    return p


@pytest.mark.parametrize("B,D,given", [(4, 1024, False), (2, 2048, False), (16, 1024, False),
                                       (64, 256, True)])
def test_verify_an_fp16_layernorm_fusion(tmp_path, B, D, given):
    """Wide rows in float16: a one-ulp change of the inputs moves the gradients by more than
    float32's noise limit; judged by float16's, a right fusion passes (generated feeds, or real
    ones)."""
    m = _half_layernorm(B=B, D=D)
    src, out = tmp_path / "half.onnx", tmp_path / "out.onnx"
    src.write_bytes(m.SerializeToString())
    d = json.loads(run_cli("optimize", src, "-o", out, "--json").stdout)
    assert d["patterns"]["layernorm"]["fused"] == 1
    feeds = ["--feeds", _layernorm_feeds(m, tmp_path)] if given else []
    proc = run_cli("verify", src, out, *feeds, "--json", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "PASS"


def test_verify_an_fp16_activation_fusion(tmp_path):
    src, out = tmp_path / "relu16.onnx", tmp_path / "out.onnx"
    src.write_bytes(_half_relu().SerializeToString())
    assert json.loads(run_cli("optimize", src, "-o", out, "--json").stdout)["total_fused"] == 1
    proc = run_cli("verify", src, out, "--json", check_rc=None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "PASS"


@pytest.mark.parametrize("scale,B,D", [(1.02, 4, 1024), (0.97, 2, 2048), (1.02, 8, 16)])
def test_a_wrong_fp16_fusion_still_fails(tmp_path, scale, B, D):
    """A 2-3% error in the fused LayerNormGrad's dX (twenty-odd fp16 ulps) is a FAIL, not
    hidden by the wider half-precision tolerances."""
    m = _half_layernorm(B=B, D=D)
    src, out = tmp_path / "half.onnx", tmp_path / "out.onnx"
    src.write_bytes(m.SerializeToString())
    run_cli("optimize", src, "-o", out)
    f = onnx.load(out)
    fnode = next(n for n in f.graph.node if n.domain == "com.fusecli")
    dx = fnode.output[0]
    fnode.output[0] = dx + "_raw"
    f.graph.initializer.append(numpy_helper.from_array(np.array(scale, np.float16), "k"))
    f.graph.node.append(helper.make_node("Mul", [dx + "_raw", "k"], [dx], name="skew"))
    onnx.save(f, out)
    proc = run_cli("verify", src, out, "--json", check_rc=None)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "FAIL"


def test_tolerances_follow_the_element_type():
    from fusecli.runtime.compare import type_limits

    f32 = type_limits(TensorProto.FLOAT, 1e-5, 1e-6)
    f16 = type_limits(TensorProto.FLOAT16, 1e-5, 1e-6)
    bf16 = type_limits(TensorProto.BFLOAT16, 1e-5, 1e-6)
    assert f32 == (1e-5, 1e-6, 1e-3) == type_limits(np.dtype(np.float32), 1e-5, 1e-6)
    assert type_limits(np.dtype(np.float16), 1e-5, 1e-6) == f16
    # 11 and 8 significant bits: one unit in the last place is 2**-10 and 2**-7
    assert 2.0**-10 < f16[0] < 2.0**-7 < bf16[0] < 0.1
    assert f16[0] < f16[2] < 0.1 and bf16[0] < bf16[2] < 0.5
    assert f16[1] == bf16[1] == 1e-6
    assert type_limits(TensorProto.FLOAT16, 0.05, 1e-6)[0] == 0.05   # a looser --rtol stays
    assert type_limits(TensorProto.INT64, 1e-5, 1e-6) == f32


def test_bfloat16_graphs_fuse_nothing_without_a_bf16_kernel(tmp_path):
    for m in (_half_layernorm(TensorProto.BFLOAT16),
              builders.compose([builders.frag_ortt_linear_act("fc/", "relu")])):
        for v in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
            if v.type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.FLOAT16):
                if v.name not in ("ln/mean", "ln/inv_std"):
                    v.type.tensor_type.elem_type = TensorProto.BFLOAT16
        src = tmp_path / "bf16.onnx"
        src.write_bytes(m.SerializeToString())
        d = json.loads(run_cli("stats", src, "--json").stdout)
        assert d["skips"] and {s["reason"] for s in d["skips"]} == {"unsupported_type"}
        d = json.loads(run_cli("optimize", src, "-o", tmp_path / "o.onnx", "--json").stdout)
        assert d["total_fused"] == 0
