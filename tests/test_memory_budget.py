"""The memory budget (`fusecli optimize --max-memory`, fusecli/engine/recompute.py): forward
tensors dropped from the saved activations and recomputed in the backward.

Expected sets and sizes come from the graphs' construction; numerical checks run the fused and
the budgeted graph on onnxruntime (both families) with every graph optimization on, so that
onnxruntime's common-subexpression elimination had its chance to merge the duplicates."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from builders import model, vi
from conftest import SAMPLES, run_cli
from fusecli import api
from fusecli.engine.recompute import apply_budget, parse_size
from fusecli.engine.saved import saved_activations
from fusecli.errors import FuseError
from fusecli.runtime.budget import HEADROOM, measured_budget

DIMS = {"batch": 2}
DATA = Path(__file__).parent / "data"


def _toy(dropout: bool = False):
    """loss = sum(tanh(x @ w) @ v) over [4, 8] x; the backward reads tanh's output t (saved),
    the product p (saved by a backward Mul) and x. With ``dropout`` t goes through a training
    Dropout whose output d (and mask) the backward reads instead."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"], name="mm0"),
             helper.make_node("Tanh", ["p"], ["t"], name="tanh")]
    h = "t"
    if dropout:
        nodes.append(helper.make_node("Dropout", ["t", "ratio", "train"], ["d", "mask"],
                                      name="drop", seed=1))
        h = "d"
    nodes += [helper.make_node("MatMul", [h, "v"], ["y"], name="mm"),
              helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0),
              # backward (not on the loss path): reads h, t and p
              helper.make_node("MatMul", [h, "dy"], ["dv"], name="mm_grad"),
              helper.make_node("Mul", ["t", "t"], ["tt"], name="tt"),
              helper.make_node("Sub", ["one", "tt"], ["dt"], name="dt"),
              helper.make_node("Mul", ["dt", "p"], ["dx"], name="dx")]
    inits = [onnx.numpy_helper.from_array(np.float32(1.0), "one"),
             onnx.numpy_helper.from_array(np.float32(0.25), "ratio"),
             onnx.numpy_helper.from_array(np.bool_(True), "train")]
    m = model(nodes, [vi("x", [4, 8]), vi("w", [8, 8]), vi("v", [8, 3]), vi("dy", [3, 3])],
              [vi("loss", []), vi("dv", [8, 3]), vi("dx", [4, 8])], inits)
    m.graph.value_info.extend([vi("p", [4, 8]), vi("t", [4, 8]), vi("y", [4, 3])])
    if dropout:
        m.graph.value_info.extend([vi("d", [4, 8]),
                                   vi("mask", [4, 8], onnx.TensorProto.BOOL)])
    return m


def _topological(m: onnx.ModelProto) -> bool:
    seen = {i.name for i in m.graph.input} | {t.name for t in m.graph.initializer} | {""}
    for n in m.graph.node:
        if not all(t in seen for t in n.input):
            return False
        seen.update(n.output)
    return True


def _fused(name: str) -> onnx.ModelProto:
    return api.optimize(SAMPLES / f"{name}.onnx").model


# --- sizes --------------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                        ("300000", 300000), ("2G", 2 * 2**30),
                                        ("64 KiB", 65536), ("1e6", 10**6), (4096, 4096)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-5MiB", "0", "MiB", "1.5.2GB"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(FuseError, match="--max-memory"):
        parse_size(text)


