"""Hostile and unlucky inputs (issue 11), through the real `fusecli` console script: the exit
code, the one line on stderr, and that nothing on disk changed except the output on success.

Classes: transactional output, confinement (symlinks, permissions), type safety and name
clashes, bounded work (hostile files and option values), exit codes and signals, rule
attribute types.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import builders
from conftest import FUSECLI, ORTT_PYTHON, REPO, SAMPLES, run_cli
from fusecli import api
from test_bad_input import (GOOD_RULE, OLD_OUTPUT, _run_ortt, linear_with_weights,
                            one_line_error, snapshot)

SAMPLE = SAMPLES / "ortt_mlp.onnx"
LINEAR_RULE = (REPO / "rules" / "linear_act_ortt_gemm.yaml").read_text()


def _initializers(path: Path) -> dict[str, np.ndarray]:
    """The initializers as onnx reads them (external data from beside the path given)."""
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


def _linear_model(folder: Path, seed: int, name="m.onnx", location="weights.bin"):
    folder.mkdir(parents=True, exist_ok=True)
    path, values = linear_with_weights(folder, name=name, location=location)
    if seed:                                    # other values, same layout
        rng = np.random.default_rng(seed)
        new = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in values.items()}
        m = onnx.load(path)
        for t in m.graph.initializer:
            if t.name in new:
                t.CopyFrom(numpy_helper.from_array(new[t.name], t.name))
        onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=location, size_threshold=0)
        values = new
    return path, values


# --- transactional output ----------------------------------------------------------------------

def test_failed_model_write_keeps_previous_model_and_data(tmp_path, monkeypatch):
    """The new model fails to land after its data was complete: the previous output (model AND
    its data) is byte-identical and no temporary file remains."""
    from fusecli import ModelError
    from fusecli.io import model as modelio

    src1, _ = _linear_model(tmp_path / "v1", seed=0)
    src2, _ = _linear_model(tmp_path / "v2", seed=7)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "fused.onnx"
    modelio.save_model(modelio.load_model(src1), out, src1)
    before = snapshot(tmp_path)
    real_replace = os.replace

    def fail_on_model(a, b, *args, **kw):
        if Path(b) == out:
            raise OSError(5, "Input/output error")
        return real_replace(a, b, *args, **kw)

    monkeypatch.setattr(modelio.os, "replace", fail_on_model)
    with pytest.raises(ModelError, match="fused.onnx: Input/output error.*left unchanged"):
        modelio.save_model(modelio.load_model(src2), out, src2)
    assert snapshot(tmp_path) == before


def test_another_models_data_file_is_never_replaced(tmp_path):
    src, values = _linear_model(tmp_path / "in", seed=0)
    out_dir = tmp_path / "shared"
    other, other_values = _linear_model(out_dir, seed=3, name="other.onnx")
    assert (out_dir / "weights.bin").exists()
    before = snapshot(out_dir)
    proc = run_cli("optimize", src, "-o", out_dir / "fused.onnx", "--json")
    assert json.loads(proc.stdout)["total_fused"] == 1
    after = snapshot(out_dir)
    assert {k: v for k, v in after.items() if k in before} == before
    assert sorted(set(after) - set(before)) == ["fused.onnx", "fused.onnx.data"]
    got = _initializers(other)
    for k, v in other_values.items():
        np.testing.assert_array_equal(got[k], v)
    got = _initializers(out_dir / "fused.onnx")
    for k, v in values.items():
        np.testing.assert_array_equal(got[k], v)


# --- confinement --------------------------------------------------------------------------------

def test_symlinked_model_reads_data_beside_the_link(tmp_path):
    """onnx and onnxruntime read a symlinked model's data beside the link: so does fusecli."""
    beside, _ = _linear_model(tmp_path / "a", seed=1)   # same layout, other values
    target, _ = _linear_model(tmp_path / "b", seed=5)
    beside.unlink()
    os.symlink(target, beside)                  # a/m.onnx -> b/m.onnx; a/weights.bin stays
    expected = _initializers(beside)            # what onnx itself reads
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run_cli("optimize", beside, "-o", out_dir / "fused.onnx")
    got = _initializers(out_dir / "fused.onnx")
    for k in ("A", "W"):
        np.testing.assert_array_equal(got[k], expected[k])


