"""Feeds recognised from the graph's dataflow (fusecli.runtime.feeds.plan_feeds) and --feeds FILE.npz.

Each policy is checked on a small graph built with onnx.helper whose input NAMES say nothing
(in0, in1, ...), so only the dataflow can tell a weight from a mask or a label."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from builders import model, vi
from conftest import SAMPLES, run_cli

from fusecli.errors import FuseError
from fusecli.runtime.feeds import load_manifest, plan_feeds, read_feeds_file

DATA = Path(__file__).parent / "data"

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _plan(nodes, inputs, outputs, inits=(), **kw):
    return plan_feeds(model(nodes, inputs, outputs, inits), **kw)


def _bound_ok(v: np.ndarray, fan_in: int) -> None:
    b = 1.0 / np.sqrt(fan_in)
    assert np.abs(v).max() <= b
    assert np.abs(v).max() > 0.9 * b  # uniform over the whole range, not a narrower one
    assert v.std() == pytest.approx(b / np.sqrt(3), rel=0.15)


def test_weights_get_fan_in_uniform_from_how_they_are_contracted():
    nodes = [
        helper.make_node("Gemm", ["in0", "in1", "in2"], ["g"], transB=1),        # in1 [64, 48]
        helper.make_node("MatMul", ["g", "in3"], ["m"]),                         # in3 [64, 40]
        helper.make_node("Transpose", ["in4"], ["t"], perm=[1, 0]),              # in4 [30, 40]
        helper.make_node("MatMul", ["m", "t"], ["y"]),
    ]
    p = _plan(nodes, [vi("in0", [8, 48]), vi("in1", [64, 48]), vi("in2", [64]),
                      vi("in3", [64, 40]), vi("in4", [30, 40])], [vi("y", [8, 30])])
    assert {k: p.policy[k] for k in ("in1", "in3", "in4")} == dict.fromkeys(
        ("in1", "in3", "in4"), "fan-in uniform U(+-1/sqrt(fan_in))")
    _bound_ok(p.feeds["in1"], 48)   # Gemm transB=1: [out, in]
    _bound_ok(p.feeds["in3"], 64)   # MatMul: [in, out]
    _bound_ok(p.feeds["in4"], 40)   # Transpose + MatMul (a 3-D Linear): [out, in]
    assert p.policy["in2"] == "zeros (bias)" and not p.feeds["in2"].any()
    assert p.policy["in0"] == "N(0,1)"


def test_conv_weight_fan_in_is_channels_times_kernel():
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])]
    p = _plan(nodes, [vi("x", [2, 16, 8, 8]), vi("w", [32, 16, 3, 3]), vi("b", [32])],
              [vi("y", [2, 32, 8, 8])])
    _bound_ok(p.feeds["w"], 16 * 9)
    assert p.policy["b"] == "zeros (bias)"
    assert p.feeds["x"].std() == pytest.approx(1.0, rel=0.1)  # float data: N(0,1)


def test_norm_scales_biases_and_running_stats():
    nodes = [
        helper.make_node("BatchNormalization", ["x", "s", "bb", "rm", "rv"], ["bn"]),
        helper.make_node("Reshape", ["bn", "shape"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "g", "beta"], ["y"], axis=-1),
    ]
    shape = numpy_helper.from_array(np.array([2, 64], np.int64), "shape")
    p = _plan(nodes, [vi("x", [2, 4, 4, 4]), vi("s", [4]), vi("bb", [4]), vi("rm", [4]),
                      vi("rv", [4]), vi("g", [64]), vi("beta", [64])], [vi("y", [2, 64])],
              [shape])
    want = {"s": ("ones (norm scale)", 1), "g": ("ones (norm scale)", 1),
            "bb": ("zeros (bias)", 0), "beta": ("zeros (bias)", 0),
            "rm": ("zeros (running mean)", 0), "rv": ("ones (running var)", 1)}
    for name, (policy, value) in want.items():
        assert p.policy[name] == policy, name
        assert np.all(p.feeds[name] == value), name


def test_token_ids_stay_within_the_embedding_rows():
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"])]
    p = _plan(nodes, [vi("table", [37, 8]), vi("ids", ["batch", "seq"], I64)],
              [vi("e", ["batch", "seq", 8])], dims={"batch": 64, "seq": 64})
    ids = p.feeds["ids"]
    assert p.policy["ids"] == "token ids in [0, 37)"
    assert ids.shape == (64, 64) and ids.min() >= 0 and ids.max() == 36  # the whole range
    assert p.policy["table"] == "N(0,1)"


def test_labels_stay_within_the_class_count_of_the_loss():
    # the class count comes from the Gemm that makes the logits (no shapes recorded between)
    nodes = [helper.make_node("Gemm", ["x", "w"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "lab"], ["loss"])]
    p = _plan(nodes, [vi("x", [512, 16]), vi("w", [7, 16]), vi("lab", [512], I64)],
              [vi("loss", [])])
    assert p.policy["lab"] == "labels in [0, 7)"
    assert p.feeds["lab"].min() == 0 and p.feeds["lab"].max() == 6
    # torch-joint's written-out loss: GatherElements of log-probabilities
    nodes = [helper.make_node("LogSoftmax", ["x"], ["lp"], axis=1),
             helper.make_node("Unsqueeze", ["lab", "one"], ["l2"]),
             helper.make_node("GatherElements", ["lp", "l2"], ["picked"], axis=1)]
    one = numpy_helper.from_array(np.array([1], np.int64), "one")
    p = _plan(nodes, [vi("x", [512, 5]), vi("lab", [512], I64)], [vi("picked", [512, 1])],
              [one])
    assert p.policy["lab"] == "labels in [0, 5)" and p.feeds["lab"].max() == 4


def test_labels_of_a_fused_head_stay_within_its_vocabulary():
    """Once the head + loss is one LinearCrossEntropy there are no logits to read the class
    count from: it is the fused op's weight rows (W [V, D]). Without that the plan fell back to
    integers in [0, 2) (the LM head's loss on two classes)."""
    import onnx

    from fusecli import FusionPass

    m = onnx.load(DATA / "torch_lces_reducemean.onnx")
    assert plan_feeds(copy.deepcopy(m)).policy["labels"] == "labels in [0, 50)"  # control
    FusionPass().run(m)
    assert "LinearCrossEntropy" in [n.op_type for n in m.graph.node]
    p = plan_feeds(m)
    assert p.policy["labels"] == "labels in [0, 50)"
    assert p.feeds["labels"].max() < 50


def _masked_where(true_means_masked: bool, shape):
    neg = numpy_helper.from_array(np.array(-np.inf, np.float32), "neg")
    ins = ["m", "neg", "s"] if true_means_masked else ["m", "s", "neg"]
    nodes = [helper.make_node("Where", ins, ["w"]), helper.make_node("Softmax", ["w"], ["p"])]
    return _plan(nodes, [vi("m", shape, B), vi("s", [2, 2, 6, 6])], [vi("p", [2, 2, 6, 6])],
                 [neg])


@pytest.mark.parametrize("true_means_masked", [True, False])
def test_square_bool_mask_is_causal_with_the_graphs_polarity(true_means_masked):
    p = _masked_where(true_means_masked, [6, 6])
    m = p.feeds["m"]
    keep = ~m if true_means_masked else m
    assert p.policy["m"].startswith("causal mask")
    assert np.array_equal(keep, np.tril(np.ones((6, 6), bool)))  # every row keeps >= 1
    assert m.any() and not m.all()


@pytest.mark.parametrize("true_means_masked", [True, False])
def test_other_bool_masks_are_padding_masks(true_means_masked):
    p = _masked_where(true_means_masked, [2, 1, 1, 6])
    m = p.feeds["m"]
    keep = ~m if true_means_masked else m
    assert p.policy["m"].startswith("padding mask")
    assert m.any() and not m.all()
    assert keep.reshape(2, 6).any(axis=1).all()  # no sequence is fully masked
    assert keep[..., 0].all()                     # position 0 is never padding


def test_integer_attention_mask_is_a_padding_mask():
    """HF style: attention_mask int64 [B, S] -> Cast -> (1 - m) * -1e9 -> added to scores."""
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    big = numpy_helper.from_array(np.array(-1e9, np.float32), "big")
    nodes = [helper.make_node("Cast", ["am"], ["amf"], to=F),
             helper.make_node("Sub", ["one", "amf"], ["inv"]),
             helper.make_node("Mul", ["inv", "big"], ["add"]),
             helper.make_node("Add", ["s", "add"], ["y"])]
    p = _plan(nodes, [vi("am", [4, 8], I64), vi("s", [4, 8])], [vi("y", [4, 8])],
              [one, big])
    m = p.feeds["am"]
    assert p.policy["am"] == "padding mask (True = keep)" and m.dtype == np.int64
    assert set(np.unique(m)) == {0, 1} and m[:, 0].all() and not m.all()


def test_ort_training_buffers_and_reset_flag_by_dataflow():
    nodes = [helper.make_node("Mul", ["x", "x"], ["g"]),
             helper.make_node("InPlaceAccumulatorV2", ["acc", "g", "flag"], ["done", "out"],
                              domain="com.microsoft")]
    p = _plan(nodes, [vi("x", [3]), vi("acc", [3]), vi("flag", [1], B)],
              [vi("done", [1], B)])
    assert p.policy["acc"] == "zeros (gradient buffer)" and not p.feeds["acc"].any()
    assert p.policy["flag"] == "True (flag)" and p.feeds["flag"].all()


def test_each_input_has_its_own_random_stream():
    """A generated value depends on (seed, name), not on the inputs' order or on which other
    inputs a --feeds file gave."""
    nodes = [helper.make_node("Sub", ["a", "b"], ["y"])]
    ins, outs = [vi("a", [4, 4]), vi("b", [4, 4])], [vi("y", [4, 4])]
    p1 = _plan(nodes, ins, outs)
    p2 = _plan(nodes, ins[::-1], outs)
    p3 = _plan(nodes, ins, outs, given={"a": np.ones((4, 4), np.float32)})
    assert p1.policy["b"] == "N(0,1)" and p1.feeds["b"].any()
    assert np.array_equal(p1.feeds["b"], p2.feeds["b"]) and np.array_equal(p1.feeds["b"],
                                                                            p3.feeds["b"])
    assert p3.policy["a"] == "file" and p3.feeds["a"].sum() == 16
    p4 = _plan(nodes, ins, outs, seed=1)
    assert not np.array_equal(p1.feeds["b"], p4.feeds["b"])


def test_shipped_samples_keep_their_parameter_files():
    entry = load_manifest()["torch_block"]
    import onnx

    p = plan_feeds(onnx.load(SAMPLES / "torch_block.onnx"), entry)
    with np.load(SAMPLES / "torch_block.params.npz") as z:
        for k in z.files:
            assert p.policy[k] == "params file"
            assert np.array_equal(p.feeds[k], z[k])
    assert p.policy["input"] == "N(0,1)"


# --- --feeds FILE.npz ----------------------------------------------------------------------

def _sym_model():
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("Add", ["e", "x"], ["y"])]
    return model(nodes, [vi("table", [10, 4]), vi("ids", ["batch", "seq"], I64),
                         vi("x", ["batch", "seq", 4])], [vi("y", ["batch", "seq", 4])])