def test_cli_bad_size_is_one_line_exit_2(tmp_path):
    proc = run_cli("optimize", SAMPLES / "torch_mlp.onnx", "-o", tmp_path / "o.onnx",
                   "--max-memory", "lots", check_rc=2)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "--max-memory" in err[0] and "512MiB" in err[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o.onnx").exists()


# --- what it chooses ------------------------------------------------------------------------
def test_toy_recomputes_elementwise_before_gemm_and_estimate_matches_the_graph():
    m = _toy()
    assert saved_activations(m.graph) == {"p", "t"}       # 128 bytes each
    rep = apply_budget(m, 128)
    # tanh (elementwise) is recomputed from p, which stays saved: 256 -> 128 bytes; the GEMM
    # that writes p (as cheap a drop: its inputs are graph inputs) comes after elementwise ops
    assert rep.before == 256 and rep.after == 128 and rep.met
    assert rep.recomputed == {"elementwise Tanh": 1}
    assert saved_activations(m.graph) == {"p"}
    assert _topological(m)


def test_budget_already_met_leaves_the_graph_unchanged():
    m = _toy()
    before = m.SerializeToString()
    rep = apply_budget(m, 256)
    assert rep.recomputed == {} and rep.after == rep.before == 256
    assert m.SerializeToString() == before


def test_unreachable_budget_is_refused_with_the_minimum_and_the_graph_unchanged():
    m = _toy(dropout=True)   # the Dropout's output d (128 bytes) cannot be recomputed
    before = m.SerializeToString()
    with pytest.raises(FuseError, match=r"unreachable.*at least 128 B"):
        apply_budget(m, 64)
    assert m.SerializeToString() == before
    rep = apply_budget(m, 64, strict=False)           # best effort on request (API only)
    assert not rep.met and rep.minimum == rep.after == 128
    assert saved_activations(m.graph) == {"d"}


def test_everything_recomputable_reaches_zero():
    m = _toy()
    rep = apply_budget(m, 1)
    assert rep.after == 0 and sorted(rep.recomputed) == ["elementwise Tanh", "gemm MatMul"]
    assert _topological(m)


def test_random_ops_are_never_duplicated():
    m = _toy(dropout=True)
    assert {"d", "t", "p"} <= saved_activations(m.graph)
    rep = apply_budget(m, 1, strict=False)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("Dropout") == 1
    assert all("Dropout" not in k for k in rep.recomputed)
    assert "d" in saved_activations(m.graph)              # the dropout output stays saved


def test_symbolic_dims_need_values():
    m = onnx.load(str(SAMPLES / "ortt_llama.onnx"))
    with pytest.raises(FuseError, match=r"symbolic dimension\(s\) batch.*--dim batch="):
        apply_budget(m, 1)


@pytest.mark.parametrize("name", ["ortt_block", "ortt_llama", "torch_block", "ortt_mlp"])
def test_samples_keep_outputs_and_order(name):
    fused = _fused(name)
    m = copy.deepcopy(fused)
    full = apply_budget(copy.deepcopy(fused), 10**12, DIMS).before
    rep = apply_budget(m, full // 2, DIMS, strict=False)
    assert rep.recomputed and rep.after < full
    assert _topological(m)
    assert [(o.name, o.type) for o in m.graph.output] == \
        [(o.name, o.type) for o in fused.graph.output]
    assert [(i.name, i.type) for i in m.graph.input] == \
        [(i.name, i.type) for i in fused.graph.input]
    # the estimate the report gives is the graph's own saved activations
    assert rep.after == apply_budget(copy.deepcopy(m), 10**12, DIMS).before
    # every duplicate reads only saved tensors, constants or other duplicates, and no random op
    assert not any(n.op_type in ("Dropout", "BitmaskDropout", "RandomUniform")
                   for n in m.graph.node if n.name.endswith("/recompute"))


def _run(path: Path, feeds: dict, python: str, lib: str, level: str = "all") -> dict:
    from fusecli.runtime.runner import run_in_runtime

    outs, _ = run_in_runtime(path, feeds, python, library=lib, opt_level=level,
                             extra=["--deterministic"])
    return outs


def _optimized_nodes(path: Path, python: str, lib: str, tmp: Path) -> list[str]:
    """Node names of the graph onnxruntime runs at ORT_ENABLE_ALL (after its CSE)."""
    import subprocess

    out = tmp / (path.stem + ".opt.onnx")
    code = ("import sys, onnxruntime as ort; so = ort.SessionOptions(); "
            "so.register_custom_ops_library(sys.argv[3]); "
            "so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL; "
            "so.optimized_model_filepath = sys.argv[2]; "
            "ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])")
    subprocess.run([python, "-c", code, str(path), str(out), lib], check=True,
                   capture_output=True)
    return [n.name for n in onnx.load(str(out)).graph.node]


def _unfenced(m: onnx.ModelProto) -> onnx.ModelProto:
    """The budgeted graph without its CSE fences (each fence's reader reads the fenced tensor)."""
    m = copy.deepcopy(m)
    fence = {n.output[0]: n.input[0] for n in m.graph.node if n.name.endswith("/fence")}
    keep = [n for n in m.graph.node if not n.name.endswith("/fence")]
    for n in keep:
        for k, t in enumerate(n.input):
            n.input[k] = fence.get(t, t)
    del m.graph.node[:]
    m.graph.node.extend(keep)
    return m


# layout ops onnxruntime folds into their GEMM readers (a Transpose of a weight becomes a
# FusedMatMul's trans attribute), so their duplicates' names vanish without CSE
_FOLDED = ("Transpose", "Reshape", "Squeeze", "Unsqueeze")


def _survivors(dups: list[str], optimized: list[str]) -> set[str]:
    """The duplicates still in onnxruntime's optimized graph: under their own name, or as the
    first node of a fusion onnxruntime names after it (a MatMul reading a Transpose becomes
    '<name>/MatmulTransposeFusion/', a FusedMatMul)."""
    names = set(optimized)
    return {d for d in dups if d in names or any(k.startswith(d + "/") for k in names)}


@pytest.mark.parametrize("name", ["ortt_llama", "ortt_block", "torch_block", "torch_llama"])
def test_budgeted_step_computes_what_the_fused_step_computes(name, manifest, tmp_path):
    """Both families, onnxruntime with every optimization on: every output (and, for
    ort-training, every gradient written into its accumulation buffer) equal to the fused
    graph's; the duplicates survive onnxruntime's CSE, and without the fences they would not."""
    from fusecli.runtime.feeds import make_feeds
    from fusecli.runtime.library import library_path
    from fusecli.runtime.runner import pick_runtime

    fused = _fused(name)
    budgeted = copy.deepcopy(fused)
    rep = apply_budget(budgeted, 1, DIMS, strict=False)     # as much as it can recompute
    assert rep.recomputed
    a, b = tmp_path / "fused.onnx", tmp_path / "budgeted.onnx"
    onnx.save(fused, str(a))
    onnx.save(budgeted, str(b))
    entry = next(e for e in manifest.values() if e["file"] == f"{name}.onnx")
    feeds = make_feeds(fused, entry, dims=DIMS)
    python, lib = pick_runtime(fused), library_path()
    # Tolerance, not bit equality: the fused ortt_block step itself differs from run to run
    # by ~1e-9 in its weight gradients (measured: 3 of 6 --deterministic runs of the same fused
    # file, without any budget); with optimizations on, onnxruntime may also fuse a
    # duplicate's reader otherwise than the original's (a Transpose into a FusedMatMul)
    for level in ("disable", "all"):
        ra, rb = _run(a, feeds, python, lib, level), _run(b, feeds, python, lib, level)
        assert ra.keys() == rb.keys()
        for k in ra:
            np.testing.assert_allclose(rb[k], ra[k], rtol=1e-5, atol=1e-7, err_msg=k)
    dups = [n.name for n in budgeted.graph.node
            if n.name.endswith("/recompute") and n.op_type not in _FOLDED]
    assert dups or name == "torch_llama"   # it recomputes only Transposes
    kept = _survivors(dups, _optimized_nodes(b, python, lib, tmp_path))
    assert kept == set(dups), sorted(set(dups) - kept)
    c = tmp_path / "unfenced.onnx"
    onnx.save(_unfenced(budgeted), str(c))
    merged = set(dups) - _survivors(dups, _optimized_nodes(c, python, lib, tmp_path))
    fences = {n.output[0] for n in budgeted.graph.node if n.name.endswith("/fence")}
    fenced = {n.name for n in budgeted.graph.node if n.name in dups and n.domain == ""
              and any(t in fences for t in n.input)}
    if name == "ortt_llama":  # CSE folds its unfenced Pow duplicate back into the original
        assert fenced and merged & fenced, (fenced, merged)


def test_cli_prints_what_it_recomputes(tmp_path):
    out = tmp_path / "o.onnx"
    proc = run_cli("optimize", SAMPLES / "ortt_llama.onnx", "-o", out, "--max-memory", "20KiB",
                   "--estimate-only", "--dim", "batch=2")
    assert "memory budget 20.0 KiB" in proc.stderr and "recomputed in the backward" in \
        proc.stderr, proc.stderr
    assert "extra work" in proc.stderr and out.exists()


def test_cli_unreachable_budget_exit_2_nothing_written(tmp_path):
    out = tmp_path / "o.onnx"
    proc = run_cli("optimize", SAMPLES / "ortt_llama.onnx", "-o", out, "--max-memory", "100",
                   "--estimate-only", "--dim", "batch=2", check_rc=2)
    lines = [ln for ln in proc.stderr.splitlines() if "unreachable" in ln]
    assert len(lines) == 1 and "at least" in lines[0], proc.stderr
    assert not out.exists()


def test_cli_symbolic_dims_without_values_exit_2(tmp_path):
    proc = run_cli("optimize", SAMPLES / "ortt_llama.onnx", "-o", tmp_path / "o.onnx",
                   "--max-memory", "1MiB", check_rc=2)
    assert "--dim batch=" in proc.stderr and "Traceback" not in proc.stderr


def test_api_takes_the_same_sizes():
    r = api.optimize(SAMPLES / "ortt_llama.onnx", max_memory="20KiB", dims=DIMS,
                     estimate_only=True)
    assert r.budget.met and r.budget.after <= 20 * 1024 < r.budget.before
    d = r.as_dict()["memory_budget"]
    assert d["budget_bytes"] == 20480 and d["recomputed_total"] > 0
    with tempfile.TemporaryDirectory():
        with pytest.raises(FuseError, match="unreachable"):
            api.optimize(SAMPLES / "ortt_llama.onnx", max_memory=100, dims=DIMS,
                         estimate_only=True)


# --- groups of nodes that pay only together ------------------------------------------------
def _chain(dropout: bool = False):
    """loss = sum(sigmoid(tanh(a)) @ v), a = x (or a training Dropout of x); the backward reads
    only c = sigmoid(tanh(a)) (128 bytes). Recomputing the Sigmoid alone would make its input
    tanh(a) saved instead (128 bytes: no gain); the Sigmoid and the Tanh together read a, which
    is a graph input (nothing becomes saved) or, with ``dropout``, the Dropout's output (128
    bytes: still no gain, and a Dropout is never recomputed)."""
    nodes, a = [], "x"
    if dropout:
        nodes.append(helper.make_node("Dropout", ["x", "ratio", "train"], ["a", "mask"],
                                      name="drop", seed=1))
        a = "a"
    nodes += [helper.make_node("Tanh", [a], ["b"], name="tanh"),
              helper.make_node("Sigmoid", ["b"], ["c"], name="sigmoid"),
              helper.make_node("MatMul", ["c", "v"], ["y"], name="mm"),
              helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0),
              helper.make_node("Mul", ["c", "g"], ["dx"], name="bwd")]   # the backward
    inits = [onnx.numpy_helper.from_array(np.float32(0.25), "ratio"),
             onnx.numpy_helper.from_array(np.bool_(True), "train")] if dropout else []
    m = model(nodes, [vi("x", [4, 8]), vi("v", [8, 3]), vi("g", [4, 8])],
              [vi("loss", []), vi("dx", [4, 8])], inits)
    m.graph.value_info.extend([vi("b", [4, 8]), vi("c", [4, 8]), vi("y", [4, 3])])
    if dropout:
        m.graph.value_info.extend([vi("a", [4, 8]), vi("mask", [4, 8], onnx.TensorProto.BOOL)])
    return m


def test_a_chain_that_pays_only_as_a_group_is_recomputed():
    m = _chain()
    fused = copy.deepcopy(m)
    assert saved_activations(m.graph) == {"c"}
    rep = apply_budget(m, 64)
    assert rep.before == 128 and rep.after == 0 and rep.met
    assert rep.recomputed == {"elementwise Sigmoid": 1, "elementwise Tanh": 1}
    assert saved_activations(m.graph) == set() and _topological(m)
    # the backward reads the duplicate, computed from x through a CSE fence, just before it
    names = [n.name for n in m.graph.node]
    bwd = next(n for n in m.graph.node if n.name == "bwd")
    assert bwd.input[0] == "c.recompute"
    assert names.index("sigmoid/recompute") < names.index("bwd")
    assert names.index("tanh") < names.index("tanh/recompute/fence") < names.index(
        "tanh/recompute") < names.index("sigmoid/recompute")
    assert rep.fences == 1
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 8), np.float32),
             "v": rng.standard_normal((8, 3), np.float32),
             "g": rng.standard_normal((4, 8), np.float32)}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    got = [ort.InferenceSession(mm.SerializeToString(), so,
                                providers=["CPUExecutionProvider"]).run(None, feeds)
           for mm in (fused, m)]
    ref = 1 / (1 + np.exp(-np.tanh(feeds["x"]))) * feeds["g"]     # NumPy: c * g
    for a, b in zip(*got):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got[1][1], ref, rtol=1e-5, atol=1e-6)


