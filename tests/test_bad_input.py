"""Bad inputs through the real `fusecli` console script: the exit code, ONE line on stderr that
says what is wrong (never a traceback), and no input or pre-existing output file modified (every
file of the test folder is hashed before and after; no temporary file is left behind).
Cases marked [sanity] are the graph checks of fusecli/engine/sanity.py. The wider round of hostile
inputs (issue 11) is in test_hostile.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import builders
from conftest import ORTT_PYTHON, REPO, SAMPLES, run_cli

SAMPLE = SAMPLES / "ortt_mlp.onnx"
OLD_OUTPUT = b"previous output - must survive every failed run\n"


# --- helpers -----------------------------------------------------------------------------------

def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    """Every regular file under root -> its hash (FIFOs and sockets by type only)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = "link:" + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(root))] = _sha(p)
        elif not p.is_dir():
            out[str(p.relative_to(root))] = f"special:{stat.S_IFMT(p.lstat().st_mode)}"
    return out


def one_line_error(proc, rc: int, *needles: str) -> str:
    assert proc.returncode == rc, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("fusecli: error: "), line
    for n in needles:
        assert n in line, (n, line)
    return line


@pytest.fixture
def work(tmp_path):
    """A folder with a pre-existing output file."""
    (tmp_path / "out.onnx").write_bytes(OLD_OUTPUT)
    return tmp_path


def expect_failure(work: Path, model, rc: int, *needles: str, extra=(), out=None,
                   timeout=60) -> str:
    before = snapshot(work)
    proc = run_cli("optimize", model, "-o", out or work / "out.onnx", *extra, check_rc=None,
                   timeout=timeout)
    line = one_line_error(proc, rc, *needles)
    assert snapshot(work) == before          # nothing modified, nothing left behind
    return line


def save(m: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(m.SerializeToString())
    return path


def relu_model(opset=17):
    """A valid inference-only model: no gradient nodes."""
    return builders.model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                          [builders.vi("x", [2, 3])], [builders.vi("y", [2, 3])], opset=opset,
                          ms=False)


