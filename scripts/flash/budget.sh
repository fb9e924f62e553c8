#!/usr/bin/env bash
# Issue 36's budget sweep: 12-layer long-sequence decoders (LM head + cross-entropy loss, both
# families), the fused step without a budget against the fused step with `--max-memory` at
# 0.5x and 0.25x of the fused step's estimated saved activations. Each graph: the original,
# the fused and the budgeted steps measured with `fusecli bench` (peak = VmHWM above the loaded
# session in fresh processes, arena off; times = medians of interleaved runs): original vs
# fused, then fused vs each budgeted step, in one run per row. Writes build/budget/sweep.md.
# Usage: scripts/flash/budget.sh [RATIO ...]   (default 0.5 0.25)
#   ARCHS="llama gpt2" FAMILIES="ortt torch" LAYERS=12 SEQ=1024 RUNS=3 THREADS=2 \
#     scripts/flash/budget.sh 0.5 0.25
# Needs build/venv-corpus-ortt and build/venv-corpus-torch (scripts/corpus/make_corpus.sh) and
# .venv with the custom-op library (make venv lib).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/flash/budget_env.sh
RATIOS=${*:-0.5 0.25}
TABLE=$OUT/sweep.md
{
  echo "| family | model | budget | budget MiB | estimated saved activations MiB | peak MiB | peak / fused | step ms | time / fused | recomputed nodes | extra work | command |"
  echo "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
} > "$TABLE"
for fam in $FAMILIES; do
  for arch in $ARCHS; do
    decoder "$fam" "$arch"
    "$FUSECLI" optimize "$m.onnx" -o "$m.fused.onnx" --json -q > "$m.optimize.json"
    est=$("$PY" -c "import sys, onnx; from fusecli.engine.recompute import apply_budget; \
print(apply_budget(onnx.load(sys.argv[1]), 10**15).before)" "$m.fused.onnx")
    "$FUSECLI" bench "$m.onnx" "$m.fused.onnx" --runs "$RUNS" --warmup 1 --threads "$THREADS" \
      --feeds "$m.params.npz" --json > "$m.bench.json"
    rows=("none:$m.bench.json:")
    for r in $RATIOS; do
      b=$("$PY" -c "import sys; print(int(float(sys.argv[1]) * int(sys.argv[2])))" "$r" "$est")
      out="$m.budget$r"
      if "$FUSECLI" optimize "$m.onnx" -o "$out.onnx" --max-memory "$b" --estimate-only --json -q \
          > "$out.optimize.json" 2> "$out.optimize.err"; then
        "$FUSECLI" bench "$m.fused.onnx" "$out.onnx" --runs "$RUNS" --warmup 1 \
          --threads "$THREADS" --feeds "$m.params.npz" --json > "$out.bench.json"
        rows+=("$r:$out.bench.json:$out.optimize.json")
      else
        rows+=("$r::$out.optimize.err")
      fi
    done
    "$PY" - "$m" "$fam" "$arch" "$est" "$LAYERS" "$SEQ" "${rows[@]}" >> "$TABLE" <<'PY'
import json, sys
m, fam, arch, est, layers, seq, *rows = sys.argv[1:]
est = int(est)
family = {"ortt": "ort-training", "torch": "torch-joint"}[fam]
name = {"llama": f"Llama-style, {layers} layers, S {seq}",
        "gpt2": f"GPT-2-style, {layers} layers, S {seq}, tied head"}[arch]
cmd = f"`ARCHS={arch} FAMILIES={fam} scripts/flash/budget.sh`"
base = json.load(open(m + ".bench.json"))
fpeak, fms = base["fused"]["peak_bytes"] / 2**20, base["fused"]["median_ms"]
opeak, oms = base["original"]["peak_bytes"] / 2**20, base["original"]["median_ms"]
print(f"| {family} | {name} | original | | | {opeak:.1f} | {opeak / fpeak:.2f}x | {oms:.0f} | "
      f"{oms / fms:.2f}x | | | {cmd} |")
print(f"| {family} | {name} | none (fused) | | {est / 2**20:.1f} | {fpeak:.1f} | 1.00x | "
      f"{fms:.0f} | 1.00x | | | {cmd} |")
for row in rows[1:]:
    r, bench, opt = row.split(":")
    budget = float(r) * est / 2**20
    if not bench:
        err = open(opt).read().strip().splitlines()[-1]
        print(f"| {family} | {name} | {r}x | {budget:.1f} | refused: {err} | | | | | | | {cmd} |")
        continue
    b = json.load(open(bench))
    mb = json.load(open(opt))["memory_budget"]
    # this run's own fused step is the reference of its ratios
    bp, bms = b["fused"]["peak_bytes"] / 2**20, b["fused"]["median_ms"]
    p, ms = b["original"]["peak_bytes"] / 2**20, b["original"]["median_ms"]
    pct = mb["extra_flops"] / mb["forward_flops"] if mb["forward_flops"] else 0
    print(f"| {family} | {name} | {r}x | {budget:.1f} | {mb['estimate_after_bytes'] / 2**20:.1f} | "
          f"{b['fused']['peak_bytes'] / 2**20:.1f} | {b['fused']['peak_bytes'] / b['original']['peak_bytes']:.2f}x | "
          f"{bms:.0f} | {bms / ms:.2f}x | {mb['recomputed_total']} | {pct:.0%} of the forward | {cmd} |")
PY
    tail -n $((2 + $(echo $RATIOS | wc -w))) "$TABLE"
  done
done
cat "$TABLE"