def test_a_group_that_does_not_lower_the_estimate_is_not_taken():
    m = _chain(dropout=True)
    before = m.SerializeToString()
    assert saved_activations(m.graph) == {"c"}
    # Sigmoid + Tanh would make the Dropout's output a saved (128 bytes for 128 bytes), and
    # the Dropout cannot join the group
    with pytest.raises(FuseError, match=r"unreachable.*at least 128 B"):
        apply_budget(m, 64)
    assert m.SerializeToString() == before
    rep = apply_budget(m, 64, strict=False)
    assert rep.recomputed == {} and rep.after == 128 and saved_activations(m.graph) == {"c"}


def test_norm_statistics_without_recorded_shapes_are_sized_and_recomputed():
    """onnxruntime's SimplifiedLayerNormalization (an ai.onnx-domain op onnx does not know)
    writes its inverse std for the backward without a recorded shape: [4, 1] float, from the
    input's shape and axis -1. Its output is recomputed from x and that inverse std, which
    the backward reads anyway and so stays saved (16 bytes)."""
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["x", "s"], ["y", "inv"],
                              name="norm", axis=-1, epsilon=1e-6, stash_type=1),
             helper.make_node("MatMul", ["y", "v"], ["z"], name="mm"),
             helper.make_node("ReduceSum", ["z"], ["loss"], name="sum", keepdims=0),
             helper.make_node("Mul", ["y", "g"], ["dy"], name="bwd0"),
             helper.make_node("Mul", ["inv", "k"], ["dinv"], name="bwd1")]
    m = model(nodes, [vi("x", [4, 8]), vi("s", [8]), vi("v", [8, 3]), vi("g", [4, 8]),
                      vi("k", [4, 1])], [vi("loss", []), vi("dy", [4, 8]), vi("dinv", [4, 1])])
    m.graph.value_info.extend([vi("y", [4, 8]), vi("z", [4, 3])])
    rep = apply_budget(m, 16)
    assert rep.before == 4 * 8 * 4 + 4 * 1 * 4 and rep.unsized == 0
    assert rep.after == 16 and saved_activations(m.graph) == {"inv"}
    assert rep.recomputed == {"elementwise SimplifiedLayerNormalization (from its statistics)": 1}
    assert rep.extra_flops == 2 * 4 * 8   # two Muls over y's 32 elements


