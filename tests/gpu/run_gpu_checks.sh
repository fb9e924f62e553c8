#!/usr/bin/env bash
# One script for a GPU machine (needs only CUDA's compiler, torch, PyYAML, pytest and this repo; no
# network). Every step runs under `timeout`; the whole script is meant to finish in a few minutes.
#   1. the launcher library: FUSECLI_CUDA_LIB (a prebuilt build/gpu/libfusecli_cuda.so, carried
#      from a CPU machine) when it names a file, else built here with nvcc alone (the same
#      fusecli/csrc/cuda_{blas,dnn}.cu + fusecli/ops/*/cuda.cu that go into libfusecli_ops.so, one nvcc
#      per file in parallel; PyYAML for the launcher prototypes); its GEMM path (cuBLAS or the
#      built-in SIMT GEMM) is printed;
#   2. the GPU tests (fusecli/ops/*/test_*_gpu.py and tests/gpu/test_*_gpu.py, marked gpu);
#   3. compute-sanitizer memcheck and racecheck, once each, over the first case of every GPU test
#      (tests/gpu/sanitize_launchers.py: every launcher of the contracts called at least once);
#   4. the benchmark (tests/gpu/bench_cuda.py) -> cuda_bench.{json,md}.
# Logs and results go to $OUT (else build/gpu/report), 8 files: summary.txt (environment, GEMM
# path, the summary table), build.log, gpu_tests.txt, sanitizer_{memcheck,racecheck}.txt,
# bench.log, cuda_bench.{json,md}. A summary table is
# printed last. Usage: bash tests/gpu/run_gpu_checks.sh [python]   (default: python3)
#   FUSECLI_GPU_STEPS="build tests sanitize bench" (default: all) runs a subset.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${1:-python3}"
REPORT="${OUT:-$ROOT/build/gpu/report}"
STEPS="${FUSECLI_GPU_STEPS:-build tests sanitize bench}"
mkdir -p build/gpu "$REPORT"
NVCC="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
SUMMARY=()
T_START=$(date +%s)
step() {  # step NAME RC SECONDS NOTE
  SUMMARY+=("$(printf '| %-10s | %-4s | %5s s | %s |' "$1" "$( [[ $2 == 0 ]] && echo ok || echo "FAIL($2)")" "$3" "$4")")
}
has_step() { [[ " $STEPS " == *" $1 "* ]]; }