def test_dangling_symlink_output_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(elsewhere / "x.onnx", work / "out.onnx")
    before = snapshot(tmp_path)
    proc = run_cli("optimize", SAMPLE, "-o", work / "out.onnx", check_rc=None)
    one_line_error(proc, 2, "symbolic link")
    assert snapshot(tmp_path) == before


def test_symlinked_subfolder_of_the_output_folder_is_not_written_through(tmp_path):
    src, _ = _linear_model(tmp_path / "in", seed=0, location="data/weights.bin")
    outside = tmp_path / "outside"
    outside.mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    os.symlink(outside, out_dir / "data")
    run_cli("optimize", src, "-o", out_dir / "fused.onnx")
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in out_dir.iterdir()) == ["data", "fused.onnx", "fused.onnx.data"]


def test_outputs_keep_the_inputs_permissions(tmp_path):
    src, _ = _linear_model(tmp_path / "in", seed=0)
    os.chmod(src, 0o600)
    os.chmod(src.parent / "weights.bin", 0o600)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run_cli("optimize", src, "-o", out_dir / "fused.onnx")
    for name in ("fused.onnx", "fused.onnx.data"):
        assert oct(os.stat(out_dir / name).st_mode & 0o777) == oct(0o600), name


# --- type safety and names -----------------------------------------------------------------------

def _to_float16(m: onnx.ModelProto, keep=()) -> onnx.ModelProto:
    for v in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT and v.name not in keep:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    return m