def _norm_step(op: str, bias: bool = True, dtype=onnx.TensorProto.FLOAT, stats_read=True,
               axis: int = -1):
    """A norm over x [2, 3, 8] (LayerNormalization, or onnxruntime's
    SimplifiedLayerNormalization) whose output y the 'backward' reads (dy = y * g) along with
    its statistics (each times a graph input), as a norm's gradient and the next GEMM's weight
    gradient do."""
    shape = [2, 3, 8]
    nstat = 2 if op == "LayerNormalization" else 1
    stat_shape = shape[:axis % 3] + [1] * (3 - axis % 3)
    stats = ["mean", "inv"][-nstat:]
    ins = ["x", "s", "b"] if bias else ["x", "s"]
    nodes = [helper.make_node(op, ins, ["y", *stats], name="norm", axis=axis, epsilon=1e-5,
                              stash_type=1),
             helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0),
             helper.make_node("Mul", ["y", "g"], ["dy"], name="bwd_y")]
    outs = [vi("loss", [], dtype), vi("dy", shape, dtype)]
    if stats_read:
        for t in stats:
            nodes.append(helper.make_node("Mul", [t, "k"], [f"d{t}"], name=f"bwd_{t}"))
            outs.append(vi(f"d{t}", stat_shape))
    pshape = shape[axis % 3:]
    inputs = [vi("x", shape, dtype), vi("s", pshape, dtype), vi("g", shape, dtype),
              vi("k", stat_shape)] + ([vi("b", pshape, dtype)] if bias else [])
    m = model(nodes, inputs, outs)
    m.graph.value_info.append(vi("y", shape, dtype))
    return m


