#!/usr/bin/env bash
# Regenerate corpus/*.onnx, corpus/*.params.npz, corpus/manifest.yaml and the docs/corpus.md coverage
# table (`make corpus`; not part of `make test`). Two generator venvs under build/, pinned by
# scripts/corpus/requirements-{ortt,torch}.txt (they conflict: onnxruntime-training-cpu vs
# onnxruntime). Then scripts/corpus/finish.py runs under .venv (fusecli) to measure known_gaps.
# Usage: scripts/corpus/make_corpus.sh [ARCH ...]   (default: every architecture, both families)
#        FAMILIES="torch-joint" scripts/corpus/make_corpus.sh llama   (one family only)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
FAMILIES=${FAMILIES:-"ort-training torch-joint"}
mkdir -p build/corpus corpus

mkvenv() {  # dir, requirements file
    local dir=$1 req=$2 want
    want=$(sha256sum "$req" | cut -d' ' -f1)
    if [[ -f $dir/.installed && "$(cat "$dir/.installed")" == "$want" ]]; then return; fi
    echo "make_corpus: creating $dir" >&2
    rm -rf "$dir"
    "$PY" -m venv "$dir"
    "$dir/bin/python" -m pip install -q -r "$req"
    echo "$want" > "$dir/.installed"
}

for fam in $FAMILIES; do
    case $fam in
        ort-training) venv=build/venv-corpus-ortt; req=scripts/corpus/requirements-ortt.txt ;;
        torch-joint) venv=build/venv-corpus-torch; req=scripts/corpus/requirements-torch.txt ;;
        *) echo "make_corpus: unknown family '$fam'" >&2; exit 2 ;;
    esac
    mkvenv "$venv" "$req"
    # onnxruntime-training logs every graph transformer on stderr: keep it in build/
    "$venv/bin/python" scripts/corpus/gen.py "$fam" "$@" 2> "build/corpus/gen-$fam.log" \
        || { tail -40 "build/corpus/gen-$fam.log" >&2; exit 1; }
done
.venv/bin/python scripts/corpus/finish.py
ls -l corpus
