#!/usr/bin/env bash
# Regenerate samples/*.onnx, samples/*.params.npz and samples/manifest.yaml (`make samples`).
# Creates two generator venvs under build/ (they conflict: onnxruntime-training-cpu vs onnxruntime):
#   build/venv-gen-ortt : torch 2.13 + onnxruntime-training-cpu 1.19.2 + onnx 1.16.2 + numpy 1.26
#   build/venv-gen-torch: torch 2.13 + onnx 1.23.2 + onnxscript 0.7.2 + onnxruntime 1.31.1
# Usage: scripts/make_samples.sh [SAMPLE ...]   (default: all; names start with ortt_ or torch_)
#        scripts/make_samples.sh --bench [DIR]  benchmark-size copies of every sample into DIR
#                                               (default build/bench-samples; samples/ untouched)
#        scripts/make_samples.sh --bench DIR NAME...  only those (also the real-size models that
#                                               are built only by name, e.g. ortt_resnet50)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
GEN_ORTT=build/venv-gen-ortt
GEN_TORCH=build/venv-gen-torch
mkdir -p build/samples samples

mkvenv() {  # dir, marker-content, packages...
    local dir=$1 want=$2; shift 2
    if [[ -f $dir/.installed && "$(cat "$dir/.installed")" == "$want" ]]; then return; fi
    echo "make_samples: creating $dir" >&2
    rm -rf "$dir"
    "$PY" -m venv "$dir"
    "$dir/bin/python" -m pip install -q "$@"
    echo "$want" > "$dir/.installed"
}

ORTT_PKGS=(torch==2.13.0 onnxruntime-training-cpu==1.19.2 onnx==1.16.2 numpy==1.26.4)
TORCH_PKGS=(torch==2.13.0 onnx==1.23.2 onnxscript==0.7.2 onnxruntime==1.31.1)

if [[ ${1:-} == --bench ]]; then
    out=${2:-build/bench-samples}
    names=("${@:3}")
    ortt=() torch=()
    for n in "${names[@]}"; do
        case $n in ortt_*) ortt+=("$n") ;; torch_*) torch+=("$n") ;;
            *) echo "make_samples: unknown sample $n" >&2; exit 2 ;; esac
    done
    mkdir -p "$out"
    if (( ${#names[@]} == 0 || ${#ortt[@]} > 0 )); then
        mkvenv "$GEN_ORTT" "${ORTT_PKGS[*]}" "${ORTT_PKGS[@]}"
        "$GEN_ORTT/bin/python" scripts/samples/gen_ortt.py --bench "$out" "${ortt[@]}" \
            2> "$out/gen_ortt.log" || { tail -30 "$out/gen_ortt.log" >&2; exit 1; }
    fi
    if (( ${#names[@]} == 0 || ${#torch[@]} > 0 )); then
        mkvenv "$GEN_TORCH" "${TORCH_PKGS[*]}" "${TORCH_PKGS[@]}"
        "$GEN_TORCH/bin/python" scripts/samples/gen_torch.py --bench "$out" "${torch[@]}" \
            2> "$out/gen_torch.log" || { tail -30 "$out/gen_torch.log" >&2; exit 1; }
    fi
    exit 0
fi

ortt=(); torchj=()
for s in "$@"; do
    case $s in
        ortt_*) ortt+=("$s") ;;
        torch_*) torchj+=("$s") ;;
        *) echo "make_samples: unknown sample '$s' (expected ortt_* or torch_*)" >&2; exit 2 ;;
    esac
done
all=$(( $# == 0 ))

if (( all || ${#ortt[@]} )); then
    mkvenv "$GEN_ORTT" "${ORTT_PKGS[*]}" "${ORTT_PKGS[@]}"
    # onnxruntime-training logs every graph transformer at INFO level on stderr: keep it in build/
    "$GEN_ORTT/bin/python" scripts/samples/gen_ortt.py "${ortt[@]}" 2> build/samples/gen_ortt.log \
        || { tail -30 build/samples/gen_ortt.log >&2; exit 1; }
fi
if (( all || ${#torchj[@]} )); then
    mkvenv "$GEN_TORCH" "${TORCH_PKGS[*]}" "${TORCH_PKGS[@]}"
    "$GEN_TORCH/bin/python" scripts/samples/gen_torch.py "${torchj[@]}" 2> build/samples/gen_torch.log \
        || { tail -30 build/samples/gen_torch.log >&2; exit 1; }
fi
"$PY" scripts/samples/write_manifest.py
mkdir -p build/dumps
for f in samples/*.onnx; do
    n=$(basename "$f" .onnx)
    "$GEN_TORCH/bin/python" scripts/samples/dump_chains.py "$f" > "build/dumps/$n.txt" 2>/dev/null || true
done
ls -l samples