def _numpy_norm(op, x, s, b, axis):
    ax = tuple(range(axis % x.ndim, x.ndim))
    x64 = x.astype(np.float64)
    if op == "LayerNormalization":
        c = x64 - x64.mean(axis=ax, keepdims=True)
    else:
        c = x64
    y = c / np.sqrt((c * c).mean(axis=ax, keepdims=True) + 1e-5) * s
    return y + b if b is not None else y


@pytest.mark.parametrize("op,bias,axis", [("LayerNormalization", True, -1),
                                          ("LayerNormalization", False, -1),
                                          ("LayerNormalization", True, 1),
                                          ("SimplifiedLayerNormalization", False, -1)])
def test_norm_output_recomputed_from_input_and_statistics(op, bias, axis):
    """The norm is not run again: its output is rebuilt elementwise from x and the statistics
    the forward wrote (still read by the backward, so still saved); on onnxruntime the step
    gives the original's outputs and NumPy's norm."""
    import onnxruntime as ort

    m = _norm_step(op, bias, axis=axis)
    original = copy.deepcopy(m)
    rep = apply_budget(m, 1, strict=False)
    assert rep.recomputed == {f"elementwise {op} (from its statistics)": 1}
    stats = {"mean", "inv"} if op == "LayerNormalization" else {"inv"}
    assert saved_activations(m.graph) == stats
    assert [n.op_type for n in m.graph.node].count(op) == 1   # the forward's norm only
    assert _topological(m)
    rng = np.random.default_rng(0)
    pshape = [2, 3, 8][axis % 3:]
    feeds = {"x": rng.standard_normal((2, 3, 8), np.float32) * 3 + 1,
             "s": rng.standard_normal(pshape, np.float32),
             "g": rng.standard_normal((2, 3, 8), np.float32),
             "k": np.ones([2, 3, 8][:axis % 3] + [1] * (3 - axis % 3), np.float32)}
    if bias:
        feeds["b"] = rng.standard_normal(pshape, np.float32)
    outs = {}
    for tag, g in (("original", original), ("budgeted", m)):
        sess = ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"])
        outs[tag] = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    for k in outs["original"]:
        np.testing.assert_allclose(outs["budgeted"][k], outs["original"][k], rtol=1e-5,
                                   atol=1e-5, err_msg=k)
    want = _numpy_norm(op, feeds["x"], feeds["s"], feeds.get("b"), axis) * feeds["g"]
    np.testing.assert_allclose(outs["budgeted"]["dy"], want, rtol=1e-4, atol=1e-5)


def test_norm_from_statistics_reads_a_recomputed_scale():
    """A scale computed in the forward (a Cast of the parameter, as mixed precision writes it)
    and read by the backward is recomputed too; the norm's elementwise duplicate reads the
    Cast's duplicate, not the forward's scale, which so stops being saved."""
    m = _norm_step("LayerNormalization")
    cast = helper.make_node("Cast", ["s"], ["s_cast"], name="cast", to=onnx.TensorProto.FLOAT)
    norm = next(n for n in m.graph.node if n.name == "norm")
    norm.input[1] = "s_cast"
    m.graph.node.insert(0, cast)
    m.graph.node.append(helper.make_node("Mul", ["s_cast", "s"], ["ds"], name="bwd_s"))
    m.graph.output.append(vi("ds", [8]))
    m.graph.value_info.append(vi("s_cast", [8]))
    assert "s_cast" in saved_activations(m.graph)
    rep = apply_budget(m, 1, strict=False)
    assert rep.recomputed == {"elementwise Cast": 1,
                              "elementwise LayerNormalization (from its statistics)": 1}
    assert saved_activations(m.graph) == {"mean", "inv"}
    (scale_mul,) = [n for n in m.graph.node if n.name.startswith("norm/mul")
                    and n.input[1].startswith("s_cast")]
    assert scale_mul.input[1] != "s_cast" and _topological(m)


