#!/usr/bin/env bash
# Fused linear + cross-entropy's memory figure (issue 22): a long-sequence Llama ort-training
# step with its LM head (vocabulary 32,000) and cross-entropy loss, original vs flash attention
# alone (--skip linear_cross_entropy) vs both fusions, peak step memory (fusecli bench: VmHWM
# in fresh processes, arena off) and step time, side by side in one run each.
# Usage: scripts/lce/memory.sh [SEQ ...]   (default 2048; needs build/venv-corpus-ortt and .venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=build/lce-mem
GEN=${GEN_PY:-build/venv-corpus-ortt/bin/python}
RUNS=${RUNS:-3}
mkdir -p "$OUT"
for s in ${@:-2048}; do
  m="$OUT/ortt_llama_lm_S$s"
  [[ -f $m.onnx ]] || "$GEN" scripts/flash/export_long_decoder.py --seq "$s" --lm-head --out "$OUT" 2>"$OUT/export-$s.log"
  .venv/bin/fusecli optimize "$m.onnx" -o "$m.fused.onnx" >/dev/null
  .venv/bin/fusecli optimize "$m.onnx" -o "$m.flash.onnx" --skip linear_cross_entropy >/dev/null
  echo "== S=$s: original vs flash + linear_cross_entropy"
  .venv/bin/fusecli bench "$m.onnx" "$m.fused.onnx" --runs "$RUNS" --warmup 1 | tail -5
  echo "== S=$s: flash alone vs flash + linear_cross_entropy"
  .venv/bin/fusecli bench "$m.flash.onnx" "$m.fused.onnx" --runs "$RUNS" --warmup 1 | tail -5
done
