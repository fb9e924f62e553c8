#!/usr/bin/env bash
# Issue 22's memory table: long-sequence decoders WITH their LM head and cross-entropy loss, in
# both graph families (ort-training, torch-joint), original vs fused with every shipped pattern
# (flash attention and the fused linear + cross-entropy are the memory fusions; the script fuses
# with whatever rules exist), peak step memory (fusecli bench: VmHWM above the
# loaded session in fresh processes, arena off) and step time (medians of interleaved runs),
# side by side in one run per row. Writes build/flash-mem/memory.md (a markdown table) and
# prints it.
# Usage: scripts/flash/memory.sh [SEQ ...]   (default 1024 2048)
#   ARCHS="llama gpt2" FAMILIES="ortt torch" RUNS=3 THREADS=2 scripts/flash/memory.sh 2048
# Needs build/venv-corpus-ortt and build/venv-corpus-torch (the corpus generator venvs of
# scripts/corpus/make_corpus.sh) and .venv with the custom-op library (make venv lib).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=build/flash-mem
RUNS=${RUNS:-3}
THREADS=${THREADS:-2}
ARCHS=${ARCHS:-llama gpt2}
FAMILIES=${FAMILIES:-ortt torch}
SEQS=${*:-1024 2048}
mkdir -p "$OUT"
TABLE=$OUT/memory.md
{
  echo "| family | model | S | vocab | original MiB | fused MiB | fused / original | original ms | fused ms | speed-up | fused patterns | saved activations, net removed (optimize) | command |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"
} > "$TABLE"
for fam in $FAMILIES; do
  gen=build/venv-corpus-$fam/bin/python
  for arch in $ARCHS; do
    for s in $SEQS; do
      m="$OUT/${fam}_${arch}_long_S$s"
      cmd="scripts/flash/export_long_decoder.py --family $fam --arch $arch --seq $s --out $OUT"
      [[ -f $m.onnx ]] || "$gen" $cmd >"$m.export.log" 2>&1
      .venv/bin/fusecli optimize "$m.onnx" -o "$m.fused.onnx" --json -q > "$m.optimize.json"
      .venv/bin/fusecli bench "$m.onnx" "$m.fused.onnx" --runs "$RUNS" --warmup 1 \
        --threads "$THREADS" --feeds "$m.params.npz" --json > "$m.bench.json"
      .venv/bin/python - "$m" "$fam" "$arch" "$s" >> "$TABLE" <<'PY'
import json, sys
m, fam, arch, s = sys.argv[1:]
o = json.load(open(m + ".optimize.json"))
b = json.load(open(m + ".bench.json"))
vocab = {"llama": 32000, "gpt2": 50257}[arch]
name = {"llama": "Llama-style (512 wide, 8 heads / 2 KV, 2 layers)",
        "gpt2": "GPT-2-style (384 wide, 6 heads, 2 layers, tied head)"}[arch]
po, pf = b["original"]["peak_bytes"] / 2**20, b["fused"]["peak_bytes"] / 2**20
to, tf = b["original"]["median_ms"], b["fused"]["median_ms"]
pats = ", ".join(f"{k} {v['fused']}" for k, v in o["patterns"].items() if v["fused"])
sa = o["saved_activations"]["net_bytes_removed"]
sa = f"{sa / 2**20:.1f} MiB" if isinstance(sa, int) else str(sa)
family = {"ortt": "ort-training", "torch": "torch-joint"}[fam]
print(f"| {family} | {name} | {s} | {vocab} | {po:.1f} | {pf:.1f} | {pf / po:.3f}x | {to:.0f} | "
      f"{tf:.0f} | {to / tf:.2f}x | {pats} | {sa} | `ARCHS={arch} FAMILIES={fam} "
      f"scripts/flash/memory.sh {s}` |")
PY
      tail -1 "$TABLE"
    done
  done
done
cat "$TABLE"