def test_batch_norm_output_recomputed_from_its_saved_statistics(tmp_path):
    """onnxruntime-training's BatchNormInternal (training mode) writes the batch's mean and
    inv_std ([C]) for its gradient; the Relu after it is saved for the next layer. Both are
    recomputed: the norm from x and those statistics (reshaped to [C, 1, 1]), then the Relu.
    On onnxruntime-training against the original and NumPy."""
    from fusecli.runtime.runner import pick_runtime, run_in_runtime

    c = 3
    nodes = [helper.make_node("BatchNormInternal", ["x", "s", "b", "rm", "rv"],
                              ["y", "rm_out", "rv_out", "mean", "inv"], name="bn",
                              domain="com.microsoft", epsilon=1e-5, momentum=0.9,
                              training_mode=1),
             helper.make_node("Relu", ["y"], ["r"], name="relu"),
             helper.make_node("ReduceSum", ["r"], ["loss"], name="sum", keepdims=0),
             helper.make_node("Mul", ["r", "g"], ["dr"], name="bwd_r"),
             helper.make_node("Mul", ["mean", "k"], ["dmean"], name="bwd_mean"),
             helper.make_node("Mul", ["inv", "k"], ["dinv"], name="bwd_inv")]
    shape = [2, c, 4, 5]
    m = model(nodes, [vi("x", shape), vi("s", [c]), vi("b", [c]), vi("rm", [c]),
                      vi("rv", [c]), vi("g", shape), vi("k", [c])],
              [vi("loss", []), vi("dr", shape), vi("dmean", [c]), vi("dinv", [c])])
    m.graph.value_info.extend([vi("y", shape), vi("r", shape), vi("mean", [c]),
                               vi("inv", [c])])
    original = copy.deepcopy(m)
    rep = apply_budget(m, 1, strict=False)
    assert rep.recomputed == {"elementwise BatchNormInternal (from its statistics)": 1,
                              "elementwise Relu": 1}
    assert saved_activations(m.graph) == {"mean", "inv"} and _topological(m)
    assert [n.op_type for n in m.graph.node].count("BatchNormInternal") == 1
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal(shape, np.float32) * 2 + 0.5,
             "s": rng.standard_normal(c).astype(np.float32),
             "b": rng.standard_normal(c).astype(np.float32),
             "rm": np.zeros(c, np.float32), "rv": np.ones(c, np.float32),
             "g": rng.standard_normal(shape, np.float32), "k": np.ones(c, np.float32)}
    outs = {}
    for tag, g in (("original", original), ("budgeted", m)):
        onnx.save(g, tmp_path / f"{tag}.onnx")
        outs[tag], _ = run_in_runtime(tmp_path / f"{tag}.onnx", feeds, pick_runtime(g))
    for k in ("loss", "dr", "dmean", "dinv"):
        np.testing.assert_allclose(outs["budgeted"][k], outs["original"][k], rtol=1e-5,
                                   atol=1e-6, err_msg=k)
    x = feeds["x"].astype(np.float64)
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    col = (1, c, 1, 1)
    y = (x - mu) / np.sqrt(var + 1e-5) * feeds["s"].reshape(col) + feeds["b"].reshape(col)
    np.testing.assert_allclose(outs["budgeted"]["dr"], np.maximum(y, 0) * feeds["g"],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["half", "statistics_not_read"])
def test_norm_without_usable_statistics_is_recomputed_whole(case):
    """A half-precision norm (statistics in float, the input in half) and a norm whose
    statistics the backward does not read (they would have to stay alive just for the
    recomputation) are duplicated whole, statistics included."""
    if case == "half":
        m = _norm_step("LayerNormalization", dtype=onnx.TensorProto.FLOAT16)
    else:
        m = _norm_step("LayerNormalization", stats_read=False)
    rep = apply_budget(m, 1, strict=False)
    assert rep.recomputed == {"norm LayerNormalization": 1}
    assert [n.op_type for n in m.graph.node].count("LayerNormalization") == 2
    assert saved_activations(m.graph) == set()