def _feeds_for(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i in m.graph.input:
        tt = i.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        out[i.name] = rng.standard_normal([d.dim_value for d in tt.shape.dim]).astype(dtype)
    return out


def test_float16_fuses_only_where_a_kernel_exists(tmp_path):
    """LayerNormGrad has a float16 kernel: fused. LinearActivationGrad is float32 only: left
    unfused with reason unsupported_type, shown by stats and explain. The result runs."""
    m = builders.compose([builders.frag_ortt_layernorm("ln/"),
                          builders.frag_ortt_linear_act("fc/", "relu")])
    _to_float16(m, keep={"ln/mean", "ln/inv_std"})    # statistics stay float32, as exported
    src = tmp_path / "half.onnx"
    src.write_bytes(m.SerializeToString())
    out = tmp_path / "out.onnx"
    d = json.loads(run_cli("optimize", src, "-o", out, "--json").stdout)
    assert d["patterns"]["layernorm"]["fused"] == 1
    assert d["patterns"]["linear_relu"] == {"detected": 1, "fused": 0,
                                            "skipped": {"unsupported_type": 1}}
    skips = json.loads(run_cli("stats", src, "--json").stdout)["skips"]
    assert [(s["reason"], s["anchor"]) for s in skips] == [("unsupported_type", "fc/act_grad")]
    text = run_cli("explain", src, "--rule", "linear_relu_ortt_gemm").stdout
    assert "[unsupported_type]" in text and "float16" in text and "float32" in text
    fused = onnx.load(out)
    assert sorted(n.op_type for n in fused.graph.node if n.domain == "com.fusecli") == [
        "LayerNormGrad"]
    _run_half_ortt(out, _feeds_for(m))
    # a torch-joint ReLU gradient in float16 becomes a float16 ActivationGrad
    zero = [numpy_helper.from_array(np.array(0, np.float16), n) for n in ("zero", "zero2")]
    m = builders.model([helper.make_node("LessOrEqual", ["X", "zero"], ["mask"], name="le"),
                        helper.make_node("Where", ["mask", "zero2", "dY"], ["dZ"], name="wh")],
                       [builders.vi("X", [4, 6], TensorProto.FLOAT16),
                        builders.vi("dY", [4, 6], TensorProto.FLOAT16)],
                       [builders.vi("dZ", [4, 6], TensorProto.FLOAT16)], zero, ms=False)
    src.write_bytes(m.SerializeToString())
    d = json.loads(run_cli("optimize", src, "-o", out, "--json").stdout)
    assert d["patterns"]["activation_grad"]["fused"] == 1
    assert [n.op_type for n in onnx.load(out).graph.node] == ["ActivationGrad"]
    _run_half_ortt(out, _feeds_for(m))


def _run_half_ortt(model_path: Path, feeds) -> None:
    if not ORTT_PYTHON.exists():
        pytest.fail("the onnxruntime-training environment is missing: run `make ortt-env`")
    np.savez(model_path.with_suffix(".feeds.npz"), **feeds)
    lib = REPO / "fusecli" / "lib" / "libfusecli_ops.so"
    code = (f"import numpy as np, onnxruntime as ort\n"
            f"so = ort.SessionOptions(); so.register_custom_ops_library({str(lib)!r})\n"
            f"s = ort.InferenceSession({str(model_path)!r}, so, "
            f"providers=['CPUExecutionProvider'])\n"
            f"f = dict(np.load({str(model_path.with_suffix('.feeds.npz'))!r}))\n"
            f"outs = s.run(None, f)\n"
            f"assert all(np.isfinite(o).all() for o in outs)\n")
    proc = subprocess.run([str(ORTT_PYTHON), "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_generated_names_avoid_value_info_and_subgraph_names(tmp_path):
    """The fused node's workspace output must not reuse a name a value_info (here a stale one
    of another type) or a subgraph tensor already holds."""
    m = builders.ortt_linear_act("relu")
    clash = "act_grad/fused_linear_relu/dZ"
    m.graph.value_info.append(helper.make_tensor_value_info(clash, TensorProto.INT64, [3]))
    then_g = helper.make_graph([helper.make_node("Neg", ["dW"], ["act_grad/fused_linear_relu"
                                                                 "/dZ_2"])], "then", [],
                               [helper.make_tensor_value_info("act_grad/fused_linear_relu/dZ_2",
                                                              TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["dW"], ["e_out"])], "else", [],
                               [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
    m.graph.node.append(helper.make_node("If", ["cond"], ["branch_out"], name="branch",
                                         then_branch=then_g, else_branch=else_g))
    m.graph.input.append(builders.vi("cond", [], TensorProto.BOOL))
    m.graph.output.append(builders.vi("branch_out", [5, 4]))
    before = {clash, "act_grad/fused_linear_relu/dZ_2"}
    src = tmp_path / "clash.onnx"
    src.write_bytes(m.SerializeToString())
    out = tmp_path / "out.onnx"
    assert json.loads(run_cli("optimize", src, "-o", out, "--json").stdout)["total_fused"] == 1
    fused = onnx.load(out)
    node = next(n for n in fused.graph.node if n.domain == "com.fusecli")
    assert not set(node.output) & before, list(node.output)
    feeds = _feeds_for(m)
    feeds["cond"] = np.array(True)
    _run_ortt(out, feeds)


@pytest.mark.parametrize("holder", ["If", "custom"])
def test_a_tensor_a_subgraph_reads_is_read_outside_the_chain(holder):
    """dZ (the activation gradient, an intermediate of the Linear+ReLU chain) read inside a
    subgraph, of a standard If or of another domain's op, keeps the chain unfused."""
    from fusecli import FusionPass

    m = builders.ortt_linear_act("relu")
    branch = helper.make_graph([helper.make_node("Neg", ["dZ"], ["neg_dz"])], "branch", [],
                               [helper.make_tensor_value_info("neg_dz", TensorProto.FLOAT, None)])
    if holder == "If":
        node = helper.make_node("If", ["cond"], ["held"], name="holder", then_branch=branch,
                                else_branch=branch)
        m.graph.input.append(builders.vi("cond", [], TensorProto.BOOL))
    else:
        node = helper.make_node("Hold", [], ["held"], name="holder", domain="org.example",
                                body=branch)
    m.graph.node.append(node)
    m.graph.output.append(builders.vi("held", [6, 5]))
    assert FusionPass().run(m) == 0
    assert FusionPass().run(builders.ortt_linear_act("relu")) == 1   # it fuses without them


def test_the_standard_ops_with_subgraphs_are_the_ones_the_index_reads():
    """GraphIndex looks for subgraph attributes only on these standard ops (and on every op
    of another domain): the ops whose schema, in any version, has one."""
    import onnx.defs

    from fusecli.engine import graph

    have = {s.name for s in onnx.defs.get_all_schemas_with_history()
            if s.domain in ("", "ai.onnx") and any(
                a.type in graph._GRAPH_ATTRS for a in s.attributes.values())}
    assert have == graph._GRAPH_OPS


# --- bounded work ------------------------------------------------------------------------------

_BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
                for p, c in zip(["", *"abcdefgh"], "abcdefghi"))


def _limited():
    # bounded memory: a run that tried to expand or read everything would die, not pass
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def _bounded_case(tmp_path, args, *needles):
    (tmp_path / "out.onnx").write_bytes(OLD_OUTPUT)
    before = snapshot(tmp_path)
    t0 = time.monotonic()
    proc = subprocess.run([str(FUSECLI), *map(str, args)], capture_output=True, text=True,
                          timeout=30, preexec_fn=_limited)
    one_line_error(proc, 2, *needles)
    assert time.monotonic() - t0 < 20
    assert snapshot(tmp_path) == before


def _opt(tmp_path, *extra):
    return ["optimize", SAMPLE, "-o", tmp_path / "out.onnx", *extra]


def test_yaml_alias_bomb_in_a_rule_file(tmp_path):
    (tmp_path / "bomb.yaml").write_text(_BOMB)
    _bounded_case(tmp_path, _opt(tmp_path, "--rules", tmp_path / "bomb.yaml"), "aliases")
    _bounded_case(tmp_path, ["rules", "validate", tmp_path / "bomb.yaml"], "aliases")


def test_fifo_in_a_rules_folder(tmp_path):
    (tmp_path / "rules").mkdir()
    os.mkfifo(tmp_path / "rules" / "pipe.yaml")
    _bounded_case(tmp_path, _opt(tmp_path, "--rules", tmp_path / "rules"), "pipe.yaml",
                  "not a regular file")


@pytest.mark.parametrize("option", ["--rules", "--expect", "--baseline"])
def test_dev_zero_as_a_file(tmp_path, option):
    _bounded_case(tmp_path, _opt(tmp_path, option, "/dev/zero"), "not a regular file")


@pytest.mark.parametrize("option,suffix", [("--rules", ".yaml"), ("--expect", ".yaml"),
                                           ("--baseline", ".json")])
def test_deeply_nested_file(tmp_path, option, suffix):
    f = tmp_path / f"deep{suffix}"
    f.write_text("[" * 50_000 + "]" * 50_000)
    _bounded_case(tmp_path, _opt(tmp_path, option, f), "nested deeper than")


def test_crossed_variants_bomb(tmp_path):
    """variants: {cross: [...]} of ten lists of ten would make 10^10 rules."""
    lists = ", ".join("[" + ", ".join(f"{{p{k}: {v}}}" for v in range(10)) + "]"
                      for k in range(10))
    head, tail = LINEAR_RULE.split("variants:", 1)
    f = tmp_path / "cross.yaml"
    f.write_text(head + f"variants: {{cross: [{lists}]}}\n" + tail[tail.index("nodes:"):])
    _bounded_case(tmp_path, ["rules", "validate", f], "more than 1000 rules")


def test_oversized_rule_file(tmp_path):
    f = tmp_path / "big.yaml"
    f.write_text(GOOD_RULE + "#" * (2 << 20) + "\n")
    _bounded_case(tmp_path, _opt(tmp_path, "--rules", f), "bytes")


def test_bench_threads_bounded(tmp_path):
    _bounded_case(tmp_path, ["bench", SAMPLE, SAMPLE, "--threads", 100000], "--threads")


def test_external_tensor_with_negative_dims(tmp_path):
    src, _ = _linear_model(tmp_path / "in", seed=0)
    m = onnx.load(src, load_external_data=False)
    big = next(t for t in m.graph.initializer if t.name == "W")
    del big.dims[:]
    big.dims.extend([-1])
    for e in big.external_data:
        if e.key == "length":
            big.external_data.remove(e)
            break
    src.write_bytes(m.SerializeToString())
    _bounded_case(tmp_path, ["optimize", src, "-o", tmp_path / "out.onnx"],
                  "negative dimension")


# --- exit codes --------------------------------------------------------------------------------

def test_symlink_loops(tmp_path):
    os.symlink("loop_b", tmp_path / "loop_a")
    os.symlink("loop_a", tmp_path / "loop_b")
    loop = tmp_path / "loop_a"
    for args in (["optimize", loop, "-o", tmp_path / "out.onnx"], _opt(tmp_path, "-o", loop),
                 _opt(tmp_path, "--rules", loop), _opt(tmp_path, "--expect", loop),
                 _opt(tmp_path, "--baseline", loop)):
        _bounded_case(tmp_path, args, "symbolic link")


def test_output_name_too_long_leaves_nothing(tmp_path):
    src, _ = _linear_model(tmp_path / "in", seed=0)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = run_cli("optimize", src, "-o", out_dir / ("n" * 300 + ".onnx"), check_rc=None)
    one_line_error(proc, 2, "bytes long", "at most")
    assert list(out_dir.iterdir()) == []


def test_external_data_length_disagreeing_with_dims(tmp_path):
    src, _ = _linear_model(tmp_path / "in", seed=0)
    m = onnx.load(src, load_external_data=False)
    w = next(t for t in m.graph.initializer if t.name == "W")
    del w.dims[:]
    w.dims.extend([4, 4])                      # 64 bytes; the stored length is larger
    src.write_bytes(m.SerializeToString())
    _bounded_case(tmp_path, ["optimize", src, "-o", tmp_path / "out.onnx"], "'W'",
                  "dims [4, 4] need 64")


def _damage(t: onnx.TensorProto, how: str) -> None:
    if how == "raw_short":
        t.raw_data = t.raw_data[:10]
    elif how == "typed_short":
        t.ClearField("raw_data")
        t.float_data.extend([1.0, 2.0])
    elif how == "string_as_raw":
        t.data_type = TensorProto.STRING
    elif how == "strings_short":
        t.data_type = TensorProto.STRING
        t.ClearField("raw_data")
        t.string_data.append(b"a")


@pytest.mark.parametrize("where", ["initializer", "constant"])
@pytest.mark.parametrize("how", ["raw_short", "typed_short", "string_as_raw", "strings_short"])
def test_stored_tensor_data_disagreeing_with_dims(tmp_path, where, how):
    """(make fuzz) a stored tensor whose data does not fit its dims and element type is refused
    at load, in one line naming it, not when a rule first reads it (was exit 4)."""
    m = builders.ortt_linear_act("relu", M=8, N=4, K=6)
    w = numpy_helper.from_array(np.ones((4, 6), np.float32), "W")
    _damage(w, how)
    del m.graph.input[[i.name for i in m.graph.input].index("W")]
    if where == "initializer":
        m.graph.initializer.append(w)
    else:
        m.graph.node.insert(0, helper.make_node("Constant", [], ["W"], value=w))
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    _bounded_case(tmp_path, ["optimize", src, "-o", tmp_path / "out.onnx"], "'W'", "dims [4, 6]")


def test_stored_tensors_of_every_layout_are_read():
    """The stored-data check knows each element type's layout: typed fields (float16 in
    int32_data, complex as pairs, uint64, 4-bit packed two per entry), raw bytes and strings."""
    m = builders.ortt_linear_act("relu", M=8, N=4, K=6)
    x = np.arange(6).reshape(2, 3)
    kept = [helper.make_tensor("f16", TensorProto.FLOAT16, [2, 3], x.astype(np.float16)),
            helper.make_tensor("c64", TensorProto.COMPLEX64, [2, 3], x.astype(np.complex64)),
            helper.make_tensor("u64", TensorProto.UINT64, [2, 3], x.astype(np.uint64)),
            helper.make_tensor("i4", TensorProto.INT4, [2, 3], x.astype(np.int8)),
            helper.make_tensor("i4raw", TensorProto.INT4, [3], b"\x12\x03", raw=True),
            helper.make_tensor("s", TensorProto.STRING, [2], [b"a", b"b"]),
            helper.make_tensor("b", TensorProto.BOOL, [0], []),
            numpy_helper.from_array(x.astype(np.float64), "f64raw")]
    m.graph.initializer.extend(kept)
    for t in kept:
        numpy_helper.to_array(t)               # (the fixtures themselves are well formed)
    assert api.check(m) == []


@pytest.mark.parametrize("baseline", [
    {"patterns": {"linear_relu": {"fused": "many"}}},
    {"patterns": ["linear_relu"]},
    {"patterns": {}, "rules": {"r": 3}},
])
def test_malformed_baseline_values(tmp_path, baseline):
    f = tmp_path / "base.json"
    f.write_text(json.dumps(baseline))
    _bounded_case(tmp_path, _opt(tmp_path, "--baseline", f), "--baseline", "fusecli optimize")


@pytest.mark.parametrize("old,new,needle", [
    ("attrs: {transA: 1, transB: 0, alpha: 1.0}", "attrs: {transA: yes, transB: 0, alpha: 1.0}",
     "'transA' (of Gemm): True is not an integer"),
    ("attrs: {transA: 1, transB: 0, alpha: 1.0}", "attrs: {transA: 1, transB: 0, alpha: [1]}",
     "'alpha' (of Gemm): [1] is not a number"),
    ("trans_w: 0}", "trans_w: 0.5}", "replace.attrs.trans_w: 0.5 is not an integer"),
    ("attrs: {keepdims: 0,", "attrs: {keepdims: [0],", "'keepdims' (of ReduceSum): [0]"),
])
def test_rule_attribute_of_the_wrong_type(tmp_path, old, new, needle):
    assert old in LINEAR_RULE
    rule = tmp_path / "rule.yaml"
    rule.write_text(LINEAR_RULE.replace(old, new))
    _bounded_case(tmp_path, ["rules", "validate", rule], needle)
    _bounded_case(tmp_path, _opt(tmp_path, "--rules", rule), needle)


@pytest.mark.parametrize("kind", ["not_executable", "not_a_program", "folder"])
def test_unusable_runtime_python(tmp_path, kind):
    python = tmp_path / "python"
    if kind == "folder":
        python.mkdir()
    else:
        python.write_text("this is not a python\n")
        python.chmod(0o755 if kind == "not_a_program" else 0o644)
    _bounded_case(tmp_path, ["verify", SAMPLE, SAMPLE, "--runtime-python", python],
                  str(python))


@pytest.mark.parametrize("option,value", [("--seed", "-1"), ("--rtol", "nan"),
                                          ("--atol", "-1")])
def test_verify_option_values_bounded(tmp_path, option, value):
    _bounded_case(tmp_path, ["verify", SAMPLE, SAMPLE, option, value], option)


def test_closed_stdout(tmp_path):
    proc = subprocess.run([str(FUSECLI), "stats", str(SAMPLE)], stderr=subprocess.PIPE,
                          text=True, timeout=60, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("fusecli: error: standard output is closed")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bfloat16_inputs_to_verify(tmp_path):
    m = builders.model([helper.make_node("Identity", ["x"], ["y"], name="id")],
                       [builders.vi("x", [2, 3], TensorProto.BFLOAT16)],
                       [builders.vi("y", [2, 3], TensorProto.BFLOAT16)], ms=False)
    src = tmp_path / "bf16.onnx"
    src.write_bytes(m.SerializeToString())
    _bounded_case(tmp_path, ["verify", src, src], "bfloat16")


def test_control_characters_in_a_name_stay_on_one_line(tmp_path):
    name = tmp_path / "bad\nname\r\x1b[31m.onnx"
    proc = run_cli("optimize", name, "-o", tmp_path / "out.onnx", check_rc=None)
    line = one_line_error(proc, 2, "no such file")
    assert "\\x0a" in line and "\x1b" not in line


# --- signals -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """A graph with 2,000 fusible chains (10,000 nodes): seconds of work to interrupt; being over
    5,000 nodes, fusecli says on stderr when it starts matching."""
    m = builders.compose([builders.frag_ortt_linear_act(f"f{i}/", "relu") for i in range(2000)])
    path = tmp_path_factory.mktemp("slow") / "slow.onnx"
    path.write_bytes(m.SerializeToString())
    return path


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig,count,rc", [(signal.SIGTERM, 1, 143), (signal.SIGINT, 1, 130),
                                          (signal.SIGTERM, 2, 143)])
def test_signal_exits_in_one_line_and_leaves_nothing(tmp_path, slow_model, sig, count, rc):
    (tmp_path / "out.onnx").write_bytes(OLD_OUTPUT)
    # the child starts with both signals at their default: a shell that starts this suite in
    # the background (`make test &`, not interactive) ignores SIGINT in it, and fusecli leaves
    # an ignored signal ignored (nohup), so the test would depend on how it was started
    p = subprocess.Popen([str(FUSECLI), "optimize", str(slow_model), "-o",
                          str(tmp_path / "out.onnx")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    try:
        assert "matching" in p.stderr.readline()      # it is busy fusing now
        for _ in range(count):
            p.send_signal(sig)
            time.sleep(0.01)
        err = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:
            p.kill()
    lines = [x for x in err.splitlines() if not re.fullmatch(r"fusecli: \d+ fusions", x)]
    assert p.returncode == rc, err
    assert lines == [f"fusecli: interrupted by {signal.Signals(sig).name}; nothing "
                     "half-written was left behind"], err
    assert (tmp_path / "out.onnx").read_bytes() == OLD_OUTPUT
    assert sorted(q.name for q in tmp_path.iterdir()) == ["out.onnx"]


def test_signal_while_the_data_is_copied_keeps_the_previous_output(tmp_path, monkeypatch):
    """The signal handler's exception lands in the middle of copying a data file: the previous
    model and data stay as they were and no temporary file is left."""
    from fusecli import errors
    from fusecli.io import model as modelio

    src1, _ = _linear_model(tmp_path / "v1", seed=0)
    src2, _ = _linear_model(tmp_path / "v2", seed=9)
    out = tmp_path / "out" / "fused.onnx"
    out.parent.mkdir()
    modelio.save_model(modelio.load_model(src1), out, src1)
    before = snapshot(tmp_path)

    def interrupted(*a, **k):
        raise errors.Interrupted(signal.SIGTERM)

    monkeypatch.setattr(modelio, "_try_reflink", lambda *a: False)
    monkeypatch.setattr(modelio, "_copy_range", interrupted)
    with pytest.raises(errors.Interrupted):
        modelio.save_model(modelio.load_model(src2), out, src2)
    assert snapshot(tmp_path) == before
