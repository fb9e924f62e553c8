"""Merge build/samples/*.json (written by gen_ortt.py / gen_torch.py) into samples/manifest.yaml.

Stdlib only (runs under plain python3); emits block-style YAML with flow-style input rows.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["ortt_mlp", "ortt_block", "ortt_block_sdpa", "ortt_block_mul", "ortt_cnn",
         "torch_mlp", "torch_block"]
KEY_ORDER = ["file", "family", "runtime", "description", "loss", "loss_output",
             "gradient_outputs", "params", "num_classes", "zero_grad_params", "patterns",
             "nodes", "ir_version", "max_abs_grad_err_vs_torch", "inputs"]

HEADER = """\
# fusecli sample training graphs. Regenerate with `make samples` (scripts/make_samples.sh).
#
# family:
#   ort-training: torch.onnx.export(training mode, opset 16) + onnxruntime.training
#     generate_artifacts(AdamW); this is training_model.onnx. runtime onnxruntime-training
#     (.venv-ortt, `make ortt-env`); stock onnxruntime cannot load it.
#   torch-joint: torch 2.13 aot_export_module(trace_joint=True) + torch.onnx.export(dynamo=True);
#     standard ONNX domains only; runtime onnxruntime (1.31.1). Outputs: loss, then
#     '<param>_grad' per parameter.
#
# Feeding (fusecli.runtime.feeds.make_feeds does all of this):
#   every graph input listed under `inputs` (initializers are not listed) with a role:
#     data / target      -> random normal (seeded); symbolic dims: batch=2 by default
#     labels             -> int64 uniform in [range[0], range[1])
#     parameter / frozen_parameter -> values from `params` (npz next to this file, keyed by
#                           input name); random only if no npz is given
#     grad_buffer        -> zeros of the parameter's shape; ort-training adds the gradient IN
#                           PLACE into this fed buffer (its `.accumulation.out` is a bool flag)
#     flag               -> lazy_reset_grad = bool[1] True
#   gradients: ort-training -> the fed '<param>_grad.accumulation.buffer' after the run
#     (runtime_worker.py saves them as 'fed/<name>'); torch-joint -> `gradient_outputs`.
#   zero_grad_params: parameters whose gradient is mathematically exactly zero (bias of the
#     attention key projection, conv bias before training-mode BN); all others are non-zero.
#   max_abs_grad_err_vs_torch: loss/gradients of this graph vs torch autograd at generation.
#
# patterns: counted from the model code (scripts/samples/models.py), not from the graph:
#   each Linear immediately followed by relu/gelu/silu = one linear_<act>; each attention = one
#   sdpa; each Conv->BN->ReLU = one conv_bn_relu (ReLU6 / SiLU / hardswish: conv_bn_<act>), each
#   Conv->BN without activation (a shortcut, the branch before a residual add) = one conv_bn;
#   each LayerNorm = one layernorm; each RMSNorm (with or without weight) = one rmsnorm.
"""

_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}


def scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if v is None:
        return "null"
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in _RESERVED:
        return s
    return json.dumps(s)


def flow(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{scalar(k)}: {flow(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(flow(x) for x in v) + "]"
    return scalar(v)


def entry_lines(e: dict, key_order: list[str]) -> list[str]:
    """One manifest entry as YAML lines under its name: a non-empty dict as a block of
    `key: flow value` lines, `inputs` as one flow row per line, anything else on one line."""
    lines = []
    for k in key_order + sorted(k for k in e if k not in key_order):
        if k not in e:
            continue
        v = e[k]
        if isinstance(v, dict) and v:
            lines.append(f"    {k}:")
            lines += [f"      {scalar(pk)}: {flow(pv)}" for pk, pv in v.items()]
        elif k == "inputs":
            lines.append("    inputs:")
            lines += [f"      - {flow(row)}" for row in v]
        elif isinstance(v, (list, dict)):
            lines.append(f"    {k}: {flow(v)}")
        else:
            lines.append(f"    {k}: {scalar(v)}")
    return lines


def main() -> int:
    frags = {p.stem: json.loads(p.read_text()) for p in (ROOT / "build/samples").glob("*.json")}
    names = [n for n in ORDER if n in frags] + sorted(n for n in frags if n not in ORDER)
    lines = [HEADER, "samples:"]
    for name in names:
        lines.append(f"  {name}:")
        lines += entry_lines(frags[name], KEY_ORDER)
    (ROOT / "samples/manifest.yaml").write_text("\n".join(lines) + "\n")
    print(f"samples/manifest.yaml: {len(names)} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