def test_a_recomputed_layer_does_not_read_the_previous_layers_recomputed_tensors():
    """Two residual 'layers' h1 = x + x @ w1, h2 = h1 + h1 @ w2 (loss = sum(h2)); the backward
    reads h2, then h1 (128 bytes each), as a real backward goes from the last layer down.
    h1 is recomputed from x (a graph input). Recomputing h2 too would read h1's duplicate and
    so compute h1's GEMM at h2's backward reader, the start of the backward, where it would
    live on until h1's own reader: no saving for the step's peak. So h2 stays saved."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a1"], name="mm1"),
             helper.make_node("Add", ["x", "a1"], ["h1"], name="add1"),
             helper.make_node("MatMul", ["h1", "w2"], ["a2"], name="mm2"),
             helper.make_node("Add", ["h1", "a2"], ["h2"], name="add2"),
             helper.make_node("ReduceSum", ["h2"], ["loss"], name="sum", keepdims=0),
             helper.make_node("Mul", ["h2", "g"], ["d2"], name="bwd2"),
             helper.make_node("Mul", ["h1", "d2"], ["d1"], name="bwd1")]
    m = model(nodes, [vi("x", [4, 8]), vi("w1", [8, 8]), vi("w2", [8, 8]), vi("g", [4, 8])],
              [vi("loss", []), vi("d1", [4, 8])])
    m.graph.value_info.extend([vi(t, [4, 8]) for t in ("a1", "h1", "a2", "h2")])
    assert saved_activations(m.graph) == {"h1", "h2"}
    rep = apply_budget(m, 1, strict=False)
    assert rep.before == 256 and rep.after == 128 and not rep.met
    assert saved_activations(m.graph) == {"h2"}
    assert rep.recomputed == {"elementwise Add": 1, "gemm MatMul": 1}
    assert _topological(m)


# --- the budget on the measured peak (fusecli/runtime/budget.py) ----------------------------
def _estimate(m: onnx.ModelProto) -> int:
    return apply_budget(copy.deepcopy(m), 1 << 62, DIMS).before


class _Meter:
    """A stand-in for onnxruntime's measured peak: ``overhead`` + ``slope`` x the model's
    estimated saved activations (or a fixed number), counting its calls."""

    def __init__(self, slope=1.0, overhead=0, fixed=None):
        self.slope, self.overhead, self.fixed, self.calls = slope, overhead, fixed, 0

    def __call__(self, m):
        self.calls += 1
        return self.fixed if self.fixed is not None else \
            int(self.overhead + self.slope * _estimate(m))


def test_measured_budget_met_when_the_peak_falls_one_for_one():
    m = _fused("ortt_llama")
    full = _estimate(m)
    meter = _Meter(overhead=10_000)
    budget = full // 2 + 10_000
    rep = measured_budget(m, budget, DIMS, measure=meter)
    assert rep.met and rep.recomputed and rep.measured_after <= budget * (1 - HEADROOM)
    assert rep.measured_before == full + 10_000 and meter.calls == 2   # the fused step, 1 try
    assert _estimate(m) == rep.after <= full // 2                     # the model was rewritten
    assert _topological(m)


def test_measured_budget_follows_the_measured_slope():
    """Each estimated byte dropped lowers the peak by half a byte: the first target (lower by
    the excess) is not enough, the second (along the measured slope) is."""
    m = _fused("ortt_llama")
    full = _estimate(m)
    meter = _Meter(slope=0.5, overhead=50_000)
    budget = int(0.5 * 0.6 * full) + 50_000
    rep = measured_budget(m, budget, DIMS, measure=meter)
    assert rep.met and rep.measured_after <= budget and meter.calls == 3
    assert rep.after <= 0.6 * full


def test_measured_budget_unreachable_is_refused_and_the_model_unchanged():
    m = _fused("ortt_llama")
    before = m.SerializeToString()
    with pytest.raises(FuseError, match=r"unreachable: the fused step's measured peak is "
                                        r"1\.0 MiB.*brought it to 1\.0 MiB at least; give a "
                                        r"budget of at least 1\.1 MiB"):
        measured_budget(m, 2**19, DIMS, measure=_Meter(fixed=2**20))
    assert m.SerializeToString() == before


def test_measured_budget_already_met_changes_nothing():
    m = _fused("ortt_llama")
    before = m.SerializeToString()
    meter = _Meter(fixed=1000)
    rep = measured_budget(m, 2000, DIMS, measure=meter)
    assert rep.met and not rep.recomputed and rep.measured_after == 1000 and meter.calls == 1
    assert m.SerializeToString() == before
    assert "measured peak 1000 B already fits" in rep.lines()[0]


def test_cli_budget_holds_on_the_measured_peak(tmp_path):
    """End to end on onnxruntime: the 2-layer ort-training Llama sample at batch 1024 (its fused
    step peaks near 14 MiB; recomputation reaches about 8 MiB): a 11 MiB budget is met as
    measured (with the headroom: at most 10.45 MiB), and `fusecli bench` measures the written
    step again well under the fused one."""
    import json

    fused, out = tmp_path / "fused.onnx", tmp_path / "budgeted.onnx"
    run_cli("optimize", SAMPLES / "ortt_llama.onnx", "-o", fused, "-q")
    proc = run_cli("optimize", SAMPLES / "ortt_llama.onnx", "-o", out, "--max-memory", "11MiB",
                   "--dim", "batch=1024", "--json")
    mb = json.loads(proc.stdout)["memory_budget"]
    assert mb["met"] and mb["recomputed_total"] > 0, mb
    assert mb["measured_peak_after_bytes"] <= 0.95 * 11 * 2**20 < mb["measured_peak_before_bytes"]
    assert "measured peak" in proc.stderr
    bench = json.loads(run_cli("bench", fused, out, "--runs", "1", "--warmup", "0", "--dim",
                               "batch=1024", "--json").stdout)
    a, b = bench["original"]["peak_bytes"], bench["fused"]["peak_bytes"]
    assert b < 0.9 * a and b <= 11.5 * 2**20, (a, b)


def test_cli_feeds_go_with_verify_or_a_measured_budget(tmp_path):
    feeds = tmp_path / "f.npz"
    np.savez(feeds, unused=np.zeros(1, np.float32))
    proc = run_cli("optimize", SAMPLES / "ortt_llama.onnx", "-o", tmp_path / "o.onnx",
                   "--max-memory", "1MiB", "--estimate-only", "--dim", "batch=2", "--feeds",
                   feeds, check_rc=2)
    assert "--feeds is for --verify and a measured --max-memory" in proc.stderr


# --- a tied head's weight gradient written once, at the end (a GEMM recomputed) -----------
_HEAD = "gemm LinearCrossEntropy (weight gradient in the backward)"


def _fused_data(name: str) -> onnx.ModelProto:
    return api.optimize(DATA / f"{name}.onnx").model


def _lce_nodes(m: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in m.graph.node if n.op_type == "LinearCrossEntropy"]


@pytest.mark.parametrize("name", ["torch_lces_shift_ce_sum_tied", "torch_lces_reducemean_neg_tied"])
def test_tied_head_gradient_is_written_once_at_the_end(name, tmp_path):
    """torch-joint, head tied to the embedding: the fused op's dW was scattered into the
    table's gradient output at the end (two [V, D] tables: onnxruntime allocates the output
    apart); recomputing its logits (a GEMM), the forward op stops writing dW and a copy of it
    in the scatter's place writes the output, the embedding's rows added by the op. The
    estimate drops by dW less what the copy keeps saved, the outputs are the fused step's."""
    from fusecli.runtime.verify import verify_models

    fused = _fused_data(name)
    (fwd,) = _lce_nodes(fused)
    dw = fwd.output[2]
    (scatter,) = [n for n in fused.graph.node if dw in n.input]
    assert scatter.op_type == "ScatterND" and scatter.output[0] in {
        o.name for o in fused.graph.output}
    budgeted = copy.deepcopy(fused)
    rep = apply_budget(budgeted, 1, strict=False)
    assert rep.recomputed.get(_HEAD) == 1
    first, late = _lce_nodes(budgeted)
    assert first.output[0] and (len(first.output) < 3 or not first.output[2])
    assert list(late.output) == ["", "", scatter.output[0]]
    assert list(late.input[-2:]) == list(scatter.input[1:])
    assert not any(n.op_type == "ScatterND" and n.output[0] == scatter.output[0]
                   for n in budgeted.graph.node)
    assert dw not in saved_activations(budgeted.graph) and _topological(budgeted)
    onnx.save(fused, tmp_path / "fused.onnx")
    onnx.save(budgeted, tmp_path / "budgeted.onnx")
    report = verify_models(tmp_path / "fused.onnx", tmp_path / "budgeted.onnx")
    assert report.ok and report.max_rel <= 1e-5, report


