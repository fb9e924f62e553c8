"""Why did a rule not fuse? The deepest partial match and the exact failing constraint.

Explaining is not part of the fusion pass: the model (a copy) is first fused as ``optimize``
would fuse it with every rule up to the explained ones in application order, so that earlier
stages (e.g. the activation-gradient rules before the Linear rules that match on their fused
op) have applied; then each explained rule is tried at every node of its anchor's op type, in
any domain, and every attempt that does not fuse reports its deepest failure.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import onnx

from fusecli.engine.fusion import FusionPass, Skip
from fusecli.engine.graph import GraphIndex
from fusecli.engine.matcher import Matcher


def _misses(model: onnx.ModelProto, fp: FusionPass,
            staged: onnx.ModelProto | None = None) -> list[Skip]:
    if not fp.rules:
        return []
    if staged is not None:
        fused = staged
    else:
        last = max((r.order, r.name) for r in fp.rules)
        stages = FusionPass(rules=[r for r in fp.all_rules if (r.order, r.name) <= last],
                            kernels=fp.kernels, provider=fp.provider)
        fused = copy.deepcopy(model)
        stages.run(fused)
    index = GraphIndex(fused.graph, fused.opset_import)
    index.bypass_passthrough()
    index.axes_attributes_as_inputs()
    out = []
    for rule in fp.rules:
        matcher = Matcher(index, rule)
        anchors = [n for op in rule.anchor.ops for d in index.domains()
                   for n in index.candidates(op, d)]
        for anchor in sorted(anchors, key=lambda n: n.key):
            res = matcher.match_at(anchor)
            fp.check_kernel(res, index)
            failure = res.guard_failure or res.deepest
            if res.match is None and failure is not None:
                out.append(Skip(rule.name, rule.pattern, anchor.name, failure,
                                res.node_failures))
    return out


def explain_model(model: onnx.ModelProto, fp: FusionPass, node_names: Iterable[str] = (),
                  include_shallow: bool = False,
                  staged: onnx.ModelProto | None = None) -> list[dict]:
    """The near misses of ``fp``'s rules on ``model`` (which is not modified).

    ``staged``: ``model`` already fused with every rule of ``fp.all_rules`` up to the last of
    ``fp.rules`` (e.g. an optimize result with all rules), which saves fusing a copy again.

    A near miss is an attempt that bound at least one rule node (or, with
    ``include_shallow``, any attempt whose anchor had the right op type) and did not fuse.
    ``node_names`` keeps only attempts whose anchor or bound nodes include one of them.
    """
    wanted = set(node_names)
    out = []
    for skip in _misses(model, fp, staged):
        f = skip.failure
        if wanted:
            # the attempt's own failure when it involves a wanted node, else the reason a
            # wanted node did not fit any rule node in this attempt
            if not wanted & {skip.anchor, *f.bound.values(), f.candidate}:
                hit = [skip.node_failures[n] for n in sorted(wanted) if n in skip.node_failures]
                if not hit:
                    continue
                f = hit[0]
        if not include_shallow and f.depth == 0:
            continue
        out.append({"rule": skip.rule, "pattern": skip.pattern, "anchor": skip.anchor,
                    **f.as_dict()})
    out.sort(key=lambda d: (-d["depth"], d["rule"], d["anchor"]))
    return out