def test_feeds_file_fixes_symbolic_dims_for_the_generated_inputs(tmp_path):
    m = _sym_model()
    np.savez(tmp_path / "f.npz", ids=np.zeros((3, 5), np.int64))
    given = read_feeds_file(tmp_path / "f.npz", m)
    p = plan_feeds(m, given=given)
    assert p.feeds["x"].shape == (3, 5, 4)
    assert p.policy == {"table": "N(0,1)", "ids": "file", "x": "N(0,1)"}


@pytest.mark.parametrize("arrays,message", [
    ({"nope": np.zeros(3, np.float32)}, "'nope' is not an input of the model"),
    ({"ids": np.zeros((3, 5), np.int32)}, "'ids' is int32, the graph wants int64"),
    ({"table": np.zeros((11, 4), np.float32)}, "'table' has shape [11, 4], the graph wants [10, 4]"),
    ({"x": np.zeros((3, 5), np.float32)}, "the graph wants ['batch', 'seq', 4] (rank 3)"),
    ({"ids": np.zeros((3, 5), np.int64), "x": np.zeros((3, 6, 4), np.float32)},
     "dimension 'seq' is 5 in 'ids' but 6 in 'x'"),
])
def test_feeds_file_errors_name_the_problem(tmp_path, arrays, message):
    np.savez(tmp_path / "f.npz", **arrays)
    with pytest.raises(FuseError) as exc:
        read_feeds_file(tmp_path / "f.npz", _sym_model())
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_feeds_file_that_is_no_npz(tmp_path):
    (tmp_path / "f.npz").write_text("hello")
    with pytest.raises(FuseError, match="not a NumPy .npz archive"):
        read_feeds_file(tmp_path / "f.npz", _sym_model())
    with pytest.raises(FuseError, match="no such file"):
        read_feeds_file(tmp_path / "missing.npz", _sym_model())


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_cli_bad_feeds_is_one_line_exit_2(tmp_path, command):
    src = SAMPLES / "torch_mlp.onnx"
    np.savez(tmp_path / "f.npz", input=np.zeros((2, 3), np.float32))
    proc = run_cli(command, src, src, "--feeds", tmp_path / "f.npz", check_rc=2)
    assert proc.stderr.startswith("fusecli: error: --feeds ")
    assert "'input' has shape [2, 3], the graph wants [2, 16]" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_verify_and_bench_report_the_feed_policy(tmp_path):
    src = tmp_path / "block.onnx"  # not a shipped sample: every feed is generated
    src.write_bytes((SAMPLES / "torch_block.onnx").read_bytes())
    report = json.loads(run_cli("verify", src, src, "--json").stdout)
    assert report["feeds"]["mask"] == "causal mask (True = masked)"
    assert report["feeds"]["q.weight"] == "fan-in uniform U(+-1/sqrt(fan_in))"
    assert report["feeds"]["ln1.weight"] == "ones (norm scale)"
    text = run_cli("verify", src, src).stdout
    assert "feeds: " in text and "causal mask (True = masked): mask" in text
    np.savez(tmp_path / "f.npz", input=np.ones((2, 8, 32), np.float32))
    bench = json.loads(run_cli("bench", src, src, "--runs", 2, "--warmup", 0,
                               "--feeds", tmp_path / "f.npz", "--json").stdout)
    assert bench["feeds"]["input"] == "file" and bench["feeds"]["mask"].startswith("causal")
    text = run_cli("bench", src, src, "--runs", 2, "--warmup", 0).stdout
    assert "feeds: " in text and "causal mask" in text