@pytest.mark.parametrize("name", ["torch_lces_reducemean", "torch_lces_hf_gpt2_mean_tied",
                                  "ortt_lces_lm_shift_ce_tied"])
def test_head_gradient_stays_where_its_table_is_written_once(name):
    """An untied torch-joint head's dW is the graph output itself (so is a tied one exported
    with a gradient output per name, GPT2LMHeadModel's lm_head.weight_grad beside
    wte.weight_grad), and ort-training's tied scatter writes an intermediate (the accumulator
    reads it; onnxruntime reuses dW's buffer): one table each, nothing to gain, the op is left
    whole."""
    fused = _fused_data(name)
    budgeted = copy.deepcopy(fused)
    rep = apply_budget(budgeted, 1, strict=False)
    assert _HEAD not in rep.recomputed
    assert [list(n.output) for n in _lce_nodes(budgeted)] == [
        list(n.output) for n in _lce_nodes(fused)]


@pytest.mark.parametrize("name", ["torch_lces_shift_ce_sum_tied", "torch_lces_reducemean_neg_tied"])
def test_tied_head_gradient_is_taken_once_no_group_is_left(name, monkeypatch):
    """The head's dW is the last choice: a budget that the groups reach without it (their
    lowest estimate, found with the head made ineligible) leaves the op whole; one byte under,
    the head is deferred too."""
    from fusecli.engine import recompute

    fused = _fused_data(name)
    with monkeypatch.context() as mp:
        mp.setattr(recompute, "_head_ports", dict)    # no op has the ports: no head
        floor = apply_budget(copy.deepcopy(fused), 1, strict=False).minimum
    at_floor = copy.deepcopy(fused)
    rep = apply_budget(at_floor, floor, strict=False)
    assert rep.met and _HEAD not in rep.recomputed and len(_lce_nodes(at_floor)) == 1
    below = apply_budget(copy.deepcopy(fused), floor - 1, strict=False)
    assert below.recomputed.get(_HEAD) == 1 and below.after < floor
