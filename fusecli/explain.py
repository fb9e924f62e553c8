"""Why did a rule not fuse? The deepest partial match and the exact failing constraint."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import onnx

from .fusion import FusionPass


def explain_model(model: onnx.ModelProto, fp: FusionPass, node_names: Iterable[str] = (),
                  include_shallow: bool = False) -> list[dict]:
    """Run ``fp`` on a copy of ``model`` in explain mode and return its near misses.

    A near miss is an attempt that bound at least one rule node (or, with
    ``include_shallow``, any attempt whose anchor had the right op type) and did not fuse.
    ``node_names`` keeps only attempts whose anchor or bound nodes include one of them.
    """
    fp.explain = True
    fp.run(copy.deepcopy(model))
    wanted = set(node_names)
    out = []
    for skip in fp.misses.values():
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
