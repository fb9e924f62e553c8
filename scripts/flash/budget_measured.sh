#!/usr/bin/env bash
# Issue 36's memory budget on the measured peak: 12-layer long-sequence decoders (LM head +
# cross-entropy loss, both families). Each graph: original vs fused (`fusecli bench`, peak =
# VmHWM above the loaded session in fresh processes, arena off; times = medians of interleaved
# runs), then `fusecli optimize ORIGINAL --max-memory BYTES --feeds PARAMS.npz` at each
# FRACTION of the fused step's benched peak (the budget fusecli must meet as it measures it),
# then fused vs the written step in one `fusecli bench` run (an independent measurement of the
# written step's peak and its time). Writes build/budget/measured.md.
# Usage: scripts/flash/budget_measured.sh [FRACTION ...]   (default 0.85 0.7)
#   ARCHS="llama gpt2" FAMILIES="ortt torch" LAYERS=12 SEQ=1024 RUNS=3 THREADS=2 \
#     scripts/flash/budget_measured.sh 0.85 0.7
# Needs the exports of scripts/flash/budget.sh (build/budget/L$LAYERS, made here when missing:
# build/venv-corpus-ortt and build/venv-corpus-torch) and .venv with the custom-op library.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/flash/budget_env.sh
FRACTIONS=${*:-0.85 0.7}
TABLE=$OUT/measured.md
{
  echo "| family | model | budget | budget MiB | fusecli's measurements (fused -> tries) MiB | written step: peak MiB (bench) | fused step in the same bench MiB | peak / fused | time / fused | recomputed nodes | result | command |"
  echo "|---|---|---|---:|---|---:|---:|---:|---:|---:|---|---|"
} > "$TABLE"
peak() { "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]]['peak_bytes'])" "$@"; }
for fam in $FAMILIES; do
  for arch in $ARCHS; do
    decoder "$fam" "$arch"
    "$FUSECLI" optimize "$m.onnx" -o "$m.fused.onnx" --json -q > "$m.optimize.json"
    "$FUSECLI" bench "$m.onnx" "$m.fused.onnx" --runs "$RUNS" --warmup 1 --threads "$THREADS" \
      --feeds "$m.params.npz" --json > "$m.bench.json"
    fused_peak=$(peak "$m.bench.json" fused)
    "$PY" - "$m" "$fam" "$arch" "$LAYERS" "$SEQ" >> "$TABLE" <<'PY'
import json, sys
m, fam, arch, layers, seq = sys.argv[1:]
b = json.load(open(m + ".bench.json"))
po, pf = b["original"]["peak_bytes"] / 2**20, b["fused"]["peak_bytes"] / 2**20
to, tf = b["original"]["median_ms"], b["fused"]["median_ms"]
family = {"ortt": "ort-training", "torch": "torch-joint"}[fam]
name = {"llama": "Llama-style", "gpt2": "GPT-2-style, tied head"}[arch]
print(f"| {family} | {name}, {layers} layers, S {seq} | none: original {po:.1f} MiB -> fused "
      f"(the fused step: {pf / po:.3f}x the original's memory, {to / tf:.2f}x its speed) | | | | "
      f"{pf:.1f} | 1.00x | 1.00x | | | `ARCHS={arch} FAMILIES={fam} "
      f"scripts/flash/budget_measured.sh` |")
PY
    for f in $FRACTIONS; do
      bytes=$("$PY" -c "import sys; print(int(float(sys.argv[1]) * int(sys.argv[2])))" "$f" "$fused_peak")
      b="$m.measured_$f"
      rc=0
      "$FUSECLI" optimize "$m.onnx" -o "$b.onnx" --max-memory "$bytes" --feeds "$m.params.npz" \
        --json > "$b.optimize.json" 2> "$b.optimize.log" || rc=$?
      if [[ $rc -eq 0 ]]; then
        "$FUSECLI" bench "$m.fused.onnx" "$b.onnx" --runs "$RUNS" --warmup 1 --threads "$THREADS" \
          --feeds "$m.params.npz" --json > "$b.bench.json"
      fi
      "$PY" - "$b" "$fam" "$arch" "$LAYERS" "$SEQ" "$f" "$bytes" "$rc" >> "$TABLE" <<'PY'
import json, re, sys
b, fam, arch, layers, seq, f, nbytes, rc = sys.argv[1:]
family = {"ortt": "ort-training", "torch": "torch-joint"}[fam]
name = {"llama": "Llama-style", "gpt2": "GPT-2-style, tied head"}[arch]
log = open(b + ".optimize.log").read()
tries = re.findall(r"try \d+: .*measured peak ([0-9.]+) MiB", log)
first = re.search(r"fused step's measured peak is ([0-9.]+) MiB", log)
seen = (first.group(1) + " -> " if first else "") + ", ".join(tries)
cmd = f"`ARCHS={arch} FAMILIES={fam} scripts/flash/budget_measured.sh {f}`"
head = f"| {family} | {name}, {layers} layers, S {seq} | {f}x | {int(nbytes) / 2**20:.1f} | {seen} |"
if rc != "0":
    why = log.strip().splitlines()[-1] if log.strip() else f"exit {rc}"
    print(f"{head} | | | | | | refused, exit {rc}: {why} | {cmd} |")
else:
    bench = json.load(open(b + ".bench.json"))
    o = json.load(open(b + ".optimize.json"))
    pf, pb = bench["original"]["peak_bytes"] / 2**20, bench["fused"]["peak_bytes"] / 2**20
    tf, tb = bench["original"]["median_ms"], bench["fused"]["median_ms"]
    n = o["memory_budget"]["recomputed_total"]
    met = "met" if pb * 2**20 <= int(nbytes) else "over when benched again"
    print(f"{head} {pb:.1f} | {pf:.1f} | {pb / pf:.2f}x | {tb / tf:.2f}x | {n} | {met} | {cmd} |")
PY
      tail -1 "$TABLE"
    done
  done
done
cat "$TABLE"
