"""The shape guard's check of FlashAttention / FlashAttentionGrad inputs (shapes.py) against the
kernels' own check (flash_inputs.cc): every shape it refuses, the CPU kernel refuses at run time,
and every shape it accepts runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from fusecli.ops.flash_attention.shapes import input_problem as fwd_problem
from fusecli.ops.flash_attention_grad.shapes import input_problem as bwd_problem
# (_built: the autouse fixture that fails clearly when the library is not built)
from kernel_helpers import DOMAIN, _built, ort_session  # noqa: F401

# case -> (Q, K, V, mask shapes, k_transposed, refused)
CASES = {
    "mha": ([2, 4, 5, 3], [2, 4, 5, 3], [2, 4, 5, 3], None, 0, False),
    "multi_query_kt": ([2, 4, 5, 3], [2, 1, 3, 5], [2, 1, 5, 3], None, 1, False),
    "grouped": ([2, 4, 5, 3], [2, 2, 5, 3], [2, 2, 5, 3], [2, 1, 5, 5], 0, False),
    "fewer_kv_dims": ([2, 4, 5, 3], [5, 3], [5, 3], None, 0, False),
    # K viewed with one more batch dim than Q (a 5-D group view against 4-D query heads)
    "k_more_dims": ([2, 4, 5, 3], [2, 2, 1, 5, 3], [2, 2, 1, 5, 3], None, 0, True),
    "not_a_divisor": ([2, 4, 5, 3], [2, 3, 5, 3], [2, 3, 5, 3], None, 0, True),
    "head_dim": ([2, 4, 5, 3], [2, 4, 5, 2], [2, 4, 5, 3], None, 0, True),
    "v_batch": ([2, 4, 5, 3], [2, 2, 5, 3], [2, 4, 5, 3], None, 0, True),
    "v_keys": ([2, 4, 5, 3], [2, 4, 5, 3], [2, 4, 6, 3], None, 0, True),
    "mask_shape": ([2, 4, 5, 3], [2, 4, 5, 3], [2, 4, 5, 3], [2, 1, 4, 5], 0, True),
}


def _run(q, k, v, mask, kt):
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in (("Q", q), ("K", k), ("V", v))}
    if mask is not None:
        feeds["mask"] = np.ones(mask, bool)
    node = helper.make_node("FlashAttention", ["Q", "K", "V", "", "mask" if mask else ""],
                            ["O", "LSE"], domain=DOMAIN, k_transposed=kt)
    ins = [helper.make_tensor_value_info(
        n, onnx.TensorProto.BOOL if a.dtype == bool else onnx.TensorProto.FLOAT, list(a.shape))
        for n, a in feeds.items()]
    outs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("O", "LSE")]
    model = helper.make_model(helper.make_graph([node], "flash", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid(DOMAIN, 1)], ir_version=9)
    ort_session(model).run(None, feeds)


@pytest.mark.parametrize("case", sorted(CASES))
def test_shape_check_agrees_with_the_kernel(case):
    q, k, v, mask, kt, refused = CASES[case]
    attrs = {"k_transposed": kt}
    why = fwd_problem(attrs, [q, k, v, None, mask])
    assert bool(why) == refused, why
    # the grad's ports: dO, Q, K, V, O, LSE, bias, mask
    assert bool(bwd_problem(attrs, [q, q, k, v, q, q[:-1], None, mask])) == refused
    if refused:
        with pytest.raises(Exception, match="FlashAttention"):
            _run(q, k, v, mask, kt)
    else:
        _run(q, k, v, mask, kt)


def test_unknown_dims_are_not_refused():
    assert fwd_problem({}, [["B", "H", None, 3], ["B", 1, None, 3], None, None, None]) is None
    assert fwd_problem({}, [None, [2, 1, 5, 3], None]) is None
