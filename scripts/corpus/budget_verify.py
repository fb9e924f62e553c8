"""Recompute as much as the memory budget can on every graph of a folder, and verify it.

For each DIR/NAME.onnx: fuse it (every shipped rule), apply the lowest budget recomputation
reaches (`apply_budget(model, 1, strict=False)`: every group the pass would ever take), write
build/budgeted/DIRNAME/NAME.onnx, and run `fusecli verify` of the ORIGINAL against it, fed from
DIR/NAME.params.npz where it exists (the sweep's and the corpus's parameters). Prints one line
per graph: the estimated saved activations before and at the minimum, what was recomputed (how
many norms were rebuilt from their statistics), and verify's verdict. Exit 1 when a verify
fails. Runs under .venv: `python scripts/corpus/budget_verify.py DIR [NAME ...]`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import onnx

from fusecli import api
from fusecli.engine.recompute import apply_budget
from fusecli.errors import FuseError
from fusecli.runtime.verify import verify_models


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    names = set(argv[1:])
    out = Path(__file__).resolve().parents[2] / "build" / "budgeted" / folder.resolve().name
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for path in sorted(folder.glob("*.onnx")):
        if names and path.stem not in names:
            continue
        model = api.optimize(path).model
        try:
            rep = apply_budget(model, 1, strict=False)
        except FuseError as exc:
            print(f"{path.stem}: not budgeted: {exc}")
            continue
        onnx.save(model, out / path.name)
        params = folder / f"{path.stem}.params.npz"
        v = verify_models(path, out / path.name, feeds_file=params if params.exists() else None)
        failed += not v.ok
        stats = sum(k for w, k in rep.recomputed.items() if "statistics" in w)
        low = rep.minimum if rep.minimum is not None else rep.after
        print(f"{path.stem}: saved activations {rep.before} -> {low} bytes "
              f"({low / max(rep.before, 1):.2f}x), {sum(rep.recomputed.values())} recomputed "
              f"({stats} norms from their statistics); verify {'PASS' if v.ok else 'FAIL'}, "
              f"max relative error {v.max_rel:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
