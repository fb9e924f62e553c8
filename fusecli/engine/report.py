"""Human-readable tables for the CLI (machine-readable output is the stats dict as JSON)."""

from __future__ import annotations

import onnx

from fusecli.ops.contracts import FUSED_DOMAIN
from fusecli.engine.fusion import rule_of


def _fmt_skipped(skipped: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) or "-"


def _bytes(b: int | str | None) -> str:
    """A size of saved.size_json: bytes (with MiB from 1 MiB), a polynomial in the symbolic
    dimensions, or unknown."""
    if b is None:
        return "unknown size"
    if isinstance(b, str):
        return f"{b} bytes"
    return f"{b} bytes" + (f", {b / 2**20:.1f} MiB" if abs(b) >= 2**20 else "")


def stats_table(d: dict, title: str) -> str:
    rows = [("pattern", "detected", "fused", "skipped")]
    for name, p in d["patterns"].items():
        rows.append((name, str(p["detected"]), str(p["fused"]), _fmt_skipped(p["skipped"])))
    w0 = max(len(r[0]) for r in rows)
    lines = [title]
    for i, r in enumerate(rows):
        lines.append(f"  {r[0]:<{w0}}  {r[1]:>8}  {r[2]:>5}  {r[3]}")
        if i == 0:
            lines.append("  " + "-" * (w0 + 30))
    b = d["bytes_eliminated"]
    lines.append(f"  total fused: {d['total_fused']}   nodes: {d['nodes_before']} -> "
                 f"{d['nodes_after']}   intermediate tensors no longer written: "
                 f"{d['buffers_eliminated']} ({_bytes(b)}; not a memory figure)")
    sa = d.get("saved_activations")
    if sa is not None:
        def part(k: str) -> str:
            u = sa.get(f"{k}_unsized")
            return _bytes(sa[f"{k}_bytes"]) + (f"; {u} of unknown size" if u else "")

        lines.append(f"  saved activations (forward tensors the backward reads): removed "
                     f"{sa['removed']} ({part('removed')}), added {sa['added']} "
                     f"({part('added')}), net {_bytes(sa['net_bytes_removed'])} less")
    tied = d.get("tied_gradients_folded")
    if tied:
        lines.append(f"  tied heads: the embedding's gradient scattered into the fused head's "
                     f"dW (one [V, D] table, not three): {', '.join(tied)}")
    planned = d.get("embedding_gradients_planned")
    if planned:
        lines.append(f"  embedding gradients: scattered into a statically shaped table, planned "
                     f"with the step's buffers: {', '.join(planned)}")
    return "\n".join(lines)


def fused_inventory(model: onnx.ModelProto) -> dict:
    """Fused ops already present in a model: op type -> count, and rule -> count."""
    ops: dict[str, int] = {}
    rules: dict[str, int] = {}
    for n in model.graph.node:
        if n.domain != FUSED_DOMAIN:
            continue
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
        r = rule_of(n)
        if r is not None:
            rules[r] = rules.get(r, 0) + 1
    return {"fused_ops": ops, "by_rule": rules}


def inventory_table(inv: dict, title: str) -> str:
    lines = [title]
    for op, n in sorted(inv["fused_ops"].items()):
        lines.append(f"  {op:<24} {n:>4}")
    if inv["by_rule"]:
        lines.append("  by rule: " + ", ".join(f"{r}={n}" for r, n in sorted(inv["by_rule"].items())))
    return "\n".join(lines)
