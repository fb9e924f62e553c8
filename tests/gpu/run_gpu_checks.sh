#!/usr/bin/env bash
# One script for a GPU machine (needs only CUDA's compiler, torch, PyYAML, pytest and this repo; no
# network):
#   1. builds the CUDA launchers with nvcc alone into build/gpu/libfusecli_cuda.so (the same
#      fusecli/ops/*/cuda.cu that go into libfusecli_ops.so; no onnxruntime/Eigen headers
#      needed; PyYAML for the generated launcher prototypes),
#      and, when build/deps/ already holds the headers, the full library with cmake+nvcc too;
#   2. runs the op folders' GPU tests (fusecli/ops/*/test_*_gpu.py, marked gpu) against it;
#   3. times every CUDA kernel vs the unfused torch ops -> $OUT (or build/gpu)/cuda_bench.{json,md}.
# Usage: bash tests/gpu/run_gpu_checks.sh [python]   (default: python3)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${1:-python3}"
REPORT="${OUT:-$ROOT/build/gpu}"
mkdir -p build/gpu "$REPORT"
NVCC="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"

ARCH_FLAGS=(-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90
            -gencode=arch=compute_90,code=compute_90)
CC="$("$PY" -c 'import torch; p=torch.cuda.get_device_properties(0); print(f"{p.major}{p.minor}")' 2>/dev/null || true)"
if [[ -n "$CC" && "$CC" != 80 && "$CC" != 90 ]]; then
  ARCH_FLAGS+=(-gencode=arch=compute_${CC},code=sm_${CC})
fi
echo "== nvcc build (sm: 80 90 ${CC:+local $CC})"
t0=$(date +%s.%N)
# the launcher prototypes are generated from the ops' contracts (needs PyYAML in $PY)
"$PY" fusecli/csrc/gen_op_tables.py --out build/gpu/generated || { echo "op tables FAILED"; exit 1; }
"$NVCC" -O3 -std=c++17 -shared -Xcompiler -fPIC,-fvisibility=hidden -cudart static "${ARCH_FLAGS[@]}" \
  -Ifusecli/csrc -Ibuild/gpu/generated fusecli/ops/*/cuda.cu -o build/gpu/libfusecli_cuda.so \
  -ldl -lpthread -lrt || { echo "nvcc build FAILED"; exit 1; }
echo "built build/gpu/libfusecli_cuda.so in $(echo "$(date +%s.%N) - $t0" | bc 2>/dev/null || echo '?') s"
if [[ -f build/deps/onnxruntime/usr/include/onnxruntime/onnxruntime_cxx_api.h ]]; then
  echo "== full library (cmake + nvcc)"
  bash scripts/build_lib.sh || echo "full library build FAILED (launcher-only checks continue)"
fi

export FUSECLI_CUDA_LIB="$ROOT/build/gpu/libfusecli_cuda.so"
echo "== GPU tests"
"$PY" -m pytest -q -p no:cacheprovider -m gpu fusecli/ops/*/test_*_gpu.py 2>&1 | tee "$REPORT/gpu_tests.txt" | tail -25
TEST_RC=${PIPESTATUS[0]}
echo "== timings"
"$PY" tests/gpu/bench_cuda.py --out "$REPORT" 2>&1 | tail -30
BENCH_RC=${PIPESTATUS[0]}
echo "tests rc=$TEST_RC bench rc=$BENCH_RC; report in $REPORT"
exit $(( TEST_RC != 0 || BENCH_RC != 0 ))