{ echo "date: $(date -u)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
  "$NVCC" --version 2>&1 | tail -2
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>&1
  "$PY" -c 'import xdist; print("pytest-xdist", xdist.__version__)' 2>&1 | tail -1
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"; } > "$REPORT/summary.txt" 2>&1
cat "$REPORT/summary.txt"

# ---- 1. the launcher library -----------------------------------------------------------------
LIB_NOTE=""
if [[ -n "${FUSECLI_CUDA_LIB:-}" && -f "${FUSECLI_CUDA_LIB}" ]]; then
  LIB="$(cd "$(dirname "$FUSECLI_CUDA_LIB")" && pwd)/$(basename "$FUSECLI_CUDA_LIB")"
  echo "== prebuilt launcher library $LIB (FUSECLI_CUDA_LIB)"
  step build 0 0 "prebuilt $LIB"
elif has_step build; then
  LIB="$ROOT/build/gpu/libfusecli_cuda.so"
  CC="$("$PY" -c 'import torch; p=torch.cuda.get_device_properties(0); print(f"{p.major}{p.minor}")' 2>/dev/null || true)"
  ARCH="-gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90"
  [[ -n "$CC" && "$CC" != 90 ]] && ARCH="$ARCH -gencode=arch=compute_${CC},code=sm_${CC}"
  echo "== nvcc build (sm_90${CC:+, device sm_$CC})"
  t0=$(date +%s)
  rm -rf build/gpu/obj && mkdir -p build/gpu/obj
  {
    "$PY" fusecli/csrc/gen_op_tables.py --out build/gpu/generated &&
    ls fusecli/csrc/cuda_*.cu fusecli/ops/*/cuda.cu | \
      xargs -P "$(nproc)" -I{} sh -c 'o=build/gpu/obj/$(echo "{}" | tr / _).o; '"timeout 300 $NVCC"' -O3 -std=c++17 -c -Xcompiler -fPIC,-fvisibility=hidden '"$ARCH"' -Ifusecli/csrc -Ibuild/gpu/generated "{}" -o "$o" || { echo "nvcc FAILED on {}"; exit 255; }' &&
    timeout 120 "$NVCC" -shared -cudart static $ARCH build/gpu/obj/*.o -o "$LIB" -ldl -lpthread -lrt
  } > "$REPORT/build.log" 2>&1
  rc=$?
  tail -5 "$REPORT/build.log"
  step build $rc $(( $(date +%s) - t0 )) "nvcc -> $LIB"
  if [[ $rc != 0 ]]; then
    echo "BUILD FAILED: see $REPORT/build.log"; printf '%s\n' "${SUMMARY[@]}"; exit 1
  fi
else
  LIB="$ROOT/build/gpu/libfusecli_cuda.so"
fi
export FUSECLI_CUDA_LIB="$LIB"
# which GEMM / convolution path the launchers take in a torch process (torch loaded cuBLAS/cuDNN)
GEMM_PATH="$(FUSECLI_QUIET_GEMM=1 timeout 60 "$PY" -c '
import ctypes, sys
import torch
torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")
lib = ctypes.CDLL(sys.argv[1])
paths = []
for name in ("fusecli_gemm_path", "fusecli_conv_path"):
    f = getattr(lib, name, None)
    if f is not None:
        f.restype = ctypes.c_char_p
        paths.append(f().decode())
print("; ".join(paths) or "unknown (library without fusecli_gemm_path)")' "$LIB" 2>&1 | tail -1)"
echo "GEMM path: $GEMM_PATH"
echo "GEMM path (launcher library alone): $GEMM_PATH" >> "$REPORT/summary.txt"

# ---- 2. the GPU tests ---------------------------------------------------------------------------
if has_step tests; then
  echo "== GPU tests"
  t0=$(date +%s)
  XDIST=()
  "$PY" -c 'import xdist' 2>/dev/null && XDIST=(-n 8)
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m gpu -rfE \
    fusecli/ops/*/test_*_gpu.py tests/gpu/test_*_gpu.py > "$REPORT/gpu_tests.txt" 2>&1
  rc=$?
  tail -40 "$REPORT/gpu_tests.txt"
  step tests $rc $(( $(date +%s) - t0 )) "$(tail -1 "$REPORT/gpu_tests.txt" | tr -d '=|' | cut -c1-90)"
  # the GEMM / convolution ops again on the previous path (SIMT GEMM, im2col): both paths
  # are tested in one run (the path is chosen once per process, by the environment)
  t0=$(date +%s)
  echo "== GPU tests of the GEMM ops on FUSECLI_GEMM_PATH=simt" >> "$REPORT/gpu_tests.txt"
  FUSECLI_GEMM_PATH=simt timeout 300 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m gpu -rfE \
    fusecli/ops/{linear_activation_grad,lora_linear_grad,linear_cross_entropy,attention_grad,conv_bn_relu_grad}/test_*_gpu.py \
    >> "$REPORT/gpu_tests.txt" 2>&1
  rc=$?
  tail -5 "$REPORT/gpu_tests.txt"
  step tests-simt $rc $(( $(date +%s) - t0 )) "$(tail -1 "$REPORT/gpu_tests.txt" | tr -d '=|' | cut -c1-90)"
fi

# ---- 3. compute-sanitizer, once -----------------------------------------------------------------
if has_step sanitize; then
  SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    if [[ -z "$SAN" ]]; then
      echo "compute-sanitizer not found" > "$REPORT/sanitizer_$tool.txt"; step "$tool" 127 0 "no compute-sanitizer"; continue
    fi
    echo "== compute-sanitizer --tool $tool"
    # cuBLAS's own kernels are not ours to check: only kernels named fusecli's (anonymous
    # namespace kernels of the op files) would be filtered by name; all are checked here
    timeout 200 "$SAN" --tool "$tool" --error-exitcode 9 --print-limit 20 \
      "$PY" tests/gpu/sanitize_launchers.py > "$REPORT/sanitizer_$tool.txt" 2>&1
    rc=$?
    tail -6 "$REPORT/sanitizer_$tool.txt"
    step "$tool" $rc $(( $(date +%s) - t0 )) "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$REPORT/sanitizer_$tool.txt" | tail -1 | cut -c1-80)"
  done
fi

# ---- 4. the benchmark ---------------------------------------------------------------------------
if has_step bench; then
  echo "== benchmark"
  t0=$(date +%s)
  timeout 240 "$PY" tests/gpu/bench_cuda.py --out "$REPORT" > "$REPORT/bench.log" 2>&1
  rc=$?
  tail -30 "$REPORT/bench.log"
  step bench $rc $(( $(date +%s) - t0 )) "$REPORT/cuda_bench.md"
fi

echo
echo "== summary ($(( $(date +%s) - T_START )) s; GEMM path: $GEMM_PATH; logs in $REPORT)"
{ echo; echo "| step       | rc   | time    | note |"; echo "|---|---|---|---|"; } | tee -a "$REPORT/summary.txt"
printf '%s\n' "${SUMMARY[@]}" | tee -a "$REPORT/summary.txt"
fail=0
for line in "${SUMMARY[@]}"; do [[ "$line" == *FAIL* ]] && fail=1; done
exit $fail
