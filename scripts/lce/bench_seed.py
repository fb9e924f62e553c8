"""The language-model head + loss with the loss's incoming gradient computed at run time (issue
22 item 2): real onnxruntime-training artifacts of tests/test_lce.py's LM (Embedding -> Linear
+ ReLU -> head -> CrossEntropyLoss(ignore_index -100)) with the cross-entropy as it is (a
constant dLoss: one fused op), times a loss_scale input (_seed: one op reading grad_seed) and
times itself (_split: the loss op, then the gradient op, the logits recomputed), each fused by
`fusecli optimize` and timed against its original by `fusecli bench` (interleaved medians, peak
memory of fresh processes). Not a test: a measurement for BENCHMARKS.md.

  .venv/bin/python scripts/lce/bench_seed.py [--seq 2048] [--vocab 32000] [--emb 64]
      [--runs 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import ORTT_PYTHON  # noqa: E402
from test_lce import SCRIPT  # noqa: E402  (the artifacts step the training test uses)

CASES = {"constant": None, "seed_input": "input", "seed_from_loss": "loss"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--emb", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    print(f"| case ({a.seq} tokens, V {a.vocab}, D {a.emb}) | rule | original ms | fused ms "
          "| speed-up | original peak MiB | fused peak MiB |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as td:
        for case, seed in CASES.items():
            d = Path(td) / case
            d.mkdir()
            cfg = {"mode": "lm_artifacts", "dir": str(d), "seq": a.seq, "vocab": a.vocab,
                   "emb": a.emb, "lora": False, "seed": seed, "optim": "AdamW"}
            subprocess.run([str(ORTT_PYTHON), "-c", SCRIPT, json.dumps(cfg)], check=True,
                           capture_output=True)
            orig, fused = d / "training_model.onnx", d / "fused.onnx"
            rep = json.loads(subprocess.run(
                [sys.executable, "-m", "fusecli", "optimize", str(orig), "-o", str(fused),
                 "--json"], check=True, capture_output=True, text=True).stdout)
            rules = [r for r, v in rep["rules"].items()
                     if v["pattern"] == "linear_cross_entropy" and v["fused"]]
            res = json.loads(subprocess.run(
                [sys.executable, "-m", "fusecli", "bench", str(orig), str(fused), "--runs",
                 str(a.runs), "--warmup", "1", "--threads", str(a.threads), "--json"],
                check=True, capture_output=True, text=True).stdout)
            o, f = res["original"], res["fused"]
            print(f"| {case} | {', '.join(rules)} | {o['median_ms']:.1f} | {f['median_ms']:.1f} "
                  f"| {res['speedup']:.2f}x | {o['peak_bytes'] / 2**20:.1f} | "
                  f"{f['peak_bytes'] / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
