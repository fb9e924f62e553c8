# Shared by scripts/flash/budget.sh and scripts/flash/budget_measured.sh (sourced, from the
# repository root): the settings both read from the environment, and the 12-layer decoders
# they measure, exported once into build/budget/L$LAYERS.
OUT=build/budget
RUNS=${RUNS:-3}
THREADS=${THREADS:-2}
LAYERS=${LAYERS:-12}
SEQ=${SEQ:-1024}
ARCHS=${ARCHS:-llama gpt2}
FAMILIES=${FAMILIES:-ortt torch}
FUSECLI=${FUSECLI:-.venv/bin/fusecli}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT/L$LAYERS"

# decoder FAMILY ARCH: sets m (the model's path without .onnx), exporting it when missing
decoder() {
  local d="$OUT/L$LAYERS"
  m="$d/${1}_${2}_long_S$SEQ"
  [[ -f $m.onnx ]] || "build/venv-corpus-$1/bin/python" scripts/flash/export_long_decoder.py \
    --family "$1" --arch "$2" --seq "$SEQ" --layers "$LAYERS" --out "$d" >"$m.export.log" 2>&1
}