def linear_with_weights(tmp: Path, name="m.onnx", location="data/weights.bin"):
    """ortt_linear_act (relu) with A and W as initializers stored as external data (both over
    modelio.INLINE_LIMIT, so they stay external; the small axes constant is read in)."""
    M, N, K = 64, 32, 48
    m = builders.ortt_linear_act("relu", M=M, N=N, K=K)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    keep = [i for i in m.graph.input if i.name not in ("A", "W")]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.initializer.extend([numpy_helper.from_array(a, "A"), numpy_helper.from_array(w, "W")])
    path = tmp / name
    (tmp / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return path, {"A": a, "W": w}


def point_external(model_path: Path, location: str) -> None:
    """Rewrite every external-data location of a saved model (the proto only)."""
    m = onnx.load(model_path, load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    model_path.write_bytes(m.SerializeToString())


# --- files that are not models ------------------------------------------------------------------

def test_missing_file(work):
    expect_failure(work, work / "nope.onnx", 2, "no such file", "nope.onnx")


def test_directory(work):
    (work / "adir").mkdir()
    expect_failure(work, work / "adir", 2, "is a directory")


def test_empty_file(work):
    expect_failure(work, save_bytes(work / "empty.onnx", b""), 2, "empty")


def save_bytes(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def test_random_bytes(work):
    data = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    expect_failure(work, save_bytes(work / "rnd.onnx", data), 2, "not a valid ONNX model")


def test_truncated_model(work):
    data = SAMPLE.read_bytes()
    expect_failure(work, save_bytes(work / "half.onnx", data[: len(data) // 2]), 2,
                   "not a valid ONNX model", "half.onnx")


def test_fifo_is_not_read(work):
    fifo = work / "pipe.onnx"
    os.mkfifo(fifo)
    expect_failure(work, fifo, 2, "not a regular file", timeout=20)


# --- valid models that are not what fusecli expects -------------------------------------------

def test_no_gradient_nodes_is_not_an_error(work):
    src = save(relu_model(), work / "relu.onnx")
    h = _sha(src)
    proc = run_cli("optimize", src, "-o", work / "out.onnx", "--json")
    assert json.loads(proc.stdout)["total_fused"] == 0
    assert "no gradient nodes" in proc.stderr and "Traceback" not in proc.stderr
    assert _sha(src) == h
    onnx.checker.check_model(onnx.load(work / "out.onnx"))


@pytest.mark.parametrize("cmd", ["optimize", "stats"])
def test_future_opset_refused(work, cmd):  # [sanity]
    src = save(relu_model(opset=99), work / "future.onnx")
    if cmd == "optimize":
        expect_failure(work, src, 2, "opset 99", "upgrade onnx")
    else:
        before = snapshot(work)
        one_line_error(run_cli("stats", src, check_rc=None), 2, "opset 99")
        assert snapshot(work) == before


def test_invalid_opset_zero_refused(work):  # [sanity]
    m = relu_model()
    m.opset_import[0].version = 0
    expect_failure(work, save(m, work / "zero.onnx"), 2, "opset 0")


# --- external data ------------------------------------------------------------------------------

def test_external_data_missing(work):
    src, _ = linear_with_weights(work)
    (work / "data" / "weights.bin").unlink()
    expect_failure(work, src, 2, "data/weights.bin", "missing")


def test_external_data_truncated(work):
    src, _ = linear_with_weights(work)
    data = work / "data" / "weights.bin"
    data.write_bytes(data.read_bytes()[:10])
    expect_failure(work, src, 2, "past the end", "weights.bin")


def test_external_data_written_beside_output(tmp_path):
    src_dir = tmp_path / "in"
    src_dir.mkdir()
    src, values = linear_with_weights(src_dir)
    in_before = snapshot(src_dir)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = run_cli("optimize", src, "-o", out_dir / "fused.onnx", "--json")
    assert json.loads(proc.stdout)["total_fused"] == 1
    assert snapshot(src_dir) == in_before
    # the data file is named after the output (owned by it), a real file (not a link to the
    # input's), and nothing else is written
    data = out_dir / "fused.onnx.data"
    assert data.is_file() and not data.is_symlink()
    assert os.stat(data).st_ino != os.stat(src_dir / "data" / "weights.bin").st_ino
    assert sorted(p.name for p in out_dir.rglob("*")) == ["fused.onnx", "fused.onnx.data"]
    proto = onnx.load(out_dir / "fused.onnx", load_external_data=False)
    locs = {e.value for t in proto.graph.initializer for e in t.external_data
            if e.key == "location"}
    assert locs == {"fused.onnx.data"}
    fused = onnx.load(out_dir / "fused.onnx")     # loads the external data from beside it
    onnx.checker.check_model(fused)
    got = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer}
    for k, v in values.items():
        np.testing.assert_array_equal(got[k], v)
    assert oct(os.stat(out_dir / "fused.onnx").st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_external_data_same_folder_reuses_the_file(tmp_path):
    src, values = linear_with_weights(tmp_path)
    data = tmp_path / "data" / "weights.bin"
    h, ino = _sha(data), os.stat(data).st_ino
    run_cli("optimize", src, "-o", tmp_path / "fused.onnx")
    assert _sha(data) == h and os.stat(data).st_ino == ino
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "fused.onnx").graph.initializer}
    np.testing.assert_array_equal(got["W"], values["W"])


def test_output_named_like_the_external_data_file_is_refused(tmp_path):
    src, _ = linear_with_weights(tmp_path, location="weights.bin")
    before = snapshot(tmp_path)
    proc = run_cli("optimize", src, "-o", tmp_path / "weights.bin", check_rc=None)
    one_line_error(proc, 2, "external data file", "weights.bin")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_external_data_outside_the_model_folder_refused(tmp_path, how):
    model_dir = tmp_path / "models"
    model_dir.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    src, _ = linear_with_weights(model_dir, location="weights.bin")
    secret = outside / "secret.bin"
    shutil.copyfile(model_dir / "weights.bin", secret)
    # a FIFO beside it: opening it for reading would block, so a run that returns proves it
    # was never opened
    os.mkfifo(outside / "pipe.bin")
    if how == "absolute":
        point_external(src, str(outside / "pipe.bin"))
        needle = "points outside"
    elif how == "dotdot":
        point_external(src, "../outside/pipe.bin")
        needle = "points outside"
    else:
        os.symlink(outside / "pipe.bin", model_dir / "link.bin")
        point_external(src, "link.bin")
        needle = "resolves outside"
    (model_dir / "out.onnx").write_bytes(OLD_OUTPUT)
    before = snapshot(tmp_path)
    st_before = os.stat(secret)
    proc = run_cli("optimize", src, "-o", model_dir / "out.onnx", check_rc=None, timeout=30)
    one_line_error(proc, 2, needle)
    assert snapshot(tmp_path) == before
    st_after = os.stat(secret)
    assert (st_after.st_mtime_ns, st_after.st_size) == (st_before.st_mtime_ns, st_before.st_size)
    # nor written: an output elsewhere never gets a '../' file either
    proc = run_cli("optimize", src, "-o", tmp_path / "o2.onnx", check_rc=None, timeout=30)
    one_line_error(proc, 2, needle)
    assert snapshot(tmp_path) == before


def test_external_data_outside_in_a_subgraph_refused(work):
    """Tensor attributes inside subgraphs and sparse initializers are checked too."""
    m = relu_model()
    t = numpy_helper.from_array(np.zeros(4, np.float32), "c")
    t.data_location = TensorProto.EXTERNAL
    t.ClearField("raw_data")
    t.external_data.add(key="location", value="/etc/hostname")
    then_g = helper.make_graph([helper.make_node("Constant", [], ["c"], value=t)], "then", [],
                               [builders.vi("c", [4])])
    else_g = helper.make_graph([helper.make_node("Constant", [], ["e"], value_floats=[0.0] * 4)],
                               "else", [], [builders.vi("e", [4])])
    m.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=then_g,
                                         else_branch=else_g))
    m.graph.input.append(builders.vi("cond", [], TensorProto.BOOL))
    m.graph.output.append(builders.vi("z", [4]))
    expect_failure(work, save(m, work / "sub.onnx"), 2, "points outside")


# --- graphs that are not sound ------------------------------------------------------------------

def _chain_with(nodes_after=(), extra_inputs=(), extra_outputs=()):
    m = builders.ortt_linear_act("relu")
    m.graph.node.extend(nodes_after)
    m.graph.input.extend(extra_inputs)
    m.graph.output.extend(extra_outputs)
    return m


def test_cycle_refused(work):  # [sanity]
    m = builders.ortt_linear_act("relu")
    # X (an input of the chain) now comes from the chain's own output: a cycle
    keep = [i for i in m.graph.input if i.name != "X"]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.node.append(helper.make_node("Neg", ["dW"], ["X"], name="loop_back"))
    expect_failure(work, save(m, work / "cycle.onnx"), 2, "cycle", "loop_back")


def test_unsorted_graph_refused(work):  # [sanity]
    m = builders.ortt_linear_act("relu")
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(reversed(nodes))
    expect_failure(work, save(m, work / "unsorted.onnx"), 2, "topological order")


def test_dangling_input_refused(work):  # [sanity]
    m = _chain_with([helper.make_node("Add", ["dW", "ghost"], ["dW2"], name="uses_ghost")],
                    extra_outputs=[builders.vi("dW2", [5, 4])])
    expect_failure(work, save(m, work / "dangling.onnx"), 2, "ghost", "dangling")


def test_duplicate_tensor_producer_refused(work):  # [sanity]
    m = _chain_with([helper.make_node("Neg", ["dY"], ["dZ"], name="second_producer")])
    expect_failure(work, save(m, work / "dup.onnx"), 2, "produced twice", "'dZ'")


def test_duplicate_node_names_warn_only(work):  # [sanity]: the warning needs the wiring
    m = _chain_with([helper.make_node("Neg", ["dW"], ["dW_neg"], name="wgrad")],
                    extra_outputs=[builders.vi("dW_neg", [5, 4])])
    src = save(m, work / "dupname.onnx")
    proc = run_cli("optimize", src, "-o", work / "out.onnx", "--json")
    assert json.loads(proc.stdout)["total_fused"] == 1
    assert "Traceback" not in proc.stderr
    assert "duplicate node names ['wgrad']" in proc.stderr
    onnx.checker.check_model(onnx.load(work / "out.onnx"))


# --- subgraphs ----------------------------------------------------------------------------------

def _if_node(then_nodes, then_outputs, name="branch"):
    then_g = helper.make_graph(then_nodes, "then", [], then_outputs)
    out = then_outputs[0]
    else_g = helper.make_graph(
        [helper.make_node("Identity", [then_nodes[0].input[0]], [out.name + "_e"])], "else", [],
        [helper.make_tensor_value_info(out.name + "_e", out.type.tensor_type.elem_type, None)])
    return helper.make_node("If", ["cond"], [f"{name}_out"], name=name, then_branch=then_g,
                            else_branch=else_g)


def _run_ortt(model_path: Path, feeds: dict) -> None:
    """Run the model in onnxruntime-training with fusecli's custom-op library."""
    if not ORTT_PYTHON.exists():
        pytest.skip("the onnxruntime-training environment is missing (make ortt-env)")
    lib = REPO / "fusecli" / "lib" / "libfusecli_ops.so"
    if not lib.exists():
        pytest.skip("the custom-op library is not built (make lib)")
    np.savez(model_path.with_suffix(".feeds.npz"), **feeds)
    code = textwrap.dedent(f"""
        import numpy as np, onnxruntime as ort
        so = ort.SessionOptions(); so.register_custom_ops_library({str(lib)!r})
        s = ort.InferenceSession({str(model_path)!r}, so, providers=["CPUExecutionProvider"])
        f = dict(np.load({str(model_path.with_suffix(".feeds.npz"))!r}))
        outs = s.run(None, f)
        assert all(np.isfinite(o).all() for o in outs if o.dtype.kind == "f")
        print("ran", len(outs))
    """)
    proc = subprocess.run([str(ORTT_PYTHON), "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _feeds(m):
    rng = np.random.default_rng(0)
    out = {}
    for i in m.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.BOOL:
            out[i.name] = np.array(True)
        else:
            out[i.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def test_subgraph_holding_a_fusible_chain_is_left_intact(tmp_path):
    inner = builders.ortt_linear_act("relu")     # the whole chain inside the then-branch
    for n in inner.graph.node:
        n.name = "in_" + n.name if n.name else ""
    ren = {t: "in_" + t for t in ("dZ", "db_raw", "db", "dW", "dA")}
    for n in inner.graph.node:
        n.input[:] = [ren.get(x, x) for x in n.input]
        n.output[:] = [ren.get(x, x) for x in n.output]
    inner_nodes = list(inner.graph.node)
    iff = _if_node(inner_nodes, [helper.make_tensor_value_info("in_dW", TensorProto.FLOAT, None)])
    iff.output[0] = "branch_out"
    next(a.g for a in iff.attribute if a.name == "else_branch").node[0].input[0] = "dW"
    m = _chain_with([iff], extra_inputs=[builders.vi("cond", [], TensorProto.BOOL)])
    m.graph.output.append(builders.vi("branch_out", [5, 4]))
    onnx.checker.check_model(m)
    src = save(m, tmp_path / "sub.onnx")
    proc = run_cli("optimize", src, "-o", tmp_path / "out.onnx", "--json")
    assert json.loads(proc.stdout)["total_fused"] == 1            # the top-level chain only
    out = onnx.load(tmp_path / "out.onnx")
    onnx.checker.check_model(out, full_check=False)
    if_node = next(n for n in out.graph.node if n.op_type == "If")
    then_g = next(a.g for a in if_node.attribute if a.name == "then_branch")
    assert [n.op_type for n in then_g.node] == [n.op_type for n in inner_nodes]
    ops = [n.op_type for n in out.graph.node]
    assert ops.index("LinearActivationGrad") < ops.index("If")   # If reads dW: stays after
    _run_ortt(tmp_path / "out.onnx", _feeds(m))


def test_subgraph_reading_an_intermediate_blocks_the_fusion(tmp_path):
    iff = _if_node([helper.make_node("Neg", ["dZ"], ["neg_dz"])],
                   [helper.make_tensor_value_info("neg_dz", TensorProto.FLOAT, None)])
    m = _chain_with([iff], extra_inputs=[builders.vi("cond", [], TensorProto.BOOL)],
                    extra_outputs=[builders.vi("branch_out", [6, 5])])
    onnx.checker.check_model(m)
    src = save(m, tmp_path / "sub.onnx")
    d = json.loads(run_cli("stats", src, "--json").stdout)
    assert d["total_fused"] == 0
    assert {s["reason"] for s in d["skips"]} == {"intermediate_consumed_outside"}
    proc = run_cli("optimize", src, "-o", tmp_path / "out.onnx", "--json")
    assert json.loads(proc.stdout)["total_fused"] == 0
    out = onnx.load(tmp_path / "out.onnx")
    onnx.checker.check_model(out)
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in m.graph.node]
    _run_ortt(tmp_path / "out.onnx", _feeds(m))


# --- output path ----------------------------------------------------------------------------------

def test_output_equal_to_input_refused(tmp_path):
    src = tmp_path / "m.onnx"
    shutil.copyfile(SAMPLE, src)
    before = snapshot(tmp_path)
    one_line_error(run_cli("optimize", src, "-o", src, check_rc=None), 2, "is the input file",
                   "--in-place")
    # also through another spelling of the same path
    one_line_error(run_cli("optimize", src, "-o", tmp_path / "." / "m.onnx", check_rc=None), 2,
                   "is the input file")
    assert snapshot(tmp_path) == before


def test_in_place_is_atomic(tmp_path):
    src = tmp_path / "m.onnx"
    shutil.copyfile(SAMPLE, src)
    ino = os.stat(src).st_ino
    proc = run_cli("optimize", src, "-o", src, "--in-place", "--json")
    assert json.loads(proc.stdout)["total_fused"] > 0
    assert os.stat(src).st_ino != ino          # replaced by rename, never rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]   # no temp file left
    m = onnx.load(src)
    assert any(n.domain == "com.fusecli" for n in m.graph.node)


def test_output_under_a_regular_file(work):
    (work / "afile").write_text("not a folder")
    expect_failure(work, SAMPLE, 2, "is a file, not a folder", out=work / "afile" / "out.onnx")
    expect_failure(work, SAMPLE, 2, "is a file, not a folder",
                   out=work / "afile" / "deeper" / "out.onnx")


def test_output_folder_missing(work):
    expect_failure(work, SAMPLE, 2, "does not exist", out=work / "nodir" / "out.onnx")


def test_output_is_a_directory(work):
    (work / "d").mkdir()
    expect_failure(work, SAMPLE, 2, "is a directory", out=work / "d")


def test_output_on_a_filesystem_that_refuses_writes(work):
    """/proc accepts no new files even from root: the write itself fails (not the pre-check)."""
    if not Path("/proc/self").exists():
        pytest.skip("no /proc")
    expect_failure(work, SAMPLE, 2, "cannot write", out=Path("/proc/fusecli-test-out.onnx"))
    assert not Path("/proc/fusecli-test-out.onnx").exists()


# --- rule files -----------------------------------------------------------------------------------

GOOD_RULE = (REPO / "rules" / "act_relu_grad_torch.yaml").read_text()


def _rule_case(work, text, *needles):
    rule = work / "rule.yaml"
    rule.write_text(text)
    before = snapshot(work)
    proc = run_cli("optimize", SAMPLE, "-o", work / "out.onnx", "--rules", rule, check_rc=None)
    line = one_line_error(proc, 2, str(rule), *needles)
    assert snapshot(work) == before
    return line


def test_rule_empty(work):
    _rule_case(work, "", "empty rule file")


def test_rule_not_yaml(work):
    _rule_case(work, "name: [unclosed\n  pattern: {\n", "not valid YAML")


def test_rule_python_tag_is_refused_and_never_runs(work):
    marker = work / "pwned"
    text = f"!!python/object/apply:os.system ['touch {marker}']\n"
    _rule_case(work, text, "not allowed in a rule file")
    text = GOOD_RULE.replace("order: 10", f"order: !!python/object/apply:os.system ['touch {marker}']")
    _rule_case(work, text, "not allowed in a rule file")
    assert not marker.exists()


def test_rule_wrong_schema(work):
    _rule_case(work, "- just\n- a list\n", "must be a YAML mapping")
    _rule_case(work, GOOD_RULE.replace("order: 10", "order: high"), "order must be an integer")
    _rule_case(work, GOOD_RULE.replace("nodes:", "nodez:"), "unknown key")


def test_rule_unknown_fused_op(work):
    _rule_case(work, GOOD_RULE.replace("op: ActivationGrad", "op: NoSuchFusedOp"),
               "NoSuchFusedOp", "is not a fused op")


def test_rule_unknown_capture(work):
    text = GOOD_RULE.replace("attrs: {activation: relu}",
                             "attrs: {activation: {attr: nope}}")
    _rule_case(work, text, "no attribute captured as 'nope'")


def test_rule_unknown_pattern_variable(work):
    text = GOOD_RULE.replace("inputs: [dY, X]\n  outputs", "inputs: [dY, Q]\n  outputs")
    _rule_case(work, text, "'Q'")


def test_rule_folder_without_rules(work):
    (work / "empty_rules").mkdir()
    before = snapshot(work)
    proc = run_cli("optimize", SAMPLE, "-o", work / "out.onnx", "--rules", work / "empty_rules",
                   check_rc=None)
    # no rules at all: either refused in one line, or a run that fuses nothing
    if proc.returncode != 0:
        one_line_error(proc, 2)
        assert snapshot(work) == before


def test_rule_that_would_create_a_cycle_is_skipped(tmp_path):
    """A is derived from dA: the fused op would need to run both before Neg (to produce dA) and
    after it (to read A)."""
    m = builders.ortt_linear_act("relu")
    keep = [i for i in m.graph.input if i.name != "A"]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    nodes = list(m.graph.node)
    wgrad = next(n for n in nodes if n.name == "wgrad")
    dgrad = next(n for n in nodes if n.name == "dgrad")
    order = [n for n in nodes if n is not wgrad]
    order.insert(order.index(dgrad) + 1, helper.make_node("Neg", ["dA"], ["A"], name="outside"))
    order.append(wgrad)
    del m.graph.node[:]
    m.graph.node.extend(order)
    onnx.checker.check_model(m)
    src = save(m, tmp_path / "cyc.onnx")
    rule = REPO / "rules" / "linear_act_ortt_gemm.yaml"
    d = json.loads(run_cli("stats", src, "--rules", rule, "--json").stdout)
    assert d["total_fused"] == 0
    assert [s["reason"] for s in d["skips"]] == ["would_create_cycle"]
    out = tmp_path / "out.onnx"
    proc = run_cli("optimize", src, "-o", out, "--rules", rule, "--json")
    assert json.loads(proc.stdout)["patterns"]["linear_relu"]["skipped"] == {
        "would_create_cycle": 1}
    fused = onnx.load(out)
    onnx.checker.check_model(fused)
    assert [n.name for n in fused.graph.node] == [n.name for n in m.graph.node]


# --- no library is ever loaded from a model or rule file -------------------------------------------

@pytest.fixture
def evil_so(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    marker = tmp_path / "LOADED"
    c = tmp_path / "evil.c"
    c.write_text(textwrap.dedent(f"""
        #include <stdio.h>
        __attribute__((constructor)) static void hit(void) {{
            FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("loaded", f); fclose(f); }}
        }}
        int RegisterCustomOps(void *a, void *b) {{ hit(); return 0; }}
    """))
    so = tmp_path / "libevil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(c)], check=True)
    return so, marker


def test_model_metadata_library_is_never_loaded(tmp_path, evil_so):
    so, marker = evil_so
    m = builders.ortt_linear_act("relu")
    for key in ("custom_op_library", "library", "onnxruntime.custom_ops_library"):
        m.metadata_props.add(key=key, value=str(so))
    m.graph.node[0].doc_string = str(so)
    src = save(m, tmp_path / "m.onnx")
    run_cli("optimize", src, "-o", tmp_path / "out.onnx")
    run_cli("stats", src)
    assert not marker.exists()


def test_rule_library_key_is_rejected(tmp_path, evil_so):
    so, marker = evil_so
    rule = tmp_path / "rule.yaml"
    rule.write_text(GOOD_RULE + f"library: {so}\n")
    for cmd in (["optimize", SAMPLE, "-o", tmp_path / "out.onnx", "--rules", rule],
                ["rules", "validate", rule]):
        proc = run_cli(*cmd, check_rc=None)
        one_line_error(proc, 2, "unknown key(s) ['library']")
    assert not marker.exists() and not (tmp_path / "out.onnx").exists()


# --- interrupted writes (in-process, through fusecli.io.model) -------------------------------------

def _fused_model():
    from fusecli import FusionPass
    from fusecli.io.model import load_model

    m = load_model(SAMPLE)
    FusionPass().run(m)
    return m


def test_failed_rename_keeps_old_output(work, monkeypatch):
    from fusecli import ModelError
    from fusecli.io import model as modelio

    m = _fused_model()
    before = snapshot(work)

    def boom(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(modelio.os, "replace", boom)
    with pytest.raises(ModelError, match="cannot write .*out.onnx: Input/output error"):
        modelio.save_model(m, work / "out.onnx", SAMPLE)
    assert snapshot(work) == before


def test_interrupt_mid_write_keeps_old_output(work, monkeypatch):
    from fusecli.io import model as modelio

    m = _fused_model()
    before = snapshot(work)

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(modelio.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        modelio.save_model(m, work / "out.onnx", SAMPLE)
    assert snapshot(work) == before


def test_disk_full_during_external_data_copy(tmp_path, monkeypatch):
    from fusecli import ModelError
    from fusecli.io import model as modelio

    src_dir = tmp_path / "in"
    src_dir.mkdir()
    src, _ = linear_with_weights(src_dir)
    out_dir = tmp_path / "out"
    (out_dir / "data").mkdir(parents=True)
    (out_dir / "data" / "weights.bin").write_bytes(b"another model's weights")
    (out_dir / "fused.onnx.data").write_bytes(b"old weights")
    (out_dir / "fused.onnx").write_bytes(OLD_OUTPUT)
    before = snapshot(tmp_path)
    m = modelio.load_model(src)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(modelio, "_copy_range", full)
    monkeypatch.setattr(modelio, "_try_reflink", lambda *a: False)
    with pytest.raises(ModelError, match="fused.onnx.data: No space left on device"):
        modelio.save_model(m, out_dir / "fused.onnx", src)
    assert snapshot(tmp_path) == before


def test_killed_mid_write_keeps_old_output(work):
    """SIGKILL cannot be cleaned up after: the old output must still be intact (a stray
    .fusecli-*.tmp may remain; it is never mistaken for the output)."""
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from fusecli import FusionPass
        from fusecli.io import model as modelio
        m = modelio.load_model({str(SAMPLE)!r}); FusionPass().run(m)
        def hang(fd):
            print("writing", flush=True); time.sleep(60)
        modelio.os.fsync = hang
        modelio.save_model(m, {str(work / 'out.onnx')!r}, {str(SAMPLE)!r})
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    assert (work / "out.onnx").read_bytes() == OLD_OUTPUT
    stray = [q.name for q in work.iterdir() if q.name != "out.onnx"]
    assert all(q.startswith(".fusecli-") and q.endswith(".tmp") for q in stray), stray


def test_sanity_is_fast_on_40k_nodes():
    from fusecli.engine.sanity import check_graph

    n = 40_000
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"n{i}") for i in range(n)]
    m = builders.model(nodes, [builders.vi("t0", [1])], [builders.vi(f"t{n}", [1])], ms=False)
    t0 = time.perf_counter()
    assert check_graph(m) == []
    assert time.perf_counter() - t0 < 3.0
    nodes.reverse()
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    t0 = time.perf_counter()
    from fusecli import ModelError

    with pytest.raises(ModelError, match="topological"):
        check_graph(m)
    assert time.perf_counter() - t0 < 3.0
