#!/usr/bin/env bash
# FlashAttention's memory figure (issue 22): a long-sequence Llama ort-training step, original
# vs today's fusion (sdpa: AttentionGrad reading the saved P) vs flash (FlashAttention +
# FlashAttentionGrad, no P), peak step memory (fusecli bench: VmHWM in fresh processes, arena
# off) and step time, side by side in one run each.
# Usage: scripts/flash/memory.sh [SEQ ...]   (default 1024 2048; needs build/venv-corpus-ortt,
# the corpus generator venv of scripts/corpus/make_corpus.sh, and .venv with the library)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=build/flash-mem
GEN=${GEN_PY:-build/venv-corpus-ortt/bin/python}
RUNS=${RUNS:-5}
mkdir -p "$OUT"
for seq in "${@:-1024 2048}"; do
  for s in $seq; do
    m="$OUT/ortt_llama_long_S$s"
    [[ -f $m.onnx ]] || "$GEN" scripts/flash/export_long_decoder.py --seq "$s" --out "$OUT" 2>"$OUT/export-$s.log"
    .venv/bin/fusecli optimize "$m.onnx" -o "$m.fused.onnx" >/dev/null
    .venv/bin/fusecli optimize "$m.onnx" -o "$m.sdpa.onnx" --skip flash_attention >/dev/null
    echo "== S=$s: original vs flash"
    .venv/bin/fusecli bench "$m.onnx" "$m.fused.onnx" --runs "$RUNS" --warmup 1 | tail -4
    echo "== S=$s: sdpa (today's fusion) vs flash"
    .venv/bin/fusecli bench "$m.sdpa.onnx" "$m.fused.onnx" --runs "$RUNS" --warmup 1 | tail -4
  done
done