# --- symbolic dims that agree with each other (issue 21) ----------------------------------------

def _flattened_target_model(target_dims, concat="Concat"):
    """y = Reshape(x [batch, seq, 4], [-1, 4]) (a flattened token dim), loss = (y - t)^2 with
    the target t of symbolic dims ``target_dims`` (what an exporter names the output's dims);
    ``concat``: the op that builds the Reshape target from x's Shape (onnxruntime-training
    writes ConcatTraining)."""
    from builders import const

    nodes = [
        helper.make_node("Shape", ["x"], ["sh"], end=1),
        helper.make_node("Mul", ["sh", "seq_c"], ["rows"]),   # not used by Reshape: a decoy
        helper.make_node(concat, ["minus1", "four"], ["tgt"] + (["lens"] if concat !=
                                                                "Concat" else []),
                         axis=0, **({"domain": "com.microsoft"} if concat != "Concat" else {})),
        helper.make_node("Reshape", ["x", "tgt"], ["y"]),
        helper.make_node("Sub", ["y", "t"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]
    inits = [const("minus1", [-1], np.int64), const("four", [4], np.int64),
             const("seq_c", [1], np.int64)]
    return model(nodes, [vi("x", ["batch", "seq", 4]), vi("t", target_dims)],
                 [vi("loss", [])], inits)


@pytest.mark.parametrize("concat", ["Concat", "ConcatTraining"])
def test_a_flattened_token_dim_gets_batch_times_sequence(concat):
    from fusecli.runtime.feeds import solve_dims

    m = _flattened_target_model(["Reshapeoutput_dim_0", "Reshapeoutput_dim_1"], concat)
    assert solve_dims(m) == {"batch": (2, "name"), "seq": (8, "name"),
                             "Reshapeoutput_dim_0": (16, "from the graph"),
                             "Reshapeoutput_dim_1": (4, "from the graph")}
    p = plan_feeds(m, dims={"batch": 3, "seq": 5})
    assert p.feeds["x"].shape == (3, 5, 4) and p.feeds["t"].shape == (15, 4)
    assert p.lines()[0] == ("symbolic dims batch=3 (--dim), seq=5 (--dim), "
                            "Reshapeoutput_dim_0=15 (from the graph), "
                            "Reshapeoutput_dim_1=4 (from the graph)")


def test_a_dim_written_as_an_expression_is_evaluated():
    from fusecli.runtime.feeds import solve_dims

    m = _flattened_target_model(["batch*seq", 4])
    assert solve_dims(m, {"seq": 3})["batch*seq"] == (6, "expression")


def test_a_dim_nothing_tells_is_guessed_and_named_in_the_hint():
    from fusecli.runtime.feeds import guessed_dims, solve_dims

    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    m = model(nodes, [vi("x", ["unk__1", 4])], [vi("y", ["unk__1", 4])])
    assert solve_dims(m) == {"unk__1": (2, "guessed")}
    assert guessed_dims(m) == ["unk__1"]


def test_a_sliced_token_type_buffer_indexing_a_one_row_table_gets_zeros():
    # BERT's token_type_ids buffer [1, max_positions], sliced to the sequence, expanded to the
    # batch, indexes token_type_embeddings [type_vocab_size = 1, H]
    from builders import const

    nodes = [helper.make_node("Slice", ["buf", "zero", "seq_len", "one"], ["s"]),
             helper.make_node("Expand", ["s", "bs"], ["e"]),
             helper.make_node("Gather", ["table", "e"], ["emb"])]
    inits = [const("zero", [0], np.int64), const("seq_len", [8], np.int64),
             const("one", [1], np.int64), const("bs", [2, 8], np.int64)]
    p = _plan(nodes, [vi("buf", [1, 16], I64), vi("table", [1, 8])], [vi("emb", [2, 8, 8])],
              inits)
    assert p.policy["buf"] == "token ids in [0, 1)"
    assert not p.feeds["buf"].any()


def test_verify_sizes_a_real_exports_flattened_token_dim_without_dim(tmp_path):
    """tests/data/ortt_bert_tokens_symbolic.onnx (scripts/corpus/archs.py bert_tokens_symbolic,
    `gen.py --out DIR ort-training bert_tokens_symbolic`): BertModel exported with symbolic
    batch and sequence, its output flattened to [batch * sequence, 32], so the MSE target is
    [Reshapeoutput_dim_0, Reshapeoutput_dim_1], fresh symbols of the exporter. Before, both
    were fed as 2 and the original did not run; the feeds now read 2 x 8 = 16 and 32 off the
    graph, verify runs without --dim and says so."""
    from pathlib import Path

    src = Path(__file__).resolve().parent / "data" / "ortt_bert_tokens_symbolic.onnx"
    out = tmp_path / "fused.onnx"
    run_cli("optimize", src, "-o", out)
    proc = run_cli("verify", src, out, timeout=300)
    assert ("symbolic dims batch=2 (name), sequence=8 (name), Reshapeoutput_dim_0=16 (from the "
            "graph), Reshapeoutput_dim_1=32 (from the graph)") in proc.stdout
    assert "PASS" in proc.stdout


# An LM head's logits [2, 8, V] = h @ w^T, shifted to [2, 7, V] and flattened to [14, V] by a
# shape computed at run time, [-1, Shape(logits)[-1]], as exporters write it, so that shape
# inference leaves the flat logits' shape unknown
_FLAT_LM_HEAD = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
                 helper.make_node("MatMul", ["h", "wt"], ["logits"]),
                 helper.make_node("Slice", ["logits", "st", "en", "ax"], ["shifted"]),
                 helper.make_node("Shape", ["shifted"], ["sh"]),
                 helper.make_node("Slice", ["sh", "m1", "big"], ["last0"]),
                 helper.make_node("Div", ["last0", "one"], ["last"]),  # beyond data propagation
                 helper.make_node("Concat", ["m1", "last"], ["flat"], axis=0),
                 helper.make_node("Reshape", ["shifted", "flat"], ["flat_logits"])]


def _flat_lm_head_consts():
    return [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
            (("m1", [-1]), ("one", [1]), ("big", [100]), ("st", [0]), ("en", [7]), ("ax", [1]))]


@pytest.mark.parametrize("vocab", [5, 3, 11])
def test_lm_head_labels_stay_within_the_vocabulary_not_the_sequence(vocab):
    """An LM head's logits [B, S, V] (no shapes recorded between) flattened to [B*S, V] for the
    loss: labels in [0, V), whatever S and B are (issue 33: S was taken for the class count)."""
    nodes = _FLAT_LM_HEAD + [
        helper.make_node("SoftmaxCrossEntropyLoss", ["flat_logits", "lab"], ["loss"])]
    consts = _flat_lm_head_consts()
    m = model(nodes, [vi("h", [2, 8, 4]), vi("w", [vocab, 4]), vi("lab", [14], I64)],
              [vi("loss", [])], consts)
    # the exporter recorded the 3-D logits' shapes, not the flat ones' (symbolic)
    m.graph.value_info.extend([vi("logits", [2, 8, vocab]), vi("shifted", [2, 7, vocab]),
                               vi("flat_logits", ["n", "v"])])
    p = plan_feeds(m)
    assert p.policy["lab"] == f"labels in [0, {vocab})"
    assert p.feeds["lab"].max() == vocab - 1


@pytest.mark.parametrize("vocab", [5, 3, 11])
def test_torch_joint_lm_head_labels_stay_within_the_vocabulary(vocab):
    """torch-joint's spelling of the same LM head + loss (rules/lce_torch.yaml): the labels
    reach GatherElements(LogSoftmax(flat logits), axis 1) through Where(label != -100, label,
    0) and an Unsqueeze, and are compared with -100 first: labels in [0, V) along the flat
    logits' last axis (V, never S = 7 or B = 2), not the 0/1 padding mask an integer compared
    with a constant otherwise gets."""
    nodes = _FLAT_LM_HEAD + [
        helper.make_node("LogSoftmax", ["flat_logits"], ["lp"], axis=1),
        helper.make_node("Equal", ["lab", "ign"], ["eq"]),
        helper.make_node("Not", ["eq"], ["ne"]),
        helper.make_node("Where", ["ne", "lab", "zero"], ["idx0"]),
        helper.make_node("Unsqueeze", ["idx0", "one"], ["idx"]),
        helper.make_node("GatherElements", ["lp", "idx"], ["g"], axis=1),
        helper.make_node("ReduceSum", ["g"], ["loss"], keepdims=0)]
    consts = _flat_lm_head_consts() + [
              numpy_helper.from_array(np.array(-100, np.int64), "ign"),
              numpy_helper.from_array(np.array(0, np.int64), "zero")]
    m = model(nodes, [vi("h", [2, 8, 4]), vi("w", [vocab, 4]), vi("lab", [14], I64)],
              [vi("loss", [])], consts)
    m.graph.value_info.extend([vi("logits", [2, 8, vocab]), vi("shifted", [2, 7, vocab]),
                               vi("flat_logits", ["n", "v"]), vi("lp", ["n", "v"])])
    p = plan_feeds(m)
    assert p.policy["lab"] == f"labels in [0, {vocab})"
    assert p.feeds["lab"].min() >= 0 and p.feeds["lab"].max() == vocab - 1
