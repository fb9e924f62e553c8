#!/usr/bin/env python3
"""Train a budgeted decoder through onnxruntime.training.api next to its original (issue 36:
"trains through onnxruntime-training's API with the original's losses").

usage: .venv/bin/python scripts/flash/budget_train.py ORIGINAL.onnx MODEL.onnx [MODEL.onnx ...]
           --artifacts DIR [--steps 3] [--lr 1e-3] [--threads 2]

ORIGINAL and every MODEL (fused, budgeted: `fusecli optimize ORIGINAL -o MODEL [--max-memory
...]`) train from the same checkpoint (DIR/checkpoint, and DIR/optimizer_model.onnx: AdamW, from
`scripts/flash/export_long_decoder.py --family ortt --artifacts`) on the same batch (random token
ids and labels of the graph's static shape, seed 0), with fusecli's library in the
SessionOptions, in .venv-ortt (tests/ortt_train.py's set-up). Prints, per model, the losses of
each step, the largest difference from the original's losses and parameters after the last
step (relative to the largest parameter), and the median step time. Exit 1 when a model's
losses differ from the original's by more than 1e-4 relative.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

def main() -> int:
    import onnx

    from fusecli.runtime.library import library_path
    from fusecli.runtime.runner import pick_runtime
    import numpy as np

    from ortt_train import HEAD, TRAIN, run_ortt

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("original")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--artifacts", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    m = onnx.load(a.original, load_external_data=False)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    vocab = max(s[0] for s in shapes.values() if len(s) == 2)  # the embedding's rows
    rng = np.random.default_rng(0)
    batch = a.artifacts / "batch.npz"  # the Module's inputs, in its order
    np.savez(batch, input_ids=rng.integers(0, vocab, size=shapes["input_ids"]),
             labels=rng.integers(0, vocab, size=shapes["labels"]))
    cfg = {"dir": str(a.artifacts), "models": [str(Path(p).resolve()) for p in
                                               [a.original, *a.models]],
           "library": library_path(), "steps": a.steps, "lr": a.lr, "threads": a.threads,
           "batch": str(batch), "against_first": True}
    res = run_ortt(pick_runtime(m), HEAD + TRAIN, cfg)
    ref = next(iter(res.values()))["losses"]
    worst = 0.0
    for path, r in res.items():
        r["loss_rel"] = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], ref))
        worst = max(worst, r["loss_rel"])
        print(f"{Path(path).name}: losses {', '.join(f'{x:.6f}' for x in r['losses'])}; "
              f"vs the original: losses {r['loss_rel']:.2e}, parameters {r['param_rel']:.2e} "
              f"(relative); median step {r['median_step_s']:.2f} s")
    return 1 if worst > 1e-4 else 0


if __name__ == "__main__":
    sys.exit(main())
